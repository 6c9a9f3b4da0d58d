"""QK-norm in the attention module (`attention.qk_norm`): QKNorm's unit queries and keys
with a learned scale g (Henry et al. 2020) and ViT-22B's LayerNorm on q and k (Dehghani
et al. 2023), against numpy; with rotary positions, another core, decoding, and the
config."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import decode_all, forward_and_grad

from jxformers.nn import Attention, ModelConfig, build_model, trainable

D_MODEL, HEADS = 16, 2


def projections(attention, x):
    """q, k, v per head `[n, heads, d]` in numpy, before any normalisation."""
    d = attention.d_head

    def proj(linear, heads):
        w, b = np.asarray(linear.weight, np.float64), np.asarray(linear.bias, np.float64)
        return (np.asarray(x, np.float64) @ w.T + b).reshape(len(x), heads, d)

    return proj(attention.q_proj, HEADS), proj(attention.k_proj, HEADS), proj(attention.v_proj, HEADS)


def attend(attention, x, q, k, v, scale, causal=False):
    n = len(x)
    out = np.zeros_like(q)
    for h in range(HEADS):
        s = scale * q[:, h] @ k[:, h].T
        if causal:
            s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h]
    w, b = np.asarray(attention.o_proj.weight, np.float64), np.asarray(attention.o_proj.bias, np.float64)
    return out.reshape(n, -1) @ w.T + b


@pytest.mark.parametrize("causal", [False, True])
def test_l2_is_g_times_the_cosine_of_unit_queries_and_keys(causal):
    attention = Attention(
        "softmax", D_MODEL, HEADS, causal=causal, qk_norm="l2", qk_norm_length=10, key=jax.random.key(0)
    )
    g = math.log2(10**2 - 10)  # Henry et al.: g0 = log2(L^2 - L)
    assert float(attention.qk_scale) == pytest.approx(g)
    x = jax.random.normal(jax.random.key(1), (7, D_MODEL))
    q, k, v = projections(attention, x)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    expected = attend(attention, x, unit(q), unit(k), v, g, causal)
    np.testing.assert_allclose(np.asarray(attention(x)), expected, atol=2e-5)
    # the logits no longer depend on the projections' scale: only on directions
    louder = eqx.tree_at(
        lambda a: (a.q_proj.weight, a.q_proj.bias), attention, (3 * attention.q_proj.weight, 3 * attention.q_proj.bias)
    )
    np.testing.assert_allclose(np.asarray(louder(x)), np.asarray(attention(x)), atol=2e-5)
    without = Attention("softmax", D_MODEL, HEADS, causal=causal, key=jax.random.key(0))
    assert not np.allclose(np.asarray(without(x)), expected, atol=1e-3)


def test_layernorm_normalises_each_heads_queries_and_keys_with_learned_gains():
    attention = Attention("softmax", D_MODEL, HEADS, qk_norm="layernorm", key=jax.random.key(2))
    gains = jnp.linspace(0.5, 1.5, attention.d_head)
    attention = eqx.tree_at(lambda a: (a.q_norm.weight, a.k_norm.bias), attention, (gains, 0.1 * gains))
    x = jax.random.normal(jax.random.key(3), (6, D_MODEL))
    q, k, v = projections(attention, x)

    def layer_norm(a, weight, bias):
        mean = a.mean(-1, keepdims=True)
        var = ((a - mean) ** 2).mean(-1, keepdims=True)
        return (a - mean) / np.sqrt(var + 1e-6) * np.asarray(weight) + np.asarray(bias)

    qn = layer_norm(q, attention.q_norm.weight, attention.q_norm.bias)
    kn = layer_norm(k, attention.k_norm.weight, attention.k_norm.bias)
    expected = attend(attention, x, qn, kn, v, 1 / math.sqrt(attention.d_head))
    np.testing.assert_allclose(np.asarray(attention(x)), expected, atol=2e-5)
    mask = trainable(attention)
    assert mask.q_norm.weight and mask.k_norm.bias  # learned


@pytest.mark.parametrize("qk_norm", ["l2", "layernorm"])
@pytest.mark.parametrize("name", ["softmax", "performer"])
def test_a_language_model_with_qk_norm_decodes_like_its_parallel_forward(qk_norm, name):
    config = ModelConfig(
        task="lm",
        vocab_size=19,
        num_layers=2,
        d_model=D_MODEL,
        num_heads=HEADS,
        max_len=12,
        embedding={"position": "rope"},
        attention={"name": name, "qk_norm": qk_norm},
    )
    model = build_model(config, key=jax.random.key(4))
    tokens = jnp.arange(12) % 19
    logits, grads = forward_and_grad(model, tokens)
    assert bool(jnp.all(jnp.isfinite(logits)))
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(logits), atol=2e-4)
    learned = grads.blocks[0].attention.qk_scale if qk_norm == "l2" else grads.blocks[0].attention.q_norm.weight
    assert float(jnp.abs(learned).sum()) > 0


def test_qk_norm_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="'fnet' never compares"):
        ModelConfig(task="classify", vocab_size=11, max_len=8, attention={"name": "fnet", "qk_norm": "l2"})
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig(task="classify", vocab_size=11, max_len=8, attention={"name": "softmax", "qk_norm": "rms"})
    with pytest.raises(ValueError, match="builds its own softmax attentions"):
        ModelConfig(
            task="classify",
            vocab_size=11,
            max_len=8,
            stack={"kind": "isab", "num_inducing": 4},
            embedding={"position": "none"},
            attention={"name": "softmax", "qk_norm": "l2"},
        )
    with pytest.raises(ValueError, match="qk_norm_length >= 2"):
        Attention("softmax", D_MODEL, HEADS, qk_norm="l2", key=jax.random.key(0))


def test_the_config_round_trips_and_the_cross_attention_has_its_own():
    config = ModelConfig(
        task="seq2seq",
        vocab_size=11,
        max_len=8,
        attention={"name": "softmax", "qk_norm": "layernorm", "softcap": 30.0},
        decoder={"num_layers": 1, "cross_attention": {"name": "softmax", "qk_norm": "l2"}},
    )
    assert config.attention.to_value() == {
        "name": "softmax",
        "softcap": 30.0,
        "impl": "auto",
        "qk_norm": "layernorm",
        "d_head": None,
        "collaborative": None,
        "disagreement": [],
        "disagreement_weight": 1.0,
        "head_aggregation": "concat",
        "routing_iterations": 3,
        "aan": False,
        "aan_ffn": True,
        "projection": "dense",
        "modules": None,
        "conv_length": 3,
        "conv_modules": 3,
        "output_projection": "dense",
    }
    assert ModelConfig.from_dict(config.to_dict()) == config  # the YAML form keeps both
    model = build_model(config, key=jax.random.key(5))
    assert model.encoder.blocks[0].attention.qk_norm == "layernorm"
    assert model.decoder.blocks[0].attention.qk_norm == "layernorm"
    assert model.decoder.blocks[0].cross_attention.qk_norm == "l2"
