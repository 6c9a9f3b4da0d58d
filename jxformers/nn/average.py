"""The average attention network (AAN) of Zhang, Xiong & Su 2018, "Accelerating Neural
Transformer via an Average Attention Network" (ACL, arXiv 1805.00631), section 3: the
decoder's self-attention replaced by

    g_j = FFN((1/j) sum_{k<=j} y_k)                       (eq. 1, the average layer)
    i_j, f_j = sigmoid(W [y_j; g_j] + b)                  (eq. 2, W in R^{2d x 2d})
    h~_j = i_j * y_j + f_j * g_j                          (eq. 3, the gating layer)
    h_j = LayerNorm(y_j + h~_j)                           (eq. 4)

with y the layer's input itself (no query, key, value or output projection) and FFN the
position-wise ReLU network of Vaswani et al. 2017. The gate's bias b and the variant
without the FFN (g_j the average itself) are the authors' code's (bzhangGo/transformer-aan,
thumt/models/transformer.py: `linear(..., bias=True)` and `use_ffn`; their README
recommends the variant without the FFN). Decoding keeps the running sum
sum_{k<=j} y_k (eq. 6): O(d) per token, whatever the length.

In jxformers the average is the registered attention `average` (`ops.average_attention`,
its O(1) decoder the running sum), and this module is the rest of the network: an
`Attention` built with `aan_d_ff` (the config's `attention: {name: average, aan: true}`)
holds it in place of its projections. Eq. 4's residual and norm are the `Block`'s: with
`norm.placement: post` the block computes eq. 4 exactly; pre-norm gives y = norm(x) and
x + h~. Non-causal (an encoder) the average is over every real position, a use the paper,
which keeps the encoder's self-attention, does not make.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from jxformers.nn.layers import FeedForward, Linear


def check_aan(
    attention: str,
    *,
    cross: bool = False,
    d_head: int | None = None,
    collaborative: int | None = None,
    disagreement: tuple[str, ...] = (),
    head_aggregation: str = "concat",
    where: str = "attention",
) -> None:
    """ValueError unless the average attention network fits the `attention` (its
    registered name) and the settings beside it: it wraps the cumulative average
    (`average`) of a self-attention layer's own input, with no heads."""
    if attention != "average":
        raise ValueError(
            f"{where}.aan is the average attention network (Zhang et al. 2018), the FFN and gating layer "
            f"around the cumulative average of attention 'average'; got attention {attention!r}"
        )
    if cross:
        raise ValueError(f"{where}.aan replaces self-attention: it averages the layer's own input, not a context")
    heads = {
        "d_head": d_head,
        "collaborative": collaborative,
        "disagreement": disagreement or None,
        "head_aggregation": None if head_aggregation == "concat" else head_aggregation,
    }
    given = {n: v for n, v in heads.items() if v is not None}
    if given:
        raise ValueError(
            f"{where}.aan averages the layer input itself, with no heads or projections, so head settings "
            f"have nothing to act on; got {given}"
        )


class AverageNetwork(eqx.Module):
    """The FFN and gating layer of the average attention network (eq. 1-3 around the
    average the core computes).

    Arguments (constructor): `d_model` (d), `d_ff` (the FFN's hidden width, the model's;
    0: no FFN, g_j the average itself), `key`. `__call__(y [seq, d], average [seq, d])`
    returns h~ `[seq, d]` (eq. 3), where `average` is the cumulative average of y (eq. 1
    before its FFN)."""

    ffn: FeedForward | None  # ReLU, d -> d_ff -> d; None: the authors' variant without it
    gate: Linear  # W and b of eq. 2, [y; g] -> [i; f]

    def __init__(self, d_model: int, d_ff: int, *, key: PRNGKeyArray):
        if isinstance(d_ff, bool) or not isinstance(d_ff, int) or d_ff < 0:
            raise ValueError(f"the average network's FFN width must be an int >= 0 (0: no FFN); got {d_ff=}")
        kf, kg = jax.random.split(key)
        self.ffn = FeedForward(d_model, d_ff, "relu", key=kf) if d_ff else None
        self.gate = Linear(2 * d_model, 2 * d_model, key=kg)

    def __call__(self, y: Float[Array, "seq d"], average: Float[Array, "seq d"]) -> Float[Array, "seq d"]:
        g = average.astype(y.dtype)
        if self.ffn is not None:
            g = self.ffn(g, inference=True)  # eq. 1 (the FFN holds no dropout)
        i, f = jnp.split(jax.nn.sigmoid(self.gate(jnp.concatenate([y, g], axis=-1))), 2, axis=-1)  # eq. 2
        return i * y + f * g  # eq. 3
