"""Learnable patterns (Tay et al. 2022, "Efficient Transformers: A Survey", arXiv
2009.06732v2, sections 3.2.9-3.2.11, Table 1 "LP"): attention whose
sparsity pattern is computed from the content, by hashing or clustering the tokens or by
a learned sort of blocks. Reformer's LSH attention (Kitaev et al., 2020), the Routing
Transformer (Roy et al., 2021), the Sinkhorn Transformer (Tay et al., 2020) and
Cluster-Former (Wang et al., 2020).

Each op works per head on one example. The bucketed ones (LSH, Cluster-Former, causal
Routing) sort the positions by (bucket, position), so every bucket is a run of the
sorted sequence in position order, and attend inside fixed-size chunks of that order
(`_sorted_chunks`; LSH's rounds concatenated, `_lsh_sorted_rounds`) or, when causal, to
the most recent keys of the query's own bucket (`_recent_keys`: the chunk boundaries of
the sorted order depend on how many later tokens fall into lower buckets, so a causal
chunked form would read the future).
Padded positions go to a bucket after every real one, so they never move a real token.

Their drawn arrays follow the registry: LSH's random rotations are drawn from a key and
redrawn by `nn.redraw`; the k-means centroids of Routing and Cluster-Former are drawn
once and then moved by an exponential moving average in training (`update_arrays`,
called by the train step outside the gradient); the Sinkhorn sorting network is learned.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers._arrays import read_values
from jxformers._typing import ArrayLike
from jxformers.decoding import TaggedCache
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    ceil_div,
    check_positive,
    check_self,
    default_scale,
    out_dtype,
    pad_to,
    positions,
    softmax_parts,
    to_blocks,
    valid_keys,
    warn_once_per_call_site,
    zero_padded,
)
from jxformers.ops.local import local_attention
from jxformers.ops.softmax import softmax_attention
from jxformers.registry import Decoder, fraction, register
from jxformers.validate import Limits

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "SharedQKWarning",
    "clusterformer_attention",
    "kmeans_centroids",
    "kmeans_update",
    "lsh_arrays",
    "lsh_attention",
    "lsh_buckets",
    "routing_attention",
    "sinkhorn_arrays",
    "sinkhorn_attention",
    "sinkhorn_balance",
]

_INT32_MAX = 2**31 - 1

# ----------------------------------------------------------------------------- shared pieces


def _heads_first(q: ArrayLike, k: ArrayLike, v: ArrayLike, length: int):
    """Pad to `length` and lay out per query head in float32: q, k, v `[heads, length, d]`
    (each kv head repeated for its group of query heads)."""
    group = q.shape[1] // k.shape[1]

    def lay(x, repeat):
        x = jnp.moveaxis(pad_to(jnp.asarray(x), length), 1, 0).astype(jnp.float32)
        return jnp.repeat(x, repeat, axis=0)

    return lay(q, 1), lay(k, group), lay(v, group)


def _unit(x: Array) -> Array:
    """x / |x| along the last axis (zero vectors stay zero)."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))
    return x / jnp.maximum(norm, 1e-6)


def _joint_softmax(parts: list[tuple[Array, Array]]) -> list[Array]:
    """`softmax_parts` for logits of any rank (lifted to its [*n, h, g, q, k] layout)."""
    lift = max(0, 4 - min(s.ndim for s, _ in parts))
    lifted = [(s.reshape((1,) * lift + s.shape), m.reshape((1,) * lift + m.shape)) for s, m in parts]
    return [p.reshape(p.shape[lift:]) for p in softmax_parts(lifted)]


def _softmax_lse(s: Array, m: Array) -> tuple[Array, Array]:
    """Masked softmax over the last axis and its log-sum-exp (-inf for an empty row,
    whose probabilities are zeros)."""
    p = _joint_softmax([(s, m)])[0]
    top = jax.lax.stop_gradient(jnp.max(jnp.where(m, s, -jnp.inf), axis=-1))
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    total = jnp.sum(jnp.where(m, jnp.exp(s - safe[..., None]), 0.0), axis=-1)
    empty = total <= 0  # a NaN total stays NaN (`not total > 0` dropped the row silently)
    lse = jnp.where(empty, -jnp.inf, jnp.log(jnp.where(empty, 1.0, total)) + safe)
    return p, lse


def _unless_alone(mask: Array, is_self: Array) -> Array:
    """Reformer's self-mask: a query never attends to its own position unless it has no
    other key to attend to."""
    others = jnp.any(mask & ~is_self, axis=-1, keepdims=True)
    return mask & (~is_self | ~others)


def _sorted_chunks(q, k, v, bucket, real, *, chunk: int, scale: float):
    """One head: sort positions by (bucket, position), cut the order into chunks of
    `chunk`, and let each query attend to the keys of its own chunk (Cluster-Former).
    q, k `[L, d]`, v `[L, dv]`, bucket, real `[L]` (L a multiple of chunk). Returns out
    `[L, dv]` in position order."""
    length = q.shape[0]
    order = jnp.argsort(bucket, stable=True)  # stable: positions ascend within a bucket
    qb, kb, vb, rb = (to_blocks(x[order], chunk) for x in (q, k, v, real))
    s = jnp.einsum("ncd,nkd->nck", qb, kb) * scale
    m = jnp.broadcast_to(rb[:, None, :], s.shape)
    p = _joint_softmax([(s, m)])[0]
    out = read_values("nck,nkd->ncd", p, vb, reads=m).reshape(length, -1)
    return jnp.zeros_like(out).at[order].set(out)


def _recent_keys(q_bucket, k_bucket, real, *, window: int, self_mask: bool):
    """One head, causal: for each query i, the `window + 1` most recent keys j <= i whose
    bucket is the query's (itself included), gathered from the keys sorted by (bucket,
    position). Which keys those are depends on earlier tokens only. Returns (key
    positions `[L, window + 1]`, which of them are attended `[L, window + 1]`)."""
    length = q_bucket.shape[0]
    pos = positions(length)
    order = jnp.argsort(k_bucket, stable=True)
    sorted_key = k_bucket[order] * length + pos[order]  # ascending
    end = jnp.searchsorted(sorted_key, q_bucket * length + pos, side="right")  # keys (b, j) <= (b_i, i)
    slot = end[:, None] - 1 - jnp.arange(window + 1)[None, :]
    j = order[jnp.clip(slot, 0, length - 1)]  # [L, window + 1] key positions
    m = (slot >= 0) & (k_bucket[j] == q_bucket[:, None]) & real[j]
    if self_mask:
        m = _unless_alone(m, j == pos[:, None])
    return j, m


def _attend_gathered(q, k, v, j, m, *, scale: float, log_count=None):
    """Each query i attends to its gathered keys j `[L, w]` where m; `log_count` (if
    given, `[L, w]`) is subtracted from the logits. Returns (out `[L, dv]`, lse `[L]`)."""
    s = jnp.einsum("ld,lwd->lw", q, k[j]) * scale
    if log_count is not None:
        s = s - log_count
    p, lse = _softmax_lse(s, m)
    return read_values("lw,lwd->ld", p, v[j], reads=m), lse


def _recent_in_bucket(q, k, v, q_bucket, k_bucket, real, *, window: int, self_mask: bool, scale: float):
    """One head, causal: query i attends to `_recent_keys` (the `window + 1` most recent
    keys j <= i of its bucket): O(L * window * d). Returns (out `[L, dv]`, lse `[L]`)."""
    j, m = _recent_keys(q_bucket, k_bucket, real, window=window, self_mask=self_mask)
    return _attend_gathered(q, k, v, j, m, scale=scale)


def _log_duplicates(j: Int[Array, "r L w"], m: Bool[Array, "r L w"]) -> Float[Array, "r L w"]:
    """log N_ij of Reformer's appendix: how many times query i attends key j over all its
    hash rounds' windows (each round's gathered keys `j`, attended where `m`)."""
    rounds, length, width = j.shape
    all_j = jnp.moveaxis(j, 0, 1).reshape(length, rounds * width)  # query i's keys in every round
    all_m = jnp.moveaxis(m, 0, 1).reshape(length, rounds * width)
    count = jnp.sum((j[..., None] == all_j[None, :, None, :]) & all_m[None, :, None, :], axis=-1)
    return jnp.log(jnp.maximum(count, 1).astype(jnp.float32))


def _lsh_sorted_rounds(q, keys, v, buckets, real, *, chunk: int, scale: float):
    """One head, not causal: Reformer's chunked attention over the hash rounds as the
    authors' trax code lays it out. Each round sorts the positions by (bucket, position);
    the rounds' orders are concatenated and cut into chunks of `chunk` (a round is a whole
    number of chunks); each chunk attends to itself and the chunk before it in the
    concatenation, so a round's first chunk sees the previous round's last one (round
    0's, the last round's: trax's `look_adjacent` wraps). A token never attends to itself
    unless it has nothing else. A key found n times among a query's windows of all rounds
    has log n subtracted from its logits (the appendix's correction), so the rounds'
    log-sum-exp combination is one softmax over the keys the query found. q, keys `[L, d]`,
    v `[L, dv]`, buckets `[r, L]`, real `[L]`. Returns (out `[r, L, dv]`, lse `[r, L]`)."""
    rounds, length = buckets.shape
    order = jax.vmap(lambda b: jnp.argsort(b, stable=True))(buckets)  # [r, L], positions ascend in a bucket
    n_chunks = rounds * length // chunk
    qp = order.reshape(n_chunks, chunk)  # the positions in each chunk of the concatenation
    kp = jnp.concatenate([jnp.roll(qp, 1, axis=0), qp], axis=1)  # the chunk before, then its own
    s = jnp.einsum("ncd,nkd->nck", q[qp], keys[kp]) * scale
    m, is_self = jnp.broadcast_to(real[kp][:, None, :], s.shape), qp[:, :, None] == kp[:, None, :]
    has_other = jnp.zeros((length,), bool).at[qp].max(jnp.any(m & ~is_self, axis=-1))  # in any round
    m = m & (~is_self | ~has_other[qp][..., None])
    # The chunk holding each position in each round, then N_ij: the occurrences of key j
    # (in any round's order) in the chunks query i reads in each round (its own and the one
    # before). The self key (attended only by a query with nothing else) counts once.
    rank = jnp.zeros((rounds, length), jnp.int32).at[positions(rounds)[:, None], order].set(positions(length)[None])
    where = (positions(rounds)[:, None] * length + rank) // chunk  # [r, L]
    read_q = where[:, qp]  # [r', n, c]: query i's chunk in round r'
    at_k = where[:, kp]  # [r'', n, 2c]: key j's chunk in round r''
    own = read_q[:, None, :, :, None] == at_k[None, :, :, None, :]  # [r', r'', n, c, 2c]
    before = (read_q[:, None, :, :, None] - 1) % n_chunks == at_k[None, :, :, None, :]
    count = jnp.sum(own | before, axis=(0, 1))
    count = jnp.where(qp[:, :, None] == kp[:, None, :], 1, count)
    p, lse = _softmax_lse(s - jnp.log(jnp.maximum(count, 1).astype(jnp.float32)), m)
    out = read_values("nck,nkd->ncd", p, v[kp], reads=m).reshape(rounds, length, -1)
    lse = lse.reshape(rounds, length)
    unsort = lambda x, o: jnp.zeros_like(x).at[o].set(x)  # noqa: E731
    return jax.vmap(unsort)(out, order), jax.vmap(unsort)(lse, order)


def _combine_rounds(outs: Float[Array, "r *L dv"], lses: Float[Array, " r *L"]) -> Float[Array, "*L dv"]:
    """Hash rounds combined by their log-sum-exp weights, o = sum_r exp(z^r - z) o^r
    (rounds where a query had no key weigh nothing)."""
    top = jnp.max(lses, axis=0, keepdims=True)
    w = jnp.where(jnp.isfinite(lses), jnp.exp(lses - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    total = w.sum(0, keepdims=True)
    w = w / jnp.where(total > 0, total, 1.0)
    return jnp.sum(w[..., None] * outs, axis=0)


# ----------------------------------------------------------------------------- decoding


def _recent_mask(buckets, bucket, filled, t, *, window: int, self_mask: bool):
    """The cache slots `_recent_keys` gives the query at position t (the window + 1 most
    recent of its bucket up to t), found by counting, in position order, the same-bucket
    keys after each slot."""
    same = filled & (buckets == bucket)
    after = jnp.cumsum(same[::-1].astype(jnp.int32))[::-1] - same.astype(jnp.int32)
    m = same & (after <= window)
    if self_mask:
        m = _unless_alone(m, positions(buckets.shape[0]) == t)
    return m


def _recent_step(q, keys, values, buckets, bucket, filled, t, *, window: int, self_mask: bool, scale: float):
    """One query at position t against the cache, attending to `_recent_mask`'s slots.
    Returns (out [dv], log-sum-exp [])."""
    m = _recent_mask(buckets, bucket, filled, t, window=window, self_mask=self_mask)
    p, lse = _softmax_lse(keys @ q * scale, m)
    return p @ values, lse


def _check_bucket_range(n_buckets: int, length: int) -> None:
    if (n_buckets + 1) * length > _INT32_MAX:
        raise ValueError(f"n_buckets ({n_buckets}) times the padded length ({length}) must stay below 2**31")


def _nearest(x: Float[Array, "L d"], centroids: Float[Array, "c d"]) -> Int[Array, " L"]:
    """Index of the nearest centroid on the unit sphere (largest cosine)."""
    return jnp.argmax(_unit(x) @ _unit(centroids).T, axis=-1).astype(jnp.int32)


def _to_output(out: Float[Array, "heads L dv"], n: int, dtype) -> Float[Array, "n heads dv"]:
    return jnp.moveaxis(out, 0, 1)[:n].astype(dtype)


def kmeans_centroids(key: PRNGKeyArray, *, heads: int, d_k: int, n_clusters: int = 4) -> dict[str, Array]:
    """Initial k-means centroids `[heads, n_clusters, d_k]`: random unit vectors (drawn
    once; training moves them with `update_arrays`)."""
    check_positive("n_clusters", n_clusters)
    return {"centroids": _unit(jax.random.normal(key, (heads, n_clusters, d_k)))}


def kmeans_update(
    centroids: Float[ArrayLike, "heads c d"],
    x: Float[ArrayLike, "m heads d"],
    real: Bool[ArrayLike, " m"],
    *,
    decay: float,
) -> Float[Array, "heads c d"]:
    """One step of online mini-batch k-means on the unit sphere (Roy et al. 2021, eq. 11):
    every centroid moves towards the mean of the unit-normalised vectors nearest to it,
    mu <- decay * mu + (1 - decay) * mean; a centroid no vector chose stays. `x` holds the
    batch's vectors (padding marked False in `real`); no gradient flows."""
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"{decay=} must be in [0, 1)")
    centroids = jnp.asarray(centroids, jnp.float32)
    xn = _unit(jax.lax.stop_gradient(jnp.asarray(x, jnp.float32)))
    assign = jnp.argmax(jnp.einsum("mhd,hcd->mhc", xn, _unit(centroids)), axis=-1)
    onehot = jax.nn.one_hot(assign, centroids.shape[1]) * jnp.asarray(real, jnp.float32)[:, None, None]
    counts = onehot.sum(0)  # [heads, c]
    means = jnp.einsum("mhc,mhd->hcd", onehot, xn) / jnp.maximum(counts, 1.0)[..., None]
    moved = decay * centroids + (1.0 - decay) * means
    return jnp.where(counts[..., None] > 0, moved, centroids)


def _check_centroids(op: str, centroids, heads: int, n_clusters: int, d_k: int) -> None:
    if centroids is None:
        raise ValueError(f"{op} needs its `centroids` (kmeans_centroids(key, ...) or the registry's init_arrays)")
    if tuple(centroids.shape) != (heads, n_clusters, d_k):
        raise ValueError(
            f"centroids must have shape {(heads, n_clusters, d_k)} for {heads=}, {n_clusters=}, "
            f"{d_k=}; got {tuple(centroids.shape)}"
        )


def _flat(q, k, kv_mask):
    """A batch `[batch, L, heads, d]` (and its `[batch, L]` mask) as `[batch * L, ...]`."""
    real = jnp.ones(q.shape[:2], bool) if kv_mask is None else kv_mask
    return q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), real.reshape(-1)


# ----------------------------------------------------------------------------- Reformer


class SharedQKWarning(UserWarning):
    """`lsh_attention` was called by hand with a `k` that is not `q`: Reformer's LSH
    attention is shared-QK (Kitaev et al. 2020, "Reformer: The Efficient Transformer",
    section 2), its keys are the queries normalised to unit length, so that `k` is never
    read. Said once per call site. Pass `k=q`, or `warn_unused_k=False` where the keys
    are known to be unused (grouped kv heads; the registry's binding, and so every model,
    passes it)."""


def lsh_arrays(key: PRNGKeyArray, *, heads: int, d_k: int, n_buckets: int = 8, n_hashes: int = 2) -> dict[str, Array]:
    """LSH's drawn random rotations `[heads, n_hashes, d_k, max(n_buckets // 2, 1)]`
    (Kitaev et al. section 2: R with i.i.d. N(0, 1) entries), redrawn with the module."""
    check_positive("n_hashes", n_hashes)
    check_positive("n_buckets", n_buckets)
    return {"rotations": jax.random.normal(key, (heads, n_hashes, d_k, max(n_buckets // 2, 1)))}


def lsh_buckets(
    x: Float[ArrayLike, "L d"], rotations: Float[ArrayLike, "n_hashes d half"], n_buckets: int
) -> Int[Array, "n_hashes L"]:
    """h(x) = argmax([xR; -xR]) for each hash round's rotation R (all zeros for one bucket)."""
    rotated = jnp.einsum("ld,rdh->rlh", jnp.asarray(x, jnp.float32), jnp.asarray(rotations, jnp.float32))
    if n_buckets == 1:
        return jnp.zeros(rotated.shape[:2], jnp.int32)
    return jnp.argmax(jnp.concatenate([rotated, -rotated], axis=-1), axis=-1).astype(jnp.int32)


@causal_never_reads_non_finite_future(keys_from_q=True)
def lsh_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    n_buckets: int = 8,
    n_hashes: int = 2,
    chunk_size: int = 64,
    rotations: Float[ArrayLike, "heads n_hashes _d_k half"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
    warn_unused_k: bool = True,
) -> Float[Array, "seq heads d_v"]:
    """Reformer's LSH attention (Kitaev et al., 2020, section 2), shared-QK.

    Keys are the queries normalised to unit length, k_j = q_j / |q_j|: the `k` argument
    is unused (its shape is checked, and its kv heads group the values), and a call whose
    `k` is not `q` warns (`SharedQKWarning`, once per call site) unless `warn_unused_k`
    is False. The registry's binding passes False (`register(..., shared_qk=True)` says
    it), so models never warn; their key projection is unused. Each of `n_hashes` rounds hashes every position with
    h(x) = argmax([xR; -xR]) for its random rotation R and sorts the positions by
    (bucket, position); as the authors' trax code, the rounds' orders are concatenated
    and cut into chunks of `chunk_size`, and each query attends to its own chunk and the
    chunk before it in the concatenation (a round's first chunk sees the previous round's
    last, round 0's the last round's), never to itself unless it has nothing else in
    any round. A key a query finds N_ij times over its rounds has log N_ij subtracted
    from its logits (the paper's appendix), and the rounds' outputs are combined by
    their log-sum-exp weights, o_i = sum_r exp(z_i^r - z_i) o_i^r: together one softmax
    over the keys found in any round. Logits are divided by sqrt(d_k).

    Causal: the paper's chunks of the sorted order would let later tokens move the chunk
    boundaries (how many of them fall into lower buckets), reading the future; here a
    query attends, in each round, to the `chunk_size` most recent earlier positions of
    its own bucket (plus itself when alone in every round), which depends on the past
    only; duplicates are counted as above.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (any length; grouped values).
        n_buckets: hash buckets, 1 or even (the hash splits [xR; -xR]).
        n_hashes: hash rounds.
        chunk_size: tokens per chunk of the sorted order (keys behind, when causal).
        rotations: `[heads, n_hashes, d_k, max(n_buckets // 2, 1)]` drawn rotations
            (`lsh_arrays`); a new key gives new hashes.
        causal: restrict to the past (see above).
        kv_mask: optional `[seq]`, True for real tokens; padded ones are hashed to a
            bucket after every real one and never attended.
        scale: default `1 / sqrt(d_k)`.
        warn_unused_k: False silences the `SharedQKWarning` of a `k` that is not `q`
            (the caller knows the keys come from `q`).

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(n_hashes * seq * chunk_size * d) plus the sort. Decodes its causal
    form one token at a time against a cache of every key and its buckets.
    """
    if warn_unused_k and k is not q:  # a hand-written model may expect its key projection to be used
        warn_once_per_call_site(
            "lsh_attention ignores its `k` argument (SharedQKWarning): Reformer's LSH attention is shared-QK "
            '(Kitaev et al. 2020, "Reformer: The Efficient Transformer", section 2), its keys are the queries '
            "normalised to unit length, k_j = q_j / |q_j|; pass k=q, or warn_unused_k=False to silence this",
            SharedQKWarning,
        )
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("n_buckets", n_buckets)
    if n_buckets != 1 and n_buckets % 2:
        raise ValueError(f"{n_buckets=} must be 1 or even (the hash is argmax over [xR; -xR])")
    check_positive("n_hashes", n_hashes)
    check_positive("chunk_size", chunk_size)
    check_self(q, k, v, kv_mask)
    heads, d_k = q.shape[1], q.shape[2]
    if rotations is None:
        raise ValueError(
            "lsh_attention needs its drawn `rotations` (lsh_arrays(key, ...) or the registry's init_arrays)"
        )
    want = (heads, n_hashes, d_k, max(n_buckets // 2, 1))
    if tuple(rotations.shape) != want:
        raise ValueError(
            f"rotations must have shape {want} for {heads=}, {n_hashes=}, {d_k=}, {n_buckets=}; "
            f"got {tuple(rotations.shape)}"
        )
    n = q.shape[0]
    chunk = min(chunk_size, n)
    length = ceil_div(n, chunk) * chunk
    _check_bucket_range(n_buckets, length)
    real = valid_keys(kv_mask, n, length)
    qh, _, vh = _heads_first(q, k, v, length)
    keys = _unit(qh)
    scale = default_scale(d_k, scale)

    def head(q_h, key_h, v_h, rot_h):
        buckets = jnp.where(real[None], lsh_buckets(q_h, rot_h, n_buckets), n_buckets)  # padding sorts last

        if not causal:
            return _combine_rounds(*_lsh_sorted_rounds(q_h, key_h, v_h, buckets, real, chunk=chunk, scale=scale))
        j, m = jax.vmap(lambda b: _recent_keys(b, b, real, window=chunk, self_mask=False))(buckets)
        is_self = j == positions(length)[None, :, None]
        has_other = jnp.any(m & ~is_self, axis=(0, 2))  # in any round
        m = m & (~is_self | ~has_other[None, :, None])
        log_count = _log_duplicates(j, m)
        attend = lambda j, m, c: _attend_gathered(q_h, key_h, v_h, j, m, scale=scale, log_count=c)  # noqa: E731
        return _combine_rounds(*jax.vmap(attend)(j, m, log_count))  # rounds [R, L, dv], [R, L]

    out = jax.vmap(head)(qh, keys, vh, jnp.asarray(rotations))
    return _to_output(out, n, out_dtype(q, k, v))


def _lsh_init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> TaggedCache:
    heads, rounds = arrays["rotations"].shape[:2]
    return TaggedCache(
        jnp.zeros((max_len, heads, d_k), jnp.float32),
        jnp.zeros((max_len, kv_heads, d_v), jnp.float32),
        jnp.zeros((max_len, heads, rounds), jnp.int32),
        jnp.zeros((), jnp.int32),
    )


def _lsh_step(q, k, v, state: TaggedCache, *, hyper_parameters, arrays, bias_fn):
    """The causal form, one token: its key (its own query, normalised) and buckets join
    the cache; each round attends to the chunk_size most recent earlier keys of the
    query's bucket (itself only when alone in every round), a key found in N rounds with
    log N subtracted from its logits; rounds combine by log-sum-exp."""
    hp = hyper_parameters
    t, rotations = state.length, arrays["rotations"]
    qf = jnp.asarray(q, jnp.float32)
    buckets = jax.vmap(lambda x, r: lsh_buckets(x[None], r, hp["n_buckets"])[:, 0])(qf, rotations)  # [heads, R]
    state = TaggedCache(
        state.k.at[t].set(_unit(qf)), state.v.at[t].set(v.astype(jnp.float32)), state.buckets.at[t].set(buckets), t + 1
    )
    filled = positions(state.k.shape[0]) <= t
    group = q.shape[0] // v.shape[0]
    scale = default_scale(q.shape[1], None)

    def head(h):
        masks = jax.vmap(
            lambda cached, b: _recent_mask(cached, b, filled, t, window=hp["chunk_size"], self_mask=False),
            in_axes=(1, 0),
        )(state.buckets[:, h], buckets[h])  # [R, slots]
        masks = _unless_alone(masks.any(0), positions(masks.shape[1]) == t)[None] & masks  # self unless alone in all
        # log N_ij: the rounds in which the query attends slot j (the appendix's correction)
        s = state.k[:, h] @ qf[h] * scale - jnp.log(jnp.maximum(masks.sum(0), 1).astype(jnp.float32))
        p, lse = jax.vmap(lambda m: _softmax_lse(s, m))(masks)
        return _combine_rounds(p @ state.v[:, h // group], lse)

    return jax.vmap(head)(jnp.arange(q.shape[0])).astype(q.dtype), state


register(
    "lsh",
    lsh_attention,
    family="learnable pattern",
    paper="Kitaev et al. 2020 (Reformer)",
    complexity="O(N c r)",
    exact=False,
    init_arrays=lsh_arrays,
    drawn=("rotations",),
    shared_qk=True,
    decoder=Decoder("tagged cache", _lsh_init, _lsh_step),
    docs={
        "n_buckets": "hash buckets (1 or even)",
        "n_hashes": "hash rounds r",
        "chunk_size": "c, tokens per chunk of the sorted order (keys behind when causal)",
    },
    summary=(
        "Reformer: shared-QK keys q/‖q‖ hashed by random rotations in r rounds (combined by log-sum-exp, "
        "duplicates counted), sorted by (bucket, position), own + previous chunk of the concatenated rounds, "
        "self-mask; causal: the chunk_size latest keys of the own bucket"
    ),
    limits={
        "n_buckets": Limits(minimum=1, rule=(lambda n: n == 1 or n % 2 == 0, "1 or even")),
        "n_hashes": 1,
        "chunk_size": 1,
    },
    dense_width=("its chunks (2 chunk_size keys per hash round)", lambda hp, n: 2 * hp["chunk_size"]),
    scaled=(
        "chunk_size = min(default, N / 8): at least eight chunks of the sorted order, a query reading two of "
        "them a round (Kitaev et al. 2020: chunks of 64 at 4,096 and more)",
        lambda d, n: {"chunk_size": fraction(n, 8, cap=d["chunk_size"])},
    ),
)


# ----------------------------------------------------------------------------- Routing Transformer


def _routing_heads(heads: int, kv_heads: int, local_heads: int | None) -> int:
    """The number of local heads: by default half the kv heads' groups (the paper's
    half local, half routing), aligned to whole groups of query heads."""
    group = heads // kv_heads
    if local_heads is None:
        return (kv_heads // 2) * group
    if local_heads < 0 or local_heads > heads or local_heads % group:
        raise ValueError(
            f"{local_heads=} must be a multiple of the query heads per kv head ({group}) between 0 and heads ({heads})"
        )
    return local_heads


@causal_never_reads_non_finite_future()
def routing_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    n_clusters: int = 4,
    local_heads: int | None = None,
    local_window: int = 32,
    max_len: int = 1024,
    centroids: Float[ArrayLike, "heads n_clusters _d_k"] | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Routing Transformer attention (Roy et al., 2021): content-based clusters from
    online k-means, combined with local attention heads.

    The first `local_heads` query heads run `local_attention` (window `local_window`);
    the others route. A routing head compares the unit-normalised queries and keys with
    its `n_clusters` centroids (shared by queries and keys) and attends within clusters
    of balanced size w = ceil(seq / n_clusters): each centroid takes its w nearest queries
    and its w nearest keys (top-w), its queries attend to its keys, and a query chosen by
    several centroids averages their outputs (one chosen by none gets zeros from its
    routing head). The centroids are state, not parameters: training moves them towards
    the data by an exponential moving average (`routing_update`, the registry's
    `update_arrays`), never by the gradient.

    Causal: a top-w among keys would let a later key push an earlier one out of the
    cluster (reading the future), so each query attends to the w + 1 most recent keys
    j <= i routed to its own nearest centroid (each token routed to its nearest centroid),
    with w = ceil(max_len / n_clusters) fixed by the model's length, not by the length of
    the call: a query's keys then depend on its past only, so a prefix of any length gives
    the outputs that cached decoding gives (the authors' code also fixes the window,
    `sparsity_cluster_attention_window`).

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        n_clusters: k-means clusters per routing head (the paper uses about sqrt(seq)).
        local_heads: query heads doing local attention, a multiple of heads // kv_heads;
            default half the kv heads' groups.
        local_window: keys each side (behind when causal) of the local heads.
        max_len: the longest sequence (models fill in theirs); the causal window is
            w = ceil(max_len / n_clusters).
        centroids: `[heads, n_clusters, d_k]` (`kmeans_centroids`).
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens (padded keys are never chosen
            while real ones remain, and never attended).
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * w * d) per routing head, O(seq^1.5) at n_clusters = sqrt(seq).
    Decodes its causal form against a cache of every key and its cluster, with the same
    w = ceil(max_len / n_clusters): cached decoding equals the causal forward at every
    prefix length.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("n_clusters", n_clusters)
    check_positive("local_window", local_window, minimum=0)
    check_positive("max_len", max_len)
    check_self(q, k, v, kv_mask)
    heads, kv_heads, d_k = q.shape[1], k.shape[1], q.shape[2]
    _check_centroids("routing_attention", centroids, heads, n_clusters, d_k)
    n_local = _routing_heads(heads, kv_heads, local_heads)
    group = heads // kv_heads
    n = q.shape[0]
    dtype = out_dtype(q, k, v)
    parts = []
    if n_local:
        kv_local = n_local // group
        parts.append(
            local_attention(
                q[:, :n_local],
                k[:, :kv_local],
                v[:, :kv_local],
                window=local_window,
                causal=causal,
                kv_mask=kv_mask,
                scale=scale,
            ).astype(dtype)
        )
    if n_local < heads:
        kv_local = n_local // group
        _check_bucket_range(n_clusters, n)
        real = valid_keys(kv_mask, n, n)
        qh, kh, vh = _heads_first(q[:, n_local:], k[:, kv_local:], v[:, kv_local:], n)
        mu = jnp.asarray(centroids, jnp.float32)[n_local:]
        width = ceil_div(n, n_clusters)  # balanced clusters of this sequence (not causal)
        sc = default_scale(d_k, scale)

        def head(q_h, k_h, v_h, mu_h):
            if causal:  # a window fixed by max_len: the decoder's at every prefix
                qc = _nearest(q_h, mu_h)
                kc = jnp.where(real, _nearest(k_h, mu_h), n_clusters)
                window = min(ceil_div(max_len, n_clusters), n)  # more than n keys are never there
                out, _ = _recent_in_bucket(q_h, k_h, v_h, qc, kc, real, window=window, self_mask=False, scale=sc)
                return out
            # Each centroid's top-w queries and top-w keys (padding last).
            score_q = jnp.where(real[:, None], _unit(q_h) @ _unit(mu_h).T, -jnp.inf)
            score_k = jnp.where(real[:, None], _unit(k_h) @ _unit(mu_h).T, -jnp.inf)
            qi = jax.lax.top_k(score_q.T, width)[1]  # [c, w]
            ki = jax.lax.top_k(score_k.T, width)[1]
            s = jnp.einsum("cwd,cud->cwu", q_h[qi], k_h[ki]) * sc
            p = _joint_softmax([(s, jnp.broadcast_to(real[ki][:, None, :], s.shape))])[0]
            o = jnp.einsum("cwu,cud->cwd", p, v_h[ki])
            total = jnp.zeros((n, o.shape[-1]), o.dtype).at[qi.reshape(-1)].add(o.reshape(-1, o.shape[-1]))
            count = jnp.zeros((n,), o.dtype).at[qi.reshape(-1)].add(1.0)
            return total / jnp.maximum(count, 1.0)[:, None]

        parts.append(_to_output(jax.vmap(head)(qh, kh, vh, mu), n, dtype))
    return jnp.concatenate(parts, axis=1)


def routing_update(
    arrays: dict,
    q: Float[ArrayLike, "batch seq heads d_k"],
    k: Float[ArrayLike, "batch seq kv_heads d_k"],
    *,
    kv_mask: Bool[ArrayLike, "batch seq"] | None = None,
    decay: float = 0.999,
) -> dict[str, Array]:
    """The centroids after one training batch: online k-means on the unit-normalised
    queries and keys together (Roy et al. eq. 11; `kmeans_update`)."""
    qf, kf, real = _flat(jnp.asarray(q), jnp.asarray(k), kv_mask)
    kf = jnp.repeat(kf, qf.shape[1] // kf.shape[1], axis=1)
    x, both = jnp.concatenate([qf, kf]), jnp.concatenate([real, real])
    return {"centroids": kmeans_update(arrays["centroids"], x, both, decay=decay)}


def _routing_init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> TaggedCache:
    heads = arrays["centroids"].shape[0]
    return TaggedCache(
        jnp.zeros((max_len, kv_heads, d_k), jnp.float32),
        jnp.zeros((max_len, kv_heads, d_v), jnp.float32),
        jnp.zeros((max_len, heads, 1), jnp.int32),
        jnp.zeros((), jnp.int32),
    )


def _routing_step(q, k, v, state: TaggedCache, *, hyper_parameters, arrays, bias_fn):
    """The causal form, one token: local heads attend to the last local_window + 1 keys;
    a routing head attends to the w + 1 most recent keys routed to its query's nearest
    centroid, w = ceil(max_len / n_clusters) with the hyper-parameter max_len (the
    parallel causal form's w at every length)."""
    hp = hyper_parameters
    t, mu = state.length, jnp.asarray(arrays["centroids"], jnp.float32)
    heads, kv_heads, slots = q.shape[0], k.shape[0], state.k.shape[0]
    group = heads // kv_heads
    qf, kf = jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)
    key_cluster = jax.vmap(lambda h: _nearest(kf[h // group][None], mu[h])[0])(jnp.arange(heads))
    state = TaggedCache(
        state.k.at[t].set(kf),
        state.v.at[t].set(v.astype(jnp.float32)),
        state.buckets.at[t, :, 0].set(key_cluster),
        t + 1,
    )
    filled = positions(slots) <= t
    n_local = _routing_heads(heads, kv_heads, hp["local_heads"])
    scale = default_scale(q.shape[1], None)
    outs = []
    if n_local:
        near = filled & (t - positions(slots) <= hp["local_window"])
        kv_local = n_local // group
        outs.append(
            softmax_attention(qf[None, :n_local], state.k[:, :kv_local], state.v[:, :kv_local], kv_mask=near)[0]
        )
    if n_local < heads:
        width = min(ceil_div(hp["max_len"], hp["n_clusters"]), slots)

        def head(h):
            cluster = _nearest(qf[h][None], mu[h])[0]
            return _recent_step(
                qf[h],
                state.k[:, h // group],
                state.v[:, h // group],
                state.buckets[:, h, 0],
                cluster,
                filled,
                t,
                window=width,
                self_mask=False,
                scale=scale,
            )[0]

        outs.append(jax.vmap(head)(jnp.arange(n_local, heads)))
    return jnp.concatenate(outs).astype(q.dtype), state


register(
    "routing",
    routing_attention,
    family="learnable pattern",
    paper="Roy et al. 2021 (Routing Transformer)",
    complexity="O(N^1.5) at k = sqrt N",
    exact=False,
    init_arrays=kmeans_centroids,
    drawn=("centroids",),
    redrawn=False,
    update_arrays=routing_update,
    covers_length="max_len",
    decoder=Decoder("tagged cache", _routing_init, _routing_step),
    docs={
        "n_clusters": "k-means clusters k per routing head (about sqrt(N))",
        "local_heads": "query heads doing local attention (default half)",
        "local_window": "keys each side of the local heads",
        "max_len": "longest sequence; the causal window is ceil(max_len / n_clusters)",
        "decay": "EMA decay of the centroids in training",
    },
    summary=(
        "Routing Transformer: online k-means centroids (EMA in training), balanced top-w clusters of queries "
        "and keys, plus local heads; causal: the w = max_len / k latest keys of the query's cluster"
    ),
    limits={"n_clusters": 1, "local_heads": 0, "local_window": 0, "max_len": 1, "decay": Limits(minimum=0, below=1)},
    dense_width=("its clusters (max_len / n_clusters keys)", lambda hp, n: -(-n // hp["n_clusters"])),
    scaled=(
        "n_clusters = max(default, floor(sqrt(N))): Roy et al. 2021's k about sqrt(N), so a cluster holds about "
        "sqrt(N) keys at any length; local_window = min(default, N / 8) keys each side, as local attention's",
        lambda d, n: {
            "n_clusters": max(d["n_clusters"], math.isqrt(n)),
            "local_window": fraction(n, 8, cap=d["local_window"]),
        },
    ),
)


# ----------------------------------------------------------------------------- Sinkhorn Transformer


def sinkhorn_arrays(
    key: PRNGKeyArray, *, heads: int, d_k: int, block_size: int = 64, max_len: int = 1024
) -> dict[str, Array]:
    """The sorting network's learned weights per head, a two-layer ReLU network from a
    block's key sum to its logits over the ceil(max_len / block_size) blocks:
    sort_w1 `[heads, d_k, d_k]`, sort_b1 `[heads, d_k]`, sort_w2 `[heads, d_k, blocks]`,
    sort_b2 `[heads, blocks]` (LeCun normal, zero biases)."""
    check_positive("block_size", block_size)
    check_positive("max_len", max_len)
    blocks = ceil_div(max_len, block_size)
    k1, k2 = jax.random.split(key)
    return {
        "sort_w1": jax.random.normal(k1, (heads, d_k, d_k)) / math.sqrt(d_k),
        "sort_b1": jnp.zeros((heads, d_k)),
        "sort_w2": jax.random.normal(k2, (heads, d_k, blocks)) / math.sqrt(d_k),
        "sort_b2": jnp.zeros((heads, blocks)),
    }


def sinkhorn_balance(
    log_r: Float[ArrayLike, "m n"], allowed: Bool[ArrayLike, "m n"], iters: int, *, rows_only: bool = False
) -> Float[Array, "m n"]:
    """Sinkhorn normalisation in log space (Adams & Zemel 2011): `iters` rounds of row
    then column normalisation over the allowed entries; returns the soft permutation
    exp(log P) (zeros where not allowed, and on empty rows). `rows_only`: normalise rows
    only (the causal form, where a column sum would read later rows)."""

    def normalise(x, axis):
        top = jnp.max(x, axis=axis, keepdims=True)
        top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
        total = jnp.sum(jnp.exp(x - top), axis=axis, keepdims=True)
        empty = total <= 0  # a NaN total stays NaN
        lse = jnp.where(empty, 0.0, jnp.log(jnp.where(empty, 1.0, total)) + top)
        return jnp.where(allowed, x - lse, -jnp.inf)

    x = jnp.where(allowed, jnp.asarray(log_r, jnp.float32), -jnp.inf)
    for _ in range(iters):
        x = normalise(x, 1)
        if not rows_only:
            x = normalise(x, 0)
    return jnp.where(allowed, jnp.exp(x), 0.0)


@causal_never_reads_non_finite_future()
def sinkhorn_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    block_size: int = 64,
    max_len: int = 1024,
    sinkhorn_iters: int = 8,
    temperature: float = 0.75,
    sortcut_blocks: int = 0,
    sort_w1: Float[ArrayLike, "heads _d_k hidden"] | None = None,
    sort_b1: Float[ArrayLike, "heads hidden"] | None = None,
    sort_w2: Float[ArrayLike, "heads hidden max_blocks"] | None = None,
    sort_b2: Float[ArrayLike, "heads max_blocks"] | None = None,
    sort_logits: Float[ArrayLike, "heads blocks blocks"] | None = None,
    gumbel_key: PRNGKeyArray | None = None,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Sparse Sinkhorn attention (Tay et al., 2020).

    The sequence is cut into contiguous blocks of `block_size`. A sorting network reads
    each block's key sum and gives block-to-block logits R `[blocks, blocks]` (the paper
    reads the layer input's block sums psi(X); psi(K) = psi(X) W_K + bias, so this is its
    network with the first layer factored through the key projection, and the op stays
    a function of q, k, v whose decoder caches keys only); in
    training Gumbel noise is added (`gumbel_key`, passed by the module on every training
    call; none at inference); Sinkhorn balancing of R / temperature (`sinkhorn_iters`
    rounds) makes a soft permutation P; the sorted key and value blocks are
    P @ blocks. Each query block attends, in one softmax, to its own block and its sorted
    block. With P the identity this is block-local attention; with P a shift, block-local
    attention plus the neighbouring block.

    SortCut (`sortcut_blocks` = n > 0, not causal): every query attends only to the first
    n sorted blocks (n * block_size keys), O(seq * n * block_size).

    Causal (the paper's causal Sinkhorn balancing): block i may be sorted only to
    earlier blocks j < i; its logits come from block i - 1's key sum (block i's own would
    hold later tokens); balancing normalises rows only (a column sum would read later
    rows); within its own block a query attends to earlier positions.

    Arguments:
        q, k, v: self-attention inputs of one length `seq <= max_len` (any length).
        block_size: tokens per block; max_len: longest sequence (the network's output
            covers ceil(max_len / block_size) blocks).
        sinkhorn_iters: balancing rounds; temperature: tau > 0.
        sortcut_blocks: 0 for the plain form, else SortCut's n.
        sort_w1, sort_b1, sort_w2, sort_b2: the sorting network (`sinkhorn_arrays`).
        sort_logits: `[heads, blocks, blocks]` logits replacing the network's (tests,
            external sorters).
        gumbel_key: key of the training noise; None: no noise (inference).
        causal: restrict to the past.
        kv_mask: optional `[seq]`, True for real tokens; padded keys are zeroed before
            the blocks are summed and sorted, so they never reach an output.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time O(seq * (block_size + blocks) * d) per head (the soft permutation mixes every
    block into every sorted block): O(seq^1.5) at block_size = sqrt(seq); memory
    O(seq * block_size + blocks^2). Decodes its causal form against a cache of every key
    (blocks of min(block_size, max_len), the parallel form's at length max_len).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("block_size", block_size)
    check_positive("max_len", max_len)
    check_positive("sinkhorn_iters", sinkhorn_iters)
    check_positive("sortcut_blocks", sortcut_blocks, minimum=0)
    if not temperature > 0:
        raise ValueError(f"{temperature=} must be > 0")
    if causal and sortcut_blocks:
        raise ValueError(
            f"{sortcut_blocks=}: SortCut lets every query see the first sorted blocks, which "
            "cannot be causal; use sortcut_blocks=0 with causal=True"
        )
    check_self(q, k, v, kv_mask)
    n, heads = q.shape[0], q.shape[1]
    if n > max_len:
        raise ValueError(f"seq ({n}) exceeds {max_len=}: the sorting network covers max_len positions")
    b = min(block_size, n)
    blocks = ceil_div(n, b)
    length = blocks * b
    real = valid_keys(kv_mask, n, length)
    qh, kh, vh = _heads_first(q, k, v, length)
    kh, vh = kh * real[None, :, None], vh * real[None, :, None]  # padded keys carry nothing
    sc = default_scale(q.shape[2], scale)
    rb = to_blocks(real, b)  # [blocks, b]
    block_real = jnp.any(rb, axis=1)
    allowed = block_real[:, None] & block_real[None, :]
    if causal:
        allowed = allowed & (positions(blocks)[None, :] < positions(blocks)[:, None])
    if sort_logits is None:
        if any(w is None for w in (sort_w1, sort_b1, sort_w2, sort_b2)):
            raise ValueError(
                "sinkhorn_attention needs its sorting network (sort_w1, sort_b1, sort_w2, sort_b2 from "
                "sinkhorn_arrays) or sort_logits"
            )
        if sort_w2.shape[-1] < blocks:
            raise ValueError(f"sort_w2 covers {sort_w2.shape[-1]} blocks but seq {n} needs {blocks}")
    elif tuple(sort_logits.shape) != (heads, blocks, blocks):
        raise ValueError(f"sort_logits must have shape {(heads, blocks, blocks)}; got {tuple(sort_logits.shape)}")
    noise_keys = None if gumbel_key is None else jax.random.split(gumbel_key, heads)

    def head(h, q_h, k_h, v_h):
        kb, vb, qb = to_blocks(k_h, b), to_blocks(v_h, b), to_blocks(q_h, b)
        if sort_logits is None:
            summary = kb.sum(axis=1)  # BlockSum of the keys
            if causal:  # block i sorts from block i - 1's sum
                summary = jnp.concatenate([jnp.zeros_like(summary[:1]), summary[:-1]])
            hidden = jax.nn.relu(summary @ sort_w1[h].astype(jnp.float32) + sort_b1[h].astype(jnp.float32)[None])
            r = hidden @ sort_w2[h, :, :blocks].astype(jnp.float32) + sort_b2[h, :blocks].astype(jnp.float32)[None]
        else:
            r = jnp.asarray(sort_logits[h], jnp.float32)
        if noise_keys is not None:
            r = r + jax.random.gumbel(noise_keys[h], r.shape)
        perm = sinkhorn_balance(r / temperature, allowed, sinkhorn_iters, rows_only=causal)
        ks, vs = jnp.einsum("ij,jsd->isd", perm, kb), jnp.einsum("ij,jsd->isd", perm, vb)
        rs = jnp.einsum("ij,js->is", perm, rb.astype(jnp.float32)) > 0
        if sortcut_blocks:
            cut = min(sortcut_blocks, blocks)
            s = jnp.einsum("ld,kd->lk", q_h, ks[:cut].reshape(-1, ks.shape[-1])) * sc
            p = _joint_softmax([(s, jnp.broadcast_to(rs[:cut].reshape(1, -1), s.shape))])[0]
            return p @ vs[:cut].reshape(-1, vs.shape[-1])
        own = jnp.broadcast_to(rb[:, None, :], (blocks, b, b))
        if causal:
            own = own & jnp.tril(jnp.ones((b, b), bool))[None]
        s_own = jnp.einsum("nqd,nkd->nqk", qb, kb) * sc
        s_sort = jnp.einsum("nqd,nkd->nqk", qb, ks) * sc
        p_own, p_sort = _joint_softmax([(s_own, own), (s_sort, jnp.broadcast_to(rs[:, None, :], s_sort.shape))])
        out = jnp.einsum("nqk,nkd->nqd", p_own, vb) + jnp.einsum("nqk,nkd->nqd", p_sort, vs)
        return out.reshape(length, -1)

    out = jax.vmap(head)(jnp.arange(heads), qh, kh, vh)
    return _to_output(out, n, out_dtype(q, k, v))


def _sinkhorn_init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> TaggedCache:
    b = min(hyper_parameters["block_size"], max_len)
    slots = ceil_div(max_len, b) * b
    return TaggedCache(
        jnp.zeros((slots, kv_heads, d_k), jnp.float32),
        jnp.zeros((slots, kv_heads, d_v), jnp.float32),
        jnp.zeros((slots, 0, 0), jnp.int32),
        jnp.zeros((), jnp.int32),
    )


def _sinkhorn_step(q, k, v, state: TaggedCache, *, hyper_parameters, arrays, bias_fn):
    """The causal form, one token at position t in block i (blocks of
    min(block_size, max_len), the parallel form's at length max_len): the sorted block is
    softmax_j<i(R_i / tau) @ key blocks, R_i from block i - 1's key sum (complete by
    then); the token attends to its block's keys up to t and to the sorted block."""
    hp = hyper_parameters
    t, slots = state.length, state.k.shape[0]
    state = TaggedCache(
        state.k.at[t].set(jnp.asarray(k, jnp.float32)),
        state.v.at[t].set(jnp.asarray(v, jnp.float32)),
        state.buckets,
        t + 1,
    )
    heads, kv_heads = q.shape[0], k.shape[0]
    b = min(hp["block_size"], slots)  # the parallel form's block at length max_len
    blocks = slots // b
    i = t // b
    group = heads // kv_heads
    scale = default_scale(q.shape[1], None)
    earlier = positions(blocks) < i

    def head(h):
        kb, vb = to_blocks(state.k[:, h // group], b), to_blocks(state.v[:, h // group], b)  # [blocks, b, d]
        summary = jnp.where(i > 0, kb.sum(axis=1)[jnp.maximum(i - 1, 0)], 0.0)
        hidden = jax.nn.relu(summary @ arrays["sort_w1"][h].astype(jnp.float32) + arrays["sort_b1"][h])
        r = hidden @ arrays["sort_w2"][h, :, :blocks].astype(jnp.float32) + arrays["sort_b2"][h, :blocks]
        perm = sinkhorn_balance((r / hp["temperature"])[None], earlier[None], hp["sinkhorn_iters"], rows_only=True)[0]
        ks, vs = jnp.einsum("j,jsd->sd", perm, kb), jnp.einsum("j,jsd->sd", perm, vb)
        own_k = jax.lax.dynamic_index_in_dim(kb, i, keepdims=False)
        own_v = jax.lax.dynamic_index_in_dim(vb, i, keepdims=False)
        own = i * b + positions(b) <= t
        qh = jnp.asarray(q[h], jnp.float32)
        p_own, p_sort = _joint_softmax([(own_k @ qh * scale, own), (ks @ qh * scale, jnp.broadcast_to(i > 0, (b,)))])
        return p_own @ own_v + p_sort @ vs

    return jax.vmap(head)(jnp.arange(heads)).astype(q.dtype), state


register(
    "sinkhorn",
    sinkhorn_attention,
    family="learnable pattern",
    paper="Tay et al. 2020 (Sparse Sinkhorn Attention)",
    complexity="O(N (b + N/b))",
    exact=False,
    init_arrays=sinkhorn_arrays,
    covers_length="max_len",
    noise_key="gumbel_key",
    decoder=Decoder("tagged cache", _sinkhorn_init, _sinkhorn_step),
    docs={
        "block_size": "tokens per block b",
        "max_len": "longest sequence the sorting network covers",
        "sinkhorn_iters": "balancing rounds",
        "temperature": "tau of the Gumbel-Sinkhorn",
        "sortcut_blocks": "SortCut: attend only to the first n sorted blocks (0: off)",
    },
    summary=(
        "Sinkhorn Transformer: contiguous blocks, learned sorting network, Gumbel-Sinkhorn soft permutation; "
        "own block + sorted block (SortCut: the first n sorted blocks)"
    ),
    limits={"block_size": 1, "max_len": 1, "sinkhorn_iters": 1, "temperature": Limits(above=0), "sortcut_blocks": 0},
    dense_width=("its own and sorted blocks (2 block_size keys)", lambda hp, n: 2 * hp["block_size"]),
    scaled=(
        "block_size = min(default, N / 8): at least eight blocks to sort (Tay et al. 2020: blocks of 64 at 1,024 "
        "and more); max_len is the model's",
        lambda d, n: {"block_size": fraction(n, 8, cap=d["block_size"])},
    ),
)


# ----------------------------------------------------------------------------- Cluster-Former


def clusterformer_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    n_clusters: int = 4,
    chunk_size: int = 64,
    centroids: Float[ArrayLike, "heads n_clusters _d_k"] | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Cluster-Former attention (Wang et al., 2020, section 3): tokens are assigned to
    their nearest k-means centroid, sorted by (cluster, position), cut into chunks of
    `chunk_size`, and attend within their chunk (so a chunk holds one cluster's tokens,
    or the end of one and the start of the next). Tokens are clustered by their unit-
    normalised query vectors, one assignment per head (the paper clusters the hidden
    states; the training-time update sees the module's queries and keys only); the
    centroids are state moved by online k-means in training (`clusterformer_update`, a
    moving average per batch where the paper reruns k-means on stored states every few
    epochs), not by the gradient. The paper interleaves these layers with sliding-window
    ones (ModelConfig `stack.layer_overrides`).

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (any length).
        n_clusters: k-means clusters per head; chunk_size: tokens per chunk.
        centroids: `[heads, n_clusters, d_k]` (`kmeans_centroids`).
        kv_mask: optional `[seq]`, True for real tokens (padding sorts last).
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * chunk_size * d) plus the sort. Not causal (an encoder layer).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("n_clusters", n_clusters)
    check_positive("chunk_size", chunk_size)
    check_self(q, k, v, kv_mask)
    heads, d_k = q.shape[1], q.shape[2]
    _check_centroids("clusterformer_attention", centroids, heads, n_clusters, d_k)
    n = q.shape[0]
    chunk = min(chunk_size, n)
    length = ceil_div(n, chunk) * chunk
    _check_bucket_range(n_clusters, length)
    real = valid_keys(kv_mask, n, length)
    qh, kh, vh = _heads_first(q, k, v, length)
    sc = default_scale(d_k, scale)

    def head(q_h, k_h, v_h, mu_h):
        cluster = jnp.where(real, _nearest(q_h, mu_h), n_clusters)
        return _sorted_chunks(q_h, k_h, v_h, cluster, real, chunk=chunk, scale=sc)

    out = jax.vmap(head)(qh, kh, vh, jnp.asarray(centroids, jnp.float32))
    return _to_output(out, n, out_dtype(q, k, v))


def clusterformer_update(
    arrays: dict,
    q: Float[ArrayLike, "batch seq heads d_k"],
    k: Float[ArrayLike, "batch seq kv_heads d_k"],
    *,
    kv_mask: Bool[ArrayLike, "batch seq"] | None = None,
    decay: float = 0.999,
) -> dict[str, Array]:
    """The centroids after one training batch: online k-means on the unit-normalised
    queries (what the op clusters; `kmeans_update`)."""
    qf, _, real = _flat(jnp.asarray(q), jnp.asarray(k), kv_mask)
    return {"centroids": kmeans_update(arrays["centroids"], qf, real, decay=decay)}


register(
    "clusterformer",
    clusterformer_attention,
    family="learnable pattern",
    paper="Wang et al. 2020 (Cluster-Former)",
    complexity="O(N c)",
    exact=False,
    init_arrays=kmeans_centroids,
    drawn=("centroids",),
    redrawn=False,
    update_arrays=clusterformer_update,
    docs={
        "n_clusters": "k-means clusters per head",
        "chunk_size": "c, tokens per chunk of the sorted order",
        "decay": "EMA decay of the centroids in training",
    },
    summary="Cluster-Former: nearest k-means centroid, sorted by (cluster, position), attention within chunks",
    limits={"n_clusters": 1, "chunk_size": 1, "decay": Limits(minimum=0, below=1)},
    dense_width=("its chunks (chunk_size keys)", lambda hp, n: hp["chunk_size"]),
    scaled=(
        "chunk_size = min(default, N / 8): at least eight chunks of the sorted order (Wang et al. 2020)",
        lambda d, n: {"chunk_size": fraction(n, 8, cap=d["chunk_size"])},
    ),
)
