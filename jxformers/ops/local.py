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
from jaxtyping import Array, Bool, Float

from jxformers.ops._common import (
    attend,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    default_scale,
    head_mask,
    neighbour_blocks,
    out_dtype,
    pad_to,
    positions,
    to_blocks,
    valid_keys,
)

_MIN_BLOCK = 16  # small windows still get blocks big enough to keep the matmuls busy


def _check_self(q, k, v, kv_mask) -> None:
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))


def local_attention(
    q: Float[Array, "seq heads d_k"],
    k: Float[Array, "_seq kv_heads _d_k"],
    v: Float[Array, "_seq _kv_heads d_v"],
    *,
    window: int,
    causal: bool = False,
    kv_mask: Bool[Array, "_seq"] | None = None,
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
    _check_self(q, k, v, kv_mask)
    check_positive("window", window, minimum=0)
    n = q.shape[0]
    # Blocks no smaller than the window, so a block's neighbours cover every key it needs;
    # a window wider than the sequence degenerates to one block holding everything.
    block = min(max(window, _MIN_BLOCK), n)
    nb = ceil_div(n, block)
    after = 0 if causal else 1
    qb = to_blocks(pad_to(q, nb * block), block)
    kb = neighbour_blocks(to_blocks(pad_to(k, nb * block), block), 1, after)
    vb = neighbour_blocks(to_blocks(pad_to(v, nb * block), block), 1, after)
    real = neighbour_blocks(to_blocks(valid_keys(kv_mask, n, nb * block), block), 1, after)

    q_pos = to_blocks(positions(nb * block), block)  # [nb, block]
    k_pos = q_pos[:, :1] - block + positions(kb.shape[1])[None, :]  # [nb, (2|3) * block]
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    near = (delta >= 0) & (delta <= window) if causal else jnp.abs(delta) <= window
    mask = near & real[:, None, :]
    out = attend(qb, [(kb, vb, head_mask(mask))], default_scale(q.shape[2], scale))
    return out.reshape(nb * block, *out.shape[2:])[:n].astype(out_dtype(q, k, v))


def block_local_attention(
    q: Float[Array, "seq heads d_k"],
    k: Float[Array, "_seq kv_heads _d_k"],
    v: Float[Array, "_seq _kv_heads d_v"],
    *,
    block_size: int,
    causal: bool = False,
    kv_mask: Bool[Array, "_seq"] | None = None,
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
    _check_self(q, k, v, kv_mask)
    check_positive("block_size", block_size)
    n = q.shape[0]
    block = min(block_size, n)  # one block holding everything when the block is longer
    nb = ceil_div(n, block)
    qb, kb, vb = (to_blocks(pad_to(x, nb * block), block) for x in (q, k, v))
    real = to_blocks(valid_keys(kv_mask, n, nb * block), block)
    mask = jnp.broadcast_to(real[:, None, :], (nb, block, block))
    if causal:
        mask = mask & jnp.tril(jnp.ones((block, block), bool))[None]
    out = attend(qb, [(kb, vb, head_mask(mask))], default_scale(q.shape[2], scale))
    return out.reshape(nb * block, *out.shape[2:])[:n].astype(out_dtype(q, k, v))


def dilated_attention(
    q: Float[Array, "seq heads d_k"],
    k: Float[Array, "_seq kv_heads _d_k"],
    v: Float[Array, "_seq _kv_heads d_v"],
    *,
    window: int,
    dilation: int,
    causal: bool = False,
    kv_mask: Bool[Array, "_seq"] | None = None,
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
    _check_self(q, k, v, kv_mask)
    check_positive("window", window, minimum=0)
    check_positive("dilation", dilation)
    n = q.shape[0]
    length = ceil_div(n, dilation) * dilation

    def interleave(x):  # [length, ...] -> [dilation, length // dilation, ...]
        return jnp.swapaxes(to_blocks(pad_to(x, length), dilation), 0, 1)

    real = interleave(valid_keys(kv_mask, n, length))
    run = jax.vmap(lambda q_, k_, v_, m_: local_attention(q_, k_, v_, window=window, causal=causal, kv_mask=m_, scale=scale))
    out = run(interleave(q), interleave(k), interleave(v), real)
    out = jnp.swapaxes(out, 0, 1).reshape(length, *out.shape[2:])
    return out[:n]
