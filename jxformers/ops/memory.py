"""Memory attention: attention through a small set of inducing / latent points (Set Transformer's ISAB and
PMA, Lee et al. 2019; Luna's pack and unpack, Ma et al. 2021; Perceiver's cross
attention to a latent array, Jaegle et al. 2021) and Funnel-style query pooling
(Dai et al., 2020).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from jxformers.ops._common import (
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    pad_to,
    to_blocks,
    valid_keys,
)
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import register

# ----------------------------------------------------------------------------- inducing points


def induced_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    inducing: Float[ArrayLike, "num_inducing heads _d_k"],
    unpack_keys: Float[ArrayLike, "heads _d_v _d_k"] | None = None,
    kv_mask: Bool[ArrayLike, "_kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Attention through m inducing points (Set Transformer ISAB; Luna pack/unpack).

    pack:   P = softmax(I K^T) V                      `[m, heads, d_v]` (I = `inducing`)
    unpack: Y = softmax(Q (P W)^T) P                  `[q_len, heads, d_v]`
    where W = `unpack_keys` `[heads, d_v, d_k]` maps packed values to keys (identity
    when omitted, which needs d_v == d_k). Modules add their own projections around.

    Non-causal: every unpacked position sees a pack of the whole sequence (Luna's causal
    variant, which packs each prefix separately, is not provided).

    Time O(N * m * d).
    """
    check_qkv(q, k, v)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    if inducing.shape[1:] != q.shape[1:]:
        raise ValueError(f"inducing must have shape [m, heads={q.shape[1]}, d_k={q.shape[2]}]; got {inducing.shape}")
    heads, d_k, d_v = q.shape[1], q.shape[2], v.shape[2]
    if unpack_keys is None and d_v != d_k:
        raise ValueError(f"unpack_keys [heads, d_v, d_k] is needed when d_v ({d_v}) != d_k ({d_k})")
    if unpack_keys is not None and unpack_keys.shape != (heads, d_v, d_k):
        raise ValueError(f"unpack_keys must have shape {(heads, d_v, d_k)}; got {unpack_keys.shape}")

    packed = softmax_attention(inducing.astype(q.dtype), k, v, kv_mask=kv_mask, scale=scale)  # [m, heads, d_v]
    pk = packed if unpack_keys is None else jnp.einsum("mhv,hvd->mhd", packed, unpack_keys.astype(packed.dtype))
    return softmax_attention(q, pk.astype(q.dtype), packed, scale=scale)


def induced_arrays(key: PRNGKeyArray, *, heads: int, d_k: int, d_v: int, num_inducing: int = 32) -> dict[str, Array]:
    """The learned inducing points (and the unpacking keys when d_v != d_k)."""
    check_positive("num_inducing", num_inducing)
    ki, ku = jax.random.split(key)
    arrays = {"inducing": jax.random.normal(ki, (num_inducing, heads, d_k))}
    if d_v != d_k:
        arrays["unpack_keys"] = jax.random.normal(ku, (heads, d_v, d_k)) / math.sqrt(d_v)
    return arrays


register(
    "induced", induced_attention, family="memory", paper="Lee et al. 2019 (ISAB); Ma et al. 2021 (Luna)",
    complexity="O(N*m)", supports_cross=True, exact=False, init_arrays=induced_arrays,
    docs={"num_inducing": "inducing points m"},
)


def latent_attention(
    latents: Float[ArrayLike, "num_latents heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, "_kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "num_latents heads d_v"]:
    """Cross attention from a small latent array to the inputs: Perceiver's encoder and
    Set Transformer's pooling by multihead attention (PMA, with k seed vectors as
    `latents`). O(N * m * d); the output has the latents' length, not the input's."""
    return softmax_attention(latents, k, v, kv_mask=kv_mask, scale=scale)


def funnel_pool(
    x: Float[ArrayLike, "n *rest"], stride: int = 2, mask: Bool[ArrayLike, "_n"] | None = None
) -> tuple[Float[Array, "pooled *rest"], Bool[Array, "pooled"]]:
    """Funnel Transformer's strided mean pooling along the sequence (Dai et al., 2020):
    windows of `stride` positions, averaged over real positions only; returns the pooled
    sequence `[ceil(n / stride), ...]` and its mask (a window is real if any position is).
    Used to shorten the queries (and the residual stream) between blocks."""
    check_positive("stride", stride)
    n = x.shape[0]
    check_mask_shape("mask", mask, (n,))
    length = ceil_div(n, stride) * stride
    real = valid_keys(mask, n, length)
    xb = to_blocks(pad_to(x.astype(jnp.float32), length), stride)
    w = to_blocks(real, stride).astype(jnp.float32)
    count = w.sum(1)
    wb = w.reshape(*w.shape, *([1] * (x.ndim - 1)))
    pooled = (xb * wb).sum(1) / jnp.maximum(count, 1).reshape(-1, *([1] * (x.ndim - 1)))
    return pooled.astype(x.dtype), count > 0


def funnel_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    stride: int = 2,
    kv_mask: Bool[ArrayLike, "_seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "pooled heads d_v"]:
    """Funnel attention: queries mean-pooled by `stride` attend the full keys and values,
    so the output is `ceil(seq / stride)` long (Dai et al., 2020, "pool-query-only").
    Time O(N^2 / stride)."""
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    pooled, _ = funnel_pool(q, stride, kv_mask)
    return softmax_attention(pooled, k, v, kv_mask=kv_mask, scale=scale)


__all__ = [
    "funnel_attention",
    "funnel_pool",
    "induced_attention",
    "latent_attention",
]
