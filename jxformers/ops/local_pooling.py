"""A local window, then attention over pooled keys of a larger window (Tay et al.'s
survey, Table 1: "FP + M"): Poolingformer (Zhang et al. 2021, "Poolingformer: Long
Document Modeling with Pooling Attention", arXiv 2105.04371).

    pool_keys                mean or max pooling along the length, over real tokens only
    poolingformer_attention  two levels: window, then pooled window over the first's output

The second level's projections come from `init_arrays` and are trained with the module.
Poolingformer is not causal: no decoding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import group_heads
from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    attend_parts,
    block_part,
    ceil_div,
    check_positive,
    check_self,
    default_scale,
    einsum_f32,
    neighbour_blocks,
    out_dtype,
    pad_to,
    positions,
    rows_to_output,
    to_blocks,
    valid_keys,
    zero_padded,
)
from jxformers.ops.local import local_attention
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "pool_keys",
    "poolingformer_arrays",
    "poolingformer_attention",
]

POOLINGS = ("mean", "max")


def pool_keys(
    x: Float[ArrayLike, "L h d"],
    real: Bool[ArrayLike, " L"],
    *,
    size: int,
    stride: int,
    pooling: str = "mean",
) -> tuple[Float[Array, "m h d"], Bool[Array, " m"]]:
    """Pool `x` along its length with kernel `size` and `stride`: slot m covers positions
    [m * stride, m * stride + size), its mean or max over the real ones among them
    (m < ceil(L / stride)). Returns the pooled slots and whether each holds a real position."""
    length = x.shape[0]
    slots = ceil_div(length, stride)
    idx = positions(slots)[:, None] * stride + positions(size)[None, :]  # [m, size]
    inside = idx < length
    idx = jnp.minimum(idx, length - 1)
    use = inside & jnp.asarray(real)[idx]
    xs = jnp.asarray(x).astype(jnp.float32)[idx]  # [m, size, h, d]
    count = jnp.sum(use, axis=1)
    w = use[:, :, None, None]
    if pooling == "mean":
        pooled = jnp.sum(jnp.where(w, xs, 0.0), axis=1) / jnp.maximum(count, 1)[:, None, None].astype(jnp.float32)
    else:
        pooled = jnp.max(jnp.where(w, xs, -jnp.inf), axis=1)
        pooled = jnp.where((count > 0)[:, None, None], pooled, 0.0)
    return pooled, count > 0


def poolingformer_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 64,
    pool_window: int = 256,
    pool_size: int = 5,
    pool_stride: int = 4,
    pooling: str = "mean",
    level2_q: Float[ArrayLike, "_c _heads _d_k"] | None = None,
    level2_k: Float[ArrayLike, "_c _heads _d_k"] | None = None,
    level2_v: Float[ArrayLike, "_c _heads _d_v"] | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Poolingformer's two-level attention (Zhang et al., 2021), bidirectional.

    Level 1: sliding-window attention, y_i = softmax over |i - j| <= `window` of
    q_i k_j / sqrt(d_k), applied to v (`local_attention`).
    Level 2, stacked on level 1: from Y (all heads concatenated, `[seq, heads * d_v]`)
    new queries, keys and values Y W'_Q, Y W'_K, Y W'_V (the learned `level2_*`
    `[heads * d_v, heads, d]`); the keys and values are pooled along the length (kernel
    `pool_size`, stride `pool_stride`, `pooling` = mean or max over real tokens), and
    query i attends, in its own softmax, the pooled slots lying inside its larger
    window |i - j| <= `pool_window`: z_i. The output is y_i + z_i.

    Arguments:
        q, k, v: self-attention inputs of one length (grouped-query heads allowed).
        window: level-1 keys each side, int >= 0. pool_window: level-2 keys each side,
            int >= pool_size. pool_size, pool_stride: the pooling kernel and stride, >= 1.
        pooling: "mean" or "max".
        level2_q, level2_k, level2_v: the second level's projections (`poolingformer_arrays`).
        kv_mask: `[seq]`, True for real tokens (padding never enters a window or a pool).

    Returns `[seq, heads, d_v]`. Time O(N * (window + pool_window / pool_stride) * d).
    Not causal: the pooled window reaches both ways (Tay et al.'s survey, Table 1, marks
    it non-causal); no decoding.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("window", window, minimum=0)
    check_positive("pool_size", pool_size)
    check_positive("pool_stride", pool_stride)
    check_positive("pool_window", pool_window, minimum=pool_size)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}; got {pooling!r}")
    check_self(q, k, v, kv_mask)
    n, heads, d_k = q.shape
    d_v = v.shape[-1]
    for name, w, d in (("level2_q", level2_q, d_k), ("level2_k", level2_k, d_k), ("level2_v", level2_v, d_v)):
        if w is None:
            raise ValueError(
                f"poolingformer_attention needs {name} [heads * d_v, heads, {d}] (the second level's "
                "learned projection): make it with registry.bind('poolingformer').init_arrays(...)"
            )
        if tuple(w.shape) != (heads * d_v, heads, d):
            raise ValueError(
                f"{name} must have shape [heads * d_v={heads * d_v}, heads={heads}, {d}]; got {tuple(w.shape)}"
            )
    y = local_attention(q, k, v, window=window, kv_mask=kv_mask, scale=scale, impl="xla").astype(jnp.float32)
    flat = y.reshape(n, heads * d_v)
    assert level2_q is not None and level2_k is not None and level2_v is not None  # checked above; for the checker
    q2, k2, v2 = (einsum_f32("nc,chd->nhd", flat, w) for w in (level2_q, level2_k, level2_v))
    # Query blocks of `block` tokens (a multiple of the stride, >= pool_window) see the
    # pooled slots of their own block and the blocks either side.
    block = pool_stride * ceil_div(max(pool_window, 16), pool_stride)
    block = min(block, pool_stride * ceil_div(n, pool_stride))
    length = ceil_div(n, block) * block
    real = valid_keys(kv_mask, n, length)
    kp, ok = pool_keys(pad_to(k2, length), real, size=pool_size, stride=pool_stride, pooling=pooling)
    vp, _ = pool_keys(pad_to(v2, length), real, size=pool_size, stride=pool_stride, pooling=pooling)
    per = block // pool_stride  # slots starting in one query block
    kb, vb, okb = (neighbour_blocks(to_blocks(x, per), 1, 1) for x in (kp, vp, ok))
    nb = length // block
    start = (positions(nb)[:, None] * per - per + positions(3 * per)[None, :]) * pool_stride  # [nb, 3 per]
    q_pos = to_blocks(positions(length), block)[:, :, None]  # [nb, block, 1]
    inside = (start[:, None, :] >= q_pos - pool_window) & (start[:, None, :] + pool_size - 1 <= q_pos + pool_window)
    part = block_part(
        to_blocks(group_heads(pad_to(q2, length), heads), block),
        kb,
        vb,
        inside & okb[:, None, :],
        default_scale(d_k, scale),
    )
    z = rows_to_output(attend_parts([part]), n, jnp.float32)
    return (y + z).astype(out_dtype(q, k, v))


def poolingformer_arrays(key: PRNGKeyArray, *, heads: int, d_k: int, d_v: int) -> dict[str, Array]:
    """The second level's learned projections W'_Q, W'_K `[heads * d_v, heads, d_k]` and
    W'_V `[heads * d_v, heads, d_v]` of the first level's output (normal, 1/sqrt(heads * d_v))."""
    c = heads * d_v
    kq, kk, kv = jax.random.split(key, 3)
    return {
        "level2_q": jax.random.normal(kq, (c, heads, d_k)) / math.sqrt(c),
        "level2_k": jax.random.normal(kk, (c, heads, d_k)) / math.sqrt(c),
        "level2_v": jax.random.normal(kv, (c, heads, d_v)) / math.sqrt(c),
    }


register(
    "poolingformer",
    poolingformer_attention,
    family="fixed pattern + memory",
    paper="Zhang et al. 2021 (Poolingformer)",
    complexity="O(N (w1 + w2 / stride))",
    exact=False,
    init_arrays=poolingformer_arrays,
    choices={"pooling": POOLINGS},
    docs={
        "window": "level 1: keys each side",
        "pool_window": "level 2: keys each side (pooled)",
        "pool_size": "pooling kernel",
        "pool_stride": "pooling stride",
        "pooling": "mean or max",
    },
    summary="Poolingformer: window attention, then its output attends mean/max-pooled keys of a larger window; y + z",
    limits={"window": 0, "pool_window": 1, "pool_size": 1, "pool_stride": 1},
)
