"""Informer's ProbSparse self-attention (Zhou et al. 2021, "Informer: Beyond Efficient
Transformer for Long Sequence Time-Series Forecasting") against a numpy reference of its
Algorithm 1 given the same key samples, its counts, and why it is not causal. The
generic suite (tests/test_generic.py) checks the rest."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, qkv

from jxformers import registry
from jxformers.ops import probsparse_counts  # plain ints (JittedOps would return arrays)

ops = JittedOps()
N, HEADS, KV_HEADS, D, DV = 24, 4, 2, 8, 6
FACTOR = 2  # U = u = 2 ceil(ln 24) = 8 of 24


def np_probsparse(q, k, v, sampled, real, *, factor, masked):
    """Algorithm 1 per query head in float64: M = max - mean of each query's sampled
    logits, the top u real queries attend the real keys (j <= i when masked), the others
    take the mean of the real values (up to i when masked)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, heads, d = q.shape
    group = heads // k.shape[1]
    u = min(factor * math.ceil(math.log(n)), n)
    out = np.zeros((n, heads, v.shape[2]))
    for h in range(heads):
        kh, vh = k[:, h // group], v[:, h // group]
        s = q[:, h] @ kh.T / np.sqrt(d)
        sampled_s = np.take_along_axis(s, sampled, axis=1)
        measure = np.where(real, sampled_s.max(1) - sampled_s.mean(1), -np.inf)
        top = np.argsort(-measure, kind="stable")[: min(u, real.sum())]
        for i in range(n):
            keys = real & ((np.arange(n) <= i) if masked else True)
            if not keys.any():
                continue
            if i in top:
                e = np.exp(s[i, keys] - s[i, keys].max())
                out[i, h] = e @ vh[keys] / e.sum()
            else:
                out[i, h] = vh[keys].mean(0)
    return out


@pytest.fixture(scope="module")
def inputs():
    q, k, v = qkv(11, N, heads=HEADS, kv_heads=KV_HEADS, d=D, dv=DV)
    return q, k, v, jax.random.key(4), np.arange(N) < N - 5


def test_counts_round_as_informers_code():
    assert probsparse_counts(24, 2) == 8  # 2 ceil(ln 24) = 2 * 4
    assert probsparse_counts(4096, 5) == 45
    assert probsparse_counts(10, 5) == 10  # 5 * 3 capped at the length
    assert probsparse_counts(1, 5) == 1


def test_samples_are_drawn_with_replacement_among_real_keys(inputs):
    *_, key, real = inputs
    sampled = np.asarray(ops.probsparse_samples(key, jnp.asarray(real), samples=8))
    assert sampled.shape == (N, 8)
    assert real[sampled].all()
    assert set(np.unique(sampled)) == set(np.flatnonzero(real))  # 192 draws reach all 19 real keys


@pytest.mark.parametrize("masked", [False, True])
def test_probsparse_is_informers_algorithm(inputs, masked):
    q, k, v, key, real = inputs
    sampled = np.asarray(ops.probsparse_samples(key, jnp.asarray(real), samples=probsparse_counts(N, FACTOR)))
    out = ops.probsparse_attention(q, k, v, key=key, kv_mask=jnp.asarray(real), factor=FACTOR, masked=masked)
    want = np_probsparse(q, k, v, sampled, real, factor=FACTOR, masked=masked)
    assert_close(np.asarray(out)[real], np.asarray(want)[real], atol=2e-5)
    if not masked:  # not vacuous: some rows attend, the others share the mean of the real values
        mean_v = np.repeat(np.asarray(v)[real].mean(0), HEADS // KV_HEADS, axis=0)  # per query head
        lazy = np.all(np.isclose(want, mean_v[None], atol=1e-6), axis=-1)[real]
        assert 0 < lazy.sum() < lazy.size
    unpadded = ops.probsparse_attention(q, k, v, key=key, factor=FACTOR, masked=masked)
    sampled_all = np.asarray(ops.probsparse_samples(key, jnp.ones(N, bool), samples=probsparse_counts(N, FACTOR)))
    assert_close(unpadded, np_probsparse(q, k, v, sampled_all, np.ones(N, bool), factor=FACTOR, masked=masked))


def test_selecting_every_query_is_softmax(inputs):
    q, k, v, key, real = inputs
    for masked in (False, True):
        out = ops.probsparse_attention(q, k, v, key=key, kv_mask=jnp.asarray(real), factor=10, masked=masked)
        want = ops.softmax_attention(q, k, v, kv_mask=jnp.asarray(real), causal=masked)
        assert_close(np.asarray(out)[real], np.asarray(want)[real], atol=2e-5)


def test_a_non_finite_sampled_key_makes_every_row_nan(inputs):
    q, k, v, key, _ = inputs
    sampled = np.asarray(ops.probsparse_samples(key, jnp.ones(N, bool), samples=probsparse_counts(N, FACTOR)))
    out = ops.probsparse_attention(q, k.at[int(sampled[0, 0])].set(jnp.nan), v, key=key, factor=FACTOR)
    assert np.isnan(np.asarray(out)).all()  # the ranking that picks every row's form read it


def test_not_causal_even_masked_a_later_token_moves_an_earlier_row(inputs):
    """Why `probsparse` refuses causal=True (and language models): the masked form picks
    its rows among every position, so a later token changes which earlier rows attend."""
    q, k, v, key, _ = inputs
    with pytest.raises(ValueError, match="causal"):
        registry.bind("probsparse", factor=FACTOR)(q, k, v, arrays={"key": key}, causal=True)
    a = ops.probsparse_attention(q, k, v, key=key, factor=FACTOR, masked=True)
    b = ops.probsparse_attention(q.at[-1].multiply(100.0), k, v, key=key, factor=FACTOR, masked=True)
    assert not np.allclose(np.asarray(a)[:-1], np.asarray(b)[:-1])
