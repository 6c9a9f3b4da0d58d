"""The delta rule: attention as a fast weight matrix that each token corrects rather than
adds to (causal by nature: the fast weights are written token by token).

* `delta_attention`: the fast weight programmer of Schlag, Irie & Schmidhuber 2021
  ("Linear Transformers Are Secretly Fast Weight Programmers"):
  W_i = W_{i-1} + beta_i (v_i - W_{i-1} phi(k_i)) phi(k_i)^T, y_i = W_i phi(q_i), with
  phi (elu + 1, DPFP or relu) normalised to sum one and beta_i = sigmoid(w_beta x_i) per
  head, a learned projection of the layer input.
* `gated_delta_attention`: the gated delta rule of Yang, Kautz & Hatamizadeh 2024
  ("Gated Delta Networks: Improving Mamba2 with Delta Rule", arXiv 2412.06464):
  S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t, with
  L2-normalised q and k, alpha_t = exp(-A softplus(w_alpha x_t + b)) (Mamba2's decay)
  and beta_t = sigmoid(w_beta x_t).
* `delta_rule`: the recurrence both share (alpha = 1 for the plain rule), in two forms
  that agree to float32 rounding: "recurrent" (one token per step) and "chunked" (the
  default): the WY representation of Yang et al. 2024 ("Parallelizing Linear
  Transformers with the Delta Rule over Sequence Length", arXiv 2406.06484), as
  flash-linear-attention's `chunk_gated_delta_rule`: inside a chunk the corrected values
  u = (I + A)^-1 (beta v - beta gamma K S_0) come from one unit-lower-triangular solve
  (the UT transform), between chunks the state is carried. States accumulate in float32
  whatever the input dtype.

Both register with `causal_only=True` (a non-causal form would read the final fast
weights W_N with every query; neither paper defines one, so it is refused), a recurrent
decoder carrying the fast weights, and token inputs (beta, alpha) computed from the layer
input. Padded positions (`kv_mask` False) get beta = 0 and alpha = 1: they never change
the state.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import group_heads, guarded_divide, zero_padded
from jxformers._typing import ArrayLike
from jxformers.decoding import RecurrentState
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    out_dtype,
    pad_to,
    to_blocks,
)
from jxformers.ops.kernelized import DPFP_NU, FEATURE_MAPS, dpfp_features
from jxformers.registry import Decoder, TokenInputs, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = ["delta_attention", "delta_rule", "gated_delta_attention"]

FORMS = ("chunked", "recurrent")
DEFAULT_CHUNK = 64
# Feature maps of the delta rule: non-negative, so that the sum normalisation holds.
DELTA_FEATURE_MAPS = ("elu", "dpfp", "relu")
L2_EPS = 1e-6  # flash-linear-attention's l2norm: x / sqrt(|x|^2 + eps)

# ----------------------------------------------------------------------------- the recurrence


# The forms are compiled whole (an eager call would compile each of their primitives alone).
@jax.jit
def _recurrent(q, k, v, beta, log_alpha):
    """q [n, h, g, m], k [n, h, m], v [n, h, dv], beta and log_alpha [n, h], float32 ->
    (outputs [n, h, g, dv], final state [h, m, dv]); the state S is stored as S^T
    (keys to values: o = S^T q)."""
    h, m, dv = k.shape[1], k.shape[2], v.shape[2]

    def step(state, xs):
        q_t, k_t, v_t, b_t, a_t = xs
        state = state * jnp.exp(a_t)[:, None, None]
        error = v_t - jnp.einsum("hm,hmd->hd", k_t, state)  # v_t - S k_t (S already decayed)
        state = state + jnp.einsum("hm,hd->hmd", k_t, b_t[:, None] * error)
        return state, jnp.einsum("hgm,hmd->hgd", q_t, state)

    final, out = jax.lax.scan(step, jnp.zeros((h, m, dv), jnp.float32), (q, k, v, beta, log_alpha))
    return out, final


def _unit_lower_inverse(a: Float[Array, "*batch C C"]) -> Float[Array, "*batch C C"]:
    """(I + a)^-1 for a strictly lower-triangular `a`, by forward substitution one row at a
    time (row i = e_i - sum_{j<i} a_ij row j), as flash-linear-attention's chunk kernels
    invert it. Not `lax.linalg.triangular_solve`: under jax 0.10.2 on CPU its gradient's
    program sometimes never finishes (a batched solve with its gradient, run 300 times,
    hung in 3 of 3 runs; the forward alone never did)."""
    size = a.shape[-1]
    eye = jnp.eye(size, dtype=a.dtype)

    def row(i, t):  # rows >= i of t are still the identity's, and a_ij = 0 for j >= i
        e_i = jnp.broadcast_to(eye[i], (*a.shape[:-2], size))
        return t.at[..., i, :].set(e_i - jnp.einsum("...j,...jk->...k", a[..., i, :], t))

    return jax.lax.fori_loop(1, size, row, jnp.broadcast_to(eye, a.shape))


@functools.partial(jax.jit, static_argnums=5)
def _chunked(q, k, v, beta, log_alpha, chunk):
    """`_recurrent` chunk by chunk (WY representation). Inside chunk c, with S_0 the
    state before it, gamma_t = prod_{s<=t} alpha_s and A[t, s] = beta_t gamma_t/gamma_s
    k_t . k_s (s < t), the states are S_t = gamma_t S_0 + sum_{s<=t} gamma_t/gamma_s
    k_s u_s^T where (I + A) U = beta V - beta gamma K S_0."""
    n, h, g, m = q.shape
    dv = v.shape[2]
    nc = ceil_div(n, chunk)
    # Tail padding: beta 0 and log-alpha 0, so it never changes the state.
    qc, kc, vc, bc, ac = (to_blocks(pad_to(x, nc * chunk), chunk) for x in (q, k, v, beta, log_alpha))
    c = jnp.cumsum(ac, axis=1)  # [nc, C, h] log gamma_t, <= 0
    lower = jnp.tril(jnp.ones((1, 1, chunk, chunk), bool))
    strict = jnp.tril(jnp.ones((1, 1, chunk, chunk), bool), -1)
    diff = jnp.moveaxis(c, 2, 1)[:, :, :, None] - jnp.moveaxis(c, 2, 1)[:, :, None, :]  # [nc, h, t, s]
    decay = jnp.where(lower, jnp.exp(jnp.minimum(diff, 0.0)), 0.0)  # gamma_t / gamma_s for s <= t
    kk = jnp.einsum("cthm,cshm->chts", kc, kc)
    a = jnp.where(strict, jnp.moveaxis(bc, 2, 1)[..., None] * decay * kk, 0.0)
    rhs = jnp.concatenate(
        [
            jnp.moveaxis(bc[..., None] * vc, 2, 1),  # beta v: [nc, h, C, dv]
            jnp.moveaxis((bc * jnp.exp(c))[..., None] * kc, 2, 1),  # beta gamma k: [nc, h, C, m]
        ],
        axis=-1,
    )
    solved = jnp.einsum("chts,chsd->chtd", _unit_lower_inverse(a), rhs)
    u0, w = solved[..., :dv], solved[..., dv:]  # u = u0 - w S_0
    scores = jnp.einsum("cthgm,cshm->chgts", qc, kc) * decay[:, :, None]  # decay is 0 above the diagonal
    q_decayed = qc * jnp.exp(c)[..., None, None]  # the state decays up to each query
    k_tail = kc * jnp.exp(c[:, -1:] - c)[..., None]  # each key decays to the chunk's end
    last = jnp.exp(c[:, -1])  # [nc, h]

    def step(state, xs):
        u0_c, w_c, s_c, qd_c, kt_c, last_c = xs
        u = u0_c - jnp.einsum("htm,hmd->htd", w_c, state)
        out = jnp.einsum("thgm,hmd->thgd", qd_c, state) + jnp.einsum("hgts,hsd->thgd", s_c, u)
        state = state * last_c[:, None, None] + jnp.einsum("thm,htd->hmd", kt_c, u)
        return state, out

    final, out = jax.lax.scan(step, jnp.zeros((h, m, dv), jnp.float32), (u0, w, scores, q_decayed, k_tail, last))
    return out.reshape(nc * chunk, h, g, dv)[:n], final


def delta_rule(
    q: Float[ArrayLike, "n heads m"],
    k: Float[ArrayLike, "n kv_heads m"],
    v: Float[ArrayLike, "n kv_heads d_v"],
    beta: Float[ArrayLike, "_n _kv_heads"],
    log_alpha: Float[ArrayLike, "_n _kv_heads"] | None = None,
    *,
    form: str = "chunked",
    chunk_size: int = DEFAULT_CHUNK,
) -> Float[Array, "n heads d_v"]:
    """The (gated) delta rule over features already made: per key head,
    S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T and o_t = S_t q_t
    (the query heads of a group read their key head's state).

    Arguments:
        q: query features `[n, heads, m]`; k: key features `[n, kv_heads, m]`.
        v: values `[n, kv_heads, d_v]`.
        beta: writing strengths `[n, kv_heads]` (0 leaves the state unchanged).
        log_alpha: log decays `[n, kv_heads]`, <= 0 (None: alpha = 1, the plain rule).
        form: "chunked" (WY representation, default) or "recurrent" (one token a step).
        chunk_size: chunk of the "chunked" form.

    Returns:
        `[n, heads, d_v]` in float32; states accumulate in float32 whatever the inputs.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}; got {form!r}")
    check_positive("chunk_size", chunk_size)
    n, heads, m = q.shape
    kv_heads = k.shape[1]
    _check_gate_shape("beta", beta, n, kv_heads)
    _check_gate_shape("log_alpha", log_alpha, n, kv_heads)
    qf, kf, vf, bf = (jnp.asarray(x).astype(jnp.float32) for x in (q, k, v, beta))
    af = jnp.zeros_like(bf) if log_alpha is None else jnp.asarray(log_alpha).astype(jnp.float32)
    fq = group_heads(qf, kv_heads)
    if form == "recurrent":
        out, _ = _recurrent(fq, kf, vf, bf, af)
    else:
        out, _ = _chunked(fq, kf, vf, bf, af, min(chunk_size, n))
    return out.reshape(n, heads, v.shape[2])


def _masked_gates(beta, log_alpha, kv_mask, n, kv_heads):
    """beta (default 1) and log-alpha (default 0) with padding set to beta 0, alpha 1."""
    b = jnp.ones((n, kv_heads), jnp.float32) if beta is None else jnp.asarray(beta).astype(jnp.float32)
    a = None if log_alpha is None else jnp.asarray(log_alpha).astype(jnp.float32)
    if kv_mask is not None:
        keep = jnp.asarray(kv_mask)[:, None]
        b = jnp.where(keep, b, 0.0)
        a = None if a is None else jnp.where(keep, a, 0.0)
    return b, a


def _check_gate_shape(name, x, n, kv_heads):
    if x is not None and tuple(jnp.shape(x)) != (n, kv_heads):
        raise ValueError(f"{name} must have shape [kv_len={n}, kv_heads={kv_heads}]; got {tuple(jnp.shape(x))}")


def _refuse_non_causal(name: str, causal: bool) -> None:
    if not causal:
        raise ValueError(
            f"{name} is causal only (causal=False was given): its fast weights are written token by "
            "token; a non-causal form would read the final fast weights W_N with every query, which "
            "its paper does not define"
        )


# ----------------------------------------------------------------------------- delta rule (Schlag et al.)


def sum_normalised(x: Array) -> Array:
    """phi / sum(phi) over the features (Schlag et al.'s normalisation); an all-zero row
    (DPFP or relu of a zero vector) stays zero."""
    return guarded_divide(x, jnp.sum(x, axis=-1))


def delta_features(x: ArrayLike, feature_map: str, dpfp_nu: int) -> Array:
    """The delta rule's phi(x), sum-normalised, in float32 (`[..., d]` -> `[..., m]`)."""
    if feature_map not in DELTA_FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {DELTA_FEATURE_MAPS}; got {feature_map!r}")
    xf = jnp.asarray(x).astype(jnp.float32)
    phi = dpfp_features(xf, dpfp_nu) if feature_map == "dpfp" else FEATURE_MAPS[feature_map](xf)
    return sum_normalised(phi)


@causal_never_reads_non_finite_future()
def delta_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    beta: Float[ArrayLike, "_kv_len _kv_heads"] | None = None,
    causal: bool = True,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    feature_map: str = "elu",
    dpfp_nu: int = DPFP_NU,
    chunk_size: int = DEFAULT_CHUNK,
    form: str = "chunked",
) -> Float[Array, "q_len heads d_v"]:
    """The delta-rule fast weight programmer (Schlag, Irie & Schmidhuber 2021).

    W_i = W_{i-1} + beta_i (v_i - W_{i-1} phi(k_i)) phi(k_i)^T and y_i = W_i phi(q_i), with
    phi(x) = f(x) / sum_j f(x)_j: the value already stored under phi(k_i) is replaced by a
    beta_i-weighted mix with v_i (no attention normaliser: the authors' best setting).

    Arguments:
        q, k, v: as `softmax_attention`; self-attention (q_len == kv_len), grouped-query
            heads allowed (the query heads of a group read their key head's fast weights).
        beta: `[n, kv_heads]` in [0, 1], the paper's sigmoid(w_beta x_i), made by the
            module from the layer input; None: 1 (each key's slot fully overwritten).
        causal: must be True (causal only).
        kv_mask: optional `[n]`; padded positions get beta = 0, so they never write.
        feature_map: f: "elu" (elu + 1, the paper's main setting), "dpfp"
            (`dpfp_features` of order `dpfp_nu`) or "relu".
        dpfp_nu: DPFP's order nu (feature_map "dpfp" only: another value with another
            map is refused).
        chunk_size, form: as `delta_rule`.

    Returns:
        `[n, heads, d_v]`.

    Time O(N (m d_v + chunk (m + d_v))), memory O(m d_v) per head for the state (plus
    the chunk's O(chunk^2)).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    _check_gate_shape("beta", beta, k.shape[0], k.shape[1])
    check_positive("dpfp_nu", dpfp_nu)
    if dpfp_nu != DPFP_NU and feature_map != "dpfp":
        raise ValueError(f"dpfp_nu={dpfp_nu} is DPFP's order: it needs feature_map='dpfp'; got {feature_map!r}")
    _refuse_non_causal("delta attention", causal)
    b, _ = _masked_gates(beta, None, kv_mask, k.shape[0], k.shape[1])
    fq, fk = delta_features(q, feature_map, dpfp_nu), delta_features(k, feature_map, dpfp_nu)
    out = delta_rule(fq, fk, v, b, form=form, chunk_size=chunk_size)
    return out.astype(out_dtype(q, k, v))


def beta_params(key: PRNGKeyArray, *, d_model: int, kv_heads: int, causal: bool) -> dict[str, Array]:
    """w_beta `[d_model, kv_heads]` (no bias, as the authors' code): beta = sigmoid(x w_beta)."""
    if not causal:
        raise ValueError(
            "the delta rule needs causal self-attention (its fast weights are written token by token); "
            "this attention is not causal (an encoder or cross-attention)"
        )
    return {"beta_w": jax.random.normal(key, (d_model, kv_heads)) / math.sqrt(d_model)}


def _token_rows(keys: Array | None, what: str) -> Array:
    if keys is None:
        raise ValueError(f"{what} writes a causal self-attention state; it has no cross-attention form")
    return keys.astype(jnp.float32)


def delta_beta(
    params: dict[str, Array],
    queries: Float[Array, "q_len d_model"],
    keys: Float[Array, "kv_len d_model"] | None,
    hyper_parameters: dict,
) -> dict[str, Float[Array, "kv_len kv_heads"]]:
    """beta_i = sigmoid(w_beta x_i) for each token x_i and key head."""
    x = _token_rows(keys, "the delta rule")
    return {"beta": jax.nn.sigmoid(x @ params["beta_w"].astype(jnp.float32))}


# ----------------------------------------------------------------------------- the decoder


def _fast_weight_decoder(features, gated: bool = False) -> Decoder:
    """One token at a time on the fast weights, in float32: `features(x [heads, d_k], hp)
    -> [heads, m]` is the op's own feature map; `gated`: the step's `log_alpha` (from the
    module's token inputs, in `arrays`) decays the state first.
    The state is a `RecurrentState` whose `s` holds the fast weights (keys to values,
    `[kv_heads, m, d_v]`); `z` and `log_scale` stay unused."""

    def init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> RecurrentState:
        m = jax.eval_shape(lambda: features(jnp.zeros((kv_heads, d_k)), hyper_parameters)).shape[-1]
        return RecurrentState(
            jnp.zeros((kv_heads, m, d_v), jnp.float32),
            jnp.zeros((kv_heads, m), jnp.float32),
            jnp.zeros((kv_heads,), jnp.float32),
            jnp.zeros((), jnp.int32),
        )

    def step(q, k, v, state: RecurrentState, *, hyper_parameters, arrays, bias_fn):
        kv_heads = k.shape[0]
        phi_k = features(k, hyper_parameters)
        b = arrays["beta"][0].astype(jnp.float32) if "beta" in arrays else jnp.ones((kv_heads,), jnp.float32)
        s = state.s
        if gated and "log_alpha" in arrays:
            s = s * jnp.exp(arrays["log_alpha"][0].astype(jnp.float32))[:, None, None]
        error = v.astype(jnp.float32) - jnp.einsum("hm,hmd->hd", phi_k, s)
        s = s + jnp.einsum("hm,hd->hmd", phi_k, b[:, None] * error)
        phi_q = group_heads(features(q, hyper_parameters)[None], kv_heads)[0]  # [kv_heads, g, m]
        out = jnp.einsum("hgm,hmd->hgd", phi_q, s)
        return out.reshape(q.shape[0], v.shape[-1]).astype(q.dtype), RecurrentState(
            s, state.z, state.log_scale, state.length + 1
        )

    return Decoder("fast weights", init, step)


_FORM_DOCS = {"chunk_size": "chunk of the chunked (WY) form", "form": "chunked (WY) or recurrent"}

register(
    "delta",
    delta_attention,
    family="kernelized",
    paper="Schlag et al. 2021",
    complexity="O(N m d)",
    causal_only=True,
    exact=False,
    token_inputs=TokenInputs(beta_params, delta_beta),
    decoder=_fast_weight_decoder(lambda x, hp: delta_features(x, hp["feature_map"], hp["dpfp_nu"])),
    choices={"feature_map": DELTA_FEATURE_MAPS, "form": FORMS},
    docs={"feature_map": "phi (sum-normalised)", "dpfp_nu": "DPFP's order nu", **_FORM_DOCS},
    summary="fast weights W_i = W_{i-1} + beta_i (v_i - W_{i-1} phi(k_i)) phi(k_i)^T, y_i = W_i phi(q_i)",
    limits={"chunk_size": 1, "dpfp_nu": 1},
)


# ----------------------------------------------------------------------------- gated delta rule (Yang et al.)


def l2_normalised(x: ArrayLike) -> Array:
    """x / sqrt(|x|^2 + 1e-6) over the features, in float32 (flash-linear-attention's l2norm)."""
    xf = jnp.asarray(x).astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + L2_EPS)


@causal_never_reads_non_finite_future()
def gated_delta_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    beta: Float[ArrayLike, "_kv_len _kv_heads"] | None = None,
    log_alpha: Float[ArrayLike, "_kv_len _kv_heads"] | None = None,
    causal: bool = True,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    form: str = "chunked",
) -> Float[Array, "q_len heads d_v"]:
    """The gated delta rule (Yang, Kautz & Hatamizadeh 2024, Gated DeltaNet).

    S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T and o_t = S_t q_t with
    q and k L2-normalised: alpha_t decays the whole memory (Mamba2's gate), beta_t
    replaces the value stored under k_t (the delta rule).

    Arguments:
        q, k, v: as `delta_attention`.
        beta: `[n, kv_heads]` in [0, 1], sigmoid(w_beta x_t) made by the module; None: 1.
        log_alpha: `[n, kv_heads]`, log alpha_t <= 0, -A softplus(w_alpha x_t + b) made
            by the module; None: 0 (alpha = 1: the plain delta rule on L2-normalised keys).
        causal: must be True (causal only).
        kv_mask: optional `[n]`; padded positions get beta = 0 and alpha = 1.
        chunk_size, form: as `delta_rule` (states in float32 in both forms).

    Returns:
        `[n, heads, d_v]`.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    _check_gate_shape("beta", beta, k.shape[0], k.shape[1])
    _check_gate_shape("log_alpha", log_alpha, k.shape[0], k.shape[1])
    _refuse_non_causal("gated delta attention", causal)
    b, a = _masked_gates(beta, log_alpha, kv_mask, k.shape[0], k.shape[1])
    out = delta_rule(l2_normalised(q), l2_normalised(k), v, b, a, form=form, chunk_size=chunk_size)
    return out.astype(out_dtype(q, k, v))


def gated_delta_params(key: PRNGKeyArray, *, d_model: int, kv_heads: int, causal: bool) -> dict[str, Array]:
    """w_beta and w_alpha `[d_model, kv_heads]` (no bias), A = exp(a_log) drawn uniform in
    (0, 16) and the softplus bias b with softplus(b) log-uniform in (0.001, 0.1) per head,
    as the authors' layer (flash-linear-attention's GatedDeltaNet, Mamba2's init)."""
    beta = beta_params(key, d_model=d_model, kv_heads=kv_heads, causal=causal)
    k_alpha, k_a, k_dt = jax.random.split(jax.random.fold_in(key, 1), 3)
    a = jax.random.uniform(k_a, (kv_heads,), minval=1e-4, maxval=16.0)
    dt = jnp.exp(jax.random.uniform(k_dt, (kv_heads,)) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
    dt = jnp.maximum(dt, 1e-4)
    return beta | {
        "alpha_w": jax.random.normal(k_alpha, (d_model, kv_heads)) / math.sqrt(d_model),
        "a_log": jnp.log(a),
        "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),  # softplus^-1(dt)
    }


def gated_delta_gates(
    params: dict[str, Array],
    queries: Float[Array, "q_len d_model"],
    keys: Float[Array, "kv_len d_model"] | None,
    hyper_parameters: dict,
) -> dict[str, Float[Array, "kv_len kv_heads"]]:
    """beta_t = sigmoid(w_beta x_t) and log alpha_t = -exp(a_log) softplus(w_alpha x_t + b)."""
    x = _token_rows(keys, "the gated delta rule")
    pre = x @ params["alpha_w"].astype(jnp.float32) + params["dt_bias"][None]
    return delta_beta(params, queries, keys, hyper_parameters) | {
        "log_alpha": -jnp.exp(params["a_log"].astype(jnp.float32))[None] * jax.nn.softplus(pre)
    }


register(
    "gated_delta",
    gated_delta_attention,
    family="kernelized",
    paper="Yang et al. 2024",
    complexity="O(N d^2)",
    causal_only=True,
    exact=False,
    token_inputs=TokenInputs(gated_delta_params, gated_delta_gates),
    decoder=_fast_weight_decoder(lambda x, hp: l2_normalised(x), gated=True),
    choices={"form": FORMS},
    docs=_FORM_DOCS,
    summary="S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t (L2-normed q, k)",
    limits={"chunk_size": 1},
)
