"""Clustered and improved clustered attention (Vyas, Katharopoulos & Fleuret 2020, "Fast
Transformers with Clustered Attention") against numpy references of the paper's
formulas, with the clustering (LSH codes, Lloyd iterations in Hamming space) reproduced
in numpy. The generic suite (tests/test_generic.py) checks the rest: shapes, jit, vmap,
gradients, padded keys, non-finite values, bf16, the refusal of causal models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, qkv

from jxformers import registry

ops = JittedOps()
N, HEADS, KV_HEADS, D, DV = 20, 4, 2, 8, 6
HP = {"clusters": 3, "iterations": 4, "bits": 10}


def np_clusters(q, planes, real, clusters, iterations):
    """Lloyd's K-means on the LSH codes, in Hamming distance (the paper's §3.2; the
    authors' hamming/cluster_cpu.cpp), with this library's initial centroids: the codes
    of the real queries at ranks floor(c n_real / C)."""
    codes = (q @ planes[:, :-1].T > planes[:, -1]).astype(int)  # [L, bits] of 0/1
    real_positions = np.flatnonzero(real)
    centroids = codes[real_positions[[c * len(real_positions) // clusters for c in range(clusters)]]]

    def assign(centroids):
        distance = (codes[:, None, :] != centroids[None, :, :]).sum(-1)
        return distance.argmin(-1)  # ties: the lowest index

    for _ in range(iterations - 1):
        cluster = assign(centroids)
        for c in range(clusters):
            members = codes[(cluster == c) & real]
            if len(members):  # the majority bit; a tie gives 0; an empty cluster keeps its centroid
                centroids[c] = (2 * members.sum(0) > len(members)).astype(int)
    return assign(centroids)


def np_softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_clustered(q, k, v, planes, real, *, clusters, iterations, bits, topk=None):
    """Eq. 6-7 (clustered) or eq. 9 (i-clustered when `topk`), per query head, float64
    (`bits` is the planes' count)."""
    assert planes.shape[0] == bits
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros((n, heads, v.shape[2]))
    for h in range(heads):
        kh, vh = k[real, h // group], v[real, h // group]  # only real keys exist
        cluster = np_clusters(q[:, h], np.asarray(planes, np.float64), real, clusters, iterations)
        for c in range(clusters):
            members = np.flatnonzero((cluster == c) & real)
            if len(members) == 0:
                continue
            centroid = q[members, h].mean(0)
            a = np_softmax(centroid @ kh.T / np.sqrt(d))  # A^c_j
            rows = np.flatnonzero(cluster == c)  # padded queries take their cluster's output too
            if topk is None:
                out[rows, h] = a @ vh
                continue
            top = np.argsort(-(centroid @ kh.T))[: min(topk, len(kh))]  # T_j
            mass = a[top].sum()  # m_j
            for i in rows:
                weights = a.copy()
                weights[top] = mass * np_softmax(q[i, h] @ kh[top].T / np.sqrt(d))
                out[i, h] = weights @ vh
    return out


@pytest.fixture(scope="module")
def inputs():
    q, k, v = qkv(7, N, heads=HEADS, kv_heads=KV_HEADS, d=D, dv=DV)
    planes = registry.bind("clustered", **HP).init_arrays(
        jax.random.key(3), heads=HEADS, kv_heads=KV_HEADS, d_k=D, d_v=DV
    )["planes"]
    real = np.arange(N) < N - 4
    return q, k, v, planes, real


def test_hamming_clusters_are_lloyds_iterations_on_the_lsh_codes(inputs):
    q, _, _, planes, real = inputs
    for h in range(HEADS):
        got = ops.hamming_clusters(q[:, h], planes, jnp.asarray(real), clusters=4, iterations=5)
        want = np_clusters(np.asarray(q[:, h], np.float64), np.asarray(planes, np.float64), real, 4, 5)
        np.testing.assert_array_equal(np.asarray(got)[real], want[real])


@pytest.mark.parametrize("name", ["clustered", "improved_clustered"])
def test_clustered_attentions_are_the_papers_formulas(inputs, name):
    q, k, v, planes, real = inputs
    topk = 5 if name == "improved_clustered" else None
    op = ops.improved_clustered_attention if topk else ops.clustered_attention
    extra = {"topk": topk} if topk else {}
    for mask in (None, jnp.asarray(real)):
        out = op(q, k, v, planes=planes, kv_mask=mask, **HP, **extra)
        want = np_clustered(q, k, v, planes, np.ones(N, bool) if mask is None else real, **HP, topk=topk)
        keep = slice(None) if mask is None else real  # padded rows: any finite output
        assert_close(np.asarray(out)[keep], want[keep], atol=2e-5)


def test_improved_clustered_with_every_key_on_top_is_softmax(inputs):
    q, k, v, planes, real = inputs
    mask = jnp.asarray(real)
    out = ops.improved_clustered_attention(q, k, v, planes=planes, kv_mask=mask, topk=N, **HP)
    assert_close(out, ops.softmax_attention(q, k, v, kv_mask=mask), atol=2e-5)


def test_padded_queries_move_no_centroid(inputs):
    q, k, v, planes, real = inputs
    moved = q.at[~real].set(50.0 * jax.random.normal(jax.random.key(9), q[~real].shape))
    for op in (ops.clustered_attention, ops.improved_clustered_attention):
        a = op(q, k, v, planes=planes, kv_mask=jnp.asarray(real), **HP)
        b = op(moved, k, v, planes=planes, kv_mask=jnp.asarray(real), **HP)
        assert_close(np.asarray(a)[real], np.asarray(b)[real], atol=0)


def test_not_causal_a_later_query_moves_an_earlier_output(inputs):
    """Why both refuse causal=True (and so language models): a centroid averages the
    queries of every position, so changing the last query changes earlier outputs."""
    q, k, v, planes, _ = inputs
    with pytest.raises(ValueError, match="causal"):
        registry.bind("clustered", **HP)(q, k, v, arrays={"planes": planes}, causal=True)
    a = ops.clustered_attention(q, k, v, planes=planes, **HP)
    b = ops.clustered_attention(q.at[-1].add(1.0), k, v, planes=planes, **HP)
    assert not np.allclose(np.asarray(a)[:-1], np.asarray(b)[:-1])
