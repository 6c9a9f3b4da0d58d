"""The token mixers against their papers' formulas (numpy, written from the papers):
MLP-Mixer's token-mixing MLP (Tolstikhin et al. 2021, eq. 1) and gMLP's spatial gating
unit (Liu et al. 2021, eq. 2-3), with padding, grouped heads and gMLP's causal decoding.
The generic suite (tests/test_generic.py) checks the rest."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, qkv

from jxformers import registry
from jxformers.ops import mixers

N, MAX_LEN, HIDDEN = 12, 16, 5


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def token_mlp_reference(v, w1, b1, w2, b2, real_len):
    """Eq. 1's first line on the real positions: every channel's column through one MLP."""
    v, w1, b1, w2, b2 = (np.asarray(a, np.float64) for a in (v, w1, b1, w2, b2))
    n = real_len
    out = np.zeros(v.shape)
    for h in range(v.shape[1]):
        for c in range(v.shape[2]):
            column = v[:n, h, c]
            out[:n, h, c] = w2[:n] @ gelu_tanh(w1[:, :n] @ column + b1) + b2[:n]
    return out


def layer_norm(x, scale, bias, eps=mixers.LN_EPSILON):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def sgu_reference(v, w, b, scale, bias, real_len, causal):
    """s(Z) = Z1 * (W LN(Z2) + b) on the real positions, Z = V's channels split in halves."""
    v = np.asarray(v, np.float64)
    n = real_len
    z = v[:n].reshape(n, -1)
    half = z.shape[1] // 2
    z1, z2 = z[:, :half], z[:, half:]
    wn = np.asarray(w, np.float64)[:n, :n]
    if causal:
        wn = np.tril(wn)
    gated = z1 * (wn @ layer_norm(z2, np.asarray(scale), np.asarray(bias)) + np.asarray(b)[:n, None])
    out = np.zeros((v.shape[0], z.shape[1]))
    out[:n, :half] = gated  # the second half of the channels: zeros
    return out.reshape(v.shape)


def per_query_head(x, heads):
    return np.repeat(x, heads // x.shape[1], axis=1)


@pytest.fixture(scope="module")
def mixer_fn():
    return jax.jit(mixers.mixer_attention)


@pytest.fixture(scope="module")
def gmlp_fn():
    return jax.jit(mixers.gmlp_attention, static_argnames="causal")


def random_mixer_arrays(seed):
    arrays = mixers.mixer_arrays(jax.random.key(seed), hidden=HIDDEN, max_len=MAX_LEN)
    k1, k2 = jax.random.split(jax.random.key(seed + 1))
    return arrays | {"b1": jax.random.normal(k1, (HIDDEN,)), "b2": jax.random.normal(k2, (MAX_LEN,))}


def random_gmlp_arrays(seed, channels):
    """O(1) weights (the paper's near-zero W would hide a wrong mixing) and a non-trivial norm."""
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "spatial_w": jax.random.normal(k[0], (MAX_LEN, MAX_LEN)) / math.sqrt(MAX_LEN),
        "spatial_b": jax.random.normal(k[1], (MAX_LEN,)),
        "ln_scale": 1.0 + 0.5 * jax.random.normal(k[2], (channels // 2,)),
        "ln_bias": 0.5 * jax.random.normal(k[3], (channels // 2,)),
    }


@pytest.mark.parametrize("real_len", [N, 9])
def test_mixer_is_one_token_mlp_per_value_channel_shared_across_heads(mixer_fn, real_len):
    q, k, v = qkv(0, N)
    arrays = random_mixer_arrays(1)
    kv_mask = jnp.arange(N) < real_len
    # padding holds garbage (NaN too): the real rows must equal the unpadded sequence's
    v_bad = v.at[real_len:].set(jnp.nan)
    out = mixer_fn(q, k, v_bad, kv_mask=kv_mask, **arrays)
    ref = per_query_head(token_mlp_reference(v, *(arrays[n] for n in ("w1", "b1", "w2", "b2")), real_len), 4)
    assert_close(out[:real_len], ref[:real_len], atol=2e-5, rtol=2e-5)
    short = mixer_fn(q[:real_len], k[:real_len], v[:real_len], **arrays)
    assert_close(out[:real_len], short, atol=2e-5, rtol=2e-5)
    grads = jax.grad(lambda a: mixer_fn(q, k, v, **a).sum())(arrays)
    assert all(bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads))


def test_mixer_is_not_causal_and_refuses_a_sequence_longer_than_its_weights():
    # not causal (the paper has no causal form): the generic suite checks that a language model refuses it
    assert not registry.get("mixer").supports_causal
    q, k, v = qkv(0, MAX_LEN + 1)
    with pytest.raises(ValueError, match="max_len=16"):
        mixers.mixer_attention(q, k, v, **random_mixer_arrays(0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("real_len", [N, 8])
def test_gmlp_is_z1_times_w_layernorm_z2_plus_b(gmlp_fn, causal, real_len):
    q, k, v = qkv(2, N)
    arrays = random_gmlp_arrays(3, v.shape[1] * v.shape[2])
    kv_mask = jnp.arange(N) < real_len
    out = gmlp_fn(q, k, v.at[real_len:].set(1e4), kv_mask=kv_mask, causal=causal, **arrays)
    ref = per_query_head(sgu_reference(v, *arrays.values(), real_len, causal), 4)
    assert_close(out[:real_len], ref[:real_len], atol=3e-5, rtol=3e-5)
    assert_close(out[:, 2:], jnp.zeros_like(out[:, 2:]), atol=0)  # kv head 1 (query heads 2, 3): the zero half
    short = gmlp_fn(q[:real_len], k[:real_len], v[:real_len], causal=causal, **arrays)
    assert_close(out[:real_len], short, atol=2e-5, rtol=2e-5)


def test_gmlp_starts_as_the_identity_on_z1_and_refuses_odd_channels(gmlp_fn):
    q, k, v = qkv(4, N)
    arrays = mixers.gmlp_arrays(jax.random.key(0), kv_heads=2, d_v=6, max_len=MAX_LEN)
    assert float(jnp.max(jnp.abs(arrays["spatial_w"]))) <= mixers.SPATIAL_INIT / MAX_LEN
    assert_close(arrays["spatial_b"], jnp.ones(MAX_LEN), atol=0)
    out = gmlp_fn(q, k, v, **arrays)
    z1 = per_query_head(np.asarray(v).reshape(N, -1)[:, :6].reshape(N, 1, 6), 4)  # kv head 0 holds Z1
    assert_close(out[:, :2], z1[:, :2], atol=5e-3)
    with pytest.raises(ValueError, match="even"):
        mixers.gmlp_attention(q, k[:, :1], v[:, :1, :5], **arrays)


def test_gmlp_decodes_row_by_row_as_its_causal_forward():
    q, k, v = qkv(5, N)
    bound = registry.bind("gmlp", max_len=MAX_LEN)
    arrays = random_gmlp_arrays(6, 12)
    parallel = jax.jit(lambda q, k, v, a: bound(q, k, v, arrays=a, causal=True))(q, k, v, arrays)
    state = bound.init_state(max_len=N, kv_heads=2, d_k=8, d_v=6, arrays=arrays)

    def step(state, qkv_t):
        out, state = bound.decode_step(*qkv_t, state, arrays=arrays)
        return state, out

    decoded = jax.jit(lambda s: jax.lax.scan(step, s, (q, k, v))[1])(state)
    assert_close(decoded, parallel, atol=2e-5, rtol=2e-4)


def test_the_mixer_layer_is_the_token_mlp_on_the_layer_input():
    """Tolstikhin et al. 2021, eq. 1: U = X + W2 GELU(W1 LayerNorm(X)) over positions; in the
    attention slot (pre-norm) the layer maps the normalised input itself: no W_Q, W_K, W_V, W_O."""
    from jxformers.nn import Attention

    layer = Attention(registry.get("mixer").bind(hidden=5, max_len=6), 8, 2, key=jax.random.key(0))
    assert (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj) == (None,) * 4
    x = np.random.default_rng(4).normal(size=(6, 8)).astype(np.float32)
    a = {name: np.asarray(w) for name, w in layer.arrays.items()}
    z = a["w1"] @ x + a["b1"][:, None]  # [hidden, channels]
    gelu = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
    expected = a["w2"] @ gelu + a["b2"][:, None]
    assert_close(eqx.filter_jit(lambda m, x: m(x))(layer, jnp.asarray(x)), expected, atol=1e-4)
