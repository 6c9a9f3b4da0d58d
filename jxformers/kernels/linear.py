"""Chunked linear attention (the kernelized family: linear, Performer, RFA, gated
linear attention): the public kernel entry point and its custom VJP.

    out = chunked_linear_attention(phi_q, phi_k, v, causal=True, log_gate=None)

computes, with features already applied, out_i = num_i / den_i where
num_i = sum_j w_ij v_j, den_i = sum_j w_ij, w_ij = (phi(q_i) . phi(k_j)) prod_{j<l<=i} g_l
over j <= i (causal) or all j (no gate): the function `ops.kernel_attention` computes
in its quadratic, scan and chunked XLA forms (rows with a zero denominator are zero).
The gate is given as log-gates (<= 0) per token and kv head, or per token, kv head and
feature (gated linear attention, where the product above is taken feature by feature);
a Performer's per-chunk stabiliser is a per-token gate too (a log-gate on the token
where the running max grows).

States and normalisers accumulate in float32 whatever the input dtype. The forward
saves the inputs, the output and one denominator per row (O(N) per head); the backward
recomputes the chunk states, so activation memory never grows with N * m * d_v. The
final state (S [kv_heads, m, d_v], z [kv_heads, m]) is the recurrent decoder's layout
(`jxformers.decoding.RecurrentState`) and is differentiable too.

The kernels live in `linear_gpu` (Triton lowering) and `linear_tpu` (Mosaic TPU), picked
by `backend`: the same four functions on the same padded inputs, so the custom VJP (and
its gate gradients) is one for both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jxformers.kernels import linear_gpu

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BACKENDS = ("gpu", "tpu")  # `linear_gpu` (Triton lowering), `linear_tpu` (Mosaic TPU)
DEFAULT_CHUNK = 64
# Whether impl="auto" picks these kernels on a GPU: on an H100 (docs/kernel_runs/linear_h100.md)
# they matched XLA's float32 chunked form to bf16 rounding (2e-3 output, 7e-3 dq) and ran
# 3.7x (forward) and 3.2-3.5x (forward+backward) faster than it at 4K-16K tokens.
AUTO_ON_GPU = True


@dataclasses.dataclass(frozen=True)
class _Static:
    n: int  # padded length, a multiple of `chunk`
    chunk: int
    causal: bool
    gated: bool
    per_feature: bool  # the log-gates are [n, kv_heads, m] (one decay per feature), else [kv_heads, n]
    group: int  # query heads per kv head
    mma: jnp.dtype  # operand dtype of the products of float32 intermediates (states, weights)
    block_v: int  # columns of the state per program of the state walks ("gpu" only; the padded d_v: unsplit)
    num_warps: int  # Triton settings (the "gpu" backend only)
    num_stages: int
    interpret: bool
    backend: str  # which module holds the kernels (BACKENDS)


def _kernels(backend: str):
    """The kernel module of `backend`: the same four functions (states, output, dstates,
    grads) on the same padded inputs."""
    if backend == "gpu":
        return linear_gpu
    if backend == "tpu":
        from jxformers.kernels import linear_tpu

        return linear_tpu
    raise ValueError(f"no chunked linear-attention kernel for backend {backend!r}; kernels: {list(BACKENDS)}")


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


def _within_chunks(log_gate, chunk):
    """[kv_heads, n] (or per feature [n, kv_heads, m]) log-gates -> their cumulative sums
    within each chunk."""
    if log_gate.ndim == 3:
        n, h, m = log_gate.shape
        return jnp.cumsum(log_gate.reshape(n // chunk, chunk, h, m), axis=1).reshape(n, h, m)
    h, n = log_gate.shape
    return jnp.cumsum(log_gate.reshape(h, n // chunk, chunk), axis=-1).reshape(h, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _linear(q, k, v, log_gate, static):
    return _forward(q, k, v, log_gate, static)[0]


def _forward(q, k, v, log_gate, static):
    kernels = _kernels(static.backend)
    b = _within_chunks(log_gate, static.chunk) if static.gated else None
    s_all, z_all, s_fin, z_fin = kernels.states(k, v, b, static)
    s_in, z_in = (s_all, z_all) if static.causal else (s_fin, z_fin)
    out, den = kernels.output(q, k, v, s_in, z_in, b, static)
    return (out, s_fin, z_fin), (q, k, v, log_gate, out, den, s_fin, z_fin)


def _backward(static, residuals, cotangents):
    q, k, v, log_gate, out, den, s_fin, z_fin = residuals
    d_out, d_s, d_z = cotangents
    kernels = _kernels(static.backend)
    heads, kv_heads, group = q.shape[1], k.shape[1], static.group
    ok = jnp.abs(den) > kernels.TINY
    inv = jnp.where(ok, 1.0 / jnp.where(ok, den, 1.0), 0.0)  # [heads, n]
    d_out = d_out.astype(jnp.float32)
    g = d_out * inv.T[:, :, None]  # dL/dnum
    r = -jnp.einsum("nhd,nhd->hn", d_out, out.astype(jnp.float32)) * inv  # dL/dden
    b = _within_chunks(log_gate, static.chunk) if static.gated else None
    s_all, z_all, _, _ = kernels.states(k, v, b, static) if static.causal else (None, None, s_fin, z_fin)
    s_in, z_in = (s_all, z_all) if static.causal else (s_fin, z_fin)
    # The final state's cotangent enters once per kv head: through the first head of its group.
    first = jnp.arange(heads) % group == 0
    ds0 = jnp.where(first[:, None, None], jnp.repeat(d_s, group, axis=0), 0.0)
    dz0 = jnp.where(first[:, None], jnp.repeat(d_z, group, axis=0), 0.0)
    ds, dz = kernels.dstates(q, g, r, ds0, dz0, b, static)
    dq, dk, dv = kernels.grads(q, k, v, g, r, s_in, z_in, ds, dz, b, static)

    def fold(x):  # per-query-head gradients -> their kv head
        return x.reshape(x.shape[0], kv_heads, group, x.shape[2]).sum(axis=2)

    dk, dv = fold(dk), fold(dv)
    d_gate = None
    if static.per_feature:  # as below, feature by feature
        qdq = (q.astype(jnp.float32) * dq).reshape(q.shape[0], kv_heads, group, -1).sum(axis=2)
        d_cum = qdq - k.astype(jnp.float32) * dk
        d_cum = d_cum.at[-1].add(jnp.einsum("hmd,hmd->hm", d_s, s_fin) + d_z * z_fin)
        d_gate = jnp.cumsum(d_cum[::-1], axis=0)[::-1]
    elif static.gated:
        # w_ij = (q_i . k_j) exp(G_i - G_j) with G the cumulative log-gate: dL/dG_t is
        # q_t . dq_t - k_t . dk_t (plus <dS, S> + <dz, z> at the end, for the final state).
        qdq = jnp.einsum("nhm,nhm->nh", q.astype(jnp.float32), dq)
        d_cum = qdq.reshape(-1, kv_heads, group).sum(-1) - jnp.einsum("nhm,nhm->nh", k.astype(jnp.float32), dk)
        d_cum = d_cum.T.at[:, -1].add(jnp.einsum("hmd,hmd->h", d_s, s_fin) + jnp.einsum("hm,hm->h", d_z, z_fin))
        d_gate = jnp.cumsum(d_cum[:, ::-1], axis=1)[:, ::-1]  # dL/dlog_gate_l = sum_{t >= l} dL/dG_t
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_gate


_linear.defvjp(_forward, _backward)


def _pad(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def check_inputs(phi_q, phi_k, v, log_gate=None, *, causal: bool, chunk_size: int) -> None:
    """ValueError naming the offending value for inputs the kernels do not take."""
    if phi_q.ndim != 3 or phi_k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"phi_q, phi_k, v must be [seq, heads, d]; got {phi_q.shape}, {phi_k.shape}, {v.shape}")
    if phi_q.shape[1] % phi_k.shape[1] or phi_k.shape[:2] != v.shape[:2] or phi_q.shape[2] != phi_k.shape[2]:
        raise ValueError(
            f"heads must be a multiple of kv_heads, phi_k and v must agree and the feature sizes "
            f"must match; got {phi_q.shape}, {phi_k.shape}, {v.shape}"
        )
    if causal and phi_q.shape[0] != phi_k.shape[0]:
        raise ValueError(f"causal needs q_len == kv_len; got {phi_q.shape[0]} and {phi_k.shape[0]}")
    dtype = jnp.result_type(phi_q, phi_k, v)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"the kernels take float32, bfloat16 or float16 inputs; got {dtype}")
    if not isinstance(chunk_size, int) or chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16 for the kernel; got {chunk_size!r}")
    if log_gate is not None:
        if not causal:
            raise ValueError("log_gate needs causal=True (the gate decays a running state)")
        if tuple(log_gate.shape) not in (tuple(phi_k.shape[:2]), tuple(phi_k.shape)):
            raise ValueError(
                f"log_gate must have shape {tuple(phi_k.shape[:2])} ([kv_len, kv_heads]) or "
                f"{tuple(phi_k.shape)} ([kv_len, kv_heads, m], per feature); got {tuple(log_gate.shape)}"
            )


def _check_block_v(block_v: int | None, d_v: int, backend: str) -> int:
    """The state walks' columns per program for `block_v` (None or `d_v`: the whole padded
    d_v, unsplit); ValueError naming the value for one the kernels cannot split by."""
    dv_pad = _pow2(d_v)
    if block_v is None or block_v == d_v:
        return dv_pad
    if backend != "gpu":
        raise ValueError(
            f"block_v splits the Triton kernels' state walks (backend='gpu') only; got {block_v=}, {backend=}"
        )
    if not isinstance(block_v, int) or block_v < 16 or block_v & (block_v - 1) or block_v > dv_pad:
        raise ValueError(
            f"block_v must be None, d_v or a power of two >= 16 dividing the padded d_v "
            f"(d_v rounded up to a power of two >= 16); got {block_v=!r}, {d_v=}, padded d_v={dv_pad}"
        )
    return block_v


def chunked_linear_attention(
    phi_q,
    phi_k,
    v,
    *,
    causal: bool = True,
    log_gate=None,
    chunk_size: int = DEFAULT_CHUNK,
    return_state: bool = False,
    backend: str = "gpu",
    interpret: bool = False,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    dtype=None,
):
    """Linear attention with features applied, as Pallas kernels (custom VJP).

    Arguments:
        phi_q: `[q_len, heads, m]`; phi_k: `[kv_len, kv_heads, m]`; v: `[kv_len, kv_heads, d_v]`
            (float32, bfloat16 or float16; products run in the inputs' promoted dtype,
            states and normalisers in float32). Heads a multiple of kv_heads.
        causal: prefix sums (q_len == kv_len); otherwise one reduction over all keys.
        log_gate: optional `[kv_len, kv_heads]` log of the forget gate (<= 0; causal
            only): S_i = exp(log_gate_i) S_{i-1} + phi(k_i) v_i^T; or `[kv_len, kv_heads, m]`,
            one decay per feature (gated linear attention): S_i = diag(exp(log_gate_i))
            S_{i-1} + phi(k_i) v_i^T, z alike. Differentiable. The per-feature form
            computes the in-chunk weights key by key on CUDA cores (exp(b_i - b_j) per
            feature has no overflow-free split into a query and a key factor), so it is
            slower than the scalar form.
        chunk_size: tokens per chunk, a power of two >= 16 (clipped for short inputs).
        return_state: also return the final `(S [kv_heads, m, d_v], z [kv_heads, m])`,
            float32 (the recurrent decoder's state after the last token).
        backend: "gpu" (`linear_gpu`, Triton lowering) or "tpu" (`linear_tpu`, Mosaic
            TPU: m and d_v padded to multiples of 128, a chunk of 128 fills the MXU;
            float16 inputs computed in float32 there; run in TPU interpret mode and
            through Pallas's TPU lowering on CPU, not yet on a TPU).
        interpret: run in Pallas interpret mode (any device; tests): GPU interpret mode
            for "gpu", TPU interpret mode (`pltpu.InterpretParams`) for "tpu".
        block_v: columns of the d_k x d_v state each program of the two state walks
            (chunk states forward, state gradients backward) carries, "gpu" only: their
            grid gains a d_v-block axis, (heads, d_v / block_v) programs instead of one per
            head (each column of S recurs on its own; z, the same in every block, is
            computed by each and stored by the first). None or d_v: unsplit; else a power
            of two >= 16 dividing the padded d_v. The output and input-gradient kernels,
            parallel over (head, chunk) already, stay unsplit. Not yet timed on a GPU.
        num_warps, num_stages: Triton settings, "gpu" only (default warps: 4 up to m,
            d_v <= 64, else 8).
        dtype: of the result (default: the inputs' promoted dtype).

    Returns:
        `[q_len, heads, d_v]` (and the state when asked).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)} (the kernel variants); got backend={backend!r}")
    check_inputs(phi_q, phi_k, v, log_gate, causal=causal, chunk_size=chunk_size)
    block_v = _check_block_v(block_v, v.shape[2], backend)
    in_dtype = jnp.result_type(phi_q, phi_k, v)
    dtype = in_dtype if dtype is None else dtype
    if backend == "tpu" and in_dtype == jnp.float16:
        # TPUs have no float16 MXU path and Mosaic's float16 support is partial (some
        # layouts fail to compile): compute in float32 (the result is cast back).
        in_dtype = jnp.dtype(jnp.float32)
    phi_q, phi_k, v = (jnp.asarray(x, in_dtype) for x in (phi_q, phi_k, v))
    q_len, heads, m = phi_q.shape
    kv_len, kv_heads, d_v = v.shape
    chunk = min(chunk_size, _pow2(max(q_len, kv_len)))
    n = -(-max(q_len, kv_len) // chunk) * chunk
    # Triton wants power-of-two tiles; Mosaic TPU wants the lane dims a multiple of 128.
    pad = _pow2 if backend == "gpu" else _kernels(backend).padded_size
    m_pad, dv_pad = pad(m), pad(d_v)
    qp = _pad(_pad(phi_q, 0, n), 2, m_pad)
    kp = _pad(_pad(phi_k, 0, n), 2, m_pad)
    vp = _pad(_pad(v, 0, n), 2, dv_pad)
    per_feature = log_gate is not None and log_gate.ndim == 3
    if per_feature:
        lg = _pad(_pad(jnp.asarray(log_gate, jnp.float32), 0, n), 2, m_pad)
    else:
        lg = None if log_gate is None else _pad(jnp.asarray(log_gate, jnp.float32).T, 1, n)
    static = _Static(
        n=n,
        chunk=chunk,
        causal=causal,
        gated=log_gate is not None,
        per_feature=per_feature,
        group=heads // kv_heads,
        block_v=block_v if backend == "gpu" else dv_pad,
        mma=jnp.dtype(jnp.bfloat16 if in_dtype == jnp.bfloat16 else jnp.float32),
        num_warps=num_warps or (4 if max(m_pad, dv_pad) <= 64 else 8),
        num_stages=num_stages,
        interpret=interpret,
        backend=backend,
    )
    out, s, z = _linear(qp, kp, vp, lg, static)
    out = out[:q_len, :, :d_v].astype(dtype)
    if return_state:
        return out, (s[:, :m, :d_v], z[:, :m])
    return out
