"""Memory-compressed attention (Liu et al., 2018, "Generating Wikipedia by Summarizing
Long Sequences"): keys and values shortened by a strided convolution before softmax
attention, cutting the cost by the stride.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    einsum_f32,
    pad_to,
    positions,
    to_blocks,
    valid_keys,
    zero_padded,
)
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "compress_memory",
    "memory_compressed_attention",
]


def compress_memory(
    x: Float[ArrayLike, "kv_len kv_heads d"],
    kernel: Float[ArrayLike, "stride _d_in _d_out"],
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
) -> tuple[Float[Array, "mem kv_heads _d_out_head"], Bool[Array, " mem"]]:
    """Strided convolution along the length, kernel size = stride (the paper's stride-3
    convolution), mixing all heads' features as the paper's does over d_model.

    Arguments:
        x: `[kv_len, kv_heads, d]`.
        kernel: `[stride, kv_heads * d, kv_heads * d_out]`.
        kv_mask: optional `[kv_len]`; padded positions are zeroed before the convolution,
            so their content can never reach the output.

    Returns:
        `(memory [ceil(kv_len / stride), kv_heads, d_out], real [mem])` where a memory slot
        is real iff its window holds at least one real position.
    """
    kv_len, heads, d = x.shape
    stride, d_in, d_out = kernel.shape
    if d_in != heads * d or d_out % heads != 0:
        raise ValueError(
            f"kernel must have shape [stride, kv_heads * d = {heads * d}, kv_heads * d_out]; got {tuple(kernel.shape)}"
        )
    mem = ceil_div(kv_len, stride)
    real = valid_keys(kv_mask, kv_len, mem * stride)
    x = jnp.where(real[:, None, None], pad_to(x, mem * stride), 0)
    windows = x.reshape(mem, stride * d_in)
    out = einsum_f32("mi,io->mo", windows, kernel.reshape(stride * d_in, d_out).astype(x.dtype))
    return out.reshape(mem, heads, d_out // heads).astype(x.dtype), to_blocks(real, stride).any(axis=1)


@causal_never_reads_non_finite_future()
def memory_compressed_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    k_kernel: Float[ArrayLike, "stride _dk_in _dk_out"],
    v_kernel: Float[ArrayLike, "_stride _dv_in _dv_out"],
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_len heads _d_v_out"]:
    """Softmax attention over keys and values compressed by a strided convolution.

    Arguments:
        q: `[q_len, heads, d_k]`.
        k, v: `[kv_len, kv_heads, d]` (cross attention allowed when not causal).
        k_kernel: `[stride, kv_heads * d_k, kv_heads * d_k]` (keys keep d_k to meet q).
        v_kernel: `[stride, kv_heads * d_v, kv_heads * d_v_out]`.
        causal: query i sees memory slot m only when the slot's whole window is in the
            past ((m + 1) * stride - 1 <= i), so no future token leaks through the
            convolution; the first stride - 1 queries then see nothing and return zeros.
        kv_mask: optional `[kv_len]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[q_len, heads, d_v_out]`.

    Time and memory O(q_len * kv_len / stride * d) plus the convolution's
    O(kv_len * stride * (heads * d)^2 / stride).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v, self_attention=causal)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    if k_kernel.shape[0] != v_kernel.shape[0]:
        raise ValueError(
            f"k_kernel and v_kernel must share the stride (axis 0); got {k_kernel.shape[0]} and {v_kernel.shape[0]}"
        )
    if k_kernel.shape[2] != k.shape[1] * k.shape[2]:
        raise ValueError(
            f"k_kernel must keep the key size: last axis {k.shape[1] * k.shape[2]}; got {k_kernel.shape[2]}"
        )
    stride = k_kernel.shape[0]
    ck, real = compress_memory(k, k_kernel, kv_mask)
    cv, _ = compress_memory(v, v_kernel, kv_mask)
    mask = None
    if causal:
        slot_end = (positions(ck.shape[0]) + 1) * stride - 1
        mask = slot_end[None, :] <= positions(q.shape[0])[:, None]
    return softmax_attention(q, ck, cv, mask=mask, kv_mask=real, scale=scale)


def memory_compressed_arrays(
    key: PRNGKeyArray, *, kv_heads: int, d_k: int, d_v: int, stride: int = 3
) -> dict[str, Float[Array, "stride d_in d_out"]]:
    """The learned convolution kernels of keys and values, `[stride, kv_heads * d, kv_heads * d]`."""
    check_positive("stride", stride)
    kk, kv = jax.random.split(key)
    std_k = 1.0 / math.sqrt(stride * kv_heads * d_k)
    std_v = 1.0 / math.sqrt(stride * kv_heads * d_v)
    return {
        "k_kernel": std_k * jax.random.normal(kk, (stride, kv_heads * d_k, kv_heads * d_k)),
        "v_kernel": std_v * jax.random.normal(kv, (stride, kv_heads * d_v, kv_heads * d_v)),
    }


register(
    "memory_compressed",
    memory_compressed_attention,
    family="downsampling",
    paper="Liu et al. 2018",
    complexity="O(N^2 / s)",
    supports_cross=True,
    exact=False,
    init_arrays=memory_compressed_arrays,
    docs={"stride": "convolution stride and kernel size"},
    summary="softmax over keys/values shortened by a strided convolution",
    limits={"stride": 1},
)
