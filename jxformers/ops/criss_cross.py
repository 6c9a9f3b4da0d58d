"""Criss-cross attention (Huang, Wang, Huang, Huang, Wei & Liu 2019, "CCNet: Criss-Cross
Attention for Semantic Segmentation"): the sequence laid out row-major on a 2-D grid of
`width` columns (as `axial` reads it), each position attending every position of its row
and of its column in one softmax, itself counted once.

The row keys are gathered per row (blocks of `width`), the column keys per residue class
mod `width`, and the softmax is taken jointly over both (`softmax_parts`), so the op
equals dense softmax under the criss-cross mask at O(N (W + N / W)) cost.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jxformers._typing import ArrayLike
from jxformers.decoding import kv_cache
from jxformers.ops._common import (
    attend_parts,
    block_part,
    causal_never_reads_non_finite_future,
    causal_row_attend,
    check_positive,
    default_scale,
    out_dtype,
    positions,
    prepare_self,
    rows_to_output,
    to_blocks,
    zero_padded,
)
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "criss_cross_attention",
]


def _criss_cross_pass(qg, kp, vp, real, *, width: int, causal: bool, scale: float):
    """One criss-cross pass over grid-padded inputs (length L = rows * width): the row
    part (blocks of one row) and the column part (residue classes mod width, the own
    row left out: it is in the row part), one softmax. Returns `[L, h, g, dv]`."""
    length = qg.shape[0]
    rows = length // width
    within = jnp.ones((width, width), bool) if not causal else jnp.tril(jnp.ones((width, width), bool))
    rb = to_blocks(real, width)
    row = block_part(
        to_blocks(qg, width), to_blocks(kp, width), to_blocks(vp, width), within[None] & rb[:, None, :], scale
    )

    def by_column(x):  # [L, ...] -> [width, rows, ...]: column c holds positions r * width + c
        return jnp.swapaxes(to_blocks(x, width), 0, 1)

    r = positions(rows)
    other = r[:, None] != r[None, :]
    if causal:
        other = other & (r[None, :] < r[:, None])
    col_mask = other[None] & by_column(real)[:, None, :]  # [width, rows(q), rows(k)]
    column = block_part(by_column(qg), by_column(kp), by_column(vp), col_mask, scale, interleaved=True)
    return attend_parts([row, column])


@causal_never_reads_non_finite_future()
def criss_cross_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    width: int = 64,
    recurrence: int = 1,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Criss-cross attention (Huang et al., 2019, section 3.1) over a grid of `width`
    columns (rows = ceil(seq / width); a short last row is padded and masked).

    Query (r, c) attends every key (r, c') of its row and (r', c) of its column, one
    softmax over the W + H - 1 keys (the paper's affinity over the criss-cross path,
    itself counted once). `recurrence` R applies the same attention map R times,
    `A^R v` (the paper's recurrent criss-cross attention, R = 2, reaches every position;
    see Returns for how it differs from the paper's loop). `causal=True` keeps the row
    to the left (c' <= c) and the column above (r' <= r), i.e. j <= i in raster order:
    an extension, the paper has no causal form. Causal with R > 1 is refused: the second
    application weighs the first one's outputs at earlier positions, which depend on
    their queries, and a key/value cache keeps no queries (two stacked causal layers
    decode).

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        width: grid columns W, int >= 1.
        recurrence: R >= 1 applications of the attention map (1 when causal).
        causal: restrict to the past (the row to the left, the column above).
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`. With R = 2 the second application reuses the first one's
        queries and keys (`A (A v)`); the paper's second loop recomputes them from the
        first loop's output with the shared weights.

    Time and memory O(R * seq * (W + seq / W) * d): O(seq^1.5) for a square grid.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("width", width)
    check_positive("recurrence", recurrence)
    if causal and (why := _causal_refusal({"recurrence": recurrence})):
        raise ValueError(why)
    n = q.shape[0]
    rows = -(-n // width)
    _, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, rows * width)
    scale = default_scale(q.shape[2], scale)
    g = qg.shape[2]
    out = _criss_cross_pass(qg, kp, vp, real, width=width, causal=causal, scale=scale)  # [L, h, g, dv]
    if recurrence > 1:
        # The next passes weigh the previous one's outputs, one per query head: spread the
        # keys over the query heads (each query head its own kv head).
        kp = jnp.repeat(kp, g, axis=1)
        qg = qg.reshape(qg.shape[0], -1, 1, qg.shape[-1])
    for _ in range(recurrence - 1):
        vp = out.reshape(out.shape[0], -1, out.shape[-1])
        out = _criss_cross_pass(qg, kp, vp, real, width=width, causal=causal, scale=scale)
    return rows_to_output(out, n, out_dtype(q, k, v))


def _causal_refusal(hp) -> str | None:
    """Why a recurrence cannot be causal (the registration's `causal_refusal`), or None."""
    if hp["recurrence"] == 1:
        return None
    return (
        f"causal criss-cross attention takes recurrence=1 (got {hp['recurrence']}): the next application "
        "reads earlier positions' outputs, which a decoder's key/value cache cannot rebuild; "
        "stack causal layers instead"
    )


register(
    "criss_cross",
    criss_cross_attention,
    family="fixed pattern",
    paper="Huang et al. 2019",
    complexity="O(N (W + N/W))",
    decoder=kv_cache(causal_row_attend(criss_cross_attention), forward=("width", "recurrence")),
    docs={"width": "grid columns", "recurrence": "R, applications of the attention map (the paper's R = 2)"},
    summary="same row or same column of a `width`-column grid, one softmax",
    limits={"width": 1, "recurrence": 1},
    dense_width=("its row and column (width + max_len / width keys)", lambda hp, n: hp["width"] + -(-n // hp["width"])),
    grid_width="width",
    causal_refusal=_causal_refusal,
    scaled=(
        "width = isqrt(N): the square grid (Huang et al. 2019's feature maps), whose row and column are the "
        "fewest keys (2 sqrt N)",
        lambda d, n: {"width": max(1, math.isqrt(n))},
    ),
)
