"""Array helpers shared by the attention ops (`jxformers.ops`) and the decoders
(`jxformers.decoding`) and kernels (`jxformers.kernels`), which sit below the ops: grouped
query heads, the division that gives an empty row (every key masked) zeros instead of NaN,
and padded keys zeroed before any weight meets them."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

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


def zero_padded(k: ArrayLike, v: ArrayLike, kv_mask: Bool[ArrayLike, " kv_len"] | None) -> tuple[ArrayLike, ArrayLike]:
    """`k` and `v` with zeros at padded key positions (kv_mask False). A masked key still
    meets a zero weight in most forms (a masked softmax row, a block of a pattern, a
    kernel feature sum), and 0 * NaN is NaN: zeroed first, whatever padding holds (NaN,
    inf) cannot reach a real output. Every op does this first; the inputs come back
    unchanged without a mask, or when shapes are wrong (the op's own checks say so)."""
    if kv_mask is None or jnp.ndim(k) != 3 or jnp.ndim(v) != 3:
        return k, v
    n = jnp.shape(k)[0]
    if jnp.shape(kv_mask) != (n,) or jnp.shape(v)[0] != n:
        return k, v
    keep = jnp.asarray(kv_mask)[:, None, None]
    return (
        jnp.where(keep, k, jnp.zeros((), jnp.result_type(k))),
        jnp.where(keep, v, jnp.zeros((), jnp.result_type(v))),
    )
