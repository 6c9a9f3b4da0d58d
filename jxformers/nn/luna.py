"""Luna: linear unified nested attention (Ma et al. 2021), a stack of layers that carries
an extra packed sequence P `[l, d_model]` beside the tokens X:

    Y_P = Attn_pack(P, X)          (pack: P's queries read X; O(N l))
    Y_X = Attn_unpack(X, Y_P)      (unpack: X's queries read the packed sequence)
    X_A = LayerNorm(X + Y_X),  P' = LayerNorm(P + Y_P),  X' = LayerNorm(X_A + FFN(X_A))

Pack and unpack are multi-head attentions with their own query/key/value projections;
the unpack has an output projection, the pack none (its heads are concatenated, as the
authors' code: the unpack's key/value projections and P's residual read Y_P directly).
P' is the next layer's P; the first layer's P is learned (`LunaStack.packed`).
Post-norm as the paper; `pre_norm=True` normalises each branch's input instead.

Causal (autoregressive) Luna replaces the pack by `ops.luna_causal_pack`: position t
unpacks from a pack of X_{<=t} only, so no position reads the future. There is then no
single packed output for the whole sequence, so P is not updated: every layer packs with
the learned P (as the authors' decoder, whose P only the encoder attention updates).
Decoding is recurrent: each layer keeps its running pack sum, O(l d) per token.

Encoder-decoder Luna (the paper's machine translation model, section 4.1; its layer as
the authors' fairseq-apollo `LunaDecoderLayer`): each decoder layer runs the causal Luna
self-attention above with the current P, then Luna's attention over the encoder output C,

    Y_PC = Attn_pack(P, C),  X' = LayerNorm(X + Attn_unpack(X, Y_PC)),  P' = LayerNorm(P + Y_PC),

then the FFN; P' is the next layer's P, so P is updated by the encoder attention only.
Decoding precomputes every layer's P and Y_PC from the encoder output (they do not depend
on the target) and keeps the causal running sums.

`LunaStack` is one element of an `Encoder`'s or `LanguageModel`'s blocks (ModelConfig
stack "luna"; a seq2seq decoder's with `cross`).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.attention import Attention
from jxformers.nn.layers import FeedForward, Linear, Norm, make_norm, split_key
from jxformers.ops import luna_causal_pack, softmax_attention


class Pack(eqx.Module):
    """Luna's pack attention: P's queries read X, per head softmax(P Wq (X Wk)^T /
    sqrt(d_head)) X Wv, heads concatenated (no output projection). `pack(p, x)` is the
    non-causal Y_P `[l, d_model]`; `prefixes(p, x)` the causal Y_P^t of every t."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, d_model: int, num_heads: int, *, key: PRNGKeyArray):
        kq, kk, kv = jax.random.split(key, 3)
        self.q_proj, self.k_proj, self.v_proj = (Linear(d_model, d_model, key=k) for k in (kq, kk, kv))
        self.num_heads = num_heads

    def _heads(self, proj, x):
        return proj(x).reshape(*x.shape[:-1], self.num_heads, -1)

    def __call__(
        self, p: Float[Array, "l d_model"], x: Float[Array, "n d_model"], kv_mask: Bool[Array, " n"] | None = None
    ) -> Float[Array, "l d_model"]:
        out = softmax_attention(
            self._heads(self.q_proj, p), self._heads(self.k_proj, x), self._heads(self.v_proj, x), kv_mask=kv_mask
        )
        return out.reshape(p.shape)

    def prefixes(
        self, p: Float[Array, "l d_model"], x: Float[Array, "n d_model"], kv_mask: Bool[Array, " n"] | None = None
    ) -> Float[Array, "n l d_model"]:
        """Y_P^t for every t: `ops.luna_causal_pack`, the pack of x_{<=t} only."""
        out = luna_causal_pack(
            self._heads(self.q_proj, p), self._heads(self.k_proj, x), self._heads(self.v_proj, x), kv_mask=kv_mask
        )
        return out.reshape(x.shape[0], *p.shape)


class LunaBlock(eqx.Module):
    """One Luna layer: `(x [n, d], p [l, d]) -> (x', p')` (see the module docstring).

    Arguments (constructor): `d_model`, `num_heads`, `d_ff`, `ffn`, `norm`, `pre_norm`,
    `causal`, `dropout` (on each branch's output), `cross` (a decoder layer: Luna's
    attention over the encoder output after the self-attention), `key`.
    """

    pack: Pack
    unpack: Attention
    ffn: FeedForward
    norms: tuple[Norm, Norm, Norm]  # x after attention, p, x after FFN
    cross_pack: Pack | None  # a decoder layer's: P's queries read the encoder output
    cross_unpack: Attention | None
    cross_norms: tuple[Norm, Norm] | None  # x and p after the encoder attention
    dropout: eqx.nn.Dropout
    pre_norm: bool = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = False,
        causal: bool = False,
        dropout: float = 0.0,
        cross: bool = False,
        key: PRNGKeyArray,
    ):
        kp, ku, kf, kcp, kcu = jax.random.split(key, 5)
        self.pack = Pack(d_model, num_heads, key=kp)
        self.unpack = Attention("softmax", d_model, num_heads, cross=True, key=ku)
        self.ffn = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kf)
        self.norms = tuple(make_norm(norm, d_model) for _ in range(3))
        self.cross_pack = Pack(d_model, num_heads, key=kcp) if cross else None
        self.cross_unpack = Attention("softmax", d_model, num_heads, cross=True, key=kcu) if cross else None
        self.cross_norms = (make_norm(norm, d_model), make_norm(norm, d_model)) if cross else None
        self.dropout = eqx.nn.Dropout(dropout)
        self.pre_norm, self.causal = pre_norm, causal

    def unpack_one(
        self, x_t: Float[Array, " d_model"], packed_t: Float[Array, "l d_model"]
    ) -> Float[Array, " d_model"]:
        """Position t's unpack: its query attends its own packed sequence Y_P^t."""
        return self.unpack(x_t[None], packed_t)[0]

    # ------------------------------------------------------------------ the layer

    def _residual(self, x, out, norm, key, inference):
        out = self.dropout(out, key=key, inference=inference)
        return x + out if self.pre_norm else norm(x + out)

    def cross_packed(
        self, p: Float[Array, "l d_model"], context: Float[Array, "ctx d_model"], context_mask=None
    ) -> Float[Array, "l d_model"]:
        """A decoder layer's Y_PC = Attn_pack(P, C) over the encoder output (padding unread)."""
        assert self.cross_pack is not None and self.cross_norms is not None
        pn = self.cross_norms[1](p) if self.pre_norm else p
        return self.cross_pack(pn, context, kv_mask=context_mask)

    def next_packed(self, p: Float[Array, "l d_model"], packed: Float[Array, "l d_model"]) -> Float[Array, "l d_model"]:
        """A decoder layer's P' = LayerNorm(P + Y_PC) (at inference: no dropout)."""
        assert self.cross_norms is not None
        return self._residual(p, packed, self.cross_norms[1], None, True)

    def _encoder_attention(self, x, p, packed, key, inference):
        """(x, p) after the encoder attention, given its Y_PC `packed`."""
        assert self.cross_unpack is not None and self.cross_norms is not None
        kx, kp = split_key(key, 2)
        xn = self.cross_norms[0](x) if self.pre_norm else x
        one = xn.ndim == 1  # a decoding step's row
        y_x = self.cross_unpack(xn[None] if one else xn, packed)
        x = self._residual(x, y_x[0] if one else y_x, self.cross_norms[0], kx, inference)
        return x, self._residual(p, packed, self.cross_norms[1], kp, inference)

    def __call__(
        self,
        x: Float[Array, "n d_model"],
        p: Float[Array, "l d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        context: Float[Array, "ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "n d_model"], Float[Array, "l d_model"]]:
        """Returns `(x', p')`; padded rows of x (kv_mask False) are never packed. Causal:
        the self-attention leaves p as it is (see the module docstring); a decoder layer
        (`cross`) then reads `context` (the encoder output; `context_mask`: its real rows)."""
        if (context is None) != (self.cross_pack is None):
            raise ValueError("a Luna decoder layer (cross) reads the encoder output as context; other layers do not")
        kx, kp, kf, kh, kc = split_key(key, 5)
        xn = self.norms[0](x) if self.pre_norm else x
        pn = self.norms[1](p) if self.pre_norm else p
        if self.causal:
            y_x = jax.vmap(self.unpack_one)(xn, self.pack.prefixes(pn, xn, kv_mask))
        else:
            y_p = self.pack(pn, xn, kv_mask=kv_mask)
            y_x = self.unpack(xn, y_p)
            p = self._residual(p, y_p, self.norms[1], kp, inference)
        x = self._residual(x, y_x, self.norms[0], kx, inference)
        if context is not None:
            x, p = self._encoder_attention(x, p, self.cross_packed(p, context, context_mask), kc, inference)
        ffn_in = self.norms[2](x) if self.pre_norm else x
        return self._residual(x, self.ffn(ffn_in, key=kh, inference=inference), self.norms[2], kf, inference), p

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        p: Float[Array, "l d_model"],
        state: dict[str, Array],
        packed: Float[Array, "l d_model"] | None = None,
    ) -> tuple[Float[Array, " d_model"], dict[str, Array]]:
        """Causal Luna, one token: add its pack to the running sum, unpack from the mean;
        a decoder layer then unpacks from its Y_PC `packed` (`cross_packed`, computed once)."""
        xn = self.norms[0](x) if self.pre_norm else x
        pn = self.norms[1](p) if self.pre_norm else p
        one = self.pack.prefixes(pn, xn[None])[0]  # this token's own pack term
        state = {"sum": state["sum"] + one.astype(jnp.float32), "count": state["count"] + 1}
        y_x = self.unpack_one(xn, (state["sum"] / state["count"]).astype(x.dtype))
        x = self._residual(x, y_x, self.norms[0], None, True)
        if packed is not None:
            x, _ = self._encoder_attention(x, p, packed, None, True)
        ffn_in = self.norms[2](x) if self.pre_norm else x
        return self._residual(x, self.ffn(ffn_in[None], inference=True)[0], self.norms[2], None, True), state


class LunaStack(eqx.Module):
    """Luna layers carrying the packed sequence from layer to layer (layer i's packed
    output P' is layer i + 1's P), starting from a learned P `[l, d_model]`.

    `stack(x [n, d], *, kv_mask) -> [n, d]`, so it sits in an `Encoder` or (causal) a
    `LanguageModel` as one block; `layers(x)` also returns every layer's P.
    O(N l d) per layer.
    """

    packed: Float[Array, "l d_model"]
    blocks: tuple[LunaBlock, ...]
    causal: bool = eqx.field(static=True)
    cross: bool = eqx.field(static=True)  # a seq2seq decoder's layers: each reads the encoder output

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_layers: int,
        packed_len: int,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = False,
        causal: bool = False,
        dropout: float = 0.0,
        cross: bool = False,
        key: PRNGKeyArray,
    ):
        if packed_len < 1 or num_layers < 1:
            raise ValueError(f"Luna needs packed_len >= 1 and num_layers >= 1; got {packed_len=}, {num_layers=}")
        kp, kb = jax.random.split(key)
        self.packed = jax.random.normal(kp, (packed_len, d_model)) * d_model**-0.5  # the authors' initialisation
        self.blocks = tuple(
            LunaBlock(
                d_model,
                num_heads,
                d_ff=d_ff,
                ffn=ffn,
                norm=norm,
                pre_norm=pre_norm,
                causal=causal,
                dropout=dropout,
                cross=cross,
                key=k,
            )
            for k in jax.random.split(kb, num_layers)
        )
        self.causal, self.cross = causal, cross

    def layers(
        self,
        x: Float[Array, "n d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        context: Float[Array, "ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "n d_model"], list[Float[Array, "l d_model"]]]:
        """The output and the packed sequence each layer read (`[P_0, P_1, ...]`, one per
        layer); a decoder's (`cross`) layers read the encoder output `context`."""
        p, seen = self.packed.astype(x.dtype), []
        for block, k in zip(self.blocks, split_key(key, len(self.blocks)), strict=True):
            seen.append(p)
            x, p = block(x, p, kv_mask=kv_mask, context=context, context_mask=context_mask, key=k, inference=inference)
        return x, seen

    def __call__(
        self,
        x: Float[Array, "n d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        bias: None = None,
        positions: Int[Array, " n"] | None = None,
        context: Float[Array, "ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "n d_model"]:
        return self.layers(
            x, kv_mask=kv_mask, context=context, context_mask=context_mask, key=key, inference=inference
        )[0]

    def project_context(
        self, context: Float[Array, "ctx d_model"], context_mask: Bool[Array, " ctx"] | None = None
    ) -> tuple[Float[Array, "layers l d_model"], Float[Array, "layers l d_model"]]:
        """What a decoder's layers read of the encoder output, computed once for decoding:
        every layer's P and its Y_PC (neither depends on the target)."""
        if not self.cross:
            raise ValueError("only a Luna decoder (cross) reads an encoder output")
        p, ps, packs = self.packed.astype(context.dtype), [], []
        for block in self.blocks:
            packed = block.cross_packed(p, context, context_mask)
            ps.append(p)
            packs.append(packed)
            p = block.next_packed(p, packed)
        return jnp.stack(ps), jnp.stack(packs)

    def init_decode_state(self, max_len: int, dtype=jnp.float32) -> tuple[dict[str, Array], ...]:
        """Per layer, the running pack sum `[l, d_model]` (float32) and its count: a fixed
        size, whatever `max_len`."""
        if not self.causal:
            raise ValueError("only causal Luna decodes incrementally")
        zero = {"sum": jnp.zeros(self.packed.shape, jnp.float32), "count": jnp.zeros((), jnp.float32)}
        return tuple(dict(zero) for _ in self.blocks)

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: tuple[dict[str, Array], ...],
        *,
        bias_fn: Any = None,
        context_kv: tuple[Array, Array] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
    ) -> tuple[Float[Array, " d_model"], tuple[dict[str, Array], ...]]:
        """One token through the layers; a decoder's `context_kv` is `project_context`'s."""
        if (context_kv is None) == self.cross:
            raise ValueError("a Luna decoder (cross) decodes with its project_context; other stacks without")
        states = []
        for i, (block, layer_state) in enumerate(zip(self.blocks, state, strict=True)):
            p = self.packed.astype(x.dtype) if context_kv is None else context_kv[0][i].astype(x.dtype)
            packed = None if context_kv is None else context_kv[1][i].astype(x.dtype)
            x, layer_state = block.decode_step(x, p, layer_state, packed)
            states.append(layer_state)
        return x, tuple(states)
