"""The transformer block: self-attention, optional cross-attention, and a feed-forward
network, each a residual branch with pre- or post-norm placement (seed 004 section 5.2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers import decoding
from jxformers.nn.attention import Attention
from jxformers.nn.layers import FeedForward, LayerNorm, RMSNorm, make_norm

NORM_PLACEMENTS = ("pre", "post")


class Block(eqx.Module):
    """x -> x + SelfAttn(norm(x)) [-> + CrossAttn(norm(.), context)] -> + FFN(norm(.))
    with pre-norm, or norm(x + f(x)) after each branch with post-norm.

    Arguments (constructor): `attention` and `cross_attention` (Attention modules, the
    latter None unless the block reads a context), `ffn`, `norm` ("layernorm" or
    "rmsnorm"), `d_model`, `pre_norm`, `dropout` (on each residual branch).
    """

    attention: Attention
    cross_attention: Attention | None
    ffn: FeedForward
    norms: tuple[LayerNorm | RMSNorm, ...]
    dropout: eqx.nn.Dropout
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self, attention: Attention, ffn: FeedForward, *, d_model: int, norm: str = "layernorm",
        pre_norm: bool = True, cross_attention: Attention | None = None, dropout: float = 0.0,
    ):
        self.attention, self.cross_attention, self.ffn = attention, cross_attention, ffn
        self.norms = tuple(make_norm(norm, d_model) for _ in range(3 if cross_attention is not None else 2))
        self.dropout = eqx.nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def _residual(self, x, branch: Callable[[Array], Array], norm, key, inference):
        if self.pre_norm:
            return x + self.dropout(branch(norm(x)), key=key, inference=inference)
        return norm(x + self.dropout(branch(x), key=key, inference=inference))

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        *,
        kv_mask: Bool[Array, " seq"] | None = None,
        bias: Float[Array, "heads seq seq"] | None = None,
        positions: Int[Array, " seq"] | None = None,
        context: Float[Array, "ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "seq d_model"]:
        keys = [None] * 6 if key is None else list(jax.random.split(key, 6))
        attend = lambda h: self.attention(h, kv_mask=kv_mask, bias=bias, positions=positions, key=keys[0], inference=inference)  # noqa: E731
        x = self._residual(x, attend, self.norms[0], keys[1], inference)
        if self.cross_attention is not None:
            if context is None:
                raise ValueError("this block cross-attends: pass a context")
            cross = self.cross_attention
            attend_ctx = lambda h: cross(h, context, kv_mask=context_mask, key=keys[2], inference=inference)  # noqa: E731
            x = self._residual(x, attend_ctx, self.norms[1], keys[3], inference)
        feed = lambda h: self.ffn(h, key=keys[4], inference=inference)  # noqa: E731
        return self._residual(x, feed, self.norms[-1], keys[5], inference)

    def decode_step(
        self,
        x: Float[Array, " d_model"],
        state: decoding.State,
        *,
        bias_fn: decoding.BiasFn | None = None,
        context_kv: tuple[Array, Array] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
    ) -> tuple[Float[Array, " d_model"], Any]:
        """One token (inference mode): self-attention against the decoding state, then
        cross-attention to the context's precomputed keys/values, then the FFN."""
        out: dict[str, Any] = {}

        def attend(h):
            y, out["state"] = self.attention.decode_step(h, state, bias_fn=bias_fn)
            return y

        x = self._residual(x, attend, self.norms[0], None, True)
        if self.cross_attention is not None:
            assert context_kv is not None
            cross = self.cross_attention
            x = self._residual(x, lambda h: cross.cross_step(h, *context_kv, kv_mask=context_mask), self.norms[1], None, True)
        x = self._residual(x, lambda h: self.ffn(h[None], inference=True)[0], self.norms[-1], None, True)
        return x, out["state"]
