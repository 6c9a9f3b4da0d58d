"""Global-local attention: ETC (Ainslie et al. 2020, "ETC: Encoding Long and Structured
Inputs in Transformers").

ETC splits its input into a small global input (n_g tokens) and a long input (n_l
tokens) and its attention into four pieces: global-to-global (g2g), global-to-long
(g2l), long-to-global (l2g) and long-to-long (l2l), the last restricted to a local
radius r. Positions enter through relative position labels (Shaw et al. 2018) clipped
at distance k. Here the global input is the first `num_global` positions of the
sequence and the long input the rest, so the op keeps the package's `q, k, v` signature
and any model can use it; the four pieces are one joint softmax per query, as in the
paper (a query's keys are the union of its two pieces).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import group_heads
from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    Part,
    attend_parts,
    check_positive,
    check_self,
    default_scale,
    dense_part,
    einsum_f32,
    out_dtype,
    positions,
    prepare_self,
    rows_to_output,
    sliding_window_part,
    window_block,
    zero_padded,
)
from jxformers.registry import fraction, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "etc_arrays",
    "etc_attention",
    "etc_relative_labels",
]


def etc_relative_labels(max_distance: int) -> int:
    """Size of ETC's relative position vocabulary: the clipped distances -k..k (labels
    0..2k, distance + k) for l2l and g2g, then "another segment" (2k + 1) and "its own
    segment" (2k + 2) linking long tokens and global tokens in l2g and g2l."""
    return 2 * max_distance + 3


def etc_arrays(key: PRNGKeyArray, *, heads: int, d_k: int, max_distance: int = 12) -> dict[str, Array]:
    """The learned relative position vectors a^K of Shaw et al., one per label and head:
    `relative_keys [2k + 3, heads, d_k]`, normal with std 0.02 (the authors' initializer
    range); none when `max_distance` is 0 (no relative positions)."""
    check_positive("max_distance", max_distance, minimum=0)
    if max_distance == 0:
        return {}
    return {"relative_keys": 0.02 * jax.random.normal(key, (etc_relative_labels(max_distance), heads, d_k))}


def _gather_labels(qa: Float[Array, "rows h g labels"], labels) -> Float[Array, "h g rows keys"]:
    """qa[i, :, :, labels[i, j]] laid out as logits `[h, g, rows, keys]`."""
    picked = jnp.take_along_axis(
        qa, jnp.broadcast_to(labels[:, None, None, :], (*qa.shape[:3], labels.shape[1])), axis=-1
    )
    return jnp.transpose(picked, (1, 2, 0, 3))


def etc_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    num_global: int = 1,
    local_radius: int = 84,
    global_every: int = 16,
    max_distance: int = 12,
    hard_g2l: bool = False,
    hard_l2g: bool = False,
    relative_keys: Float[ArrayLike, "labels heads _d_k"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """ETC's global-local attention (Ainslie et al. 2020, section 3.1-3.2).

    The first `num_global` positions are the global input, the rest the long input
    (long token t = position num_global + t). With g, g' global indices and t, t' long
    indices, query -> key is allowed for
      * g2g: every g -> g';
      * g2l: every g -> t, or with `hard_g2l` only t in g's segment;
      * l2g: every t -> g, or with `hard_l2g` only t's own global token;
      * l2l: t -> t' with |t - t'| <= local_radius.
    Segments tie long tokens to global tokens as the paper's experiments do (one global
    token per sentence or per fixed block): long token t belongs to segment
    t // global_every, whose global token is g = t // global_every (long tokens past
    the last global token's segment have none).

    Relative positions (section 3.2, Shaw et al. 2018): each allowed pair gets a label,
    the clipped distance clip(t' - t, -k, k) in l2l and clip(g' - g, -k, k) in g2g, and
    "own segment" or "other segment" in l2g and g2l; the logit is
    `scale * q_i . (k_j + a_label(i, j))` with a learned `a` per label and head
    (`relative_keys`, from `etc_arrays`). `max_distance=0` uses none.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` = num_global + long length.
        num_global: n_g, global tokens at the start of the sequence, 1 <= n_g < seq.
        local_radius: r, long keys each side of a long query, int >= 0.
        global_every: long tokens per segment (one global token each), int >= 1.
        max_distance: k, relative distances are clipped at k, int >= 0 (0: none).
        hard_g2l, hard_l2g: the paper's hard masks tying each global token to its segment.
        relative_keys: `[2k + 3, heads, d_k]`, the label vectors (None iff k = 0).
        causal: refused: ETC is an encoder; the paper defines no causal form.
        kv_mask: optional `[seq]`, True for real tokens (global and long alike).
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(n_l * (r + n_g) + n_g * seq) per head and feature: the long
    queries run a blocked sliding window plus the global keys; the global queries attend
    every key.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("num_global", num_global)
    check_positive("local_radius", local_radius, minimum=0)
    check_positive("global_every", global_every)
    check_positive("max_distance", max_distance, minimum=0)
    for name, flag in (("hard_g2l", hard_g2l), ("hard_l2g", hard_l2g)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool; got {flag!r}")
    if causal:
        raise ValueError(
            "etc attention cannot be causal: ETC (Ainslie et al. 2020) is an encoder and its paper "
            "defines no causal form; got causal=True"
        )
    check_self(q, k, v, kv_mask)
    n, heads, d_k = q.shape
    if num_global >= n:
        raise ValueError(
            f"num_global ({num_global}) must be smaller than the sequence length seq ({n}): "
            "the long input is what follows the global tokens"
        )
    labels = etc_relative_labels(max_distance)
    if max_distance == 0 and relative_keys is not None:
        raise ValueError("relative_keys given but max_distance is 0 (no relative positions)")
    if max_distance > 0:
        if relative_keys is None:
            raise ValueError(
                f"max_distance={max_distance} needs relative_keys [{labels}, {heads}, {d_k}] (etc_arrays makes them)"
            )
        if tuple(jnp.shape(relative_keys)) != (labels, heads, d_k):
            raise ValueError(
                f"relative_keys must have shape {(labels, heads, d_k)} (2 max_distance + 3 labels, "
                f"heads, d_k); got {tuple(jnp.shape(relative_keys))}"
            )
    g_n, l_n = num_global, n - num_global
    kv_heads = k.shape[1]
    scale = default_scale(d_k, scale)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    real = jnp.ones((n,), bool) if kv_mask is None else jnp.asarray(kv_mask)
    segment = positions(l_n) // global_every  # the global token of each long token
    own = segment[:, None] == positions(g_n)[None, :]  # [l_n, g_n]
    relative = max_distance > 0
    if relative:  # q_i . a_label for every label: [seq, h, g, labels], scaled like the logits
        qa = einsum_f32("nhgd,lhgd->nhgl", group_heads(q, kv_heads), group_heads(jnp.asarray(relative_keys), kv_heads))
        qa = qa * jnp.float32(scale)

    def with_bias(part: Part, bias) -> Part:
        return Part(part.logits + bias, part.mask, part.apply) if relative else part

    def clipped(delta):
        return jnp.clip(delta, -max_distance, max_distance) + max_distance

    # Global queries: g2g and g2l, every key of the sequence in one dense part.
    g2l = jnp.broadcast_to(real[None, g_n:], (g_n, l_n))
    if hard_g2l:
        g2l = g2l & own.T
    g_mask = jnp.concatenate([jnp.broadcast_to(real[None, :g_n], (g_n, g_n)), g2l], axis=1)
    g_part = dense_part(group_heads(q[:g_n], kv_heads), k, v, g_mask, scale)
    if relative:
        g_pos = positions(g_n)
        g_labels = jnp.concatenate([clipped(g_pos[None, :] - g_pos[:, None]), 2 * max_distance + 1 + own.T], axis=1)
        g_part = with_bias(g_part, _gather_labels(qa[:g_n], g_labels))
    out_global = rows_to_output(attend_parts([g_part]), g_n, out_dtype(q, k, v))

    # Long queries: l2l, a sliding window over the long input, and l2g, the global keys.
    block = window_block(l_n, local_radius)
    length, qg, kl, vl, real_l = prepare_self(q[g_n:], k[g_n:], v[g_n:], real[g_n:], block)
    window = sliding_window_part(qg, kl, vl, real_l, block=block, window=local_radius, causal=False, scale=scale)
    own_rows = jnp.pad(own, ((0, length - l_n), (0, 0)))
    l2g = jnp.broadcast_to(real[None, :g_n], (length, g_n))
    if hard_l2g:
        l2g = l2g & own_rows
    global_keys = dense_part(qg, k[:g_n], v[:g_n], l2g, scale)
    if relative:
        qa_long = jnp.pad(qa[g_n:], ((0, length - l_n), (0, 0), (0, 0), (0, 0)))
        rows = positions(length)
        slots = positions(window.logits.shape[-1])
        delta = (rows[:, None] // block) * block - block + slots[None, :] - rows[:, None]  # key - query
        window = with_bias(window, _gather_labels(qa_long, clipped(delta)))
        global_keys = with_bias(global_keys, _gather_labels(qa_long, 2 * max_distance + 1 + own_rows.astype(jnp.int32)))
    out_long = rows_to_output(attend_parts([window, global_keys]), l_n, out_dtype(q, k, v))
    return jnp.concatenate([out_global, out_long], axis=0)


register(
    "etc",
    etc_attention,
    family="fixed pattern + memory",
    paper="Ainslie et al. 2020 (ETC)",
    complexity="O(N (r + g))",
    supports_causal=False,
    exact=False,
    init_arrays=etc_arrays,
    docs={
        "num_global": "global tokens n_g, the first positions of the sequence",
        "local_radius": "r, long keys each side of a long query (l2l)",
        "global_every": "long tokens per segment, each tied to one global token",
        "max_distance": "k, relative position labels clipped at distance k (0: none)",
        "hard_g2l": "a global token attends only the long tokens of its segment",
        "hard_l2g": "a long token attends only its segment's global token",
    },
    summary=(
        "ETC: the first g positions global (g2g, g2l, l2g full; hard masks tie a global token to its "
        "segment), long tokens within radius r; relative position labels clipped at k"
    ),
    limits={"num_global": 1, "local_radius": 0, "global_every": 1, "max_distance": 0},
    dense_width=(
        "its local radius and global tokens (2 local_radius + 1 + num_global keys per long token)",
        lambda hp, n: 2 * hp["local_radius"] + 1 + hp["num_global"],
    ),
    scaled=(
        "local_radius = min(default, N / 16) keys each side: the local window a quarter to an eighth of the keys "
        "(Ainslie et al. 2020: radius 84 at 4,096)",
        lambda d, n: {"local_radius": fraction(n, 16, cap=d["local_radius"])},
    ),
)
