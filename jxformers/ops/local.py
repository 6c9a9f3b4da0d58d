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
from jxformers.kernels import IMPLS, choose_kernel
from jxformers.kernels import pattern as kp
from jxformers.kernels.cudnn import cudnn_attention, cudnn_unsupported
from jxformers.kernels.flash import pattern_attention
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

IMPL_DOC = {"impl": "auto, xla, pallas or interpret (block-sparse flash kernel)"}


def local_pattern(window: int, *, causal: bool, q_len: int, kv_len: int) -> kp.Pattern:
    """|i - j| <= window, or 0 <= i - j <= window when causal."""
    return kp.intersect(kp.Band(-window, window), kp.causal(q_len, kv_len) if causal else None)


def block_local_pattern(block_size: int, *, causal: bool, q_len: int, kv_len: int) -> kp.Pattern:
    """i // block_size == j // block_size (and j <= i when causal)."""
    return kp.intersect(kp.Band(0, 0, unit=block_size), kp.causal(q_len, kv_len) if causal else None)


def local_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 128,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, "_seq"] | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "seq heads d_v"]:
    """Sliding-window attention (Image Transformer / Longformer local attention).

    Query i attends key j iff |i - j| <= window, or 0 <= i - j <= window when causal.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (grouped-query heads allowed).
        window: keys each side (bidirectional) or behind (causal); int >= 0.
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.
        impl: "auto", "xla", "pallas", "interpret" or "cudnn" (`jxformers.kernels.impl`).

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * window * d). Causal supported; decoding keeps a ring buffer
    of the last `window` keys.
    """
    check_positive("window", window, minimum=0)
    check_self(q, k, v, kv_mask)
    cudnn = cudnn_unsupported(q, k, v, causal=causal, kv_mask=kv_mask, window=window) or True
    choice = choose_kernel(impl, what="local attention", q_len=q.shape[0], cudnn=cudnn)
    if choice is not None and choice.backend == "cudnn":
        return cudnn_attention(q, k, v, causal=causal, window=window, scale=scale)
    if choice is not None:
        pattern = local_pattern(window, causal=causal, q_len=q.shape[0], kv_len=k.shape[0])
        return pattern_attention(q, k, v, pattern, choice, kv_mask=kv_mask, scale=scale).astype(out_dtype(q, k, v))
    block = window_block(q.shape[0], window)
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block)
    scale = default_scale(q.shape[2], scale)
    part = sliding_window_part(qg, kp, vp, real, block=block, window=window, causal=causal, scale=scale)
    return rows_to_output(attend_parts([part]), q.shape[0], out_dtype(q, k, v))


register(
    "local", local_attention, family="fixed pattern", paper="Parmar et al. 2018; Beltagy et al. 2020",
    complexity="O(N*w)", decoder=ring_buffer(softmax_attention, slots=lambda hp: hp["window"] + 1),
    choices={"impl": IMPLS}, docs={"window": "keys each side (behind when causal)",
                                   "impl": "auto, xla, pallas, interpret (block-sparse flash kernel) or cudnn"},
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
    impl: str = "auto",
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
        impl: "auto", "xla", "pallas" or "interpret" (`jxformers.kernels.impl`).

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * block_size * d). Causal supported.
    """
    check_positive("block_size", block_size)
    check_self(q, k, v, kv_mask)
    choice = choose_kernel(impl, what="block-local attention", q_len=q.shape[0])
    if choice is not None:
        pattern = block_local_pattern(block_size, causal=causal, q_len=q.shape[0], kv_len=k.shape[0])
        return pattern_attention(q, k, v, pattern, choice, kv_mask=kv_mask, scale=scale).astype(out_dtype(q, k, v))
    block = min(block_size, q.shape[0])  # one block holding everything when the block is longer
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block)
    mask = jnp.broadcast_to(to_blocks(real, block)[:, None, :], (real.shape[0] // block, block, block))
    if causal:
        mask = mask & jnp.tril(jnp.ones((block, block), bool))[None]
    part = block_part(to_blocks(qg, block), to_blocks(kp, block), to_blocks(vp, block), mask, default_scale(q.shape[2], scale))
    return rows_to_output(attend_parts([part]), q.shape[0], out_dtype(q, k, v))


register(
    "block_local", block_local_attention, family="fixed pattern", paper="Parmar et al. 2018; Qiu et al. 2019",
    complexity="O(N*b)", choices={"impl": IMPLS}, docs={"block_size": "tokens per block"} | IMPL_DOC,
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
    impl: str = "auto",
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
        impl: "auto", "xla", "pallas" or "interpret": the interleaved subsequences run
            through `local_attention`'s kernel (a dense band, not a sparse one).

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
    run = jax.vmap(lambda q_, k_, v_, m_: local_attention(q_, k_, v_, window=window, causal=causal, kv_mask=m_, scale=scale,
                                                                      impl=impl))
    out = run(interleave(q), interleave(k), interleave(v), real)
    out = jnp.swapaxes(out, 0, 1).reshape(length, *out.shape[2:])
    return out[:n]


register(
    "dilated", dilated_attention, family="fixed pattern", paper="Beltagy et al. 2020", complexity="O(N*w)",
    choices={"impl": IMPLS}, docs={"window": "attended keys each side", "dilation": "stride between attended keys"} | IMPL_DOC,
)
