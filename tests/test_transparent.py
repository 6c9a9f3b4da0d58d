"""Transparent attention (Bapna et al. 2018, `decoder: {transparent: true}`,
jxformers/nn/transparent.py): the combination c_j = Σ_i softmax_i(W)_{i,j} h_i against
numpy, each decoder block reading its own, decoding parity, gradients, the config's
refusals, training steps, exact resume and 8 simulated devices."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jxformers import ModelConfig, build_model
from jxformers.nn import EncoderDecoder

ENCODER, DECODER = 3, 2
CONFIG = dict(
    task="seq2seq", vocab_size=13, num_layers=ENCODER, d_model=16, num_heads=2, max_len=12,
    ffn={"d_ff": 32}, decoder={"num_layers": DECODER, "transparent": True},
)  # fmt: skip
SOURCE = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
TARGET = jnp.array([1, 2, 7, 8, 3])


def small(**over) -> EncoderDecoder:
    model = build_model(CONFIG | over, key=jax.random.key(0))
    assert isinstance(model, EncoderDecoder) and model.layer_weights is not None
    w = jax.random.normal(jax.random.key(3), model.layer_weights.shape)  # off the uniform start
    return eqx.tree_at(lambda m: m.layer_weights, model, w)


def f64(x):
    return np.asarray(x, np.float64)


def np_layernorm(v, norm, eps=1e-5):
    centred = v - v.mean(-1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * f64(norm.weight) + f64(norm.bias)


@eqx.filter_jit
def encoder_states(encoder, source, mask):
    """h_0 .. h_N by running the encoder's blocks one by one (each output through the final norm)."""
    x = encoder.embedding(source, jnp.arange(source.shape[0]))
    h = [x]
    for block in encoder.blocks:
        x = block(x, kv_mask=mask, inference=True)
        h.append(x)
    return jnp.stack([encoder.norm(v) for v in h])


@eqx.filter_jit
def decoder_logits(decoder, target, contexts, mask):
    """The decoder's logits with block j cross-attending contexts[j]."""
    y = decoder.embedding(target, jnp.arange(target.shape[0]))
    for j, block in enumerate(decoder.blocks):
        y = block(y, context=contexts[j], context_mask=mask, inference=True)
    return decoder.embedding.logits(decoder.norm(y))


def test_each_decoder_block_reads_its_own_weighted_sum_of_every_encoder_layer():
    model = small()
    mask = jnp.array([True] * 6 + [False] * 2)
    h = f64(encoder_states(model.encoder, SOURCE, mask))  # [N + 1, src, d]
    w = f64(model.layer_weights)
    s = np.exp(w) / np.exp(w).sum(0, keepdims=True)  # softmax over the encoder layers i
    c = np.stack([sum(s[i, j] * h[i] for i in range(ENCODER + 1)) for j in range(DECODER)])
    contexts, got_mask = eqx.filter_jit(lambda m: m.encode(SOURCE, mask))(model)
    np.testing.assert_allclose(np.asarray(contexts), c, rtol=1e-4, atol=1e-5)
    assert got_mask.tolist() == mask.tolist()
    # the decoder: block j cross-attends c_j
    logits = decoder_logits(model.decoder, TARGET, jnp.asarray(c, jnp.float32), mask)
    got = eqx.filter_jit(lambda m: m(SOURCE, TARGET, mask))(model)
    np.testing.assert_allclose(np.asarray(got), np.asarray(logits), rtol=1e-4, atol=1e-5)
    # with every block given the plain average instead, the logits differ: the test can fail
    average = jnp.asarray(np.stack([h.mean(0)] * DECODER), jnp.float32)
    assert float(jnp.abs(decoder_logits(model.decoder, TARGET, average, mask) - logits).max()) > 1e-3


def test_all_weight_on_the_last_layer_is_the_plain_encoder_decoder():
    model = small()
    last = jnp.full(model.layer_weights.shape, -40.0).at[-1].set(40.0)
    model = eqx.tree_at(lambda m: m.layer_weights, model, last)
    plain = EncoderDecoder(model.encoder, model.decoder)
    assert plain.layer_weights is None
    np.testing.assert_allclose(np.asarray(model(SOURCE, TARGET)), np.asarray(plain(SOURCE, TARGET)), atol=1e-5)


def test_decoding_a_conditioned_decoder_equals_the_parallel_forward():
    model = small(embedding={"position": "rope"})
    mask = jnp.array([True] * 7 + [False])
    decoder = model.conditioned(SOURCE, mask)
    state, rows = decoder.init_decode_state(6), []
    step = eqx.filter_jit(lambda d, t, s: d.decode_step(t, s))
    for token in TARGET:
        logits, state = step(decoder, token, state)
        rows.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.stack(rows)), np.asarray(model(SOURCE, TARGET, mask)), atol=1e-5)


def seq2seq_loss(model, batch, key=None):
    def one(source, target, k):
        logits = model(source, target[:-1], key=k, inference=key is None)
        return -jax.nn.log_softmax(logits)[jnp.arange(target.shape[0] - 1), target[1:]].mean()

    keys = None if key is None else jax.random.split(key, batch["source"].shape[0])
    return jax.vmap(one)(batch["source"], batch["target"], keys).mean()


def batch(rows=4):
    rng = np.random.default_rng(0)
    source = rng.integers(0, 13, (rows, 8)).astype(np.int32)
    return {"source": source, "target": np.concatenate([source[:, :1] * 0, source[:, ::-1]], 1)[:, :7]}


OPTIMIZER = optax.adamw(3e-3)


@eqx.filter_jit
def _step(params, static, opt_state, data, key):
    loss, grads = jax.value_and_grad(lambda p: seq2seq_loss(eqx.combine(p, static), data, key))(params)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads


def steps(model, count, opt_state=None, start=0):
    """(model, optimizer state, losses, last gradients) after `count` AdamW steps on one
    batch, step i's dropout key folded from i (counted from `start`)."""
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = OPTIMIZER.init(params) if opt_state is None else opt_state
    losses = []
    for i in range(start, start + count):
        params, opt_state, loss, grads = _step(params, static, opt_state, batch(), jax.random.fold_in(KEY, i))
        losses.append(float(loss))
    return eqx.combine(params, static), opt_state, losses, grads


KEY = jax.random.key(7)


def test_training_steps_lower_the_loss_with_finite_gradients_that_reach_w():
    model, _, losses, grads = steps(small(dropout=0.1), 4)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert float(jnp.abs(grads.layer_weights).min()) > 0
    assert losses[-1] < losses[0]


def test_a_resumed_run_continues_exactly(tmp_path):
    """Every array of the model (W included) is in the checkpointed state: two steps, a
    save and a load into a fresh model, two more steps are four steps, bit for bit."""
    from jxformers.train.state import TrainState, load_state_dict, split_model, state_dict

    straight, _, want, _ = steps(small(dropout=0.1), 4)
    half, opt_state, first, _ = steps(small(dropout=0.1), 2)
    params, drawn, _ = split_model(half)
    saved = TrainState(params, drawn, opt_state, jnp.asarray(2, jnp.int32), jax.random.key(0))
    np.savez(tmp_path / "state.npz", **{k: np.asarray(v) for k, v in state_dict(saved).items()})
    fresh, fresh_drawn, static = split_model(build_model(CONFIG | {"dropout": 0.1}, key=jax.random.key(9)))
    template = TrainState(fresh, fresh_drawn, OPTIMIZER.init(fresh), jnp.zeros((), jnp.int32), jax.random.key(0))
    loaded = load_state_dict(dict(np.load(tmp_path / "state.npz")), template)
    resumed, _, rest, _ = steps(loaded.model(static), 2, loaded.opt_state, start=2)
    assert first + rest == want
    assert bool(jnp.all(resumed.layer_weights == straight.layer_weights))


def test_yaml_and_refusals():
    config = ModelConfig.from_yaml("task: seq2seq\nnum_layers: 2\ndecoder: {transparent: true}\n")
    assert config.decoder.transparent
    with pytest.raises(ValueError, match="one length"):
        ModelConfig(**(CONFIG | {"stack": {"filters": {1: 0.5}}}))
    with pytest.raises(ValueError, match="decoder of task seq2seq"):
        ModelConfig(task="lm", decoder={"transparent": True})


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_with_the_losses_of_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    import equinox as eqx, optax
    from jxformers import build_model
    from jxformers.train.sharding import make_mesh, plan_sharding
    from jxformers.train.state import TrainState, split_model
    from test_transparent import CONFIG, batch, seq2seq_loss

    optimizer = optax.adamw(3e-3)
    data = batch(8)
    out = {}
    for sharded in (False, True):
        params, drawn, static = split_model(build_model(CONFIG, key=jax.random.key(0)))
        state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
        plan = plan_sharding(state, static, make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), batch_size=8)

        gathered = plan.gathered(plan.state.params) if sharded else None

        def step(state, data):
            def loss(p):
                if gathered is not None:  # as the library's train step: whole parameters in the forward
                    p = jax.lax.with_sharding_constraint(p, gathered)
                key = jax.random.fold_in(state.rng, state.step)
                return seq2seq_loss(eqx.combine(p, state.drawn, static), data, key)
            value, grads = jax.value_and_grad(loss)(state.params)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            new = TrainState(optax.apply_updates(state.params, updates), state.drawn, opt_state, state.step + 1,
                             state.rng)
            return new, value

        if sharded:
            state = plan.place_state(state)
            step = jax.jit(step, in_shardings=(plan.state, plan.batch), out_shardings=(plan.state, plan.replicated))
            feed = plan.place_batch(data)
        else:
            step, feed = jax.jit(step), data
        losses = []
        for _ in range(3):
            state, value = step(state, feed)
            losses.append(float(value))
        out[sharded] = losses, np.asarray(state.params.layer_weights)
    np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5)
    np.testing.assert_allclose(out[True][1], out[False][1], rtol=1e-4, atol=1e-6)
    assert out[True][0][-1] < out[True][0][0]
    """
    )
