"""Low-rank and synthetic attention: Linformer (Wang et al., 2020) and Synthesizer
(Tay et al., 2021; seed 000 section 3.2.15)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jxformers.ops._common import check_mask_shape, check_qkv, default_scale, einsum_f32
from jxformers.ops.softmax import softmax_attention


def linformer_attention(
    q: Float[Array, "q_len heads d_k"],
    k: Float[Array, "kv_len kv_heads _d_k"],
    v: Float[Array, "_kv_len _kv_heads d_v"],
    *,
    e_proj: Float[Array, "proj_len max_len"],
    f_proj: Float[Array, "_proj_len _max_len"],
    kv_mask: Bool[Array, "_kv_len"] | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Linformer: keys and values projected along the length to `proj_len` rows,
    softmax(q (E K)^T / sqrt(d)) (F V).

    Arguments:
        q, k, v: as `softmax_attention`; `kv_len <= max_len`.
        e_proj, f_proj: `[proj_len, max_len]` length projections (learned parameters;
            shared across heads, the paper's "headwise sharing"). Sequences shorter than
            `max_len` use the first `kv_len` columns, so one model serves every length up
            to `max_len` (and proj_len may exceed kv_len).
        kv_mask: optional `[kv_len]`; padded keys and values are zeroed before the
            projection, so their content never reaches the output: a padded sequence
            gives the same output as the unpadded one.
        causal: not supported; the projection mixes every position into every row
            (a future token would leak into the past). True raises ValueError.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[q_len, heads, d_v]`.

    Time and memory O(N * proj_len * d).
    """
    if causal:
        raise ValueError(
            "linformer_attention cannot be causal: its length projection mixes future positions into "
            "every projected key; use linear_attention, performer_attention or local_attention"
        )
    check_qkv(q, k, v)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    if e_proj.shape != f_proj.shape:
        raise ValueError(f"e_proj and f_proj must have the same shape; got {e_proj.shape} and {f_proj.shape}")
    kv_len = k.shape[0]
    if e_proj.shape[1] < kv_len:
        raise ValueError(f"e_proj covers max_len={e_proj.shape[1]} positions but kv_len is {kv_len}")
    if kv_mask is not None:
        k = jnp.where(kv_mask[:, None, None], k, 0)
        v = jnp.where(kv_mask[:, None, None], v, 0)
    pk = einsum_f32("pn,nhd->phd", e_proj[:, :kv_len].astype(k.dtype), k)
    pv = einsum_f32("pn,nhd->phd", f_proj[:, :kv_len].astype(v.dtype), v)
    out = softmax_attention(q, pk.astype(k.dtype), pv.astype(v.dtype), scale=scale)
    if kv_mask is not None:  # every key padded: nothing to attend, as the other ops
        out = jnp.where(jnp.any(kv_mask), out, 0)
    return out


SYNTHESIZER_KINDS = ("dense", "random", "factorized_random")


def synthesizer_logits(
    q: Float[Array, "q_len heads d_k"],
    kv_len: int,
    *,
    kind: str,
    w1: Float[Array, "_heads _d_k _hidden"] | None = None,
    b1: Float[Array, "_heads _hidden"] | None = None,
    w2: Float[Array, "_heads _hidden _max_len"] | None = None,
    random: Float[Array, "_heads _max_len _max_len2"] | None = None,
    factor_a: Float[Array, "_heads _max_len _r"] | None = None,
    factor_b: Float[Array, "_heads _max_len2 _r"] | None = None,
) -> Float[Array, "heads q_len kv_len"]:
    """Synthetic attention logits B [heads, q_len, kv_len] (seed 000 section 3.2.15):

    * "dense": B_i = relu(x_i W1 + b1) W2 from each query token alone (here x_i = q_i per
      head), `w1 [heads, d_k, hidden]`, `b1 [heads, hidden]`, `w2 [heads, hidden, max_len]`;
    * "random": B = R, a `[heads, max_len, max_len]` matrix independent of the input
      (trainable or fixed: the caller decides what it differentiates);
    * "factorized_random": B = R1 R2^T with `factor_a [heads, max_len, r]`,
      `factor_b [heads, max_len, r]`.
    Lengths shorter than `max_len` take the leading rows/columns.
    """
    q_len, heads, _ = q.shape

    def need(name, value, shape_hint):
        if value is None:
            raise ValueError(f"synthesizer kind {kind!r} needs `{name}` {shape_hint}")
        return value

    if kind == "dense":
        w1, b1, w2 = need("w1", w1, "[heads, d_k, hidden]"), need("b1", b1, "[heads, hidden]"), need("w2", w2, "[heads, hidden, max_len]")
        if w2.shape[2] < kv_len or w1.shape[0] != heads:
            raise ValueError(f"w2 must cover kv_len={kv_len} columns and w1/w2 have {heads} heads; got w1 {w1.shape}, w2 {w2.shape}")
        hid = jnp.maximum(jnp.einsum("qhd,hde->hqe", q.astype(jnp.float32), w1.astype(jnp.float32)) + b1[:, None, :], 0)
        return jnp.einsum("hqe,hem->hqm", hid, w2[:, :, :kv_len].astype(jnp.float32))
    if kind == "random":
        r = need("random", random, "[heads, max_len, max_len]")
        if r.shape[0] != heads or r.shape[1] < q_len or r.shape[2] < kv_len:
            raise ValueError(f"random must have shape [{heads}, >= {q_len}, >= {kv_len}]; got {r.shape}")
        return r[:, :q_len, :kv_len].astype(jnp.float32)
    if kind == "factorized_random":
        a, b = need("factor_a", factor_a, "[heads, max_len, r]"), need("factor_b", factor_b, "[heads, max_len, r]")
        if a.shape[0] != heads or a.shape[1] < q_len or b.shape[1] < kv_len or a.shape[2] != b.shape[2]:
            raise ValueError(f"factor_a/factor_b must be [{heads}, >= len, r] with one r; got {a.shape}, {b.shape}")
        return jnp.einsum("hqr,hkr->hqk", a[:, :q_len].astype(jnp.float32), b[:, :kv_len].astype(jnp.float32))
    raise ValueError(f"kind must be one of {SYNTHESIZER_KINDS}; got {kind!r}")


def synthesizer_attention(
    q: Float[Array, "q_len heads d_k"],
    k: Float[Array, "kv_len kv_heads _d_k"],
    v: Float[Array, "_kv_len _kv_heads d_v"],
    *,
    kind: str = "random",
    dot_weight: float = 0.0,
    causal: bool = False,
    kv_mask: Bool[Array, "_kv_len"] | None = None,
    **weights: Array,
) -> Float[Array, "q_len heads d_v"]:
    """Synthesizer attention: softmax(B + dot_weight * q k^T / sqrt(d)) v, with the
    synthetic logits B of `synthesizer_logits` (`kind` and its `weights`).

    `dot_weight=0` is the pure Synthesizer (keys unused); a positive weight mixes it with
    dot-product attention (the paper's "Random + Vanilla" mixtures). Causal and padding
    masks apply to the synthetic logits as to any softmax attention.

    Time O(N^2) like softmax (the point is no query-key interaction, not speed); the
    factorized variant cuts parameters, not time.
    """
    check_qkv(q, k, v)
    if not isinstance(dot_weight, (int, float)) or dot_weight < 0:
        raise ValueError(f"dot_weight must be a float >= 0; got {dot_weight!r}")
    bias = synthesizer_logits(q, k.shape[0], kind=kind, **weights)
    scale = dot_weight * default_scale(q.shape[2], None)
    return softmax_attention(q, k, v, bias=bias, scale=scale, causal=causal, kv_mask=kv_mask)
