"""The survey's remaining attentions (seed 000, Table 1) that combine ideas from several
families: adaptively sparse attention (Correia et al., 2019: alpha-entmax with a learned
alpha per head, "Sparse"), the Long-Short Transformer (Zhu et al., 2021: a sliding
window plus a dynamic low-rank projection, "FP + LR") and Poolingformer (Zhang et al.,
2021: a sliding window, then attention over pooled keys of a larger window, "FP + M").

    sparsemax, entmax        the normalisers (exact sort; bisection), with their gradients
    adaptive_sparse_attention    alpha-entmax attention, alpha = 1 + sigmoid(a) per head
    long_short_attention     segment-wise window + dynamic projection, DualLN; causal form
                             with segment-wise projections
    poolingformer_attention  two levels: window, then pooled window over the first's output

Their learned arrays (alpha's logit, W_P and the DualLN gains, the second level's
projections) come from `init_arrays` and are trained with the module, as RFA's sigma.
The two causal ones decode from a cache of every key (their own `Decoder` steps: the
registry's `kv_cache` passes no arrays to its attend function, and the Long-Short step
recomputes the finished segments' projections); Poolingformer is not causal.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, PRNGKeyArray

from jxformers.decoding import KVCache
from jxformers.ops._common import (
    Part,
    attend_parts,
    block_part,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    check_self,
    default_scale,
    einsum_f32,
    group_heads,
    head_mask,
    logits,
    neighbour_blocks,
    out_dtype,
    pad_to,
    positions,
    rows_to_output,
    sliding_window_part,
    to_blocks,
    valid_keys,
    weighted_values,
    zero_padded,
)
from jxformers.ops.local import local_attention
from jxformers.registry import Decoder, register

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
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (1.0 < alpha <= 2.0) or (
            learned and alpha == 2.0):
        raise ValueError(f"alpha must be in (1, {top}{' (1 + sigmoid(a) never reaches 2)' if learned else ''}; "
                         f"got {alpha!r}")


def head_alpha(alpha_logit: Float[ArrayLike, " heads"]) -> Float[Array, " heads"]:
    """alpha = 1 + sigmoid(a), in (1, 2): Correia et al.'s parametrisation of a head's alpha."""
    return 1.0 + jax.nn.sigmoid(jnp.asarray(alpha_logit).astype(jnp.float32))


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
    out = weighted_values(p, v)  # [q, h, g, dv]
    return out.reshape(q.shape[0], heads, v.shape[-1]).astype(out_dtype(q, k, v))


def adaptive_sparse_arrays(key: PRNGKeyArray, *, heads: int, alpha: float = 1.5, learned: bool = True
                           ) -> dict[str, Array]:
    """The learned a per head, alpha = 1 + sigmoid(a), every head starting at `alpha`
    (a = logit(alpha - 1)); none when `learned` is False (alpha stays fixed)."""
    _check_alpha(alpha, learned=learned)
    if not learned:
        return {}
    return {"alpha_logit": jnp.full((heads,), math.log((alpha - 1.0) / (2.0 - alpha)), jnp.float32)}


def _cache_init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> KVCache:
    """Every key and value so far (slot p holds position p)."""
    dtype = jnp.float32 if dtype is None else dtype
    return KVCache(jnp.zeros((max_len, kv_heads, d_k), dtype), jnp.zeros((max_len, kv_heads, d_v), dtype),
                   jnp.full((max_len,), -1, jnp.int32), jnp.zeros((), jnp.int32))


def _cache_append(state: KVCache, k, v) -> KVCache:
    slot = state.length % state.k.shape[0]
    return KVCache(state.k.at[slot].set(k.astype(state.k.dtype)), state.v.at[slot].set(v.astype(state.v.dtype)),
                   state.slot_pos.at[slot].set(state.length), state.length + 1)


def _adaptive_sparse_step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
    state = _cache_append(state, k, v)
    out = adaptive_sparse_attention(q[None], state.k, state.v, alpha=hyper_parameters["alpha"],
                                    alpha_logit=arrays.get("alpha_logit"), kv_mask=state.slot_pos >= 0)[0]
    return out.astype(q.dtype), state


register(
    "adaptive_sparse", adaptive_sparse_attention, family="sparse", paper="Correia et al. 2019",
    complexity="O(N^2)", supports_cross=True, exact=False, init_arrays=adaptive_sparse_arrays,
    decoder=Decoder("cache", _cache_init, _adaptive_sparse_step),
    docs={"alpha": "entmax alpha in (1, 2] (2: sparsemax); the learned alpha's initial value",
          "learned": "learn alpha = 1 + sigmoid(a) per head (else alpha is fixed)"},
)


# ----------------------------------------------------------------------------- Long-Short


def dual_layer_norm(x: Float[ArrayLike, "*n kv_heads d"], params: Float[ArrayLike, "2 kv_heads d"] | None,
                    eps: float = 1e-5) -> Float[Array, "*n kv_heads d"]:
    """A LayerNorm over each token's heads and features jointly (Transformer-LS's DualLN
    normalises the d_model-wide keys and values), with gain `params[0]` and bias
    `params[1]` `[kv_heads, d]` (None: gain 1, bias 0), in float32."""
    x = jnp.asarray(x).astype(jnp.float32)
    mean = jnp.mean(x, axis=(-2, -1), keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=(-2, -1), keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    if params is None:
        return y
    params = jnp.asarray(params).astype(jnp.float32).reshape((2,) + (1,) * (y.ndim - 2) + params.shape[1:])
    return y * params[0] + params[1]


def _masked_softmax_over(s: Array, real: Array, axis: int) -> Array:
    """Softmax along `axis` over entries where `real` (broadcast) is True; all-masked
    slices give zeros."""
    s = jnp.where(real, s, -jnp.inf)
    top = jnp.max(s, axis=axis, keepdims=True)
    e = jnp.where(real, jnp.exp(s - jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))), 0.0)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def dynamic_projection(
    k: Float[ArrayLike, "seg l kv_heads d_k"], v: Float[ArrayLike, "seg l kv_heads d_v"],
    real: Bool[ArrayLike, "seg l"], proj_w: Float[ArrayLike, "kv_heads d_k rank"],
) -> tuple[Float[Array, "seg rank kv_heads d_k"], Float[Array, "seg rank kv_heads d_v"]]:
    """Transformer-LS's dynamic projection of each segment: P = softmax(K W_P) over the
    segment's (real) positions `[l, rank]` per head, K_bar = P^T K and V_bar = P^T V."""
    s = einsum_f32("slhd,hdr->slhr", k, proj_w)
    p = _masked_softmax_over(s, real[:, :, None, None], axis=1)
    return einsum_f32("slhr,slhd->srhd", p, k), einsum_f32("slhr,slhd->srhd", p, v)


def _ls_arrays_check(proj_w, kv_heads: int, d_k: int) -> None:
    if proj_w is None:
        raise ValueError("long_short_attention needs proj_w [kv_heads, d_k, rank] (the learned dynamic projection "
                         "W_P): make it with registry.bind('long_short').init_arrays(...)")
    if proj_w.shape[:2] != (kv_heads, d_k):
        raise ValueError(f"proj_w must have shape [kv_heads={kv_heads}, d_k={d_k}, rank]; got {tuple(proj_w.shape)}")


def _causal_compressed(k, v, real, proj_w, ln_k, ln_v, segment_size: int):
    """The causal form's compressed keys: each segment of `segment_size` keys projected
    to `rank` keys (`dynamic_projection`), DualLN'd; with each compressed key's segment
    index and whether its segment holds a real key. k, v `[L, h, d]`, any L."""
    n = k.shape[0]
    length = ceil_div(n, segment_size) * segment_size
    real = valid_keys(real, n, length)
    kb, vb, rb = (to_blocks(pad_to(x, length), segment_size) for x in (k, v, real))
    kbar, vbar = dynamic_projection(kb, vb, rb, proj_w)
    rank = proj_w.shape[-1]
    kbar = dual_layer_norm(kbar.reshape(-1, *kbar.shape[2:]), ln_k)
    vbar = dual_layer_norm(vbar.reshape(-1, *vbar.shape[2:]), ln_v)
    segment = jnp.repeat(positions(length // segment_size), rank)
    seg_real = jnp.repeat(jnp.any(rb, axis=1), rank)
    return kbar, vbar, segment, seg_real


def long_short_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 128,
    segment_size: int = 64,
    proj_w: Float[ArrayLike, "_kv_heads _d_k rank"] | None = None,
    ln_local_k: Float[ArrayLike, "2 _kv_heads _d_k"] | None = None,
    ln_local_v: Float[ArrayLike, "2 _kv_heads _d_v"] | None = None,
    ln_proj_k: Float[ArrayLike, "2 _kv_heads _d_k"] | None = None,
    ln_proj_v: Float[ArrayLike, "2 _kv_heads _d_v"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Long-Short Transformer attention (Zhu et al., 2021): one softmax over a short-term
    window and a long-range dynamic projection of the keys and values.

    Bidirectional: the sequence is cut into segments of `window` tokens; a query attends
    the keys of its own segment and `window // 2` keys each side of it (the paper's
    segment-wise sliding window), plus `rank` projected keys K_bar = P^T K, V_bar = P^T V
    with P = softmax(K W_P) taken over the whole (real) length.
    Causal (the paper's autoregressive form): a query attends its `window` most recent
    keys (itself included) plus the projected keys of every earlier segment of
    `segment_size` tokens, each segment projected on its own (P = softmax over its
    positions), so nothing reads a later key.
    DualLN: the window keys/values and the projected ones go through separate
    LayerNorms (`ln_local_*`, `ln_proj_*`: gain and bias `[2, kv_heads, d]`, over each
    token's heads and features jointly) before the one softmax.

    Arguments:
        q, k, v: self-attention inputs of one length (grouped-query heads allowed).
        window: the short-term window w (segment length bidirectionally; keys behind
            when causal), int >= 1.
        segment_size: the causal form's projection segment l, int >= 1 (bidirectional: unused).
        proj_w: `[kv_heads, d_k, rank]`, W_P, learned (`long_short_arrays`).
        causal, kv_mask, scale: as everywhere (padded keys never enter a window, a
            projection or a normaliser).

    Returns `[seq, heads, d_v]`. Time O(N * (w + r) * d) bidirectional; causal
    O(N * (w + N r / l) * d).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("window", window)
    check_positive("segment_size", segment_size)
    check_self(q, k, v, kv_mask)
    _ls_arrays_check(proj_w, k.shape[1], k.shape[2])
    n = q.shape[0]
    sc = default_scale(q.shape[2], scale)
    real = valid_keys(kv_mask, n, n)
    k_local, v_local = dual_layer_norm(k, ln_local_k), dual_layer_norm(v, ln_local_v)
    if causal:
        block = min(max(window, 16), n)
        length = ceil_div(n, block) * block
        qg = group_heads(pad_to(q, length), k.shape[1])
        near = sliding_window_part(qg, pad_to(k_local, length), pad_to(v_local, length), pad_to(real, length, value=False),
                                   block=block, window=window - 1, causal=True, scale=sc)
        kbar, vbar, segment, seg_real = _causal_compressed(k, v, real, proj_w, ln_proj_k, ln_proj_v, segment_size)
        earlier = (positions(length)[:, None] // segment_size > segment[None, :]) & seg_real[None, :]
        far = Part(logits(qg, kbar, sc), head_mask(earlier), lambda p: weighted_values(p, vbar))
        return rows_to_output(attend_parts([near, far]), n, out_dtype(q, k, v))
    length = ceil_div(n, window) * window
    qg = group_heads(pad_to(q, length), k.shape[1])
    kb, vb, rb = (neighbour_blocks(to_blocks(pad_to(x, length), window), 1, 1)
                  for x in (k_local, v_local, pad_to(real, length, value=False)))
    start = positions(length // window)[:, None] * window
    k_pos = start - window + positions(3 * window)[None, :]  # [blocks, 3w]
    half = window // 2
    near_mask = (k_pos >= start - half) & (k_pos < start + window + half) & rb  # [blocks, 3w]
    near_mask = jnp.broadcast_to(near_mask[:, None, :], (length // window, window, 3 * window))
    near = block_part(to_blocks(qg, window), kb, vb, near_mask, sc)
    kbar, vbar = dynamic_projection(k[None], v[None], real[None], proj_w)
    kbar, vbar = dual_layer_norm(kbar[0], ln_proj_k), dual_layer_norm(vbar[0], ln_proj_v)
    any_real = jnp.broadcast_to(jnp.any(real), (length, kbar.shape[0]))
    far = Part(logits(qg, kbar, sc), head_mask(any_real), lambda p: weighted_values(p, vbar))
    return rows_to_output(attend_parts([near, far]), n, out_dtype(q, k, v))


def long_short_arrays(key: PRNGKeyArray, *, kv_heads: int, d_k: int, d_v: int, rank: int = 16) -> dict[str, Array]:
    """W_P `[kv_heads, d_k, rank]` (normal, 1/sqrt(d_k)) and the DualLN gains and biases
    (ones and zeros), all learned."""
    check_positive("rank", rank)

    def ln(d):
        return jnp.stack([jnp.ones((kv_heads, d)), jnp.zeros((kv_heads, d))])

    return {"proj_w": jax.random.normal(key, (kv_heads, d_k, rank)) / math.sqrt(d_k),
            "ln_local_k": ln(d_k), "ln_local_v": ln(d_v), "ln_proj_k": ln(d_k), "ln_proj_v": ln(d_v)}


def _long_short_step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
    """One causal token against every cached key: the window's last `window` keys and the
    projections of the segments before the token's own (recomputed from the cache)."""
    t = state.length
    state = _cache_append(state, k, v)
    window, segment_size = hyper_parameters["window"], hyper_parameters["segment_size"]
    real = state.slot_pos >= 0
    qg = group_heads(q[None], k.shape[0])  # [1, h, g, d]
    sc = default_scale(q.shape[-1], None)
    k_local = dual_layer_norm(state.k, arrays.get("ln_local_k"))
    v_local = dual_layer_norm(state.v, arrays.get("ln_local_v"))
    near_mask = (real & (state.slot_pos > t - window))[None, :]
    near = Part(logits(qg, k_local, sc), head_mask(near_mask), lambda p: weighted_values(p, v_local))
    kbar, vbar, segment, seg_real = _causal_compressed(state.k, state.v, real, arrays["proj_w"], arrays.get("ln_proj_k"),
                                                       arrays.get("ln_proj_v"), segment_size)
    earlier = ((t // segment_size > segment) & seg_real)[None, :]
    far = Part(logits(qg, kbar, sc), head_mask(earlier), lambda p: weighted_values(p, vbar))
    out = attend_parts([near, far])
    return out.reshape(q.shape[0], v.shape[-1]).astype(q.dtype), state


register(
    "long_short", long_short_attention, family="fixed pattern + low rank", paper="Zhu et al. 2021 (Transformer-LS)",
    complexity="O(N*(w+r))", exact=False, init_arrays=long_short_arrays,
    decoder=Decoder("cache", _cache_init, _long_short_step),
    docs={"window": "short-term window w (segment length; keys behind when causal)",
          "segment_size": "causal: tokens per dynamically projected segment l",
          "rank": "projected keys r (per segment when causal)"},
)


# ----------------------------------------------------------------------------- Poolingformer

POOLINGS = ("mean", "max")


def pool_keys(
    x: Float[ArrayLike, "L h d"], real: Bool[ArrayLike, " L"], *, size: int, stride: int, pooling: str = "mean",
) -> tuple[Float[Array, "m h d"], Bool[Array, " m"]]:
    """Pool `x` along its length with kernel `size` and `stride`: slot m covers positions
    [m * stride, m * stride + size), its mean or max over the real ones among them
    (m < ceil(L / stride)). Returns the pooled slots and whether each holds a real position."""
    length = x.shape[0]
    slots = ceil_div(length, stride)
    idx = positions(slots)[:, None] * stride + positions(size)[None, :]  # [m, size]
    inside = idx < length
    idx = jnp.minimum(idx, length - 1)
    use = inside & jnp.asarray(real)[idx]
    xs = jnp.asarray(x).astype(jnp.float32)[idx]  # [m, size, h, d]
    count = jnp.sum(use, axis=1)
    w = use[:, :, None, None]
    if pooling == "mean":
        pooled = jnp.sum(jnp.where(w, xs, 0.0), axis=1) / jnp.maximum(count, 1)[:, None, None].astype(jnp.float32)
    else:
        pooled = jnp.max(jnp.where(w, xs, -jnp.inf), axis=1)
        pooled = jnp.where((count > 0)[:, None, None], pooled, 0.0)
    return pooled, count > 0


def poolingformer_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 64,
    pool_window: int = 256,
    pool_size: int = 5,
    pool_stride: int = 4,
    pooling: str = "mean",
    level2_q: Float[ArrayLike, "_c _heads _d_k"] | None = None,
    level2_k: Float[ArrayLike, "_c _heads _d_k"] | None = None,
    level2_v: Float[ArrayLike, "_c _heads _d_v"] | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Poolingformer's two-level attention (Zhang et al., 2021), bidirectional.

    Level 1: sliding-window attention, y_i = softmax over |i - j| <= `window` of
    q_i k_j / sqrt(d_k), applied to v (`local_attention`).
    Level 2, stacked on level 1: from Y (all heads concatenated, `[seq, heads * d_v]`)
    new queries, keys and values Y W'_Q, Y W'_K, Y W'_V (the learned `level2_*`
    `[heads * d_v, heads, d]`); the keys and values are pooled along the length (kernel
    `pool_size`, stride `pool_stride`, `pooling` = mean or max over real tokens), and
    query i attends, in its own softmax, the pooled slots lying inside its larger
    window |i - j| <= `pool_window`: z_i. The output is y_i + z_i.

    Arguments:
        q, k, v: self-attention inputs of one length (grouped-query heads allowed).
        window: level-1 keys each side, int >= 0. pool_window: level-2 keys each side,
            int >= pool_size. pool_size, pool_stride: the pooling kernel and stride, >= 1.
        pooling: "mean" or "max".
        level2_q, level2_k, level2_v: the second level's projections (`poolingformer_arrays`).
        kv_mask: `[seq]`, True for real tokens (padding never enters a window or a pool).

    Returns `[seq, heads, d_v]`. Time O(N * (window + pool_window / pool_stride) * d).
    Not causal: the pooled window reaches both ways (the survey's Table 1 marks it
    non-causal); no decoding.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("window", window, minimum=0)
    check_positive("pool_size", pool_size)
    check_positive("pool_stride", pool_stride)
    check_positive("pool_window", pool_window, minimum=pool_size)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {list(POOLINGS)}; got {pooling!r}")
    check_self(q, k, v, kv_mask)
    n, heads, d_k = q.shape
    d_v = v.shape[-1]
    for name, w, d in (("level2_q", level2_q, d_k), ("level2_k", level2_k, d_k), ("level2_v", level2_v, d_v)):
        if w is None:
            raise ValueError(f"poolingformer_attention needs {name} [heads * d_v, heads, {d}] (the second level's "
                             "learned projection): make it with registry.bind('poolingformer').init_arrays(...)")
        if tuple(w.shape) != (heads * d_v, heads, d):
            raise ValueError(f"{name} must have shape [heads * d_v={heads * d_v}, heads={heads}, {d}]; "
                             f"got {tuple(w.shape)}")
    y = local_attention(q, k, v, window=window, kv_mask=kv_mask, scale=scale, impl="xla").astype(jnp.float32)
    flat = y.reshape(n, heads * d_v)
    q2, k2, v2 = (einsum_f32("nc,chd->nhd", flat, w) for w in (level2_q, level2_k, level2_v))
    # Query blocks of `block` tokens (a multiple of the stride, >= pool_window) see the
    # pooled slots of their own block and the blocks either side.
    block = pool_stride * ceil_div(max(pool_window, 16), pool_stride)
    block = min(block, pool_stride * ceil_div(n, pool_stride))
    length = ceil_div(n, block) * block
    real = valid_keys(kv_mask, n, length)
    kp, ok = pool_keys(pad_to(k2, length), real, size=pool_size, stride=pool_stride, pooling=pooling)
    vp, _ = pool_keys(pad_to(v2, length), real, size=pool_size, stride=pool_stride, pooling=pooling)
    per = block // pool_stride  # slots starting in one query block
    kb, vb, okb = (neighbour_blocks(to_blocks(x, per), 1, 1) for x in (kp, vp, ok))
    nb = length // block
    start = (positions(nb)[:, None] * per - per + positions(3 * per)[None, :]) * pool_stride  # [nb, 3 per]
    q_pos = to_blocks(positions(length), block)[:, :, None]  # [nb, block, 1]
    inside = (start[:, None, :] >= q_pos - pool_window) & (start[:, None, :] + pool_size - 1 <= q_pos + pool_window)
    part = block_part(to_blocks(group_heads(pad_to(q2, length), heads), block), kb, vb, inside & okb[:, None, :],
                      default_scale(d_k, scale))
    z = rows_to_output(attend_parts([part]), n, jnp.float32)
    return (y + z).astype(out_dtype(q, k, v))


def poolingformer_arrays(key: PRNGKeyArray, *, heads: int, d_k: int, d_v: int) -> dict[str, Array]:
    """The second level's learned projections W'_Q, W'_K `[heads * d_v, heads, d_k]` and
    W'_V `[heads * d_v, heads, d_v]` of the first level's output (normal, 1/sqrt(heads * d_v))."""
    c = heads * d_v
    kq, kk, kv = jax.random.split(key, 3)
    return {"level2_q": jax.random.normal(kq, (c, heads, d_k)) / math.sqrt(c),
            "level2_k": jax.random.normal(kk, (c, heads, d_k)) / math.sqrt(c),
            "level2_v": jax.random.normal(kv, (c, heads, d_v)) / math.sqrt(c)}


register(
    "poolingformer", poolingformer_attention, family="fixed pattern + memory", paper="Zhang et al. 2021 (Poolingformer)",
    complexity="O(N*(w1+w2/stride))", exact=False, init_arrays=poolingformer_arrays, choices={"pooling": POOLINGS},
    docs={"window": "level 1: keys each side", "pool_window": "level 2: keys each side (pooled)",
          "pool_size": "pooling kernel", "pool_stride": "pooling stride", "pooling": "mean or max"},
)
