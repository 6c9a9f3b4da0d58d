"""The score options the flash kernels compute inside their tiles, written once for the
kernels and the XLA ops (`jxformers.ops._scores` reads them from here):

    softcap   c * tanh(s / c) of the scaled, biased logits (Gemma Team 2024, "Gemma 2:
              Improving Open Language Models at a Practical Size", arXiv 2408.00118).
    sinks     "zero": one more key of logit 0 and value 0 in every softmax (Miller 2023,
              "Attention Is Off By One"; Xiao et al. 2023, "Efficient Streaming Language
              Models with Attention Sinks", arXiv 2309.17453); "learned": that key's logit
              is a parameter per query head (OpenAI 2025, gpt-oss model card, arXiv
              2508.10925).

A kernel starts each row's online softmax from the sink (running max its logit, running
sum 1) and saves the log-sum-exp with the sink in it, so the backward kernels need no
change for it: the sink's own gradient is a sum over rows outside them (`flash.py`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from jxformers._typing import ArrayLike

SINKS = ("none", "zero", "learned")


def check_softcap(softcap) -> None:
    """ValueError unless `softcap` is a number > 0 or None."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be a number > 0 or None; got {softcap!r}")


def check_sinks(heads: int, sinks: str, sink_logits: ArrayLike | None) -> None:
    """ValueError unless `sinks` is one of `SINKS` and `sink_logits` is `[heads]` exactly
    when it is "learned"."""
    if sinks not in SINKS:
        raise ValueError(f"sinks must be one of {SINKS}; got {sinks!r}")
    if sinks == "learned":
        if sink_logits is None or jnp.shape(sink_logits) != (heads,):
            raise ValueError(
                f"sinks='learned' needs sink_logits of shape ({heads},) (one per query head); got "
                f"{None if sink_logits is None else jnp.shape(sink_logits)}"
            )
    elif sink_logits is not None:
        raise ValueError(f"sink_logits are read only with sinks='learned'; got {sinks=}")


def capped(s: Float[Array, "*n"], softcap: float | None) -> Float[Array, "*n"]:
    """c * tanh(s / c), or s itself without a cap."""
    return s if softcap is None else tanh_cap(s, softcap)


def tanh_cap(s: Float[Array, "*n"], softcap: float, times: float = 1.0) -> Float[Array, "*n"]:
    """`times` * c * tanh(s / c) with multiplications only: the one formula of the cap, in
    the XLA ops and in the kernels' tiles (which fold their base-2 factor into `times`)."""
    return jnp.float32(times * softcap) * jnp.tanh(s * jnp.float32(1.0 / softcap))


def cap_slope(t: Float[Array, "*n"], softcap: float, times: float = 1.0) -> Float[Array, "*n"]:
    """d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2, from the capped logits `t` = `tanh_cap(s,
    softcap, times)` (the backward kernels recompute those); 0 where t = -inf (masked),
    so a masked entry's 0 * slope stays 0."""
    u = t * jnp.float32(1.0 / (times * softcap))
    return jnp.maximum(1.0 - u * u, 0.0)


def sink_logit_vector(sinks: str, sink_logits: ArrayLike | None, heads: int) -> Float[Array, " heads"] | None:
    """The sink's logit per query head as float32 `[heads]` (zeros for "zero"), or None
    without a sink (after `check_sinks`)."""
    if sinks == "none":
        return None
    if sinks == "zero":
        return jnp.zeros((heads,), jnp.float32)
    assert sink_logits is not None  # check_sinks said so
    return jnp.asarray(sink_logits, jnp.float32)
