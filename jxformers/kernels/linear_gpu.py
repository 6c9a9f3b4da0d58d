"""Chunked (gated) linear attention for GPUs: Pallas kernels through the Triton lowering.

The design of flash-linear-attention's chunk kernels, with linear attention's normaliser
carried beside the state. For chunks of C tokens, b the within-chunk cumulative log-gate
(zero without a gate) and B its last value:

* `states`: one program per (kv head, d_v block) walks the chunks in order, carrying
  the float32 state's columns S[:, block] [m, block_v] and the normaliser z [m]:
  S <- exp(B) S + sum_j exp(B - b_j) phi(k_j) v_j^T, column by column independent, so
  d_v splits over programs as in flash-linear-attention (`block_v`; unsplit by default).
  Causal: it stores the state entering each chunk ([kv_heads, chunks * m, dv]); always
  the final state (the recurrent decoder's layout, [kv_heads, m, dv] and [kv_heads, m]).
* `output`: one program per (query head, chunk), all parallel: the masked, decayed
  (phi(q) phi(k)^T) v of the chunk plus exp(b_i) phi(q_i) S; the same for the
  denominator; the output and the denominator (the backward's only extra residual).
* `dstates`: one program per (query head, d_v block) walks the chunks backwards
  carrying dS[:, block], dz (the gradients of the state leaving each chunk).
* `grads`: one program per (query head, chunk): dq, dk, dv of the chunk from its
  recomputed state and the dS, dz after it.

Per-feature gates (gated linear attention: b is [C, m]) take the same kernels with the
in-chunk weights built key by key (every factor exp(b_i - b_j) with i >= j is <= 1, so no
gate can overflow them) on CUDA cores; the state terms stay matrix products.

Every function here takes padded inputs (sequence a multiple of the chunk, feature and
value sizes powers of two >= 16); `jxformers.kernels.linear` pads, checks, and holds the
custom VJP. The same kernels run in interpret mode on any backend (`interpret=True`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

TINY = 1e-30  # as jxformers._arrays.guarded_divide: a smaller denominator is an empty row


def _dot(a, b, *, trans_a=False, trans_b=False, dtype=None):
    """a @ b (a^T, b^T when asked) with a float32 result, both operands cast to `dtype`
    (default: their own); float32 operands in full float32 (not TF32). On CPU (interpret
    mode) 16-bit operands are upcast: XLA:CPU rejects some bf16 x bf16 -> f32 dots, and
    the products of 16-bit numbers are exact in float32 anyway."""
    dtype = a.dtype if dtype is None else dtype
    if jnp.dtype(dtype).itemsize < 4 and jax.default_backend() == "cpu":
        dtype = jnp.float32
    a, b = a.astype(dtype), b.astype(dtype)
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _params(static):
    return pltriton.CompilerParams(num_warps=static.num_warps, num_stages=static.num_stages)


def _tril(c):
    i = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    j = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    return i >= j


def _decay(b, c):
    """D[i, j] = exp(b_i - b_j) for j <= i, else 0 (b: within-chunk cumulative log-gates)."""
    return jnp.where(_tril(c), jnp.exp(jnp.minimum(b[:, None] - b[None, :], 0.0)), 0.0)


def _kv_spec(n, d, group, split=False):
    """A head's whole sequence of [n, heads, d] for a (head, d_v block) program: all of d,
    or (`split`) the program's block of d columns."""
    return pl.BlockSpec((n, None, d), lambda h, j: (0, h // group, j if split else 0))


def _gate_spec(static, n, m, group):
    """A head's whole within-chunk cumulative log-gates: [kv_heads, n] (scalar) or
    [n, kv_heads, m] (per feature), for a (head, d_v block) program."""
    if static.per_feature:
        return _kv_spec(n, m, group)
    return pl.BlockSpec((None, n), lambda h, j: (h // group, 0))


def _walk_specs(static, rows):
    """BlockSpecs of a state walk's (S, z) outputs (or inputs) [heads, rows, dv] and
    [heads, rows] for a (head, d_v block) program: its block of S's columns, all of z."""
    return [
        pl.BlockSpec((None, rows, static.block_v), lambda h, j: (h, 0, j)),
        pl.BlockSpec((None, rows), lambda h, j: (h, 0)),
    ]


def _first_block(split):
    """Whether this program holds the first d_v block (None when d_v is not split). Read
    at the kernel's top: the interpreter replaces `program_id` there, not inside loops."""
    return pl.program_id(1) == 0 if split else None


def _store_z(first, ref, index, z):
    """ref[index] = z, the normaliser (the same in every d_v block's program): stored by
    the first block's program only when d_v is split (`first` not None)."""

    def store():
        ref[index] = z

    if first is None:
        store()
    else:
        pl.when(first)(store)


def _chunk_gate_spec(static, c_len, m, group):
    """One chunk's within-chunk cumulative log-gates, for a (head, chunk) program."""
    if static.per_feature:
        return pl.BlockSpec((c_len, None, m), lambda h, c: (c, h // group, 0))
    return pl.BlockSpec((None, c_len), lambda h, c: (h // group, c))


def _rows(c_len, j):
    """[C] mask of the rows i >= j (the queries that see key j of the chunk)."""
    return lax.broadcasted_iota(jnp.int32, (c_len,), 0) >= j


# ----------------------------------------------------------------------------- forward


def _states_kernel(k_ref, v_ref, *rest, static, split):
    b_ref = rest[0] if static.gated else None
    if static.causal:
        s_ref, z_ref, sf_ref, zf_ref = rest[-4:]
    else:
        sf_ref, zf_ref = rest[-2:]
    c_len, m = static.chunk, k_ref.shape[-1]
    first = _first_block(split)

    def body(c, carry):
        s, z = carry
        start = c * c_len
        if static.causal:
            s_ref[pl.ds(c * m, m), :] = s
            _store_z(first, z_ref, pl.ds(c * m, m), z)
        k = k_ref[pl.ds(start, c_len), :]
        v = v_ref[pl.ds(start, c_len), :]
        kf = k.astype(jnp.float32)
        if static.per_feature:  # b [C, m]: each feature decays at its own rate
            b = b_ref[pl.ds(start, c_len), :]
            total = b_ref[start + c_len - 1, :]
            kf = kf * jnp.exp(total[None, :] - b)
            s, z = s * jnp.exp(total)[:, None], z * jnp.exp(total)
        elif static.gated:
            b = b_ref[pl.ds(start, c_len)]
            total = b_ref[start + c_len - 1]
            kf = kf * jnp.exp(total - b)[:, None]
            s, z = s * jnp.exp(total), z * jnp.exp(total)
        s = s + _dot(kf, v, trans_a=True, dtype=static.mma)
        z = z + jnp.sum(kf, axis=0)
        return s, z

    init = (jnp.zeros(sf_ref.shape, jnp.float32), jnp.zeros(zf_ref.shape, jnp.float32))
    s, z = lax.fori_loop(0, static.n // c_len, body, init)
    sf_ref[...] = s
    _store_z(first, zf_ref, slice(None), z)


def states(k, v, b, static):
    """Per kv head: (state entering each chunk [kv_heads, chunks * m, dv], its
    normaliser [kv_heads, chunks * m]; causal only) and the final (S, z). One program per
    (kv head, block of `static.block_v` columns of the state)."""
    n, kv_heads, m = k.shape
    dv = v.shape[-1]
    nc = n // static.chunk
    inputs = [k, v] + ([b] if static.gated else [])
    in_specs = [_kv_spec(n, m, 1), _kv_spec(n, static.block_v, 1, split=True)]
    in_specs += [_gate_spec(static, n, m, 1)] if static.gated else []
    out_specs = _walk_specs(static, m)
    out_shape = [jax.ShapeDtypeStruct((kv_heads, m, dv), jnp.float32), jax.ShapeDtypeStruct((kv_heads, m), jnp.float32)]
    if static.causal:
        out_specs = _walk_specs(static, nc * m) + out_specs
        out_shape = [
            jax.ShapeDtypeStruct((kv_heads, nc * m, dv), jnp.float32),
            jax.ShapeDtypeStruct((kv_heads, nc * m), jnp.float32),
        ] + out_shape
    result = pl.pallas_call(
        functools.partial(_states_kernel, static=static, split=static.block_v < dv),
        grid=(kv_heads, dv // static.block_v),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(static),
        interpret=static.interpret,
        name="linear_attention_states",
    )(*inputs)
    if static.causal:
        return tuple(result)
    return None, None, *result


def _state_specs(static, m, dv, group):
    """BlockSpecs of (S, z) as read by a (head, chunk) program: the state entering the
    chunk (causal) or the final one (non-causal)."""
    if static.causal:
        return (
            pl.BlockSpec((None, m, dv), lambda h, c: (h // group, c, 0)),
            pl.BlockSpec((None, m), lambda h, c: (h // group, c)),
        )
    return (
        pl.BlockSpec((None, m, dv), lambda h, c: (h // group, 0, 0)),
        pl.BlockSpec((None, m), lambda h, c: (h // group, 0)),
    )


def _output_kernel(q_ref, k_ref, v_ref, s_ref, z_ref, *rest, static):
    b_ref = rest[0] if static.gated else None
    o_ref, den_ref = rest[-2:]
    c_len = static.chunk
    q = q_ref[...]
    s, z = s_ref[...], z_ref[...]
    if static.per_feature:
        # exp(b_i - b_j) per feature cannot be split into a query and a key factor
        # without overflow, so the chunk's keys are visited one at a time (i >= j only:
        # every factor is <= 1), on CUDA cores; the state term is one product.
        b = b_ref[...]
        qf = q.astype(jnp.float32)
        qd = qf * jnp.exp(b)
        init = (_dot(qd, s, dtype=static.mma), jnp.sum(qd * z[None, :], axis=1))

        def key(j, carry):
            num, den = carry
            k_j, v_j, b_j = k_ref[j, :].astype(jnp.float32), v_ref[j, :].astype(jnp.float32), b_ref[j, :]
            w = jnp.sum(qf * k_j[None, :] * jnp.exp(jnp.minimum(b - b_j[None, :], 0.0)), axis=1)
            w = jnp.where(_rows(c_len, j), w, 0.0)
            return num + w[:, None] * v_j[None, :], den + w

        num, den = lax.fori_loop(0, c_len, key, init)
    elif static.causal:
        k, v = k_ref[...], v_ref[...]
        a = _dot(q, k, trans_b=True)
        qd = q.astype(jnp.float32)
        if static.gated:
            b = b_ref[...]
            a = a * _decay(b, c_len)
            qd = qd * jnp.exp(b)[:, None]
        else:
            a = jnp.where(_tril(c_len), a, 0.0)
        num = _dot(a, v, dtype=static.mma) + _dot(qd, s, dtype=static.mma)
        den = jnp.sum(a, axis=1) + jnp.sum(qd * z[None, :], axis=1)
    else:
        num = _dot(q, s, dtype=static.mma)
        den = jnp.sum(q.astype(jnp.float32) * z[None, :], axis=1)
    ok = ~(jnp.abs(den) <= TINY)  # NaN stays NaN: `NaN > TINY` is False (a silent zero)
    o_ref[...] = jnp.where(ok[:, None], num / jnp.where(ok, den, 1.0)[:, None], 0.0).astype(o_ref.dtype)
    den_ref[...] = den


def output(q, k, v, s, z, b, static):
    """out `[n, heads, dv]` (q's dtype) and the denominators `[heads, n]` (float32)."""
    n, heads, m = q.shape
    kv_heads, dv = v.shape[1], v.shape[2]
    group = heads // kv_heads
    c_len = static.chunk
    in_specs = [
        pl.BlockSpec((c_len, None, m), lambda h, c: (c, h, 0)),
        pl.BlockSpec((c_len, None, m), lambda h, c: (c, h // group, 0)),
        pl.BlockSpec((c_len, None, dv), lambda h, c: (c, h // group, 0)),
        *_state_specs(static, m, dv, group),
    ]
    inputs = [q, k, v, s, z]
    if static.gated:
        in_specs.append(_chunk_gate_spec(static, c_len, m, group))
        inputs.append(b)
    return pl.pallas_call(
        functools.partial(_output_kernel, static=static),
        grid=(heads, n // c_len),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((c_len, None, dv), lambda h, c: (c, h, 0)),
            pl.BlockSpec((None, c_len), lambda h, c: (h, c)),
        ],
        out_shape=[jax.ShapeDtypeStruct((n, heads, dv), q.dtype), jax.ShapeDtypeStruct((heads, n), jnp.float32)],
        compiler_params=_params(static),
        interpret=static.interpret,
        name="linear_attention_output",
    )(*inputs)


# ----------------------------------------------------------------------------- backward


def _dstates_kernel(q_ref, g_ref, r_ref, ds0_ref, dz0_ref, *rest, static, split):
    b_ref = rest[0] if static.gated else None
    if static.causal:
        ds_ref, dz_ref = rest[-2:]
    else:
        dsf_ref, dzf_ref = rest[-2:]
    c_len, m = static.chunk, q_ref.shape[-1]
    first = _first_block(split)
    nc = static.n // c_len

    def body(t, carry):
        acc, accz = carry
        c = nc - 1 - t if static.causal else t
        start = c * c_len
        if static.causal:  # the gradient of the state leaving chunk c
            ds_ref[pl.ds(c * m, m), :] = acc
            _store_z(first, dz_ref, pl.ds(c * m, m), accz)
        qd = q_ref[pl.ds(start, c_len), :].astype(jnp.float32)
        g = g_ref[pl.ds(start, c_len), :]
        r = r_ref[pl.ds(start, c_len)]
        if static.per_feature:
            b = b_ref[pl.ds(start, c_len), :]
            total = b_ref[start + c_len - 1, :]
            qd = qd * jnp.exp(b)
            acc, accz = acc * jnp.exp(total)[:, None], accz * jnp.exp(total)
        elif static.gated:
            b = b_ref[pl.ds(start, c_len)]
            total = b_ref[start + c_len - 1]
            qd = qd * jnp.exp(b)[:, None]
            acc, accz = acc * jnp.exp(total), accz * jnp.exp(total)
        acc = acc + _dot(qd, g, trans_a=True, dtype=static.mma)
        accz = accz + jnp.sum(qd * r[:, None], axis=0)
        return acc, accz

    acc, accz = lax.fori_loop(0, nc, body, (ds0_ref[...], dz0_ref[...]))
    if not static.causal:
        dsf_ref[...] = acc
        _store_z(first, dzf_ref, slice(None), accz)


def dstates(q, g, r, ds0, dz0, b, static):
    """Per query head: the gradients of the state leaving each chunk (causal:
    `[heads, chunks * m, dv]`, `[heads, chunks * m]`) or of the final state. One program
    per (query head, block of `static.block_v` columns)."""
    n, heads, m = q.shape
    dv = g.shape[-1]
    nc = n // static.chunk
    in_specs = [
        _kv_spec(n, m, 1),
        _kv_spec(n, static.block_v, 1, split=True),
        pl.BlockSpec((None, n), lambda h, j: (h, 0)),
        *_walk_specs(static, m),
    ]
    inputs = [q, g, r, ds0, dz0]
    if static.gated:
        in_specs.append(_gate_spec(static, n, m, static.group))
        inputs.append(b)
    rows = nc * m if static.causal else m
    out_specs = _walk_specs(static, rows)
    out_shape = [jax.ShapeDtypeStruct((heads, rows, dv), jnp.float32), jax.ShapeDtypeStruct((heads, rows), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_dstates_kernel, static=static, split=static.block_v < dv),
        grid=(heads, dv // static.block_v),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(static),
        interpret=static.interpret,
        name="linear_attention_dstates",
    )(*inputs)


def _grads_kernel(q_ref, k_ref, v_ref, g_ref, r_ref, s_ref, z_ref, ds_ref, dz_ref, *rest, static):
    b_ref = rest[0] if static.gated else None
    dq_ref, dk_ref, dv_ref = rest[-3:]
    c_len = static.chunk
    q, k, v = q_ref[...], k_ref[...], v_ref[...]
    g, r = g_ref[...], r_ref[...]
    s, z, ds, dz = s_ref[...], z_ref[...], ds_ref[...], dz_ref[...]
    mma = static.mma
    if static.per_feature:
        b = b_ref[...]
        total = b_ref[c_len - 1, :]
        q_decay, k_decay = jnp.exp(b), jnp.exp(total[None, :] - b)
        qf = q.astype(jnp.float32)
        dq = q_decay * (_dot(g, s, trans_b=True, dtype=mma) + r[:, None] * z[None, :])
        dk_ref[...] = k_decay * (_dot(v, ds, trans_b=True, dtype=mma) + dz[None, :])
        dv_ref[...] = _dot(k.astype(jnp.float32) * k_decay, ds, dtype=mma)

        def key(j, dq):  # the chunk's key j: its column of the weights, its rows of dk, dv
            k_j, v_j, b_j = k_ref[j, :].astype(jnp.float32), v_ref[j, :].astype(jnp.float32), b_ref[j, :]
            seen = _rows(c_len, j)
            decay = jnp.exp(jnp.minimum(b - b_j[None, :], 0.0))
            w = jnp.where(seen, jnp.sum(qf * k_j[None, :] * decay, axis=1), 0.0)
            dw = jnp.where(seen, jnp.sum(g * v_j[None, :], axis=1) + r, 0.0)
            dk_ref[j, :] = dk_ref[j, :] + jnp.sum(dw[:, None] * qf * decay, axis=0)
            dv_ref[j, :] = dv_ref[j, :] + jnp.sum(w[:, None] * g, axis=0)
            return dq + dw[:, None] * k_j[None, :] * decay

        dq_ref[...] = lax.fori_loop(0, c_len, key, dq)
        return
    if not static.causal:
        dq = _dot(g, s, trans_b=True, dtype=mma) + r[:, None] * z[None, :]
        dk = _dot(v, ds, trans_b=True, dtype=mma) + dz[None, :]
        dv = _dot(k, ds, dtype=mma)
    else:
        if static.gated:
            b = b_ref[...]
            total = b_ref[c_len - 1]
            decay = _decay(b, c_len)
            q_decay, k_decay = jnp.exp(b)[:, None], jnp.exp(total - b)[:, None]
        else:
            decay = _tril(c_len).astype(jnp.float32)
            q_decay = k_decay = 1.0
        a = _dot(q, k, trans_b=True) * decay  # the chunk's weights w_ij
        dw = (_dot(g, v, trans_b=True, dtype=mma) + r[:, None]) * decay  # dL/dw_ij, decayed
        dq = _dot(dw, k, dtype=mma) + q_decay * (_dot(g, s, trans_b=True, dtype=mma) + r[:, None] * z[None, :])
        kd = k.astype(jnp.float32) * k_decay
        dk = _dot(dw, q, trans_a=True, dtype=mma) + k_decay * (_dot(v, ds, trans_b=True, dtype=mma) + dz[None, :])
        dv = _dot(a, g, trans_a=True, dtype=mma) + _dot(kd, ds, dtype=mma)
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv


def grads(q, k, v, g, r, s, z, ds, dz, b, static):
    """float32 dq `[n, heads, m]` and per-query-head dk `[n, heads, m]`, dv `[n, heads, dv]`
    (the caller sums each kv head's group)."""
    n, heads, m = q.shape
    kv_heads, dv = v.shape[1], v.shape[2]
    group = heads // kv_heads
    c_len = static.chunk
    own = _state_specs(static, m, dv, 1)
    in_specs = [
        pl.BlockSpec((c_len, None, m), lambda h, c: (c, h, 0)),
        pl.BlockSpec((c_len, None, m), lambda h, c: (c, h // group, 0)),
        pl.BlockSpec((c_len, None, dv), lambda h, c: (c, h // group, 0)),
        pl.BlockSpec((c_len, None, dv), lambda h, c: (c, h, 0)),
        pl.BlockSpec((None, c_len), lambda h, c: (h, c)),
        *_state_specs(static, m, dv, group),
        *own,
    ]
    inputs = [q, k, v, g, r, s, z, ds, dz]
    if static.gated:
        in_specs.append(_chunk_gate_spec(static, c_len, m, group))
        inputs.append(b)
    tile = lambda d: pl.BlockSpec((c_len, None, d), lambda h, c: (c, h, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_grads_kernel, static=static),
        grid=(heads, n // c_len),
        in_specs=in_specs,
        out_specs=[tile(m), tile(m), tile(dv)],
        out_shape=[
            jax.ShapeDtypeStruct((n, heads, m), jnp.float32),
            jax.ShapeDtypeStruct((n, heads, m), jnp.float32),
            jax.ShapeDtypeStruct((n, heads, dv), jnp.float32),
        ],
        compiler_params=_params(static),
        interpret=static.interpret,
        name="linear_attention_grads",
    )(*inputs)
