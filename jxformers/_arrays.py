"""Array helpers shared by the attention ops (`jxformers.ops`) and the decoders
(`jxformers.decoding`), which sits below the ops: grouped query heads and the division
that gives an empty row (every key masked) zeros instead of NaN."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from jxformers._typing import ArrayLike

TINY = 1e-30  # below this a denominator is treated as empty (all keys masked)


def group_heads(q: Float[ArrayLike, "*lead heads d"], kv_heads: int) -> Float[Array, "*lead h g d"]:
    """Split query heads into [kv_heads, group] so one key head serves `group` queries."""
    *lead, heads, d = q.shape
    return jnp.asarray(q).reshape(*lead, kv_heads, heads // kv_heads, d)


def guarded_divide(num: ArrayLike, den: ArrayLike) -> Array:
    """num / den with empty rows (den == 0: every key masked) giving zeros, not NaN."""
    ok = jnp.abs(den) > TINY
    return jnp.where(ok[..., None], num / jnp.where(ok, den, 1.0)[..., None], 0.0)
