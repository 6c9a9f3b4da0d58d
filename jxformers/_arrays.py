"""Array helpers shared by the attention ops (`jxformers.ops`) and the decoders
(`jxformers.decoding`) and kernels (`jxformers.kernels`), which sit below the ops: grouped
query heads, the division that gives an empty row (every key masked) zeros instead of NaN,
padded keys zeroed before any weight meets them, the weights-times-values product
through which a non-finite value reaches only the rows that weigh it, and the rotation of
feature pairs by a table of angles (RoPE's, which `jxformers.nn.positions` makes and
kernelized ops apply after their feature map)."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jxformers._typing import ArrayLike

TINY = 1e-30  # below this a denominator is treated as empty (all keys masked)


def group_heads(q: Float[ArrayLike, "*lead heads d"], kv_heads: int) -> Float[Array, "*lead h g d"]:
    """Split query heads into [kv_heads, group] so one key head serves `group` queries."""
    *lead, heads, d = q.shape
    return jnp.asarray(q).reshape(*lead, kv_heads, heads // kv_heads, d)


def guarded_divide(num: ArrayLike, den: ArrayLike) -> Array:
    """num / den with empty rows (den == 0: every key masked) giving zeros, not NaN. A
    non-finite den (a NaN or inf key or value reached the row) stays non-finite: written
    as `not (|den| <= TINY)`, because `NaN > TINY` is False and turned such rows into a
    silent zero."""
    ok = ~(jnp.abs(den) <= TINY)
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


def read_values(
    spec: str, p: ArrayLike, v: ArrayLike, reads: ArrayLike | None = None, einsum: Callable[..., Array] = jnp.einsum
) -> Array:
    """`einsum(spec, p, v)` for attention weights p and values v (v's last axis, the
    features, is the output's last), where a value that is not finite (NaN, inf) reaches
    exactly the rows that read it: those rows are NaN, and a row whose pattern does not
    connect it (a masked slot of a gathered block) stays finite. The plain product
    multiplies the 0 in, and 0 * NaN is NaN. `reads` (bool, p's shape): which keys each
    row reads; default: those of non-zero weight. Costs a pass over v and one product of
    `reads` with a per-key flag; the gradient at a replaced entry is zero."""
    ins, out = spec.split("->")
    p_axes, v_axes = ins.split(",")
    if v_axes[-1] != out[-1]:
        raise ValueError(f"{spec=}: the values' last axis must be the output's last")
    clean, bad = finite_values(v)
    result = einsum(spec, p, clean)
    reads = jnp.asarray(p) != 0 if reads is None else jnp.broadcast_to(reads, jnp.shape(p))
    return nan_where(jnp.einsum(f"{p_axes},{v_axes[:-1]}->{out[:-1]}", reads.astype(jnp.float32), bad) > 0, result)


def finite_values(v: ArrayLike) -> tuple[Array, Array]:
    """(v with non-finite entries zeroed, float32 flag [..., k, h] of the value vectors
    [..., k, h, d] that held one): the two halves of `read_values`."""
    v = jnp.asarray(v)
    finite = jnp.isfinite(v)
    return jnp.where(finite, v, jnp.zeros((), v.dtype)), (~jnp.all(finite, axis=-1)).astype(jnp.float32)


def poison_keys(k: ArrayLike, v: ArrayLike) -> tuple[Array, Array]:
    """(k with NaN at each key whose value vector holds a non-finite entry, v with those
    entries zeroed), for kernels that multiply a whole tile of values by its weights,
    masked slots' zeros included (0 * NaN is NaN). The NaN key then reaches exactly the
    rows whose pattern reads it, as the kernels' masks already keep a NaN key's score to
    those rows: the rows `read_values` would mark, at the cost of one pass over k and v."""
    clean, bad = finite_values(v)
    k = jnp.asarray(k)
    return jnp.where(bad[..., None] > 0, jnp.asarray(jnp.nan, k.dtype), k), clean


def nan_where(reached: ArrayLike, out: Array) -> Array:
    """`out` with NaN in the rows `reached` marks (`reached` lacks out's feature axis)."""
    return jnp.where(jnp.asarray(reached)[..., None], jnp.asarray(jnp.nan, out.dtype), out)


def rotate_pairs(x: Float[ArrayLike, "n heads d"], rotation: Float[ArrayLike, "n 2 half"]) -> Float[Array, "n heads d"]:
    """Turn each feature pair (i, i + d/2) of every head by the table `rotation [n, 2,
    d/2]` = (cos, sin) of its angles (times a scale, for xPos): RoFormer's rotation in
    the "rotate half" layout, in float32."""
    d = x.shape[-1]
    if rotation.shape != (x.shape[0], 2, d // 2) or d % 2:
        raise ValueError(
            f"a rotation table [n, 2, d/2] = {(x.shape[0], 2, d // 2)} turns features of even size d; "
            f"got features {tuple(x.shape)} and a table {tuple(rotation.shape)}"
        )
    cos, sin = rotation[:, None, 0].astype(jnp.float32), rotation[:, None, 1].astype(jnp.float32)
    x1, x2 = jnp.split(jnp.asarray(x, jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
