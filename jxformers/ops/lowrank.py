"""Low-rank attention (Tay et al. 2022, "Efficient Transformers: A Survey", arXiv
2009.06732v2, sections 3.2.12-3.2.15, "LR"): Linformer (Wang et al., 2020),
Synthesizer (Tay et al., 2021) and Nystromformer's landmarks (Xiong et al., 2021)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import group_heads
from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    default_scale,
    einsum_f32,
    logits,
    out_dtype,
    positions,
    softmax_parts,
    valid_keys,
    weighted_values,
    zero_padded,
)
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import TokenInputs, fraction, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "iterative_pinv",
    "linformer_attention",
    "nystrom_attention",
    "segment_means",
    "synthesizer_attention",
    "synthesizer_logits",
]


def linformer_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    e_proj: Float[ArrayLike, "proj_len max_len"],
    f_proj: Float[ArrayLike, "_proj_len _max_len"] | None = None,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Linformer: keys and values projected along the length to `proj_len` rows,
    softmax(q (E K)^T / sqrt(d)) (F V).

    Arguments:
        q, k, v: as `softmax_attention`; `kv_len <= max_len`.
        e_proj, f_proj: `[proj_len, max_len]` length projections of the keys and the
            values (learned parameters, shared across heads: the paper's "headwise
            sharing"); f_proj None projects the values by E too (the paper's "key-value
            sharing", E = F; its "layerwise sharing" is that with one E held by the
            model for every layer: `linformer_arrays`' `sharing`). Sequences shorter than
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
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    if causal:
        raise ValueError(
            "linformer_attention cannot be causal: its length projection mixes future positions into "
            "every projected key; use linear_attention, performer_attention or local_attention"
        )
    check_qkv(q, k, v)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    if f_proj is None:  # key-value sharing: F = E
        f_proj = e_proj
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


# Linformer's parameter sharing (Wang et al. 2020, section 4, "Additional Efficiency
# Techniques"): E and F per layer shared by its heads; E = F per layer; one E = F for every
# layer of the model.
LINFORMER_SHARINGS = ("headwise", "kv", "layerwise")


def linformer_arrays(
    key: PRNGKeyArray, *, proj_len: int = 256, max_len: int = 4096, sharing: str = "headwise"
) -> dict[str, Float[Array, "proj_len max_len"]]:
    """Linformer's learned length projections at nn.Linear(max_len, proj_len)'s scale (as
    the paper's code): E and F with `sharing` "headwise", E alone (F = E) with "kv" and
    "layerwise" (one of LINFORMER_SHARINGS). With "layerwise" a model holds the E of its
    first such layer once for all of them (`linformer_layer_shared`)."""
    check_positive("proj_len", proj_len)
    check_positive("max_len", max_len)
    if sharing not in LINFORMER_SHARINGS:
        raise ValueError(f"linformer sharing must be one of {LINFORMER_SHARINGS}; got {sharing!r}")
    ke, kf = jax.random.split(key)
    std = 1.0 / math.sqrt(max_len)
    arrays = {"e_proj": std * jax.random.normal(ke, (proj_len, max_len))}
    if sharing == "headwise":
        arrays["f_proj"] = std * jax.random.normal(kf, (proj_len, max_len))
    return arrays


def linformer_layer_shared(hyper_parameters: Mapping[str, Any]) -> tuple[str, ...]:
    """The arrays a model holds once for all its Linformer layers: E with layerwise sharing."""
    return ("e_proj",) if hyper_parameters["sharing"] == "layerwise" else ()


register(
    "linformer",
    linformer_attention,
    family="low rank",
    paper="Wang et al. 2020",
    complexity="O(N k)",
    supports_causal=False,
    supports_cross=True,
    exact=False,
    init_arrays=linformer_arrays,
    layer_shared=linformer_layer_shared,
    covers_length="max_len",
    docs={
        "proj_len": "projected length k",
        "max_len": "longest sequence the projections cover",
        "sharing": "headwise: E, F per layer; kv: E = F per layer; layerwise: one E = F for every layer",
    },
    choices={"sharing": LINFORMER_SHARINGS},
    summary="keys/values projected along the length by E, F",
    limits={"proj_len": 1, "max_len": 1},
    dense_width=("its projected length (proj_len)", lambda hp, n: hp["proj_len"]),
    scaled=(
        "proj_len = min(default, N / 4) (Wang et al. 2020: k = 256 for n of 512 to 4,096, k = n / 4 at 1,024); "
        "max_len is the model's",
        lambda d, n: {"proj_len": fraction(n, 4, cap=d["proj_len"])},
    ),
)


SYNTHESIZER_KINDS = ("dense", "factorized_dense", "random", "factorized_random")
_FROM_TOKENS = ("dense", "factorized_dense")  # kinds whose logits the module makes from X


def synthesizer_logits(
    q_len: int,
    kv_len: int,
    heads: int,
    *,
    kind: str,
    dense_logits: Float[ArrayLike, "_heads _q_len _max_len"] | None = None,
    random: Float[ArrayLike, "_heads _max_len _max_len2"] | None = None,
    fixed_random: Float[ArrayLike, "_heads _max_len _max_len2"] | None = None,
    factor_a: Float[ArrayLike, "_heads _max_len _r"] | None = None,
    factor_b: Float[ArrayLike, "_heads _max_len2 _r"] | None = None,
) -> Float[Array, "heads q_len kv_len"]:
    """Synthetic attention logits B [heads, q_len, kv_len] (Tay et al. 2021, section 3):

    * "dense" / "factorized_dense": `dense_logits [heads, q_len, max_len]`, row i made
      from the query token's layer input X_i alone (`synthesizer_dense_logits`, called
      by the attention module);
    * "random": B = R, a `[heads, max_len, max_len]` matrix independent of the input:
      `random` when trained, `fixed_random` when kept fixed (drawn once);
    * "factorized_random": B = R1 R2^T with `factor_a [heads, max_len, r]`,
      `factor_b [heads, max_len, r]`.
    Lengths shorter than `max_len` take the leading rows/columns.
    """

    def need(name, value, shape_hint):
        if value is None:
            raise ValueError(f"synthesizer kind {kind!r} needs `{name}` {shape_hint}")
        return value

    if kind in _FROM_TOKENS:
        b = need("dense_logits", dense_logits, "[heads, q_len, max_len] (from the layer input; use nn.Attention)")
        if b.shape[0] != heads or b.shape[1] != q_len or b.shape[2] < kv_len:
            raise ValueError(
                f"dense_logits must have shape [{heads}, {q_len}, >= {kv_len}] (max_len >= the sequence); got {b.shape}"
            )
        return b[:, :, :kv_len].astype(jnp.float32)
    if kind == "random":
        r = (
            random
            if random is not None
            else need("random", fixed_random, "(or `fixed_random`) [heads, max_len, max_len]")
        )
        if r.shape[0] != heads or r.shape[1] < q_len or r.shape[2] < kv_len:
            raise ValueError(
                f"random must have shape [{heads}, >= {q_len}, >= {kv_len}] (max_len >= the sequence); got {r.shape}"
            )
        return r[:, :q_len, :kv_len].astype(jnp.float32)
    if kind == "factorized_random":
        a, b = need("factor_a", factor_a, "[heads, max_len, r]"), need("factor_b", factor_b, "[heads, max_len, r]")
        if a.shape[0] != heads or a.shape[1] < q_len or b.shape[1] < kv_len or a.shape[2] != b.shape[2]:
            raise ValueError(
                f"factor_a/factor_b must be [{heads}, >= len, r] with one r (max_len >= the sequence); "
                f"got {a.shape}, {b.shape}"
            )
        return jnp.einsum("hqr,hkr->hqk", a[:, :q_len].astype(jnp.float32), b[:, :kv_len].astype(jnp.float32))
    raise ValueError(f"kind must be one of {SYNTHESIZER_KINDS}; got {kind!r}")


@causal_never_reads_non_finite_future()
def synthesizer_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    kind: str = "random",
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    mixture_logits: Float[ArrayLike, " 2"] | None = None,
    dense_logits: Float[ArrayLike, "_heads _q_len _max_len"] | None = None,
    random: Float[ArrayLike, "_heads _max_len _max_len2"] | None = None,
    fixed_random: Float[ArrayLike, "_heads _max_len _max_len2"] | None = None,
    factor_a: Float[ArrayLike, "_heads _max_len _r"] | None = None,
    factor_b: Float[ArrayLike, "_heads _max_len2 _r"] | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Synthesizer attention (Tay et al. 2021): softmax(B) v with the synthetic logits B
    of `synthesizer_logits` (`kind` and its arrays); q and k are unused.

    With `mixture_logits` (2 learned numbers) it is the paper's mixture of the synthetic
    and the dot-product attention, softmax(a_1 B + a_2 q k^T / sqrt(d)) v with
    (a_1, a_2) = softmax(mixture_logits): weights learned and summing to one (section
    3.3; "Random + Vanilla" with kind="random"). Causal and padding masks apply to the
    logits as to any softmax attention.

    Time O(N^2) like softmax (the point is no query-key interaction, not speed); the
    factorized kinds cut parameters, not time.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v)
    bias = synthesizer_logits(
        q.shape[0],
        k.shape[0],
        q.shape[1],
        kind=kind,
        dense_logits=dense_logits,
        random=random,
        fixed_random=fixed_random,
        factor_a=factor_a,
        factor_b=factor_b,
    )
    if mixture_logits is None:
        return softmax_attention(q, k, v, bias=bias, scale=0.0, causal=causal, kv_mask=kv_mask)
    if jnp.shape(mixture_logits) != (2,):
        raise ValueError(
            f"mixture_logits must have shape (2,) (synthetic, dot product); got {jnp.shape(mixture_logits)}"
        )
    weights = jax.nn.softmax(jnp.asarray(mixture_logits, jnp.float32))
    return softmax_attention(
        q * weights[1].astype(q.dtype), k, v, bias=weights[0] * bias, causal=causal, kv_mask=kv_mask
    )


def synthesizer_arrays(
    key: PRNGKeyArray,
    *,
    heads: int,
    kind: str = "random",
    max_len: int = 512,
    rank: int = 8,
    trainable_random: bool = True,
    mixture: bool = False,
) -> dict[str, Array]:
    """The random kinds' matrices (`random` trained, or `fixed_random` drawn once when
    not `trainable_random`) and, with `mixture`, the mixture's logits (equal weights)."""
    for name, value in (("max_len", max_len), ("rank", rank)):
        check_positive(name, value)
    k1, k2 = jax.random.split(key)
    arrays = {}
    if kind == "random":
        arrays["random" if trainable_random else "fixed_random"] = jax.random.normal(k1, (heads, max_len, max_len))
    elif kind == "factorized_random":
        arrays["factor_a"] = jax.random.normal(k1, (heads, max_len, rank)) / rank**0.25
        arrays["factor_b"] = jax.random.normal(k2, (heads, max_len, rank)) / rank**0.25
    if mixture:
        arrays["mixture_logits"] = jnp.zeros((2,))
    return arrays


def synthesizer_dense_params(
    key: PRNGKeyArray,
    *,
    d_model: int,
    heads: int,
    kind: str = "random",
    max_len: int = 512,
    hidden: int | None = None,
    factor: int = 8,
) -> dict[str, Array]:
    """The dense kinds' per-head layers on the token X_i (`d_model` wide).

    "dense": F(X_i) = W2 relu(W1 X_i + b1) + b2 with W1 `[heads, d_model, hidden]`
    (hidden defaults to d_model, the paper's d x d) and W2 `[heads, hidden, max_len]`.
    "factorized_dense": A = W_a X_i + b_a `[factor]` and B = W_b X_i + b_b
    `[ceil(max_len / factor)]`; row i is A tiled times B repeated (C[p] = A[p mod a] *
    B[p div a]), cut to max_len.
    """
    if kind not in _FROM_TOKENS:
        return {}
    hidden = d_model if hidden is None else hidden
    for name, value in (("hidden", hidden), ("max_len", max_len), ("factor", factor)):
        check_positive(name, value)
    if kind == "dense":
        shapes = {"w1": (d_model, hidden), "w2": (hidden, max_len)}
    else:
        shapes = {"wa": (d_model, factor), "wb": (d_model, ceil_div(max_len, factor))}
    params = {}
    for (name, (fan_in, fan_out)), k in zip(shapes.items(), jax.random.split(key, len(shapes)), strict=True):
        params[name] = jax.random.normal(k, (heads, fan_in, fan_out)) / math.sqrt(fan_in)
        params[name.replace("w", "b")] = jnp.zeros((heads, fan_out))
    return params


def synthesizer_dense_logits(
    params: dict[str, Array],
    queries: Float[Array, "q_len d_model"],
    keys: Float[Array, "kv_len d_model"] | None,
    hyper_parameters: dict,
) -> dict[str, Float[Array, "heads q_len max_len"]]:
    """The dense kinds' logits from each query token's layer input X_i alone."""
    if not params:
        return {}
    x = queries.astype(jnp.float32)

    def layer(w, b, h):  # h [q, d_in] (shared) or [heads, q, d_in] -> [heads, q, d_out]
        spec = "qd,hde->hqe" if h.ndim == 2 else "hqd,hde->hqe"
        return jnp.einsum(spec, h, params[w].astype(jnp.float32)) + params[b][:, None, :]

    if "w1" in params:
        return {"dense_logits": layer("w2", "b2", jax.nn.relu(layer("w1", "b1", x)))}
    a, b = layer("wa", "ba", x), layer("wb", "bb", x)
    c = jnp.tile(a, (1, 1, b.shape[-1])) * jnp.repeat(b, a.shape[-1], axis=-1)
    return {"dense_logits": c[:, :, : hyper_parameters["max_len"]]}


register(
    "synthesizer",
    synthesizer_attention,
    family="low rank",
    paper="Tay et al. 2021",
    complexity="O(N^2)",
    supports_cross=True,
    exact=False,
    content_based=False,
    init_arrays=synthesizer_arrays,
    token_inputs=TokenInputs(synthesizer_dense_params, synthesizer_dense_logits),
    drawn=("fixed_random",),
    redrawn=False,
    covers_length="max_len",
    choices={"kind": SYNTHESIZER_KINDS},
    docs={
        "kind": "synthetic logits",
        "max_len": "longest sequence",
        "rank": "factorized_random: rank",
        "trainable_random": "random: train R (else fixed)",
        "mixture": "learned softmax-normalised mixture with dot-product attention",
        "hidden": "dense: hidden width (default d_model)",
        "factor": "factorized_dense: a (b = max_len / a)",
    },
    summary=(
        "dense (from X), factorized dense, random (trained or fixed), factorized random; optional learned "
        "mixture with q k^T"
    ),
    limits={"max_len": 1, "rank": 1, "hidden": 1, "factor": 1},
)


# ----------------------------------------------------------------------------- Nystromformer


def segment_means(
    x: Float[ArrayLike, "n heads d"], num_segments: int, real: Bool[ArrayLike, " n"] | None = None
) -> tuple[Float[Array, "num_segments heads d"], Bool[Array, " num_segments"]]:
    """Means of `num_segments` contiguous segments of near-equal size (segment s covers
    positions [floor(s n / m), floor((s + 1) n / m))), over real positions only; works for
    any n >= 1 (segments may be empty when m > n; those are marked not real)."""
    n = x.shape[0]
    real = jnp.ones((n,), bool) if real is None else real
    bounds = (positions(num_segments + 1) * n) // num_segments
    seg = jnp.sum(bounds[None, 1:-1] <= positions(n)[:, None], axis=1)  # segment of each position
    weights = (seg[None, :] == positions(num_segments)[:, None]) & real[None, :]  # [m, n]
    count = weights.sum(axis=1)
    sums = jnp.einsum("mn,nhd->mhd", weights.astype(jnp.float32), x.astype(jnp.float32))
    means = sums / jnp.maximum(count, 1)[:, None, None]
    return means.astype(x.dtype), count > 0


def iterative_pinv(a: Float[ArrayLike, "*b m m"], iterations: int = 6) -> Float[Array, "*b m m"]:
    """Moore-Penrose pseudo-inverse by the iteration of Razavi et al. (2014) used by
    Nystromformer: Z <- Z/4 (13 I - A Z (15 I - A Z (7 I - A Z))), from
    Z0 = A^T / (max row sum * max column sum) (A is row-stochastic here)."""
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    abs_a = jnp.abs(a)
    norm = jnp.max(abs_a.sum(-1), axis=-1) * jnp.max(abs_a.sum(-2), axis=-1)
    z = jnp.swapaxes(a, -1, -2) / norm[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    num_landmarks: int = 64,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    pinv_iterations: int = 6,
    conv_weight: Float[ArrayLike, "conv_kernel_size kv_heads"] | None = None,
    scale: float | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Nystromformer attention: softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V,
    with landmarks Q~, K~ the means of `num_landmarks` contiguous segments, plus the
    authors' skip connection: a depthwise convolution of V along the sequence.

    Arguments:
        q, k, v: as `softmax_attention` (cross attention allowed).
        num_landmarks: m >= 1; any length works (segments of near-equal size).
        kv_mask: optional `[kv_len]`; key landmarks average real keys only, and
            softmax(Q~ K^T) never sees a padded key. (Query landmarks of self-attention
            pass the same mask when q_len == kv_len.)
        pinv_iterations: iterations of `iterative_pinv` (6 in the paper).
        conv_weight: optional `[K, kv_heads]` (K odd), the skip connection of the
            authors' code (mlpen/Nystromformer, `conv_kernel_size`): each head's values
            convolved along the sequence by its own K-tap filter, the same for every
            feature, zero-padded K // 2 each side (a depthwise `Conv2d` with kernel
            (K, 1), no bias), added to the output; padded values are zeros there too.
            Self-attention only (q_len == kv_len). None: no skip connection.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[q_len, heads, d_v]`. With m equal to the length (one token per segment), a
        converged pseudo-inverse and no `conv_weight` this is exactly softmax attention.

    Time and memory O(N * m * d + m^3). Not causal.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v)
    check_positive("num_landmarks", num_landmarks)
    check_positive("pinv_iterations", pinv_iterations, minimum=0)
    kv_len = k.shape[0]
    check_mask_shape("kv_mask", kv_mask, (kv_len,))
    if conv_weight is not None and q.shape[0] != kv_len:
        raise ValueError(
            f"nystrom's convolution skip adds each position's convolved values to its own output: self-attention "
            f"only (q_len == kv_len); got q_len {q.shape[0]}, kv_len {kv_len}: use conv_kernel_size=0 for "
            "cross-attention"
        )
    if conv_weight is not None and (conv_weight.shape[0] % 2 == 0 or conv_weight.shape[1] != k.shape[1]):
        raise ValueError(f"conv_weight must be [odd K, kv_heads {k.shape[1]}]; got {list(conv_weight.shape)}")
    scale = default_scale(q.shape[2], scale)
    real = valid_keys(kv_mask, kv_len, kv_len)
    q_real = real if q.shape[0] == kv_len else None
    kv_heads = k.shape[1]
    q_land, q_land_ok = segment_means(q, num_landmarks, q_real)
    k_land, k_land_ok = segment_means(k, num_landmarks, real)

    def probs(qx, kx, key_ok):
        s = logits(group_heads(qx, kv_heads), kx, scale)  # [h, g, q, k]
        (p,) = softmax_parts([(s, key_ok[None, None, None, :])])
        return p

    k1 = probs(q, k_land, k_land_ok)  # [h, g, N, m]
    k2 = probs(q_land, k_land, k_land_ok)  # [h, g, m, m]
    k3 = probs(q_land, k, real)  # [h, g, m, N]
    k3 = jnp.where(q_land_ok[None, None, :, None], k3, 0.0)
    k2 = jnp.where(q_land_ok[None, None, :, None], k2, 0.0)
    k3v = weighted_values(k3, v)  # [m, h, g, dv]
    k3v = jnp.moveaxis(k3v, 0, 2)  # [h, g, m, dv]
    out = k1 @ (iterative_pinv(k2, pinv_iterations) @ k3v)  # [h, g, N, dv]
    out = jnp.moveaxis(out, 2, 0).reshape(q.shape[0], q.shape[1], v.shape[2])
    if kv_mask is not None:
        out = jnp.where(jnp.any(kv_mask), out, 0.0)
    if conv_weight is not None:
        out = out + jnp.repeat(_value_convolution(v, conv_weight), q.shape[1] // kv_heads, axis=1)
    return out.astype(out_dtype(q, k, v))


def _value_convolution(
    v: Float[ArrayLike, "n kv_heads d_v"], weight: Float[ArrayLike, "taps kv_heads"]
) -> Float[Array, "n kv_heads d_v"]:
    """Nystromformer's skip connection: `out[i, h] = sum_t weight[t, h] v[i + t - K // 2, h]`
    (zeros outside the sequence), in float32."""
    taps, n = weight.shape[0], v.shape[0]
    padded = jnp.pad(v.astype(jnp.float32), ((taps // 2, taps // 2), (0, 0), (0, 0)))
    w = weight.astype(jnp.float32)
    out = jnp.zeros(padded[:n].shape, jnp.float32)
    for t in range(taps):
        out = out + w[None, t, :, None] * padded[t : t + n]
    return out


def nystrom_arrays(key: PRNGKeyArray, *, kv_heads: int, conv_kernel_size: int = 35) -> dict[str, Array]:
    """The learned filters of the convolution skip, `conv_weight` `[K, kv_heads]`, drawn
    as PyTorch's Conv2d does (U(+-1/sqrt(K)): a depthwise filter's fan-in is K); none
    when K is 0. K = 35: the authors' LRA configurations (every "nystrom-m" entry)."""
    check_positive("conv_kernel_size", conv_kernel_size, minimum=0)
    if conv_kernel_size == 0:
        return {}
    if conv_kernel_size % 2 == 0:
        raise ValueError(f"conv_kernel_size must be odd (a centred filter) or 0 (no skip); got {conv_kernel_size}")
    bound = 1.0 / math.sqrt(conv_kernel_size)
    return {"conv_weight": jax.random.uniform(key, (conv_kernel_size, kv_heads), minval=-bound, maxval=bound)}


def _nystrom_scaled(defaults, max_len: int) -> dict[str, int]:
    """Nystromformer's settings at max_len N (its registration's `scaled`): landmarks
    min(default, N / 8), and a convolution skip on V of min(default, N / 4) taps, odd
    (0 stays 0: no skip), so that it mixes a neighbourhood, not the whole sequence."""
    taps = min(defaults["conv_kernel_size"], max(1, max_len // 4))
    return {
        "num_landmarks": fraction(max_len, 8, cap=defaults["num_landmarks"]),
        "conv_kernel_size": taps - (1 - taps % 2) if taps else 0,
    }


register(
    "nystrom",
    nystrom_attention,
    family="low rank",
    paper="Xiong et al. 2021",
    complexity="O(N m + m^3)",
    supports_cross=True,
    exact=False,
    init_arrays=nystrom_arrays,
    docs={
        "num_landmarks": "landmarks m",
        "pinv_iterations": "pseudo-inverse iterations",
        "conv_kernel_size": "taps of the depthwise convolution skip on V (odd; 0: none, and for cross-attention)",
    },
    summary="Nystrom landmarks (segment means), an iterative pseudo-inverse and a convolution skip on V",
    limits={"num_landmarks": 1, "pinv_iterations": 0, "conv_kernel_size": 0},
    dense_width=("its landmarks (num_landmarks)", lambda hp, n: hp["num_landmarks"]),
    scaled=(
        "num_landmarks = min(default, N / 8) (Xiong et al. 2021: 64 at 512 to 4,096); conv_kernel_size = min(default, "
        "the odd number at most N / 4), so that the skip on V stays local",
        _nystrom_scaled,
    ),
)
