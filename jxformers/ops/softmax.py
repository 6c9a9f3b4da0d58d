"""Exact softmax attention: the dense reference and the memory-efficient chunked form.

`softmax_attention` is the reference every other op in the zoo is tested against.
`chunked_attention` computes the same function with O(N * chunk) memory by an online
softmax over key chunks inside query chunks (Rabe & Staats, "Self-attention does not
need O(n^2) memory", 2021), rematerialising each chunk in the backward pass.

Both take the score options (`jxformers.ops._scores`): logit soft-capping (Gemma 2) and
attention sinks (a zero key or a learned logit per head); the dense form also takes
Explicit Sparse Transformer's top-k and talking heads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jxformers._arrays import group_heads
from jxformers._typing import ArrayLike
from jxformers.decoding import kv_cache
from jxformers.kernels import IMPLS, choose_kernel
from jxformers.kernels import pattern as kp
from jxformers.kernels.alibi import Alibi, check_alibi
from jxformers.kernels.cudnn import cudnn_attention, cudnn_unsupported
from jxformers.kernels.flash import pattern_attention
from jxformers.kernels.scores import SINKS, capped
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_mask_shape,
    check_positive,
    check_qkv,
    default_scale,
    head_mask,
    logits,
    out_dtype,
    pad_to,
    positions,
    softmax_parts,
    to_blocks,
    valid_keys,
    weighted_values,
    zero_padded,
)
from jxformers.ops._priors import (
    PRIOR_DOCS,
    PRIOR_LIMITS,
    PRIOR_OPTIONS,
    SPAN_LOSS_WEIGHT,
    Priors,
    check_priors,
    default_positions,
    gather_priors,
    init_prior_arrays,
    localness_centres,
    prior_terms,
    reach,
)
from jxformers.ops._scores import (
    SCORE_OPTION_DOCS,
    SCORE_OPTION_LIMITS,
    SCORE_OPTIONS,
    check_score_options,
    init_score_arrays,
    mix_heads,
    prepend_persistent,
    sink_part,
    top_k_mask,
)
from jxformers.registry import fraction, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "causal_mask",
    "chunked_attention",
    "softmax_attention",
    "softmax_weights",
]


# The score options the flash kernels compute in their tiles (`jxformers.kernels.scores`).
KERNEL_SCORE_OPTIONS = ("softcap", "sinks")


def causal_mask(q_len: int, kv_len: int) -> Bool[Array, "q_len kv_len"]:
    """Causal mask aligned bottom-right: query i sits at position i + kv_len - q_len, so
    with q_len < kv_len the queries are the *last* q_len positions (the decoding case)."""
    offset = kv_len - q_len
    return positions(q_len)[:, None] + offset >= positions(kv_len)[None, :]


def softmax_pattern(q_len: int, kv_len: int, *, causal: bool) -> kp.Pattern:
    """Softmax attention's pattern for the block-sparse kernel: every key, or the
    bottom-right causal band."""
    return kp.causal(q_len, kv_len) if causal else kp.DENSE


@causal_never_reads_non_finite_future()
def softmax_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    mask: Bool[ArrayLike, "_q_len _kv_len"] | None = None,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    bias: Float[ArrayLike, "_q_len _kv_len"] | Float[ArrayLike, "_heads _q_len _kv_len"] | Alibi | None = None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    top_k: int | None = None,
    sinks: str = "none",
    sink_logits: Float[ArrayLike, " heads"] | None = None,
    talking_heads: bool = False,
    talking_logits: Float[ArrayLike, "heads heads"] | None = None,
    talking_weights: Float[ArrayLike, "heads heads"] | None = None,
    persistent_kv: int = 0,
    persistent_k: Float[ArrayLike, "m kv_heads d_k"] | None = None,
    persistent_v: Float[ArrayLike, "m kv_heads d_v"] | None = None,
    localness: bool = False,
    localness_w: Float[ArrayLike, "d_k d_k"] | None = None,
    localness_up: Float[ArrayLike, " d_k"] | None = None,
    localness_ud: Float[ArrayLike, " d_k"] | None = None,
    gaussian_prior: bool = False,
    gaussian_w: Float[Array, ""] | None = None,
    gaussian_b: Float[Array, ""] | None = None,
    adaptive_span: int | None = None,
    span_ramp: int = 32,
    span_z: Float[ArrayLike, " heads"] | None = None,
    span_loss_weight: float = SPAN_LOSS_WEIGHT,
    head_windows: tuple[int, ...] | None = None,
    query_positions: Int[ArrayLike, " _q_len"] | None = None,
    key_positions: Int[ArrayLike, " _kv_len"] | None = None,
    relative_values: Float[ArrayLike, "labels d_v"] | None = None,
    impl: str = "auto",
) -> Float[Array, "q_len heads d_v"]:
    """Dense scaled dot-product attention (Vaswani et al., 2017), the reference op.

    Arguments:
        q: queries `[q_len, heads, d_k]`.
        k: keys `[kv_len, kv_heads, d_k]`; `heads` must be a multiple of `kv_heads`
            (grouped-query attention).
        v: values `[kv_len, kv_heads, d_v]`.
        mask: optional `[q_len, kv_len]`, True where query i may attend key j.
        kv_mask: optional `[kv_len]`, True for real keys, False for padding.
        bias: optional additive logits bias, `[q_len, kv_len]` or `[heads, q_len, kv_len]`,
            or an `Alibi` (`jxformers.kernels.alibi`: slopes and offset, which the
            flash kernel computes on each tile instead of reading an N x N array).
        causal: if True, query i attends keys j <= i + kv_len - q_len (bottom-right).
        scale: logits multiplier; default `1 / sqrt(d_k)`.
        softcap: c: the logits (scaled, bias added) become c * tanh(s / c) (Gemma 2).
        top_k: each query keeps its k highest logits among the keys it may attend, the
            rest masked (Zhao et al. 2019, Explicit Sparse Transformer; ties at the k-th
            value are all kept).
        sinks: "none"; "zero": a key of logit 0 and value 0 joins every softmax (the "+1"
            in the denominator); "learned": a logit per head, `sink_logits [heads]`
            (gpt-oss). The sink takes probability and gives nothing back.
        talking_heads: mix the heads' logits by `talking_logits [heads, heads]` before
            the softmax (after the cap, before masks and top-k) and their weights by
            `talking_weights [heads, heads]` after it (Shazeer et al. 2020).
        persistent_kv: m > 0 joins sqrt(d_k) `persistent_k [m, kv_heads, d_k]` and sqrt(m)
            `persistent_v [m, kv_heads, d_v]` in front of the keys and values, attended by
            every query (unmasked, unbiased; Sukhbaatar et al. 2019's persistent memory,
            parametrised as their code).
        localness, gaussian_prior, adaptive_span, span_ramp, head_windows (and their
            arrays): the attention priors of `jxformers.ops._priors` (Yang et al. 2018's
            predicted local window, Guo et al. 2019's Gaussian, Sukhbaatar et al. 2019's
            adaptive span, Guo et al. 2020's per-head windows). `span_loss_weight` is
            read by the module around the op (`nn.Attention` adds the span loss).
        query_positions, key_positions: the positions the priors and `relative_values`
            measure distance by (default: bottom-right aligned indices; the kv-cache
            decoder passes the step's and the slots').
        relative_values: Shaw et al. 2018's value term ("Self-Attention with Relative
            Position Representations", eq. 3): a^V `[2k + 1, d_v]`, one vector per
            clipped distance clip(j - i, -k, k) (label distance + k), shared by the heads;
            query i's output becomes sum_j p_ij (v_j + a^V_{clip(j - i)}). Each row's
            probability mass per label (a segment sum of p, O(q_len * kv_len) per head as
            p itself) times a^V, so no `[q_len, kv_len, d_v]` array is formed. The logit
            side, q_i . a^K_ij, arrives as `bias` (`jxformers.nn.relative`).
        impl: one of `jxformers.kernels.IMPLS` (`jxformers.kernels.impl`):
            the flash-attention kernel (O(N) memory) takes calls without `mask`, with no
            bias or an `Alibi` one, and of the score options only `softcap` and `sinks`
            (`KERNEL_SCORE_OPTIONS`; "auto" keeps XLA for those until they have run on a
            GPU); cuDNN bf16/fp16 calls without any mask, bias or score option.

    Returns:
        `[q_len, heads, d_v]`. A query with every key masked returns zeros.

    Time O(q_len * kv_len * d), memory O(q_len * kv_len) (O(N) with the kernel).
    Causal, cross attention and decoding (q_len = 1 against a cache) are supported.
    Softmax runs in float32.
    """
    arguments = locals()
    return _softmax(gather_priors(arguments), weights=False, **_dense_arguments(arguments))


def softmax_weights(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    **options: Any,
) -> Float[Array, "q_len heads kv_len"]:
    """Each head's attention matrix A of `softmax_attention(q, k, v, **options)` (its
    score options, priors, masks and bias included): the probabilities its reference path
    multiplies v by, in float32, on the `kv_len` keys given (persistent keys' columns
    left out). `v` is read for its shape alone. Time and memory O(q_len * kv_len * d)
    per head, as the attention itself (no kernel: the matrix is the output)."""
    arguments = options | {"q": q, "k": k, "v": v, "impl": "xla"}
    return _softmax(gather_priors(arguments), weights=True, **_dense_arguments(arguments))


def _dense_arguments(arguments: dict[str, Any]) -> dict[str, Any]:
    """The dense op's arguments other than the priors' (`gather_priors` takes those)."""
    return {n: x for n, x in arguments.items() if n not in Priors._fields and n != "span_loss_weight"}


def _softmax(
    priors: Priors,
    *,
    weights: bool,
    q,
    k,
    v,
    mask=None,
    kv_mask=None,
    bias=None,
    causal: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    top_k: int | None = None,
    sinks: str = "none",
    sink_logits=None,
    talking_heads: bool = False,
    talking_logits=None,
    talking_weights=None,
    persistent_kv: int = 0,
    persistent_k=None,
    persistent_v=None,
    query_positions=None,
    key_positions=None,
    relative_values=None,
    impl: str = "auto",
):
    """`softmax_attention` with its priors gathered once (`priors`): its output, or with
    `weights` the probabilities `[q_len, heads, kv_len]` of its reference path."""
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v)
    q_len, heads, d_k = q.shape
    kv_len = k.shape[0]
    check_mask_shape("mask", mask, (q_len, kv_len))
    check_mask_shape("kv_mask", kv_mask, (kv_len,))
    options = check_score_options(
        heads,
        softcap=softcap,
        top_k=top_k,
        sinks=sinks,
        sink_logits=sink_logits,
        talking_heads=talking_heads,
        talking_logits=talking_logits,
        talking_weights=talking_weights,
        persistent_kv=persistent_kv,
        persistent_k=persistent_k,
        persistent_v=persistent_v,
        kv_heads=k.shape[1],
    )
    prior_names = check_priors(heads, d_k, priors)
    options = options + prior_names
    if relative_values is not None:
        _check_relative_values(relative_values, v.shape[2])
        options = [*options, "relative_values"]
    prior = None
    if prior_names:  # measured on the keys before any persistent ones join them
        q_pos, k_pos = default_positions(q_len, kv_len)
        q_pos = q_pos if query_positions is None else jnp.asarray(query_positions)
        k_pos = k_pos if key_positions is None else jnp.asarray(key_positions)
        visible = _allowed(q_len, kv_len, mask, kv_mask, causal).sum(-1)
        prior = prior_terms(group_heads(q, k.shape[1]), q_pos, k_pos, visible, causal=causal, p=priors)
    if persistent_kv:
        if isinstance(bias, Alibi):
            check_alibi(bias, heads)
            bias = bias.dense(q_len, kv_len)
        k, v, kv_mask, mask, bias = prepend_persistent(
            persistent_k, persistent_v, k, v, kv_mask=kv_mask, mask=mask, bias=bias
        )
        kv_len = k.shape[0]
        if prior is not None:  # the persistent keys: unbiased, unmasked
            prior = _persistent_free(prior, persistent_kv)
    alibi = bias if isinstance(bias, Alibi) else None
    if alibi is not None:
        check_alibi(alibi, heads)
    unsupported = None
    if mask is not None or (bias is not None and alibi is None):
        unsupported = "a dense mask or a dense bias (use kv_mask, causal and an Alibi bias)"
    beyond = [name for name in options if name not in KERNEL_SCORE_OPTIONS]
    if beyond:
        unsupported = f"score options {beyond} (the kernels compute softmax with {list(KERNEL_SCORE_OPTIONS)} only)"
    cudnn = (
        unsupported
        or (f"score options {options}" if options else None)
        or cudnn_unsupported(q, k, v, causal=causal, kv_mask=kv_mask, mask=mask, bias=bias)
        or True
    )
    choice = choose_kernel(impl, unsupported=unsupported, what="softmax attention", q_len=q_len, cudnn=cudnn)
    if impl == "auto" and options:
        # The kernels' soft-cap and sinks have not run on a GPU yet: "auto" keeps the XLA
        # op for them until they are checked there (explicit impl="pallas" runs them).
        choice = None
    if choice is not None and choice.backend == "cudnn":
        return cudnn_attention(q, k, v, causal=causal, scale=scale)
    if choice is not None:
        return pattern_attention(
            q,
            k,
            v,
            softmax_pattern(q_len, kv_len, causal=causal),
            choice,
            kv_mask=kv_mask,
            scale=scale,
            alibi=alibi,
            softcap=softcap,
            sinks=sinks,
            sink_logits=sink_logits,
        ).astype(out_dtype(q, k, v))
    if alibi is not None:
        bias = alibi.dense(q_len, kv_len)
    if bias is not None and tuple(bias.shape) not in {(q_len, kv_len), (heads, q_len, kv_len)}:
        raise ValueError(f"bias must have shape {(q_len, kv_len)} or {(heads, q_len, kv_len)}; got {tuple(bias.shape)}")
    scale = default_scale(d_k, scale)

    full = _allowed(q_len, kv_len, mask, kv_mask, causal)
    kv_heads = k.shape[1]
    qg = group_heads(q, kv_heads)
    s = logits(qg, k, scale)  # [h, g, q, k]
    if bias is not None:
        b = bias.astype(jnp.float32)
        b = b.reshape(1, 1, q_len, kv_len) if b.ndim == 2 else b.reshape(kv_heads, heads // kv_heads, q_len, kv_len)
        s = s + b
    if prior is not None and prior.bias is not None:
        s = s + prior.bias
    if talking_heads:  # Shazeer et al.: L = J P_l before the softmax
        s = mix_heads(s, talking_logits)
    s = capped(s, softcap)
    allowed = head_mask(full)
    if prior is not None:  # adaptive span's m multiplies exp(s): log m joins after the cap
        if prior.log_mask is not None:
            s = s + prior.log_mask
        if prior.allowed is not None:
            allowed = allowed & prior.allowed
    if top_k is not None:
        allowed = allowed & top_k_mask(s, allowed, top_k)
    p = softmax_parts([(s, allowed), *sink_part(sinks, sink_logits, s.shape)])[0]
    if talking_heads:  # ... and U = W P_w after it; masked weights are 0 in every head
        p = mix_heads(p, talking_weights)
    if weights:  # [q, heads, kv] on the sequence's own keys (persistent ones in front)
        return jnp.moveaxis(p.reshape(heads, q_len, kv_len), 1, 0)[:, :, persistent_kv:]
    # A pattern beyond padding (handled by zero_padded) leaves structural zeros in p.
    sparse = mask is not None or causal or top_k is not None or (prior is not None and prior.allowed is not None)
    out = weighted_values(p, v, reads=allowed if sparse else None)
    if relative_values is not None:  # on the sequence's own keys (persistent ones have no position)
        q_pos, k_pos = default_positions(q_len, kv_len - persistent_kv)
        q_pos = q_pos if query_positions is None else jnp.asarray(query_positions)
        k_pos = k_pos if key_positions is None else jnp.asarray(key_positions)
        out = out + relative_value_term(p[..., persistent_kv:], relative_values, q_pos, k_pos)
    return out.reshape(q_len, heads, v.shape[2]).astype(out_dtype(q, k, v))


def _check_relative_values(table, d_v: int) -> None:
    shape = tuple(jnp.shape(table))
    if len(shape) != 2 or shape[0] % 2 != 1 or shape[1] != d_v:
        raise ValueError(
            f"relative_values is a^V [2k + 1, d_v] (an odd number of clipped distances -k..k, d_v = {d_v}); "
            f"got shape {shape}"
        )


def relative_value_term(
    p: Float[ArrayLike, "h g q k"],
    table: Float[ArrayLike, "labels d_v"],
    q_pos: Int[ArrayLike, " q"],
    k_pos: Int[ArrayLike, " k"],
) -> Float[Array, "q h g d_v"]:
    """Shaw et al. 2018 eq. 3's sum_j p_ij a^V_{clip(j - i, -k, k)}: the probability mass
    each query row puts on each label (distance + k, 2k + 1 labels), a segment sum over
    the keys, times the label's vector. Memory O(h q k) for the labels' scatter, as p."""
    h, g, q_len, kv_len = p.shape
    labels, k = table.shape[0], table.shape[0] // 2
    label = jnp.clip(jnp.asarray(k_pos)[None, :] - jnp.asarray(q_pos)[:, None], -k, k) + k  # [q, k]
    segment = (jnp.arange(q_len)[:, None] * labels + label).reshape(-1)  # one segment per (row, label)
    flat = jnp.moveaxis(p.astype(jnp.float32).reshape(h * g, q_len * kv_len), 0, 1)
    mass = jax.ops.segment_sum(flat, segment, num_segments=q_len * labels)  # [q * labels, h g]
    mass = mass.reshape(q_len, labels, h, g)
    return jnp.einsum("qrhg,rd->qhgd", mass, jnp.asarray(table).astype(jnp.float32))


def _allowed(q_len: int, kv_len: int, mask, kv_mask, causal: bool) -> Bool[Array, "q_len kv_len"]:
    """Where query i may attend key j: `mask`, `kv_mask` and the causal band together."""
    full = jnp.ones((q_len, kv_len), bool)
    if mask is not None:
        full = full & mask
    if kv_mask is not None:
        full = full & kv_mask[None, :]
    if causal:
        full = full & causal_mask(q_len, kv_len)
    return full


def _persistent_free(prior, m: int):
    """The prior's terms with m persistent keys in front: no bias, no mask there."""

    def pad(x, value):
        return None if x is None else jnp.pad(x, [(0, 0)] * 3 + [(m, 0)], constant_values=value)

    return prior._replace(
        bias=pad(prior.bias, 0.0), log_mask=pad(prior.log_mask, 0.0), allowed=pad(prior.allowed, True)
    )


def _softmax_arrays(
    key,
    *,
    heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    sinks: str = "none",
    talking_heads: bool = False,
    persistent_kv: int = 0,
    localness: bool = False,
    gaussian_prior: bool = False,
    adaptive_span: int | None = None,
):
    """The dense op's option arrays: the score options' and the priors'."""
    ks, kp = jax.random.split(key)
    score = init_score_arrays(
        ks,
        heads=heads,
        kv_heads=kv_heads,
        d_k=d_k,
        d_v=d_v,
        sinks=sinks,
        talking_heads=talking_heads,
        persistent_kv=persistent_kv,
    )
    prior = init_prior_arrays(
        kp, heads=heads, d_k=d_k, localness=localness, gaussian_prior=gaussian_prior, adaptive_span=adaptive_span
    )
    return score | prior


register(
    "softmax",
    softmax_attention,
    family="exact",
    paper="Vaswani et al. 2017",
    complexity="O(N^2)",
    supports_cross=True,
    decoder=kv_cache(softmax_attention, forward=(*SCORE_OPTIONS, *PRIOR_OPTIONS, "relative_values"), positions=True),
    init_arrays=_softmax_arrays,
    choices={"impl": IMPLS, "sinks": SINKS},
    docs={
        "impl": "one of jxformers.kernels.IMPLS (flash-attention kernel or cuDNN)",
        **SCORE_OPTION_DOCS,
        **PRIOR_DOCS,
    },
    limits={**{n: SCORE_OPTION_LIMITS[n] for n in ("softcap", "top_k", "persistent_kv")}, **PRIOR_LIMITS},
    summary="`mask`, `kv_mask`, `bias`, causal (bottom-right) — the reference",
)


@causal_never_reads_non_finite_future()
def chunked_attention(
    q: Float[ArrayLike, "q_len heads d_k"],
    k: Float[ArrayLike, "kv_len kv_heads _d_k"],
    v: Float[ArrayLike, "_kv_len _kv_heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, " _kv_len"] | None = None,
    causal: bool = False,
    chunk_size: int = 512,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: str = "none",
    sink_logits: Float[ArrayLike, " heads"] | None = None,
    persistent_kv: int = 0,
    persistent_k: Float[ArrayLike, "m kv_heads d_k"] | None = None,
    persistent_v: Float[ArrayLike, "m kv_heads d_v"] | None = None,
    localness: bool = False,
    localness_w: Float[ArrayLike, "d_k d_k"] | None = None,
    localness_up: Float[ArrayLike, " d_k"] | None = None,
    localness_ud: Float[ArrayLike, " d_k"] | None = None,
    gaussian_prior: bool = False,
    gaussian_w: Float[Array, ""] | None = None,
    gaussian_b: Float[Array, ""] | None = None,
    adaptive_span: int | None = None,
    span_ramp: int = 32,
    span_z: Float[ArrayLike, " heads"] | None = None,
    span_loss_weight: float = SPAN_LOSS_WEIGHT,
    head_windows: tuple[int, ...] | None = None,
) -> Float[Array, "q_len heads d_v"]:
    """Exact attention in O(N * chunk) memory (Rabe & Staats, 2021).

    Queries are split into chunks of `chunk_size`; for each, keys are visited chunk by
    chunk with an online (running max / running sum) softmax, and each chunk is
    rematerialised in the backward pass, so neither direction holds an N x N matrix.
    Equal to `softmax_attention` to float32 rounding for any length (the last chunk is
    padded and masked).

    Arguments:
        q, k, v: as `softmax_attention` (grouped-query heads allowed, q_len may differ
            from kv_len).
        kv_mask: optional `[kv_len]`, True for real keys.
        causal: bottom-right causal mask, as `softmax_attention`.
        chunk_size: keys and queries per chunk (>= 1).
        scale: default `1 / sqrt(d_k)`.
        softcap, sinks, sink_logits, persistent_kv, persistent_k, persistent_v: as
            `softmax_attention` (a sink starts each row's running sum; top-k and talking
            heads need whole rows and every head, the dense form's alone).
        localness, gaussian_prior, adaptive_span, span_ramp, span_loss_weight,
            head_windows (and their arrays): the priors, as `softmax_attention` (not with
            persistent_kv here). With adaptive span, or windows on every head, each query
            chunk visits only the key chunks within reach (S + R, or the widest window):
            the compute shrinks with the span.

    Returns:
        `[q_len, heads, d_v]`; rows with no visible key are zero.

    Time O(q_len * kv_len * d); memory O(chunk^2 + N * d). Supports causal, cross
    attention and decoding.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v)
    check_positive("chunk_size", chunk_size)
    q_len, heads, d_k = q.shape
    kv_len, kv_heads, d_v = v.shape
    check_mask_shape("kv_mask", kv_mask, (kv_len,))
    check_score_options(
        heads,
        softcap=softcap,
        sinks=sinks,
        sink_logits=sink_logits,
        persistent_kv=persistent_kv,
        persistent_k=persistent_k,
        persistent_v=persistent_v,
        kv_heads=kv_heads,
    )
    priors = gather_priors(locals())
    prior_names = check_priors(heads, d_k, priors)
    if prior_names and persistent_kv:
        raise ValueError(
            f"chunked attention takes the priors {prior_names} or persistent_kv, not both "
            "(the persistent keys have no position; softmax attention takes both)"
        )
    if persistent_kv:
        k, v, kv_mask, _, _ = prepend_persistent(
            persistent_k, persistent_v, k, v, kv_mask=kv_mask, mask=None, bias=None
        )
        kv_len = k.shape[0]
    scale = default_scale(d_k, scale)

    qc = min(chunk_size, q_len)
    kc = min(chunk_size, kv_len)
    nq, nk = ceil_div(q_len, qc), ceil_div(kv_len, kc)
    q_blocks = to_blocks(pad_to(q, nq * qc), qc)
    k_blocks = to_blocks(pad_to(k, nk * kc), kc)
    v_blocks = to_blocks(pad_to(v, nk * kc), kc)
    real_blocks = to_blocks(valid_keys(kv_mask, kv_len, nk * kc), kc)
    offset = kv_len - q_len  # bottom-right causal alignment, as softmax_attention
    # I of the localness prior: the real keys each query may attend (causal: up to it).
    real_keys = valid_keys(kv_mask, kv_len, kv_len)
    visible_at = jnp.cumsum(real_keys) if causal else jnp.full((kv_len,), real_keys.sum())
    distance = reach(adaptive_span, span_ramp, head_windows)
    # Key chunks each query chunk visits: all, or those within the priors' reach.
    visits = nk if distance is None else min(nk, ceil_div(qc + 2 * distance, kc) + 1)

    def visible_of(at):  # I of the localness prior for queries at positions `at`
        return visible_at[jnp.clip(at, 0, kv_len - 1)] if causal else jnp.broadcast_to(visible_at[0], at.shape)

    def key_step(carry, xs):
        acc, row_max, row_sum, qb, q_pos, centres = carry
        kb, vb, real, k_pos = xs
        qg = group_heads(qb, kv_heads)
        s = logits(qg, kb, scale)  # [h, g, qc, kc]
        m = real[None, :]
        if causal:
            m = m & (q_pos[:, None] + offset >= k_pos[None, :])
        m = head_mask(m)
        if prior_names:
            at = q_pos + offset
            terms = prior_terms(qg, at, k_pos, visible_of(at), causal=causal, p=priors, centres=centres)
            s = s if terms.bias is None else s + terms.bias
            s = capped(s, softcap)
            s = s if terms.log_mask is None else s + terms.log_mask
            m = m if terms.allowed is None else m & terms.allowed
        else:
            s = capped(s, softcap)
        s = jnp.where(m, s, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(s, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.where(m, jnp.exp(s - safe_max[..., None]), 0.0)
        correction = jnp.exp(jnp.where(jnp.isfinite(row_max), row_max, safe_max) - safe_max)
        row_sum = row_sum * correction + p.sum(axis=-1)
        pv = weighted_values(p, vb, reads=m)  # [qc, h, g, dv]
        acc = acc * jnp.moveaxis(correction, -1, 0)[..., None] + pv
        return (acc, new_max, row_sum, qb, q_pos, centres), None

    # Rematerialise per key chunk: the scan then saves only its O(chunk * d) carries.
    key_step = jax.checkpoint(key_step)

    def query_chunk(args):
        qb, q_pos = args
        g = heads // kv_heads
        sink = sink_part(sinks, sink_logits, (kv_heads, g, qc, 1))
        # A sink (value 0) starts every row: running max its logit, running sum exp(0) = 1.
        start = sink[0][0][..., 0] if sink else jnp.full((kv_heads, g, qc), -jnp.inf, jnp.float32)
        init = (
            jnp.zeros((qc, kv_heads, g, d_v), jnp.float32),
            start,
            jnp.ones((kv_heads, g, qc), jnp.float32) if sink else jnp.zeros((kv_heads, g, qc), jnp.float32),
            qb,
            q_pos,
            # localness's centres and windows: once per query chunk, read by every key chunk
            localness_centres(group_heads(qb, kv_heads), visible_of(q_pos + offset), priors) if localness else None,
        )
        k_pos = to_blocks(positions(nk * kc), kc)
        xs = (k_blocks, v_blocks, real_blocks, k_pos)
        if visits < nk:  # the chunks around the query chunk's diagonal, clamped to the keys
            first = jnp.clip((q_pos[0] + offset - distance) // kc, 0, nk - visits)
            xs = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, visits), xs)
        (acc, _, row_sum, _, _, _), _ = jax.lax.scan(key_step, init, xs)
        denom = jnp.moveaxis(row_sum, -1, 0)[..., None]
        empty = denom <= 0  # a NaN sum (a non-finite key this row reads) stays NaN, not a silent 0
        return jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, denom))

    q_pos = to_blocks(positions(nq * qc), qc)
    out = jax.lax.map(jax.checkpoint(query_chunk), (q_blocks, q_pos))  # [nq, qc, h, g, dv]
    out = out.reshape(nq * qc, heads, d_v)[:q_len]
    return out.astype(out_dtype(q, k, v))


def _chunked_arrays(
    key,
    *,
    heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    sinks: str = "none",
    persistent_kv: int = 0,
    localness: bool = False,
    gaussian_prior: bool = False,
    adaptive_span: int | None = None,
):
    """The chunked op's option arrays: a learned sink, persistent memory, the priors' (no
    talking heads)."""
    return _softmax_arrays(
        key,
        heads=heads,
        kv_heads=kv_heads,
        d_k=d_k,
        d_v=d_v,
        sinks=sinks,
        persistent_kv=persistent_kv,
        localness=localness,
        gaussian_prior=gaussian_prior,
        adaptive_span=adaptive_span,
    )


register(
    "chunked",
    chunked_attention,
    family="exact",
    paper="Rabe & Staats 2021",
    complexity="O(N^2) time, O(N chunk) memory",
    supports_cross=True,
    decoder=kv_cache(softmax_attention, forward=(*SCORE_OPTIONS, *PRIOR_OPTIONS, "relative_values"), positions=True),
    init_arrays=_chunked_arrays,
    choices={"sinks": SINKS},
    docs={
        "chunk_size": "queries and keys per chunk",
        **{n: SCORE_OPTION_DOCS[n] for n in ("softcap", "sinks", "persistent_kv")},
        **PRIOR_DOCS,
    },
    summary="same as softmax, online softmax over chunks (Rabe & Staats)",
    limits={"chunk_size": 1, **{n: SCORE_OPTION_LIMITS[n] for n in ("softcap", "persistent_kv")}, **PRIOR_LIMITS},
    scaled=(
        "chunk_size = min(default, max(16, N / 4)): exact at any chunk; chunks shorter than N keep its memory at "
        "O(N chunk) (Rabe & Staats 2021)",
        lambda d, n: {"chunk_size": fraction(n, 4, cap=d["chunk_size"], minimum=16)},
    ),
)
