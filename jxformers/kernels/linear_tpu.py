"""Chunked (gated) linear attention for TPUs: Pallas kernels through the Mosaic TPU lowering.

The same four functions as `linear_gpu` (`states`, `output`, `dstates`, `grads`), with
the same padded inputs, written the TPU way (as `flash_tpu` is): every kernel has a
grid (head, chunk) whose BlockSpecs hand it one chunk's tiles, so Pallas double-buffers
the DMA of the next chunk while the current one computes.

* `states`: grid (kv head, chunk), the chunk axis sequential ("arbitrary"): the float32
  state and normaliser live in VMEM scratch across it, S <- exp(B) S + sum_j
  exp(B - b_j) phi(k_j) v_j^T (b the within-chunk cumulative log-gate, B its last
  value). Causal: it writes the state entering each chunk; always the final state.
* `output`: grid (query head, chunk), both parallel: the chunk's masked, decayed
  (phi(q) phi(k)^T) v plus exp(b_i) phi(q_i) S, the same for the denominator.
* `dstates`: grid (query head, chunk) walking the chunks backwards (the index maps
  read chunk `chunks - 1 - t`), carrying dS, dz in VMEM scratch.
* `grads`: grid (query head, chunk), parallel: dq, dk, dv of the chunk.

Layouts, for Mosaic's (8, 128) tiling rule (a tile's last two dims are multiples of
(8, 128) or the array's own): the caller pads m and d_v to multiples of 128, so a
`[n, heads, d]` array enters as `[n, heads * d]` (a free reshape) and a head's chunk is
one `(chunk, d)` tile (chunk a multiple of 8; 128 fills the MXU). The state is kept
transposed, S^T `[d_v, m]`, with z a row `[1, m]`: a per-feature decay then scales
S^T's columns like z's lanes, and the products of the output and of dq, dk, dv with
the state are plain or right-transposed (the MXU's native forms). Per-row vectors
(scalar log-gates, the denominators, dL/dden) travel as rows `[heads, chunks, 1,
chunk]` (legal tiles for any chunk); a kernel that needs one as a column turns it
with `_column`, as splash attention's dq kernel turns its logsumexp row.

Per-feature gates (gated linear attention, b is `[chunk, m]`) build the chunk's weights
key by key (every factor exp(b_i - b_j) with i >= j is <= 1, so no gate can overflow
them) on the VPU; keys are picked by masked sums (static shapes, no dynamic
sublane indexing, which Mosaic restricts for packed 16-bit rows); the state terms
stay MXU products. This path is VPU-bound and slower than the scalar one.

States, normalisers and accumulators are float32; products of float32 intermediates
run in `static.mma` (bfloat16 for bf16 inputs). `interpret=True` runs the kernels in
TPU interpret mode (`pltpu.InterpretParams`) on any backend; the CPU tests run them so
and through Pallas's TPU lowering. Mosaic's own compilation (libtpu) and real TPUs
have not run them yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jxformers.kernels.linear_gpu import TINY
from jxformers.kernels.tpu_interpret import with_semantics

__all__ = ["LANES", "TINY", "dstates", "grads", "output", "padded_size", "states"]

LANES = 128  # lanes of a TPU vreg: m and d_v are padded to multiples of this

_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))  # a @ b.T: the MXU takes a right-transposed operand natively
_TN = (((0,), (0,)), ((), ()))  # a.T @ b: contracts over the chunk's tokens (state updates, dk, dv)


def padded_size(d: int) -> int:
    """m or d_v padded for these kernels: a multiple of the 128 lanes."""
    return -(-d // LANES) * LANES


def _dot(a, b, dims, dtype=None):
    """float32-accumulated product, both operands cast to `dtype` (default: a's);
    float32 ones at HIGHEST precision, asked for explicitly (a TPU's default for float32
    products may be a single bf16 pass)."""
    dtype = a.dtype if dtype is None else dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), dims, precision=precision, preferred_element_type=jnp.float32
    )


def _call(kernel, *, name, grid, sequential, in_specs, out_specs, out_shape, scratch=(), static):
    def build(semantics):
        return pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            scratch_shapes=scratch,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=pltpu.InterpretParams() if static.interpret else False,
            name=name,
        )

    # Heads are independent (megacore may split them); a chunk walk carries its state
    # in scratch, so its axis runs in order, while output/grads chunks do not.
    return with_semantics(build, ("parallel", "arbitrary" if sequential else "parallel"), interpret=static.interpret)


def _column(row_ref):
    """A `(1, C)` row tile as a `(C, 1)` column (as splash attention reads its logsumexp)."""
    return row_ref[0][:, None]


def _tril(c_len):
    i = lax.broadcasted_iota(jnp.int32, (c_len, c_len), 0)
    j = lax.broadcasted_iota(jnp.int32, (c_len, c_len), 1)
    return i >= j


def _decay(b_col, b_row, c_len):
    """D[i, j] = exp(b_i - b_j) for j <= i, else 0 (scalar gates; b the within-chunk
    cumulative log-gates as a column and as a row)."""
    return jnp.where(_tril(c_len), jnp.exp(jnp.minimum(b_col - b_row, 0.0)), 0.0)


def _scalar_gate(b_ref, c_len):
    """A scalar-gate tile `(1, C)` -> (b as a column `[C, 1]`, b as a row, B `[1, 1]`)."""
    b_row = b_ref[...]
    return _column(b_ref), b_row, b_row[:, c_len - 1 :]


def _per_feature(qf, kf, b, c_len, dw=None):
    """The chunk's weights W[i, j] = sum_f q_if k_jf exp(b_if - b_jf) (j <= i, else 0)
    for per-feature gates, built key by key; with `dw` (dL/dW, zero above the
    diagonal) also the in-chunk dq and dk. All `[C, .]` float32."""
    rows = lax.broadcasted_iota(jnp.int32, (c_len, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (1, c_len), 1)

    def key(j, carry):
        w, dq, dk = carry
        pick = rows == j
        k_j = jnp.sum(jnp.where(pick, kf, 0.0), axis=0, keepdims=True)  # [1, m]
        b_j = jnp.sum(jnp.where(pick, b, 0.0), axis=0, keepdims=True)
        # min(., 0) only matters above the diagonal (masked): no overflow there either.
        decay = jnp.exp(jnp.minimum(b - b_j, 0.0))  # [C, m]
        w = w + jnp.where(cols == j, jnp.sum(qf * k_j * decay, axis=1, keepdims=True), 0.0)
        if dw is not None:
            dw_j = jnp.sum(jnp.where(cols == j, dw, 0.0), axis=1, keepdims=True)  # column j of dW
            dq = dq + dw_j * k_j * decay
            dk = dk + jnp.where(pick, jnp.sum(dw_j * qf * decay, axis=0, keepdims=True), 0.0)
        return w, dq, dk

    zeros = jnp.zeros(qf.shape, jnp.float32)
    w, dq, dk = lax.fori_loop(0, c_len, key, (jnp.zeros((c_len, c_len), jnp.float32), zeros, zeros))
    return jnp.where(_tril(c_len), w, 0.0), dq, dk


# ----------------------------------------------------------------------------- layouts


def _flat(x):
    """`[n, heads, d]` -> `[n, heads * d]` (free): a head's chunk is one `(C, d)` tile."""
    return x.reshape(x.shape[0], -1)


def _rows(x, chunk):
    """`[heads, n]` -> `[heads, chunks, 1, chunk]` (free): one chunk's values are a row tile."""
    return x.reshape(x.shape[0], -1, 1, chunk)


def _gate(b, static):
    """The caller's within-chunk cumulative log-gates in the kernels' layout."""
    return _flat(b) if static.per_feature else _rows(b, static.chunk)


def _tile(c_len, d, head, chunk=lambda c: c):
    """A `(C, d)` tile of a flat `[n, heads * d]` array; `head(h)`, `chunk(c)` pick it."""
    return pl.BlockSpec((c_len, d), lambda h, c: (chunk(c), head(h)))


def _row_spec(c_len, head, chunk=lambda c: c):
    return pl.BlockSpec((None, None, 1, c_len), lambda h, c: (head(h), chunk(c), 0, 0))


def _gate_spec(static, m, head, chunk=lambda c: c):
    if static.per_feature:
        return pl.BlockSpec((static.chunk, m), lambda h, c: (chunk(c), head(h)))
    return _row_spec(static.chunk, head, chunk)


def _state_specs(m, dv, head, chunk):
    """(S^T `[heads, rows, dv, m]`, z `[heads, rows, 1, m]`): row `chunk(c)`."""
    return (
        pl.BlockSpec((None, None, dv, m), lambda h, c: (head(h), chunk(c), 0, 0)),
        pl.BlockSpec((None, None, 1, m), lambda h, c: (head(h), chunk(c), 0, 0)),
    )


def _as_state(s, z):
    """A state from `linear.py` (the final one, `[h, m, dv]` and `[h, m]`) in the kernels'
    layout `[h, 1, dv, m]`, `[h, 1, 1, m]`; per-chunk states (4-D) already are. The
    transpose is O(m d_v) per head, outside the O(n) work."""
    if s.ndim == 3:
        return jnp.swapaxes(s, 1, 2)[:, None], z[:, None, None, :]
    return s, z


# ----------------------------------------------------------------------------- forward


def _states_kernel(k_ref, v_ref, *rest, static):
    b_ref = rest[0] if static.gated else None
    s_acc, z_acc = rest[-2:]
    outs = rest[int(static.gated) : -2]
    c, c_len = pl.program_id(1), static.chunk

    @pl.when(c == 0)
    def _init():
        s_acc[...] = jnp.zeros(s_acc.shape, jnp.float32)
        z_acc[...] = jnp.zeros(z_acc.shape, jnp.float32)

    if static.causal:  # the state entering chunk c
        outs[0][...] = s_acc[...]
        outs[1][...] = z_acc[...]
    kf = k_ref[...].astype(jnp.float32)
    s, z = s_acc[...], z_acc[...]
    if static.per_feature:  # b [C, m]: each feature decays at its own rate (S^T's columns)
        b = b_ref[...]
        total = b[c_len - 1 :, :]
        kf = kf * jnp.exp(total - b)
        s, z = s * jnp.exp(total), z * jnp.exp(total)
    elif static.gated:
        b_col, _, total = _scalar_gate(b_ref, c_len)
        kf = kf * jnp.exp(total - b_col)
        s, z = s * jnp.exp(total), z * jnp.exp(total)
    s_acc[...] = s + _dot(v_ref[...], kf, _TN, static.mma)  # S^T += v^T phi(k)
    z_acc[...] = z + jnp.sum(kf, axis=0, keepdims=True)

    @pl.when(c == pl.num_programs(1) - 1)
    def _final():
        outs[-2][...] = s_acc[...]
        outs[-1][...] = z_acc[...]


def states(k, v, b, static):
    """Per kv head: (state entering each chunk, its normaliser; causal only, in the
    kernels' layout `[kv_heads, chunks, dv, m]`, `[kv_heads, chunks, 1, m]`) and the final
    (S `[kv_heads, m, dv]`, z `[kv_heads, m]`)."""
    n, kv_heads, m = k.shape
    dv = v.shape[-1]
    c_len, nc = static.chunk, n // static.chunk
    own = lambda h: h  # noqa: E731
    inputs = [_flat(k), _flat(v)] + ([_gate(b, static)] if static.gated else [])
    in_specs = [_tile(c_len, m, own), _tile(c_len, dv, own)] + ([_gate_spec(static, m, own)] if static.gated else [])
    final = [pl.BlockSpec((None, dv, m), lambda h, c: (h, 0, 0)), pl.BlockSpec((None, 1, m), lambda h, c: (h, 0, 0))]
    out_specs, out_shape = (
        final,
        [jax.ShapeDtypeStruct((kv_heads, dv, m), jnp.float32), jax.ShapeDtypeStruct((kv_heads, 1, m), jnp.float32)],
    )
    if static.causal:
        out_specs = [*_state_specs(m, dv, own, lambda c: c), *out_specs]
        out_shape = [
            jax.ShapeDtypeStruct((kv_heads, nc, dv, m), jnp.float32),
            jax.ShapeDtypeStruct((kv_heads, nc, 1, m), jnp.float32),
            *out_shape,
        ]
    result = _call(
        functools.partial(_states_kernel, static=static),
        name="linear_attention_states_tpu",
        grid=(kv_heads, nc),
        sequential=True,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch=[pltpu.VMEM((dv, m), jnp.float32), pltpu.VMEM((1, m), jnp.float32)],
        static=static,
    )(*inputs)
    s_fin, z_fin = jnp.swapaxes(result[-2], 1, 2), result[-1][:, 0]
    if static.causal:
        return result[0], result[1], s_fin, z_fin
    return None, None, s_fin, z_fin


def _output_kernel(q_ref, k_ref, v_ref, s_ref, z_ref, *rest, static):
    b_ref = rest[0] if static.gated else None
    o_ref, den_ref = rest[-2:]
    c_len, mma = static.chunk, static.mma
    q = q_ref[...]
    qd = q.astype(jnp.float32)
    w = None  # the chunk's weights (causal)
    if static.per_feature:
        b = b_ref[...]
        w, _, _ = _per_feature(qd, k_ref[...].astype(jnp.float32), b, c_len)
        qd = qd * jnp.exp(b)
    elif static.causal:
        w = _dot(q, k_ref[...], _NT)
        if static.gated:
            b_col, b_row, _ = _scalar_gate(b_ref, c_len)
            w = w * _decay(b_col, b_row, c_len)
            qd = qd * jnp.exp(b_col)
        else:
            w = jnp.where(_tril(c_len), w, 0.0)
    z = z_ref[...]
    num = _dot(qd, s_ref[...], _NT, mma)
    den = jnp.sum(qd * z, axis=1, keepdims=True)  # a column, to divide the rows of num
    den_row = _dot(z, qd, _NT)  # the same as a row (the stored layout) from the MXU: no transpose
    if w is not None:
        num = num + _dot(w, v_ref[...], _NN, mma)
        den = den + jnp.sum(w, axis=1, keepdims=True)
        den_row = den_row + _dot(jnp.ones((1, c_len), jnp.float32), w, _NT)
    ok = ~(jnp.abs(den) <= TINY)  # NaN stays NaN: `NaN > TINY` is False (a silent zero)
    o_ref[...] = jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0).astype(o_ref.dtype)
    den_ref[...] = den_row


def output(q, k, v, s, z, b, static):
    """out `[n, heads, dv]` (q's dtype) and the denominators `[heads, n]` (float32); (s, z)
    are the per-chunk states from `states` (causal) or the final ones."""
    n, heads, m = q.shape
    kv_heads, dv = v.shape[1], v.shape[2]
    group, c_len = heads // kv_heads, static.chunk
    own, kv = (lambda h: h), (lambda h: h // group)
    s, z = _as_state(s, z)
    in_specs = [
        _tile(c_len, m, own),
        _tile(c_len, m, kv),
        _tile(c_len, dv, kv),
        *_state_specs(m, dv, kv, (lambda c: c) if static.causal else (lambda c: 0)),
    ]
    inputs = [_flat(q), _flat(k), _flat(v), s, z]
    if static.gated:
        in_specs.append(_gate_spec(static, m, kv))
        inputs.append(_gate(b, static))
    out, den = _call(
        functools.partial(_output_kernel, static=static),
        name="linear_attention_output_tpu",
        grid=(heads, n // c_len),
        sequential=False,
        in_specs=in_specs,
        out_specs=[_tile(c_len, dv, own), _row_spec(c_len, own)],
        out_shape=[
            jax.ShapeDtypeStruct((n, heads * dv), q.dtype),
            jax.ShapeDtypeStruct((heads, n // c_len, 1, c_len), jnp.float32),
        ],
        static=static,
    )(*inputs)
    return out.reshape(n, heads, dv), den.reshape(heads, n)


# ----------------------------------------------------------------------------- backward


def _dstates_kernel(q_ref, g_ref, r_ref, ds0_ref, dz0_ref, *rest, static):
    b_ref = rest[0] if static.gated else None
    ds_ref, dz_ref, acc, accz = rest[-4:]
    t, c_len = pl.program_id(1), static.chunk

    @pl.when(t == 0)
    def _init():
        acc[...] = ds0_ref[...]
        accz[...] = dz0_ref[...]

    if static.causal:  # the gradient of the state leaving this chunk
        ds_ref[...] = acc[...]
        dz_ref[...] = accz[...]
    qd = q_ref[...].astype(jnp.float32)
    ds, dz = acc[...], accz[...]
    if static.per_feature:
        b = b_ref[...]
        total = b[c_len - 1 :, :]
        qd = qd * jnp.exp(b)
        ds, dz = ds * jnp.exp(total), dz * jnp.exp(total)
    elif static.gated:
        b_col, _, total = _scalar_gate(b_ref, c_len)
        qd = qd * jnp.exp(b_col)
        ds, dz = ds * jnp.exp(total), dz * jnp.exp(total)
    acc[...] = ds + _dot(g_ref[...], qd, _TN, static.mma)  # dS^T += g^T (decayed phi(q))
    accz[...] = dz + _dot(r_ref[...], qd, _NN)  # dz += sum_i r_i (decayed phi(q_i)): a row times the tile

    if not static.causal:

        @pl.when(t == pl.num_programs(1) - 1)
        def _final():
            ds_ref[...] = acc[...]
            dz_ref[...] = accz[...]


def dstates(q, g, r, ds0, dz0, b, static):
    """Per query head, in the kernels' layout: the gradients of the state leaving each
    chunk (causal: `[heads, chunks, dv, m]`, `[heads, chunks, 1, m]`) or of the final
    state (`[heads, 1, dv, m]`, `[heads, 1, 1, m]`). ds0, dz0: `[heads, m, dv]`, `[heads, m]`."""
    n, heads, m = q.shape
    dv = g.shape[-1]
    c_len, nc = static.chunk, n // static.chunk
    own = lambda h: h  # noqa: E731
    back = lambda t: nc - 1 - t  # noqa: E731  (grid step t visits chunk nc - 1 - t)
    ds0, dz0 = _as_state(ds0, dz0)
    in_specs = [
        _tile(c_len, m, own, back),
        _tile(c_len, dv, own, back),
        _row_spec(c_len, own, back),
        *_state_specs(m, dv, own, lambda t: 0),
    ]
    inputs = [_flat(q), _flat(g), _rows(r, c_len), ds0, dz0]
    if static.gated:
        in_specs.append(_gate_spec(static, m, lambda h: h // static.group, back))
        inputs.append(_gate(b, static))
    rows = nc if static.causal else 1
    return _call(
        functools.partial(_dstates_kernel, static=static),
        name="linear_attention_dstates_tpu",
        grid=(heads, nc),
        sequential=True,
        in_specs=in_specs,
        out_specs=list(_state_specs(m, dv, own, back if static.causal else (lambda t: 0))),
        out_shape=[
            jax.ShapeDtypeStruct((heads, rows, dv, m), jnp.float32),
            jax.ShapeDtypeStruct((heads, rows, 1, m), jnp.float32),
        ],
        scratch=[pltpu.VMEM((dv, m), jnp.float32), pltpu.VMEM((1, m), jnp.float32)],
        static=static,
    )(*inputs)


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, r_ref, s_ref, z_ref, ds_ref, dz_ref, *rest, static):
    b_ref = rest[0] if static.gated else None
    dq_ref, dk_ref, dv_ref = rest[-3:]
    c_len, mma = static.chunk, static.mma
    q, k, v, g = q_ref[...], k_ref[...], v_ref[...], g_ref[...]
    r = _column(r_ref)
    dst = ds_ref[...]
    # The state terms: dq = g S^T + r z, dk = v dS^T + dz, dv = phi(k) dS (decayed when gated).
    dq = _dot(g, s_ref[...], _NN, mma) + r * z_ref[...]
    dk = _dot(v, dst, _NN, mma) + dz_ref[...]
    if not static.causal:
        dq_ref[...] = dq
        dk_ref[...] = dk
        dv_ref[...] = _dot(k, dst, _NT, mma)
        return
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    dw = _dot(g, v, _NT, mma) + r  # dL/dw_ij before the decay and the mask
    if static.per_feature:
        b = b_ref[...]
        k_decay = jnp.exp(b[c_len - 1 :, :] - b)
        dq, dk = dq * jnp.exp(b), dk * k_decay
        w, dq_in, dk_in = _per_feature(qf, kf, b, c_len, dw=jnp.where(_tril(c_len), dw, 0.0))
    else:
        if static.gated:
            b_col, b_row, total = _scalar_gate(b_ref, c_len)
            decay = _decay(b_col, b_row, c_len)
            k_decay = jnp.exp(total - b_col)
            dq, dk = dq * jnp.exp(b_col), dk * k_decay
        else:
            decay = _tril(c_len).astype(jnp.float32)
            k_decay = 1.0
        w = _dot(q, k, _NT) * decay
        dw = dw * decay
        dq_in, dk_in = _dot(dw, k, _NN, mma), _dot(dw, q, _TN, mma)
    dq_ref[...] = dq + dq_in
    dk_ref[...] = dk + dk_in
    dv_ref[...] = _dot(w, g, _TN, mma) + _dot(kf * k_decay, dst, _NT, mma)


def grads(q, k, v, g, r, s, z, ds, dz, b, static):
    """float32 dq `[n, heads, m]` and per-query-head dk `[n, heads, m]`, dv `[n, heads, dv]`
    (the caller sums each kv head's group); ds, dz as `dstates` returns them."""
    n, heads, m = q.shape
    kv_heads, dv = v.shape[1], v.shape[2]
    group, c_len = heads // kv_heads, static.chunk
    own, kv = (lambda h: h), (lambda h: h // group)
    chunk = (lambda c: c) if static.causal else (lambda c: 0)
    s, z = _as_state(s, z)
    in_specs = [
        _tile(c_len, m, own),
        _tile(c_len, m, kv),
        _tile(c_len, dv, kv),
        _tile(c_len, dv, own),
        _row_spec(c_len, own),
        *_state_specs(m, dv, kv, chunk),
        *_state_specs(m, dv, own, chunk),
    ]
    inputs = [_flat(q), _flat(k), _flat(v), _flat(g), _rows(r, c_len), s, z, ds, dz]
    if static.gated:
        in_specs.append(_gate_spec(static, m, kv))
        inputs.append(_gate(b, static))
    dq, dk, dv_ = _call(
        functools.partial(_grads_kernel, static=static),
        name="linear_attention_grads_tpu",
        grid=(heads, n // c_len),
        sequential=False,
        in_specs=in_specs,
        out_specs=[_tile(c_len, m, own), _tile(c_len, m, own), _tile(c_len, dv, own)],
        out_shape=[
            jax.ShapeDtypeStruct((n, heads * m), jnp.float32),
            jax.ShapeDtypeStruct((n, heads * m), jnp.float32),
            jax.ShapeDtypeStruct((n, heads * dv), jnp.float32),
        ],
        static=static,
    )(*inputs)
    return dq.reshape(n, heads, m), dk.reshape(n, heads, m), dv_.reshape(n, heads, dv)
