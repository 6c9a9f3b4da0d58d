"""Relative positions that act inside every attention (Lin et al. 2021, "A Survey of
Transformers", arXiv 2106.04554, section 5.1.2): score terms computed from each layer's
own queries and the distance j - i, added to the content logits q_i k_j^T.

* "shaw": Shaw, Uszkoreit & Vaswani 2018, "Self-Attention with Relative Position
  Representations", eq. 3-4: e_ij = q_i (k_j + a^K_ij)^T / sqrt(d) and
  z_i = sum_j p_ij (v_j + a^V_ij), a^K_ij = w^K_{clip(j - i, -k, k)} (a^V alike): 2k + 1
  learned vectors of the head size for keys and as many for values, per layer, shared by
  the heads (the paper's section 3.3 shares them across heads).

How they reach the attention core: the key term is a logit bias `[heads, q, kv]` (the
core's `bias`, after its 1/sqrt(d_k)), and Shaw's value term, which changes the output
and not the scores, is the core's `relative_values` argument (a^V;
`jxformers.ops.softmax_attention` adds each row's probability mass per clipped distance
times a^V). So an attention that takes them must take a bias and compare queries with
keys (`check_relative`; softmax today) and take `relative_values`. `RelativeTerms` is
one attention's own part (Shaw's vectors are per layer: the model shares nothing).

Memory: the term is a dense `[heads, q, kv]` array beside the attention's own logits,
O(h n^2) (so no flash kernel: a dense bias rules it out); the per-label table before the
gather is O(h n k) (2k + 1 labels). Decoding (causal, against a key/value cache) costs
O(slots * d) per step.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from jxformers import registry

# The kinds whose terms each attention computes from its own q (and k) and parameters.
RELATIVE_KINDS = ("shaw",)
SCORE_KINDS = RELATIVE_KINDS
# Shaw's k where the config leaves it unset: the clipping distance of the paper's experiments.
SHAW_MAX_DISTANCE = 16


def gather_labels(by_label: Float[Array, "h n labels"], labels: Int[Array, "n m"]) -> Float[Array, "h n m"]:
    """by_label[h, i, labels[i, j]]: a term computed once per label (distance, bucket) laid
    out per pair; O(h n m) memory."""
    index = jnp.broadcast_to(labels[None], (by_label.shape[0], *labels.shape))
    return jnp.take_along_axis(by_label, index, axis=2)


def _distances(q_pos: Real[Array, " n"], k_pos: Real[Array, " m"]) -> Int[Array, "n m"]:
    """i - j per pair, to the nearest integer (a shortened encoder's grid is fractional:
    its distances are rounded as T5's buckets round them)."""
    return jnp.round(q_pos[:, None] - k_pos[None, :]).astype(jnp.int32)


def check_relative(
    kind: str,
    spec: registry.AttentionSpec,
    *,
    qk_norm: str = "none",
    collaborative: bool = False,
    maps: bool = False,
    where: str = "attention",
) -> None:
    """ValueError unless position `kind` (one of SCORE_KINDS) fits the attention `spec`
    and the module's options: its terms are logits beside q k^T, so the attention must
    take a logit bias and compare queries with keys; Shaw's value term needs the op's
    `relative_values`."""
    if kind not in SCORE_KINDS:
        raise ValueError(f"relative position kind must be one of {SCORE_KINDS}; got {kind!r}")
    able = registry.names(takes_bias=True, content_based=True)
    if not (spec.takes_bias and spec.content_based):
        why = "takes no logit bias" if not spec.takes_bias else "never compares queries with keys"
        raise ValueError(
            f"position {kind!r} adds score terms to the content logits q k^T, and {where} {spec.name!r} {why}; "
            f"attentions that take them: {able}"
        )
    if kind == "shaw" and not spec.takes_relative_values:
        raise ValueError(
            f"position 'shaw' adds a^V to the values the weights average (Shaw et al. 2018 eq. 3), which {where} "
            f"{spec.name!r} cannot: its op takes no relative_values; ones that do: "
            f"{[n for n in able if registry.get(n).takes_relative_values]}"
        )
    if kind in RELATIVE_KINDS and qk_norm != "none":
        raise ValueError(
            f"position {kind!r} reads each head's projected queries as its paper does; {where}'s "
            f"qk_norm={qk_norm!r} rescales them: use qk_norm 'none'"
        )
    if collaborative:
        raise ValueError(
            f"position {kind!r} works on each head's own queries and keys of the head size; {where}'s collaborative "
            "heads share one query/key projection of another size"
        )
    if maps and kind in RELATIVE_KINDS:
        raise ValueError(
            f"position {kind!r} computes its terms inside each attention; the carried attention maps "
            "(stack.attention_maps) are formed by jxformers.nn.cross_layer from q, k and an array bias, "
            "without them"
        )


class RelativeTerms(eqx.Module):
    """One attention's part of a relative position scheme (see the module docstring):
    its own parameters and how the scheme changes the core's bias and arrays.

    Fields: Shaw's `keys` a^K and `values` a^V `[2k + 1, d_head]` (~ N(0, 0.02^2));
    `max_distance` k, Shaw's clip.

    Shapes: `q [n, heads, d]`, positions `[n]` and `[m]`
    (fractional ones rounded to integer distances); `bias(...) -> [heads, n, m]`, already
    over the core's sqrt(d), and O(h n m) memory. Causal or not: the terms are defined for
    every distance, and the causal mask is the core's.
    """

    kind: str = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    d_head: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)
    keys: Float[Array, "labels d_head"]
    values: Float[Array, "labels d_head"]

    def __init__(self, kind: str, *, heads: int, d_head: int, max_distance: int = 0, key: PRNGKeyArray):
        if kind not in SCORE_KINDS:
            raise ValueError(f"relative position kind must be one of {SCORE_KINDS}; got {kind!r}")
        if kind == "shaw" and (isinstance(max_distance, bool) or max_distance < 1):
            raise ValueError(
                f"position {kind!r} clips distances at k: max_distance must be an int >= 1; got {max_distance}"
            )
        self.kind, self.heads, self.d_head, self.max_distance = kind, heads, d_head, max_distance
        k1, k2 = jax.random.split(key)
        self.keys = 0.02 * jax.random.normal(k1, (2 * max_distance + 1, d_head))
        self.values = 0.02 * jax.random.normal(k2, (2 * max_distance + 1, d_head))

    def bias(
        self, q: Float[Array, "n heads d"], q_pos: Real[Array, " n"], k_pos: Real[Array, " m"]
    ) -> Float[Array, "heads n m"]:
        """The position term of the logits for these queries at these positions, over
        the core's sqrt(d): q_i . a^K_{clip(j - i)} / sqrt(d)."""
        labels = jnp.clip(-_distances(q_pos, k_pos), -self.max_distance, self.max_distance) + self.max_distance
        by_label = jnp.einsum("nhd,ld->hnl", q.astype(jnp.float32), self.keys)
        return gather_labels(by_label, labels) / math.sqrt(q.shape[-1])

    def arrays(self, q_pos: Real[Array, " n"], k_pos: Real[Array, " m"]) -> dict[str, Array]:
        """The core's extra arguments: Shaw's a^V (`relative_values`) and the integer
        positions its labels are measured by."""
        return {
            "relative_values": self.values,
            "query_positions": jnp.round(q_pos).astype(jnp.int32),
            "key_positions": jnp.round(k_pos).astype(jnp.int32),
        }

    def step_arrays(self) -> dict[str, Array]:
        """`arrays` for a decoding step, whose positions the cache's decoder passes."""
        return {"relative_values": self.values}
