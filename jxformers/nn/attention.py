"""`Attention`: multi-head attention with any registered attention as its core.

The module owns the query/key/value/output projections and the core's own arrays: the
learned ones (Linformer's E/F, Synthesizer's matrices, compressed attention's kernels,
inducing points, RFA's sigma) are parameters; the drawn ones (Performer's and RFA's
projection, BigBird's random-pattern key) are held out of the gradient and resampled
with the pure `redraw(key)`. A core that reads the layer's input tokens
(`spec.reads_tokens`: RFA's gate, the dense Synthesizer) gets the parameters of those
token inputs here too, and the module passes it what they make from its input.
Swapping one attention for another changes nothing else (the "builder" design of
fast-transformers, the code of Katharopoulos et al. 2020, "Transformers are RNNs",
arXiv 2006.16236).

Two more hooks serve the learnable patterns: a core that draws noise in training
(`spec.noise_key`: Sinkhorn's Gumbel noise) gets a fresh key on every call made with a
key and not in inference; a core whose drawn arrays are state updated in training
(`spec.updates_arrays`: Routing's k-means centroids) returns its inputs from `apply` in
training (`Produced.attention_inputs`), so the train step can compute the update outside
the gradient (`nn.update_arrays`).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray, Real

from jxformers import decoding, registry
from jxformers.kernels.alibi import Alibi
from jxformers.nn import cross_layer, heads
from jxformers.nn.average import AverageNetwork, check_aan
from jxformers.nn.layers import LayerNorm, Linear
from jxformers.nn.positions import Rotary
from jxformers.nn.produced import AttentionInputs, Produced
from jxformers.nn.relative import INPUT_KINDS, RelativeTerms, SharedTerms, check_relative
from jxformers.nn.scaling import OUTPUT_PROJECTIONS, PROJECTIONS, SparseQKV, SparseQKVState, check_sparse_qkv
from jxformers.ops._priors import SPAN_LOSS_WEIGHT, span_loss
from jxformers.ops.kernelized import ROTATION_ARGUMENT

# How queries and keys are normalised before the core (see `Attention`).
QK_NORMS = ("none", "l2", "layernorm")
# The decoding state of an `Attention`: its core's, or that wrapped with a sparse QKV layer's window.
AttentionState = decoding.State | SparseQKVState


def check_qk_norm(qk_norm: str, spec: registry.AttentionSpec, length: int | None) -> None:
    """ValueError unless `qk_norm` is one of QK_NORMS and fits the attention: its
    weights must depend on q and k, and QKNorm's g needs a length L >= 2."""
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {QK_NORMS}; got {qk_norm!r}")
    if qk_norm != "none" and not spec.content_based:
        raise ValueError(
            f"qk_norm={qk_norm!r} normalises queries and keys, which {spec.name!r} never compares "
            "(its weights do not depend on q and k)"
        )
    if qk_norm == "l2" and (length is None or length < 2):
        raise ValueError(f"qk_norm='l2' starts its scale at log2(L^2 - L): give qk_norm_length >= 2; got {length}")


def check_input_mixer(
    spec: registry.AttentionSpec,
    *,
    cross: bool = False,
    num_heads: int,
    kv_heads: int | None = None,
    d_head: int | None = None,
    rope: bool = False,
    head_scale: bool = False,
    projection: str = "dense",
    head_options: dict[str, Any] | None = None,
    where: str = "attention",
) -> None:
    """ValueError when `spec` transforms the layer input itself (`spec.mixes_input`,
    FNet) and a setting asks for what such a layer lacks: heads (kv_heads, d_head, head
    options, NormFormer's head scale), queries and keys (rotary positions), projections
    (the sparse QKV layer) or a context (cross-attention). Nothing for other attentions."""
    if not spec.mixes_input:
        return
    defaults = {"collaborative": None, "disagreement": (), "disagreement_weight": 1.0, "head_aggregation": "concat",
                "routing_iterations": 3}  # fmt: skip
    given = {n: v for n, v in (head_options or {}).items() if v != defaults.get(n, v)}
    wanted = {
        "cross-attention": cross,
        f"kv_heads={kv_heads}": kv_heads not in (None, num_heads),
        f"d_head={d_head}": d_head is not None,
        "rotary positions (rope, xpos)": rope,
        "head_scale (norm.placement normformer)": head_scale,
        f"projection={projection!r}": projection != "dense",
        f"head options {given}": bool(given),
    }
    refused = [what for what, on in wanted.items() if on]
    if refused:
        raise ValueError(
            f"{where}: {spec.name!r} transforms the layer input itself, with no heads, projections, queries or "
            f"keys (a parameter-free sublayer); refused with {refused}"
        )


def _check_projection(projection: str, output_projection: str, *, cross: bool, collaborative, aan: bool,
                      **sizes) -> int | None:  # fmt: skip
    """S, the modules of a sparse QKV layer (None for dense projections), after
    ValueErrors for what it cannot serve: cross-attention (its convolutions run over the
    query sequence's positions), collaborative heads and the average attention network
    (their own projections), and the sizes `check_sparse_qkv` refuses."""
    if projection not in PROJECTIONS or output_projection not in OUTPUT_PROJECTIONS:
        raise ValueError(
            f"projection must be one of {PROJECTIONS} and output_projection one of {OUTPUT_PROJECTIONS}; got "
            f"{projection!r}, {output_projection!r}"
        )
    if projection == "dense":
        if output_projection != "dense":
            raise ValueError("output_projection 'none' drops W_O after a sparse QKV layer: set projection 'sparse'")
        return None
    given = {"cross": cross, "collaborative": collaborative is not None, "aan": aan}
    if any(given.values()):
        raise ValueError(
            f"projection 'sparse' (the sparse QKV layer) convolves one sequence's positions into its q, k and v: "
            f"no cross-attention, collaborative heads or aan; got {[n for n, on in given.items() if on]}"
        )
    return check_sparse_qkv(**sizes)


def attention_modules(model) -> list[Attention]:
    """The attention modules of a model, in tree order."""
    is_attention = lambda x: isinstance(x, Attention)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_attention) if is_attention(x)]


class Attention(eqx.Module):
    """Multi-head attention around a registered attention core.

    Arguments (constructor):
        attention: a bound attention (`registry.get(name).bind(...)`), or a registry name
            whose hyper-parameters are `attention_kwargs`.
        d_model: model width; num_heads: query heads; kv_heads: key/value heads
            (grouped-query when fewer; default num_heads); d_head: default d_model // num_heads.
        causal: mask the future (self-attention only).
        cross: keys and values come from a `context` sequence (encoder-decoder).
        d_context: the context's width, read by W_K and W_V (cross-attention only;
            None: d_model). Perceiver's input with Fourier features concatenated.
        rope: rotate q and k by position before the core: a `Rotary` (RoPE with its
            base and context scaling, or xPos, which needs `causal`), True for plain
            RoPE (`Rotary()`), False for none.
        attention_kwargs: the core's hyper-parameters when `attention` is a name.
        qk_norm: how each head's queries and keys are normalised before rotary
            embeddings and the core (one of QK_NORMS). "l2": QKNorm (Henry et al. 2020,
            "Query-Key Normalization for Transformers", arXiv 2010.04245, eq. 3): q and k
            scaled to unit length, the logits g * q^T k with a learned scalar g started
            at log2(L^2 - L), L = `qk_norm_length` (the core receives g sqrt(d_head) q̂
            and k̂, so an op scaling by 1/sqrt(d_k) computes exactly that). "layernorm":
            LayerNorm over d_head on q and on k, each with its own learned gain and bias
            shared by the heads (Dehghani et al. 2023, "Scaling Vision Transformers to 22
            Billion Parameters", arXiv 2302.05442, section 2.1).
        qk_norm_length: L of QKNorm's initial g (the model's max_len).
        collaborative, disagreement, disagreement_weight, head_aggregation,
            routing_iterations: the improved multi-heads of `jxformers.nn.heads`:
            collaborative heads sharing a query/key projection of this size D̃_k, the
            disagreement terms returned (times λ) as layer losses in training, and the
            heads aggregated by routing-by-agreement (dynamic or EM routing) instead of
            concatenated.
        aan_d_ff: the average attention network of Zhang et al. 2018 (`jxformers.nn.average`)
            with an FFN of this hidden width (0: without the FFN), for the attention `average`: the layer input
            itself is averaged (one head of width d_model, no projections), then the FFN
            and the gating layer; None: the plain attention.
        head_scale: NormFormer's head-wise scaling (Shleifer et al. 2021, "NormFormer:
            Improved Transformer Pretraining with Extra Normalization", section 2): each
            head's output (each output capsule with routing) times a learned scalar
            started at 1, before the output projection.
        projection: how q, k, v are made: "dense" (W_Q, W_K, W_V) or "sparse", the
            Scaling Transformer's sparse QKV layer (Jaszczur et al. 2021, section 3.2;
            `jxformers.nn.scaling.SparseQKV`): a multiplicative layer of `modules` S
            modules (None: num_heads), then a convolution per q, k, v of kernel
            `conv_length` (causal, over the positions) x `conv_modules` (over the modules);
            heads of d_model / num_heads, no grouped keys, self-attention only.
            `output_projection` "none" drops W_O after a sparse QKV layer (the authors'
            code's default): the heads' concatenation is the output.
        relative: this layer's part of a relative position scheme (`jxformers.nn.relative`:
            Shaw et al., Transformer-XL's, DeBERTa's score terms, TUPE's content scale),
            for a self-attention whose core takes a bias and compares q with k
            (`check_relative`); its shared part comes as `bias` (`SharedTerms`; TUPE: an
            array). The terms add O(heads * seq * kv) memory. Or FLOATER's per-block part
            (kind "floater", any attention): x + p^(n)(t_i) from `bias` (`SharedTerms.flow`)
            before the projections.
        key: PRNG key for the projections and the core's arrays.

    `__call__(x, context=None, *, kv_mask=None, bias=None, positions=None, key=None,
    inference=False)` maps `x: [seq, d_model]` to `[seq, d_model]` under
    `jax.named_scope(<attention name>)`; `key` only feeds a core that draws noise in
    training (Sinkhorn's Gumbel noise). `apply` takes the same arguments and returns
    `(output, Produced)` (the k-means inputs of a core that updates arrays). Dropout
    belongs to the residual branch around this module (`Block`), not here. Complexity,
    causal and decoding support are the core's (`jxformers list`).
    """

    core: registry.BoundAttention = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)
    d_head: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    cross: bool = eqx.field(static=True)
    rope: Rotary | None = eqx.field(static=True)
    relative: RelativeTerms | None
    qk_norm: str = eqx.field(static=True)
    q_proj: Linear | None  # None: a layer that reuses another's maps (nn.cross_layer), aan, or a sparse QKV layer
    k_proj: Linear | None
    v_proj: Linear | None  # None: the average attention network (aan), which averages x itself
    o_proj: Linear | None  # None: aan, or a sparse QKV layer without W_O
    qkv: SparseQKV | None  # the Scaling Transformer's sparse QKV layer in place of W_Q, W_K, W_V
    arrays: dict[str, Array]
    drawn: dict[str, Array]
    token_params: dict[str, Array]
    q_norm: LayerNorm | None
    k_norm: LayerNorm | None
    qk_scale: Float[Array, ""] | None
    mixing: Float[Array, "heads d_key"] | None
    routing: heads.HeadRouting | heads.HeadEMRouting | None
    aan: AverageNetwork | None
    head_scale: Float[Array, " heads"] | None  # NormFormer's per-head output scale
    disagreement: tuple[str, ...] = eqx.field(static=True)
    disagreement_weight: float = eqx.field(static=True)

    def __init__(
        self,
        attention: str | registry.BoundAttention,
        d_model: int,
        num_heads: int,
        *,
        kv_heads: int | None = None,
        d_head: int | None = None,
        causal: bool = False,
        cross: bool = False,
        d_context: int | None = None,
        rope: bool | Rotary = False,
        attention_kwargs: dict[str, Any] | None = None,
        qk_norm: str = "none",
        qk_norm_length: int | None = None,
        collaborative: int | None = None,
        disagreement: tuple[str, ...] = (),
        disagreement_weight: float = 1.0,
        head_aggregation: str = "concat",
        routing_iterations: int = 3,
        aan_d_ff: int | None = None,
        head_scale: bool = False,
        relative: RelativeTerms | None = None,
        projection: str = "dense",
        modules: int | None = None,
        conv_length: int = 3,
        conv_modules: int = 3,
        output_projection: str = "dense",
        key: PRNGKeyArray,
    ):
        if isinstance(attention, str):
            attention = registry.get(attention).bind(**(attention_kwargs or {}))
        elif attention_kwargs:
            raise ValueError("attention_kwargs go with an attention name; a bound attention already has them")
        if aan_d_ff is not None:
            check_aan(attention.name, cross=cross, d_head=d_head, collaborative=collaborative,
                      disagreement=tuple(disagreement), head_aggregation=head_aggregation)  # fmt: skip
            num_heads, kv_heads, d_head = 1, 1, d_model  # the average of x itself: one head of width d_model
        check_input_mixer(
            attention.spec, cross=cross, num_heads=num_heads, kv_heads=kv_heads, d_head=d_head, rope=bool(rope),
            head_scale=head_scale, projection=projection, head_options={"collaborative": collaborative,
            "disagreement": tuple(disagreement), "disagreement_weight": disagreement_weight,
            "head_aggregation": head_aggregation, "routing_iterations": routing_iterations},
        )  # fmt: skip
        if attention.spec.mixes_input:  # FNet: the op transforms x itself, one "head" of width d_model
            num_heads, kv_heads, d_head = 1, 1, d_model
        kv_heads = num_heads if kv_heads is None else kv_heads
        d_head = d_model // num_heads if d_head is None else d_head
        if num_heads < 1 or kv_heads < 1 or num_heads % kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of kv_heads ({kv_heads})")
        if d_head < 1:
            raise ValueError(f"d_head must be >= 1 (d_model {d_model} // num_heads {num_heads}); got {d_head}")
        attention.check_call(causal=causal, cross=cross)
        rotary = rope if isinstance(rope, Rotary) else Rotary() if rope else None
        if rotary is not None and rotary.kind == "xpos" and not causal:
            raise ValueError(
                "rope=Rotary('xpos') decays q.k by ζ^((m-n)/B) for keys n before the query m: it needs causal "
                f"attention (keys after the query would be scaled up with the distance); got {causal=}"
            )
        check_qk_norm(qk_norm, attention.spec, qk_norm_length)
        if relative is not None:
            check_relative(relative.kind, attention.spec, qk_norm=qk_norm, collaborative=collaborative is not None)
            if rotary is not None or aan_d_ff is not None:
                raise ValueError(f"relative positions ({relative.kind!r}) go with neither rope nor aan")
            if (relative.heads, relative.d_head) != (num_heads, d_head):
                raise ValueError(
                    f"relative terms for {relative.heads} heads of {relative.d_head}; this attention has "
                    f"{num_heads} heads of {d_head}"
                )
        self.relative = relative
        sparse = _check_projection(
            projection, output_projection, d_model=d_model, num_heads=num_heads, kv_heads=kv_heads, d_head=d_head,
            cross=cross, collaborative=collaborative, aan=aan_d_ff is not None, modules=modules,
            conv_length=conv_length, conv_modules=conv_modules,
        )  # fmt: skip
        self.disagreement, self.disagreement_weight = tuple(disagreement), disagreement_weight
        heads.check_head_options(
            attention.spec, collaborative=collaborative, disagreement=self.disagreement,
            disagreement_weight=disagreement_weight, head_aggregation=head_aggregation,
            routing_iterations=routing_iterations, qk_norm=qk_norm, rope=rotary is not None,
        )  # fmt: skip
        kq, kk, kv, ko, ka, kt = jax.random.split(key, 6)
        self.mixing = None if collaborative is None else heads.concatenated_mixing(num_heads, collaborative)
        self.routing = None
        if head_aggregation in heads.ROUTINGS:
            routing = heads.HeadRouting if head_aggregation == "routing" else heads.HeadEMRouting
            self.routing = routing(num_heads, d_head, routing_iterations, key=jax.random.fold_in(ko, 1))
        d_key = d_head if collaborative is None else collaborative
        self.core = attention
        self.num_heads, self.kv_heads, self.d_head = num_heads, kv_heads, d_head
        self.causal, self.cross, self.rope = causal, cross, rotary
        self.q_proj = Linear(d_model, num_heads * d_head if collaborative is None else d_key, key=kq)
        if d_context is not None and not cross:
            raise ValueError(f"d_context ({d_context}) is the width of a cross-attention's context; cross is False")
        d_kv_in = d_model if d_context is None else d_context
        self.k_proj = Linear(d_kv_in, kv_heads * d_head if collaborative is None else d_key, key=kk)
        self.v_proj = Linear(d_kv_in, kv_heads * d_head, key=kv)
        self.o_proj = Linear(num_heads * d_head, d_model, key=ko)
        made = attention.init_arrays(ka, heads=num_heads, kv_heads=kv_heads, d_k=d_key, d_v=d_head)
        drawn = attention.spec.drawn
        self.arrays = {n: a for n, a in made.items() if n not in drawn}
        self.drawn = {n: a for n, a in made.items() if n in drawn}
        if head_scale and aan_d_ff is not None:
            raise ValueError("head_scale scales each head's output; the average attention network (aan) has no heads")
        # NormFormer (Shleifer et al. 2021, section 2): HeadScaleMHA = Concat(g_1 h_1, ..., g_n h_n) W^O, g from 1
        self.head_scale = jnp.ones((num_heads,), jnp.float32) if head_scale else None
        self.aan = None
        if aan_d_ff is not None:
            self.aan = AverageNetwork(d_model, aan_d_ff, key=jax.random.fold_in(ko, 2))
            self.q_proj = self.k_proj = self.v_proj = self.o_proj = None
        if attention.spec.mixes_input:  # a parameter-free sublayer: no W_Q, W_K, W_V, W_O
            self.q_proj = self.k_proj = self.v_proj = self.o_proj = None
        self.qkv = None
        if sparse is not None:
            self.qkv = SparseQKV(
                d_model, modules=sparse, conv_length=conv_length, conv_modules=conv_modules,
                shared_qk=attention.spec.shared_qk, key=jax.random.fold_in(kq, 1),
            )  # fmt: skip
            self.q_proj = self.k_proj = self.v_proj = None
            if output_projection == "none":
                self.o_proj = None
        self.token_params = attention.init_token_params(
            kt, d_model=d_model, heads=num_heads, kv_heads=kv_heads, d_k=d_key, d_v=d_head, causal=causal
        )
        self.qk_norm = qk_norm
        layer_norms = qk_norm == "layernorm"
        self.q_norm = LayerNorm(d_head, eps=1e-6) if layer_norms else None
        self.k_norm = LayerNorm(d_head, eps=1e-6) if layer_norms else None
        self.qk_scale = None
        if qk_norm == "l2":
            assert qk_norm_length is not None  # check_qk_norm said so
            self.qk_scale = jnp.asarray(math.log2(qk_norm_length**2 - qk_norm_length), jnp.float32)

    @property
    def name(self) -> str:
        return self.core.name

    @property
    def d_key(self) -> int:
        """The size of the core's queries and keys: d_head, or collaborative heads' D̃_k."""
        return self.d_head if self.mixing is None else self.mixing.shape[1]

    def redraw(self, key: PRNGKeyArray) -> Attention:
        """A copy with the drawn arrays (Performer features, BigBird pattern) resampled."""
        if not self.drawn:
            return self
        made = self.core.init_arrays(key, heads=self.num_heads, kv_heads=self.kv_heads, d_k=self.d_key, d_v=self.d_head)
        return eqx.tree_at(lambda m: m.drawn, self, {n: made[n] for n in self.drawn})

    def _core_arrays(self, queries=None, keys=None) -> dict[str, Any]:
        """The core's arrays, and what its token inputs make of `queries` / `keys`
        (the layer's input tokens, `[len, d_model]`) when it reads tokens."""
        arrays = self.arrays | jax.lax.stop_gradient(self.drawn)
        if queries is None:
            return arrays
        return arrays | self.core.token_arrays(self.token_params, queries, keys)

    def _turned(self, q, k, q_positions, k_positions) -> tuple[Array, Array, dict[str, Array]]:
        """RoPE: q and k turned by position before the core, or, for a core that turns its
        features after its feature map (`linear`, RoFormer eq. 19: it takes `q_rotation`),
        q and k as they are and the tables it turns them with (for its arrays)."""
        assert self.rope is not None
        if ROTATION_ARGUMENT in inspect.signature(self.core.spec.op).parameters:
            d = q.shape[-1]
            return q, k, {"q_rotation": self.rope.table(q_positions, d, keys=False),
                          "k_rotation": self.rope.table(k_positions, d, keys=True)}  # fmt: skip
        return self.rope.queries(q, q_positions), self.rope.keys(k, k_positions), {}

    def _normed(self, x: Float[Array, "n heads d"], which: str) -> Float[Array, "n heads d"]:
        """Queries (`which` "q") or keys ("k") after the module's qk_norm."""
        if self.qk_norm == "none":
            return x
        if self.qk_norm == "layernorm":
            norm = self.q_norm if which == "q" else self.k_norm
            assert norm is not None
            return norm(x)
        assert self.qk_scale is not None
        xf = x.astype(jnp.float32)
        unit = xf * jax.lax.rsqrt(jnp.maximum(jnp.sum(xf * xf, -1, keepdims=True), 1e-12))
        if which == "q":  # g sqrt(d) q̂: the core's 1/sqrt(d_k) leaves g q̂^T k̂
            unit = unit * (self.qk_scale * math.sqrt(self.d_head))
        return unit.astype(x.dtype)

    def _heads(self, x, proj, heads):
        return proj(x).reshape(x.shape[0], heads, self.d_head)

    def _queries(self, x):
        assert self.q_proj is not None, "a layer reusing the maps (stack.attention_maps: lazy) forms no queries"
        if self.mixing is not None:  # collaborative: each head mixes the shared query
            return heads.mixed_queries(self.q_proj(x), self.mixing, self.d_head)
        return self._normed(self._heads(x, self.q_proj, self.num_heads), "q")

    def _keys(self, source):
        assert self.k_proj is not None, "a layer reusing the maps (stack.attention_maps: lazy) forms no keys"
        if self.mixing is not None:
            return heads.shared_keys(self.k_proj(source), self.kv_heads)
        return self._normed(self._heads(source, self.k_proj, self.kv_heads), "k")

    def _out(self, out, x):
        assert self.aan is None, "the average attention network (aan) has no output projection"
        if self.routing is not None:  # output capsules in place of the heads
            out = self.routing(out)
        if self.head_scale is not None:
            out = out * self.head_scale.astype(out.dtype)[None, :, None]
        out = out.reshape(x.shape[0], self.num_heads * self.d_head).astype(x.dtype)
        return out if self.o_proj is None else self.o_proj(out)  # None: a sparse QKV layer without W_O

    def _projected(self, x, source, kv_mask=None):
        """(q, k, v) of the heads, normalised (qk_norm): from W_Q, W_K, W_V, or from the
        sparse QKV layer (self-attention; its padded rows `kv_mask` zeroed before the
        convolutions; a shared-QK core gets k = q, which it does not read)."""
        if self.qkv is None:
            q, k = self._queries(x), self._keys(source)
            return q, k, self._heads(source, self.v_proj, self.kv_heads)
        return self._split_qkv(*self.qkv(x, kv_mask))

    def _split_qkv(self, q, k, v):
        """The sparse QKV layer's `[n, d_model]` outputs as heads, q and k normalised."""
        n = q.shape[0]
        q = self._normed(q.reshape(n, self.num_heads, self.d_head), "q")
        k = q if k is None else self._normed(k.reshape(n, self.kv_heads, self.d_head), "k")
        return q, k, v.reshape(n, self.kv_heads, self.d_head)

    def _relative(self, q, k, q_pos, k_pos, given):
        """(the core's queries, its bias, its extra arrays) under this module's relative
        terms: `given` is the shared part (`SharedTerms`) or, for TUPE, the array bias."""
        assert self.relative is not None
        shared = given if isinstance(given, SharedTerms) else None
        if shared is None and self.relative.kind in ("transformer_xl", "deberta"):
            raise ValueError(
                f"relative position {self.relative.kind!r} needs its shared terms (the model's Positions.shared) "
                f"as the bias; got {type(given).__name__}"
            )
        bias = self.relative.bias(q, k, q_pos, k_pos, shared)
        if bias is None:  # TUPE: the positional correlation comes whole
            bias = None if isinstance(given, SharedTerms) else given
        return self.relative.queries(q, shared), bias, self.relative.arrays(q_pos, k_pos)

    def __call__(self, x, context=None, **kwargs) -> Float[Array, "seq d_model"]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(x, context, **kwargs)[0]

    def apply(
        self,
        x: Float[Array, "seq d_model"],
        context: Float[Array, "ctx d_context"] | None = None,
        *,
        kv_mask: Bool[Array, " kv"] | None = None,
        bias: Float[Array, "heads seq kv"] | Alibi | SharedTerms | None = None,
        positions: Real[Array, " seq"] | None = None,
        context_positions: Real[Array, " kv"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced]:
        """Arguments:
            x: `[seq, d_model]` queries (and keys/values for self-attention).
            context: `[ctx, d_context]` keys/values for cross-attention (d_context: d_model
                unless the module was built with another).
            kv_mask: `[kv]` True for real keys (padding mask).
            bias: `[heads, seq, kv]` additive logit bias (ALiBi, T5, TUPE), or the shared
                part of this module's relative terms (`SharedTerms`: Transformer-XL's u, v;
                DeBERTa's P).
            positions, context_positions: token positions for rotary embeddings and
                relative terms (default 0..n-1; fractional ones allowed).
            key, inference: the training noise of a core that draws some
                (`spec.noise_key`); none without a key or at inference.

        Returns:
            `([seq, d_model], Produced)`: in training (not `inference`), a core that
            updates arrays (`spec.updates_arrays`) adds its q, k and kv_mask
            (`Produced.attention_inputs`), a core with an adaptive span its span loss
            (`Produced.layer_losses["span_loss"]`) and a `disagreement` its terms
            (`Produced.layer_losses`); otherwise the `Produced` is empty.
        """
        if (context is None) == self.cross:
            raise ValueError("cross-attention needs a context" if self.cross else "self-attention takes no context")
        with jax.named_scope(self.name):
            if self.aan is not None:  # eq. 1-3 of Zhang et al.: the average of x itself, FFN, gate
                y = x[:, None, :]
                average = self.core(y, y, y, causal=self.causal, kv_mask=kv_mask, bias=bias)[:, 0]  # bias: refused
                return self.aan(x, average), Produced()
            if self.core.spec.mixes_input:  # FNet, MLP-Mixer: the op on x itself, no projections
                y = x[:, None, :]
                out = self.core(y, y, y, arrays=self._core_arrays(), kv_mask=kv_mask, bias=bias)
                return out[:, 0].astype(x.dtype), Produced()
            if self.relative is not None and self.relative.kind in INPUT_KINDS:  # FLOATER: x + p^(n)
                x, bias = self.relative.inputs(x, bias if isinstance(bias, SharedTerms) else None), None
            source = x if context is None else context
            q, k, v = self._projected(x, source, kv_mask)
            if self.rope is not None or self.relative is not None:
                positions = jnp.arange(x.shape[0]) if positions is None else positions
                if context_positions is None:
                    context_positions = positions if context is None else jnp.arange(source.shape[0])
            turn = {}
            if self.rope is not None:
                assert positions is not None and context_positions is not None
                q, k, turn = self._turned(q, k, positions, context_positions)
            arrays = self._core_arrays(x, source) | turn
            if self.relative is not None and self.relative.kind not in INPUT_KINDS:
                assert positions is not None and context_positions is not None
                q, bias, extra = self._relative(q, k, positions, context_positions, bias)
                arrays = arrays | extra
            noise = self.core.spec.noise_key
            if noise is not None and key is not None and not inference:
                arrays = arrays | {noise: key}
            out = self.core(q, k, v, arrays=arrays, causal=self.causal, kv_mask=kv_mask, bias=bias)
            produced = Produced()
            if self.core.spec.updates_arrays and not inference:
                produced = Produced(attention_inputs=(AttentionInputs(q, k, kv_mask),))
            if not inference:
                produced = produced + self.span_loss()
            if self.disagreement and not inference:
                produced = produced + self._disagreement(q, k, v, out, arrays, kv_mask, bias, context is None)
            return self._out(out, x), produced

    def span_loss(self) -> Produced:
        """Adaptive span's L1 loss on this layer's spans (Sukhbaatar et al. 2019), when its
        core has one: `{"span_loss": lambda * mean_h z_h}` in `Produced.layer_losses`."""
        hp = self.core.hyper_parameters
        span = hp.get("adaptive_span")
        if span is None:
            return Produced()
        weight = hp.get("span_loss_weight", SPAN_LOSS_WEIGHT)
        return Produced(layer_losses={"span_loss": span_loss(self.arrays["span_z"], span, weight)})

    def _disagreement(self, q, k, v, out, arrays, kv_mask, bias, self_attention: bool) -> Produced:
        """The disagreement terms as layer losses (`heads.disagreement_losses`); the query
        rows' padding is kv_mask's in self-attention, unknown (all rows) otherwise."""
        weights = None
        if "position" in self.disagreement:
            weights = heads.attention_weights(
                self.core, q, k, v, arrays=arrays, causal=self.causal, kv_mask=kv_mask, bias=bias
            )
        losses = heads.disagreement_losses(
            self.disagreement, self.disagreement_weight, values=v, outputs=out, weights=weights,
            query_mask=kv_mask if self_attention else None, kv_mask=kv_mask,
        )  # fmt: skip
        return Produced(layer_losses=losses)

    # ------------------------------------------------------------------ decoding

    def init_decode_state(self, max_len: int, dtype=jnp.float32) -> AttentionState:
        """Empty decoding state (a cache, ring buffer or recurrent state; fixed shape),
        with a sparse QKV layer's window around it."""
        if not self.causal:
            raise ValueError("only causal self-attention decodes incrementally")
        inner = self.core.init_state(
            max_len=max_len,
            kv_heads=self.kv_heads,
            d_k=self.d_key,
            d_v=self.d_head,
            arrays=self._core_arrays(),
            dtype=dtype,
        )
        return inner if self.qkv is None else SparseQKVState(self.qkv.init_window(dtype), inner)

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: AttentionState,
        *,
        bias_fn: decoding.BiasFn | SharedTerms | None = None,
    ) -> tuple[Float[Array, " d_model"], AttentionState]:
        """One token through causal self-attention: `x [d_model]` at position
        `state.length`; returns the output `[d_model]` and the new state. `bias_fn`: the
        position bias of the step's row from the positions (ALiBi, T5, TUPE), or the
        shared part of this module's relative terms."""
        with jax.named_scope(self.name):
            if self.aan is not None:  # the running sum of x (eq. 6 of Zhang et al.), FFN, gate
                out, state = self.core.decode_step(x[None], x[None], x[None], state)
                return self.aan(x[None], out.astype(x.dtype))[0], state  # out: [1 head, d_model]
            if self.relative is not None and self.relative.kind in INPUT_KINDS:  # FLOATER: x + p^(n)(t_pos)
                given = bias_fn if isinstance(bias_fn, SharedTerms) else None
                x, bias_fn = self.relative.inputs(x[None], given)[0], None
            window = None
            if self.qkv is not None:  # the convolutions read the window of earlier positions
                if not isinstance(state, SparseQKVState):
                    raise ValueError(f"a sparse QKV layer decodes with a SparseQKVState; got {type(state).__name__}")
                made, window = self.qkv.step(x, state.window)
                (q, k, v), state = self._split_qkv(*made), state.inner
            else:
                q, k, v = self._projected(x[None], x[None])
            assert not isinstance(state, SparseQKVState), "dense projections decode with their core's state alone"
            turn = {}
            if self.rope is not None:  # the cache keeps keys turned at their own position
                pos = state.length[None]
                q, k, turn = self._turned(q, k, pos, pos)
            arrays = self._core_arrays(x[None], x[None]) | turn
            if self.relative is not None and self.relative.kind not in INPUT_KINDS:
                q, bias_fn, extra = self._relative_step(q, k, v, state, bias_fn)
                arrays = arrays | extra
            assert not isinstance(bias_fn, SharedTerms)  # only relative terms read it
            out, state = self.core.decode_step(q[0], k[0], v[0], state, arrays=arrays, bias_fn=bias_fn)
            if window is not None:
                state = SparseQKVState(window, state)
            return self._out(out[None], x[None])[0], state

    def _relative_step(self, q, k, v, state, given):
        """(the core's query, the step's bias function, its extra arrays) under this
        module's relative terms, for one token against a key/value cache: the terms of the
        step's row read the cache's keys as the decoder is about to hold them (this token's
        written to its slot), at the positions the decoder passes."""
        assert self.relative is not None
        if not isinstance(state, decoding.KVCache):
            raise ValueError(
                f"relative position {self.relative.kind!r} decodes against a key/value cache; {self.name!r} keeps a "
                f"{type(state).__name__}"
            )
        if self.relative.kind == "tupe":  # its bias depends on the positions alone
            return self.relative.queries(q, None), given, {}
        shared = given if isinstance(given, SharedTerms) else None
        keys = decoding.cache_append(state, k[0], v[0]).k

        def step_bias(q_pos, kv_pos):
            assert self.relative is not None
            bias = self.relative.bias(q, keys, q_pos, kv_pos, shared)
            assert bias is not None
            return bias

        return self.relative.queries(q, shared), step_bias, self.relative.step_arrays()

    def cross_step(
        self,
        x: Float[Array, " d_model"],
        k: Float[Array, "ctx kv_heads d_key"],
        v: Float[Array, "ctx kv_heads d_head"],
        *,
        kv_mask: Bool[Array, " ctx"] | None = None,
    ) -> Float[Array, " d_model"]:
        """One query through cross-attention against keys/values projected once
        (`project_context`)."""
        with jax.named_scope(self.name):
            q = self._queries(x[None])
            out = self.core(q, k, v, arrays=self._core_arrays(x[None], None), kv_mask=kv_mask)
            return self._out(out, x[None])[0]

    def project_context(self, context: Float[Array, "ctx d_context"]) -> tuple[Array, Array]:
        """The keys and values of a cross-attention context, computed once for decoding."""
        k = self._keys(context)
        return k, self._heads(context, self.v_proj, self.kv_heads)

    # ------------------------------------------------------------------ cross-layer maps

    def apply_maps(
        self,
        x: Float[Array, "seq d_model"],
        maps: cross_layer.Maps | None,
        *,
        role: str,
        kv_mask: Bool[Array, " kv"] | None = None,
        bias: Float[Array, "heads seq kv"] | Alibi | None = None,
        positions: Real[Array, " seq"] | None = None,
        combine: Any = None,
    ) -> tuple[Float[Array, "seq d_model"], cross_layer.Maps]:
        """Self-attention that reads and hands on cross-layer attention maps
        (`jxformers.nn.cross_layer`; dense softmax, `check_maps`). `role` "residual":
        `maps` are the previous layer's scores (None in the first layer), this layer's
        come back; "lazy": this layer's probabilities come back; "reuse": `maps` are
        those probabilities, used with this layer's values, and come back unchanged;
        "predictive": `combine(own, maps)` (`cross_layer.Evolve`) makes this layer's
        logits from its own scores and the previous layer's, and they come back."""
        if self.qkv is not None:
            raise ValueError("attention maps carried between layers are formed from dense projections, not sparse QKV")
        with jax.named_scope(self.name):
            v = self._heads(x, self.v_proj, self.kv_heads)
            if role == "reuse":
                if maps is None:
                    raise ValueError("a layer that reuses attention maps needs them (LazyFormer); got maps=None")
                return self._out(cross_layer.reused_attention(maps, v, kv_mask=kv_mask), x), maps
            q = self._normed(self._heads(x, self.q_proj, self.num_heads), "q")
            k = self._normed(self._heads(x, self.k_proj, self.kv_heads), "k")
            if self.rope is not None:
                positions = jnp.arange(x.shape[0]) if positions is None else positions
                q, k = self.rope.queries(q, positions), self.rope.keys(k, positions)
            q = self._map_queries(q)
            prev = None if role == "lazy" else maps
            out, scores, probs = cross_layer.map_attention(
                q, k, v, prev=prev, kv_mask=kv_mask, bias=bias, causal=self.causal, combine=combine
            )
            return self._out(out, x), probs if role == "lazy" else scores

    def _map_queries(self, q):
        """The queries of a layer that carries maps: TUPE's content scale (its bias comes
        as an array); the relative terms computed inside are refused (`check_relative`)."""
        if self.relative is None:
            return q
        if self.relative.kind != "tupe":
            raise ValueError(f"relative position {self.relative.kind!r} cannot carry attention maps (check_relative)")
        return self.relative.queries(q, None)

    def decode_step_maps(
        self,
        x: Float[Array, " d_model"],
        state: decoding.KVCache,
        maps: cross_layer.Maps | None,
        *,
        role: str,
        bias_fn: decoding.BiasFn | SharedTerms | None = None,
    ) -> tuple[Float[Array, " d_model"], decoding.KVCache, cross_layer.Maps]:
        """`apply_maps` for one token at position `state.length` against a key/value
        cache of every position; `maps` and the result are that token's row
        `[heads, 1, slots]`."""
        with jax.named_scope(self.name):
            v = self._heads(x[None], self.v_proj, self.kv_heads)
            if role == "reuse":
                if maps is None:
                    raise ValueError("a layer that reuses attention maps needs them (LazyFormer); got maps=None")
                state = decoding.cache_append(state, state.k[0], v[0])
                out = cross_layer.reused_attention(maps, state.v, kv_mask=state.slot_pos >= 0)
                return self._out(out, x[None])[0], state, maps
            q = self._normed(self._heads(x[None], self.q_proj, self.num_heads), "q")
            k = self._normed(self._heads(x[None], self.k_proj, self.kv_heads), "k")
            if self.rope is not None:
                pos = state.length[None]
                q, k = self.rope.queries(q, pos), self.rope.keys(k, pos)
            q = self._map_queries(q)  # refuses the kinds whose shared terms come as bias_fn
            assert not isinstance(bias_fn, SharedTerms)
            state = decoding.cache_append(state, k[0], v[0])
            bias = None if bias_fn is None else bias_fn(state.length[None] - 1, jnp.maximum(state.slot_pos, 0))
            prev = maps if role == "residual" else None
            out, scores, probs = cross_layer.map_attention(
                q, state.k, state.v, prev=prev, kv_mask=state.slot_pos >= 0, bias=bias
            )
            return self._out(out, x[None])[0], state, scores if role == "residual" else probs
