"""Poolingformer's two-level attention (jxformers/ops/local_pooling.py) beyond the generic
suite: against a numpy reference written from the paper (mean and max pooling, with
padding), the second level's reach, and its refusal of causal use. Small shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, jitted_call, qkv

from jxformers import ModelConfig, registry

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


def arrays_for(name, seed=1, heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V, **hp):
    return registry.bind(name, **hp).init_arrays(jax.random.key(seed), heads=heads, kv_heads=kv_heads, d_k=d_k, d_v=d_v)


def softmax_np(s, real):
    s = np.where(real, s, -np.inf)
    if not real.any():
        return np.zeros_like(s)
    e = np.where(real, np.exp(s - s[real].max()), 0.0)
    return e / e.sum()


def poolingformer_np(q, k, v, arrays, *, window, pool_window, pool_size, pool_stride, pooling, kv_mask=None):
    """Poolingformer's two levels from the paper, one query and head at a time (numpy, float64):
    y = window attention; z = attention of Y W'_Q to the pooled Y W'_K, Y W'_V slots inside
    the larger window; out = y + z."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    a = {name: np.asarray(x, np.float64) for name, x in arrays.items()}
    n, heads, d = q.shape
    group = heads // k.shape[1]
    real = np.ones(n, bool) if kv_mask is None else np.asarray(kv_mask)
    j = np.arange(n)
    y = np.zeros((n, heads, v.shape[-1]))
    for i in range(n):
        for hq in range(heads):
            p = softmax_np(k[:, hq // group] @ q[i, hq] / np.sqrt(d), real & (np.abs(i - j) <= window))
            y[i, hq] = p @ v[:, hq // group]
    flat = y.reshape(n, -1)
    q2, k2, v2 = (np.einsum("nc,chd->nhd", flat, a[name]) for name in ("level2_q", "level2_k", "level2_v"))
    starts = np.arange(0, n, pool_stride)
    slots = []  # (start, pooled key [heads, d], pooled value [heads, dv]) of slots holding a real token
    for s in starts:
        idx = np.arange(s, min(s + pool_size, n))
        idx = idx[real[idx]]
        if not len(idx):
            continue
        if pooling == "dynamic":
            # Wu et al.'s dynamic convolution as strided pooling: the kernel [heads, pool_size] is
            # a linear map of the input at the window's centre (zeros when that is padding or past
            # the end), softmax over the window's real taps, one kernel per head for keys and values.
            c = s + (pool_size - 1) // 2
            centre = flat[c] if c < n and real[c] else np.zeros(flat.shape[1])
            kernel = np.einsum("c,chs->hs", centre, a["level2_pool"])[:, idx - s]  # [heads, taps]
            e = np.exp(kernel - kernel.max(axis=1, keepdims=True))
            w = e / e.sum(axis=1, keepdims=True)
            slots.append((s, np.einsum("ht,thd->hd", w, k2[idx]), np.einsum("ht,thd->hd", w, v2[idx])))
        else:
            pool = np.mean if pooling == "mean" else np.max
            slots.append((s, pool(k2[idx], axis=0), pool(v2[idx], axis=0)))
    z = np.zeros_like(y)
    for i in range(n):
        inside = [(kk, vv) for s, kk, vv in slots if s >= i - pool_window and s + pool_size - 1 <= i + pool_window]
        if not inside:
            continue
        keys, values = np.stack([kk for kk, _ in inside]), np.stack([vv for _, vv in inside])  # [m, heads, d]
        for hq in range(heads):
            p = softmax_np(keys[:, hq] @ q2[i, hq] / np.sqrt(d), np.ones(len(inside), bool))
            z[i, hq] = p @ values[:, hq]
    return y + z


@pytest.mark.parametrize(
    "hp",
    [
        dict(window=2, pool_window=8, pool_size=3, pool_stride=2, pooling="mean"),
        dict(window=1, pool_window=20, pool_size=4, pool_stride=3, pooling="max"),
        dict(window=3, pool_window=5, pool_size=5, pool_stride=5, pooling="mean"),
        dict(window=1, pool_window=9, pool_size=4, pool_stride=2, pooling="dynamic"),
    ],
    ids=["mean", "max-wide", "kernel=stride", "dynamic"],
)
def test_poolingformer_equals_the_papers_two_levels(hp):
    n = 29
    q, k, v = qkv(10, n)
    arrays = arrays_for("poolingformer", pool_size=hp["pool_size"], pooling=hp["pooling"])
    kv_mask = jnp.arange(n) < 25
    out = call(ops.poolingformer_attention, q, k, v, **hp, kv_mask=kv_mask, **arrays)
    expected = poolingformer_np(q, k, v, arrays, **hp, kv_mask=kv_mask)
    assert_close(out[:25], expected[:25], atol=2e-5, rtol=1e-4)


def test_poolingformer_second_level_reads_the_first_levels_output_beyond_its_window():
    n = 32
    q, k, v = qkv(11, n)
    hp = dict(window=1, pool_window=12, pool_size=2, pool_stride=2)
    arrays = arrays_for("poolingformer")
    out = call(ops.poolingformer_attention, q, k, v, **hp, **arrays)
    # Token 20 is 10 away from token 10: outside level 1's window, inside level 2's.
    moved = call(ops.poolingformer_attention, q, k, v.at[20].add(5.0), **hp, **arrays)
    assert float(jnp.abs(moved[10] - out[10]).max()) > 1e-3
    # Without the second level's value projection there is only level 1: far tokens no longer matter.
    silent = arrays | {"level2_v": jnp.zeros_like(arrays["level2_v"])}
    a = call(ops.poolingformer_attention, q, k, v, **hp, **silent)
    b = call(ops.poolingformer_attention, q, k, v.at[20].add(5.0), **hp, **silent)
    assert_close(a[10], b[10], atol=1e-6)
    assert_close(a, call(ops.local_attention, q, k, v, window=1), atol=1e-5)


def test_poolingformer_refuses_causal_and_names_its_arrays():
    bound = registry.bind("poolingformer", window=2, pool_window=8, pool_size=3, pool_stride=2)
    assert not bound.spec.supports_causal
    q, k, v = qkv(0, 12)
    with pytest.raises(ValueError, match="causal"):
        bound(q, k, v, arrays=arrays_for("poolingformer"), causal=True)
    with pytest.raises(ValueError, match="causal"):
        ModelConfig(
            task="lm",
            vocab_size=11,
            num_layers=1,
            d_model=16,
            num_heads=2,
            d_ff=16,
            max_len=16,
            attention="poolingformer",
        )
    with pytest.raises(ValueError, match="level2_q"):
        ops.poolingformer_attention(q, k, v, window=2, pool_window=8)
    with pytest.raises(ValueError, match="level2_pool.*pooling='dynamic'"):  # its kernel predictor missing
        ops.poolingformer_attention(q, k, v, window=2, pool_window=8, pooling="dynamic", **arrays_for("poolingformer"))
    with pytest.raises(ValueError, match="level2_v"):
        ops.poolingformer_attention(
            q, k, v, window=2, pool_window=8, **(arrays_for("poolingformer") | {"level2_v": jnp.zeros((3, 4, 6))})
        )
