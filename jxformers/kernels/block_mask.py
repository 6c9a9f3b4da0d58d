"""Block-sparse metadata: which key blocks each query block visits, and how.

Computed at trace time from a static `Pattern` (numpy), with optional extra blocks
known only at run time (BigBird's random blocks, a jax array). The forward and the dq
kernels walk each query block's row; the dk/dv kernel walks each key block's column:
both come from one `[num_q_blocks, num_k_blocks]` matrix of kinds.

    EMPTY    never visited
    PARTIAL  visited; the kernel evaluates the pattern's rule on the tile
    FULL     visited; every (i, j) allowed (only padding and kv_mask still apply)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jxformers.kernels.pattern import Pattern

EMPTY, PARTIAL, FULL = 0, 1, 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def block_kinds(pattern: Pattern, q_len: int, kv_len: int, block_q: int, block_k: int) -> np.ndarray:
    """`[ceil(q_len / block_q), ceil(kv_len / block_k)]` int8 kinds of `pattern`. A key
    block running past `kv_len` is never FULL: the kernel masks its padded keys."""
    nq, nk = ceil_div(q_len, block_q), ceil_div(kv_len, block_k)
    q_start = (np.arange(nq, dtype=np.int64) * block_q)[:, None]
    k_start = (np.arange(nk, dtype=np.int64) * block_k)[None, :]
    any_, all_ = pattern.blocks(q_start, k_start, block_q, block_k)
    any_ = np.broadcast_to(any_, (nq, nk))
    all_ = np.broadcast_to(all_, (nq, nk)).copy()
    if kv_len % block_k:
        all_[:, -1] = False
    return np.where(all_, FULL, np.where(any_, PARTIAL, EMPTY)).astype(np.int8)


@dataclasses.dataclass(frozen=True)
class VisitLists:
    """Per row of a kinds matrix, the visited columns, FULL ones first: `index [rows,
    width]` int32 column numbers (the tail past `count` is padding), `full [rows]` how
    many lead FULL, `count [rows]` how many are visited. Kernels run two loops, the
    first without evaluating the pattern."""

    index: jax.Array | np.ndarray
    full: jax.Array | np.ndarray
    count: jax.Array | np.ndarray
    # Static lists whose FULL columns form one run per row: the kernels compute their
    # addresses (index[row, 0] + t) instead of loading them, which Triton pipelines.
    full_contiguous: bool = False

    @property
    def width(self) -> int:
        return self.index.shape[1]


# Sort key of a kind: FULL first, then PARTIAL, EMPTY last.
_RANK = np.array([2, 1, 0], np.int8)


def visit_lists(kinds) -> VisitLists:
    """The visit lists of each row of `kinds` (numpy: width = the longest row; a jax
    array: width = the number of columns, as the counts are unknown at trace time)."""
    if isinstance(kinds, np.ndarray):
        count = (kinds != EMPTY).sum(axis=1).astype(np.int32)
        width = max(1, int(count.max(initial=0)))
        order = np.argsort(_RANK[kinds], axis=1, kind="stable")[:, :width].astype(np.int32)
        full = (kinds == FULL).sum(axis=1).astype(np.int32)
        steps = np.diff(order, axis=1) == 1
        lead = np.arange(width - 1)[None, :] < full[:, None] - 1
        return VisitLists(order, full, count, full_contiguous=bool(np.all(steps | ~lead)))
    count = jnp.sum(kinds != EMPTY, axis=1).astype(jnp.int32)
    order = jnp.argsort(jnp.asarray(_RANK)[kinds], axis=1, stable=True).astype(jnp.int32)
    return VisitLists(order, jnp.sum(kinds == FULL, axis=1).astype(jnp.int32), count)


def add_full_blocks(kinds: np.ndarray, rows_cols) -> jax.Array:
    """`kinds` with FULL at the run-time blocks `rows_cols [rows, r]` (column numbers per
    row; negative entries are none): BigBird's random blocks on top of its static part."""
    rows, r = rows_cols.shape
    cols = jnp.asarray(rows_cols, jnp.int32)
    extra = (
        jnp.zeros(kinds.shape, bool)
        .at[jnp.repeat(jnp.arange(rows), r), jnp.clip(cols, 0).reshape(-1)]
        .max((cols >= 0).reshape(-1))
    )
    return jnp.where(extra, FULL, jnp.asarray(kinds)).astype(jnp.int8)


def density(kinds) -> float:
    """Visited fraction of the block grid (static kinds only)."""
    return float(np.mean(np.asarray(kinds) != EMPTY))
