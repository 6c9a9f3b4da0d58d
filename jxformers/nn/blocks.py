"""The transformer block: self-attention, optional cross-attention, and a feed-forward
network, each a residual branch with its norms placed as `jxformers.nn.residual` says
(pre, post, sandwich, ReZero, DeepNorm, Admin, Fixup; Lin et al. 2021, "A Survey of Transformers",
arXiv 2106.04554, section 5.2)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Real

from jxformers import decoding
from jxformers.kernels.alibi import Alibi
from jxformers.nn import cross_layer, residual
from jxformers.nn.attention import Attention, AttentionState
from jxformers.nn.layers import FeedForward, Norm, make_norm, normalise
from jxformers.nn.layouts import FeedForwardSublayer, run_sublayers
from jxformers.nn.local import LocalRNN, LocalState
from jxformers.nn.mask_attention import DynamicMaskAttention
from jxformers.nn.moe import MoE
from jxformers.nn.pkm import ProductKeyMemory
from jxformers.nn.produced import Produced, ResidualMoments
from jxformers.nn.relative import SharedTerms, check_relative
from jxformers.nn.scaling import SparseFeedForward

NORM_PLACEMENTS = residual.PLACEMENTS


class Block(eqx.Module):
    """x -> x + SelfAttn(norm(x)) [-> + CrossAttn(norm(.), context)] -> + FFN(norm(.))
    with pre-norm, or norm(x + f(x)) after each branch with post-norm.

    Arguments (constructor): `attention` and `cross_attention` (Attention modules, the
    latter None unless the block reads a context), `ffn`, `norm` ("layernorm" or
    "rmsnorm"), `d_model`, `pre_norm`, `placement` (one of `residual.PLACEMENTS`; it
    overrides `pre_norm`: admin's skip weights start at 1 until `residual.admin_profile`,
    fixup's scalar biases at 0 and multipliers at 1), `dropout` (once on each residual branch's
    output; the attention modules hold none), `norm_eps` (None: the norm's default).
    The FFN may be a FeedForward, the Scaling Transformer's `SparseFeedForward`, a
    mixture of experts (`MoE`) or a `ProductKeyMemory`; the latter two see the token mask.
    `ffn` None drops the FFN sublayer (and its norm): with persistent key/value vectors
    in the attention (`persistent_kv`) the block is the all-attention layer of Sukhbaatar
    et al. 2019 ("Augmenting Self-attention with Persistent Memory", section 4), LN(x + A(x))
    with post-norm. `apply` returns `(output, Produced)`: an MoE's
    aux dict and the k-means inputs of an attention that updates arrays
    (`jxformers.nn.produced`); `__call__` returns the output alone.

    `maps` (one of `cross_layer.MAP_ROLES`, default "none"): the block's part in a stack
    that carries attention maps from layer to layer (RealFormer's residual scores,
    LazyFormer's shared probabilities, the Evolving Attention Transformer's convolved
    logits with `evolve`, its convolution; `jxformers.nn.cross_layer`); such a block runs
    through `apply_maps` and `decode_step_maps`, which take the previous block's maps
    and return its own.

    `local` (default None): sublayers run on x before the self-attention branch, each
    with its own residual and norm: R-Transformer's LocalRNN sublayers (a `LocalRNN`,
    Wang et al. 2019) or Mask Attention Networks' dynamic mask attention (a
    `DynamicMaskAttention`, Fan et al. 2021: the block is DMAN -> SAN -> FFN); the
    decoding state then is a `LocalState` around the attention's.

    `pre_ffns`, `post_ffns` (tuples of `layouts.FeedForwardSublayer`, default empty): FFN
    sublayers of their own before the self-attention branch and after the block's FFN
    (or after its attention, `ffn` None): Macaron's half steps (Lu et al. 2019), the
    f's of a reordered stack (Press et al. 2020; `jxformers.nn.layouts`).
    """

    attention: Attention
    cross_attention: Attention | None
    ffn: FeedForward | SparseFeedForward | MoE | ProductKeyMemory | None
    norms: tuple[Norm, ...]  # one per branch: on its input (pre, sandwich) or after its sum (post, deepnorm)
    out_norms: tuple[Norm | None, ...]  # on each branch's output: sandwich's, normformer's (self-attention)
    resweight: Float[Array, ""] | None  # rezero: the block's residual scalar
    omegas: tuple[Float[Array, " d_model"], ...] | None  # admin: each branch's skip weights (x w + f(x))
    shifts: Float[Array, " branches"] | None  # fixup: each branch's scalar bias on its input
    scales: Float[Array, " branches"] | None  # fixup: each branch's scalar multiplier on its output
    dropout: eqx.nn.Dropout
    evolve: cross_layer.Evolve | None
    local: LocalRNN | DynamicMaskAttention | None
    pre_ffns: tuple[FeedForwardSublayer, ...]
    post_ffns: tuple[FeedForwardSublayer, ...]
    placement: str = eqx.field(static=True)
    alpha: float = eqx.field(static=True)  # deepnorm: the residual's scale
    maps: str = eqx.field(static=True)

    def __init__(
        self,
        attention: Attention,
        ffn: FeedForward | SparseFeedForward | MoE | ProductKeyMemory | None,
        *,
        d_model: int,
        norm: str = "layernorm",
        pre_norm: bool = True,
        cross_attention: Attention | None = None,
        dropout: float = 0.0,
        norm_eps: float | None = None,
        maps: str = "none",
        evolve: cross_layer.Evolve | None = None,
        placement: str | None = None,
        alpha: float = 1.0,
        local: LocalRNN | DynamicMaskAttention | None = None,
        pre_ffns: tuple[FeedForwardSublayer, ...] = (),
        post_ffns: tuple[FeedForwardSublayer, ...] = (),
    ):
        placement = placement or ("pre" if pre_norm else "post")
        if placement not in residual.PLACEMENTS:
            raise ValueError(f"placement must be one of {residual.PLACEMENTS}; got {placement!r}")
        if alpha != 1.0 and placement != "deepnorm":
            raise ValueError(f"alpha (the residual's scale) is deepnorm's; got {alpha=} with {placement=}")
        if maps not in cross_layer.MAP_ROLES:
            raise ValueError(f"maps must be one of {cross_layer.MAP_ROLES}; got {maps=}")
        cross_layer.check_maps(maps, attention.core)
        if maps != "none" and attention.relative is not None:
            check_relative(attention.relative.kind, attention.core.spec, maps=True)
        if maps != "none" and attention.cross:
            raise ValueError(f"maps={maps!r} passes self-attention maps on; this block's attention cross-attends")
        if maps != "none" and (attention.mixing is not None or attention.routing is not None or attention.disagreement):
            raise ValueError(
                f"maps={maps!r} forms the maps from plain heads; this block's attention has collaborative heads, "
                "routing or disagreement terms (improved multi-heads), which the carried maps do not take"
            )
        if maps == "predictive" and attention.causal:
            raise ValueError(
                "maps='predictive' convolves the previous layer's maps over the query axis, which would read "
                "later queries' rows: it serves non-causal attention only"
            )
        if evolve is not None and maps != "predictive":
            raise ValueError(f"evolve is the predictive maps' convolution; got it with {maps=}")
        self.maps, self.evolve, self.local = maps, evolve, local
        self.pre_ffns, self.post_ffns = tuple(pre_ffns), tuple(post_ffns)
        self.attention, self.cross_attention, self.ffn = attention, cross_attention, ffn
        branches = 1 + (cross_attention is not None) + (ffn is not None)
        normed = 0 if placement in residual.NORM_FREE else branches
        self.norms = tuple(make_norm(norm, d_model, norm_eps) for _ in range(normed))
        out_normed = {"sandwich": range(branches), "normformer": (0,)}.get(placement, ())
        self.out_norms = tuple(make_norm(norm, d_model, norm_eps) if i in out_normed else None for i in range(branches))
        self.resweight = jnp.zeros((), jnp.float32) if placement == "rezero" else None
        # Admin's weights start at 1 (post-norm) until its profile sets them (residual.admin_profile)
        self.omegas = (
            tuple(jnp.ones((d_model,), jnp.float32) for _ in range(branches)) if placement == "admin" else None
        )
        fixup = placement == "fixup"
        self.shifts = jnp.zeros((branches,), jnp.float32) if fixup else None
        self.scales = jnp.ones((branches,), jnp.float32) if fixup else None
        self.dropout = eqx.nn.Dropout(dropout)
        self.placement, self.alpha = placement, float(alpha)

    @property
    def pre_norm(self) -> bool:
        """Whether each branch's input is normalised (pre, sandwich)."""
        return self.placement in residual.INPUT_NORMED

    def _branch(self, f: Callable[[Array], tuple[Array, Produced]], index: int, x, key, inference, mask=None):
        """(the branch's output, what f produced): dropout(f(N(x))) with pre-norm,
        dropout(N'(f(N(x)))) with sandwich (and normformer's self-attention), a dropout(f(x))
        with rezero, s dropout(f(x - b)) with fixup, dropout(f(x)) with post-norm, deepnorm and admin; `index`
        is the branch's (0 self-attention, then cross-attention, then the FFN). The one dropout of a residual
        branch. `mask`: x's real tokens, for norms that keep batch statistics (`layers.normalise`)."""
        y, produced = f(self._branch_input(x, index, mask))
        if (out_norm := self.out_norms[index]) is not None:
            y = normalise(out_norm, y, mask)
        y = self.dropout(y, key=key, inference=inference)
        if self.resweight is not None:
            y = self.resweight.astype(y.dtype) * y
        if self.scales is not None:
            y = self.scales[index].astype(y.dtype) * y
        return y, produced

    def _branch_input(self, x, index: int, mask=None):
        """What branch `index` reads of x: N(x) with an input norm, x - b with fixup, else x."""
        if self.pre_norm:
            return normalise(self.norms[index], x, mask)
        return x if self.shifts is None else x - self.shifts[index].astype(x.dtype)

    def _residual(self, x, branch_out, index: int, mask=None):
        """x + the branch's output, normalised after the sum with post-norm (alpha x +
        ... with deepnorm, x w + ... with admin); `mask` as `_branch`'s."""
        if self.omegas is not None:
            return normalise(self.norms[index], self._skip(x, index) + branch_out, mask)
        if self.placement in residual.OUTPUT_NORMED:
            summed = x * self.alpha + branch_out if self.alpha != 1.0 else x + branch_out
            return normalise(self.norms[index], summed, mask)
        return x + branch_out

    def _skip(self, x, index: int):
        """Admin's skip term of branch `index`: x w (x `[..., d_model]`)."""
        assert self.omegas is not None
        return x * jnp.broadcast_to(self.omegas[index].astype(x.dtype), x.shape)

    def _moments(self, x, branch_out, index: int, mask) -> Produced:
        """Admin's statistics of branch `index` (`ResidualMoments`: its skip term x w and its
        output over the real rows, `mask` None: all); nothing for the other placements."""
        if self.omegas is None:
            return Produced()
        rows = jnp.ones(x.shape[:1], bool) if mask is None else mask
        weight = rows[:, None].astype(jnp.float32)

        def moments(v):
            v = v.astype(jnp.float32)
            return jnp.stack([weight.sum() * v.shape[-1], (v * weight).sum(), (v * v * weight).sum()])

        skip = self._skip(x, index)
        return Produced(residual_moments=(ResidualMoments(jnp.stack([moments(skip), moments(branch_out)]), (index,)),))

    @property
    def _ffn_index(self) -> int:
        return 1 + (self.cross_attention is not None)

    def project_context(self, context: Float[Array, "ctx d_model"]) -> tuple[Array, Array]:
        """The keys and values its cross-attention reads of a context, computed once for
        decoding (`decode_step`'s `context_kv`)."""
        if self.cross_attention is None:
            raise ValueError("this block does not cross-attend: it has no context to project")
        return self.cross_attention.project_context(context)

    def attention_branch(
        self,
        x: Float[Array, "seq d_model"],
        *,
        kv_mask: Bool[Array, " kv"] | None = None,
        bias: Float[Array, "heads seq kv"] | Alibi | SharedTerms | None = None,
        positions: Real[Array, " seq"] | None = None,
        source: Float[Array, "kv d_model"] | None = None,
        source_positions: Real[Array, " kv"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced]:
        """The self-attention branch without its residual: dropout(attention(norm(x)))
        (pre-norm), and what the attention produced (under the path "attention"). The
        reversible stack calls this and `ffn_branch`.

        With `source` (Funnel's pooling layer: x pooled, source the unpooled stream), the
        keys and values come from norm(source) instead of norm(x) (source itself with
        post-norm); `kv_mask` and `source_positions` are then the source's."""
        # The core's own training noise (Sinkhorn's Gumbel); the dropout key stays as it was.
        noise = None if key is None or inference else jax.random.fold_in(key, 1)
        if source is None:
            attend = lambda h: self.attention.apply(  # noqa: E731
                h, kv_mask=kv_mask, bias=bias, positions=positions, key=noise, inference=inference
            )
        else:
            kv = self._branch_input(source, 0, kv_mask)
            attend = lambda h: self.attention.apply(  # noqa: E731
                h,
                kv,
                kv_mask=kv_mask,
                bias=bias,
                positions=positions,
                context_positions=source_positions,
                key=noise,
                inference=inference,
            )
        y, produced = self._branch(attend, 0, x, key, inference, kv_mask if source is None else None)
        return y, produced.under("attention")

    def ffn_branch(
        self,
        x: Float[Array, "seq d_model"],
        *,
        mask: Bool[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced]:
        """The feed-forward branch without its residual: dropout(ffn(norm(x))) (pre-norm);
        the FFN's own dropout acts on its hidden units. `mask` (True for real tokens)
        reaches an MoE or product-key memory, `token_ids` (the input token of each row,
        `moe.NO_TOKEN` where none) an MoE (hash routing reads them); an MoE's aux dict is
        in the `Produced`."""
        k_hidden, k_out = (None, None) if key is None else jax.random.split(key)

        ffn = self.ffn
        if ffn is None:
            raise ValueError("this block has no FFN sublayer (ffn none): it has no FFN branch")

        def feed(h):
            if isinstance(ffn, (FeedForward, SparseFeedForward)):
                return ffn(h, key=k_hidden, inference=inference), Produced()
            if isinstance(ffn, ProductKeyMemory):
                return ffn(h, mask=mask, key=k_hidden, inference=inference), Produced()
            y, aux = ffn(h, mask=mask, token_ids=token_ids, key=k_hidden, inference=inference)
            return y, Produced(moe=(aux,))

        return self._branch(feed, self._ffn_index, x, k_out, inference, mask)

    def __call__(self, x: Float[Array, "seq d_model"], **kwargs) -> Float[Array, "seq d_model"]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(x, **kwargs)[0]

    def apply(self, x: Float[Array, "seq d_model"], **kwargs) -> tuple[Float[Array, "seq d_model"], Produced]:
        """`apply_maps(x, None, ...)` without the maps: a block of a stack that carries
        none (`maps` "none"), or the first of one (the arguments are `apply_maps`'s)."""
        y, produced, _ = self.apply_maps(x, None, **kwargs)
        return y, produced

    def _maps_branch(self, x, maps, *, kv_mask, bias, positions, key, inference):
        """The self-attention branch of a block that carries maps: (output, its maps)."""
        if self.maps == "predictive" and maps is not None and self.evolve is None:
            raise ValueError("a predictive block after the first needs its convolution (evolve); got None")
        made = {}
        combine = None if self.evolve is None else functools.partial(self.evolve, query_mask=kv_mask)

        def attend(h):
            y, made["maps"] = self.attention.apply_maps(
                h, maps, role=self.maps, kv_mask=kv_mask, bias=bias, positions=positions, combine=combine
            )
            return y, Produced()

        return self._branch(attend, 0, x, key, inference, kv_mask)[0], made["maps"]

    def apply_maps(
        self,
        x: Float[Array, "seq d_model"],
        maps: cross_layer.Maps | None,
        *,
        kv_mask: Bool[Array, " kv"] | None = None,
        bias: Float[Array, "heads seq kv"] | Alibi | SharedTerms | None = None,
        positions: Real[Array, " seq"] | None = None,
        context: Float[Array, "ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        source: Float[Array, "kv d_model"] | None = None,
        source_positions: Real[Array, " kv"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced, cross_layer.Maps | None]:
        """Arguments:
            x: `[seq, d_model]`; maps: the previous block's attention maps
                `[heads, seq, seq]` (None: the first block, or a stack that carries
                none; `jxformers.nn.cross_layer`); kv_mask: `[kv]` True for real keys (kv = seq unless
                `source` is given); bias: `[heads, seq, kv]` logit bias (or the shared part of
                relative terms, `SharedTerms`); positions:
                `[seq]` (and source_positions `[kv]`) for rotary embeddings.
            context, context_mask: the encoder output a cross-attention block reads.
            source: `[kv, d_model]` the sequence self-attention takes its keys and
                values from when it is not x (Funnel's pooling layer); the block's
                attention must then be built with `cross=True`.
            token_ids: `[seq]` the input token id of each row of x (`moe.NO_TOKEN` for
                rows that hold none: CLS, memory tokens), for an MoE FFN that routes by
                token id (hash layers); the models pass them while rows are tokens.

        Returns:
            `([seq, d_model], Produced, maps)`: what the attentions and an MoE FFN made
            besides their outputs (see the class docstring), and this block's maps for
            the next (`maps` itself when the block carries none).
        """
        k_attn, k_cross, k_ffn = (None, None, None) if key is None else jax.random.split(key, 3)
        if self.local is not None:
            if source is not None:
                raise ValueError(
                    "a block with sublayers before its attention (LocalRNN, DMAN) takes no source (Funnel pooling): "
                    "its keys would skip them"
                )
            k_local = None if key is None else jax.random.fold_in(key, 7)
            x = self.local(x, kv_mask, key=k_local, inference=inference)
        if self.pre_ffns:
            if source is not None:
                raise ValueError("a block with FFN sublayers before its attention takes no source (Funnel pooling)")
            x = run_sublayers(self.pre_ffns, x, kv_mask, key=key, inference=inference, salt=11)
        if self.maps == "none":
            out, produced = self.attention_branch(
                x,
                kv_mask=kv_mask,
                bias=bias,
                positions=positions,
                source=source,
                source_positions=source_positions,
                key=k_attn,
                inference=inference,
            )
        else:
            if source is not None:
                raise ValueError(f"a block carrying attention maps ({self.maps!r}) takes no source (Funnel pooling)")
            out, maps = self._maps_branch(
                x, maps, kv_mask=kv_mask, bias=bias, positions=positions, key=k_attn, inference=inference
            )
            produced = Produced()
        rows = kv_mask if source is None else None  # with a source, kv_mask is not x's
        produced = produced + self._moments(x, out, 0, rows)
        x = self._residual(x, out, 0, rows)
        if self.cross_attention is not None:
            if context is None:
                raise ValueError("this block cross-attends: pass a context")
            cross = self.cross_attention
            attend = lambda h: cross.apply(h, context, kv_mask=context_mask, inference=inference)  # noqa: E731
            out, more = self._branch(attend, 1, x, k_cross, inference, rows)
            produced = produced + more.under("cross_attention") + self._moments(x, out, 1, rows)
            x = self._residual(x, out, 1, rows)
        if self.ffn is not None:  # else the all-attention layer (or a reordered stack's s): no FFN sublayer
            out, more = self.ffn_branch(x, mask=rows, token_ids=token_ids, key=k_ffn, inference=inference)
            produced = produced + more + self._moments(x, out, self._ffn_index, rows)
            x = self._residual(x, out, self._ffn_index, rows)
        x = run_sublayers(self.post_ffns, x, rows, key=key, inference=inference, salt=31)
        return x, produced, maps

    def init_decode_state(self, max_len: int, dtype) -> AttentionState | LocalState:
        """The self-attention's empty decoding state (fixed shape); a layer that reuses
        the maps caches its values alone; sublayers before the attention add theirs (LocalRNN
        windows, DMAN's key/value cache)."""
        if self.maps == "reuse":
            a = self.attention
            inner = cross_layer.values_cache(max_len, a.kv_heads, a.d_head, dtype)
        else:
            inner = self.attention.init_decode_state(max_len, dtype)
        return inner if self.local is None else LocalState(self.local.init_state(max_len, dtype), inner)

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: AttentionState | LocalState,
        *,
        bias_fn: decoding.BiasFn | SharedTerms | None = None,
        context_kv: tuple[Array, Array] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        token_id: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, " d_model"], Any]:
        """One token (inference mode): self-attention against the decoding state, then
        cross-attention to the context's precomputed keys/values, then the FFN (`token_id`:
        the token's id, for an MoE that routes by it)."""
        x, state, _ = self.decode_step_maps(
            x, state, None, bias_fn=bias_fn, context_kv=context_kv, context_mask=context_mask, token_id=token_id
        )
        return x, state

    def decode_step_maps(
        self,
        x: Float[Array, " d_model"],
        state: AttentionState | LocalState,
        maps: cross_layer.Maps | None,
        *,
        bias_fn: decoding.BiasFn | SharedTerms | None = None,
        context_kv: tuple[Array, Array] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        token_id: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, " d_model"], Any, cross_layer.Maps | None]:
        """`decode_step` taking the previous block's maps for this token (its row,
        `[heads, 1, slots]`) and returning this block's (`maps` when it carries none)."""
        out: dict[str, Any] = {"maps": maps}
        windows, inner = None, state
        if isinstance(state, LocalState):
            assert self.local is not None
            x, windows = self.local.step(x, state.windows)
            inner = state.inner
        assert not isinstance(inner, LocalState)
        x = run_sublayers(self.pre_ffns, x, inference=True)

        def attend(h):
            if self.maps == "none":
                y, out["state"] = self.attention.decode_step(h, inner, bias_fn=bias_fn)
            else:
                assert isinstance(inner, decoding.KVCache)  # softmax's cache (check_maps)
                y, out["state"], out["maps"] = self.attention.decode_step_maps(
                    h, inner, maps, role=self.maps, bias_fn=bias_fn
                )
            return y, Produced()

        x = self._residual(x, self._branch(attend, 0, x, None, True)[0], 0)
        if self.cross_attention is not None:
            assert context_kv is not None
            cross = self.cross_attention
            step = lambda h: (cross.cross_step(h, *context_kv, kv_mask=context_mask), Produced())  # noqa: E731
            x = self._residual(x, self._branch(step, 1, x, None, True)[0], 1)
        if self.ffn is not None:
            ids = None if token_id is None else token_id[None]
            x = self._residual(x, self.ffn_branch(x[None], token_ids=ids, inference=True)[0][0], self._ffn_index)
        x = run_sublayers(self.post_ffns, x, inference=True)
        state = out["state"] if windows is None else LocalState(windows, out["state"])
        return x, state, out["maps"]
