"""Kernelized attention: softmax(q k^T) replaced by phi(q) phi(k)^T, so that
(phi(Q) phi(K)^T) V = phi(Q) (phi(K)^T V) costs O(N) (Katharopoulos et al., 2020, eq. 4-6).

* `linear_attention`: deterministic feature maps (elu + 1, relu, identity, DPFP
  `dpfp_features`, a callable).
* `performer_attention`: FAVOR+ positive orthogonal random features for the softmax
  kernel, its trigonometric (sin/cos) features, and the generalised ReLU kernel
  (Choromanski et al., 2021).
* `efficient_attention`: Efficient Attention's softmax over query features and over key
  positions, rho_q(Q) (rho_k(K)^T V) (Shen et al., 2021).
* `rfa_attention`: random Fourier features with a learned scale and an optional
  recurrent gate computed from the layer input (Peng et al., 2021).

Linear, Performer and RFA share one core (`kernel_attention`): non-causal by associativity; causal as
the prefix sums S_i = sum_{j<=i} phi(k_j) v_j^T, Z_i = sum_{j<=i} phi(k_j) in one of three
forms that agree to float32 rounding: "quadratic" (the masked N x N reference), "scan"
(the RNN S_i = S_{i-1} + phi(k_i) v_i^T of Katharopoulos et al. 2020, "Transformers are
RNNs", arXiv 2006.16236, one token per step) and "chunked" (the
default: quadratic inside chunks, a carried state between chunks, one step per chunk).
States and denominators accumulate in float32. `impl="pallas"` (or "interpret") runs the
chunked form and the non-causal reduction as Pallas kernels (`jxformers.kernels.linear`:
forward and backward, gates and Performer's stabiliser included; a GPU and a TPU variant).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import group_heads, guarded_divide, rotate_pairs
from jxformers._typing import ArrayLike
from jxformers.decoding import recurrent
from jxformers.kernels import linear as linear_kernels
from jxformers.kernels.impl import IMPLS, choose_kernel
from jxformers.kernels.linear import chunked_linear_attention
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    einsum_f32,
    out_dtype,
    pad_to,
    to_blocks,
    zero_padded,
)
from jxformers.registry import TokenInputs, fraction, register
from jxformers.validate import Limits

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "efficient_attention",
    "kernel_attention",
    "linear_attention",
    "performer_attention",
    "performer_features",
    "performer_projection",
    "dpfp_features",
    "performer_trig_parts",
    "rfa_attention",
    "rfa_features",
]

FORMS = ("chunked", "scan", "quadratic")
# An op taking this argument (and "k_rotation") turns its features after its feature map
# (RoFormer eq. 19): a module with rope passes it the tables instead of turning q and k.
ROTATION_ARGUMENT = "q_rotation"
DEFAULT_CHUNK = 64
IMPL_DOC = {"impl": "one of jxformers.kernels.IMPLS (chunked linear-attention kernel; no cuDNN route)"}

# ----------------------------------------------------------------------------- core


def _noncausal(fq, fk, v, nq=None, nk=None):
    """fq [q, h, g, m], fk [k, h, m], v [k, h, dv] -> [q, h, g, dv]; nq, nk: the
    numerator's features where they differ (RoFormer eq. 19's rotated ones), as in every
    form below."""
    if nq is None or nk is None:
        nq, nk = fq, fk
    state = einsum_f32("khm,khd->hmd", nk, v)
    norm = jnp.sum(fk, axis=0, dtype=jnp.float32)
    num = jnp.einsum("qhgm,hmd->qhgd", nq, state)
    den = jnp.einsum("qhgm,hm->qhg", fq, norm)
    return guarded_divide(num, den)


def _quadratic(fq, fk, v, decay, nq=None, nk=None):
    n = fq.shape[0]
    weights = []
    pairs = [(fq, fk)] if nq is None or nk is None else [(fq, fk), (nq, nk)]  # the denominator's, the numerator's
    for left, right in pairs:
        a = jnp.where(jnp.tril(jnp.ones((n, n), bool)), einsum_f32("qhgm,khm->hgqk", left, right), 0.0)
        weights.append(a if decay is None else a * _decay_matrix(decay)[:, None])
    num = jnp.einsum("hgqk,khd->qhgd", weights[-1], v.astype(jnp.float32))
    return guarded_divide(num, jnp.moveaxis(weights[0].sum(-1), -1, 0))


def _scan(fq, fk, v, decay, nq=None, nk=None):
    h, m, dv = fk.shape[1], fk.shape[2], v.shape[2]
    if nq is None or nk is None:
        nq, nk = fq, fk

    def step(carry, xs):
        state, norm = carry
        q_t, k_t, v_t, g_t, nq_t, nk_t = xs
        if decay is not None:  # gated: S_t = g_t S_{t-1} + phi(k_t) v_t^T
            state, norm = state * g_t[:, None, None], norm * g_t[:, None]
        state = state + einsum_f32("hm,hd->hmd", nk_t, v_t)
        norm = norm + k_t.astype(jnp.float32)
        out = guarded_divide(jnp.einsum("hgm,hmd->hgd", nq_t, state), jnp.einsum("hgm,hm->hg", q_t, norm))
        return (state, norm), out

    init = (jnp.zeros((h, m, dv), jnp.float32), jnp.zeros((h, m), jnp.float32))
    gates = decay if decay is not None else jnp.ones(fk.shape[:2], jnp.float32)
    _, out = jax.lax.scan(step, init, (fq, fk, v, gates, nq, nk))
    return out


def _decay_matrix(gate: ArrayLike) -> Array:
    """For gates g [n, h]: D[h, i, j] = prod_{j < l <= i} g_l for j <= i, else 0."""
    log_g = jnp.log(jnp.clip(gate.astype(jnp.float32), 1e-30, 1.0))
    c = jnp.cumsum(log_g, axis=0)  # [n, h]
    diff = c.T[:, :, None] - c.T[:, None, :]  # [h, i, j] = c_i - c_j
    n = log_g.shape[0]
    return jnp.where(jnp.tril(jnp.ones((n, n), bool)), jnp.exp(jnp.minimum(diff, 0.0)), 0.0)


def _chunked(fq, fk, v, decay, chunk, key_log_scale, nq=None, nk=None):
    """One scan step per chunk (a chunkwise-parallel variant with an associative scan
    over chunk states was measured 1.5x slower on CPU: its chunk matmuls are small).
    `key_log_scale` [n_chunks, h] (Performer's stabiliser) says that chunk c's key
    features of head h were divided by exp(key_log_scale[c, h]); it must not decrease
    along the chunks, and each head's carried state is rescaled when its scale grows."""
    n, h, g, m = fq.shape
    dv = v.shape[2]
    nc = ceil_div(n, chunk)
    qc, kc, vc = (to_blocks(pad_to(x, nc * chunk), chunk) for x in (fq, fk, v))
    rotated = nq is not None and nk is not None
    nqc, nkc = (qc, kc)
    if nq is not None and nk is not None:
        nqc, nkc = (to_blocks(pad_to(x, nc * chunk), chunk) for x in (nq, nk))
    gates = None if decay is None else to_blocks(pad_to(decay, nc * chunk, value=1.0), chunk)
    scales = jnp.zeros((nc, h), jnp.float32) if key_log_scale is None else key_log_scale
    tril = jnp.tril(jnp.ones((chunk, chunk), bool))

    def step(carry, xs):
        state, norm, prev_scale = carry
        q_c, k_c, v_c, g_c, scale, nq_c, nk_c = xs
        rescale = jnp.exp(prev_scale - scale)  # [h], <= 1: earlier chunks were shifted less
        state, norm = state * rescale[:, None, None], norm * rescale[:, None]
        a = jnp.where(tril, einsum_f32("qhgm,khm->hgqk", q_c, k_c), 0.0)
        a_num = jnp.where(tril, einsum_f32("qhgm,khm->hgqk", nq_c, nk_c), 0.0) if rotated else a
        inter_q, inter_nq = q_c.astype(jnp.float32), nq_c.astype(jnp.float32)
        if g_c is not None:
            a, a_num = a * _decay_matrix(g_c)[:, None], a_num * _decay_matrix(g_c)[:, None]
            c = jnp.cumsum(jnp.log(jnp.clip(g_c.astype(jnp.float32), 1e-30, 1.0)), axis=0)  # [chunk, h]
            inter_q = inter_q * jnp.exp(c)[:, :, None, None]  # the state decays up to each query
            inter_nq = inter_nq * jnp.exp(c)[:, :, None, None]
        num = jnp.einsum("hgqk,khd->qhgd", a_num, v_c.astype(jnp.float32))
        num = num + jnp.einsum("qhgm,hmd->qhgd", inter_nq, state)
        den = jnp.moveaxis(a.sum(-1), -1, 0) + jnp.einsum("qhgm,hm->qhg", inter_q, norm)
        k_f, nk_f = k_c.astype(jnp.float32), nk_c.astype(jnp.float32)
        if g_c is not None:  # each key decays from its position to the chunk's end
            tail = jnp.exp(c[-1][None, :] - c)  # [chunk, h]
            state, norm = state * jnp.exp(c[-1])[:, None, None], norm * jnp.exp(c[-1])[:, None]
            k_f, nk_f = k_f * tail[:, :, None], nk_f * tail[:, :, None]
        state = state + jnp.einsum("khm,khd->hmd", nk_f, v_c.astype(jnp.float32))
        norm = norm + k_f.sum(0)
        return (state, norm, scale), guarded_divide(num, den)

    init = (jnp.zeros((h, m, dv), jnp.float32), jnp.zeros((h, m), jnp.float32), scales[0])
    _, out = jax.lax.scan(step, init, (qc, kc, vc, gates, scales, nqc, nkc))
    return out.reshape(nc * chunk, h, g, dv)[:n]


def kernel_attention(
    phi_q: Float[ArrayLike, "q_len heads m"],
    phi_k: Float[ArrayLike, "kv_len kv_heads _m"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    form: str = "chunked",
    chunk_size: int | None = None,
    gate: Float[ArrayLike, "_kv_len _kv_heads"] | None = None,
    key_log_scale: Float[ArrayLike, "_chunks _kv_heads"] | None = None,
    numerator: tuple[Float[ArrayLike, "_q_len _heads _m"], Float[ArrayLike, "_kv_len _kv_heads _m"]] | None = None,
    dtype: jnp.dtype | None = None,
    impl: str = "auto",
) -> Float[Array, "q_len heads d_v"]:
    """Attention with the similarity phi(q_i) . phi(k_j) (features already applied).

    Arguments:
        phi_q: query features `[q_len, heads, m]`; phi_k: key features `[kv_len, kv_heads, m]`.
        v: values `[kv_len, kv_heads, d_v]`.
        causal: prefix sums (self-attention: q_len == kv_len).
        kv_mask: optional `[kv_len]`; padded keys are dropped from states and normalisers.
        form: causal form, "chunked" (default), "scan" or "quadratic".
        chunk_size: chunk of the "chunked" form (default 64).
        gate: optional per-token forget gate in (0, 1] (causal only): the states become
            S_i = g_i S_{i-1} + phi(k_i) v_i^T (RFA's gated recurrence).
        key_log_scale: internal (Performer's per-chunk, per-head stabiliser), "chunked"
            form only.
        numerator: optional `(phi_q', phi_k')`, other features for the numerator only:
            sum_j (phi_q'_i . phi_k'_j) v_j / sum_j (phi_q_i . phi_k_j) (RoFormer eq. 19's
            rotated features; XLA forms only).
        dtype: of the result (default: the inputs' promoted dtype). The XLA forms compute
            features, values and states in float32 whatever the input dtype; the kernel
            takes features and values in `dtype` when it is bfloat16 or float16 (float32
            otherwise) and accumulates states and normalisers in float32.
        impl: one of `jxformers.kernels.IMPLS`, no cuDNN route: the
            chunked kernel (`jxformers.kernels.linear`) computes the "chunked" form and
            the non-causal reduction; other forms, and chunk sizes that are not a power
            of two >= 16, run in XLA ("auto") or raise ("pallas"). "auto" uses the
            kernel on Hopper GPUs (measured there; `kernels.linear.AUTO_ON_GPU`);
            "pallas" on a TPU runs the Mosaic TPU variant (`kernels.linear_tpu`,
            explicit only: it has run in TPU interpret mode, not on a TPU).

    Returns:
        `[q_len, heads, d_v]`; rows whose keys are all masked are zero.
    """
    if phi_q.shape[2] != phi_k.shape[2]:
        raise ValueError(f"phi_k has {phi_k.shape[2]} features but phi_q has {phi_q.shape[2]}; they must match")
    check_qkv(phi_q, phi_k, v, self_attention=causal)
    check_mask_shape("kv_mask", kv_mask, (phi_k.shape[0],))
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}; got {form!r}")
    chunk = DEFAULT_CHUNK if chunk_size is None else chunk_size
    check_positive("chunk_size", chunk)
    if gate is not None and not causal:
        raise ValueError("gate needs causal=True (the gate decays a running state)")
    dtype = out_dtype(phi_q, phi_k, v) if dtype is None else dtype
    choice = choose_kernel(
        impl,
        unsupported="a separate numerator (RoFormer eq. 19)"
        if numerator is not None
        else _kernel_unsupported(impl, causal, form, chunk),
        what="kernelized (linear) attention",
        q_len=phi_q.shape[0],
    )
    if choice is not None:
        return _kernel_path(
            phi_q, phi_k, v, kv_mask, causal, gate, key_log_scale, min(chunk, phi_q.shape[0]), chunk, dtype, choice
        )
    phi_q, phi_k, v = (x.astype(jnp.float32) for x in (phi_q, phi_k, v))
    if numerator is not None and (numerator[0].shape != phi_q.shape or numerator[1].shape != phi_k.shape):
        shapes = tuple(tuple(x.shape) for x in numerator)
        raise ValueError(f"numerator features must have the shapes of phi_q and phi_k; got {shapes}")
    nq, nk = (None, None) if numerator is None else (x.astype(jnp.float32) for x in numerator)
    if kv_mask is not None:
        phi_k = jnp.where(kv_mask[:, None, None], phi_k, 0)
        nk = None if nk is None else jnp.where(kv_mask[:, None, None], nk, 0)
        v = jnp.where(kv_mask[:, None, None], v, 0)
    fq = group_heads(phi_q, phi_k.shape[1])
    nq = None if nq is None else group_heads(nq, phi_k.shape[1])
    if not causal:
        out = _noncausal(fq, phi_k, v, nq, nk)
    elif form == "quadratic":
        out = _quadratic(fq, phi_k, v, gate, nq, nk)
    elif form == "scan":
        out = _scan(fq, phi_k, v, gate, nq, nk)
    else:
        out = _chunked(fq, phi_k, v, gate, min(chunk, phi_q.shape[0]), key_log_scale, nq, nk)
    return out.reshape(phi_q.shape[0], phi_q.shape[1], v.shape[2]).astype(dtype)


def _kernel_unsupported(impl: str, causal: bool, form: str, chunk: int) -> str | None:
    """Why the chunked kernel cannot take this call (None when it can)."""
    if causal and form != "chunked":
        return f"form={form!r} (the kernel computes the 'chunked' form)"
    if chunk < 16 or chunk & (chunk - 1):
        return f"chunk_size={chunk} (the kernel needs a power of two >= 16)"
    if impl == "auto" and not linear_kernels.AUTO_ON_GPU:
        return "disabled for impl='auto' (jxformers.kernels.linear.AUTO_ON_GPU is False)"
    return None


def _kernel_path(phi_q, phi_k, v, kv_mask, causal, gate, key_log_scale, scale_chunk, chunk, dtype, choice):
    """`kernel_attention` through `chunked_linear_attention`: gates become log-gates and
    Performer's per-chunk stabiliser (chunks of `scale_chunk`) a log-gate on the first
    token of each chunk, exp(previous scale - scale) (exact whatever the kernel's chunk)."""
    compute = dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    if kv_mask is not None:
        phi_k = jnp.where(kv_mask[:, None, None], phi_k, 0)
        v = jnp.where(kv_mask[:, None, None], v, 0)
    log_gate = None
    if gate is not None:
        log_gate = jnp.log(jnp.clip(gate.astype(jnp.float32), 1e-30, 1.0))
    if key_log_scale is not None:
        scales = key_log_scale.astype(jnp.float32)
        steps = jnp.concatenate([jnp.zeros_like(scales[:1]), scales[:-1] - scales[1:]])  # [chunks, kv_heads], <= 0
        starts = jnp.zeros((scales.shape[0], scale_chunk, scales.shape[1]), jnp.float32).at[:, 0].set(steps)
        boundary = starts.reshape(-1, scales.shape[1])[: phi_k.shape[0]]
        log_gate = boundary if log_gate is None else log_gate + boundary
    out = chunked_linear_attention(
        phi_q.astype(compute),
        phi_k.astype(compute),
        v.astype(compute),
        causal=causal,
        log_gate=log_gate,
        chunk_size=chunk,
        backend=choice.backend,
        interpret=choice.interpret,
    )
    return out.astype(dtype)


# ----------------------------------------------------------------------------- linear attention

# DPFP's order nu: the authors' code's default (`--dpfp_n_roll 2`); their experiments
# vary it over 1, 2 and 3 (Schlag et al. 2021).
DPFP_NU = 2


def dpfp_features(x: Float[ArrayLike, "*lead d"], nu: int = DPFP_NU) -> Float[Array, "*lead two_d_nu"]:
    """DPFP, the deterministic parameter-free projection of Schlag, Irie & Schmidhuber
    2021 ("Linear Transformers Are Secretly Fast Weight Programmers"): with
    r(x) = [relu(x), relu(-x)] in R^(2d), phi(x) holds the products r_i(x) r_(i+j)(x)
    (indices mod 2d) for j = 1 .. nu: 2 d nu non-negative features, nearly orthogonal for
    different inputs. (The authors' code multiplies by a roll the other way, r_i r_(i-j):
    the same products in another order, so the same dot products.)

    Arguments:
        x: `[..., d]`.
        nu: the order (number of rolls), >= 1.

    Returns:
        `[..., 2 d nu]`, in float32.
    """
    check_positive("nu", nu)
    xf = jnp.asarray(x).astype(jnp.float32)
    r = jnp.concatenate([jax.nn.relu(xf), jax.nn.relu(-xf)], axis=-1)
    return jnp.concatenate([r * jnp.roll(r, -j, axis=-1) for j in range(1, nu + 1)], axis=-1)


FEATURE_MAPS: dict[str, Callable[[Array], Array]] = {
    "elu": lambda x: jax.nn.elu(x) + 1.0,
    "relu": jax.nn.relu,
    "identity": lambda x: x,
    "dpfp": dpfp_features,  # order DPFP_NU; another order: functools.partial(dpfp_features, nu=3)
}


@causal_never_reads_non_finite_future()
def linear_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    feature_map: str | Callable[[Array], Array] = "elu",
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    form: str = "chunked",
    impl: str = "auto",
    q_rotation: Float[ArrayLike, "q_len 2 _half"] | None = None,
    k_rotation: Float[ArrayLike, "_kv_len 2 _half"] | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Linear attention (Katharopoulos et al., 2020): sim(q, k) = phi(q) . phi(k).

    Arguments:
        q, k, v: as `softmax_attention` (grouped-query heads allowed).
        feature_map: "elu" (elu(x) + 1, the paper's), "relu", "identity", "dpfp"
            (`dpfp_features` of order `DPFP_NU`, Schlag et al. 2021) or a callable
            applied elementwise-or-not to `[len, heads, d_k]` arrays.
        causal: prefix-sum (autoregressive) attention; self-attention only.
        kv_mask: optional `[kv_len]`, True for real tokens.
        chunk_size: chunk of the causal "chunked" form (default 64).
        form: causal form: "chunked" (default), "scan" (token-by-token RNN) or
            "quadratic" (masked N x N reference). All agree to float32 rounding.
        impl: one of `jxformers.kernels.IMPLS`, no cuDNN route: the
            chunked Pallas kernel (`jxformers.kernels.linear`) for the "chunked" form
            and the non-causal reduction.
        q_rotation, k_rotation: RoPE with linear attention as RoFormer's eq. 19 (Su et
            al. 2021): the (cos, sin) tables `[len, 2, m/2]` of each position's angles
            (`nn.Rotary.table`; the module passes them when it has rope) turn the
            features after phi, in the numerator only:
            sum_j (R_i phi(q_i)) . (R_j phi(k_j)) v_j / sum_j phi(q_i) . phi(k_j), so the
            output depends on relative positions alone. Both or neither; XLA forms only.

    Returns:
        `[q_len, heads, d_v]`. A row whose denominator is zero (every key padded) is zero.

    Time O(N * d_k * d_v) (non-causal and chunked causal: plus O(N * chunk * d)); memory
    O(d_k * d_v) per head for the state. Slower than softmax below a few thousand
    tokens on most hardware (see docs/benchmarks.md). Decoding is the RNN form.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {sorted(FEATURE_MAPS)} or a callable; got {feature_map!r}")
        phi = FEATURE_MAPS[feature_map]
    elif callable(feature_map):
        phi = feature_map
    else:
        raise ValueError(f"feature_map must be a name or a callable; got {feature_map!r}")
    check_qkv(q, k, v, self_attention=causal)
    fq, fk = phi(jnp.asarray(q)), phi(jnp.asarray(k))
    if (q_rotation is None) != (k_rotation is None):
        raise ValueError("q_rotation and k_rotation go together (RoFormer eq. 19 turns both features)")
    numerator = None
    if q_rotation is not None and k_rotation is not None:
        numerator = (rotate_pairs(fq, q_rotation), rotate_pairs(fk, k_rotation))
    return kernel_attention(
        fq,
        fk,
        v,
        causal=causal,
        kv_mask=kv_mask,
        form=form,
        chunk_size=chunk_size,
        numerator=numerator,
        dtype=out_dtype(q, k, v),
        impl=impl,
    )


def _feature_map(feature_map: str | Callable[[Array], Array]) -> Callable[[Array], Array]:
    return FEATURE_MAPS[feature_map] if isinstance(feature_map, str) else feature_map


def _linear_features(x, arrays, hyper_parameters):
    return _feature_map(hyper_parameters["feature_map"])(x.astype(jnp.float32)), None


_FORMS = {"form": FORMS, "impl": IMPLS}
_FORM_DOCS = {"chunk_size": "chunk of the causal chunked form", "form": "causal form"} | IMPL_DOC

register(
    "linear",
    linear_attention,
    family="kernelized",
    paper="Katharopoulos et al. 2020",
    complexity="O(N d^2)",
    supports_cross=True,
    exact=False,
    decoder=recurrent(_linear_features),
    choices={"feature_map": tuple(FEATURE_MAPS), **_FORMS},
    docs={"feature_map": "phi", **_FORM_DOCS},
    summary="phi(q) . phi(k), phi = elu + 1, relu, identity, DPFP or yours; causal as chunked / scan / quadratic",
    limits={"chunk_size": 1},
)


# ----------------------------------------------------------------------------- Performer


def performer_projection(
    key: PRNGKeyArray, num_features: int, d_k: int, *, orthogonal: bool = True
) -> Float[Array, "num_features d_k"]:
    """Random projection W for FAVOR+ features: rows ~ N(0, I_d). With `orthogonal`,
    rows come in blocks of d_k exactly orthogonal directions (QR of a Gaussian matrix),
    each row rescaled to the norm of an independent Gaussian vector, so every row keeps
    the N(0, I) marginal (the estimator stays unbiased) with lower variance."""
    check_positive("num_features", num_features)
    check_positive("d_k", d_k)
    if not orthogonal:
        return jax.random.normal(key, (num_features, d_k))
    blocks = ceil_div(num_features, d_k)
    k_dir, k_norm = jax.random.split(key)
    gauss = jax.random.normal(k_dir, (blocks, d_k, d_k))
    qmat, r = jnp.linalg.qr(gauss)  # columns orthonormal
    # QR's sign convention biases the directions; fixing diag(R) > 0 makes Q Haar-uniform
    # (without it the estimator is biased, which the unbiasedness test catches).
    qmat = qmat * jnp.sign(jnp.diagonal(r, axis1=1, axis2=2))[:, None, :]
    rows = jnp.swapaxes(qmat, 1, 2).reshape(blocks * d_k, d_k)[:num_features]
    norms = jnp.linalg.norm(jax.random.normal(k_norm, (num_features, d_k)), axis=1)
    return rows * norms[:, None]


# The generalised kernel's additive epsilon (`kernel_epsilon` of the official code).
RELU_EPSILON = 1e-3
# Performer's kernels: FAVOR+ positive softmax features, trigonometric softmax features, ReLU.
PERFORMER_KERNELS = ("softmax", "trig", "relu")


def performer_features(
    x: Float[ArrayLike, "n heads d_k"],
    projection: Float[ArrayLike, "m _d_k"],
    *,
    kernel: str = "softmax",
    shift: Float[ArrayLike, " ..."] | float = 0.0,
) -> Float[Array, "n heads features"]:
    """FAVOR+ features with E[phi(q) . phi(k)] = exp(q . k / sqrt(d)) ("softmax", positive;
    "trig", trigonometric) or the generalised ReLU kernel ("relu").

    "softmax": phi(x) = exp(W x' - |x'|^2 / 2 - shift) / sqrt(m) with x' = x d^(-1/4);
    `shift` (broadcast to `[n, heads, 1]` or a scalar) is the stabiliser: it cancels
    between numerator and denominator when constant over the keys (or per query row).
    "trig": phi(x) = exp(|x'|^2 / 2 - shift) [sin(W x'), cos(W x')] / sqrt(m), 2m features
    (`performer_trig_parts`); E[phi(q) . phi(k)] = exp(q . k / sqrt(d)) too, but the
    features are not positive, so the estimated normaliser can be near zero or negative
    (why the paper prefers the positive ones).
    "relu": phi(x) = relu(W x) + RELU_EPSILON, exactly the official JAX code's
    generalised kernel (no input scaling, the epsilon added to the unscaled features:
    a common factor such as 1/sqrt(m) would cancel, but an epsilon added after it would
    be sqrt(m) times larger relative to the features).
    """
    if kernel == "relu":
        wx = jnp.einsum("nhd,md->nhm", x.astype(jnp.float32), projection.astype(jnp.float32))
        return jax.nn.relu(wx) + RELU_EPSILON
    if kernel == "trig":
        unit, log_magnitude = performer_trig_parts(x, projection)
        return unit * jnp.exp(log_magnitude - shift)[..., None] / math.sqrt(projection.shape[0])
    if kernel != "softmax":
        raise ValueError(f"kernel must be one of {PERFORMER_KERNELS}; got {kernel!r}")
    return jnp.exp(performer_log_features(x, projection) - shift) / math.sqrt(projection.shape[0])


def performer_trig_parts(
    x: Float[ArrayLike, "n heads d_k"], projection: Float[ArrayLike, "m _d_k"]
) -> tuple[Float[Array, "n heads two_m"], Float[Array, "n heads"]]:
    """The trigonometric softmax-kernel features (Choromanski et al. 2021, §2.3, Lemma 1's
    h(x) = exp(|x|^2 / 2) with [sin(W x), cos(W x)]) in two parts, x' = x d^(-1/4):
    `([sin(W x'), cos(W x')] [n, heads, 2m], |x'|^2 / 2 [n, heads])`, in float32. The
    features are exp(second) * first / sqrt(m); kept apart so the magnitude can be
    stabilised (a per-query factor cancels; keys take a shift shared by the keys)."""
    wx, xs = _projected(x, projection)
    return jnp.concatenate([jnp.sin(wx), jnp.cos(wx)], axis=-1), 0.5 * jnp.sum(xs * xs, axis=-1)


def _projected(x, projection):
    """(W x', x') with x' = x d^(-1/4), in float32."""
    xs = x.astype(jnp.float32) * x.shape[-1] ** -0.25
    return jnp.einsum("nhd,md->nhm", xs, projection.astype(jnp.float32)), xs


def performer_log_features(
    x: Float[ArrayLike, "n heads d_k"], projection: Float[ArrayLike, "m _d_k"]
) -> Float[Array, "n heads m"]:
    """log of the unnormalised FAVOR+ softmax features, W x' - |x'|^2 / 2 with
    x' = x d^(-1/4), in float32: `performer_features` is exp(this - shift) / sqrt(m)."""
    wx, xs = _projected(x, projection)
    return wx - 0.5 * jnp.sum(xs * xs, axis=-1, keepdims=True)


def performer_query_features(
    q: Float[ArrayLike, "n heads d_k"], projection: Float[ArrayLike, "m _d_k"]
) -> Float[Array, "n heads m"]:
    """FAVOR+ softmax features of queries, stabilised by each row's own max (a per-query
    constant, so it cancels between numerator and denominator)."""
    log_q = performer_log_features(q, projection)
    log_q = log_q - jax.lax.stop_gradient(jnp.max(log_q, axis=-1, keepdims=True))
    return jnp.exp(log_q) / math.sqrt(projection.shape[0])


@causal_never_reads_non_finite_future()
def performer_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    projection: Float[ArrayLike, "num_features _d_k"],
    *,
    kernel: str = "softmax",
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    form: str = "chunked",
    impl: str = "auto",
) -> Float[Array, "q_len heads d_v"]:
    """Performer FAVOR+ attention (Choromanski et al., 2021).

    An unbiased, positive random-feature estimate of softmax attention: the error falls
    as `num_features` grows (O(1/sqrt(m))). The stabiliser subtracts each query row's max
    and, for keys, the max over real keys (non-causal) or a running max over chunks that
    rescales the carried state (causal), so features never overflow and padded keys
    cannot move it. Padded keys are masked in the normaliser too.

    Arguments:
        q, k, v: as `softmax_attention`.
        projection: `[num_features, d_k]` from `performer_projection(key, ...)`; redraw it
            with a new key to resample the features.
        kernel: "softmax" (FAVOR+ positive features), "trig" (the paper's trigonometric
            softmax features, `performer_trig_parts`: 2 num_features features, not
            positive) or "relu" (generalised ReLU kernel).
        causal: prefix-sum form (chunked by default, as `linear_attention`).
        kv_mask: optional `[kv_len]`, True for real tokens.
        chunk_size, form, impl: as `linear_attention`.

    Returns:
        `[q_len, heads, d_v]`.

    Time O(N * m * d), memory O(m * d) per head for the state.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v, self_attention=causal)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    if projection.shape[1] != q.shape[2]:
        raise ValueError(f"projection must have shape [num_features, d_k={q.shape[2]}]; got {tuple(projection.shape)}")
    dtype = out_dtype(q, k, v)
    if kernel == "relu":
        fq, fk = performer_features(q, projection, kernel="relu"), performer_features(k, projection, kernel="relu")
        return kernel_attention(
            fq, fk, v, causal=causal, kv_mask=kv_mask, form=form, chunk_size=chunk_size, dtype=dtype, impl=impl
        )
    if kernel not in PERFORMER_KERNELS:
        raise ValueError(f"kernel must be one of {PERFORMER_KERNELS}; got {kernel!r}")
    m = projection.shape[0]
    real = jnp.ones((k.shape[0],), bool) if kv_mask is None else kv_mask
    if kernel == "softmax":
        fq, lk = performer_query_features(q, projection), performer_log_features(k, projection)
        key_log = jnp.max(lk, axis=2)  # [kv_len, kv_heads]: each key's largest log-feature

        def key_features(shift):  # shift [kv_len or 1, kv_heads]
            return jnp.exp(lk - shift[:, :, None]) / math.sqrt(m)

    else:  # trig: h(q) is a factor of the query's row (it cancels), h(k) is shifted as above
        fq = performer_trig_parts(q, projection)[0] / math.sqrt(m)
        unit_k, key_log = performer_trig_parts(k, projection)

        def key_features(shift):
            return unit_k * jnp.exp(key_log - shift)[:, :, None] / math.sqrt(m)

    # The key stabiliser is per head: a maximum shared by the heads would let one head
    # with large norms shift another's features into underflow, coupling the heads.
    key_max = jax.lax.stop_gradient(jnp.where(real[:, None], key_log, -jnp.inf))  # [kv_len, kv_heads]
    if not causal or form != "chunked":
        shift = jnp.max(key_max, axis=0)
        shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
        fk = key_features(shift[None, :])
        return kernel_attention(
            fq, fk, v, causal=causal, kv_mask=kv_mask, form=form, chunk_size=chunk_size, dtype=dtype, impl=impl
        )
    chunk = min(chunk_size, q.shape[0])
    check_positive("chunk_size", chunk)
    nc = ceil_div(k.shape[0], chunk)
    chunk_max = jnp.max(to_blocks(pad_to(key_max, nc * chunk, value=-jnp.inf), chunk), axis=1)  # [nc, kv_heads]
    running = jax.lax.cummax(chunk_max, axis=0)  # never decreases: the state only shrinks when rescaled
    running = jnp.where(jnp.isfinite(running), running, 0.0)
    per_token = jnp.repeat(running, chunk, axis=0)[: k.shape[0]]
    fk = key_features(per_token)
    return kernel_attention(
        fq,
        fk,
        v,
        causal=True,
        kv_mask=kv_mask,
        form="chunked",
        chunk_size=chunk_size,
        key_log_scale=running,
        dtype=dtype,
        impl=impl,
    )


def performer_arrays(
    key: PRNGKeyArray, *, d_k: int, num_features: int = 256, orthogonal: bool = True
) -> dict[str, Float[Array, "num_features d_k"]]:
    """Performer's drawn projection (redrawn with the module)."""
    return {"projection": performer_projection(key, num_features, d_k, orthogonal=orthogonal)}


def _performer_key_features(k, arrays, hyper_parameters):
    """Plain features (ReLU kernel), log-features and each head's max (softmax kernel),
    or the unit trigonometric features (trig kernel; their magnitude is
    `_performer_key_magnitude`), which the recurrent decoder shifts by its running
    per-head stabiliser as the chunked form does."""
    kernel = hyper_parameters["kernel"]
    if kernel == "relu":
        return performer_features(k[None], arrays["projection"], kernel="relu")[0], None
    if kernel == "trig":
        return performer_trig_parts(k[None], arrays["projection"])[0][0] / math.sqrt(
            arrays["projection"].shape[0]
        ), None
    log_k = performer_log_features(k[None], arrays["projection"])[0]
    return log_k, jnp.max(log_k, axis=-1)


def _performer_key_magnitude(k, arrays, hyper_parameters):
    """log h(k) = |k'|^2 / 2 per head for the trig kernel (None for the others)."""
    if hyper_parameters["kernel"] != "trig":
        return None
    return performer_trig_parts(k[None], arrays["projection"])[1][0]


def _performer_query_features(q, arrays, hyper_parameters):
    kernel = hyper_parameters["kernel"]
    if kernel == "relu":
        return performer_features(q[None], arrays["projection"], kernel="relu")[0]
    if kernel == "trig":  # h(q) is a factor of the query's row: it cancels
        return performer_trig_parts(q[None], arrays["projection"])[0][0] / math.sqrt(arrays["projection"].shape[0])
    return performer_query_features(q[None], arrays["projection"])[0]


register(
    "performer",
    performer_attention,
    family="kernelized",
    paper="Choromanski et al. 2021",
    complexity="O(N m d)",
    supports_cross=True,
    exact=False,
    init_arrays=performer_arrays,
    drawn=("projection",),
    decoder=recurrent(
        _performer_key_features, query_features=_performer_query_features, magnitude=_performer_key_magnitude
    ),
    choices={"kernel": PERFORMER_KERNELS, **_FORMS},
    docs={
        "num_features": "random features m",
        "orthogonal": "orthogonal random features",
        "kernel": "softmax (FAVOR+ positive features), trig (sin/cos features) or relu",
        **_FORM_DOCS,
    },
    summary="FAVOR+ positive (or sin/cos) orthogonal random features, or a ReLU kernel, stabilised",
    limits={"chunk_size": 1, "num_features": 1},
    dense_width=("its random features (num_features)", lambda hp, n: hp["num_features"]),
    scaled=(
        "num_features = min(default, N / 2): fewer random features than keys, or the feature map costs more than "
        "softmax's N x N (Choromanski et al. 2021's m = 256 for N >= 512)",
        lambda d, n: {"num_features": fraction(n, 2, cap=d["num_features"])},
    ),
)


# ----------------------------------------------------------------------------- Efficient Attention


def efficient_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Efficient Attention (Shen, Zhang, Zhao, Yi & Li 2021, eq. 2 with the softmax
    normalisation): E = rho_q(Q) (rho_k(K)^T V), rho_q a softmax over each query's d_k
    features, rho_k a softmax over the positions of each key feature (per head). Each of
    the d_k "global context vectors" rho_k(K)[:, f]^T V is a softmax-weighted mean of
    the values; a query mixes them by its own feature softmax. No 1/sqrt(d_k) (the
    paper's and its code's).

    Arguments:
        q, k, v: as `softmax_attention` (grouped-query heads allowed; cross lengths too).
        causal: not supported: rho_k normalises each feature over every position, so
            every output reads every key (the paper has no causal form). True raises.
        kv_mask: optional `[kv_len]`; rho_k's softmax runs over the real positions only.

    Returns:
        `[q_len, heads, d_v]`; zeros when every key is padded.

    Time O(N * d_k * d_v), memory O(d_k * d_v) per head; in float32.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    if causal:
        raise ValueError(
            "efficient_attention cannot be causal: rho_k's softmax over positions normalises each key "
            "feature by every key, the future included; use linear_attention or performer_attention"
        )
    check_qkv(q, k, v)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    real = jnp.ones((k.shape[0],), bool) if kv_mask is None else jnp.asarray(kv_mask)
    rho_q = jax.nn.softmax(q.astype(jnp.float32), axis=-1)
    logits_k = jnp.where(real[:, None, None], k.astype(jnp.float32), -jnp.inf)
    top = jax.lax.stop_gradient(jnp.max(logits_k, axis=0, keepdims=True))
    weights = jnp.where(real[:, None, None], jnp.exp(logits_k - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    # d_k global context vectors per head: rho_k(K)^T V, normalised after the sum
    context = guarded_divide(einsum_f32("khf,khd->hfd", weights, v), jnp.sum(weights, axis=0))
    out = jnp.einsum("qhgf,hfd->qhgd", group_heads(rho_q, k.shape[1]), context)
    return out.reshape(q.shape[0], q.shape[1], v.shape[2]).astype(out_dtype(q, k, v))


register(
    "efficient",
    efficient_attention,
    family="kernelized",
    paper="Shen et al. 2021",
    complexity="O(N d^2)",
    supports_causal=False,
    supports_cross=True,
    exact=False,
    summary="softmax over each query's features times softmax-over-positions keys^T V",
)


# ----------------------------------------------------------------------------- RFA


def rfa_features(
    x: Float[ArrayLike, "n heads d_k"],
    projection: Float[ArrayLike, "m _d_k"],
    log_sigma: Float[ArrayLike, "sigma_heads _d_k"] | None = None,
) -> Float[Array, "n heads two_m"]:
    """Random Fourier features of the l2-normalised input:
    phi(x) = [sin(W x), cos(W x)] / sqrt(m) with W = epsilon * diag(sigma), epsilon the
    standard-normal `projection` and sigma = exp(log_sigma) (default 1): RFA's
    reparametrised random feature variance, w_i ~ N(0, diag(sigma^2)), so that sigma is
    learned. phi(x) . phi(y) estimates the Gaussian kernel exp(-|sigma (x - y)|^2 / 2),
    for unit vectors and a scalar sigma exp((x . y - 1) sigma^2).

    `log_sigma` is per key head `[kv_heads, d_k]`; query heads of one group share it.
    """
    xs = x.astype(jnp.float32)
    xs = xs / jnp.maximum(jnp.linalg.norm(xs, axis=-1, keepdims=True), 1e-6)
    if log_sigma is not None:
        xs = xs * jnp.repeat(jnp.exp(log_sigma.astype(jnp.float32)), x.shape[1] // log_sigma.shape[0], axis=0)[None]
    wx = jnp.einsum("nhd,md->nhm", xs, projection.astype(jnp.float32))
    return jnp.concatenate([jnp.sin(wx), jnp.cos(wx)], axis=-1) / math.sqrt(projection.shape[0])


@causal_never_reads_non_finite_future()
def rfa_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    projection: Float[ArrayLike, "num_features _d_k"],
    *,
    log_sigma: Float[ArrayLike, "_kv_heads _d_k"] | None = None,
    gate: Float[ArrayLike, "_kv_len _kv_heads"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    form: str = "chunked",
    impl: str = "auto",
) -> Float[Array, "q_len heads d_v"]:
    """Random Feature Attention (Peng et al., 2021).

    sim(q, k) = phi(q) . phi(k) with random Fourier features of unit-normalised q and k
    (`rfa_features`): `projection` is standard normal (`performer_projection`), the
    learned `log_sigma [kv_heads, d_k]` scales it (default: sigma = 1). With `gate`
    (causal only; values in (0, 1], the paper's g_t = sigmoid(w_g . x_t + b_g) per token
    and head, made from the layer input by the module), the states follow RFA's gated
    recurrence S_t = g_t S_{t-1} + (1 - g_t) phi(k_t) v_t^T (and z_t alike): pass the
    gate, and the (1 - g_t) factor is applied to keys and values here.

    Note: Fourier features are not positive, so the estimated normaliser can approach
    zero for some rows (a known weakness of RFA); such rows are returned as zero rather
    than NaN.

    `chunk_size`, `form` and `impl` are as `linear_attention`'s (the kernel takes the gate).

    Returns:
        `[q_len, heads, d_v]`.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v, self_attention=causal)
    if projection.shape[1] != q.shape[2]:
        raise ValueError(f"projection must have shape [num_features, d_k={q.shape[2]}]; got {tuple(projection.shape)}")
    if log_sigma is not None and log_sigma.shape != (k.shape[1], k.shape[2]):
        raise ValueError(
            f"log_sigma must have shape [kv_heads={k.shape[1]}, d_k={k.shape[2]}]; got {tuple(log_sigma.shape)}"
        )
    fq, fk = rfa_features(q, projection, log_sigma), rfa_features(k, projection, log_sigma)
    if gate is not None:
        if gate.shape != k.shape[:2]:
            raise ValueError(f"gate must have shape {k.shape[:2]} ([kv_len, kv_heads]); got {gate.shape}")
        fk = fk * (1.0 - gate.astype(jnp.float32))[:, :, None]
    return kernel_attention(
        fq,
        fk,
        v,
        causal=causal,
        kv_mask=kv_mask,
        form=form,
        chunk_size=chunk_size,
        gate=gate,
        dtype=out_dtype(q, k, v),
        impl=impl,
    )


def rfa_arrays(
    key: PRNGKeyArray, *, kv_heads: int, d_k: int, num_features: int = 128, sigma: float = 1.0
) -> dict[str, Array]:
    """RFA's drawn standard-normal projection (redrawn with the module) and its learned
    random-feature scale, `log_sigma [kv_heads, d_k]` starting at log(sigma) (positive
    by parametrisation)."""
    if not sigma > 0:
        raise ValueError(f"sigma (the initial random feature scale) must be > 0; got {sigma!r}")
    return {
        "projection": performer_projection(key, num_features, d_k),
        "log_sigma": jnp.full((kv_heads, d_k), math.log(sigma), jnp.float32),
    }


def rfa_gate_params(
    key: PRNGKeyArray, *, d_model: int, kv_heads: int, causal: bool, gated: bool = False
) -> dict[str, Array]:
    """The gate's projection (w_g [d_model, kv_heads], b_g [kv_heads]) when `gated`."""
    if not gated:
        return {}
    if not causal:
        raise ValueError(
            "rfa: gated=True needs causal self-attention (the gate decays a running state); "
            "this attention is not causal (an encoder or cross-attention): use gated=False there"
        )
    return {
        "gate_w": jax.random.normal(key, (d_model, kv_heads)) / math.sqrt(d_model),
        "gate_b": jnp.zeros((kv_heads,)),
    }


def rfa_gate(
    params: dict[str, Array],
    queries: Float[Array, "q_len d_model"],
    keys: Float[Array, "kv_len d_model"] | None,
    hyper_parameters: dict,
) -> dict[str, Float[Array, "kv_len kv_heads"]]:
    """g_t = sigmoid(w_g . x_t + b_g) for each key token x_t and head (gated RFA)."""
    if not params:
        return {}
    if keys is None:
        raise ValueError("gated RFA decays a causal self-attention state; it has no gate in cross-attention")
    x = keys.astype(jnp.float32)
    return {"gate": jax.nn.sigmoid(x @ params["gate_w"].astype(jnp.float32) + params["gate_b"][None])}


def _rfa_key_features(k, arrays, hyper_parameters):
    phi = rfa_features(k[None], arrays["projection"], arrays.get("log_sigma"))[0]
    if "gate" in arrays:  # the gated update adds (1 - g_t) phi(k_t) v_t^T
        phi = phi * (1.0 - arrays["gate"][0])[:, None]
    return phi, None


def _rfa_query_features(q, arrays, hyper_parameters):
    return rfa_features(q[None], arrays["projection"], arrays.get("log_sigma"))[0]


def _rfa_decay(k, arrays, hyper_parameters):
    return arrays["gate"][0] if "gate" in arrays else None


register(
    "rfa",
    rfa_attention,
    family="kernelized",
    paper="Peng et al. 2021",
    complexity="O(N m d)",
    supports_cross=True,
    exact=False,
    init_arrays=rfa_arrays,
    drawn=("projection",),
    token_inputs=TokenInputs(rfa_gate_params, rfa_gate),
    decoder=recurrent(_rfa_key_features, query_features=_rfa_query_features, gate=_rfa_decay),
    choices=_FORMS,
    docs={
        "num_features": "random Fourier features m",
        "sigma": "initial random feature scale (learned)",
        "gated": "gate the causal state (sigmoid of the layer input)",
        **_FORM_DOCS,
    },
    summary="random Fourier features with learned scale, optional input-dependent gate",
    limits={"chunk_size": 1, "num_features": 1, "sigma": Limits(above=0)},
    dense_width=("its random features (num_features)", lambda hp, n: hp["num_features"]),
    scaled=(
        "num_features = min(default, N / 2): fewer random features than keys (Peng et al. 2021's 128 at N >= 256)",
        lambda d, n: {"num_features": fraction(n, 2, cap=d["num_features"])},
    ),
)
