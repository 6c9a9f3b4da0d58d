"""Attention with only a prior (Lin et al. 2021, "A Survey of Transformers", section
4.5.5): weights fixed by position, no query-key product.

`hard_gaussian_attention` is You, Sun & Iyyer 2020, "Hard-Coded Gaussian Attention for
Neural Machine Translation" (ACL, arXiv 2005.00742), section 3: head h's weights over
the keys j are a Gaussian N(i + o_h, sigma^2) of the query's position i, normalised
over the keys it may attend; its output is those weights times the values (the
paper's heads centred at i - 1 and i + 1 in the encoder, i - 1 and i in the decoder,
sigma = 1). Queries and keys are not read: only the value and output projections learn.

`average_attention` is the average layer of Zhang, Xiong & Su 2018, "Accelerating Neural
Transformer via an Average Attention Network" (ACL, arXiv 1805.00631), eq. 1 before its
FFN: query j's weights are 1/j on the keys k <= j, the cumulative average of the values
(non-causal: the plain average of every real key, which the paper, replacing only the
decoder's self-attention, never uses). It decodes in O(1) memory: the running sum of the
values and their count (the recurrent state of linear attention with the feature map
phi = 1). The paper's whole network (the average of the layer input itself, its FFN and
the gating layer) is the attention module's setting `aan` (`jxformers.nn.average`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jxformers._arrays import guarded_divide
from jxformers._typing import ArrayLike
from jxformers.decoding import kv_cache, recurrent
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    check_mask_shape,
    check_qkv,
    out_dtype,
    softmax_parts,
    weighted_values,
    zero_padded,
)
from jxformers.ops._priors import default_positions
from jxformers.registry import register
from jxformers.validate import Limits

__all__ = ["average_attention", "hard_gaussian_attention"]


@causal_never_reads_non_finite_future()
def hard_gaussian_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    bias: Float[ArrayLike, "_heads _q_len _kv_len"] | None = None,
    causal: bool = False,
    offsets: tuple[int, ...] = (-1, 1),
    std: float = 1.0,
    query_positions: Int[ArrayLike, " _q_len"] | None = None,
    key_positions: Int[ArrayLike, " _kv_len"] | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Hard-coded Gaussian attention (You et al. 2020).

    Arguments:
        q: `[q_len, heads, d_k]`, read for its shape only.
        k: `[kv_len, kv_heads, d_k]`, read for its shape only.
        v: `[kv_len, kv_heads, d_v]`.
        kv_mask: optional `[kv_len]`, True for real keys.
        bias: optional `[heads, q_len, kv_len]` added to the log-weights (a position bias).
        causal: query i sees keys j <= i (bottom-right aligned).
        offsets: each head's centre offset o_h (head h takes offsets[h % len(offsets)]):
            (-1, 1) the paper's encoder, (-1, 0) its decoder.
        std: sigma of every head's Gaussian (the paper's 1).
        query_positions, key_positions: positions the Gaussian is centred by (default
            the bottom-right aligned indices; the kv-cache decoder passes the step's).

    Returns:
        `[q_len, heads, d_v]`: sum_j N(j; i + o_h, sigma^2) v_j / sum_j N(j; i + o_h,
        sigma^2) over the keys query i may attend (zeros when it may attend none).

    Time O(N^2 d) like softmax attention (the weights are formed, not read from q k^T).
    """
    k, v = zero_padded(k, v, kv_mask)
    check_qkv(q, k, v)
    q_len, heads, _ = q.shape
    kv_len, kv_heads, d_v = v.shape
    check_mask_shape("kv_mask", kv_mask, (kv_len,))
    if query_positions is None and q_len != kv_len:
        raise ValueError(
            f"hard-coded Gaussian attention is self-attention: {q_len=} must equal {kv_len=} "
            "(a decoder passes query_positions for its one query)"
        )
    if not offsets or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets):
        raise ValueError(f"offsets must be a non-empty tuple of ints; got {offsets!r}")
    if not (isinstance(std, (int, float)) and std > 0):
        raise ValueError(f"std must be a number > 0; got {std!r}")
    q_pos, k_pos = default_positions(q_len, kv_len)
    q_pos = q_pos if query_positions is None else jnp.asarray(query_positions)
    k_pos = k_pos if key_positions is None else jnp.asarray(key_positions)
    centre = (
        q_pos[None, :].astype(jnp.float32) + jnp.asarray([offsets[h % len(offsets)] for h in range(heads)])[:, None]
    )
    gap = k_pos[None, None, :].astype(jnp.float32) - centre[:, :, None]  # [heads, q, k]
    s = -(gap**2) / (2.0 * float(std) ** 2)  # log N(j; i + o, sigma^2) up to a constant
    if bias is not None:
        s = s + jnp.asarray(bias, jnp.float32)
    allowed = jnp.ones((q_len, kv_len), bool)
    if kv_mask is not None:
        allowed = allowed & jnp.asarray(kv_mask)[None, :]
    if causal:
        allowed = allowed & (q_pos[:, None] >= k_pos[None, :])
    g = heads // kv_heads
    s = s.reshape(kv_heads, g, q_len, kv_len)  # query head = kv head * g + index (group_heads)
    p = softmax_parts([(s, allowed[None, None])])[0]
    out = weighted_values(p, v, reads=p != 0)  # a far key's Gaussian weight may be exactly 0
    return out.reshape(q_len, heads, d_v).astype(out_dtype(q, k, v))


register(
    "hard_gaussian",
    hard_gaussian_attention,
    family="prior",
    paper="You et al. 2020",
    complexity="O(N^2)",
    content_based=False,
    exact=False,  # its weights are not softmax(q k^T) under any mask
    decoder=kv_cache(hard_gaussian_attention, forward=("offsets", "std"), positions=True),
    docs={
        "offsets": "each head's centre i + o (heads cycle through them): (-1, 1) encoder, (-1, 0) decoder",
        "std": "sigma of the Gaussians",
    },
    limits={"std": Limits(above=0), "offsets": Limits()},
    summary="fixed Gaussian weights around i + offset per head; no q k^T (You et al.)",
)


@causal_never_reads_non_finite_future()
def average_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    causal: bool = False,
) -> Float[Array, "q_len heads d_v"]:
    """Average attention (Zhang et al. 2018, eq. 1 without its FFN).

    Arguments:
        q: `[q_len, heads, d_k]`, read for its shape only.
        k: `[kv_len, kv_heads, d_k]`, read for its shape only.
        v: `[kv_len, kv_heads, d_v]`.
        kv_mask: optional `[kv_len]`, True for real keys (padding leaves the sums and counts).
        causal: query j averages the values k <= j (the paper's cumulative average);
            otherwise every query gets the average of all real values.

    Returns:
        `[q_len, heads, d_v]`: (1/|K_j|) sum_{k in K_j} v_k, K_j the real keys query j may
        attend (zeros when it may attend none); query head h reads kv head h // (heads // kv_heads).

    Time O(N d) (a prefix sum, in float32), memory O(N d); decoding O(d) per token.
    """
    k, v = zero_padded(k, v, kv_mask)
    check_qkv(q, k, v)
    q_len, heads, _ = q.shape
    kv_len, kv_heads, _ = v.shape
    check_mask_shape("kv_mask", kv_mask, (kv_len,))
    if q_len != kv_len:
        raise ValueError(f"average attention is self-attention: {q_len=} must equal {kv_len=}")
    real = jnp.ones((kv_len,), jnp.float32) if kv_mask is None else jnp.asarray(kv_mask, jnp.float32)
    values = jnp.asarray(v, jnp.float32)  # padded values are zeros (zero_padded)
    if causal:
        total, count = jnp.cumsum(values, axis=0), jnp.cumsum(real)
    else:
        total = jnp.broadcast_to(values.sum(0), values.shape)
        count = jnp.broadcast_to(real.sum(), real.shape)
    out = guarded_divide(total, count[:, None])  # [n, kv_heads, d_v]
    return jnp.repeat(out, heads // kv_heads, axis=1).astype(out_dtype(q, k, v))


def _ones(x, arrays, hyper_parameters):
    """phi = 1: linear attention's state becomes (sum of the values, their count)."""
    return jnp.ones((x.shape[0], 1), jnp.float32), None


register(
    "average",
    average_attention,
    family="prior",
    paper="Zhang et al. 2018",
    complexity="O(N)",
    content_based=False,
    exact=False,  # uniform weights are not softmax(q k^T) under any mask
    decoder=recurrent(_ones),
    summary="j <= i, each with weight 1/i: the cumulative average of the values; no q k^T (Zhang et al.)",
)
