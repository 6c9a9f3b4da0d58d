"""Memory attention: attention through a small set of inducing / latent points, and
Funnel-style query pooling (Dai et al., 2020).

The models these ops come from are built whole in `jxformers.nn` (ModelConfig
`stack` kinds): Set Transformer's ISAB and PMA (Lee et al. 2019; `nn/set_transformer.py`),
Luna (Ma et al. 2021; `nn/luna.py`, whose causal pack is `luna_causal_pack` here) and
Perceiver (Jaegle et al. 2021; `nn/perceiver.py`). `induced_attention` is a registered
single-op reduction of ISAB that fits any attention slot.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    pad_to,
    to_blocks,
    valid_keys,
    zero_padded,
)
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import fraction, register

# ----------------------------------------------------------------------------- inducing points


def induced_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    inducing: Float[ArrayLike, "num_inducing heads _d_k"],
    unpack_keys: Float[ArrayLike, "heads _d_v _d_k"] | None = None,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Inducing-point attention in one op: a reduction of Set Transformer's ISAB (Lee et
    al. 2019) to two softmaxes inside one attention module.

    pack:   P = softmax(I K^T) V                      `[m, heads, d_v]` (I = `inducing`)
    unpack: Y = softmax(Q (P W)^T) P                  `[q_len, heads, d_v]`
    where W = `unpack_keys` `[heads, d_v, d_k]` maps packed values to keys (identity
    when omitted, which needs d_v == d_k; the registered attention always learns it).

    Not the paper's ISAB, which is two full attention blocks MAB(X, MAB(I, X)), each
    with its own projections, residual, LayerNorm and feed-forward network: that is
    ModelConfig(stack="isab") (`jxformers.nn.set_transformer.ISAB`). This op keeps
    only the two attentions, so it can replace softmax in any model. Non-causal.

    Time O(N * m * d).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
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
    """The learned inducing points and the unpacking keys (packed values to keys, per
    head: the unpack's own key projection)."""
    check_positive("num_inducing", num_inducing)
    ki, ku = jax.random.split(key)
    return {
        "inducing": jax.random.normal(ki, (num_inducing, heads, d_k)),
        "unpack_keys": jax.random.normal(ku, (heads, d_v, d_k)) / math.sqrt(d_v),
    }


register(
    "induced",
    induced_attention,
    family="memory",
    paper="after Lee et al. 2019: ISAB reduced to one op (the paper's ISAB: ModelConfig stack 'isab')",
    complexity="O(N m)",
    supports_cross=True,
    exact=False,
    init_arrays=induced_arrays,
    docs={"num_inducing": "inducing points m"},
    summary=(
        'pack into m learned inducing points, unpack: ISAB reduced to one op (the paper\'s ISAB is `stack="isab"`)'
    ),
    limits={"num_inducing": 1},
    dense_width=("its inducing points (num_inducing)", lambda hp, n: hp["num_inducing"]),
    scaled=(
        "num_inducing = min(default, N / 8): fewer inducing points than keys (Lee et al. 2019's m = 16 or 32)",
        lambda d, n: {"num_inducing": fraction(n, 8, cap=d["num_inducing"])},
    ),
)


def latent_attention(
    latents: Float[ArrayLike, "num_latents heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "num_latents heads d_v"]:
    """Cross attention from a small latent array to the inputs: Perceiver's encoder and
    Set Transformer's pooling by multihead attention (PMA, with k seed vectors as
    `latents`). O(N * m * d); the output has the latents' length, not the input's."""
    return softmax_attention(latents, k, v, kv_mask=kv_mask, scale=scale)


def luna_causal_pack(
    pack_q: Float[ArrayLike, "packed heads d_k"],
    k: Float[ArrayLike, "n heads _d_k"],
    v: Float[ArrayLike, "_n _heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, " _n"] | None = None,
    scale: float | None = None,
) -> Float[Array, "_n packed heads d_v"]:
    """Luna's causal pack (Ma et al. 2021, section 3.4, as the authors' fairseq code):
    the packed sequence that position t may read, built from positions <= t only,

        Y_P^t[l] = (1 / t) sum_{j <= t} f(P_l . k_j * scale) v_j,   f(x) = softplus(x ln 2) / ln 2

    (f(0) = 1; t counts the real positions up to t, padded ones (kv_mask False) add
    nothing). The pack's softmax over positions is replaced by f and a mean, so every
    prefix's pack is a prefix sum: O(N m d) time and memory for m = `packed` rows.
    `pack_q`: the packed sequence's queries; `k`, `v`: the sequence's pack keys and values.
    """
    check_qkv(pack_q, k, v)
    n = k.shape[0]
    check_mask_shape("kv_mask", kv_mask, (n,))
    if k.shape[1] != pack_q.shape[1]:
        raise ValueError(f"k must have the packed queries' {pack_q.shape[1]} heads; got {k.shape[1]}")
    scale = 1.0 / math.sqrt(pack_q.shape[-1]) if scale is None else scale
    real = valid_keys(kv_mask, n, n)
    logits = jnp.einsum("lhd,nhd->nlh", pack_q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    weights = jnp.where(real[:, None, None], jax.nn.softplus(logits * math.log(2.0)) / math.log(2.0), 0.0)
    sums = jnp.cumsum(weights[..., None] * v.astype(jnp.float32)[:, None], axis=0)
    count = jnp.maximum(jnp.cumsum(real.astype(jnp.float32)), 1.0)
    return (sums / count[:, None, None, None]).astype(v.dtype)


def funnel_pool(
    x: Float[ArrayLike, " n *rest"], stride: int = 2, mask: Bool[ArrayLike, " _n"] | None = None
) -> tuple[Float[Array, " pooled *rest"], Bool[Array, " pooled"]]:
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
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
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
    "luna_causal_pack",
]
