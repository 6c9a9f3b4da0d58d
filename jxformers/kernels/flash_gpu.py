"""Block-sparse flash attention for GPUs: Pallas kernels through the Triton lowering.

One program per (head, query block) walks that block's visit list with an online
softmax (FlashAttention-2's loop, float32 statistics in base 2); the dq kernel walks
the same list, the dk/dv kernel walks each key block's column of the same kinds
matrix. Tiles are `[block, d]` of `[seq, heads, d]` arrays, so no transpose is
needed; a grouped-query head reads its kv head's K/V directly (index `h // group`).
Every function here takes padded inputs (sequences a multiple of the blocks, head
sizes a power of two >= 16); `jxformers.kernels.flash` pads and checks.

The same kernels run in interpret mode on any backend (`interpret=True`), which is
how the CPU test suite checks them against the XLA ops.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jxformers.kernels.alibi import tile_distances
from jxformers.kernels.block_mask import VisitLists
from jxformers.kernels.scores import cap_slope, tanh_cap

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _compiler_params(sizes, *, backward: bool = False):
    stages = sizes.num_stages_bwd if backward and sizes.num_stages_bwd else sizes.num_stages
    return pltriton.CompilerParams(num_warps=sizes.num_warps, num_stages=stages)


def _dot(a, b, *, trans_a=False, trans_b=False):
    """a @ b (a^T, b^T when asked) with a float32 result; float32 inputs in full float32
    (not TF32). `pl.dot` is gone from JAX 0.12, so this is `lax.dot_general`."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _tile_mask(static, q_start, k_start, bq, bk):
    """The pattern's rule and the key bound on one tile (partial blocks only)."""
    i = q_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    j = k_start + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    return static.pattern.allowed(i, j) & (j < static.kv_len)


def _distances(static, q_start, k_start, bq, bk):
    return tile_distances(static.alibi_offset, q_start, k_start, (bq, bk))


def _logits2(static, q, k, partial, q_start, k_start, kvm_ref, q_tags=None, slope=None):
    """Base-2 logits of one tile, masked: -inf where not allowed (the pattern's rule is
    evaluated on `partial` tiles only). `kvm_ref` holds key tags (0: padding; with
    segments, segment + 1), `q_tags [bq]` the queries' segment + 1; `slope` the head's
    ALiBi slope (the bias is computed here, on every visited tile); with a soft-cap,
    c tanh(s / c) of the natural-log logits (bias added), then in base 2."""
    bq, bk = q.shape[0], k.shape[0]
    if static.softcap is None:
        s = _dot(q, k, trans_b=True) * (static.scale * LOG2E)
        if slope is not None:
            s = s - (slope * LOG2E) * _distances(static, q_start, k_start, bq, bk)
    else:
        s = _dot(q, k, trans_b=True) * static.scale
        if slope is not None:
            s = s - slope * _distances(static, q_start, k_start, bq, bk)
        s = tanh_cap(s, static.softcap, LOG2E)
    if kvm_ref is not None:
        tags = kvm_ref[pl.ds(k_start, bk)]
        keep = tags[None, :] != 0 if q_tags is None else q_tags[:, None] == tags[None, :]
        s = jnp.where(keep, s, -jnp.inf)
    if partial:
        s = jnp.where(_tile_mask(static, q_start, k_start, bq, bk), s, -jnp.inf)
    return s


def _visit(index_ref, full_ref, count_ref, row, body, init, *, contiguous):
    """Run `body(block, carry, partial)` over a row's visited blocks: the FULL ones
    (numbered index[row, 0] + t when `contiguous`), then the partial ones."""
    # Loaded once, outside the loop: addresses that depend on a load inside the loop
    # keep Triton's pipeliner from prefetching the next tiles.
    first = index_ref[row, 0]

    def full_body(t, carry):
        block = first + t if contiguous else index_ref[row, t]
        return body(block, carry, partial=False)

    def partial_body(t, carry):
        return body(index_ref[row, t], carry, partial=True)

    carry = lax.fori_loop(0, full_ref[row], full_body, init)
    return lax.fori_loop(full_ref[row], count_ref[row], partial_body, carry)


def _extra_refs(rest, static):
    """(key tags, query tags, ALiBi slope) among a kernel's trailing inputs, None when
    absent; the slope is the current head's (grid axis 0), loaded."""
    kvm_ref = rest[0] if static.has_kv_mask else None
    qt_ref = rest[1] if static.has_segments else None
    slope = None
    if static.alibi_offset is not None:
        slope = rest[int(static.has_kv_mask) + int(static.has_segments)][pl.program_id(0)]
    return kvm_ref, qt_ref, slope


def _sink_start(rest, static, bq):
    """The online softmax's starting (m, l) of a block's rows, base 2: the sink's logit
    and exp(0) = 1 when there is a sink (the forward's input after the slopes), else
    (-inf, 0)."""
    if not static.sinks:
        return jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32)
    at = int(static.has_kv_mask) + int(static.has_segments) + int(static.alibi_offset is not None)
    sink = rest[at][pl.program_id(0)] * LOG2E
    return jnp.full((bq,), sink, jnp.float32), jnp.ones((bq,), jnp.float32)


def _capped_grad(ds, s, static):
    """dL/d(logit before the cap) from dL/d(capped logit) `ds` and the tile's base-2
    capped logits `s` (unchanged without a cap)."""
    return ds if static.softcap is None else ds * cap_slope(s, static.softcap, LOG2E)


def _forward_kernel(index_ref, full_ref, count_ref, q_ref, k_ref, v_ref, *rest, static, bq, bk, contiguous):
    kvm_ref, qt_ref, slope = _extra_refs(rest, static)
    o_ref, lse_ref = rest[-2:]
    qb = pl.program_id(1)
    q = q_ref[...]
    q_start = qb * bq
    q_tags = None if qt_ref is None else qt_ref[pl.ds(q_start, bq)]

    def body(block, carry, partial):
        acc, m, l = carry
        k_start = block * bk
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        s = _logits2(static, q, k, partial, q_start, k_start, kvm_ref, q_tags, slope)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    init = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), *_sink_start(rest, static, bq))
    acc, m, l = _visit(index_ref, full_ref, count_ref, qb, body, init, contiguous=contiguous)
    seen = jnp.logical_not(l <= 0)  # a NaN sum (a non-finite key the row reads) stays NaN, not a silent 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * LN2, jnp.inf)


def _kv_spec(length, d, group):
    return pl.BlockSpec((length, None, d), lambda h, b: (0, h // group, 0))


def _full_spec(x):
    return pl.BlockSpec(x.shape, lambda h, b: (0,) * x.ndim)


def _extras(kv_mask, slopes, static, sinks=None):
    """The trailing inputs: key tags alone, or (key tags, query tags) with segments; then
    the ALiBi slopes `[heads]`, and (the forward's) sink logits `[heads]`."""
    tags = [] if not static.has_kv_mask else list(kv_mask) if static.has_segments else [kv_mask]
    return tags + ([slopes] if static.alibi_offset is not None else []) + ([sinks] if sinks is not None else [])


def forward(q, k, v, kv_mask, slopes, sinks, rows: VisitLists, static):
    """out `[Lq, H, dv]`, lse `[H, Lq]` (natural log; +inf for rows that see no key, the
    sink's logit with a sink); `sinks` the sink logits `[heads]` or None."""
    lq, heads, dk = q.shape
    lk, kv_heads, dv = v.shape
    group = heads // kv_heads
    bq, bk = static.sizes.block_q, static.sizes.block_k
    meta = [jnp.asarray(rows.index), jnp.asarray(rows.full), jnp.asarray(rows.count)]
    tags = _extras(kv_mask, slopes, static, sinks)
    inputs = [*meta, q, k, v, *tags]
    in_specs = [
        *map(_full_spec, meta),
        pl.BlockSpec((bq, None, dk), lambda h, b: (b, h, 0)),
        _kv_spec(lk, dk, group),
        _kv_spec(lk, dv, group),
        *map(_full_spec, tags),
    ]
    return pl.pallas_call(
        functools.partial(_forward_kernel, static=static, bq=bq, bk=bk, contiguous=rows.full_contiguous),
        grid=(heads, lq // bq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((bq, None, dv), lambda h, b: (b, h, 0)), pl.BlockSpec((None, bq), lambda h, b: (h, b))],
        out_shape=[jax.ShapeDtypeStruct((lq, heads, dv), q.dtype), jax.ShapeDtypeStruct((heads, lq), jnp.float32)],
        compiler_params=_compiler_params(static.sizes),
        interpret=static.interpret,
        name="block_sparse_flash_forward",
    )(*inputs)


def _dq_kernel(
    index_ref, full_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, static, bq, bk, contiguous
):
    kvm_ref, qt_ref, slope = _extra_refs(rest, static)
    alibi = slope is not None
    dq_ref = rest[-2] if alibi else rest[-1]
    qb = pl.program_id(1)
    q, do = q_ref[...], do_ref[...]
    lse2 = lse_ref[...] * LOG2E
    delta = delta_ref[...]
    q_start = qb * bq
    q_tags = None if qt_ref is None else qt_ref[pl.ds(q_start, bq)]

    def body(block, carry, partial):
        dq, d_slope = carry
        k_start = block * bk
        k = k_ref[pl.ds(k_start, bk), :]
        v = v_ref[pl.ds(k_start, bk), :]
        s = _logits2(static, q, k, partial, q_start, k_start, kvm_ref, q_tags, slope)
        p = jnp.exp2(s - lse2[:, None])
        dp = _dot(do, v, trans_b=True)
        ds = _capped_grad(p * (dp - delta[:, None]), s, static)  # dL/d(scaled logit + bias)
        if alibi:  # the bias is -slope * distance; masked entries have ds = 0
            d_slope = d_slope - jnp.sum(ds * _distances(static, q_start, k_start, bq, bk), axis=1)
        return dq + _dot(ds.astype(k.dtype), k), d_slope

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros((bq,), jnp.float32))
    dq, d_slope = _visit(index_ref, full_ref, count_ref, qb, body, init, contiguous=contiguous)
    dq_ref[...] = (dq * static.scale).astype(dq_ref.dtype)
    if alibi:
        rest[-1][...] = d_slope


def _dkv_kernel(
    index_ref, full_ref, count_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, static, bq, bk, contiguous
):
    kvm_ref, qt_ref, slope = _extra_refs(rest, static)
    dk_ref, dv_ref = rest[-2:]
    kb = pl.program_id(1)
    k, v = k_ref[...], v_ref[...]
    k_start = kb * bk

    def body(block, carry, partial):
        dk, dv = carry
        q_start = block * bq
        q = q_ref[pl.ds(q_start, bq), :]
        do = do_ref[pl.ds(q_start, bq), :]
        lse2 = lse_ref[pl.ds(q_start, bq)] * LOG2E
        delta = delta_ref[pl.ds(q_start, bq)]
        q_tags = None if qt_ref is None else qt_ref[pl.ds(q_start, bq)]
        s = _logits2(static, q, k, partial, q_start, k_start, kvm_ref, q_tags, slope)
        p = jnp.exp2(s - lse2[:, None])
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        dp = _dot(do, v, trans_b=True)
        ds = _capped_grad(p * (dp - delta[:, None]), s, static)
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = _visit(index_ref, full_ref, count_ref, kb, body, init, contiguous=contiguous)
    dk_ref[...] = dk * static.scale
    dv_ref[...] = dv


def backward(q, k, v, kv_mask, slopes, do, lse, delta, rows: VisitLists, cols: VisitLists, static):
    """dq `[Lq, H, dk]` (q's dtype), float32 per-query-head dk `[Lk, H, dk]`, dv
    `[Lk, H, dv]` (the caller sums each kv head's group), and with ALiBi each row's
    share of its head's slope gradient `[H, Lq]` (else None)."""
    lq, heads, dk_ = q.shape
    lk, kv_heads, dv_ = v.shape
    group = heads // kv_heads
    sizes = static.sizes
    extra = _extras(kv_mask, slopes, static)
    alibi = static.alibi_offset is not None

    bq, bk = sizes.backward
    meta = [jnp.asarray(rows.index), jnp.asarray(rows.full), jnp.asarray(rows.count)]
    q_tile = pl.BlockSpec((bq, None, dk_), lambda h, b: (b, h, 0))
    row_vec = pl.BlockSpec((None, bq), lambda h, b: (h, b))
    dq_out = [jax.ShapeDtypeStruct(q.shape, q.dtype)] + [jax.ShapeDtypeStruct((heads, lq), jnp.float32)] * alibi
    dq, *d_slope = pl.pallas_call(
        functools.partial(_dq_kernel, static=static, bq=bq, bk=bk, contiguous=rows.full_contiguous),
        grid=(heads, lq // bq),
        in_specs=[
            *map(_full_spec, meta),
            q_tile,
            _kv_spec(lk, dk_, group),
            _kv_spec(lk, dv_, group),
            pl.BlockSpec((bq, None, dv_), lambda h, b: (b, h, 0)),
            row_vec,
            row_vec,
            *map(_full_spec, extra),
        ],
        out_specs=[q_tile] + [row_vec] * alibi,
        out_shape=dq_out,
        compiler_params=_compiler_params(sizes, backward=True),
        interpret=static.interpret,
        name="block_sparse_flash_dq",
    )(*meta, q, k, v, do, lse, delta, *extra)

    meta = [jnp.asarray(cols.index), jnp.asarray(cols.full), jnp.asarray(cols.count)]
    full_rows = pl.BlockSpec((None, lq), lambda h, b: (h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, static=static, bq=bq, bk=bk, contiguous=cols.full_contiguous),
        grid=(heads, lk // bk),
        in_specs=[
            *map(_full_spec, meta),
            pl.BlockSpec((lq, None, dk_), lambda h, b: (0, h, 0)),
            pl.BlockSpec((bk, None, dk_), lambda h, b: (b, h // group, 0)),
            pl.BlockSpec((bk, None, dv_), lambda h, b: (b, h // group, 0)),
            pl.BlockSpec((lq, None, dv_), lambda h, b: (0, h, 0)),
            full_rows,
            full_rows,
            *map(_full_spec, extra),
        ],
        out_specs=[
            pl.BlockSpec((bk, None, dk_), lambda h, b: (b, h, 0)),
            pl.BlockSpec((bk, None, dv_), lambda h, b: (b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((lk, heads, dk_), jnp.float32),
            jax.ShapeDtypeStruct((lk, heads, dv_), jnp.float32),
        ],
        compiler_params=_compiler_params(sizes, backward=True),
        interpret=static.interpret,
        name="block_sparse_flash_dkv",
    )(*meta, q, k, v, do, lse, delta, *extra)
    return dq, dk, dv, (d_slope[0] if alibi else None)
