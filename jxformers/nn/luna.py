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

`LunaStack` is one element of an `Encoder`'s or `LanguageModel`'s blocks (ModelConfig
stack "luna").
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
    `causal`, `dropout` (on each branch's output), `key`.
    """

    pack: Pack
    unpack: Attention
    ffn: FeedForward
    norms: tuple[Norm, Norm, Norm]  # x after attention, p, x after FFN
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
        key: PRNGKeyArray,
    ):
        kp, ku, kf = jax.random.split(key, 3)
        self.pack = Pack(d_model, num_heads, key=kp)
        self.unpack = Attention("softmax", d_model, num_heads, cross=True, key=ku)
        self.ffn = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kf)
        self.norms = tuple(make_norm(norm, d_model) for _ in range(3))
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

    def __call__(
        self,
        x: Float[Array, "n d_model"],
        p: Float[Array, "l d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "n d_model"], Float[Array, "l d_model"]]:
        """Returns `(x', p')`; padded rows of x (kv_mask False) are never packed. Causal:
        p' is p (see the module docstring)."""
        kx, kp, kf, kh = split_key(key, 4)
        xn = self.norms[0](x) if self.pre_norm else x
        pn = self.norms[1](p) if self.pre_norm else p
        if self.causal:
            y_x = jax.vmap(self.unpack_one)(xn, self.pack.prefixes(pn, xn, kv_mask))
        else:
            y_p = self.pack(pn, xn, kv_mask=kv_mask)
            y_x = self.unpack(xn, y_p)
            p = self._residual(p, y_p, self.norms[1], kp, inference)
        x = self._residual(x, y_x, self.norms[0], kx, inference)
        ffn_in = self.norms[2](x) if self.pre_norm else x
        return self._residual(x, self.ffn(ffn_in, key=kh, inference=inference), self.norms[2], kf, inference), p

    def decode_step(
        self, x: Float[Array, " d_model"], p: Float[Array, "l d_model"], state: dict[str, Array]
    ) -> tuple[Float[Array, " d_model"], dict[str, Array]]:
        """Causal Luna, one token: add its pack to the running sum, unpack from the mean."""
        xn = self.norms[0](x) if self.pre_norm else x
        pn = self.norms[1](p) if self.pre_norm else p
        one = self.pack.prefixes(pn, xn[None])[0]  # this token's own pack term
        state = {"sum": state["sum"] + one.astype(jnp.float32), "count": state["count"] + 1}
        y_x = self.unpack_one(xn, (state["sum"] / state["count"]).astype(x.dtype))
        x = self._residual(x, y_x, self.norms[0], None, True)
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
                key=k,
            )
            for k in jax.random.split(kb, num_layers)
        )
        self.causal = causal

    def layers(
        self,
        x: Float[Array, "n d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "n d_model"], list[Float[Array, "l d_model"]]]:
        """The output and the packed sequence each layer read (`[P_0, P_1, ...]`, one per layer)."""
        p, seen = self.packed.astype(x.dtype), []
        for block, k in zip(self.blocks, split_key(key, len(self.blocks)), strict=True):
            seen.append(p)
            x, p = block(x, p, kv_mask=kv_mask, key=k, inference=inference)
        return x, seen

    def __call__(
        self,
        x: Float[Array, "n d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        bias: None = None,
        positions: Int[Array, " n"] | None = None,
        context: None = None,
        context_mask: None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "n d_model"]:
        return self.layers(x, kv_mask=kv_mask, key=key, inference=inference)[0]

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
        context_kv: None = None,
        context_mask: None = None,
    ) -> tuple[Float[Array, " d_model"], tuple[dict[str, Array], ...]]:
        p, states = self.packed.astype(x.dtype), []
        for block, layer_state in zip(self.blocks, state, strict=True):
            x, layer_state = block.decode_step(x, p, layer_state)
            states.append(layer_state)
        return x, tuple(states)
