"""Shared pieces of the attention ops: argument validation, grouped-query logits,
the one masked softmax every op reduces to, and blocking helpers. (Grouping query heads
and the guarded division are in `jxformers._arrays`: the decoders use them too.)

Every op in this package ends in `softmax_parts`: a masked softmax over one or more
*parts* (groups of keys gathered in whatever layout suits the pattern) normalised
jointly, so a pattern that is a union of sub-patterns (window + global + random) is one
softmax, exactly as the dense masked reference would compute it.

Shape letters used internally: `n` query groups (blocks), `q` queries per group, `k`
keys per group, `h` kv heads, `g` query heads per kv head, `d` features.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from collections.abc import Callable
from typing import NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jxformers._arrays import finite_values, group_heads, nan_where, zero_padded  # noqa: F401  (the ops import it from here)
from jxformers._typing import ArrayLike
from jxformers.registry import INT32_MAX

# ----------------------------------------------------------------------------- checks

# Packages whose frames stand between a user's call and an op: transformations and
# wrappers (jit, vmap, partial, Equinox's filters, the runtime type checkers of the tests).
_WRAPPER_PACKAGES = frozenset({"jax", "jaxlib", "equinox", "jaxtyping", "beartype", "functools", "contextlib"})


def _wraps(frame) -> bool:
    """Whether `frame` runs a transformation's or a wrapper's code (`_WRAPPER_PACKAGES`,
    or a function beartype generated)."""
    package = str(frame.f_globals.get("__name__", "")).split(".")[0]
    return (
        package in _WRAPPER_PACKAGES
        or frame.f_code.co_filename.startswith("<@beartype")
        # causal_never_reads_non_finite_future's wrapper (by name: import hooks recompile code)
        or (frame.f_code.co_name == "guarded" and frame.f_code.co_filename == __file__)
    )


_WARNED: set[tuple[type[Warning], str, int]] = set()


def warn_once_per_call_site(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)` from the op that calls this, attributed to the
    user's line that called the op (the first frame above it that is not a
    transformation's or a wrapper's) and said once per such line. Python's own "once per
    location" cannot be relied on: its memory of shown warnings is cleared whenever the
    warning filters change, by any `warnings.catch_warnings` anywhere (beartype, the
    tests' type checker, enters one for every call it checks)."""
    frame, level = inspect.currentframe(), 1  # this function's frame: warnings.warn's stacklevel 1
    for _ in range(2):  # past the wrappers around this function to the op, then past the op's to its caller
        frame, level = (frame.f_back if frame is not None else None), level + 1
        while frame is not None and _wraps(frame):
            frame, level = frame.f_back, level + 1
    site = (category, frame.f_code.co_filename, frame.f_lineno) if frame is not None else (category, "", 0)
    if site in _WARNED:
        return
    _WARNED.add(site)
    warnings.warn(message, category, stacklevel=level)


def check_positive(name: str, value: int, *, minimum: int = 1) -> None:
    """Raise ValueError unless `value` is a Python int in [`minimum`, INT32_MAX]: a size or
    offset past int32 would overflow JAX's index arithmetic deep inside the op. (The
    registry and the configs convert NumPy integers; an op called by hand takes ints.)"""
    if isinstance(value, bool) or not isinstance(value, int):
        hint = f" (int({value!r}) is one)" if isinstance(value, numbers.Integral) else ""
        raise ValueError(f"{name} must be a Python int >= {minimum}; got {value!r}{hint}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    if value > INT32_MAX:
        raise ValueError(f"{name} must be at most {INT32_MAX} (JAX indexes with int32); got {value}")


def check_qkv(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, self_attention: bool = False) -> None:
    """Validate per-example q/k/v shapes ([len, heads, features]) and dtypes, and raise a
    named ValueError. Every op calls this before computing anything."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        shape, dtype = jnp.shape(x), jnp.result_type(x)
        if len(shape) != 3:
            raise ValueError(
                f"{name} must have shape [len, heads, features] (one example; batch with jax.vmap); got shape {shape}"
            )
        if 0 in shape:
            raise ValueError(
                f"{name} has shape {shape}: lengths, heads and features must all be >= 1 "
                "(a length-0 sequence has nothing to attend)"
            )
        # Integer inputs would give integer probabilities, i.e. silent zeros.
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(
                f"{name} must be a floating-point array (float32, bfloat16, float16, float64); "
                f"got dtype {dtype}; cast it, e.g. {name}.astype(jnp.float32)"
            )
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k has d_k={k.shape[2]} but q has d_k={q.shape[2]}; they must match")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has kv_len={v.shape[0]} but k has kv_len={k.shape[0]}; they must match")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has kv_heads={v.shape[1]} but k has kv_heads={k.shape[1]}; they must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q heads ({q.shape[1]}) must be a positive multiple of k/v heads ({k.shape[1]}) (grouped-query attention)"
        )
    if self_attention and q.shape[0] != k.shape[0]:
        raise ValueError(f"this op is self-attention: q_len ({q.shape[0]}) must equal kv_len ({k.shape[0]})")


def check_mask_shape(name: str, mask: ArrayLike | None, shape: tuple[int, ...]) -> None:
    if mask is None:
        return
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(mask.shape)}")
    if mask.dtype != jnp.bool_:
        raise ValueError(f"{name} must be a boolean array (True = attend); got dtype {mask.dtype}")


def default_scale(d_k: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(d_k) if scale is None else float(scale)


def out_dtype(q: ArrayLike, k: ArrayLike, v: ArrayLike) -> jnp.dtype:
    return jnp.result_type(q.dtype, k.dtype, v.dtype)


# ----------------------------------------------------------------------------- softmax


def einsum_f32(spec: str, a: ArrayLike, b: ArrayLike) -> Array:
    """einsum accumulating in float32. Operands are cast to their common dtype; on CPU,
    16-bit floats are upcast to float32 first, because XLA:CPU's dot thunk rejects
    bf16 x bf16 -> f32 for some layouts (seen with jax 0.10: "Unsupported element type
    for DotThunk"). On GPU/TPU bf16 operands stay bf16 (tensor cores, f32 accumulation)."""
    dtype = jnp.result_type(a.dtype, b.dtype)
    if jnp.dtype(dtype).itemsize < 4 and jax.default_backend() == "cpu":
        dtype = jnp.float32
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def logits(
    q: Float[ArrayLike, "*n q h g d"], k: Float[ArrayLike, "*n k h d"], scale: float
) -> Float[Array, "*n h g q k"]:
    """Scaled dot products in float32 (bf16 inputs accumulate in float32)."""
    return einsum_f32("...qhgd,...khd->...hgqk", q, k) * jnp.float32(scale)


def masked_softmax_over(s: Array, real: Array, axis: int) -> Array:
    """Softmax along `axis` over entries where `real` (broadcast) is True; all-masked
    slices give zeros."""
    s = jnp.where(real, s, -jnp.inf)
    top = jnp.max(s, axis=axis, keepdims=True)
    e = jnp.where(real, jnp.exp(s - jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))), 0.0)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def softmax_parts(
    parts: list[tuple[Float[ArrayLike, "*n h g q _k"], Bool[ArrayLike, "*#n #h #g #q _k"]]],
) -> list[Float[Array, "*n h g q _k"]]:
    """Probabilities of a softmax taken jointly over several groups of keys.

    Each part is `(logits, mask)`; masks broadcast against their logits. A query row
    whose keys are all masked gets all-zero probabilities (never NaN), and gradients
    through masked entries are exactly zero.
    """
    logits_, masks = zip(*parts, strict=True)
    return list(_joint_softmax(tuple(logits_), tuple(jnp.asarray(m) for m in masks)))


@jax.custom_jvp
def _joint_softmax(logits_: tuple, masks: tuple) -> tuple:
    row_max = None
    for s, m in zip(logits_, masks, strict=True):
        part_max = jnp.max(jnp.where(m, s, -jnp.inf), axis=-1)
        row_max = part_max if row_max is None else jnp.maximum(row_max, part_max)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # empty rows shift by 0
    exps = [jnp.where(m, jnp.exp(s - row_max[..., None]), 0.0) for s, m in zip(logits_, masks, strict=True)]
    denom = sum(e.sum(axis=-1) for e in exps)
    # `denom <= 0`, not `not denom > 0`: a NaN logit at a key the row reads keeps the row NaN
    empty = denom <= 0
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, denom))
    return tuple(e * inv[..., None] for e in exps)


@_joint_softmax.defjvp
def _joint_softmax_jvp(primals, tangents):
    # Softmax's own derivative, dp = p * (ds - <p, ds>), as jax.nn.softmax does: autodiff
    # through the masked forward keeps several [q, k] intermediates per part and made
    # attention's backward pass about 2x slower on CPU. p is 0 at masked entries and in
    # empty rows; the `where` keeps their gradients exactly zero even where the incoming
    # gradient is not finite (0 * nan is nan).
    logits_, masks = primals
    d_logits, _ = tangents
    probs = _joint_softmax(logits_, masks)
    inner = sum((p * ds).sum(axis=-1) for p, ds in zip(probs, d_logits, strict=True))
    return probs, tuple(
        jnp.where(m, p * (ds - inner[..., None]), 0.0) for p, ds, m in zip(probs, d_logits, masks, strict=True)
    )


def weighted_values(
    p: Float[ArrayLike, "*n h g q k"], v: Float[ArrayLike, "*n k h dv"], reads: Bool[ArrayLike, ...] | None = None
) -> Float[Array, "*n q h g dv"]:
    """p @ v with float32 accumulation.

    `reads`: where p has structural zeros (a pattern, a mask, a sparse support), which
    keys each row reads: `[*n, q, k]`, or `[*n, h or 1, g or 1, q, k]` as the logits'
    masks. Then a value that is not finite (NaN, inf) reaches exactly those rows (and
    heads), which are NaN, and a row that does not read it stays finite: a plain matmul
    multiplies the 0 in, and 0 * NaN is NaN. Costs a pass over v and one product of
    `reads` with a per-key flag (per row, without the head axes when `reads` has none).
    None: every row reads every key (a dense product: NaN spreads as it should)."""
    if reads is None:
        return einsum_f32("...hgqk,...khd->...qhgd", p.astype(v.dtype), v)
    clean, bad = finite_values(v)  # bad: [*n, k, h]
    out = einsum_f32("...hgqk,...khd->...qhgd", p.astype(clean.dtype), clean)
    reads = jnp.asarray(reads)
    if reads.ndim == jnp.ndim(p) and reads.shape[-4:-2] == (1, 1):
        reads = reads[..., 0, 0, :, :]
    if reads.ndim == jnp.ndim(p):  # per head: [*n, h, g, q, k]
        hit = jnp.einsum("...hgqk,...kh->...qhg", jnp.broadcast_to(reads, jnp.shape(p)).astype(jnp.float32), bad)
    else:  # [*n, q, k], the same for every head
        hit = jnp.einsum("...qk,...kh->...qh", reads.astype(jnp.float32), bad)[..., None]
    return nan_where(hit > 0, out)


def head_mask(mask: Bool[ArrayLike, "*n q k"]) -> Bool[Array, "*n 1 1 q k"]:
    """Give a [*n, q, k] mask the two head axes of the logits."""
    return mask[..., None, None, :, :]


# ----------------------------------------------------------------------------- blocking


def pad_to(x: ArrayLike, length: int, axis: int = 0, value=0) -> Array:
    """Pad `x` at the end of `axis` up to `length`."""
    extra = length - x.shape[axis]
    if extra == 0:
        return jnp.asarray(x)  # numpy in, jax out, as when padding
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def valid_keys(kv_mask: Bool[ArrayLike, " kv_len"] | None, kv_len: int, padded_len: int) -> Bool[Array, " padded"]:
    """kv_mask (True = real) extended with False over the padding to `padded_len`."""
    real = jnp.ones((kv_len,), bool) if kv_mask is None else kv_mask
    return pad_to(real, padded_len, value=False)


def to_blocks(x: ArrayLike, block: int) -> Array:
    """[L, ...] -> [L // block, block, ...]; L must already be a multiple of `block`."""
    return x.reshape(x.shape[0] // block, block, *x.shape[1:])


def neighbour_blocks(x: ArrayLike, before: int, after: int) -> Array:
    """For blocked `x` [n, b, ...] return [n, (before + 1 + after) * b, ...]: each block
    concatenated with its `before` predecessors and `after` successors (zero-padded past
    the ends; callers mask those slots by position)."""
    n = x.shape[0]
    widths = [(before, after)] + [(0, 0)] * (x.ndim - 1)
    xp = jnp.pad(x, widths)
    windows = [xp[i : i + n] for i in range(before + 1 + after)]
    stacked = jnp.concatenate(windows, axis=1)
    return stacked


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def positions(n: int) -> Int[Array, " n"]:
    return jnp.arange(n, dtype=jnp.int32)


# ----------------------------------------------------------------------------- unions
# A pattern that is a union of sub-patterns (window + global + random) gathers each
# sub-pattern's keys in its own layout. A `Part` holds that sub-pattern's logits and mask
# in one shared *row* layout `[h, g, L, k_p]` (query rows in position order), so the
# softmax is taken jointly, and a function that applies the probabilities back to the
# values in the part's own layout, returning `[L, h, g, dv]`.


class Part(NamedTuple):
    logits: Float[Array, "h g L _k"]
    mask: Bool[Array, " ..."]
    apply: Callable[[Float[Array, "h g L _k"]], Float[Array, "L h g _dv"]]


def dense_part(
    qg: Float[ArrayLike, "L h g d"],
    k: Float[ArrayLike, "_k h d"],
    v: Float[ArrayLike, "_k h dv"],
    mask: Bool[ArrayLike, "L _k"],
    scale: float,
) -> Part:
    """All query rows against one shared set of keys."""
    return Part(logits(qg, k, scale), head_mask(mask), lambda p: weighted_values(p, v, reads=mask))


def block_part(
    qg: Float[ArrayLike, "n b h g d"],
    k: Float[ArrayLike, "n _k h d"],
    v: Float[ArrayLike, "n _k h dv"],
    mask: Bool[ArrayLike, "n b _k"],
    scale: float,
    *,
    interleaved: bool = False,
) -> Part:
    """Query blocks, each against its own gathered keys. Rows are block-major
    (position = block * b + i) or, with `interleaved`, residue-major
    (position = i * n + block: block n holds positions congruent to n mod `n`)."""
    n, b = qg.shape[:2]
    s = logits(qg, k, scale)  # [n, h, g, b, k]
    m = head_mask(mask)

    def to_rows(x):  # [n, h, g, b, k] -> [h, g, L, k]
        x = jnp.moveaxis(x, 0, 2 if not interleaved else 3)
        return x.reshape(*x.shape[:2], n * b, x.shape[-1])

    def from_rows(x):
        shape = (n, b) if not interleaved else (b, n)
        x = x.reshape(*x.shape[:2], *shape, x.shape[-1])
        return jnp.moveaxis(x, 2 if not interleaved else 3, 0)

    def apply(p):
        out = weighted_values(from_rows(p), v, reads=mask)  # [n, b, h, g, dv]
        if interleaved:
            out = jnp.swapaxes(out, 0, 1)
        return out.reshape(n * b, *out.shape[2:])

    return Part(to_rows(s), to_rows(jnp.broadcast_to(m, (n, 1, 1, b, m.shape[-1]))), apply)


def attend_parts(parts: list[Part]) -> Float[Array, "L h g dv"]:
    """Joint masked softmax over every part's keys, then the weighted sum of values."""
    probs = softmax_parts([(p.logits, p.mask) for p in parts])
    return sum(part.apply(p) for part, p in zip(parts, probs, strict=True))


def first_occurrence(idx: Int[ArrayLike, " m"]) -> Bool[Array, " m"]:
    """True where idx[i] differs from every earlier entry (so a key listed twice counts once)."""
    m = idx.shape[0]
    same = idx[:, None] == idx[None, :]
    earlier = jnp.tril(jnp.ones((m, m), bool), k=-1)
    return ~jnp.any(same & earlier, axis=1)


# ----------------------------------------------------------------------------- patterns

MIN_BLOCK = 16  # small windows still get blocks big enough to keep the matmuls busy


def per_query_head(head: Callable[..., Array], q: ArrayLike, k: ArrayLike, v: ArrayLike, *per_kv_head: Array) -> Array:
    """`head(q_h [L, d], k_h [S, d], v_h [S, dv], *x_h) -> [L, dv]` for every query head,
    with its kv head's keys, values and slices `x_h` of `per_kv_head` (arrays whose first
    axis is the kv head): for ops whose per-head work is not one einsum (a clustering, a
    selection). Returns `[L, heads, dv]`."""
    qg = jnp.moveaxis(group_heads(jnp.asarray(q), k.shape[1]), 0, -2)  # [h, g, L, d]
    kh, vh = jnp.moveaxis(jnp.asarray(k), 0, 1), jnp.moveaxis(jnp.asarray(v), 0, 1)  # [h, S, d]
    shared = (None,) * (2 + len(per_kv_head))  # a kv head's arrays serve each query head of its group
    out = jax.vmap(jax.vmap(head, in_axes=(0, *shared)))(qg, kh, vh, *per_kv_head)  # [h, g, L, dv]
    return jnp.moveaxis(out, 2, 0).reshape(q.shape[0], q.shape[1], -1)


def check_self(q: ArrayLike, k: ArrayLike, v: ArrayLike, kv_mask: ArrayLike | None) -> None:
    """Validate self-attention inputs (one length, kv_mask of that length)."""
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))


def prepare_self(q: ArrayLike, k: ArrayLike, v: ArrayLike, kv_mask: ArrayLike | None, block: int):
    """Validate self-attention inputs and pad them to whole blocks.

    Returns `(length, qg [length, h, g, d], k, v, real [length])` where `real` is False
    over padding and padded keys.
    """
    check_self(q, k, v, kv_mask)
    n = q.shape[0]
    length = ceil_div(n, block) * block
    qg = group_heads(pad_to(q, length), k.shape[1])
    return length, qg, pad_to(k, length), pad_to(v, length), valid_keys(kv_mask, n, length)


def window_block(n: int, window: int) -> int:
    """Block size for a sliding window: no smaller than the window, so a block's
    neighbours hold every key it needs; one block when the window spans everything."""
    return min(max(window, MIN_BLOCK), n)


def sliding_window_part(
    qg: Float[ArrayLike, "L h g d"],
    k: Float[ArrayLike, "L h d"],
    v: Float[ArrayLike, "L h dv"],
    real: Bool[ArrayLike, " L"],
    *,
    block: int,
    window: int,
    causal: bool,
    scale: float,
) -> Part:
    """Query i against keys j with |i - j| <= window (0 <= i - j <= window if causal),
    computed per block of queries against the neighbouring key blocks: O(L * block).
    Inputs are padded to a multiple of `block` >= window (see `window_block`)."""
    after = 0 if causal else 1
    kb, vb, rb = (neighbour_blocks(to_blocks(x, block), 1, after) for x in (k, v, real))
    q_pos = to_blocks(positions(k.shape[0]), block)  # [nb, block]
    k_pos = q_pos[:, :1] - block + positions(kb.shape[1])[None, :]  # [nb, (2|3) * block]
    delta = q_pos[:, :, None] - k_pos[:, None, :]
    near = (delta >= 0) & (delta <= window) if causal else jnp.abs(delta) <= window
    return block_part(to_blocks(qg, block), kb, vb, near & rb[:, None, :], scale)


def rows_to_output(rows: Float[ArrayLike, "L h g dv"], n: int, dtype) -> Float[Array, "n heads dv"]:
    """[L, h, g, dv] -> [n, h * g, dv] in `dtype` (drops the padding rows)."""
    return rows.reshape(rows.shape[0], -1, rows.shape[-1])[:n].astype(dtype)


def _non_finite_heads(x: Array, heads: int) -> Bool[Array, "n heads"]:
    """[n, heads]: whether any feature of x [n, h, d] is non-finite, each of x's h heads
    spread over the `heads // h` query heads it serves (all of them when h does not divide)."""
    bad = ~jnp.all(jnp.isfinite(x), axis=-1)
    h = x.shape[1]
    if heads % h:
        return jnp.broadcast_to(jnp.any(bad, axis=1, keepdims=True), (x.shape[0], heads))
    return jnp.repeat(bad, heads // h, axis=1)


_Op = TypeVar("_Op", bound=Callable)


def _finite_or_zero(x: Array) -> Array:
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def causal_never_reads_non_finite_future(*, keys_from_q: bool = False):
    """Decorate a causal-capable op `op(q, k, v, *, causal=..., kv_mask=..., ...)` so that a
    non-finite value (NaN, inf) at a later position never reaches an earlier row.

    A masked-out future key still meets a zero weight inside a matmul (a masked softmax
    row, a band of blocks, a kernel feature sum), and 0 * NaN is NaN, so without this a
    NaN at position j made rows i < j NaN in every causal op. Under `causal=True` (self
    attention, `q_len == kv_len`) the op runs on keys and values with non-finite entries
    replaced by zeros (the queries too when they are the keys: `keys_from_q`, shared-QK),
    and then each row (and head) i is NaN where a real key j <= i (kv_mask True) had a
    non-finite k_j (q_j with `keys_from_q`) or v_j: the rows that may read it (a superset
    for a sparse pattern). Costs a pass over k and v, their zeroed copies, and a
    cumulative max over positions. Otherwise (not causal, other shapes: the op's own
    checks speak) the op runs unchanged. The gradient reaching a replaced entry is zero."""

    def decorate(op: _Op) -> _Op:
        default_causal = inspect.signature(op).parameters["causal"].default

        @functools.wraps(op)
        def guarded(q, k, v, *args, **kwargs):
            causal = kwargs.get("causal", default_causal)
            shapes = [jnp.shape(x) for x in (q, k, v)]
            if (
                causal is not True
                or any(len(s) != 3 for s in shapes)
                or len({s[0] for s in shapes}) != 1
                or not all(jnp.issubdtype(jnp.result_type(x), jnp.floating) for x in (q, k, v))
            ):
                return op(q, k, v, *args, **kwargs)
            k_is_q = k is q
            q, k, v = (jnp.asarray(x) for x in (q, k, v))
            n, heads = q.shape[:2]
            bad_keys = _non_finite_heads(v, heads) | _non_finite_heads(q if keys_from_q else k, heads)
            kv_mask = kwargs.get("kv_mask")
            if kv_mask is not None and jnp.shape(kv_mask) == (n,):
                bad_keys = bad_keys & jnp.asarray(kv_mask)[:, None]  # padding is never read
            poisoned = jax.lax.cummax(bad_keys.astype(jnp.int32), axis=0) > 0
            if keys_from_q:  # the queries are the keys: clean them, mark each one's own row
                poisoned = poisoned | _non_finite_heads(q, heads)
                clean_q = _finite_or_zero(q)
                # k is ignored; passed on as it came (`k is q` is what the op's warning reads)
                out = op(clean_q, clean_q if k_is_q else k, _finite_or_zero(v), *args, **kwargs)
            else:
                # The queries stay as given: a non-finite q_i reaches row i alone (its own
                # scores), or no row when the op never reads the queries' values.
                out = op(q, _finite_or_zero(k), _finite_or_zero(v), *args, **kwargs)
            if not isinstance(out, jax.Array) or out.ndim != 3 or out.shape[:2] != (n, heads):
                return out
            return jnp.where(poisoned[:, :, None], jnp.asarray(jnp.nan, out.dtype), out)

        return cast(_Op, guarded)

    return decorate


# ----------------------------------------------------------------------------- decoding


def causal_row_attend(op: Callable) -> Callable:
    """An `Attend` for `jxformers.decoding.kv_cache` made from a causal-capable
    self-attention op whose row t reads only positions <= t (a pattern that is not a
    softmax under one mask: pooled spans, a cumulative relay, a grid's row and column).
    Each step runs the op causally over the whole cache (slot p holds position p; the
    slots not yet written are masked as padding) with the step's query at row t, the
    newest position, and returns row t: one parallel forward per step, so the decoder
    is the op itself and cannot drift from it."""

    def attend(q, k, v, *, kv_mask, bias=None, **hyper_parameters):
        if bias is not None:
            raise ValueError("this attention takes no bias (its registration says takes_bias=False)")
        t = jnp.sum(kv_mask.astype(jnp.int32)) - 1
        rows = jnp.zeros((k.shape[0], *q.shape[1:]), q.dtype).at[t].set(q[0])
        out = op(rows, k, v, causal=True, kv_mask=kv_mask, **hyper_parameters)
        return jax.lax.dynamic_slice_in_dim(out, t, 1)

    return attend
