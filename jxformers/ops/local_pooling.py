"""A local window, then attention over pooled keys of a larger window (Tay et al.'s
survey, Table 1: "FP + M"): Poolingformer (Zhang et al. 2021, "Poolingformer: Long
Document Modeling with Pooling Attention", arXiv 2105.04371).

    pool_keys                mean, max or dynamic-convolution pooling along the length,
                             over real tokens only
    dynamic_pool_logits      the dynamic convolution's kernels, predicted from the input
    poolingformer_attention  two levels: window, then pooled window over the first's output

The second level's projections (and the dynamic pooling's kernel predictor) come from
`init_arrays` and are trained with the module.
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
    masked_softmax_over,
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
from jxformers.registry import fraction, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "dynamic_pool_logits",
    "pool_keys",
    "poolingformer_arrays",
    "poolingformer_attention",
]

POOLINGS = ("mean", "max", "dynamic")


def pool_keys(
    x: Float[ArrayLike, "L h d"],
    real: Bool[ArrayLike, " L"],
    *,
    size: int,
    stride: int,
    pooling: str = "mean",
    logits: Float[ArrayLike, "m size h"] | None = None,
) -> tuple[Float[Array, "m h d"], Bool[Array, " m"]]:
    """Pool `x` along its length with kernel `size` and `stride`: slot m covers positions
    [m * stride, m * stride + size), pooled over the real ones among them
    (m < ceil(L / stride)): their mean, their max, or (`pooling` "dynamic") the sum of
    its taps weighted by softmax(`logits[m, :, h]`) over the real taps, per head h
    (`dynamic_pool_logits`). Returns the pooled slots and whether each holds a real position."""
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
    elif pooling == "max":
        pooled = jnp.max(jnp.where(w, xs, -jnp.inf), axis=1)
        pooled = jnp.where((count > 0)[:, None, None], pooled, 0.0)
    else:
        if logits is None:
            raise ValueError("pool_keys: pooling 'dynamic' needs logits [slots, size, heads] (dynamic_pool_logits)")
        # softmax over the real taps only: a slot cut by padding or the end renormalises
        p = masked_softmax_over(jnp.asarray(logits).astype(jnp.float32), use[:, :, None], axis=1)
        pooled = jnp.einsum("msh,mshd->mhd", p, jnp.where(w, xs, 0.0))
    return pooled, count > 0


def dynamic_pool_logits(
    x: Float[ArrayLike, "L c"],
    real: Bool[ArrayLike, " L"],
    weight: Float[ArrayLike, "c h size"],
    *,
    stride: int,
) -> Float[Array, "m size h"]:
    """The dynamic convolution's kernels (Wu et al. 2019, "Pay Less Attention with
    Lightweight and Dynamic Convolutions": DynamicConv predicts a position's kernel from
    that position's input, one kernel of `size` taps per head, by a linear map without
    bias) for the strided pooling: slot m (positions [m * stride, m * stride + size)) takes
    the logits x_c W at its centre c = m * stride + (size - 1) // 2; a padded or
    out-of-range centre reads zeros (equal logits: the mean of the slot's real taps).

    Arguments:
        x: `[L, c]` the pooling's input rows (the first level's output, all heads).
        real: `[L]` True for real positions.
        weight: `[c, heads, size]` the kernel predictor W (`level2_pool`).
        stride: the pooling stride.

    Returns `[ceil(L / stride), size, heads]` logits (softmax-normalised by `pool_keys`).
    """
    length = x.shape[0]
    size = weight.shape[-1]
    centre = positions(ceil_div(length, stride)) * stride + (size - 1) // 2
    known = centre < length
    centre = jnp.minimum(centre, length - 1)
    rows = jnp.where((known & jnp.asarray(real)[centre])[:, None], jnp.asarray(x)[centre], 0.0)
    return einsum_f32("mc,chs->msh", rows, weight)


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
    level2_pool: Float[ArrayLike, "_c _heads _pool_size"] | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Poolingformer's two-level attention (Zhang et al., 2021), bidirectional.

    Level 1: sliding-window attention, y_i = softmax over |i - j| <= `window` of
    q_i k_j / sqrt(d_k), applied to v (`local_attention`).
    Level 2, stacked on level 1: from Y (all heads concatenated, `[seq, heads * d_v]`)
    new queries, keys and values Y W'_Q, Y W'_K, Y W'_V (the learned `level2_*`
    `[heads * d_v, heads, d]`); the keys and values are pooled along the length (kernel
    `pool_size`, stride `pool_stride`, `pooling` = mean or max over real tokens, or
    "dynamic": the paper's dynamic-convolution pooling after Wu et al. 2019, each slot's
    kernel predicted from Y at its centre by the learned `level2_pool`, softmax over its
    real taps, one kernel per head shared by keys and values), and
    query i attends, in its own softmax, the pooled slots lying inside its larger
    window |i - j| <= `pool_window`: z_i. The output is y_i + z_i.

    Arguments:
        q, k, v: self-attention inputs of one length (grouped-query heads allowed).
        window: level-1 keys each side, int >= 0. pool_window: level-2 keys each side,
            int >= pool_size. pool_size, pool_stride: the pooling kernel and stride, >= 1.
        pooling: "mean", "max" or "dynamic".
        level2_q, level2_k, level2_v: the second level's projections (`poolingformer_arrays`).
        level2_pool: `[heads * d_v, heads, pool_size]`, the dynamic pooling's kernel
            predictor (`pooling` "dynamic" only).
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
    if (pooling == "dynamic") != (level2_pool is not None):
        raise ValueError(
            "level2_pool [heads * d_v, heads, pool_size] is the kernel predictor of pooling 'dynamic' and only "
            f"of it; got pooling={pooling!r} with level2_pool "
            f"{None if level2_pool is None else tuple(level2_pool.shape)}"
        )
    if level2_pool is not None and tuple(level2_pool.shape) != (heads * d_v, heads, pool_size):
        raise ValueError(
            f"level2_pool must have shape [heads * d_v={heads * d_v}, heads={heads}, pool_size={pool_size}]; "
            f"got {tuple(level2_pool.shape)}"
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
    logits = (
        None
        if level2_pool is None
        else dynamic_pool_logits(pad_to(flat, length), real, level2_pool, stride=pool_stride)
    )
    kp, ok = pool_keys(pad_to(k2, length), real, size=pool_size, stride=pool_stride, pooling=pooling, logits=logits)
    vp, _ = pool_keys(pad_to(v2, length), real, size=pool_size, stride=pool_stride, pooling=pooling, logits=logits)
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


def poolingformer_arrays(
    key: PRNGKeyArray, *, heads: int, d_k: int, d_v: int, pool_size: int = 5, pooling: str = "mean"
) -> dict[str, Array]:
    """The second level's learned projections W'_Q, W'_K `[heads * d_v, heads, d_k]` and
    W'_V `[heads * d_v, heads, d_v]` of the first level's output, and with `pooling`
    "dynamic" the kernel predictor `level2_pool` `[heads * d_v, heads, pool_size]` (all
    normal, 1/sqrt(heads * d_v))."""
    c = heads * d_v
    kq, kk, kv, kp = jax.random.split(key, 4)
    arrays = {
        "level2_q": jax.random.normal(kq, (c, heads, d_k)) / math.sqrt(c),
        "level2_k": jax.random.normal(kk, (c, heads, d_k)) / math.sqrt(c),
        "level2_v": jax.random.normal(kv, (c, heads, d_v)) / math.sqrt(c),
    }
    if pooling == "dynamic":
        arrays["level2_pool"] = jax.random.normal(kp, (c, heads, pool_size)) / math.sqrt(c)
    return arrays


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
        "pooling": "mean, max, or dynamic (the paper's dynamic-convolution pooling, kernels predicted from the input)",
    },
    summary="Poolingformer: window attention, then its output attends pooled keys of a larger window; y + z",
    limits={"window": 0, "pool_window": 1, "pool_size": 1, "pool_stride": 1},
    scaled=(
        "window = min(default, N / 16) and pool_window = min(default, N / 4) keys each side, at least pool_size "
        "(the op's rule): both levels local (Zhang et al. 2021: 64 and 256 at 4,096)",
        lambda d, n: {
            "window": fraction(n, 16, cap=d["window"]),
            "pool_window": fraction(n, 4, cap=d["pool_window"], minimum=d["pool_size"]),
        },
    ),
)
