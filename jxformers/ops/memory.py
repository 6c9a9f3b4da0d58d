"""Memory and downsampling attention: Nystromformer's landmarks (Xiong et al., 2021),
attention through a small set of inducing / latent points (Set Transformer's ISAB and
PMA, Lee et al. 2019; Luna's pack and unpack, Ma et al. 2021; Perceiver's cross
attention to a latent array, Jaegle et al. 2021) and Funnel-style query pooling
(Dai et al., 2020).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jxformers.ops._common import (
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    default_scale,
    group_heads,
    logits,
    out_dtype,
    pad_to,
    positions,
    softmax_parts,
    to_blocks,
    valid_keys,
    weighted_values,
)
from jxformers.ops.softmax import softmax_attention

# ----------------------------------------------------------------------------- Nystromformer


def segment_means(
    x: Float[Array, "n heads d"], num_segments: int, real: Bool[Array, "n"] | None = None
) -> tuple[Float[Array, "num_segments heads d"], Bool[Array, "num_segments"]]:
    """Means of `num_segments` contiguous segments of near-equal size (segment s covers
    positions [floor(s n / m), floor((s + 1) n / m))), over real positions only; works for
    any n >= 1 (segments may be empty when m > n; those are marked not real)."""
    n = x.shape[0]
    real = jnp.ones((n,), bool) if real is None else real
    bounds = (positions(num_segments + 1) * n) // num_segments
    seg = jnp.sum(bounds[None, 1:-1] <= positions(n)[:, None], axis=1)  # segment of each position
    weights = (seg[None, :] == positions(num_segments)[:, None]) & real[None, :]  # [m, n]
    count = weights.sum(axis=1)
    sums = jnp.einsum("mn,nhd->mhd", weights.astype(jnp.float32), x.astype(jnp.float32))
    means = sums / jnp.maximum(count, 1)[:, None, None]
    return means.astype(x.dtype), count > 0


def iterative_pinv(a: Float[Array, "*b m m"], iterations: int = 6) -> Float[Array, "*b m m"]:
    """Moore-Penrose pseudo-inverse by the iteration of Razavi et al. (2014) used by
    Nystromformer: Z <- Z/4 (13 I - A Z (15 I - A Z (7 I - A Z))), from
    Z0 = A^T / (max row sum * max column sum) (A is row-stochastic here)."""
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    abs_a = jnp.abs(a)
    norm = jnp.max(abs_a.sum(-1), axis=-1) * jnp.max(abs_a.sum(-2), axis=-1)
    z = jnp.swapaxes(a, -1, -2) / norm[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_attention(
    q: Float[Array, "q_len heads d_k"],
    k: Float[Array, "kv_len kv_heads _d_k"],
    v: Float[Array, "_kv_len _kv_heads d_v"],
    *,
    num_landmarks: int,
    kv_mask: Bool[Array, "_kv_len"] | None = None,
    pinv_iterations: int = 6,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Nystromformer attention: softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V,
    with landmarks Q~, K~ the means of `num_landmarks` contiguous segments.

    Arguments:
        q, k, v: as `softmax_attention` (cross attention allowed).
        num_landmarks: m >= 1; any length works (segments of near-equal size).
        kv_mask: optional `[kv_len]`; key landmarks average real keys only, and
            softmax(Q~ K^T) never sees a padded key. (Query landmarks of self-attention
            pass the same mask when q_len == kv_len.)
        pinv_iterations: iterations of `iterative_pinv` (6 in the paper).
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[q_len, heads, d_v]`. With m equal to the length (one token per segment) and a
        converged pseudo-inverse this is exactly softmax attention.

    Time and memory O(N * m * d + m^3). Not causal.
    """
    check_qkv(q, k, v)
    check_positive("num_landmarks", num_landmarks)
    check_positive("pinv_iterations", pinv_iterations, minimum=0)
    kv_len = k.shape[0]
    check_mask_shape("kv_mask", kv_mask, (kv_len,))
    scale = default_scale(q.shape[2], scale)
    real = valid_keys(kv_mask, kv_len, kv_len)
    q_real = real if q.shape[0] == kv_len else None
    kv_heads = k.shape[1]
    q_land, q_land_ok = segment_means(q, num_landmarks, q_real)
    k_land, k_land_ok = segment_means(k, num_landmarks, real)

    def probs(qx, kx, key_ok):
        s = logits(group_heads(qx, kv_heads), kx, scale)  # [h, g, q, k]
        (p,) = softmax_parts([(s, key_ok[None, None, None, :])])
        return p

    k1 = probs(q, k_land, k_land_ok)  # [h, g, N, m]
    k2 = probs(q_land, k_land, k_land_ok)  # [h, g, m, m]
    k3 = probs(q_land, k, real)  # [h, g, m, N]
    k3 = jnp.where(q_land_ok[None, None, :, None], k3, 0.0)
    k2 = jnp.where(q_land_ok[None, None, :, None], k2, 0.0)
    k3v = weighted_values(k3, v)  # [m, h, g, dv]
    k3v = jnp.moveaxis(k3v, 0, 2)  # [h, g, m, dv]
    out = k1 @ (iterative_pinv(k2, pinv_iterations) @ k3v)  # [h, g, N, dv]
    out = jnp.moveaxis(out, 2, 0).reshape(q.shape[0], q.shape[1], v.shape[2])
    if kv_mask is not None:
        out = jnp.where(jnp.any(kv_mask), out, 0.0)
    return out.astype(out_dtype(q, k, v))


# ----------------------------------------------------------------------------- inducing points


def induced_attention(
    q: Float[Array, "q_len heads d_k"],
    k: Float[Array, "kv_len kv_heads _d_k"],
    v: Float[Array, "_kv_len _kv_heads d_v"],
    *,
    inducing: Float[Array, "num_inducing heads _d_k"],
    unpack_keys: Float[Array, "heads _d_v _d_k"] | None = None,
    kv_mask: Bool[Array, "_kv_len"] | None = None,
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


def latent_attention(
    latents: Float[Array, "num_latents heads d_k"],
    k: Float[Array, "kv_len kv_heads _d_k"],
    v: Float[Array, "_kv_len _kv_heads d_v"],
    *,
    kv_mask: Bool[Array, "_kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "num_latents heads d_v"]:
    """Cross attention from a small latent array to the inputs: Perceiver's encoder and
    Set Transformer's pooling by multihead attention (PMA, with k seed vectors as
    `latents`). O(N * m * d); the output has the latents' length, not the input's."""
    return softmax_attention(latents, k, v, kv_mask=kv_mask, scale=scale)


def funnel_pool(
    x: Float[Array, "n *rest"], stride: int = 2, mask: Bool[Array, "_n"] | None = None
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
    q: Float[Array, "seq heads d_k"],
    k: Float[Array, "_seq kv_heads _d_k"],
    v: Float[Array, "_seq _kv_heads d_v"],
    *,
    stride: int = 2,
    kv_mask: Bool[Array, "_seq"] | None = None,
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
    "iterative_pinv",
    "latent_attention",
    "nystrom_attention",
    "segment_means",
]
