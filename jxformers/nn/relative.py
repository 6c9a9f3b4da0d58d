"""Relative positions that act inside every attention (Lin et al. 2021, "A Survey of
Transformers", arXiv 2106.04554, section 5.1.2): score terms computed from each layer's
own queries (and keys) and the distance j - i, added to the content logits q_i k_j^T.

* "shaw": Shaw, Uszkoreit & Vaswani 2018, "Self-Attention with Relative Position
  Representations", eq. 3-4: e_ij = q_i (k_j + a^K_ij)^T / sqrt(d) and
  z_i = sum_j p_ij (v_j + a^V_ij), a^K_ij = w^K_{clip(j - i, -k, k)} (a^V alike): 2k + 1
  learned vectors of the head size for keys and as many for values, per layer, shared by
  the heads (the paper's section 3.3 shares them across heads).
* "transformer_xl": Dai et al. 2019, "Transformer-XL: Attentive Language Models Beyond a
  Fixed-Length Context", section 3.3: A_ij = (q_i + u)^T k_j + (q_i + v)^T W_{k,R} R_{i-j}
  over 1/sqrt(d), terms (a) + (c) and (b) + (d) of the paper, R the sinusoid of the
  distance, W_{k,R} per layer, u and v per head shared by every layer (as the
  `transformer_xl` stack, `jxformers.nn.transformer_xl`, whose math this is:
  `relative_sinusoid` and `distance_term` serve both).
* "deberta": He, Liu, Gao & Chen 2021, "DeBERTa: Decoding-enhanced BERT with Disentangled
  Attention", eq. 4: A_ij = Q^c_i K^c_j^T + Q^c_i K^r_{δ(i,j)}^T + K^c_j Q^r_{δ(j,i)}^T
  over sqrt(3d) (content-to-content, content-to-position, position-to-content),
  δ(i, j) = clip(i - j + k, 0, 2k - 1), Q^r = P W_{q,r} and K^r = P W_{k,r} with P
  `[2k, d_model]` shared by every layer and W_{q,r}, W_{k,r} per layer. DeBERTa v1's
  linear buckets, or v2's log buckets (`position_buckets` b > 0): δ(i, j) =
  clip(bucket(i - j) + b, 0, 2b - 1), `log_buckets`, and P `[2b, d_model]`.
* "tupe": Ke, He & Liu 2021, "Rethinking Positional Encoding in Language Pre-training":
  the positional correlation is a bias computed once per forward from absolute positions
  (`jxformers.nn.positions.UntiedPositions`); inside the attention only the content
  logits change, scaled by 1/sqrt(2d) instead of 1/sqrt(d).

FLOATER (Liu et al. 2020, `jxformers.nn.floater`) is absolute, not relative, but travels
the same way: the model solves every block's position p^(n)(t_i) at once and hands the
solution to the blocks as `SharedTerms.flow`; each attention's `RelativeTerms` (kind
"floater", its block index `layer`) adds its block's row to the attention's input before
the projections, and nothing else (any attention takes it).

How they reach the attention core: each term is a logit bias `[heads, q, kv]` (the
core's `bias`, after its 1/sqrt(d_k)), the scale of the content logits is folded into the
queries (TUPE 1/sqrt(2), DeBERTa 1/sqrt(3); Transformer-XL's u is added to them), and
Shaw's value term, which changes the output and not the scores, is the core's
`relative_values` argument (a^V; `jxformers.ops.softmax_attention` adds each row's
probability mass per clipped distance times a^V). So an attention that takes them must
take a bias and compare queries with keys (`check_relative`; softmax today), Shaw's also
`relative_values`. What the layers share (Transformer-XL's u and v, DeBERTa's P) is a
`SharedTerms` held by the model's `Positions`, handed to the blocks where an array bias
would go; `RelativeTerms` is one attention's own part.

Memory: every term is a dense `[heads, q, kv]` array beside the attention's own logits,
O(h n^2) (so no flash kernel: a dense bias rules it out); the per-distance tables before
the gather are O(h n k) (Shaw, DeBERTa: 2k + 1 or 2k labels) and O(h n (n + kv)) for
Transformer-XL (every distance of the grid). Decoding (causal, against a key/value cache)
costs O(slots * d) per step for Shaw and DeBERTa, and O(slots * d_model * d) for
Transformer-XL, whose W_{k,R} R_t is projected for every distance of the cache at each
step (as its own stack does for its memory).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from jxformers import registry
from jxformers.nn.layers import Linear

# The kinds whose terms each attention computes from its own q (and k) and parameters,
# and TUPE, whose positional correlation is an array bias but whose content logits the
# attention scales.
RELATIVE_KINDS = ("shaw", "transformer_xl", "deberta")
SCORE_KINDS = (*RELATIVE_KINDS, "tupe")
# Positions each attention adds to its input (x + p^(n)) from the model's solution: FLOATER.
INPUT_KINDS = ("floater",)
# The content logits q k^T / sqrt(d) are divided further by sqrt of this (the papers' 1/sqrt(3d), 1/sqrt(2d)).
_CONTENT_DIVISOR = {"shaw": 1, "transformer_xl": 1, "deberta": 3, "tupe": 2}
# Shaw's k where the config leaves it unset: the clipping distance of the paper's experiments.
SHAW_MAX_DISTANCE = 16


def relative_sinusoid(distances: Real[Array, " m"], dim: int) -> Float[Array, "m dim"]:
    """Transformer-XL's R: [sin(d f), cos(d f)] with f_i = 1 / 10000^(2i / dim) (the
    official code's layout: all sines, then all cosines)."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    angle = distances.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], -1)[:, :dim]


def gather_labels(by_label: Float[Array, "h n labels"], labels: Int[Array, "n m"]) -> Float[Array, "h n m"]:
    """by_label[h, i, labels[i, j]]: a term computed once per label (distance, bucket) laid
    out per pair; O(h n m) memory."""
    index = jnp.broadcast_to(labels[None], (by_label.shape[0], *labels.shape))
    return jnp.take_along_axis(by_label, index, axis=2)


def distance_term(
    qv: Float[Array, "n heads d"], r: Float[Array, "t heads d"], index: Int[Array, "n m"]
) -> Float[Array, "heads n m"]:
    """Transformer-XL's terms (b) + (d), (q_i + v)^T W_{k,R} R_t, for every row t of
    `r` = W_{k,R} R (one per distance), then picked at `index[i, j]`, the row of the
    distance between query i and key j: an exact gather (the paper's shift trick computes
    the same numbers). In float32; unscaled."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return gather_labels(jnp.einsum("nhd,thd->hnt", f32(qv), f32(r)), index)


def _distances(q_pos: Real[Array, " n"], k_pos: Real[Array, " m"]) -> Int[Array, "n m"]:
    """i - j per pair, to the nearest integer (a shortened encoder's grid is fractional:
    its distances are rounded as T5's buckets round them)."""
    return jnp.round(q_pos[:, None] - k_pos[None, :]).astype(jnp.int32)


def log_buckets(relative: Int[Array, "*s"], buckets: int, max_position: int) -> Int[Array, "*s"]:
    """DeBERTa v2's log-bucketed relative position (He et al. 2021, the v2/v3 code's
    `make_log_bucket_position(relative_pos, bucket_size, max_position)`): with
    mid = buckets // 2, a distance r with |r| <= mid is kept, a longer one becomes
    sign(r) (ceil(log(|r| / mid) / log((max_position - 1) / mid) (mid - 1)) + mid), so
    |r| = max_position - 1 lands on 2 mid - 1; farther ones keep growing (the callers
    clip). Needs mid >= 1 and max_position - 1 > mid."""
    mid = buckets // 2
    sign = jnp.sign(relative)
    inner = (relative < mid) & (relative > -mid)
    magnitude = jnp.where(inner, mid - 1, jnp.abs(relative)).astype(jnp.float32)
    # both logs in float32 (as HF transformers' torch port): log(a) / log(a) is then exactly 1
    # at |r| = max_position - 1, where a float64 denominator would tip the ceil to the next bucket
    ratio = jnp.log(magnitude / mid) / jnp.log(jnp.asarray((max_position - 1) / mid, jnp.float32))
    log_pos = (jnp.ceil(ratio * (mid - 1)) + mid).astype(relative.dtype)
    return jnp.where(magnitude <= mid, relative, log_pos * sign)


def _per_head(k: Float[Array, "m kv_heads d"], heads: int) -> Float[Array, "m heads d"]:
    """Keys of the kv heads repeated for each query head of their group (grouped-query)."""
    return jnp.repeat(k, heads // k.shape[1], axis=1)


class SharedTerms(eqx.Module):
    """The relative terms' parameters every layer shares, held by the model's `Positions`
    and passed to each attention where a logit bias would go (`Attention.apply`'s `bias`,
    `decode_step`'s `bias_fn`). Transformer-XL: `u`, `v` `[heads, d_head]` (the global
    content and position biases); DeBERTa: `table`, P `[2k, d_model]` (v2's log buckets:
    `[2b, d_model]`); FLOATER: `flow` `[layers, n, d_model]`, every block's p^(n)(t_i) for
    the rows the attentions see (the grid of a forward; one position when decoding)."""

    u: Float[Array, "heads d_head"] | None = None
    v: Float[Array, "heads d_head"] | None = None
    table: Float[Array, "labels d_model"] | None = None
    flow: Float[Array, "layers n d_model"] | None = None

    @staticmethod
    def make(
        kind: str,
        *,
        heads: int,
        d_head: int,
        d_model: int,
        max_distance: int,
        key: PRNGKeyArray,
        position_buckets: int = 0,
    ):
        """The shared parameters of `kind` (None for Shaw and TUPE, which share nothing
        here, and FLOATER, whose `flow` is solved per forward), each ~ N(0, 0.02^2);
        `position_buckets` b > 0: DeBERTa v2's P of 2b rows."""
        ku, kv = jax.random.split(key)
        if kind == "transformer_xl":
            return SharedTerms(
                u=0.02 * jax.random.normal(ku, (heads, d_head)), v=0.02 * jax.random.normal(kv, (heads, d_head))
            )
        if kind == "deberta":
            rows = 2 * (position_buckets or max_distance)
            return SharedTerms(table=0.02 * jax.random.normal(key, (rows, d_model)))
        return None


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
    if kind in INPUT_KINDS:  # FLOATER changes the attention's input only: any attention takes it
        if maps:
            raise ValueError(
                f"position {kind!r} adds each block's own position to its attention's input; the carried "
                "attention maps (stack.attention_maps) are formed by jxformers.nn.cross_layer without it"
            )
        return
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
    its own parameters and how the scheme changes the core's queries, bias and arrays.

    Fields (None where the kind has none): Shaw's `keys` a^K and `values` a^V
    `[2k + 1, d_head]` (~ N(0, 0.02^2)); Transformer-XL's `r_proj` W_{k,R} (d_model ->
    heads * d_head); DeBERTa's `pos_q` W_{q,r} and `pos_k` W_{k,r} (d_model -> heads *
    d_head). `max_distance` k: Shaw's clip, DeBERTa's 2k buckets (with
    `position_buckets` b > 0, DeBERTa v2's log buckets: 2b of them reaching distance k,
    `log_buckets`). FLOATER ("floater"): no parameters here, only `layer`, the row of the
    model's `SharedTerms.flow` this attention adds to its input (`inputs`).

    Shapes: `q [n, heads, d]`, `k [m, kv_heads, d]`, positions `[n]` and `[m]`
    (fractional ones rounded to integer distances); `bias(...) -> [heads, n, m]`, already
    over the core's sqrt(d), and O(h n m) memory. Causal or not: the terms are defined for
    every distance (Transformer-XL's and DeBERTa's for negative ones too: an encoder's keys
    after the query), and the causal mask is the core's.
    """

    kind: str = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    d_head: int = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)
    position_buckets: int = eqx.field(static=True)
    layer: int = eqx.field(static=True)
    keys: Float[Array, "labels d_head"] | None
    values: Float[Array, "labels d_head"] | None
    r_proj: Linear | None
    pos_q: Linear | None
    pos_k: Linear | None

    def __init__(
        self,
        kind: str,
        *,
        d_model: int,
        heads: int,
        d_head: int,
        max_distance: int = 0,
        position_buckets: int = 0,
        layer: int = 0,
        key: PRNGKeyArray,
    ):
        if kind not in (*SCORE_KINDS, *INPUT_KINDS):
            raise ValueError(f"relative position kind must be one of {(*SCORE_KINDS, *INPUT_KINDS)}; got {kind!r}")
        reach = max_distance - 1 > position_buckets // 2  # the log buckets reach k - 1 from b // 2
        if position_buckets and (kind != "deberta" or position_buckets < 2 or not reach):
            raise ValueError(
                "position_buckets b (DeBERTa v2's log buckets) goes with kind 'deberta', b >= 2 and a max_distance "
                f"k > b // 2 + 1 (the log reaches k - 1 from b // 2); got {kind=}, {position_buckets=}, {max_distance=}"
            )
        if kind in ("shaw", "deberta") and (isinstance(max_distance, bool) or max_distance < 1):
            raise ValueError(
                f"position {kind!r} clips distances at k: max_distance must be an int >= 1; got {max_distance}"
            )
        self.kind, self.heads, self.d_head, self.max_distance = kind, heads, d_head, max_distance
        self.position_buckets, self.layer = position_buckets, layer
        self.keys = self.values = self.r_proj = self.pos_q = self.pos_k = None
        k1, k2 = jax.random.split(key)
        if kind == "shaw":
            self.keys = 0.02 * jax.random.normal(k1, (2 * max_distance + 1, d_head))
            self.values = 0.02 * jax.random.normal(k2, (2 * max_distance + 1, d_head))
        elif kind == "transformer_xl":
            self.r_proj = Linear(d_model, heads * d_head, use_bias=False, key=k1)
        elif kind == "deberta":
            self.pos_q = Linear(d_model, heads * d_head, use_bias=False, key=k1)
            self.pos_k = Linear(d_model, heads * d_head, use_bias=False, key=k2)

    def queries(self, q: Float[Array, "n heads d"], shared: SharedTerms | None) -> Float[Array, "n heads d"]:
        """The core's queries: the content logits' scale folded in (DeBERTa 1/sqrt(3),
        TUPE 1/sqrt(2): the core's 1/sqrt(d) then gives 1/sqrt(3d), 1/sqrt(2d)), or
        Transformer-XL's q + u (terms (a) + (c))."""
        if self.kind == "transformer_xl":
            assert shared is not None and shared.u is not None
            return (q.astype(jnp.float32) + shared.u[None]).astype(q.dtype)
        divisor = _CONTENT_DIVISOR[self.kind]
        return q if divisor == 1 else (q.astype(jnp.float32) / math.sqrt(divisor)).astype(q.dtype)

    def bias(
        self,
        q: Float[Array, "n heads d"],
        k: Float[Array, "m kv_heads d"],
        q_pos: Real[Array, " n"],
        k_pos: Real[Array, " m"],
        shared: SharedTerms | None,
    ) -> Float[Array, "heads n m"] | None:
        """The position terms of the logits for these (unscaled) queries and keys at these
        positions, over the core's sqrt(d); None for TUPE (its bias comes whole)."""
        d = q.shape[-1]
        if self.kind == "shaw":  # q_i . a^K_{clip(j - i)} / sqrt(d)
            assert self.keys is not None
            labels = jnp.clip(-_distances(q_pos, k_pos), -self.max_distance, self.max_distance) + self.max_distance
            by_label = jnp.einsum("nhd,ld->hnl", q.astype(jnp.float32), self.keys)
            return gather_labels(by_label, labels) / math.sqrt(d)
        if self.kind == "transformer_xl":  # (q_i + v) . W_{k,R} R_{i-j} / sqrt(d)
            assert shared is not None and shared.v is not None and self.r_proj is not None
            n, m = q.shape[0], k.shape[0]
            low = -(m - 1)  # the distances i - j of a grid of max(n, m) positions: -(m - 1) .. max(n, m) - 1
            span = jnp.arange(low, max(n, m))
            d_model = self.r_proj.weight.shape[1]
            r = self.r_proj(relative_sinusoid(span, d_model)).reshape(span.shape[0], self.heads, d)
            index = jnp.clip(_distances(q_pos, k_pos) - low, 0, span.shape[0] - 1)
            return distance_term(q.astype(jnp.float32) + shared.v[None], r, index) / math.sqrt(d)
        if self.kind == "deberta":  # (Q^c_i K^r_δ(i,j) + K^c_j Q^r_δ(j,i)) / sqrt(3d)
            assert shared is not None and shared.table is not None
            assert self.pos_q is not None and self.pos_k is not None
            span = self.position_buckets or self.max_distance  # v2's att_span: b, or v1's k
            buckets = 2 * span
            rows = shared.table.shape[0]
            if rows != buckets:
                raise ValueError(f"deberta's P has {rows} rows; this layer's k = {span} needs {buckets}")
            q_r = self.pos_q(shared.table).reshape(buckets, self.heads, d)
            k_r = self.pos_k(shared.table).reshape(buckets, self.heads, d)
            delta = jnp.clip(self._bucket(_distances(q_pos, k_pos)) + span, 0, buckets - 1)  # δ(i, j) [n, m]
            delta_t = jnp.clip(self._bucket(_distances(k_pos, q_pos)) + span, 0, buckets - 1)  # δ(j, i) [m, n]
            f32 = jnp.float32
            c2p = gather_labels(jnp.einsum("nhd,rhd->hnr", q.astype(f32), k_r), delta)
            keys = _per_head(k, self.heads).astype(f32)
            p2c = jnp.swapaxes(gather_labels(jnp.einsum("mhd,rhd->hmr", keys, q_r), delta_t), 1, 2)
            return (c2p + p2c) / math.sqrt(3 * d)
        return None

    def _bucket(self, distances: Int[Array, "n m"]) -> Int[Array, "n m"]:
        """DeBERTa's distance as bucketed: as it is (v1), or v2's log bucket."""
        if not self.position_buckets:
            return distances
        return log_buckets(distances, self.position_buckets, self.max_distance)

    def inputs(self, x: Float[Array, "n d_model"], shared: SharedTerms | None) -> Float[Array, "n d_model"]:
        """FLOATER: x + p^(layer)(t_i), this block's row of the model's solution (`[n,
        d_model]`, aligned with x's rows by the model)."""
        if shared is None or shared.flow is None:
            raise ValueError(
                f"position {self.kind!r} needs the model's solved positions (SharedTerms.flow) as the bias; got "
                f"{type(shared).__name__}"
            )
        flow = shared.flow[self.layer]
        if flow.shape != x.shape:
            raise ValueError(f"floater: block {self.layer}'s positions have shape {flow.shape}; its input {x.shape}")
        return (x.astype(jnp.float32) + flow).astype(x.dtype)

    def arrays(self, q_pos: Real[Array, " n"], k_pos: Real[Array, " m"]) -> dict[str, Array]:
        """The core's extra arguments: Shaw's a^V (`relative_values`) and the integer
        positions its labels are measured by; none for the others."""
        if self.kind != "shaw":
            return {}
        assert self.values is not None
        return {
            "relative_values": self.values,
            "query_positions": jnp.round(q_pos).astype(jnp.int32),
            "key_positions": jnp.round(k_pos).astype(jnp.int32),
        }

    def step_arrays(self) -> dict[str, Array]:
        """`arrays` for a decoding step, whose positions the cache's decoder passes."""
        return {} if self.values is None else {"relative_values": self.values}
