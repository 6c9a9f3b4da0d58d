"""Local (fixed-window) attention: sliding window, non-overlapping blocks, dilated window.

All three are computed blockwise in O(N * window) time and memory: the sequence is cut
into contiguous blocks and each query block sees only its neighbouring key blocks, with
positions masked exactly (never a dense N x N mask). Any length works; the tail block is
padded and masked. (The LRA reference code groups *strided* positions for "local"
attention; these group contiguous ones, as the papers say.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jxformers._typing import ArrayLike
from jxformers.decoding import KVCache, ring_buffer
from jxformers.kernels import IMPLS, choose_kernel
from jxformers.kernels import pattern as kp
from jxformers.kernels.cudnn import cudnn_attention, cudnn_unsupported
from jxformers.kernels.flash import pattern_attention
from jxformers.ops._common import (
    attend_parts,
    block_part,
    causal_never_reads_non_finite_future,
    ceil_div,
    check_positive,
    check_self,
    default_scale,
    logits,
    out_dtype,
    pad_to,
    prepare_self,
    rows_to_output,
    sliding_window_part,
    softmax_parts,
    to_blocks,
    valid_keys,
    weighted_values,
    window_block,
    zero_padded,
)
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import Decoder, fraction, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "block_local_attention",
    "block_raster_coordinates",
    "block_raster_order",
    "dilated_attention",
    "image_local_2d_attention",
    "local_attention",
]

IMPL_DOC = {"impl": "one of jxformers.kernels.IMPLS (block-sparse flash kernel; no cuDNN route)"}
LOCAL_IMPL_DOC = {"impl": "one of jxformers.kernels.IMPLS (block-sparse flash kernel or cuDNN)"}


def local_pattern(window: int, *, causal: bool, q_len: int, kv_len: int) -> kp.Pattern:
    """|i - j| <= window, or 0 <= i - j <= window when causal."""
    return kp.intersect(kp.Band(-window, window), kp.causal(q_len, kv_len) if causal else None)


def block_local_pattern(block_size: int, *, causal: bool, q_len: int, kv_len: int) -> kp.Pattern:
    """i // block_size == j // block_size (and j <= i when causal)."""
    return kp.intersect(kp.Band(0, 0, unit=block_size), kp.causal(q_len, kv_len) if causal else None)


@causal_never_reads_non_finite_future()
def local_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 128,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
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
        impl: one of `jxformers.kernels.IMPLS` (the block-sparse flash kernel or cuDNN).

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * window * d). Causal supported; decoding keeps a ring buffer
    of the last `window` keys.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
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
    "local",
    local_attention,
    family="fixed pattern",
    paper="Parmar et al. 2018; Beltagy et al. 2020",
    complexity="O(N w)",
    decoder=ring_buffer(softmax_attention, slots=lambda hp: hp["window"] + 1),
    choices={"impl": IMPLS},
    docs={"window": "keys each side (behind when causal)"} | LOCAL_IMPL_DOC,
    summary="|i - j| <= window (0 <= i - j <= window causal)",
    limits={"window": 0},
    dense_width=("its window (2 window + 1 keys)", lambda hp, n: 2 * hp["window"] + 1),
    scaled=(
        "window = min(default, N / 8) keys each side (Beltagy et al. 2020: 512 at 4,096): a quarter of the keys",
        lambda d, n: {"window": fraction(n, 8, cap=d["window"])},
    ),
)


@causal_never_reads_non_finite_future()
def block_local_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    block_size: int = 128,
    head_shifts: tuple[int, ...] = (),
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "seq heads d_v"]:
    """Blockwise attention over non-overlapping contiguous blocks (Image Transformer's
    local 1-D blocks; Qiu et al. 2020's blockwise attention, with its per-head block
    permutations through `head_shifts`).

    Query i attends key j iff i // block_size == j // block_size (and j <= i if causal);
    with `head_shifts`, head h's query block a attends key block (a + shift_h) mod n_b.

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        block_size: tokens per block, int >= 1; the last block may be shorter.
        head_shifts: one shift per query head (empty: 0 for all, the identity):
            Qiu, Ma, Levy, Yih, Wang & Tang 2020 ("Blockwise Self-Attention for Long
            Document Understanding") give each head a permutation pi of the blocks, the
            query block a attending key block pi(a), the shifts pi(a) = (a + shift) mod
            n_b (BlockBERT's permutations for n_b blocks; e.g. 2 blocks: heads split
            between shifts 0 and 1). Not causal unless every shift is 0 (a shifted block
            lies in the future); XLA only.
        causal: restrict to the past within the block.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.
        impl: one of `jxformers.kernels.IMPLS`, no cuDNN route.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * block_size * d). Causal supported.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("block_size", block_size)
    check_self(q, k, v, kv_mask)
    if any(head_shifts):
        return _permuted_blocks(
            q, k, v, block_size, head_shifts, causal=causal, kv_mask=kv_mask, scale=scale, impl=impl
        )
    choice = choose_kernel(impl, what="block-local attention", q_len=q.shape[0])
    if choice is not None:
        pattern = block_local_pattern(block_size, causal=causal, q_len=q.shape[0], kv_len=k.shape[0])
        return pattern_attention(q, k, v, pattern, choice, kv_mask=kv_mask, scale=scale).astype(out_dtype(q, k, v))
    block = min(block_size, q.shape[0])  # one block holding everything when the block is longer
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block)
    mask = jnp.broadcast_to(to_blocks(real, block)[:, None, :], (real.shape[0] // block, block, block))
    if causal:
        mask = mask & jnp.tril(jnp.ones((block, block), bool))[None]
    part = block_part(
        to_blocks(qg, block), to_blocks(kp, block), to_blocks(vp, block), mask, default_scale(q.shape[2], scale)
    )
    return rows_to_output(attend_parts([part]), q.shape[0], out_dtype(q, k, v))


def _permuted_blocks(q, k, v, block_size: int, head_shifts: tuple[int, ...], *, causal, kv_mask, scale, impl):
    """Block-local attention where head h's query block a reads key block (a + shift_h) mod n_b."""
    heads = q.shape[1]
    if len(head_shifts) != heads or any(s < 0 for s in head_shifts):
        raise ValueError(f"head_shifts must give one shift >= 0 per query head ({heads}); got {head_shifts}")
    if causal:
        raise ValueError(f"block_local with head_shifts {head_shifts} reads later blocks: it cannot be causal")
    if impl == "pallas":
        raise ValueError("block_local's head_shifts give each head its own pattern: impl 'pallas' has one; use 'xla'")
    group = heads // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # each query head its own blocks
    block = min(block_size, q.shape[0])
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block)
    shifts = np.asarray(head_shifts)
    nb = real.shape[0] // block
    take = (np.arange(nb)[:, None] + shifts[None, :]) % nb  # [query block, head] -> key block

    def permuted(x):  # [L, heads, ...] -> [nb, block, heads, ...]: head h's key block for each query block
        blocks = to_blocks(x, block)
        return blocks[take, :, np.arange(heads)[None, :]].swapaxes(1, 2)

    reads = jnp.broadcast_to(to_blocks(real, block)[take][:, :, None, None, :], (nb, heads, 1, block, block))
    scores = logits(to_blocks(qg, block), permuted(kp), default_scale(q.shape[2], scale))  # [nb, heads, 1, b, b]
    (p,) = softmax_parts([(scores, reads)])
    out = weighted_values(p, permuted(vp), reads=reads)  # [nb, b, heads, 1, dv]
    return rows_to_output(out.reshape(nb * block, heads, 1, -1), q.shape[0], out_dtype(q, k, v))


register(
    "block_local",
    block_local_attention,
    family="fixed pattern",
    paper="Parmar et al. 2018; Qiu et al. 2019",
    complexity="O(N b)",
    choices={"impl": IMPLS},
    docs={"block_size": "tokens per block", "head_shifts": "per-head block shift (Qiu et al.'s permutations)"}
    | IMPL_DOC,
    summary="i // b == j // b (contiguous blocks); per head, (i // b + shift) mod n_b == j // b",
    limits={"block_size": 1, "head_shifts": 0},
    dense_width=("its block (block_size keys)", lambda hp, n: hp["block_size"]),
    scaled=(
        "block_size = min(default, N / 8): at least eight blocks (Parmar et al. 2018's blocks of 256 at 2,048)",
        lambda d, n: {"block_size": fraction(n, 8, cap=d["block_size"])},
    ),
)


@causal_never_reads_non_finite_future()
def dilated_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 64,
    dilation: int = 2,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
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
        impl: one of `jxformers.kernels.IMPLS`: the interleaved subsequences run
            through `local_attention`'s kernel (a dense band, not a sparse one) or cuDNN.

    Returns:
        `[seq, heads, d_v]`.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("window", window, minimum=0)
    check_positive("dilation", dilation)
    check_self(q, k, v, kv_mask)
    n = q.shape[0]
    length = ceil_div(n, dilation) * dilation

    def interleave(x):  # [length, ...] -> [dilation, length // dilation, ...]
        return jnp.swapaxes(to_blocks(pad_to(x, length), dilation), 0, 1)

    real = interleave(valid_keys(kv_mask, n, length))
    run = jax.vmap(
        lambda q_, k_, v_, m_: local_attention(
            q_, k_, v_, window=window, causal=causal, kv_mask=m_, scale=scale, impl=impl
        )
    )
    out = run(interleave(q), interleave(k), interleave(v), real)
    out = jnp.swapaxes(out, 0, 1).reshape(length, *out.shape[2:])
    return out[:n]


register(
    "dilated",
    dilated_attention,
    family="fixed pattern",
    paper="Beltagy et al. 2020",
    complexity="O(N w)",
    choices={"impl": IMPLS},
    docs={"window": "attended keys each side", "dilation": "stride between attended keys"} | LOCAL_IMPL_DOC,
    summary="(i - j) % dilation == 0 and |i - j| <= window * dilation",
    limits={"window": 0, "dilation": 1},
    scaled=(
        "window = min(default, N / (8 dilation)) keys each side: it reaches N / 8 each side, as local's window",
        lambda d, n: {"window": fraction(n, 8 * d["dilation"], cap=d["window"])},
    ),
)


# ----------------------------------------------------------------------------- Image Transformer 2-D


def _check_image_local_2d(
    width: int, query_height: int, query_width: int, memory_height: int, memory_width: int
) -> None:
    check_positive("width", width)
    check_positive("query_height", query_height)
    check_positive("query_width", query_width)
    check_positive("memory_height", memory_height, minimum=0)
    check_positive("memory_width", memory_width, minimum=0)
    if width % query_width:
        raise ValueError(
            f"query_width ({query_width}) must divide the image width ({width}): "
            "query blocks tile each band of query_height rows"
        )


def block_raster_coordinates(index, *, width: int, query_height: int, query_width: int):
    """(row, column, block row, block column) of the pixel at `index` in the block raster
    order of Image Transformer's 2-D local attention (Parmar et al. 2018, section 3.2):
    query blocks of `query_height` x `query_width` pixels in raster order over the image,
    the pixels of a block in raster order inside it. Works on ints, numpy or jax arrays."""
    block_size = query_height * query_width
    blocks_per_row = width // query_width
    block, offset = index // block_size, index % block_size
    block_row, block_col = block // blocks_per_row, block % blocks_per_row
    return (
        block_row * query_height + offset // query_width,
        block_col * query_width + offset % query_width,
        block_row,
        block_col,
    )


def block_raster_order(height: int, width: int, *, query_height: int, query_width: int) -> np.ndarray:
    """The permutation taking an image flattened in raster order (`image.reshape(height *
    width, ...)`) to the block raster order `image_local_2d_attention` reads:
    `seq = flat[block_raster_order(...)]`; `flat[order] = seq` undoes it. `height` must be a
    multiple of `query_height` and `width` of `query_width`."""
    _check_image_local_2d(width, query_height, query_width, 0, 0)
    if height % query_height:
        raise ValueError(f"query_height ({query_height}) must divide the image height ({height})")
    row, col, _, _ = block_raster_coordinates(
        np.arange(height * width), width=width, query_height=query_height, query_width=query_width
    )
    return row * width + col


def _in_memory_block(i, j, *, width, query_height, query_width, memory_height, memory_width, causal):
    """Whether key j is in the memory block of query i's query block (and, when causal,
    not after i in the generation order)."""
    hw = dict(width=width, query_height=query_height, query_width=query_width)
    _, _, q_brow, q_bcol = block_raster_coordinates(i, **hw)
    k_row, k_col, _, _ = block_raster_coordinates(j, **hw)
    top = q_brow * query_height
    left = q_bcol * query_width
    inside = (
        (k_row >= top - memory_height)
        & (k_row < top + query_height)
        & (k_col >= left - memory_width)
        & (k_col < left + query_width + memory_width)
    )
    return inside & (j <= i) if causal else inside


@causal_never_reads_non_finite_future()
def image_local_2d_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    width: int = 32,
    query_height: int = 8,
    query_width: int = 8,
    memory_height: int = 8,
    memory_width: int = 8,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Image Transformer's 2-D local attention (Parmar et al. 2018, section 3.2).

    The image, `width` pixels wide, is cut into query blocks of `query_height` x
    `query_width` pixels; the sequence holds its pixels in the paper's block raster
    order (the blocks in raster order, the pixels of each block in raster order: see
    `block_raster_order` to lay out an image, `block_raster_coordinates` for the
    geometry). A sequence shorter than the image is its first `seq` pixels in that
    order (what generation has produced so far). Every query of a block attends the
    block's memory block: the query block extended by `memory_height` rows above and
    `memory_width` columns left and right (nothing below), clipped to the image; with
    `causal=True` only the pixels at or before the query in the generation order (the
    paper's masked attention, so the model generates pixel by pixel).

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (block raster order).
        width: image width in pixels, a multiple of `query_width`.
        query_height, query_width: the query block shape (h_q, w_q), ints >= 1.
        memory_height: h_m, rows above the query block in its memory block, int >= 0.
        memory_width: w_m, columns left and right of the query block, int >= 0.
        causal: mask pixels after the query in the generation order.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * (ceil(h_m / h_q) + 1) * (2 ceil(w_m / w_q) + 1) * h_q w_q * d):
    each query block gathers the query blocks its memory block overlaps and masks the
    pixels outside it. Decoding keeps a ring buffer of the pixels a memory block reaches
    back to.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    _check_image_local_2d(width, query_height, query_width, memory_height, memory_width)
    check_self(q, k, v, kv_mask)
    n = q.shape[0]
    band = query_height * width  # one band of query blocks (query_height full rows)
    block = query_height * query_width
    length = ceil_div(n, band) * band
    num_blocks, per_row = length // block, width // query_width
    up, side = ceil_div(memory_height, query_height), ceil_div(memory_width, query_width)
    # Static geometry (numpy, at trace time): the query blocks each block's memory overlaps.
    b = np.arange(num_blocks)
    b_row, b_col = b // per_row, b % per_row
    nb_rows = np.stack([b_row - du for du in range(up, -1, -1) for _ in range(-side, side + 1)], axis=1)
    nb_cols = np.stack([b_col + dc for _ in range(up, -1, -1) for dc in range(-side, side + 1)], axis=1)
    ok = (nb_rows >= 0) & (nb_cols >= 0) & (nb_cols < per_row)
    neighbour = np.where(ok, nb_rows * per_row + nb_cols, num_blocks)  # num_blocks: an empty block
    key_idx = (neighbour[:, :, None] * block + np.arange(block)[None, None, :]).reshape(num_blocks, -1)
    query_idx = np.arange(length).reshape(num_blocks, block)
    hw = dict(
        width=width,
        query_height=query_height,
        query_width=query_width,
        memory_height=memory_height,
        memory_width=memory_width,
        causal=causal,
    )
    geometry = _in_memory_block(query_idx[:, :, None], key_idx[:, None, :], **hw)
    geometry &= (key_idx < length)[:, None, :]
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, band)
    kp, vp, real = pad_to(kp, length + block), pad_to(vp, length + block), valid_keys(real, length, length + block)
    mask = jnp.asarray(geometry) & real[key_idx][:, None, :]
    part = block_part(to_blocks(qg, block), kp[key_idx], vp[key_idx], mask, default_scale(q.shape[2], scale))
    return rows_to_output(attend_parts([part]), n, out_dtype(q, k, v))


def _image_local_2d_slots(hp) -> int:
    """Ring-buffer slots: the farthest key behind a query inside its memory block."""
    up, side = ceil_div(hp["memory_height"], hp["query_height"]), ceil_div(hp["memory_width"], hp["query_width"])
    return (up * (hp["width"] // hp["query_width"]) + side + 1) * hp["query_height"] * hp["query_width"]


def _image_local_2d_init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> KVCache:
    slots = min(max_len, _image_local_2d_slots(hyper_parameters))
    dtype = jnp.float32 if dtype is None else dtype
    return KVCache(
        jnp.zeros((slots, kv_heads, d_k), dtype),
        jnp.zeros((slots, kv_heads, d_v), dtype),
        jnp.full((slots,), -1, jnp.int32),
        jnp.zeros((), jnp.int32),
    )


def _image_local_2d_step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
    """One pixel: write it into the ring buffer, attend the cached pixels of its memory
    block that come at or before it (the causal forward's row)."""
    hp = hyper_parameters
    slot = state.length % state.k.shape[0]
    state = KVCache(
        state.k.at[slot].set(k.astype(state.k.dtype)),
        state.v.at[slot].set(v.astype(state.v.dtype)),
        state.slot_pos.at[slot].set(state.length),
        state.length + 1,
    )
    here = state.length - 1
    keep = _in_memory_block(
        here,
        jnp.maximum(state.slot_pos, 0),
        width=hp["width"],
        query_height=hp["query_height"],
        query_width=hp["query_width"],
        memory_height=hp["memory_height"],
        memory_width=hp["memory_width"],
        causal=True,
    )
    out = softmax_attention(q[None], state.k, state.v, kv_mask=keep & (state.slot_pos >= 0))[0]
    return out.astype(q.dtype), state


def _image_local_2d_scaled(defaults, max_len: int) -> dict[str, int]:
    """Image Transformer 2-D's settings at max_len N (its registration's `scaled`): a
    square grid of width isqrt(N), rounded down to a multiple of its query blocks of
    q = min(default, width / 4) (query_width must divide the width), and memory of q rows
    above and q columns each side: the defaults (32, 8, 8, 8, 8) at N = 1,024, a memory
    block of 6 q^2 pixels (at most 0.375 N)."""
    side = max(1, math.isqrt(max_len))
    block = min(defaults["query_width"], max(1, side // 4))
    return {
        "width": side - side % block,
        "query_height": block,
        "query_width": block,
        "memory_height": block,
        "memory_width": block,
    }


register(
    "image_local_2d",
    image_local_2d_attention,
    family="fixed pattern",
    paper="Parmar et al. 2018 (Image Transformer)",
    complexity="O(N m)",
    decoder=Decoder("ring buffer", _image_local_2d_init, _image_local_2d_step),
    docs={
        "width": "image width in pixels (a multiple of query_width)",
        "query_height": "query block rows h_q",
        "query_width": "query block columns w_q",
        "memory_height": "h_m, memory rows above the query block",
        "memory_width": "w_m, memory columns left and right of the query block",
    },
    summary=(
        "Image Transformer 2-D: block raster order; a query block attends its memory block (h_m rows above, "
        "w_m columns each side)"
    ),
    limits={"width": 1, "query_height": 1, "query_width": 1, "memory_height": 0, "memory_width": 0},
    dense_width=(
        "its memory block ((memory_height + query_height) x (query_width + 2 memory_width) pixels)",
        lambda hp, n: (hp["memory_height"] + hp["query_height"]) * (hp["query_width"] + 2 * hp["memory_width"]),
    ),
    grid_width="width",
    scaled=(
        "a square grid: width = isqrt(N) rounded down to a multiple of q = min(default, width / 4), query and "
        "memory blocks of q (the defaults at 32 x 32 = 1,024 pixels, Parmar et al. 2018): 6 q^2 <= 0.375 N pixels",
        _image_local_2d_scaled,
    ),
)
