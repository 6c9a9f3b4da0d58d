"""`attention.d_head`: each head's size decoupled from d_model / num_heads (Bhojanapalli et
al. 2020, "Low-Rank Bottleneck in Multi-head Attention Models", arXiv 2002.07028: heads of
size d_p >= n remove the rank bottleneck of d_model / heads), against numpy, in a model
with rotary positions and decoding, and its checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import decode_all, forward

from jxformers.nn import Attention, ModelConfig, build_model


def test_heads_of_any_size_are_scaled_by_their_own_size():
    d_model, heads, d_head = 16, 2, 24  # 2 x 24 = 48 != 16
    attention = Attention("softmax", d_model, heads, d_head=d_head, key=jax.random.key(0))
    assert attention.q_proj.weight.shape == (heads * d_head, d_model)
    assert attention.o_proj.weight.shape == (d_model, heads * d_head)
    x = jax.random.normal(jax.random.key(1), (7, d_model))
    xs = np.asarray(x, np.float64)

    def proj(linear):
        w, b = np.asarray(linear.weight, np.float64), np.asarray(linear.bias, np.float64)
        return (xs @ w.T + b).reshape(7, heads, d_head)

    q, k, v = proj(attention.q_proj), proj(attention.k_proj), proj(attention.v_proj)
    out = np.zeros_like(q)
    for h in range(heads):
        s = q[:, h] @ k[:, h].T / math.sqrt(d_head)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = p / p.sum(-1, keepdims=True) @ v[:, h]
    w, b = np.asarray(attention.o_proj.weight, np.float64), np.asarray(attention.o_proj.bias, np.float64)
    np.testing.assert_allclose(np.asarray(attention(x)), out.reshape(7, -1) @ w.T + b, atol=2e-5)


def test_a_config_sets_the_head_size_and_the_model_decodes():
    config = ModelConfig(
        task="lm",
        vocab_size=13,
        num_layers=2,
        d_model=16,
        num_heads=2,
        max_len=12,
        embedding={"position": "rope"},
        attention={"name": "softmax", "d_head": 12},
        stack={"kind": "transformer", "layer_overrides": {1: {"attention": {"name": "local", "window": 3}}}},
    )
    assert ModelConfig.from_dict(config.to_dict()) == config
    model = build_model(config, key=jax.random.key(2))
    assert [b.attention.d_head for b in model.blocks] == [12, 8]  # the override has its own (default) size
    tokens = jnp.arange(12) % 13
    logits = forward(model, tokens)
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(logits), atol=2e-4)


def test_bad_head_sizes_are_refused_at_config_time():
    with pytest.raises(ValueError, match="attention.d_head must be >= 1"):
        ModelConfig(task="lm", vocab_size=13, max_len=8, attention={"name": "softmax", "d_head": 0})
    with pytest.raises(ValueError, match="needs an even head size; block 0's attention's is 7"):
        ModelConfig(
            task="lm",
            vocab_size=13,
            max_len=8,
            embedding={"position": "rope"},
            attention={"name": "softmax", "d_head": 7},
        )
