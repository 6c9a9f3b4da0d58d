"""Model-level tests beyond the generic model suite (tests/suites.py ModelSuite, run for
every attention by tests/test_generic.py): every position scheme decodes, decoding states
have fixed size, generation and sampling."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from conftest import assert_close
from suites import TINY, decode_all, forward, tokens
from suites import model_config as config

import jxformers
from jxformers import build_model


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
    out = eqx.filter_jit(lambda m, p: jxformers.generate(m, p, 9, key=jax.random.key(0), temperature=0.0))(
        model, prompt
    )
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
