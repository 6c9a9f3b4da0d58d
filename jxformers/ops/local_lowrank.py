"""A local window plus a low-rank projection of the whole sequence (Tay et al.'s survey,
Table 1: "FP + LR"): the Long-Short Transformer (Zhu et al. 2021, "Long-Short
Transformer: Efficient Transformers for Language and Vision", arXiv 2107.02192).

    dual_layer_norm          DualLN: a LayerNorm over each token's heads and features
    dynamic_projection       P = softmax(K W_P) per segment, K_bar = P^T K, V_bar = P^T V
    long_short_attention     segment-wise window + dynamic projection, DualLN; causal form
                             with segment-wise projections

W_P and the DualLN gains come from `init_arrays` and are trained with the module. The
causal form decodes from a cache of every key (its own `Decoder` step, which recomputes
the finished segments' projections).
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
    Part,
    attend_parts,
    block_part,
    causal_never_reads_non_finite_future,
    ceil_div,
    check_positive,
    check_self,
    default_scale,
    einsum_f32,
    head_mask,
    logits,
    masked_softmax_over,
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
from jxformers.registry import Decoder, fraction, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "dual_layer_norm",
    "dynamic_projection",
    "long_short_arrays",
    "long_short_attention",
]


def dual_layer_norm(
    x: Float[ArrayLike, "*n kv_heads d"], params: Float[ArrayLike, "2 kv_heads d"] | None, eps: float = 1e-5
) -> Float[Array, "*n kv_heads d"]:
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


def dynamic_projection(
    k: Float[ArrayLike, "seg l kv_heads d_k"],
    v: Float[ArrayLike, "seg l kv_heads d_v"],
    real: Bool[ArrayLike, "seg l"],
    proj_w: Float[ArrayLike, "kv_heads d_k rank"],
) -> tuple[Float[Array, "seg rank kv_heads d_k"], Float[Array, "seg rank kv_heads d_v"]]:
    """Transformer-LS's dynamic projection of each segment: P = softmax(K W_P) over the
    segment's (real) positions `[l, rank]` per head, K_bar = P^T K and V_bar = P^T V."""
    s = einsum_f32("slhd,hdr->slhr", k, proj_w)
    p = masked_softmax_over(s, jnp.asarray(real)[:, :, None, None], axis=1)
    return einsum_f32("slhr,slhd->srhd", p, k), einsum_f32("slhr,slhd->srhd", p, v)


def _ls_arrays_check(proj_w, kv_heads: int, d_k: int) -> None:
    if proj_w is None:
        raise ValueError(
            "long_short_attention needs proj_w [kv_heads, d_k, rank] (the learned dynamic projection "
            "W_P): make it with registry.bind('long_short').init_arrays(...)"
        )
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


@causal_never_reads_non_finite_future()
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
        near = sliding_window_part(
            qg,
            pad_to(k_local, length),
            pad_to(v_local, length),
            pad_to(real, length, value=False),
            block=block,
            window=window - 1,
            causal=True,
            scale=sc,
        )
        kbar, vbar, segment, seg_real = _causal_compressed(k, v, real, proj_w, ln_proj_k, ln_proj_v, segment_size)
        earlier = (positions(length)[:, None] // segment_size > segment[None, :]) & seg_real[None, :]
        far = Part(logits(qg, kbar, sc), head_mask(earlier), lambda p: weighted_values(p, vbar, reads=earlier))
        return rows_to_output(attend_parts([near, far]), n, out_dtype(q, k, v))
    length = ceil_div(n, window) * window
    qg = group_heads(pad_to(q, length), k.shape[1])
    kb, vb, rb = (
        neighbour_blocks(to_blocks(pad_to(x, length), window), 1, 1)
        for x in (k_local, v_local, pad_to(real, length, value=False))
    )
    start = positions(length // window)[:, None] * window
    k_pos = start - window + positions(3 * window)[None, :]  # [blocks, 3w]
    half = window // 2
    near_mask = (k_pos >= start - half) & (k_pos < start + window + half) & rb  # [blocks, 3w]
    near_mask = jnp.broadcast_to(near_mask[:, None, :], (length // window, window, 3 * window))
    near = block_part(to_blocks(qg, window), kb, vb, near_mask, sc)
    assert proj_w is not None  # checked above; for the type checker
    kbar, vbar = dynamic_projection(k[None], v[None], real[None], proj_w)
    kbar, vbar = dual_layer_norm(kbar[0], ln_proj_k), dual_layer_norm(vbar[0], ln_proj_v)
    any_real = jnp.broadcast_to(jnp.any(real), (length, kbar.shape[0]))
    far = Part(logits(qg, kbar, sc), head_mask(any_real), lambda p: weighted_values(p, vbar, reads=any_real))
    return rows_to_output(attend_parts([near, far]), n, out_dtype(q, k, v))


def long_short_arrays(key: PRNGKeyArray, *, kv_heads: int, d_k: int, d_v: int, rank: int = 16) -> dict[str, Array]:
    """W_P `[kv_heads, d_k, rank]` (normal, 1/sqrt(d_k)) and the DualLN gains and biases
    (ones and zeros), all learned."""
    check_positive("rank", rank)

    def ln(d):
        return jnp.stack([jnp.ones((kv_heads, d)), jnp.zeros((kv_heads, d))])

    return {
        "proj_w": jax.random.normal(key, (kv_heads, d_k, rank)) / math.sqrt(d_k),
        "ln_local_k": ln(d_k),
        "ln_local_v": ln(d_v),
        "ln_proj_k": ln(d_k),
        "ln_proj_v": ln(d_v),
    }


def _long_short_step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
    """One causal token against every cached key: the window's last `window` keys and the
    projections of the segments before the token's own (recomputed from the cache)."""
    t = state.length
    state = cache_append(state, k, v)
    window, segment_size = hyper_parameters["window"], hyper_parameters["segment_size"]
    real = state.slot_pos >= 0
    qg = group_heads(q[None], k.shape[0])  # [1, h, g, d]
    sc = default_scale(q.shape[-1], None)
    k_local = dual_layer_norm(state.k, arrays.get("ln_local_k"))
    v_local = dual_layer_norm(state.v, arrays.get("ln_local_v"))
    near_mask = (real & (state.slot_pos > t - window))[None, :]
    near = Part(logits(qg, k_local, sc), head_mask(near_mask), lambda p: weighted_values(p, v_local, reads=near_mask))
    kbar, vbar, segment, seg_real = _causal_compressed(
        state.k, state.v, real, arrays["proj_w"], arrays.get("ln_proj_k"), arrays.get("ln_proj_v"), segment_size
    )
    earlier = ((t // segment_size > segment) & seg_real)[None, :]
    far = Part(logits(qg, kbar, sc), head_mask(earlier), lambda p: weighted_values(p, vbar, reads=earlier))
    out = attend_parts([near, far])
    return out.reshape(q.shape[0], v.shape[-1]).astype(q.dtype), state


register(
    "long_short",
    long_short_attention,
    family="fixed pattern + low rank",
    paper="Zhu et al. 2021 (Transformer-LS)",
    complexity="O(N (w + r))",
    exact=False,
    init_arrays=long_short_arrays,
    decoder=Decoder("cache", full_cache_init, _long_short_step),
    docs={
        "window": "short-term window w (segment length; keys behind when causal)",
        "segment_size": "causal: tokens per dynamically projected segment l",
        "rank": "projected keys r (per segment when causal)",
    },
    summary=(
        "Transformer-LS: segment-wise window + r keys from a dynamic projection softmax(K W_P)^T K, DualLN, "
        "one softmax; causal: recent window + per-segment projections of earlier segments"
    ),
    limits={"window": 1, "segment_size": 1, "rank": 1},
    scaled=(
        "window, segment_size and rank = min(default, N / 8): a window a quarter of the keys and fewer projected "
        "keys than keys (Zhu et al. 2021: window 128, rank 16 at 4,096)",
        lambda d, n: {k: fraction(n, 8, cap=d[k]) for k in ("window", "segment_size", "rank")},
    ),
)
