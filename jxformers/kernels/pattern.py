"""Static attention patterns as rules on positions, for the block-sparse kernels.

A pattern says which key j query i may attend. Each is a frozen, hashable dataclass
(kernels are traced once per pattern) with two views of the same rule:

* `allowed(i, j)`: elementwise on integer position arrays (numpy or jax, broadcasting);
  the kernels evaluate it on a (block_q, block_k) tile of a partially visible block,
  so no N x N mask is ever built.
* `blocks(q_start, k_start, block_q, block_k)`: for a grid of blocks (starts as
  broadcastable numpy arrays), `(any, all)`: some / every (i, j) of the block allowed.
  Primitives answer exactly; unions and intersections answer conservatively (a block
  may be called partial when it is full or empty), which costs a visit, never a wrong
  answer: partial blocks evaluate `allowed`.

Primitives: `Band` (lo <= i//unit - j//unit <= hi, on a step: sliding windows,
causal, dilated and strided windows, block-diagonal and block-banded patterns),
`KeyRange` / `QueryRange` (global tokens and blocks), `KeyResidue` (periodic summary keys). Combine with `union` and
`intersect`. Positions are those of the unpadded sequences; causal alignment is the
ops' bottom-right one (`causal(q_len, kv_len)`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import numpy as np


class Pattern:
    def allowed(self, i, j):
        raise NotImplementedError

    def blocks(self, q_start, k_start, block_q: int, block_k: int):
        raise NotImplementedError


def _floordiv(x, unit: int):
    # Positions are >= 0, so C-style division (what Triton lowers) equals floor division.
    return x if unit == 1 else x // unit


@dataclasses.dataclass(frozen=True)
class Band(Pattern):
    """lo <= i//unit - j//key_unit <= hi (None: unbounded) and the difference % step == 0;
    `key_unit` defaults to `unit`.

    `Band(-w, w)` is a sliding window, `Band(0, None)` causal, `Band(-w*d, w*d, step=d)`
    a dilated window, `Band(0, 0, unit=b)` block-diagonal, `Band(-1, 1, unit=b)` the
    neighbouring blocks; `Band(1, None, unit=s, key_unit=c)` the keys of earlier blocks
    when queries come in blocks of s and keys (gathered, c per block) in blocks of c.
    """

    lo: int | None = None
    hi: int | None = None
    step: int = 1
    unit: int = 1
    key_unit: int | None = None

    def allowed(self, i, j):
        d = _floordiv(i, self.unit) - _floordiv(j, self.key_unit or self.unit)
        ok = True
        if self.lo is not None:
            ok = ok & (d >= self.lo)
        if self.hi is not None:
            ok = ok & (d <= self.hi)
        if self.step > 1:
            ok = ok & (d % self.step == 0)
        return ok if not isinstance(ok, bool) else (d == d)

    def blocks(self, q_start, k_start, block_q, block_k):
        u, ku = self.unit, self.key_unit or self.unit
        # Every difference in [dmin, dmax] occurs in a rectangle of positions (i // u
        # and j // ku each run over a range of consecutive integers).
        dmin = q_start // u - (k_start + block_k - 1) // ku
        dmax = (q_start + block_q - 1) // u - k_start // ku
        lo = dmin if self.lo is None else np.maximum(dmin, self.lo)
        hi = dmax if self.hi is None else np.minimum(dmax, self.hi)
        s = self.step
        any_ = (lo <= hi) & ((hi // s) * s >= lo)
        all_ = (dmin >= lo) & (dmax <= hi) & ((dmin == dmax) | (s == 1)) & any_
        return any_, all_


def _range_blocks(start, block, lo, hi):
    first, last = start, start + block - 1
    upper = np.iinfo(np.int64).max if hi is None else hi - 1
    return (first <= upper) & (last >= lo), (first >= lo) & (last <= upper)


@dataclasses.dataclass(frozen=True)
class KeyRange(Pattern):
    """lo <= j < hi (hi None: to the end): keys every query sees (global tokens)."""

    lo: int
    hi: int | None

    def allowed(self, i, j):
        ok = j >= self.lo
        return ok & (j < self.hi) if self.hi is not None else ok

    def blocks(self, q_start, k_start, block_q, block_k):
        any_, all_ = _range_blocks(k_start, block_k, self.lo, self.hi)
        shape = np.broadcast_shapes(np.shape(q_start), np.shape(k_start))
        return np.broadcast_to(any_, shape), np.broadcast_to(all_, shape)


@dataclasses.dataclass(frozen=True)
class QueryRange(Pattern):
    """lo <= i < hi: queries that see every key (global queries)."""

    lo: int
    hi: int | None

    def allowed(self, i, j):
        ok = i >= self.lo
        return ok & (i < self.hi) if self.hi is not None else ok

    def blocks(self, q_start, k_start, block_q, block_k):
        any_, all_ = _range_blocks(q_start, block_q, self.lo, self.hi)
        shape = np.broadcast_shapes(np.shape(q_start), np.shape(k_start))
        return np.broadcast_to(any_, shape), np.broadcast_to(all_, shape)


@dataclasses.dataclass(frozen=True)
class KeyResidue(Pattern):
    """j % period >= lo: the last `period - lo` positions of every period (Sparse
    Transformer's summary keys)."""

    period: int
    lo: int

    def allowed(self, i, j):
        return j % self.period >= self.lo

    def blocks(self, q_start, k_start, block_q, block_k):
        r0 = k_start % self.period
        wraps = r0 + block_k - 1 >= self.period
        any_ = wraps | (r0 + block_k - 1 >= self.lo)
        all_ = ~wraps & (r0 >= self.lo)
        shape = np.broadcast_shapes(np.shape(q_start), np.shape(k_start))
        return np.broadcast_to(any_, shape), np.broadcast_to(all_, shape)


@dataclasses.dataclass(frozen=True)
class Union(Pattern):
    parts: tuple[Pattern, ...]

    def allowed(self, i, j):
        return functools.reduce(operator.or_, (p.allowed(i, j) for p in self.parts))

    def blocks(self, q_start, k_start, block_q, block_k):
        pairs = [p.blocks(q_start, k_start, block_q, block_k) for p in self.parts]
        return functools.reduce(np.logical_or, (a for a, _ in pairs)), functools.reduce(
            np.logical_or, (b for _, b in pairs)
        )


@dataclasses.dataclass(frozen=True)
class Intersect(Pattern):
    parts: tuple[Pattern, ...]

    def allowed(self, i, j):
        return functools.reduce(operator.and_, (p.allowed(i, j) for p in self.parts))

    def blocks(self, q_start, k_start, block_q, block_k):
        pairs = [p.blocks(q_start, k_start, block_q, block_k) for p in self.parts]
        return functools.reduce(np.logical_and, (a for a, _ in pairs)), functools.reduce(
            np.logical_and, (b for _, b in pairs)
        )


DENSE = Band()


def union(*parts: Pattern | None) -> Pattern:
    parts = tuple(p for p in parts if p is not None)
    if any(p == DENSE for p in parts):
        return DENSE
    return parts[0] if len(parts) == 1 else Union(parts)


def _merge_bands(a: Band, b: Band) -> Band | None:
    """The intersection of two bands as one band, when it is one (exact block answers)."""
    if a.unit != b.unit or (a.step > 1 and b.step > 1):
        return None
    lo = a.lo if b.lo is None else b.lo if a.lo is None else max(a.lo, b.lo)
    hi = a.hi if b.hi is None else b.hi if a.hi is None else min(a.hi, b.hi)
    return Band(lo, hi, max(a.step, b.step), a.unit)


def intersect(*parts: Pattern | None) -> Pattern:
    out: list[Pattern] = []
    for p in parts:
        if p is None or p == DENSE:
            continue
        if isinstance(p, Band):
            for n, q in enumerate(out):
                if isinstance(q, Band) and (merged := _merge_bands(q, p)) is not None:
                    out[n] = merged
                    break
            else:
                out.append(p)
        else:
            out.append(p)
    if not out:
        return DENSE
    return out[0] if len(out) == 1 else Intersect(tuple(out))


def key_set(indices, *, max_ranges: int = 16) -> Pattern | None:
    """Keys at the given positions (merged into runs), as a union of `KeyRange`s; None
    when there are more than `max_ranges` runs (each is a comparison in the kernel)."""
    runs: list[list[int]] = []
    for i in sorted(set(int(x) for x in indices)):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    if len(runs) > max_ranges:
        return None
    return union(*(KeyRange(lo, hi) for lo, hi in runs)) if runs else None


def causal(q_len: int, kv_len: int) -> Band:
    """j <= i + kv_len - q_len: the ops' bottom-right causal alignment."""
    return Band(lo=q_len - kv_len, hi=None)


def dense_mask(pattern: Pattern, q_len: int, kv_len: int) -> np.ndarray:
    """`[q_len, kv_len]` bool: the pattern as a dense mask (references and tests only)."""
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    return np.broadcast_to(np.asarray(pattern.allowed(i, j), bool), (q_len, kv_len))
