"""Axial attention (Ho et al., 2019): the sequence laid out row-major on a 2-D grid of
`width` columns, attention along rows, then along columns.

Row attention is `block_local_attention` with blocks of one row; column attention is
full attention inside each residue class mod `width`, i.e. `dilated_attention` with a
window covering every row. Both are exact masked softmax patterns; composed, every
position reaches every other in two hops at O(N * (rows + width)) cost. The causal
composition is the Axial Transformer's autoregressive one (Ho et al. 2019, sections 3-4):
an unmasked row pass and a column pass over the rows above (the outer context, its input
shifted down one row), added to the values of a masked row pass (the inner decoder), so
every position reaches its whole causal past.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_positive,
    check_self,
    zero_padded,
)
from jxformers.ops.local import block_local_attention, dilated_attention
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "axial_attention",
]


@causal_never_reads_non_finite_future()
def axial_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    width: int = 64,
    order: str = "row_then_column",
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Axial attention over a grid of `width` columns (rows = ceil(seq / width); a short
    last row is padded and masked).

    * "row": query (r, c) attends every key (r, c') of its row;
    * "column": query (r, c) attends every key (r', c) of its column;
    * "row_then_column": the column attention applied to the row attention's output,
      `A_col @ (A_row @ v)` with the same q and k: full receptive field in two hops.
    `causal=True` keeps only earlier positions in raster order in "row" (c' <= c) and
    "column" (r' <= r). "row_then_column" under `causal` is the Axial Transformer's
    construction (Ho et al. 2019, sections 3-4): the outer context
    `ctx = A_col<(A_row v)`, an unmasked row pass whose output the column pass reads
    only from the rows above (r' < r: the paper's shift down by one row), and then the
    masked row pass over the values plus that context, `A_row<= (v + ctx)` (the inner
    decoder reading its embedding plus the context). Query (r, c) thus reaches every
    earlier position: (r, c' <= c) directly and every position of rows r' < r through
    the context. The first row has no context (zero).

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        width: grid columns, int >= 1.
        order: which pass(es) to apply.
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time O(seq * (width + seq / width) * d): O(seq^1.5) for a square grid.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_self(q, k, v, kv_mask)
    check_positive("width", width)
    if order not in ("row", "column", "row_then_column"):
        raise ValueError(f"order must be 'row', 'column' or 'row_then_column'; got {order!r}")
    rows = ceil_div(q.shape[0], width)
    if order == "row_then_column" and causal:
        return _causal_composition(q, k, v, width=width, rows=rows, kv_mask=kv_mask, scale=scale)
    if order in ("row", "row_then_column"):
        v = block_local_attention(q, k, v, block_size=width, causal=causal, kv_mask=kv_mask, scale=scale)
        if order == "row":
            return v
        # The row pass gives one value per *query* head; the column pass needs keys to match.
        k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
    return dilated_attention(q, k, v, window=rows, dilation=width, causal=causal, kv_mask=kv_mask, scale=scale)


def _causal_composition(q, k, v, *, width: int, rows: int, kv_mask, scale):
    """The Axial Transformer's causal composition (see `axial_attention`)."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)  # the passes give per-query-head values
    whole_rows = block_local_attention(q, k, v, block_size=width, kv_mask=kv_mask, scale=scale)

    def down_one_row(x):  # position (r, c) holds (r - 1, c); the first row holds nothing
        return jnp.concatenate([jnp.zeros((width, *x.shape[1:]), x.dtype), x])[:n]

    real = jnp.ones((n,), bool) if kv_mask is None else jnp.asarray(kv_mask)
    context = dilated_attention(
        q, down_one_row(k), down_one_row(whole_rows), window=rows, dilation=width, causal=True,
        kv_mask=down_one_row(real), scale=scale,
    )  # fmt: skip
    return block_local_attention(q, k, v + context.astype(v.dtype), block_size=width, causal=True, kv_mask=kv_mask,
                                 scale=scale)  # fmt: skip


register(
    "axial",
    axial_attention,
    family="fixed pattern",
    paper="Ho et al. 2019",
    complexity="O(N (W + N/W))",
    choices={"order": ("row", "column", "row_then_column")},
    docs={"width": "grid columns", "order": "passes"},
    summary="same row, then same column of a `width`-column grid (causal: the Axial Transformer's shifted "
    "outer context, then the masked row)",
    limits={"width": 1},
    dense_width=("its row and column (width + max_len / width keys)", lambda hp, n: hp["width"] + -(-n // hp["width"])),
    grid_width="width",
    scaled=(
        "width = isqrt(N): the square grid (Ho et al. 2019), whose row and column are the fewest keys (2 sqrt N)",
        lambda d, n: {"width": max(1, math.isqrt(n))},
    ),
)
