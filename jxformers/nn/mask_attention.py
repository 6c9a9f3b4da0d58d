"""Mask Attention Networks' dynamic mask attention (Fan et al. 2021, "Mask Attention
Networks: Rethinking and Strengthen Transformer", NAACL, section 3).

The paper reads self-attention (SAN) and the FFN as attention under a static mask (all
ones; the identity) and adds a third sublayer, the dynamic mask attention network (DMAN),
whose mask is learned per head, per query token and per distance:

    M[h, t, s] = sigmoid(x_t w + P[s - t] + U[h])                      (the paper's eq. 12)
    DMAN(x)_t  = sum_s  M[h,t,s] exp(q_t k_s / sqrt(d)) v_s / sum_s M[h,t,s] exp(q_t k_s / sqrt(d))

for each head h: softmax attention with log M added to the logits. The model's block is
then DMAN -> SAN -> FFN, each a residual branch with its norm (`Block`'s pre-attention
sublayer, `stack.dman`). `P` holds one scalar per signed distance (P[0] = 0, the authors'
fairseq code's `self_x`), `w` is a d_model -> 1 map of the query token, `U` one scalar per head.

`dynamic_mask_logits` is the mask's logit alone; `DynamicMaskAttention` the residual
sublayer with its own softmax attention, decoded token by token (its mask's row from the
step's token and the cached positions).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.attention import Attention, AttentionState
from jxformers.nn.cells import sublayer
from jxformers.nn.layers import Norm, make_norm
from jxformers.nn.produced import Produced


def dynamic_mask_logits(
    gate: Float[Array, " seq"],
    distance_bias: Float[Array, " distances"],
    head_bias: Float[Array, " heads"],
    q_pos: Int[Array, " seq"],
    kv_pos: Int[Array, " kv"],
) -> Float[Array, "heads seq kv"]:
    """x_t w + P[s - t] + U[h], the logit of DMAN's mask for queries at `q_pos` (with
    their `gate` = x_t w) and keys at `kv_pos`. `distance_bias` holds P for the
    distances -(D - 1) .. D - 1 (D = (len + 1) // 2, P[0] its middle entry); a distance
    beyond D - 1 takes the last one (clipped)."""
    reach = (distance_bias.shape[0] - 1) // 2
    distance = jnp.clip(kv_pos[None, :] - q_pos[:, None], -reach, reach)
    return gate[None, :, None] + distance_bias[distance + reach][None] + head_bias[:, None, None]


class DynamicMaskAttention(eqx.Module):
    """DMAN as a residual sublayer (Fan et al. 2021):

        pre-norm:  x + dropout(DMAN(LN(x)))
        post-norm: LN(x + dropout(DMAN(x)))         (the paper's and the authors' default)

    Arguments (constructor): `d_model`, `num_heads`, `max_len` (the longest sequence:
    P holds 2 max_len - 1 distances), `causal` (a language model's), `norm` and
    `norm_eps` (the block's kind), `pre_norm`, `dropout` (on the branch's output),
    `key`. Its attention is the dense softmax (the mask multiplies each probability) with
    no rotary or bias positions: P is its position signal.

    Shapes: `__call__(x [n, d], mask [n])` -> `[n, d]`; `step(x [d], cache)` ->
    (`[d]`, cache), the cache that of `init_state(max_len, dtype)`.
    """

    attention: Attention
    gate: Float[Array, " d_model"]
    distance_bias: Float[Array, " distances"]
    head_bias: Float[Array, " heads"]
    norm: Norm
    dropout: eqx.nn.Dropout
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        max_len: int,
        causal: bool = False,
        norm: str = "layernorm",
        norm_eps: float | None = None,
        pre_norm: bool = False,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if max_len < 1:
            raise ValueError(f"DMAN needs max_len >= 1 for its distance terms; got {max_len=}")
        k_attn, k_gate, k_dist, k_head = jax.random.split(key, 4)
        self.attention = Attention("softmax", d_model, num_heads, causal=causal, key=k_attn)
        # the authors' init: w xavier-uniform (fan_in d, fan_out 1), P and U standard normal, P[0] = 0
        limit = (6.0 / (d_model + 1)) ** 0.5
        self.gate = jax.random.uniform(k_gate, (d_model,), minval=-limit, maxval=limit)
        ahead, behind = jax.random.normal(k_dist, (2, max_len - 1))
        self.distance_bias = jnp.concatenate([behind[::-1], jnp.zeros((1,)), ahead])
        self.head_bias = jax.random.normal(k_head, (num_heads,))
        self.norm = make_norm(norm, d_model, norm_eps)
        self.dropout = eqx.nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def log_mask(self, h: Float[Array, "n d"], q_pos: Int[Array, " n"], kv_pos: Int[Array, " kv"]) -> Array:
        """log M `[heads, n, kv]` for queries h at `q_pos` and keys at `kv_pos`:
        log sigmoid of `dynamic_mask_logits`, added to the attention's logits."""
        gate = (h.astype(jnp.float32) @ self.gate).astype(jnp.float32)
        return jax.nn.log_sigmoid(dynamic_mask_logits(gate, self.distance_bias, self.head_bias, q_pos, kv_pos))

    def _branch(self, x, attend, key, inference, mask=None):
        f = lambda h: (attend(h), Produced())  # noqa: E731
        out, _ = sublayer(
            x, f, self.norm, pre_norm=self.pre_norm, dropout=self.dropout, key=key, inference=inference, mask=mask
        )
        return out

    def __call__(
        self,
        x: Float[Array, "n d"],
        mask: Bool[Array, " n"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "n d"]:
        pos = jnp.arange(x.shape[0])

        def attend(h):
            bias = self.log_mask(h, pos, pos).astype(h.dtype)
            return self.attention(h, kv_mask=mask, bias=bias, inference=inference)

        return self._branch(x, attend, key, inference, mask)

    def init_state(self, max_len: int, dtype: Any) -> AttentionState:
        """The decoding state: the attention's key/value cache for `max_len` tokens."""
        return self.attention.init_decode_state(max_len, dtype)

    def step(self, x: Float[Array, " d"], state: AttentionState) -> tuple[Float[Array, " d"], AttentionState]:
        """One token through the sublayer (inference): (its output, the new state)."""
        out = {}

        def attend(h):
            bias_fn = lambda q_pos, kv_pos: self.log_mask(h[None], q_pos, kv_pos).astype(h.dtype)  # noqa: E731
            y, out["state"] = self.attention.decode_step(h, state, bias_fn=bias_fn)
            return y

        return self._branch(x, attend, None, True), out["state"]
