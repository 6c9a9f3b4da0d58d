"""Fixed sparse patterns that combine several sub-patterns into one softmax:
Sparse Transformer (strided and fixed), Longformer (dilated window + global tokens, with
its separate global projections), BigBird (sliding blocks + global blocks + random
blocks) and BigBird's random blocks alone.

Each sub-pattern is gathered in the layout that makes it cheap (blocks, residue
classes, a shared set of global keys) and the softmax is taken jointly over the union,
with keys that two sub-patterns share counted once, so each op equals dense
`softmax_attention` under the pattern's mask (the tests build that mask independently).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers._typing import ArrayLike
from jxformers.kernels import IMPLS, choose_kernel
from jxformers.kernels import pattern as kp
from jxformers.kernels.flash import BlockSizes, merge_attentions, pattern_attention
from jxformers.ops._common import (
    Part,
    attend_parts,
    block_part,
    causal_never_reads_non_finite_future,
    ceil_div,
    check_positive,
    check_self,
    default_scale,
    dense_part,
    first_occurrence,
    logits,
    neighbour_blocks,
    out_dtype,
    pad_to,
    positions,
    prepare_self,
    rows_to_output,
    sliding_window_part,
    to_blocks,
    valid_keys,
    weighted_values,
    window_block,
    zero_padded,
)
from jxformers.ops.local import IMPL_DOC
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import TokenInputs, fraction, register
from jxformers.validate import Limits

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "bigbird_attention",
    "bigbird_global_blocks",
    "bigbird_random_blocks",
    "longformer_attention",
    "random_attention",
    "random_attention_blocks",
    "sparse_transformer_attention",
]

# ----------------------------------------------------------------------------- Sparse Transformer


@causal_never_reads_non_finite_future()
def sparse_transformer_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    stride: int = 64,
    pattern: str = "strided",
    num_summary: int = 1,
    distinct_summaries: bool = False,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "seq heads d_v"]:
    """Sparse Transformer attention (Child et al., 2019), the union of its two heads.

    With stride s:
      * "strided": query i attends key j iff |i - j| < s or (i - j) mod s == 0;
      * "fixed":   query i attends key j iff j // s == i // s or j mod s >= s - c,
        with c = `num_summary` summary positions at the end of every block.
    `causal=True` adds j <= i (the paper's autoregressive setting).

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        stride: s >= 1 (the paper uses about sqrt(seq)).
        pattern: "strided" (images, periodic data) or "fixed" (text).
        num_summary: c, 1 <= c <= stride; used by "fixed" only.
        distinct_summaries: "fixed" only: head h takes its own length-c sub-block of
            every block as summary cells, j mod s in [s - (u + 1) c, s - u c) with
            u = h mod (s // c) (head 0 the last c cells; heads cycle once the s // c
            sub-blocks are used), as the paper suggests (section 4.3: "we found that
            letting different heads attend to distinct sub-blocks of length c within
            the block of size l was preferable"). False: every head uses the last c.
            Runs on XLA (the kernel has one pattern for all heads).
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.
        impl: one of `jxformers.kernels.IMPLS`, no cuDNN route; "auto" takes the kernel
            where `choose_kernel` does (Hopper GPUs, >= 128 queries: on an H100 it ran
            1.4-4.7x faster than the XLA op at 8K-16K tokens) and XLA elsewhere. The
            kernel runs "strided" as two disjoint parts merged by their log-sum-exps:
            the band |i - j| < s, and the columns laid out by residue mod s, where
            they are block-diagonal (cost O(seq * (s + seq / s)), as the op's), and
            "fixed" as the own block and the gathered summary keys (cost
            O(seq * (s + c * seq / s))).

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * (s + seq / s) * d) for "strided" and
    O(seq * (s + c * seq / s) * d) for "fixed": O(seq^1.5) at s = sqrt(seq).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("stride", stride)
    if pattern not in ("strided", "fixed"):
        raise ValueError(f"pattern must be 'strided' or 'fixed'; got {pattern!r}")
    check_positive("num_summary", num_summary)
    if num_summary > stride:
        raise ValueError(f"num_summary must be <= stride ({stride}); got {num_summary}")
    if distinct_summaries and pattern != "fixed":
        raise ValueError(f"distinct_summaries chooses the summary cells of pattern 'fixed'; got pattern {pattern!r}")
    if distinct_summaries and impl == "pallas":
        raise ValueError("distinct_summaries gives each head its own pattern: impl 'pallas' has one for all; use 'xla'")
    n = q.shape[0]
    check_self(q, k, v, kv_mask)
    choice = None if distinct_summaries else choose_kernel(impl, what="sparse_transformer attention", q_len=n)
    if choice is not None and pattern == "strided":
        out = _strided_kernel(q, k, v, choice, stride=stride, causal=causal, kv_mask=kv_mask, scale=scale)
        return out.astype(out_dtype(q, k, v))
    if choice is not None:
        out = _fixed_kernel(
            q, k, v, choice, stride=stride, num_summary=num_summary, causal=causal, kv_mask=kv_mask, scale=scale
        )
        return out.astype(out_dtype(q, k, v))
    s = stride
    length, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, s)
    nb = length // s
    scale = default_scale(q.shape[2], scale)
    pos = positions(length)
    q_blocks = to_blocks(qg, s)  # [nb, s, h, g, d]

    if pattern == "strided":
        local = sliding_window_part(qg, kp, vp, real, block=s, window=s - 1, causal=causal, scale=scale)

        # Column part, grouped by residue r = i mod s: keys r, r + s, r + 2s, ...; the
        # key in the query's own row of the grid (j == i) is already in the local part.
        def by_residue(x):
            return jnp.swapaxes(to_blocks(x, s), 0, 1)

        col_q, col_k, col_v, col_real = by_residue(qg), by_residue(kp), by_residue(vp), by_residue(real)
        rows = positions(nb)
        other = rows[:, None] != rows[None, :]
        if causal:
            other = other & (rows[None, :] < rows[:, None])
        col_mask = other[None] & col_real[:, None, :]  # [s, nb(q), nb(k)]
        column = block_part(col_q, col_k, col_v, col_mask, scale, interleaved=True)
        out = attend_parts([local, column])
    else:
        c = num_summary
        kb, vb, rb = to_blocks(kp, s), to_blocks(vp, s), to_blocks(real, s)
        within = jnp.ones((s, s), bool) if not causal else jnp.tril(jnp.ones((s, s), bool))
        block = block_part(q_blocks, kb, vb, within[None] & rb[:, None, :], scale)
        # Summary keys: the last c positions of every block (with distinct summaries, the
        # last c of each of the sub-blocks the heads use), shared by all queries; those
        # in the query's own block are already in the block part.
        used = min(q.shape[1], s // c) if distinct_summaries else 1  # sub-blocks of length c
        width = c * used
        sum_k = kb[:, s - width :].reshape(nb * width, *kb.shape[2:])
        sum_v = vb[:, s - width :].reshape(nb * width, *vb.shape[2:])
        sum_real = rb[:, s - width :].reshape(nb * width)
        sum_pos = to_blocks(pos, s)[:, s - width :].reshape(nb * width)
        mask = (sum_pos[None, :] // s != pos[:, None] // s) & sum_real[None, :]
        if causal:
            mask = mask & (sum_pos[None, :] <= pos[:, None])
        if distinct_summaries:  # query head h (= kv head * group + member) reads sub-block h mod (s // c)
            sub_block = (s - 1 - sum_pos % s) // c
            heads = positions(q.shape[1]).reshape(qg.shape[1], qg.shape[2]) % (s // c)
            mask = mask[None, None] & (sub_block[None, None, :] == heads[:, :, None])[:, :, None, :]
            summary = Part(logits(qg, sum_k, scale), mask, lambda p: weighted_values(p, sum_v, reads=mask))
        else:
            summary = dense_part(qg, sum_k, sum_v, mask, scale)
        out = attend_parts([block, summary])
    return rows_to_output(out, n, out_dtype(q, k, v))


def residue_order(n: int, stride: int) -> np.ndarray:
    """The positions 0..L-1 (L: n rounded up to a multiple of `stride`) grouped by residue
    mod `stride`: entry r * (L // stride) + b is position b * stride + r."""
    nb = ceil_div(n, stride)
    return np.arange(nb * stride).reshape(nb, stride).T.reshape(-1)


def strided_parts(stride: int, *, causal: bool, n: int) -> tuple[kp.Pattern, kp.Pattern]:
    """The "strided" pattern as two disjoint patterns: the band |i - j| < s on the
    positions, and the columns (i - j) mod s == 0, j != i, on the residue order (length
    L), where they are block-diagonal with blocks of L // s."""
    s, nb = stride, ceil_div(n, stride)
    band = kp.intersect(kp.Band(-(s - 1), s - 1), kp.causal(n, n) if causal else None)
    others = kp.Band(1, None) if causal else kp.union(kp.Band(1, None), kp.Band(None, -1))
    return band, kp.intersect(kp.Band(0, 0, unit=nb), others)


def _strided_kernel(q, k, v, choice, *, stride: int, causal: bool, kv_mask, scale):
    """Sparse Transformer "strided" through the block-sparse kernel: the band and the
    columns (`strided_parts`) each visit only their own blocks, merged exactly by their
    log-sum-exps. Reordering by residue costs one gather of q, k, v and one of the output."""
    n = q.shape[0]
    band, columns = strided_parts(stride, causal=causal, n=n)
    order = residue_order(n, stride)
    length = order.shape[0]
    near = pattern_attention(q, k, v, band, choice, kv_mask=kv_mask, scale=scale, return_lse=True)
    real = valid_keys(kv_mask, n, length)
    out, lse = pattern_attention(
        *(pad_to(x, length)[order] for x in (q, k, v)),
        columns,
        choice,
        kv_mask=real[order],
        scale=scale,
        return_lse=True,
    )
    back = np.argsort(order)[:n]
    return merge_attentions([near, (out[back], lse[back])])


def summary_positions(n: int, stride: int, num_summary: int) -> np.ndarray:
    """The "fixed" pattern's summary keys, the last c positions of every block of s, in
    order (c per block; the last block's may run past n)."""
    s, c = stride, num_summary
    return (np.arange(ceil_div(n, s))[:, None] * s + np.arange(s - c, s)[None, :]).reshape(-1)


def fixed_parts(stride: int, num_summary: int, *, causal: bool, n: int) -> tuple[kp.Pattern, kp.Pattern]:
    """The "fixed" pattern as two disjoint patterns: the query's own block (on the
    positions), and the summary keys of the other blocks (queries on the positions in
    blocks of s, keys the gathered `summary_positions` in blocks of c)."""
    s, c = stride, num_summary
    own = kp.intersect(kp.Band(0, 0, unit=s), kp.causal(n, n) if causal else None)
    earlier = kp.Band(1, None, unit=s, key_unit=c)
    return own, earlier if causal else kp.union(earlier, kp.Band(None, -1, unit=s, key_unit=c))


def _fixed_kernel(q, k, v, choice, *, stride: int, num_summary: int, causal: bool, kv_mask, scale):
    """Sparse Transformer "fixed" through the block-sparse kernel: the own block and the
    gathered summary keys of the other blocks (`fixed_parts`), merged by their
    log-sum-exps; the summary part is cross attention to N c / s keys."""
    n = q.shape[0]
    own, others = fixed_parts(stride, num_summary, causal=causal, n=n)
    where = summary_positions(n, stride, num_summary)
    length = ceil_div(n, stride) * stride
    near = pattern_attention(q, k, v, own, choice, kv_mask=kv_mask, scale=scale, return_lse=True)
    real = valid_keys(kv_mask, n, length)
    far = pattern_attention(
        q,
        pad_to(k, length)[where],
        pad_to(v, length)[where],
        others,
        choice,
        kv_mask=real[where],
        scale=scale,
        return_lse=True,
    )
    return merge_attentions([near, far])


def sparse_transformer_pattern(stride: int, pattern: str, num_summary: int, *, causal: bool, n: int) -> kp.Pattern:
    """|i - j| < s or s | (i - j) ("strided"); j // s == i // s or j mod s >= s - c ("fixed")."""
    s = stride
    if pattern == "strided":
        union = kp.union(kp.Band(-(s - 1), s - 1), kp.Band(step=s))
    else:
        union = kp.union(kp.Band(0, 0, unit=s), kp.KeyResidue(s, s - num_summary))
    return kp.intersect(union, kp.causal(n, n) if causal else None)


register(
    "sparse_transformer",
    sparse_transformer_attention,
    family="fixed pattern",
    paper="Child et al. 2019",
    complexity="O(N sqrt N)",
    choices={"pattern": ("strided", "fixed"), "impl": IMPLS},
    docs={
        "stride": "s, about sqrt(N)",
        "pattern": "strided or fixed",
        "num_summary": "c, summary positions per block (fixed)",
        "distinct_summaries": "each head its own length-c sub-block of summary cells (fixed)",
    }
    | IMPL_DOC,
    summary="strided: |i - j| < s or (i - j) % s == 0; fixed: j // s == i // s or j % s >= s - c",
    limits={"stride": 1, "num_summary": 1},
    dense_width=(
        "its pattern (stride + max_len / stride keys)",
        lambda hp, n: hp["stride"] + -(-n // hp["stride"]) * (hp["num_summary"] if hp["pattern"] == "fixed" else 1),
    ),
    scaled=(
        "stride = min(default, isqrt(N)) (Child et al. 2019: about sqrt N): about 2 sqrt N keys",
        lambda d, n: {"stride": min(d["stride"], max(1, math.isqrt(n)))},
    ),
)


# ----------------------------------------------------------------------------- Longformer


def _check_global_indices(global_indices, n: int) -> Int[Array, " num_global"]:
    if isinstance(global_indices, (jax.Array, np.ndarray)):
        if global_indices.ndim != 1 or not jnp.issubdtype(global_indices.dtype, jnp.integer):
            raise ValueError(
                f"global_indices must be a 1-D int array; got {global_indices.dtype}{list(global_indices.shape)}"
            )
    else:
        bad = [i for i in global_indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"global_indices must be ints in [0, {n}); got {list(global_indices)}")
    return jnp.asarray(global_indices, dtype=jnp.int32).reshape(-1)


def _global_projections(q, k, v, global_q, global_k, global_v):
    """The queries, keys and values of the global rows: the separate projections when
    given (all three), else q, k, v themselves."""
    given = [x is not None for x in (global_q, global_k, global_v)]
    if not any(given):
        return q, k, v
    if not all(given):
        raise ValueError(
            "global_q, global_k and global_v go together (Longformer's Q_g, K_g, V_g); "
            f"got only {[n for n, g in zip(('global_q', 'global_k', 'global_v'), given, strict=True) if g]}"
        )
    for name, x, like in (("global_q", global_q, q), ("global_k", global_k, k), ("global_v", global_v, v)):
        if jnp.shape(x) != jnp.shape(like):
            raise ValueError(
                f"{name} must have the shape of its local projection {jnp.shape(like)}; got {jnp.shape(x)}"
            )
    return global_q, global_k, global_v


@causal_never_reads_non_finite_future()
def longformer_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    window: int = 128,
    dilation: int = 1,
    global_indices: Int[ArrayLike, " num_global"] | Sequence[int] = (0,),
    global_q: Float[ArrayLike, "_seq _heads _d_k"] | None = None,
    global_k: Float[ArrayLike, "_seq _kv_heads _d_k"] | None = None,
    global_v: Float[ArrayLike, "_seq _kv_heads _d_v"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "seq heads d_v"]:
    """Longformer attention (Beltagy et al., 2020, section 3.1): a (dilated) sliding
    window plus global tokens, one softmax per query.

    Query i attends key j iff (i - j) is a multiple of `dilation` and
    |i - j| <= window * dilation (the dilated window; `dilation=1` is a plain window), or
    i or j is a global position. `causal=True` intersects the pattern with j <= i.

    The paper computes the global attention with its own projections Q_g, K_g, V_g:
    give `global_q`, `global_k`, `global_v` (the same shapes as q, k, v) and a global
    query's row is softmax(Q_g[i] K_g^T) V_g over every key, while the other rows, global
    keys included, use the sliding-window projections q, k, v (as the authors' code).
    Without them the global rows use q, k, v.

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        window: keys each side (behind the query when causal), int >= 0.
        dilation: stride between the window's keys, int >= 1.
        global_indices: positions of the global tokens (e.g. `(0,)` for [CLS]), a Python
            sequence (checked against `seq`) or an int array (may differ per example under
            vmap; entries outside [0, seq) are ignored). Repeats count once.
        global_q, global_k, global_v: the global projections of the same tokens, or None.
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens (padded global tokens are masked
            as keys like any padding).
        scale: default `1 / sqrt(d_k)`.
        impl: one of `jxformers.kernels.IMPLS`, no cuDNN route: the kernel runs the window and
            the global keys as one block-sparse pattern (global indices must be a Python
            sequence; a dilated window is visited as a dense band, `dilation` times the
            work); the global rows are then recomputed densely as here.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * (window + num_global) * d) whatever the dilation: the window
    runs over the `dilation` interleaved subsequences laid end to end, each followed by
    `window` masked slots so no window crosses into the next.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_self(q, k, v, kv_mask)
    check_positive("window", window, minimum=0)
    check_positive("dilation", dilation)
    n = q.shape[0]
    idx = _check_global_indices(global_indices, n)
    gq, gk, gv = _global_projections(q, k, v, global_q, global_k, global_v)
    static_globals = not isinstance(global_indices, (jax.Array, np.ndarray))
    pattern = longformer_pattern(window, dilation, global_indices, causal=causal, n=n) if static_globals else None
    unsupported = (
        "global_indices given as an array (the kernel's pattern is static: give a tuple)"
        if not static_globals
        else "more than 16 runs of global positions"
        if pattern is None
        else None
    )
    choice = choose_kernel(impl, unsupported=unsupported, what="longformer attention", q_len=n)
    if choice is not None:
        out = pattern_attention(q, k, v, pattern, choice, kv_mask=kv_mask, scale=scale).astype(out_dtype(q, k, v))
        return _longformer_global_rows(out, idx, gq, gk, gv, kv_mask, causal, scale)
    d = dilation
    real_n = jnp.ones((n,), bool) if kv_mask is None else jnp.asarray(kv_mask)
    if d == 1:
        slots, slot, origin, laid_out = n, None, positions(n), (q, k, v, kv_mask)
    else:  # position i sits at slot (i mod d) * seg + i // d: residue classes end to end
        seg = ceil_div(n, d) + window
        slots = d * seg
        slot = (positions(n) % d) * seg + positions(n) // d
        origin = jnp.full((slots,), -1, jnp.int32).at[slot].set(positions(n))  # -1: a gap
        laid_out = tuple(
            jnp.zeros((slots, *jnp.shape(x)[1:]), jnp.result_type(x)).at[slot].set(x) for x in (q, k, v, real_n)
        )
    block = window_block(slots, window)
    length, qg, kp, vp, real = prepare_self(*laid_out, block)
    scale = default_scale(q.shape[2], scale)
    pos = pad_to(origin, length, value=-1)  # each row's position

    def near(i, j):
        delta = i - j
        inside = (delta % d == 0) & (jnp.abs(delta) <= window * d)
        return inside & (delta >= 0) if causal else inside

    parts = [sliding_window_part(qg, kp, vp, real, block=block, window=window, causal=causal, scale=scale)]
    in_range = (idx >= 0) & (idx < n)
    safe = jnp.where(in_range, idx, 0)
    if idx.shape[0] > 0:
        g_ok = in_range & first_occurrence(idx) & real_n[safe]
        # Global keys not already inside the query's window.
        mask = g_ok[None, :] & ~near(pos[:, None], safe[None, :])
        if causal:
            mask = mask & (safe[None, :] <= pos[:, None])
        parts.append(dense_part(qg, jnp.asarray(k)[safe], jnp.asarray(v)[safe], mask, scale))
    out = rows_to_output(attend_parts(parts), length, out_dtype(q, k, v))
    out = out[:n] if slot is None else out[slot]
    return _longformer_global_rows(out, idx, gq, gk, gv, kv_mask, causal, scale)


def _longformer_global_rows(out, idx, gq, gk, gv, kv_mask, causal, scale):
    """`out` with the global queries' rows replaced: each attends every (real, and with
    causal: earlier) key, through the global projections when given."""
    if idx.shape[0] == 0:
        return out
    n = out.shape[0]
    in_range = (idx >= 0) & (idx < n)
    safe = jnp.where(in_range, idx, 0)
    rows_mask = jnp.ones((idx.shape[0], n), bool)
    if causal:
        rows_mask = positions(n)[None, :] <= safe[:, None]
    g_out = softmax_attention(jnp.asarray(gq)[safe], gk, gv, mask=rows_mask, kv_mask=kv_mask, scale=scale)
    return out.at[jnp.where(in_range, idx, n)].set(g_out.astype(out.dtype), mode="drop")


def longformer_pattern(
    window: int, dilation: int, global_indices: Sequence[int], *, causal: bool, n: int
) -> kp.Pattern | None:
    """The (dilated) window or a global key, within j <= i when causal; None when the
    global positions form more than 16 runs."""
    globals_ = kp.key_set(global_indices)
    if globals_ is None and len(global_indices):
        return None
    band = kp.Band(-window * dilation, window * dilation, step=dilation)
    return kp.intersect(kp.union(band, globals_), kp.causal(n, n) if causal else None)


def longformer_global_params(
    key: PRNGKeyArray, *, d_model: int, heads: int, kv_heads: int, d_k: int, d_v: int, global_projections: bool = True
) -> dict[str, Array]:
    """Q_g, K_g, V_g: weights `[d_model, heads, d]` and biases `[heads, d]` at
    `nn.Linear`'s scale (uniform in +-1/sqrt(d_model)), when `global_projections`."""
    if not global_projections:
        return {}
    bound = 1.0 / math.sqrt(d_model)
    shapes = {"global_q": (heads, d_k), "global_k": (kv_heads, d_k), "global_v": (kv_heads, d_v)}
    params = {}
    for (name, shape), k in zip(shapes.items(), jax.random.split(key, 3), strict=True):
        kw, kb = jax.random.split(k)
        params[name + "_w"] = jax.random.uniform(kw, (d_model, *shape), minval=-bound, maxval=bound)
        params[name + "_b"] = jax.random.uniform(kb, shape, minval=-bound, maxval=bound)
    return params


def longformer_globals(
    params: dict[str, Array],
    queries: Float[Array, "q_len d_model"],
    keys: Float[Array, "kv_len d_model"] | None,
    hyper_parameters: dict,
) -> dict[str, Array]:
    """The global projections of the layer's tokens (nothing when there are none).
    Rotary embeddings (ModelConfig embedding position "rope") rotate the module's q and k, not these: with
    rope the global rows see no positions (the paper uses learned absolute ones)."""
    if not params:
        return {}
    if keys is None:
        raise ValueError("Longformer is self-attention: its global projections need the keys' tokens")
    sources = {"global_q": queries, "global_k": keys, "global_v": keys}
    return {
        n: jnp.einsum("nm,mhd->nhd", x, params[n + "_w"].astype(x.dtype)) + params[n + "_b"].astype(x.dtype)[None]
        for n, x in sources.items()
    }


register(
    "longformer",
    longformer_attention,
    family="fixed pattern",
    paper="Beltagy et al. 2020",
    complexity="O(N (w + g))",
    token_inputs=TokenInputs(longformer_global_params, longformer_globals),
    choices={"impl": IMPLS},
    docs={
        "window": "keys each side",
        "dilation": "stride between window keys",
        "global_indices": "positions of global tokens",
        "global_projections": "separate Q_g, K_g, V_g for the global attention (the paper's)",
    }
    | IMPL_DOC,
    summary="(dilated) window, or i or j global; separate Q_g/K_g/V_g for global rows",
    limits={"window": 0, "dilation": 1, "global_indices": 0},
    dense_width=(
        "its window and globals (2 window + 1 + globals keys)",
        lambda hp, n: 2 * hp["window"] + 1 + len(hp["global_indices"]),
    ),
    scaled=(
        "window = min(default, N / 8) keys each side (Beltagy et al. 2020: 512 at 4,096), its global tokens kept",
        lambda d, n: {"window": fraction(n, 8, cap=d["window"])},
    ),
)


# ----------------------------------------------------------------------------- BigBird


def bigbird_global_blocks(num_blocks: int, num_global_blocks: int) -> tuple[int, ...]:
    """BigBird-ITC global blocks: the first ceil(g/2) and the last floor(g/2) blocks
    (g = 2, the paper's setting, is the first and the last block)."""
    first = range(min(num_blocks, ceil_div(num_global_blocks, 2)))
    last = range(max(0, num_blocks - num_global_blocks // 2), num_blocks)
    return tuple(sorted(set(first) | set(last)))


def _window_blocks(num_blocks: int, num_window_blocks: int) -> Bool[Array, "nb nb"]:
    b = positions(num_blocks)
    return jnp.abs(b[:, None] - b[None, :]) <= num_window_blocks // 2


def bigbird_random_blocks(
    key: PRNGKeyArray,
    seq_len: int,
    *,
    block_size: int,
    num_random_blocks: int = 3,
    num_window_blocks: int = 3,
    num_global_blocks: int = 2,
) -> Int[Array, "num_blocks num_random_blocks"]:
    """Draw BigBird's random key blocks for every query block, without replacement and
    outside the query block's window and the global blocks (as in the paper's code).

    Returns `[ceil(seq_len / block_size), num_random_blocks]` block indices; -1 marks a
    slot with no block left to draw (short sequences) and the rows of global blocks.
    """
    check_positive("seq_len", seq_len)
    check_positive("block_size", block_size)
    check_positive("num_random_blocks", num_random_blocks, minimum=0)
    nb = ceil_div(seq_len, block_size)
    glob = jnp.zeros((nb,), bool).at[jnp.asarray(bigbird_global_blocks(nb, num_global_blocks), jnp.int32)].set(True)
    allowed = ~_window_blocks(nb, num_window_blocks) & ~glob[None, :] & ~glob[:, None]
    scores = jax.random.uniform(key, (nb, nb)) + jnp.where(allowed, 0.0, 2.0)
    order = jnp.argsort(scores, axis=1)[:, :num_random_blocks]
    if num_random_blocks > nb:
        order = jnp.pad(order, ((0, 0), (0, num_random_blocks - nb)), constant_values=-1)
    ok = jnp.take_along_axis(allowed, jnp.maximum(order, 0), axis=1) & (order >= 0)
    return jnp.where(ok, order, -1).astype(jnp.int32)


def bigbird_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    block_size: int = 64,
    random_blocks: Int[ArrayLike, "_num_blocks _r"] | None = None,
    key: PRNGKeyArray | None = None,
    num_random_blocks: int = 3,
    num_window_blocks: int = 3,
    num_global_blocks: int = 2,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "seq heads d_v"]:
    """BigBird-ITC attention (Zaheer et al., 2020), block-sparse and bidirectional.

    The sequence is cut into blocks of `block_size`. Query block a attends key block b
    iff |a - b| <= num_window_blocks // 2 (sliding), a or b is a global block
    (`bigbird_global_blocks`), or b is one of a's random blocks. The random blocks are
    `random_blocks` if given, else drawn from `key` with `bigbird_random_blocks` (the
    same key gives the same pattern: fixed per call, redrawn only by a new key). In a
    model the key is drawn once per layer and kept for the whole run, as the paper's
    code seeds its pattern per layer: training's periodic `nn.redraw` leaves it alone.
    Padded keys (`kv_mask`) are masked in every part, global ones included.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (any length; the last block
            is padded and masked).
        block_size: tokens per block, int >= 1.
        random_blocks: `[num_blocks, num_random_blocks]` block indices, -1 for none.
        key: PRNG key to draw `random_blocks` when they are not given.
        num_random_blocks, num_window_blocks (odd), num_global_blocks: the pattern.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.
        impl: one of `jxformers.kernels.IMPLS`, no cuDNN route: the kernel visits the sliding,
            global and random key blocks with tiles of `block_size` (a power of two
            >= 16); the global query blocks are computed densely as here.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * block_size * (window + global + random) * d). Not causal.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("block_size", block_size)
    check_positive("num_window_blocks", num_window_blocks)
    if num_window_blocks % 2 == 0:
        raise ValueError(f"num_window_blocks must be odd (a centred window); got {num_window_blocks}")
    check_positive("num_global_blocks", num_global_blocks, minimum=0)
    check_positive("num_random_blocks", num_random_blocks, minimum=0)
    length, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block_size)
    n = q.shape[0]
    nb = ceil_div(n, block_size)
    if random_blocks is None and num_random_blocks > 0:
        if key is None:
            raise ValueError("bigbird_attention needs `key` (or `random_blocks`) to draw its random blocks")
        random_blocks = bigbird_random_blocks(
            key,
            n,
            block_size=block_size,
            num_random_blocks=num_random_blocks,
            num_window_blocks=num_window_blocks,
            num_global_blocks=num_global_blocks,
        )
    if random_blocks is None:
        random_blocks = jnp.zeros((nb, 0), jnp.int32)
    if random_blocks.shape[0] != nb:
        raise ValueError(
            f"random_blocks must have shape [num_blocks={nb}, r] for seq={n}, block_size={block_size}; "
            f"got {tuple(random_blocks.shape)}"
        )
    b = block_size
    glob_ids = jnp.asarray(bigbird_global_blocks(nb, num_global_blocks), jnp.int32)
    unsupported = None if b >= 16 and not b & (b - 1) else f"block_size={b} is not a power of two >= 16"
    choice = choose_kernel(impl, unsupported=unsupported, what="bigbird attention", q_len=n)
    if choice is not None:
        out = pattern_attention(
            q,
            k,
            v,
            bigbird_pattern(n, b, num_window_blocks, num_global_blocks),
            choice,
            kv_mask=kv_mask,
            scale=scale,
            extra_blocks=random_blocks,
            block_sizes=BlockSizes(b, b, block_q_bwd=b, block_k_bwd=b),
        )
        return _bigbird_global_rows(out.astype(out_dtype(q, k, v)), q, k, v, glob_ids, b, kv_mask, scale, impl)
    scale = default_scale(q.shape[2], scale)
    is_glob = jnp.zeros((nb,), bool).at[glob_ids].set(True)
    half = num_window_blocks // 2
    q_blocks = to_blocks(qg, b)
    kb, vb, rb = to_blocks(kp, b), to_blocks(vp, b), to_blocks(real, b)

    # Sliding blocks.
    win_k, win_v = neighbour_blocks(kb, half, half), neighbour_blocks(vb, half, half)
    win_real = neighbour_blocks(rb, half, half)
    parts = [block_part(q_blocks, win_k, win_v, jnp.broadcast_to(win_real[:, None, :], (nb, b, win_k.shape[1])), scale)]

    # Global key blocks outside the query block's window.
    if glob_ids.shape[0] > 0:
        g_k = kb[glob_ids].reshape(-1, *kb.shape[2:])
        g_v = vb[glob_ids].reshape(-1, *vb.shape[2:])
        g_real = rb[glob_ids].reshape(-1)
        g_block = jnp.repeat(glob_ids, b)
        q_block = positions(length) // b
        mask = (jnp.abs(q_block[:, None] - g_block[None, :]) > half) & g_real[None, :]
        parts.append(dense_part(qg, g_k, g_v, mask, scale))

    # Random key blocks, each counted once and never one the other parts already hold.
    r = random_blocks.shape[1]
    if r > 0:
        rnd = random_blocks.astype(jnp.int32)
        safe = jnp.clip(rnd, 0, nb - 1)
        own = positions(nb)[:, None]
        usable = (rnd >= 0) & (rnd < nb) & (jnp.abs(safe - own) > half) & ~is_glob[safe]
        usable = usable & jax.vmap(first_occurrence)(rnd)
        r_k = kb[safe].reshape(nb, r * b, *kb.shape[2:])
        r_v = vb[safe].reshape(nb, r * b, *vb.shape[2:])
        r_real = (rb[safe] & usable[:, :, None]).reshape(nb, r * b)
        parts.append(block_part(q_blocks, r_k, r_v, jnp.broadcast_to(r_real[:, None, :], (nb, b, r * b)), scale))

    out = rows_to_output(attend_parts(parts), n, out_dtype(q, k, v))
    return _bigbird_global_rows(out, q, k, v, glob_ids, b, kv_mask, scale, impl)


def _bigbird_global_rows(out, q, k, v, glob_ids, b, kv_mask, scale, impl):
    """`out` with the global query blocks' rows replaced: they attend every real key."""
    if glob_ids.shape[0] == 0:
        return out
    n = out.shape[0]
    g_rows = (glob_ids[:, None] * b + positions(b)[None, :]).reshape(-1)
    g_out = softmax_attention(jnp.take(q, g_rows, axis=0, mode="clip"), k, v, kv_mask=kv_mask, scale=scale, impl=impl)
    return out.at[jnp.where(g_rows < n, g_rows, n)].set(g_out.astype(out.dtype), mode="drop")


def bigbird_pattern(n: int, block_size: int, num_window_blocks: int, num_global_blocks: int) -> kp.Pattern:
    """The static part of BigBird's pattern for the kernel (random blocks come at run
    time): the sliding blocks and the global key blocks (global query blocks are
    recomputed densely, so they are left out)."""
    b, nb = block_size, ceil_div(n, block_size)
    first, last = ceil_div(num_global_blocks, 2), num_global_blocks // 2
    half = num_window_blocks // 2
    return kp.union(
        kp.Band(-half, half, unit=b),
        kp.KeyRange(0, min(first, nb) * b) if first else None,
        kp.KeyRange(max(0, nb - last) * b, None) if last else None,
    )


def bigbird_arrays(key: PRNGKeyArray) -> dict[str, PRNGKeyArray]:
    """BigBird's drawn array: the key its random blocks are drawn from (redrawn with the module)."""
    return {"key": key}


register(
    "bigbird",
    bigbird_attention,
    family="fixed pattern",
    paper="Zaheer et al. 2020",
    complexity="O(N b (w + g + r))",
    init_arrays=bigbird_arrays,
    drawn=("key",),
    redrawn=False,
    choices={"impl": IMPLS},
    docs={
        "block_size": "tokens per block",
        "num_random_blocks": "random key blocks per query block",
        "num_window_blocks": "sliding window in blocks (odd)",
        "num_global_blocks": "global blocks (first and last)",
    }
    | IMPL_DOC,
    summary="block window, global first/last blocks, random blocks",
    limits={
        "block_size": 1,
        "num_random_blocks": 0,
        "num_window_blocks": Limits(minimum=1, odd=True),
        "num_global_blocks": 0,
    },
    dense_width=(
        "its blocks (block_size x (window + global + random blocks) keys)",
        lambda hp, n: hp["block_size"] * (hp["num_window_blocks"] + hp["num_global_blocks"] + hp["num_random_blocks"]),
    ),
    scaled=(
        "block_size = min(default, N / 16): at least 16 blocks, of which a query block reads its 8 "
        "(Zaheer et al. 2020: blocks of 64 at 4,096)",
        lambda d, n: {"block_size": fraction(n, 16, cap=d["block_size"])},
    ),
)


# ----------------------------------------------------------------------------- random blocks alone


def random_attention_blocks(
    key: PRNGKeyArray,
    seq_len: int,
    *,
    heads: int,
    block_size: int,
    num_random_blocks: int = 3,
    num_window_blocks: int = 0,
    num_global_blocks: int = 0,
    per_head: bool = True,
) -> Int[Array, "heads num_blocks num_random_blocks"]:
    """BigBird's random key blocks (`bigbird_random_blocks`), one draw per query head
    (`per_head`, as the paper's code draws them) or one shared by every head (as
    `bigbird_attention` takes them: with the same key and settings, the same blocks).

    `num_window_blocks` and `num_global_blocks` are the blocks the draw avoids, as a
    BigBird with those settings avoids its window and global blocks; 0 and 0 (the
    random pattern alone) draw from every block, the query's own included.

    Returns `[heads, ceil(seq_len / block_size), num_random_blocks]` block indices, -1
    for none (a slot with no block left to draw; the rows of avoided global blocks)."""
    # bigbird_random_blocks avoids |a - b| <= num_window_blocks // 2; -1 // 2 = -1 avoids none.
    draw = dict(
        block_size=block_size,
        num_random_blocks=num_random_blocks,
        num_window_blocks=num_window_blocks if num_window_blocks else -1,
        num_global_blocks=num_global_blocks,
    )
    if not per_head:
        shared = bigbird_random_blocks(key, seq_len, **draw)
        return jnp.broadcast_to(shared, (heads, *shared.shape))
    return jax.vmap(lambda kk: bigbird_random_blocks(kk, seq_len, **draw))(jax.random.split(key, heads))


def random_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    block_size: int = 64,
    random_blocks: Int[ArrayLike, "_heads _num_blocks _r"] | None = None,
    key: PRNGKeyArray | None = None,
    num_random_blocks: int = 3,
    num_window_blocks: int = 0,
    num_global_blocks: int = 0,
    per_head: bool = True,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """BigBird's random attention alone (Zaheer et al., 2020): a fixed random pattern of
    key blocks, so BigBird's parts (window: `block_local` / `local`; global; random)
    can be compared one by one.

    The sequence is cut into blocks of `block_size`; query block a of head h attends
    the key blocks `random_blocks[h, a]` (each counted once; -1 for none) and nothing
    else, one softmax. The blocks are given, or drawn from `key` by
    `random_attention_blocks` (fixed per key: a model draws the key once per layer and
    keeps it for the run, as BigBird's). A row whose blocks hold no real key (all -1,
    or all padding) is zero. Not causal, as BigBird: its random blocks are drawn from
    the whole sequence, the future included.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (any length; the last block
            is padded and masked).
        block_size: tokens per block, int >= 1.
        random_blocks: `[heads, num_blocks, r]` block indices, -1 for none.
        key: PRNG key to draw `random_blocks` when they are not given.
        num_random_blocks: r, random key blocks per query block (and head).
        num_window_blocks: 0, or the odd BigBird window whose blocks the draw avoids.
        num_global_blocks: BigBird global blocks the draw avoids (their query rows draw none).
        per_head: a draw per query head (True, BigBird's code) or one for all heads.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * block_size * r * d).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("block_size", block_size)
    check_positive("num_random_blocks", num_random_blocks)
    check_positive("num_window_blocks", num_window_blocks, minimum=0)
    if num_window_blocks % 2 == 0 and num_window_blocks:
        raise ValueError(f"num_window_blocks must be 0 or odd (a centred window); got {num_window_blocks}")
    check_positive("num_global_blocks", num_global_blocks, minimum=0)
    length, qg, kp, vp, real = prepare_self(q, k, v, kv_mask, block_size)
    n, heads = q.shape[:2]
    nb, b = length // block_size, block_size
    if random_blocks is None:
        if key is None:
            raise ValueError("random_attention needs `key` (or `random_blocks`) to draw its random blocks")
        random_blocks = random_attention_blocks(
            key,
            n,
            heads=heads,
            block_size=b,
            num_random_blocks=num_random_blocks,
            num_window_blocks=num_window_blocks,
            num_global_blocks=num_global_blocks,
            per_head=per_head,
        )
    if random_blocks.ndim != 3 or random_blocks.shape[:2] != (heads, nb):
        raise ValueError(
            f"random_blocks must have shape [heads={heads}, num_blocks={nb}, r] for seq={n}, "
            f"block_size={b}; got {tuple(random_blocks.shape)}"
        )
    scale = default_scale(q.shape[2], scale)
    h, g = qg.shape[1:3]
    r = random_blocks.shape[2]
    rnd = random_blocks.astype(jnp.int32).reshape(h, g, nb, r)
    safe = jnp.clip(rnd, 0, nb - 1)
    usable = (rnd >= 0) & (rnd < nb) & jax.vmap(jax.vmap(jax.vmap(first_occurrence)))(rnd)
    kb, vb, rb = to_blocks(kp, b), to_blocks(vp, b), to_blocks(real, b)

    def one_head(q_head, kv_head, blocks, ok):  # one query head: [nb, b, d] against its r blocks
        r_k = kb[:, :, kv_head][blocks].reshape(nb, r * b, 1, -1)
        r_v = vb[:, :, kv_head][blocks].reshape(nb, r * b, 1, -1)
        r_real = (rb[blocks] & ok[:, :, None]).reshape(nb, r * b)
        part = block_part(
            to_blocks(q_head, b)[:, :, None, None], r_k, r_v, jnp.broadcast_to(r_real[:, None], (nb, b, r * b)), scale
        )
        return attend_parts([part])[:, 0, 0]  # [length, dv]

    kv_heads = jnp.repeat(positions(h), g)
    out = jax.vmap(one_head, in_axes=(1, 0, 0, 0), out_axes=1)(
        qg.reshape(length, h * g, -1), kv_heads, safe.reshape(h * g, nb, r), usable.reshape(h * g, nb, r)
    )
    return out[:n].astype(out_dtype(q, k, v))


register(
    "random",
    random_attention,
    family="fixed pattern",
    paper="Zaheer et al. 2020",
    complexity="O(N b r)",
    init_arrays=bigbird_arrays,  # the same drawn array: the key its blocks are drawn from
    drawn=("key",),
    redrawn=False,
    docs={
        "block_size": "tokens per block",
        "num_random_blocks": "random key blocks per query block and head",
        "num_window_blocks": "0, or a BigBird window (odd) the draw avoids",
        "num_global_blocks": "BigBird global blocks the draw avoids",
        "per_head": "a draw per query head (BigBird's code) or one shared",
    },
    summary="BigBird's random key blocks alone: r blocks per query block and head",
    limits={
        "block_size": 1,
        "num_random_blocks": 1,
        "num_window_blocks": Limits(minimum=0, rule=(lambda w: w == 0 or w % 2 == 1, "0 or odd")),
        "num_global_blocks": 0,
    },
    dense_width=(
        "its random blocks (block_size x num_random_blocks keys)",
        lambda hp, n: hp["block_size"] * hp["num_random_blocks"],
    ),
    scaled=(
        "block_size = min(default, N / 16), as BigBird's: at least 16 blocks, 3 of them read",
        lambda d, n: {"block_size": fraction(n, 16, cap=d["block_size"])},
    ),
)
