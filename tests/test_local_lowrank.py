"""The Long-Short Transformer's attention (jxformers/ops/local_lowrank.py) beyond the
generic suite: against a numpy reference written from the paper (bidirectional and
causal, with padding), its projection's reach and its two LayerNorms. Small shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, jitted_call, qkv

from jxformers import registry

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


def arrays_for(name, seed=1, heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V, **hp):
    return registry.bind(name, **hp).init_arrays(jax.random.key(seed), heads=heads, kv_heads=kv_heads, d_k=d_k, d_v=d_v)


def layer_norm_np(x, params):
    """LayerNorm of each token over its heads and features together (DualLN), numpy."""
    mean = x.mean(axis=(-2, -1), keepdims=True)
    var = ((x - mean) ** 2).mean(axis=(-2, -1), keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * params[0] + params[1]


def softmax_np(s, real):
    s = np.where(real, s, -np.inf)
    if not real.any():
        return np.zeros_like(s)
    e = np.where(real, np.exp(s - s[real].max()), 0.0)
    return e / e.sum()


def long_short_np(q, k, v, arrays, *, window, segment_size, causal, kv_mask=None):
    """Transformer-LS from the paper, one query and one head at a time (numpy, float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    a = {name: np.asarray(x, np.float64) for name, x in arrays.items()}
    n, heads, d = q.shape
    group = heads // k.shape[1]
    real = np.ones(n, bool) if kv_mask is None else np.asarray(kv_mask)
    k_local, v_local = layer_norm_np(k, a["ln_local_k"]), layer_norm_np(v, a["ln_local_v"])
    rank = a["proj_w"].shape[-1]

    def project(lo, hi):  # P = softmax over the real positions of [lo, hi) of K W_P; -> K_bar, V_bar [rank, h, d]
        idx = np.arange(lo, min(hi, n))
        scores = np.einsum("lhd,hdr->lhr", k[idx], a["proj_w"])
        p = np.stack(
            [np.stack([softmax_np(scores[:, h, r], real[idx]) for r in range(rank)], 1) for h in range(k.shape[1])], 1
        )  # [l, h, r]
        kbar, vbar = np.einsum("lhr,lhd->rhd", p, k[idx]), np.einsum("lhr,lhd->rhd", p, v[idx])
        return layer_norm_np(kbar, a["ln_proj_k"]), layer_norm_np(vbar, a["ln_proj_v"]), real[idx].any()

    if not causal:
        whole = project(0, n)
    out = np.zeros((n, heads, v.shape[-1]))
    for i in range(n):
        j = np.arange(n)
        if causal:
            near = real & (j <= i) & (j > i - window)
            far = [project(c * segment_size, (c + 1) * segment_size) for c in range(i // segment_size)]
        else:
            start = (i // window) * window
            near = real & (j >= start - window // 2) & (j < start + window + window // 2)
            far = [whole]
        for hq in range(heads):
            h = hq // group
            keys = [k_local[near, h]] + [kb[:, h] for kb, _, ok in far if ok]
            values = [v_local[near, h]] + [vb[:, h] for _, vb, ok in far if ok]
            keys, values = np.concatenate(keys), np.concatenate(values)
            if len(keys) == 0:
                continue
            p = softmax_np(keys @ q[i, hq] / np.sqrt(d), np.ones(len(keys), bool))
            out[i, hq] = p @ values
    return out


def random_arrays(name, seed=7, **hp):
    """The attention's arrays with every entry random (LayerNorm gains and biases too)."""
    made = arrays_for(name, **hp)
    keys = jax.random.split(jax.random.key(seed), len(made))
    return {n: x + 0.3 * jax.random.normal(kk, x.shape) for kk, (n, x) in zip(keys, sorted(made.items()), strict=True)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n, hp", [(19, dict(window=4, segment_size=5, rank=3)), (16, dict(window=6, segment_size=4, rank=2))]
)
def test_long_short_equals_the_papers_formula(causal, n, hp):
    q, k, v = qkv(8, n)
    arrays = random_arrays("long_short", rank=hp["rank"])
    kv_mask = jnp.arange(n) < n - 3
    out = call(
        ops.long_short_attention,
        q,
        k,
        v,
        window=hp["window"],
        segment_size=hp["segment_size"],
        causal=causal,
        kv_mask=kv_mask,
        **arrays,
    )
    expected = long_short_np(
        q, k, v, arrays, window=hp["window"], segment_size=hp["segment_size"], causal=causal, kv_mask=kv_mask
    )
    assert_close(out[: n - 3], expected[: n - 3], atol=2e-5, rtol=1e-4)


def test_long_short_projection_reaches_beyond_the_window_and_dual_ln_matters():
    n = 24
    q, k, v = qkv(9, n)
    hp = dict(window=4, segment_size=4)
    arrays = random_arrays("long_short", rank=2)
    for causal in (False, True):
        out = call(ops.long_short_attention, q, k, v, **hp, causal=causal, **arrays)
        # Query 20 sees token 2 only through the projection: changing token 2's value moves it.
        moved = call(ops.long_short_attention, q, k, v.at[2].add(3.0), **hp, causal=causal, **arrays)
        assert float(jnp.abs(moved[20] - out[20]).max()) > 1e-3
        # The two LayerNorms are separate: changing only the projected ones' gain changes the output.
        other = arrays | {"ln_proj_k": arrays["ln_proj_k"].at[0].multiply(2.0)}
        assert float(jnp.abs(call(ops.long_short_attention, q, k, v, **hp, causal=causal, **other) - out).max()) > 1e-3


def test_long_short_needs_its_projection():
    q, k, v = qkv(0, 8)
    with pytest.raises(ValueError, match="proj_w"):
        ops.long_short_attention(q, k, v, window=4)
    with pytest.raises(ValueError, match="proj_w"):
        ops.long_short_attention(q, k, v, window=4, proj_w=jnp.zeros((2, 5, 3)))
