"""Set Transformer's attention blocks (Lee et al. 2019, section 3):

    MAB(X, Y)  = LayerNorm(H + rFF(H)),  H = LayerNorm(X + Multihead(X, Y, Y))
    ISAB_m(X)  = MAB(X, H),  H = MAB(I, X)          I: m learned inducing points
    PMA_k(Z)   = MAB(S, rFF(Z))                     S: k learned seed vectors

Each MAB is a full attention block with its own query/key/value/output projections,
residuals, LayerNorms and row-wise feed-forward network. ISAB is permutation-equivariant
and costs O(N m); PMA pools a set into k vectors, invariant to the set's order. `ISAB`
is a block of `Encoder` (ModelConfig stack "isab"); `PMA` is a `Classifier`
pooling (ModelConfig head "pma"). `pre_norm=True` moves each LayerNorm to the branch's input
(X + Multihead(LN(X), Y)), a variant the paper does not define.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers.nn.attention import Attention
from jxformers.nn.layers import FeedForward, Norm, make_norm, split_key


class MAB(eqx.Module):
    """Multihead attention block: `x` attends to `y`, then a row-wise FFN; each branch
    with a residual and a norm (after it as the paper; before it with `pre_norm`).

    Arguments (constructor): `d_model`, `num_heads`, `d_ff`, `ffn` (kind), `norm`,
    `pre_norm`, `dropout` (on each branch's output), `d_y` (the width of `y`; None:
    d_model), `key`.

    `mab(x [nx, d_model], y [ny, d_y], *, y_mask [ny]) -> [nx, d_model]`; padded
    rows of `y` (y_mask False) are never read. O(nx * ny * d).
    """

    attention: Attention
    ffn: FeedForward
    norms: tuple[Norm, Norm]
    dropout: eqx.nn.Dropout
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = False,
        dropout: float = 0.0,
        d_y: int | None = None,
        key: PRNGKeyArray,
    ):
        ka, kf = jax.random.split(key)
        self.attention = Attention("softmax", d_model, num_heads, cross=True, d_context=d_y, key=ka)
        self.ffn = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kf)
        self.norms = (make_norm(norm, d_model), make_norm(norm, d_model))
        self.dropout = eqx.nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def _residual(self, f, norm, x, key, inference):
        if self.pre_norm:
            return x + self.dropout(f(norm(x)), key=key, inference=inference)
        return norm(x + self.dropout(f(x), key=key, inference=inference))

    def __call__(
        self,
        x: Float[Array, "nx d_model"],
        y: Float[Array, "ny d_y"],
        *,
        y_mask: Bool[Array, " ny"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "nx d_model"]:
        k1, k2, k3 = split_key(key, 3)
        h = self._residual(lambda q: self.attention(q, y, kv_mask=y_mask), self.norms[0], x, k1, inference)
        return self._residual(lambda z: self.ffn(z, key=k3, inference=inference), self.norms[1], h, k2, inference)


class ISAB(eqx.Module):
    """Induced set attention block: ISAB_m(X) = MAB(X, MAB(I, X)), with m learned
    inducing points I `[m, d_model]` and two MABs, each with its own weights.

    A block of `Encoder`: `isab(x [n, d_model], *, kv_mask [n]) -> [n, d_model]`,
    permutation-equivariant over the real rows; padded rows (kv_mask False) are not
    read. Non-causal (every output reads the whole set). O(N m d).
    """

    inducing: Float[Array, "m d_model"]
    mab_in: MAB
    mab_out: MAB

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_inducing: int,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = False,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if num_inducing < 1:
            raise ValueError(f"ISAB needs num_inducing >= 1; got {num_inducing}")
        ki, k1, k2 = jax.random.split(key, 3)
        mab = functools.partial(
            MAB, d_model, num_heads, d_ff=d_ff, ffn=ffn, norm=norm, pre_norm=pre_norm, dropout=dropout
        )
        self.inducing = jax.random.normal(ki, (num_inducing, d_model)) / math.sqrt(d_model)
        self.mab_in = mab(key=k1)
        self.mab_out = mab(key=k2)

    def __call__(
        self,
        x: Float[Array, "n d_model"],
        *,
        kv_mask: Bool[Array, " n"] | None = None,
        bias: None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "n d_model"]:
        k1, k2 = split_key(key, 2)
        h = self.mab_in(self.inducing.astype(x.dtype), x, y_mask=kv_mask, key=k1, inference=inference)
        return self.mab_out(x, h, key=k2, inference=inference)


class PMA(eqx.Module):
    """Pooling by multihead attention: PMA_k(Z) = MAB(S, rFF(Z)) with k learned seed
    vectors S `[k, d_model]`: a set `[n, d_model]` (padded rows excluded by `mask`) to
    `[k, d_model]`, invariant to the order of the set. O(N k d)."""

    seeds: Float[Array, "k d_model"]
    rff: FeedForward
    mab: MAB

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_seeds: int = 1,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = False,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if num_seeds < 1:
            raise ValueError(f"PMA needs num_seeds >= 1; got {num_seeds}")
        ks, kr, km = jax.random.split(key, 3)
        self.seeds = jax.random.normal(ks, (num_seeds, d_model)) / math.sqrt(d_model)
        self.rff = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kr)
        self.mab = MAB(d_model, num_heads, d_ff=d_ff, ffn=ffn, norm=norm, pre_norm=pre_norm, dropout=dropout, key=km)

    def __call__(
        self,
        z: Float[Array, "n d_model"],
        mask: Bool[Array, " n"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "k d_model"]:
        k1, k2 = split_key(key, 2)
        return self.mab(
            self.seeds.astype(z.dtype),
            self.rff(z, key=k1, inference=inference),
            y_mask=mask,
            key=k2,
            inference=inference,
        )
