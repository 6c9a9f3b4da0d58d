"""Average attention (Zhang, Xiong & Su 2018, "Accelerating Neural Transformer via an
Average Attention Network", arXiv 1805.00631): the op `average` (eq. 1's cumulative
average) and the attention module's setting `aan` (eq. 1-3: the FFN and gating layer
around the average of the layer input itself; eq. 4 is the post-norm Block), against a
numpy reference written from the paper; decoding with its O(1) running sum; config."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close

from jxformers import ModelConfig, build_model, nn, registry
from jxformers.nn.attention import Attention
from jxformers.nn.blocks import Block
from jxformers.nn.layers import FeedForward

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

D, D_FF = 8, 12


def cumulative_average(x: np.ndarray, real: np.ndarray | None = None, causal: bool = True) -> np.ndarray:
    """(1/|K_j|) sum_{k in K_j} x_k over the real positions k <= j (all real k when not causal)."""
    n = x.shape[0]
    real = np.ones(n, bool) if real is None else real
    out = np.zeros_like(x, dtype=np.float64)
    for j in range(n):
        keys = [k for k in range(n) if real[k] and (k <= j or not causal)]
        if keys:
            out[j] = np.mean(x[keys].astype(np.float64), axis=0)
    return out


def relu_ffn(ffn: FeedForward, x: np.ndarray) -> np.ndarray:
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Vaswani et al. 2017)."""
    w1, b1, w2, b2 = (
        np.asarray(a, np.float64) for a in (ffn.w_in.weight, ffn.w_in.bias, ffn.w_out.weight, ffn.w_out.bias)
    )
    return np.maximum(x @ w1.T + b1, 0) @ w2.T + b2


def aan_reference(attention: Attention, y: np.ndarray, real=None, causal=True) -> np.ndarray:
    """Eq. 1-3: g_j = FFN(avg_{k<=j} y_k); i_j, f_j = sigmoid(W [y_j; g_j]); i_j y_j + f_j g_j."""
    aan = attention.aan
    assert aan is not None
    average = cumulative_average(y, real, causal)
    g = average if aan.ffn is None else relu_ffn(aan.ffn, average)  # eq. 1 (or the authors' variant without it)
    w, b = np.asarray(aan.gate.weight, np.float64), np.asarray(aan.gate.bias, np.float64)
    gates = 1 / (1 + np.exp(-(np.concatenate([y, g], -1) @ w.T + b)))  # eq. 2, with the authors' bias
    i, f = gates[:, :D], gates[:, D:]
    return i * y + f * g  # eq. 3


def layer_norm(x: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def aan(causal=True, seed=0) -> Attention:
    return Attention("average", D, 2, causal=causal, aan_d_ff=D_FF, key=jax.random.key(seed))


def lm_config(**extra) -> ModelConfig:
    # one layer: decoding parity and the gradients are each layer's own
    fields = dict(task="lm", vocab_size=13, d_model=D, num_heads=2, num_layers=1, max_len=32, ffn={"d_ff": D_FF})
    return ModelConfig(attention={"name": "average", "aan": True}, **fields | extra)


# ----------------------------------------------------------------------------- the op


@pytest.mark.parametrize("causal", [True, False])
def test_op_is_the_cumulative_average_of_the_values_per_kv_head(causal):
    n, heads, kv_heads = 9, 4, 2
    q, k = (jax.random.normal(jax.random.key(i), (n, heads // (i + 1), 3)) for i in range(2))
    v = jax.random.normal(jax.random.key(2), (n, kv_heads, 5))
    real = np.arange(n) < 7
    for mask in (None, real):
        out = np.asarray(
            ops.average_attention(q, k, v, causal=causal, kv_mask=None if mask is None else jnp.asarray(mask))
        )
        for h in range(heads):  # query head h reads kv head h // 2
            np.testing.assert_allclose(out[:, h], cumulative_average(np.asarray(v[:, h // 2]), mask, causal), atol=1e-6)
    # The weights are 1/j, not those of any query-key product: other queries and keys change nothing.
    assert_close(ops.average_attention(q * 0, k * 5, v, causal=causal), ops.average_attention(q, k, v, causal=causal))
    if causal:  # a test that can fail: the cumulative average is not the plain one
        assert not np.allclose(out[:, 0], cumulative_average(np.asarray(v[:, 0]), real, causal=False))


def test_decoding_keeps_a_running_sum_whose_size_does_not_grow_with_max_len():
    bound = registry.bind("average")
    states = [bound.init_state(max_len=m, kv_heads=2, d_k=3, d_v=5) for m in (4, 4096)]
    assert jax.tree.map(jnp.shape, states[0]) == jax.tree.map(jnp.shape, states[1])
    assert [x.size for x in jax.tree.leaves(states[1])] == [2 * 5, 2, 2, 1]  # sum, count, (scale), length
    assert registry.get("average").decoder.kind == "recurrent"


# ----------------------------------------------------------------------------- the network


@pytest.mark.parametrize("causal", [True, False])
def test_aan_layer_follows_eq_1_to_3_with_padding(causal):
    attention = aan(causal)
    # the gate's bias away from its start, so that the reference checks it
    bias = jax.random.normal(jax.random.key(8), attention.aan.gate.bias.shape)
    attention = eqx.tree_at(lambda a: a.aan.gate.bias, attention, bias)
    assert (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj) == (None,) * 4
    y = jax.random.normal(jax.random.key(3), (7, D))
    assert_close(attention(y), aan_reference(attention, np.asarray(y), causal=causal), atol=1e-5)
    # Padding: the padded positions (NaN here) leave the real ones as the reference says.
    real = np.arange(7) < 5
    padded = y.at[5:].set(jnp.nan)
    out = attention(padded, kv_mask=jnp.asarray(real))
    assert_close(out[:5], aan_reference(attention, np.asarray(y), real, causal)[:5], atol=1e-5)
    # A test that can fail: the gates' halves swapped (i <-> f) give another output.
    swapped = eqx.tree_at(lambda a: a.aan.gate.weight, attention, jnp.roll(attention.aan.gate.weight, D, axis=0))
    assert not np.allclose(np.asarray(swapped(y)), aan_reference(attention, np.asarray(y), causal=causal), atol=1e-3)


def test_the_variant_without_the_ffn_gates_the_average_itself():
    """The authors' code has `use_ffn` and their README recommends it off: g_j is then the
    average itself (`attention.aan_ffn: false`)."""
    fields = dict(task="lm", vocab_size=13, d_model=D, num_heads=2, num_layers=1, max_len=32)
    config = ModelConfig(attention={"name": "average", "aan": True, "aan_ffn": False}, **fields)
    attention = build_model(config, key=jax.random.key(6)).blocks[0].attention
    assert attention.aan is not None and attention.aan.ffn is None
    y = jax.random.normal(jax.random.key(7), (7, D))
    assert_close(attention(y), aan_reference(attention, np.asarray(y)), atol=1e-5)
    with pytest.raises(ValueError, match="aan_ffn: false drops the average attention network's FFN; set aan: true"):
        ModelConfig(attention={"name": "average", "aan_ffn": False}, **fields)


def test_post_norm_block_adds_the_residual_and_layer_norm_of_eq_4():
    attention = aan()
    ffn = FeedForward(D, D_FF, "relu", key=jax.random.key(4))
    block = Block(attention, ffn, d_model=D, pre_norm=False)
    y = np.asarray(jax.random.normal(jax.random.key(5), (6, D)))
    h = layer_norm(y + aan_reference(attention, y))  # eq. 4
    expected = layer_norm(h + relu_ffn(ffn, h))  # then the decoder's FFN sublayer (post-norm)
    assert_close(block(jnp.asarray(y)), expected, atol=1e-5)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_language_model_decodes_token_by_token_as_its_parallel_forward(placement):
    model = build_model(lm_config(norm={"placement": placement}), key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (11,), 0, 13)

    @eqx.filter_jit
    def decode(model, x):
        def step(state, token):
            logits, state = model.decode_step(token, state)
            return state, logits

        return jax.lax.scan(step, model.init_decode_state(32), x)

    state, logits = decode(model, x)
    forward = eqx.filter_jit(lambda m, x: m(x))
    assert_close(logits, forward(model, x), atol=3e-5, rtol=1e-4)
    # O(1) state: a running sum of d_model per layer, the same for 32 tokens and 100000.
    layer = model.blocks[0].attention
    big = jax.eval_shape(lambda: layer.init_decode_state(100_000))
    assert jax.tree.map(jnp.shape, big) == jax.tree.map(jnp.shape, state["layers"][0])
    assert state["layers"][0].s.shape == (1, 1, D)
    # Causal: changing later tokens leaves earlier logits alone.
    changed = forward(model, x.at[6:].set(0))
    assert_close(changed[:6], logits[:6], atol=3e-5, rtol=1e-4)


def test_gradients_reach_the_ffn_and_the_gate_under_jit():
    model = build_model(lm_config(), key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(2), (9,), 0, 13)
    params, rest = eqx.partition(model, nn.trainable(model))

    @jax.jit
    def grad(params):
        return jax.grad(lambda p: jnp.mean(jnp.square(eqx.combine(p, rest)(x))))(params)

    g = grad(params).blocks[0].attention.aan
    for leaf in (g.ffn.w_in.weight, g.ffn.w_out.weight, g.gate.weight):
        assert bool(jnp.all(jnp.isfinite(leaf))) and float(jnp.abs(leaf).max()) > 0


def test_encoder_aan_is_the_global_average_and_padding_never_leaks():
    config = ModelConfig(
        task="classify", vocab_size=13, num_classes=2, d_model=D, num_heads=2, num_layers=1, max_len=16,
        attention={"name": "average", "aan": True}, ffn={"d_ff": D_FF},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(0))
    assert not model.encoder.blocks[0].attention.causal
    x = jax.random.randint(jax.random.key(3), (10,), 0, 13)
    mask = jnp.arange(10) < 7
    forward = eqx.filter_jit(model)  # compiled once for both calls, not op by op
    assert_close(forward(x, mask), forward(jnp.where(mask, x, 1), mask), atol=1e-5)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("attention", "word"),
    [
        ({"name": "softmax", "aan": True}, "'average'"),
        ({"name": "average", "aan": True, "d_head": 4}, "d_head"),
        ({"name": "average", "aan": True, "disagreement": ["output"]}, "disagreement"),
        ({"name": "average", "aan": True, "head_aggregation": "routing"}, "head_aggregation"),
        ({"name": "average", "aan": True, "qk_norm": "l2"}, "qk_norm"),
    ],
)
def test_config_refuses_what_the_network_cannot_take(attention, word):
    with pytest.raises(ValueError, match=word):
        ModelConfig(task="lm", vocab_size=5, d_model=D, num_heads=2, attention=attention)


def test_hand_built_module_refuses_other_attentions_and_cross_attention():
    with pytest.raises(ValueError, match="got attention 'softmax'"):
        Attention("softmax", D, 2, aan_d_ff=D_FF, key=jax.random.key(0))
    with pytest.raises(ValueError, match="context"):
        Attention("average", D, 2, cross=True, aan_d_ff=D_FF, key=jax.random.key(0))
    with pytest.raises(ValueError, match="cross"):  # the op is self-attention only
        ModelConfig(task="seq2seq", vocab_size=5, d_model=D, num_heads=2, decoder={"cross_attention": "average"})


def test_yaml_and_set_reach_the_setting():
    text = "task: lm\nvocab_size: 5\nd_model: 8\nnum_heads: 2\nattention: {name: average, aan: true}\n"
    config = ModelConfig.from_yaml(text)
    assert config.attention.aan and config.attention.to_value()["aan"] is True
    assert ModelConfig.from_dict(config.to_dict()) == config
    from jxformers.train.experiment import load_experiment

    experiment = load_experiment("copy", ["preset=tiny", "model.attention=average", "model.attention.aan=true"])
    assert experiment.model.attention.name == "average" and experiment.model.attention.aan is True
