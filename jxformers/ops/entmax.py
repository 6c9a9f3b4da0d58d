"""Sparse normalisers: attention whose softmax is replaced by sparsemax or alpha-entmax,
so weights can be exactly zero (Tay et al.'s survey, Table 1: "Sparse").

    sparsemax, entmax        the normalisers (exact sort; bisection), with their gradients:
                             Martins & Astudillo 2016, "From Softmax to Sparsemax"
                             (arXiv 1602.02068); Peters, Niculae & Martins 2019,
                             "Sparse Sequence-to-Sequence Models" (arXiv 1905.05702)
    adaptive_sparse_attention    alpha-entmax attention, alpha = 1 + sigmoid(a) per head:
                             Correia, Niculae & Martins 2019, "Adaptively Sparse
                             Transformers" (arXiv 1909.00015)

The learned alpha's logit comes from `init_arrays` and is trained with the module, as
RFA's sigma. Decoding runs from a cache of every key (its own `Decoder` step: the
registry's `kv_cache` passes no arrays to its attend function).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import group_heads
from jxformers._typing import ArrayLike
from jxformers.decoding import KVCache, cache_append, full_cache_init
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    check_mask_shape,
    check_qkv,
    default_scale,
    logits,
    out_dtype,
    weighted_values,
    zero_padded,
)
from jxformers.registry import Decoder, register
from jxformers.validate import Limits

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "adaptive_sparse_arrays",
    "adaptive_sparse_attention",
    "entmax",
    "head_alpha",
    "sparsemax",
]

# ----------------------------------------------------------------------------- entmax


def _compute_dtype(x: ArrayLike) -> jnp.dtype:
    """float32, or float64 for float64 inputs (the finite-difference tests)."""
    return jnp.dtype(jnp.float64 if jnp.result_type(x) == jnp.float64 else jnp.float32)


def _rows(z: ArrayLike, mask: ArrayLike | None):
    """Scores with masked entries at -inf, shifted so each row's largest real score is 0;
    rows with no real entry become zeros (their outputs are zeroed at the end)."""
    z = jnp.asarray(z)
    z = z.astype(_compute_dtype(z))
    mask = jnp.ones(z.shape, bool) if mask is None else jnp.broadcast_to(mask, z.shape)
    any_real = jnp.any(mask, axis=-1, keepdims=True)
    z = jnp.where(mask, z, -jnp.inf)
    top = jnp.max(z, axis=-1, keepdims=True)
    z = jnp.where(any_real, z - jnp.where(any_real, top, 0.0), 0.0)
    return z, mask, any_real


def _support_jacobian_vjp(p, g, s):
    """dz = diag(s) g - s (s . g) / sum(s): the vjp of entmax in z (Peters et al., 2019),
    s = p^(2 - alpha) on the support and 0 off it; rows without support give 0."""
    total = jnp.sum(s, axis=-1, keepdims=True)
    mean = jnp.sum(s * g, axis=-1, keepdims=True) / jnp.where(total > 0, total, 1.0)
    return s * (g - mean)


@jax.custom_vjp
def _sparsemax_rows(z, mask):
    return _sparsemax_fwd(z, mask)[0]


def _sparsemax_fwd(z, mask):
    zf, mask, any_real = _rows(z, mask)
    d = zf.shape[-1]
    zs = -jnp.sort(-zf, axis=-1)  # descending; masked entries (-inf) last
    ks = jnp.arange(1, d + 1, dtype=zf.dtype).reshape((1,) * (zf.ndim - 1) + (d,))
    cumulative = jnp.cumsum(zs, axis=-1)
    support = 1.0 + ks * zs > cumulative  # k is in the support iff 1 + k z_(k) > sum_{j<=k} z_(j)
    size = jnp.maximum(jnp.sum(support, axis=-1, keepdims=True), 1)
    tau = (jnp.take_along_axis(cumulative, size - 1, axis=-1) - 1.0) / size.astype(zf.dtype)
    p = jnp.where(mask & any_real, jnp.maximum(zf - tau, 0.0), 0.0)
    return p.astype(z.dtype), p


def _sparsemax_bwd(p, g):
    s = (p > 0).astype(p.dtype)
    return _support_jacobian_vjp(p, g.astype(p.dtype), s).astype(g.dtype), None


_sparsemax_rows.defvjp(_sparsemax_fwd, _sparsemax_bwd)


def sparsemax(
    z: Float[ArrayLike, "*rows n"], mask: Bool[ArrayLike, "*#rows #n"] | None = None
) -> Float[Array, "*rows n"]:
    """Sparsemax over the last axis (Martins & Astudillo, 2016), exact by sorting:
    the Euclidean projection of `z` onto the simplex, p = [z - tau]_+. Entries where
    `mask` is False get exactly 0; a row with no True entry is all zeros. Gradients are
    the closed form (the support's centred identity), with zero through masked entries."""
    z = jnp.asarray(z)
    mask = jnp.ones(z.shape, bool) if mask is None else jnp.broadcast_to(jnp.asarray(mask), z.shape)
    return _sparsemax_rows(z, mask)


def _bisection_iterations(dtype) -> int:
    """Halvings of tau's bracket (width < 1) past the dtype's resolution."""
    return jnp.finfo(dtype).nmant + 8


def _entmax_p(x, tau, inv):
    return jnp.maximum(x - tau, 0.0) ** inv


@jax.custom_vjp
def _entmax_rows(z, alpha, mask):
    return _entmax_fwd(z, alpha, mask)[0]


def _entmax_fwd(z, alpha, mask):
    zf, mask, any_real = _rows(z, mask)
    am1 = (alpha.astype(zf.dtype) - 1.0)[..., None]
    inv = 1.0 / am1
    x = zf * am1  # p_i = [(alpha - 1) z_i - tau]_+ ^ (1 / (alpha - 1)), sum_i p_i = 1
    count = jnp.sum(mask, axis=-1, keepdims=True)
    count = jnp.where(any_real, count, zf.shape[-1]).astype(zf.dtype)
    # The largest x is 0: tau lies in [-1, -(1/count)^(alpha - 1)] (Blondel et al. 2019; entmax).
    lo = jnp.full_like(am1, -1.0)
    width = -((1.0 / count) ** am1) - lo
    f_lo = jnp.sum(_entmax_p(x, lo, inv), axis=-1, keepdims=True) - 1.0

    def body(_, carry):
        lo, width = carry
        width = width / 2
        mid = lo + width
        f_mid = jnp.sum(_entmax_p(x, mid, inv), axis=-1, keepdims=True) - 1.0
        return jnp.where(f_mid * f_lo >= 0, mid, lo), width

    lo, _ = jax.lax.fori_loop(0, _bisection_iterations(zf.dtype), body, (lo, width))
    p = _entmax_p(x, lo, inv)
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    p = jnp.where(mask & any_real, p, 0.0)
    return p.astype(z.dtype), (p, zf, alpha)


def _entmax_bwd(res, g):
    p, zf, alpha = res
    g = g.astype(p.dtype)
    a = alpha.astype(p.dtype)[..., None]
    on = p > 0
    safe = jnp.where(on, p, 1.0)
    s = jnp.where(on, safe ** (2.0 - a), 0.0)
    dz = _support_jacobian_vjp(p, g, s)
    # d p_i / d alpha on the support (Correia et al. 2019, appendix; from p_i^(alpha-1) =
    # (alpha-1) z_i - tau): s_i (w_i - sum_j s_j w_j / sum_j s_j) / (alpha - 1), with
    # w_i = z_i - p_i^(alpha-1) log p_i.
    w = jnp.where(on, zf - safe ** (a - 1.0) * jnp.log(safe), 0.0)
    total = jnp.sum(s, axis=-1, keepdims=True)
    dtau = jnp.sum(s * w, axis=-1, keepdims=True) / jnp.where(total > 0, total, 1.0)
    dp_dalpha = s * (w - dtau) / (a - 1.0)
    dalpha = jnp.sum(g * dp_dalpha, axis=-1)
    return dz.astype(g.dtype), dalpha.astype(alpha.dtype), None


_entmax_rows.defvjp(_entmax_fwd, _entmax_bwd)


def entmax(
    z: Float[ArrayLike, "*rows n"],
    alpha: Float[ArrayLike, "*#rows"] | float,
    mask: Bool[ArrayLike, "*#rows #n"] | None = None,
) -> Float[Array, "*rows n"]:
    """alpha-entmax over the last axis (Peters et al., 2019; Correia et al., 2019):
    p = argmax_p p.z + H_alpha^T(p) = [(alpha - 1) z - tau]_+ ^ (1 / (alpha - 1)), with tau
    found by bisection to the dtype's resolution (float32 or float64), then normalised.
    alpha -> 1 is softmax, alpha = 2 sparsemax (use `sparsemax` there: exact by sorting).

    `alpha` (in (1, 2]) broadcasts against the rows (one per head, say). Entries where
    `mask` is False get exactly 0; a row with no True entry is all zeros. Gradients are
    closed-form in both `z` and `alpha` (custom vjp; the bisection is not differentiated).
    """
    z = jnp.asarray(z)
    mask = jnp.ones(z.shape, bool) if mask is None else jnp.broadcast_to(jnp.asarray(mask), z.shape)
    alpha = jnp.broadcast_to(jnp.asarray(alpha, _compute_dtype(z)), z.shape[:-1])
    return _entmax_rows(z, alpha, mask)


# ----------------------------------------------------------------------------- adaptive sparse


def _check_alpha(alpha: float, *, learned: bool) -> None:
    top = "2)" if learned else "2]"
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, (int, float))
        or not (1.0 < alpha <= 2.0)
        or (learned and alpha == 2.0)
    ):
        raise ValueError(
            f"alpha must be in (1, {top}{' (1 + sigmoid(a) never reaches 2)' if learned else ''}; got {alpha!r}"
        )


def head_alpha(alpha_logit: Float[ArrayLike, " heads"]) -> Float[Array, " heads"]:
    """alpha = 1 + sigmoid(a), in (1, 2): Correia et al.'s parametrisation of a head's alpha."""
    return 1.0 + jax.nn.sigmoid(jnp.asarray(alpha_logit).astype(jnp.float32))


@causal_never_reads_non_finite_future()
def adaptive_sparse_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "kv_len _kv_heads d_v"],
    *,
    alpha: float = 1.5,
    alpha_logit: Float[ArrayLike, " _heads"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    mask: Bool[ArrayLike, "_q_len _kv_len"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Adaptively sparse attention (Correia, Niculae & Martins, 2019): softmax replaced by
    alpha-entmax, p = entmax_alpha(q k^T / sqrt(d_k)), with alpha learned per head.

    Arguments:
        q, k, v: queries and keys/values (cross lengths allowed; causal needs one length).
        alpha: the fixed alpha in (1, 2] when `alpha_logit` is None (2: sparsemax, exact
            by sorting), else unused (it is the learned alpha's initial value).
        alpha_logit: `[heads]`, the learned a of alpha = 1 + sigmoid(a) per query head
            (`adaptive_sparse_arrays` makes it); entmax then runs by bisection.
        causal: query i sees keys j <= i. kv_mask: `[kv_len]`, True for real keys.
        mask: `[q_len, kv_len]`, True where attending is allowed.
        scale: default 1 / sqrt(d_k).

    Masked keys get exactly zero weight; a query with no key gets zeros. Gradients reach
    q, k and alpha (closed-form vjp of entmax, `entmax`). Time O(q_len * kv_len * d), plus
    O(q_len * kv_len * iterations) for the bisection (31 halvings in float32); memory
    O(q_len * kv_len). Decodes with a key/value cache.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    learned = alpha_logit is not None
    if not learned:
        _check_alpha(alpha, learned=False)
    check_qkv(q, k, v, self_attention=causal)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    check_mask_shape("mask", mask, (q.shape[0], k.shape[0]))
    heads, kv_heads = q.shape[1], k.shape[1]
    if learned and tuple(alpha_logit.shape) != (heads,):
        raise ValueError(f"alpha_logit must have shape [heads={heads}]; got {tuple(alpha_logit.shape)}")
    qg = group_heads(q, kv_heads)
    s = logits(qg, k, default_scale(q.shape[2], scale))  # [h, g, q, k]
    allowed = jnp.ones(s.shape[-2:], bool)
    if causal:
        allowed = allowed & jnp.tril(jnp.ones(s.shape[-2:], bool))
    if mask is not None:
        allowed = allowed & jnp.asarray(mask)
    if kv_mask is not None:
        allowed = allowed & jnp.asarray(kv_mask)[None, :]
    allowed = jnp.broadcast_to(allowed, s.shape)
    if learned:
        a = head_alpha(alpha_logit).reshape(kv_heads, heads // kv_heads, 1)
        p = entmax(s, jnp.broadcast_to(a, s.shape[:-1]), allowed)
    elif alpha == 2.0:
        p = sparsemax(s, allowed)
    else:
        p = entmax(s, float(alpha), allowed)
    out = weighted_values(p, v, reads=p != 0)  # [q, h, g, dv]; the support is data-dependent
    return out.reshape(q.shape[0], heads, v.shape[-1]).astype(out_dtype(q, k, v))


def adaptive_sparse_arrays(
    key: PRNGKeyArray, *, heads: int, alpha: float = 1.5, learned: bool = True
) -> dict[str, Array]:
    """The learned a per head, alpha = 1 + sigmoid(a), every head starting at `alpha`
    (a = logit(alpha - 1)); none when `learned` is False (alpha stays fixed)."""
    _check_alpha(alpha, learned=learned)
    if not learned:
        return {}
    return {"alpha_logit": jnp.full((heads,), math.log((alpha - 1.0) / (2.0 - alpha)), jnp.float32)}


def _adaptive_sparse_step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
    state = cache_append(state, k, v)
    out = adaptive_sparse_attention(
        q[None],
        state.k,
        state.v,
        alpha=hyper_parameters["alpha"],
        alpha_logit=arrays.get("alpha_logit"),
        kv_mask=state.slot_pos >= 0,
    )[0]
    return out.astype(q.dtype), state


register(
    "adaptive_sparse",
    adaptive_sparse_attention,
    family="sparse",
    paper="Correia et al. 2019",
    complexity="O(N^2)",
    supports_cross=True,
    exact=False,
    init_arrays=adaptive_sparse_arrays,
    decoder=Decoder("cache", full_cache_init, _adaptive_sparse_step),
    docs={
        "alpha": "entmax alpha in (1, 2] (2: sparsemax); the learned alpha's initial value",
        "learned": "learn alpha = 1 + sigmoid(a) per head (else alpha is fixed)",
    },
    summary=(
        "Adaptively Sparse Transformer: alpha-entmax of q k^T (exact zeros), alpha = 1 + sigmoid(a) learned "
        "per head; sparsemax at a fixed alpha = 2"
    ),
    limits={"alpha": Limits(above=1, maximum=2)},
)
