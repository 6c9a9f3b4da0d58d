"""Attention maps carried from one layer to the next (Lin et al. 2021, "A Survey of
Transformers", arXiv 2106.04554, section 4.5, cross-layer attention), set by the
transformer stack's `attention_maps` (`TransformerStack` in nn/config/components.py):

* "residual": RealFormer (He, Ravula, Kanagal & Ainslie 2020, "RealFormer: Transformer
  Likes Residual Attention", arXiv 2012.11747, section 3.2): layer l's pre-softmax scores
  are its own scaled logits plus layer l-1's pre-softmax scores, per head,
  S_l = Q_l K_l^T / sqrt(d) + B_l + S_{l-1}, S_0 = 0 (no term in the first layer), and
  the layer attends with softmax(S_l) under the masks. What is carried is S_l: logits
  and the layer's own logit bias (ALiBi, T5), the masks applied afresh in every layer
  and never carried (a masked entry is carried as 0).
* "lazy": LazyFormer (Ying, Ke, He & Liu 2021, "LazyFormer: Self Attention with Lazy
  Update", arXiv 2102.12702): the stack is cut into lazy blocks of
  `lazy_block` layers; the first layer of each computes its attention probabilities
  P = softmax(QK^T / sqrt(d) + B) and the next `lazy_block - 1` layers reuse that P,
  computing only their own values and output, P X W^V_l per head, then W^O_l. They have
  no query or key projections.
* "predictive": the Evolving Attention Transformer (Wang, Yang, Bai, Zhang, Bai, Yu,
  Zhang, Huang & Tong 2021, "Evolving Attention with Residual Convolutions", arXiv
  2102.12895; Lin et al.'s survey calls it the Predictive Attention Transformer): layer l > 1 mixes the previous
  layer's logits into its own and refines the mix by a 3 x 3 convolution over the
  (query, key) plane with the heads as channels (`Evolve`):
  A_in = (1 - beta) S_l + beta A_{l-1}, A_l = alpha CNN(A_in) + (1 - alpha) A_in,
  softmax(A_l); the first layer's A_1 = S_l. The convolution reads the neighbouring
  query rows, the next one included, so causal models are refused.

The maps travel as a value: `[heads, q_len, kv_len]` float32 (the scores or logits, or
LazyFormer's probabilities), passed into each block and returned from it (`Block.apply_maps`,
`Block.decode_step_maps`). They need the whole score matrix, so only the dense softmax
attention (registry name "softmax", no score options, impl auto or xla) carries them
(`check_maps`). In decoding a token's row of the maps is all the next layer needs for
the same token, so nothing is kept between steps beyond each layer's key/value cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers import registry
from jxformers._arrays import group_heads
from jxformers.decoding import KVCache
from jxformers.kernels.alibi import Alibi
from jxformers.ops._common import (
    check_qkv,
    default_scale,
    head_mask,
    logits,
    out_dtype,
    softmax_parts,
    weighted_values,
    zero_padded,
)
from jxformers.ops.softmax import causal_mask

# The stack's `attention_maps`: none, RealFormer's residual scores, LazyFormer's reuse.
MAP_KINDS = ("none", "residual", "lazy", "predictive")
# A block's part in it: "lazy" computes the probabilities a lazy block shares, "reuse" reads them.
MAP_ROLES = ("none", "residual", "lazy", "reuse", "predictive")

Maps = Float[Array, "heads q kv"]


def map_role(kind: str, index: int, lazy_block: int) -> str:
    """Block `index`'s role (one of MAP_ROLES) in a stack whose `attention_maps` is `kind`."""
    if kind not in MAP_KINDS:
        raise ValueError(f"attention_maps must be one of {MAP_KINDS}; got {kind=}")
    if kind == "lazy":
        return "lazy" if index % lazy_block == 0 else "reuse"
    return kind


def check_maps(kind: str, bound: registry.BoundAttention, where: str = "the attention") -> None:
    """ValueError unless `bound` forms the dense score matrix the maps are made of: the
    softmax attention with no score option and no kernel (impl auto or xla)."""
    if kind == "none":
        return
    if bound.name != "softmax":
        raise ValueError(
            f"attention_maps={kind!r} carries each layer's score matrix to the next, which only the dense "
            f"'softmax' attention forms; {where} is {bound.name!r}"
        )
    defaults = registry.get("softmax").bind().hyper_parameters
    changed = {n: v for n, v in bound.hyper_parameters.items() if n != "impl" and v != defaults[n]}
    impl = bound.hyper_parameters.get("impl", "auto")
    if changed or impl not in ("auto", "xla"):
        raise ValueError(
            f"attention_maps={kind!r} computes plain softmax scores itself (no score options, no kernel): "
            f"{where} sets {changed=}, {impl=}"
        )


def map_attention(
    q: Float[Array, "q_len heads d_k"],
    k: Float[Array, "kv_len kv_heads d_k"],
    v: Float[Array, "kv_len kv_heads d_v"],
    *,
    prev: Maps | None = None,
    kv_mask: Bool[Array, " kv_len"] | None = None,
    bias: Float[Array, "heads q_len kv_len"] | Alibi | None = None,
    causal: bool = False,
    combine: Callable[[Maps, Maps], Maps] | None = None,
) -> tuple[Float[Array, "q_len heads d_v"], Maps, Maps]:
    """Dense softmax attention that adds `prev` to its scores and returns them.

    Scores S = q k^T / sqrt(d_k) + bias + prev (each term when given), masked entries
    (padding, the future when `causal`, bottom-right) set to 0; weights P = softmax(S)
    over the allowed keys (a row with none: zeros). `combine(own, prev)` replaces the
    sum with prev (`Evolve`); it receives the layer's own scores with masked entries 0.

    Returns:
        `(out [q_len, heads, d_v], S [heads, q_len, kv_len], P [heads, q_len, kv_len])`,
        S and P in float32. Time and memory O(q_len kv_len heads).
    """
    k, v = (jnp.asarray(a) for a in zero_padded(k, v, kv_mask))
    check_qkv(q, k, v)
    q_len, heads, d_k = q.shape
    kv_len, kv_heads = k.shape[:2]
    allowed = jnp.ones((q_len, kv_len), bool)
    if kv_mask is not None:
        allowed = allowed & kv_mask[None, :]
    if causal:
        allowed = allowed & causal_mask(q_len, kv_len)
    grouped = (kv_heads, heads // kv_heads, q_len, kv_len)  # the logits' [h, g, q, k]
    s = logits(group_heads(q, kv_heads), k, default_scale(d_k, None)).reshape(heads, q_len, kv_len)
    if isinstance(bias, Alibi):
        bias = bias.dense(q_len, kv_len)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    s = jnp.where(allowed, s, 0.0)  # a masked entry carries nothing (no NaN, no inf) onward
    if prev is not None:
        s = jnp.where(allowed, s + prev if combine is None else combine(s, prev), 0.0)
    p = softmax_parts([(s.reshape(grouped), head_mask(allowed))])[0]
    out = weighted_values(p, v).reshape(q_len, heads, v.shape[2]).astype(out_dtype(q, k, v))
    return out, s, p.reshape(heads, q_len, kv_len)


class Evolve(eqx.Module):
    """The Evolving Attention Transformer's step from one layer's attention logits to the
    next (Wang et al. 2021, arXiv 2102.12895; the mixing as in the authors' code,
    `EAAugmentedConv`): with the layer's own scores S and the previous layer's logits A,

        A_in = (1 - beta) S + beta A,    A_out = alpha CNN(A_in) + (1 - alpha) A_in,

    CNN = LeakyReLU(Conv2d(heads -> heads, 3 x 3, zero padding, bias)) over the (query,
    key) plane with the heads as channels. `query_mask` (True for real queries) zeroes
    the rows of padded queries in A_in, so that padding reaches no real row through the
    kernel; masked keys are 0 already (`map_attention`).

    Arguments (constructor): heads; alpha (the convolution's weight), beta (the previous
    layer's); key. Time O(9 heads^2 q kv) per layer.
    """

    weight: Float[Array, "heads heads 3 3"]
    bias: Float[Array, " heads"]
    alpha: float = eqx.field(static=True)
    beta: float = eqx.field(static=True)

    def __init__(self, heads: int, *, alpha: float, beta: float, key: PRNGKeyArray):
        kw, kb = jax.random.split(key)
        bound = 1 / math.sqrt(heads * 9)  # PyTorch's Conv2d initialisation, as the authors'
        self.weight = jax.random.uniform(kw, (heads, heads, 3, 3), minval=-bound, maxval=bound)
        self.bias = jax.random.uniform(kb, (heads,), minval=-bound, maxval=bound)
        self.alpha, self.beta = alpha, beta

    def __call__(self, own: Maps, prev: Maps, query_mask: Bool[Array, " q"] | None = None) -> Maps:
        mixed = (1 - self.beta) * own + self.beta * prev
        if query_mask is not None:
            mixed = jnp.where(query_mask[None, :, None], mixed, 0.0)
        conv = jax.lax.conv_general_dilated(
            mixed[None], self.weight.astype(mixed.dtype), (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )[0]
        refined = jax.nn.leaky_relu(conv + self.bias[:, None, None].astype(mixed.dtype))
        return self.alpha * refined + (1 - self.alpha) * mixed


def reused_attention(
    p: Maps, v: Float[Array, "kv_len kv_heads d_v"], *, kv_mask: Bool[Array, " kv_len"] | None = None
) -> Float[Array, "q_len heads d_v"]:
    """P V per head with given weights `p [heads, q_len, kv_len]` (LazyFormer's upper
    layers); padded values (kv_mask False) are zeroed first."""
    if kv_mask is not None:
        v = jnp.where(kv_mask[:, None, None], v, jnp.zeros((), v.dtype))
    heads, q_len, kv_len = p.shape
    kv_heads = v.shape[1]
    out = weighted_values(p.reshape(kv_heads, heads // kv_heads, q_len, kv_len), v)
    return out.reshape(q_len, heads, v.shape[2]).astype(v.dtype)


def values_cache(max_len: int, kv_heads: int, d_v: int, dtype) -> KVCache:
    """The decoding state of a layer that reuses the maps: its values alone (keys of size 0)."""
    return KVCache(
        jnp.zeros((max_len, kv_heads, 0), dtype),
        jnp.zeros((max_len, kv_heads, d_v), dtype),
        jnp.full((max_len,), -1, jnp.int32),
        jnp.zeros((), jnp.int32),
    )
