"""Clustered attention (Vyas, Katharopoulos & Fleuret 2020, "Fast Transformers with
Clustered Attention", NeurIPS): the queries are hashed by random hyperplanes, grouped
into C clusters by a few Lloyd iterations of K-means in Hamming space, and each
cluster's centroid (the mean of its queries) attends every key; every query takes its
centroid's output (`clustered_attention`). The improved form, i-clustered (§3.3,
`improved_clustered_attention`), recomputes each query's attention exactly on the top-k
keys of its centroid and keeps the centroid's weights on the others.

`hamming_clusters` is the clustering, shared by both ops and public so that a test (or a
user) can look at the assignment. Both ops are self-attention only (padded queries,
known from `kv_mask`, must not move a centroid) and not causal: a centroid averages
queries from every position, so a position's output depends on later tokens, and no
incremental decoder could reproduce it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers._arrays import guarded_divide, read_values
from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    check_positive,
    check_self,
    default_scale,
    logits,
    out_dtype,
    per_query_head,
    softmax_parts,
    zero_padded,
)
from jxformers.registry import fraction, register
from jxformers.validate import Limits

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = ["clustered_arrays", "clustered_attention", "hamming_clusters", "improved_clustered_attention"]

_MAX_BITS = 63  # the authors' hashes are int64 codes of at most 63 bits: their default


def clustered_arrays(key: PRNGKeyArray, *, d_k: int, bits: int = 63) -> dict[str, Array]:
    """The drawn hyperplanes `[bits, d_k + 1]` of the query hash: N(0, 1) normals and
    offsets (the authors' `hash_bias=True`, so Hamming distance follows L2 distance),
    shared by every head, redrawn with the module (the authors draw new planes at every
    call)."""
    check_positive("bits", bits)
    return {"planes": jax.random.normal(key, (bits, d_k + 1))}


def _hash_codes(x: Float[Array, "L d"], planes: Float[Array, "bits d1"]) -> Float[Array, "L bits"]:
    """Bit b of x's hash is [x . a_b > c_b] for the plane (a_b, c_b), as ±1 floats: the
    Hamming distance of two codes is (bits - their dot product) / 2."""
    projection = x @ planes[:, :-1].T - planes[None, :, -1]
    return jnp.where(projection > 0, 1.0, -1.0)


def hamming_clusters(
    q: Float[ArrayLike, "L d"],
    planes: Float[ArrayLike, "bits d1"],
    real: Bool[ArrayLike, " L"],
    *,
    clusters: int,
    iterations: int,
) -> Int[Array, " L"]:
    """Cluster the queries of one head by K-means on their LSH codes in Hamming space
    (Vyas et al. 2020, §3.2; the authors' `clustering/hamming`).

    Each query is hashed by the random hyperplanes (`_hash_codes`). The C initial
    centroids are the codes of C real queries at evenly spaced ranks among the real
    positions (the c-th: rank floor(c * n_real / C)); then `iterations` assignments to
    the nearest centroid (ties to the lowest index) with `iterations - 1` updates
    between them, each centroid bit the majority bit of its members (a tie gives 0),
    a centroid no real query chose kept as it was. Padded queries (`real` False) are
    assigned but never counted, so they move no centroid.

    Returns:
        `[L]` int32 cluster of each query (no gradient).
    """
    codes = _hash_codes(jax.lax.stop_gradient(jnp.asarray(q, jnp.float32)), jnp.asarray(planes, jnp.float32))
    real = jnp.asarray(real)
    n_real = jnp.sum(real.astype(jnp.int32))
    real_first = jnp.argsort(~real, stable=True)  # the real positions first, in order
    ranks = (jnp.arange(clusters) * n_real) // clusters
    centroids = codes[real_first[ranks]]

    def assign(centroids):
        return jnp.argmax(codes @ centroids.T, axis=-1).astype(jnp.int32)  # max agreement = min Hamming

    def update(_, centroids):
        members = jax.nn.one_hot(assign(centroids), clusters) * real[:, None]
        votes = members.T @ codes  # [C, bits]: (ones - zeros) among the members
        chosen = jnp.sum(members, axis=0) > 0
        return jnp.where(chosen[:, None], jnp.where(votes > 0, 1.0, -1.0), centroids)

    return assign(jax.lax.fori_loop(0, iterations - 1, update, centroids))


def _centroid_queries(q: Float[Array, "L d"], cluster: Int[Array, " L"], real: Bool[Array, " L"], clusters: int):
    """(centroids `[C, d]`, the mean of each cluster's real queries; members `[L, C]`)."""
    members = jax.nn.one_hot(cluster, clusters, dtype=jnp.float32) * real[:, None]
    counts = jnp.sum(members, axis=0)
    return guarded_divide(members.T @ q.astype(jnp.float32), counts), members


def _check(op: str, q, k, v, kv_mask, planes, *, clusters: int, iterations: int, bits: int) -> None:
    check_positive("clusters", clusters)
    check_positive("iterations", iterations)
    check_positive("bits", bits)
    if bits > _MAX_BITS:
        raise ValueError(f"bits must be at most {_MAX_BITS} (the authors' int64 hash codes); got {bits}")
    check_self(q, k, v, kv_mask)
    if planes is None:
        raise ValueError(f"{op} needs its drawn `planes` (clustered_arrays(key, ...) or the registry's init_arrays)")
    want = (bits, q.shape[2] + 1)
    if tuple(planes.shape) != want:
        raise ValueError(f"planes must have shape {want} for bits={bits}, d_k={q.shape[2]}; got {tuple(planes.shape)}")


def _clustered_heads(head_fn, q, k, v, kv_mask, planes, *, clusters: int, iterations: int):
    """Run `head_fn(q_h [L, d], k_h [L, d], v_h [L, dv], cluster [L], real [L]) -> [L, dv]`
    for every query head, clustering that head's queries. Returns `[L, heads, dv]`."""
    real = jnp.ones((q.shape[0],), bool) if kv_mask is None else jnp.asarray(kv_mask)

    def head(q_h, k_h, v_h):
        cluster = hamming_clusters(q_h, planes, real, clusters=clusters, iterations=iterations)
        return head_fn(q_h, k_h, v_h, cluster, real)

    return per_query_head(head, q, k, v)


def _centroid_softmax(qc, k_h, real, scale):
    """The centroids' attention over the real keys: (logits `[C, L]`, weights `[C, L]`)."""
    s = logits(qc[:, None, None, :], k_h[:, None, :], scale)[0, 0]  # [C, L]
    return s, softmax_parts([(s[None, None], real[None, None, None, :])])[0][0, 0]


def clustered_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    clusters: int = 100,
    iterations: int = 10,
    bits: int = 63,
    planes: Float[ArrayLike, "_bits _d1"] | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Clustered attention (Vyas et al. 2020, §3.2, eq. 6-7).

    The queries of each head are grouped into `clusters` clusters (`hamming_clusters`:
    LSH codes of `bits` random hyperplanes, `iterations` Lloyd iterations in Hamming
    space); each centroid Q^c_j, the mean of its cluster's queries, attends every key,
    A^c = softmax(Q^c K^T / sqrt(d_k)), and each query's output is its centroid's,
    A^c V. The gradient reaches every query through its centroid's mean; the
    assignment is discrete.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (grouped kv heads).
        clusters: C, clusters per head (the paper's experiments: 100 or 200).
        iterations: Lloyd iterations (assignments) of the K-means (the authors' 10).
        bits: bits of the LSH code, at most 63 (the authors' 63).
        planes: `[bits, d_k + 1]` drawn hyperplanes (`clustered_arrays`).
        kv_mask: optional `[seq]`, True for real tokens: padded keys are never attended
            and padded queries move no centroid (they take their nearest cluster's output).
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time O(seq * C * (bits * iterations + d)), memory O(seq * C). Not causal: a centroid
    averages queries from every position (the authors' code refuses masks too).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    _check("clustered_attention", q, k, v, kv_mask, planes, clusters=clusters, iterations=iterations, bits=bits)
    sc = default_scale(q.shape[2], scale)

    def head(q_h, k_h, v_h, cluster, real):
        qc, _ = _centroid_queries(q_h, cluster, real, clusters)
        _, a = _centroid_softmax(qc, k_h, real, sc)
        return read_values("ck,kd->cd", a, v_h, reads=jnp.broadcast_to(real, a.shape))[cluster]

    out = _clustered_heads(head, q, k, v, kv_mask, planes, clusters=clusters, iterations=iterations)
    return out.astype(out_dtype(q, k, v))


def improved_clustered_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    clusters: int = 100,
    iterations: int = 10,
    bits: int = 63,
    topk: int = 32,
    planes: Float[ArrayLike, "_bits _d1"] | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Improved clustered attention, i-clustered (Vyas et al. 2020, §3.3, eq. 9).

    Clustered as `clustered_attention`; T_j holds the `topk` keys of largest centroid
    logit for cluster j, and m_j = sum over T_j of the centroid's weights A^c_j. A query
    i of cluster j attends

        A^t_il = m_j exp(q_i k_l / sqrt(d)) / sum_{r in T_j} exp(q_i k_r / sqrt(d))   if l in T_j,
        A^t_il = A^c_jl                                                               otherwise,

    its own exact softmax on the top keys, scaled to the centroid's mass on them, and the
    centroid's weights on the rest (which sum to 1 - m_j, so each row sums to 1).

    Arguments:
        q, k, v, clusters, iterations, bits, planes, kv_mask, scale: as `clustered_attention`.
        topk: k, top keys per cluster recomputed exactly (the authors' 32); at least
            the sequence length makes it exact softmax attention.

    Returns:
        `[seq, heads, d_v]`.

    Time O(seq * C * (bits * iterations + d) + seq * topk * d), memory O(seq * (C +
    topk)). Not causal (see `clustered_attention`): the authors' causal variant keeps the
    clustering over every query, so a position's top keys depend on later queries.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    _check(
        "improved_clustered_attention", q, k, v, kv_mask, planes, clusters=clusters, iterations=iterations, bits=bits
    )
    check_positive("topk", topk)
    sc = default_scale(q.shape[2], scale)
    top = min(topk, k.shape[0])

    def head(q_h, k_h, v_h, cluster, real):
        qc, _ = _centroid_queries(q_h, cluster, real, clusters)
        s, a = _centroid_softmax(qc, k_h, real, sc)
        # Padded keys sort last (never above a real one); when topk exceeds the real keys
        # they are selected but masked below, as the authors mask -inf top-k entries.
        chosen = jax.lax.top_k(jnp.where(real[None, :], jax.lax.stop_gradient(s), -jnp.inf), top)[1]  # [C, top]
        in_top = jnp.zeros(a.shape, bool).at[jnp.arange(clusters)[:, None], chosen].set(True)
        mass = jnp.sum(jnp.where(in_top, a, 0.0), axis=-1)  # m_j
        rest = jnp.where(in_top, 0.0, a)
        bottom = read_values("ck,kd->cd", rest, v_h, reads=~in_top & real[None, :])  # [C, dv]
        keys = chosen[cluster]  # [L, top]: each query's cluster's top keys
        reads = real[keys]
        s_top = jnp.einsum("ld,ltd->lt", q_h.astype(jnp.float32), k_h[keys].astype(jnp.float32)) * sc
        p = softmax_parts([(s_top[None, None], reads[None, None])])[0][0, 0] * mass[cluster][:, None]
        return read_values("lt,ltd->ld", p, v_h[keys], reads=reads) + bottom[cluster]

    out = _clustered_heads(head, q, k, v, kv_mask, planes, clusters=clusters, iterations=iterations)
    return out.astype(out_dtype(q, k, v))


_DOCS = {
    "clusters": "C, query clusters per head (the paper's 100 or 200)",
    "iterations": "Lloyd iterations of the Hamming K-means",
    "bits": "bits of the queries' LSH code (at most 63)",
}
_LIMITS = {"clusters": 1, "iterations": 1, "bits": Limits(minimum=1, maximum=_MAX_BITS)}

register(
    "clustered",
    clustered_attention,
    family="learnable pattern",
    paper="Vyas et al. 2020 (Fast Transformers with Clustered Attention)",
    complexity="O(N C (B I + d))",
    exact=False,
    init_arrays=clustered_arrays,
    drawn=("planes",),
    docs=_DOCS,
    summary=(
        "clustered attention: queries LSH-hashed and K-means-clustered in Hamming space; each cluster's "
        "mean query attends every key and its queries take its output; not causal"
    ),
    limits=_LIMITS,
    dense_width=("its clusters (C centroid rows)", lambda hp, n: hp["clusters"]),
    scaled=(
        "clusters = min(default, N / 8): fewer clusters than queries (Vyas et al. 2020: 100 or 200 at up to 4,096)",
        lambda d, n: {"clusters": fraction(n, 8, cap=d["clusters"])},
    ),
)

register(
    "improved_clustered",
    improved_clustered_attention,
    family="learnable pattern",
    paper="Vyas et al. 2020 (Fast Transformers with Clustered Attention)",
    complexity="O(N C (B I + d) + N k d)",
    exact=False,
    init_arrays=clustered_arrays,
    drawn=("planes",),
    docs=_DOCS | {"topk": "k, keys per cluster each query recomputes exactly"},
    summary=(
        "i-clustered: clustered attention, each query's exact softmax on its centroid's top-k keys scaled to "
        "the centroid's mass on them, the centroid's weights elsewhere; not causal"
    ),
    limits=_LIMITS | {"topk": 1},
    # C centroid rows attend every key: as costly as softmax once C reaches the length, as are k top keys
    dense_width=("its clusters or top keys (max(C, topk))", lambda hp, n: max(hp["clusters"], hp["topk"])),
    scaled=(
        "clusters and topk = min(default, N / 8): fewer clusters than queries, fewer top keys than keys (Vyas et "
        "al. 2020: 100 clusters, top 32)",
        lambda d, n: {"clusters": fraction(n, 8, cap=d["clusters"]), "topk": fraction(n, 8, cap=d["topk"])},
    ),
)
