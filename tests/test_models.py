"""Registry-driven model tests: for every registered attention, a tiny encoder
classifier (forward, jit, grad, padding) and, for causal ones, a tiny language model
(causality, decoding parity, generation). A new attention is covered once it has an
entry in test_generic.VARIANTS."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close
from test_generic import VARIANTS

import jxformers
from jxformers import ModelConfig, build_model, registry

SEQ = 21
TINY = dict(vocab_size=31, num_layers=2, d_model=16, num_heads=4, kv_heads=2, d_ff=24, max_len=40)


def config(name, task, **extra):
    return ModelConfig(task=task, attention=name, attention_kwargs=dict(VARIANTS[name][0]), **TINY | extra)


def tokens(seed, n=SEQ):
    return jax.random.randint(jax.random.key(seed), (n,), 0, TINY["vocab_size"])


@eqx.filter_jit
def forward(model, x, mask=None):
    return model(x, mask)


@eqx.filter_jit
def loss_grad(model, x, mask=None):
    def loss(params, rest):
        out = eqx.combine(params, rest)(x, mask)
        return jnp.mean(jnp.square(out))

    params, rest = eqx.partition(model, jxformers.nn.trainable(model))
    return jax.grad(loss)(params, rest)


def finite_grads(grads):
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    return leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)


@pytest.mark.parametrize("name", registry.names())
def test_classifier_forward_grad_and_padding(name):
    model = build_model(config(name, "classify", pooling="mean" if name == "fnet" else "cls"), key=jax.random.key(0))
    x = tokens(1)
    logits = forward(model, x)
    assert logits.shape == (2,) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    assert finite_grads(loss_grad(model, x))
    # Padding never leaks: whatever sits in padded positions, the logits are the same.
    mask = jnp.arange(SEQ) < 15
    other = jnp.where(mask, x, tokens(2))
    assert_close(forward(model, x, mask), forward(model, other, mask), atol=1e-5)
    assert finite_grads(loss_grad(model, x, mask))


@pytest.mark.parametrize("name", registry.names(supports_causal=True))
def test_language_model_is_causal_and_trains(name):
    model = build_model(config(name, "lm"), key=jax.random.key(0))
    x = tokens(3)
    logits = forward(model, x)
    assert logits.shape == (SEQ, TINY["vocab_size"])
    changed = forward(model, x.at[12:].set(tokens(4)[12:]))
    assert_close(changed[:12], logits[:12], atol=1e-5)
    assert not bool(jnp.allclose(changed[12:], logits[12:]))
    assert finite_grads(loss_grad(model, x))


@pytest.mark.parametrize("name", registry.names())
def test_language_model_needs_causal_attention(name):
    if registry.get(name).causal:
        return
    with pytest.raises(ValueError, match="causal"):
        config(name, "lm")


def decode_all(model, x):
    @eqx.filter_jit
    def run(model, x):
        def step(state, token):
            logits, state = model.decode_step(token, state)
            return state, logits

        return jax.lax.scan(step, model.init_decode_state(x.shape[0]), x)[1]

    return run(model, x)


@pytest.mark.parametrize("name", registry.names(decodes=True))
def test_decoding_parity_with_the_parallel_forward(name):
    model = build_model(config(name, "lm", position="rope"), key=jax.random.key(0))
    x = tokens(5)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("position", ["sinusoidal", "learned", "alibi", "t5"])
def test_decoding_parity_for_every_position_scheme(position):
    model = build_model(config("softmax", "lm", position=position), key=jax.random.key(1))
    x = tokens(6)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)


def test_decoding_states_have_fixed_size():
    for name, size in [("softmax", None), ("local", 4), ("linear", 0), ("performer", 0)]:
        model = build_model(config(name, "lm"), key=jax.random.key(0))
        short, long = model.init_decode_state(8), model.init_decode_state(40)
        n_short = sum(x.size for x in jax.tree.leaves(short))
        n_long = sum(x.size for x in jax.tree.leaves(long))
        if size is None:
            assert n_long > n_short  # a cache grows with max_len
        else:
            assert n_long == n_short  # ring buffer / recurrent state: constant


@pytest.mark.parametrize("name", ["softmax", "linear"])
def test_greedy_generation_matches_the_parallel_argmax(name):
    model = build_model(config(name, "lm"), key=jax.random.key(2))
    prompt = tokens(7, 5)
    out = eqx.filter_jit(lambda m, p: jxformers.generate(m, p, 9, key=jax.random.key(0), temperature=0.0))(model, prompt)
    assert out.shape == (14,) and bool(jnp.all(out[:5] == prompt))
    logits = forward(model, out)
    assert bool(jnp.all(jnp.argmax(logits[4:-1], -1) == out[5:]))
    recompute = jxformers.generate(model, prompt, 9, key=jax.random.key(0), temperature=0.0, use_cache=False)
    assert bool(jnp.all(recompute == out))
    top1 = jxformers.generate(model, prompt, 9, key=jax.random.key(3), temperature=1.0, top_k=1)
    assert bool(jnp.all(top1 == out))


def test_sampling_draws_from_the_vocabulary_and_depends_on_the_key():
    model = build_model(config("performer", "lm"), key=jax.random.key(2))
    a = jxformers.generate(model, tokens(8, 3), 20, key=jax.random.key(0), temperature=1.5)
    b = jxformers.generate(model, tokens(8, 3), 20, key=jax.random.key(1), temperature=1.5)
    assert bool(jnp.all((a >= 0) & (a < TINY["vocab_size"])))
    assert not bool(jnp.all(a == b))


def test_generate_rejects_bad_arguments():
    model = build_model(config("softmax", "lm"), key=jax.random.key(0))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="max_len"):
        jxformers.generate(model, tokens(0, 30), 20, key=key)
    with pytest.raises(ValueError, match="temperature"):
        jxformers.generate(model, tokens(0, 3), 2, key=key, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        jxformers.generate(model, tokens(0, 3), 2, key=key, top_k=0)
    lm = build_model(config("sparse_transformer", "lm"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="cannot decode"):
        lm.init_decode_state(8)
