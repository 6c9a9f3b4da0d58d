"""Local (fixed-window) attention: sliding window, non-overlapping blocks, dilated window.

All three are computed blockwise in O(N * window) time and memory: the sequence is cut
into contiguous blocks and each query block sees only its neighbouring key blocks, with
positions masked exactly (never a dense N x N mask). Any length works; the tail block is
padded and masked. (The LRA reference code groups *strided* positions for "local"
attention; these group contiguous ones, as the papers say.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jxformers.decoding import ring_buffer
from jxformers.ops._common import (
    attend_parts,
    block_part,
    ceil_div,
    check_positive,
    check_self,
    default_scale,
    out_dtype,
    pad_to,
    prepare_self,
    rows_to_output,
    sliding_window_part,
    to_blocks,
    valid_keys,
    window_block,
)
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import register


def local_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 128,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, "_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Sliding-window attention (Image Transformer / Longformer local attention).

    Query i attends key j iff |i - j| <= window, or 0 <= i - j <= window when causal.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (grouped-query heads allowed).
        window: keys each side (bidirectional) or behind (causal); int >= 0.
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * window * d). Causal supported; decoding keeps a ring buffer
    of the last `window` keys.
    """
    check_positive("window", window, minimum=0)
    block = window_block(q.shape[0], window)
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block)
    scale = default_scale(q.shape[2], scale)
    part = sliding_window_part(qg, kp, vp, real, block=block, window=window, causal=causal, scale=scale)
    return rows_to_output(attend_parts([part]), q.shape[0], out_dtype(q, k, v))


register(
    "local", local_attention, family="fixed pattern", paper="Parmar et al. 2018; Beltagy et al. 2020",
    complexity="O(N*w)", decoder=ring_buffer(softmax_attention, slots=lambda hp: hp["window"] + 1),
    docs={"window": "keys each side (behind when causal)"},
)


def block_local_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    block_size: int = 128,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, "_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Blockwise attention over non-overlapping contiguous blocks (Image Transformer's
    local 1-D blocks; Qiu et al.'s blockwise attention with the identity permutation).

    Query i attends key j iff i // block_size == j // block_size (and j <= i if causal).

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        block_size: tokens per block, int >= 1; the last block may be shorter.
        causal: restrict to the past within the block.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * block_size * d). Causal supported.
    """
    check_positive("block_size", block_size)
    block = min(block_size, q.shape[0])  # one block holding everything when the block is longer
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block)
    mask = jnp.broadcast_to(to_blocks(real, block)[:, None, :], (real.shape[0] // block, block, block))
    if causal:
        mask = mask & jnp.tril(jnp.ones((block, block), bool))[None]
    part = block_part(to_blocks(qg, block), to_blocks(kp, block), to_blocks(vp, block), mask, default_scale(q.shape[2], scale))
    return rows_to_output(attend_parts([part]), q.shape[0], out_dtype(q, k, v))


register(
    "block_local", block_local_attention, family="fixed pattern", paper="Parmar et al. 2018; Qiu et al. 2019",
    complexity="O(N*b)", docs={"block_size": "tokens per block"},
)


def dilated_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 64,
    dilation: int = 2,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, "_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Dilated sliding window (Longformer, Beltagy et al. 2020, section 3.1).

    Query i attends key j iff (i - j) is a multiple of `dilation` and
    |i - j| <= window * dilation (0 <= i - j when causal): `window` keys each side with
    gaps of `dilation - 1` tokens, a receptive field of `window * dilation`.
    `dilation=1` is `local_attention`.

    Computed as `local_attention` on each of the `dilation` interleaved subsequences
    (positions with the same remainder mod `dilation`), so the cost stays
    O(seq * window * d) whatever the dilation.

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        window: attended keys each side (or behind when causal); int >= 0.
        dilation: stride between attended keys; int >= 1.
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.
    """
    check_positive("window", window, minimum=0)
    check_positive("dilation", dilation)
    check_self(q, k, v, kv_mask)
    n = q.shape[0]
    length = ceil_div(n, dilation) * dilation

    def interleave(x):  # [length, ...] -> [dilation, length // dilation, ...]
        return jnp.swapaxes(to_blocks(pad_to(x, length), dilation), 0, 1)

    real = interleave(valid_keys(kv_mask, n, length))
    run = jax.vmap(lambda q_, k_, v_, m_: local_attention(q_, k_, v_, window=window, causal=causal, kv_mask=m_, scale=scale))
    out = run(interleave(q), interleave(k), interleave(v), real)
    out = jnp.swapaxes(out, 0, 1).reshape(length, *out.shape[2:])
    return out[:n]


register(
    "dilated", dilated_attention, family="fixed pattern", paper="Beltagy et al. 2020", complexity="O(N*w)",
    docs={"window": "attended keys each side", "dilation": "stride between attended keys"},
)
