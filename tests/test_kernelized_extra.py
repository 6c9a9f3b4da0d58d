"""Performer's trigonometric features (Choromanski et al. 2021, §2.3) and Efficient
Attention (Shen et al. 2021, eq. 2) against numpy references written from the papers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, qkv

from jxformers import registry
from jxformers.ops import kernelized

# ----------------------------------------------------------------------------- Performer, trig


def trig_features_reference(x, w):
    """phi(x) = h(x) / sqrt(m) [sin(w_i . x'), cos(w_i . x')], h(x) = exp(|x'|^2 / 2), x' = x d^(-1/4)."""
    x = np.asarray(x, np.float64) * x.shape[-1] ** -0.25
    wx = np.einsum("nhd,md->nhm", x, np.asarray(w, np.float64))
    h = np.exp(0.5 * (x**2).sum(-1, keepdims=True))
    return h * np.concatenate([np.sin(wx), np.cos(wx)], -1) / math.sqrt(w.shape[0])


def kernel_reference(fq, fk, v, causal, kv_mask):
    """Eq. of FAVOR's attention with features: (phi(Q) phi(K)^T masked) V / row sums."""
    rep = fq.shape[1] // fk.shape[1]
    fk, v = np.repeat(fk, rep, axis=1), np.repeat(np.asarray(v, np.float64), rep, axis=1)
    a = np.einsum("qhm,khm->hqk", fq, fk)
    if causal:
        a = a * np.tril(np.ones(a.shape[1:]))
    a = a * np.asarray(kv_mask)[None, None, :]
    return np.einsum("hqk,khd->qhd", a, v) / a.sum(-1).T[:, :, None]


def test_trig_features_are_the_formula_and_estimate_the_softmax_kernel():
    d, m = 4, 4096
    x = 0.5 * jax.random.normal(jax.random.key(0), (3, 1, d))
    y = 0.5 * jax.random.normal(jax.random.key(1), (3, 1, d))
    w = kernelized.performer_projection(jax.random.key(2), m, d)
    fx = kernelized.performer_features(x, w, kernel="trig")
    assert_close(fx, trig_features_reference(x, w), atol=1e-5, rtol=1e-5)

    # E[phi(x) . phi(y)] = exp(x . y / sqrt(d)): the mean over draws of many features
    def estimate(key):
        w = kernelized.performer_projection(key, m, d)
        fx, fy = (kernelized.performer_features(a, w, kernel="trig") for a in (x, y))
        return jnp.einsum("nhm,nhm->n", fx, fy)

    estimates = jax.jit(jax.vmap(estimate))(jax.random.split(jax.random.key(3), 8))
    exact = np.exp(np.einsum("nhd,nhd->n", np.asarray(x), np.asarray(y)) / math.sqrt(d))
    np.testing.assert_allclose(np.mean(estimates, axis=0), exact, rtol=1e-2)


@pytest.fixture(scope="module")
def trig_fn():
    return jax.jit(
        lambda q, k, v, w, kv_mask, causal: kernelized.performer_attention(
            q, k, v, w, kernel="trig", causal=causal, kv_mask=kv_mask, chunk_size=8
        ),
        static_argnames="causal",
    )


@pytest.mark.parametrize("causal", [False, True])
def test_trig_attention_is_the_kernel_formula_with_padding(trig_fn, causal):
    n, real = 21, 17
    q, k, v = qkv(4, n)
    q, k = 0.5 * q, 0.5 * k  # moderate norms: the estimated normaliser stays away from zero
    w = kernelized.performer_projection(jax.random.key(5), 64, 8)
    kv_mask = jnp.arange(n) < real
    out = trig_fn(q, k.at[real:].set(jnp.inf), v.at[real:].set(jnp.nan), w, kv_mask, causal)
    ref = kernel_reference(trig_features_reference(q, w), trig_features_reference(k, w), v, causal, kv_mask)
    assert_close(out[:real], ref[:real], atol=1e-4, rtol=1e-4)
    if causal:
        grads = jax.jit(jax.grad(lambda q: trig_fn(q, k, v, w, kv_mask, causal).sum()))(q)
        assert bool(jnp.all(jnp.isfinite(grads))) and bool(jnp.any(grads != 0))


def test_trig_decodes_token_by_token_as_its_causal_forward():
    n = 20
    q, k, v = qkv(6, n)
    q, k = 0.5 * q, 0.5 * k
    bound = registry.bind("performer", kernel="trig", num_features=32, chunk_size=8)
    arrays = bound.init_arrays(jax.random.key(7), heads=4, kv_heads=2, d_k=8, d_v=6)
    parallel = jax.jit(lambda q, k, v: bound(q, k, v, arrays=arrays, causal=True))(q, k, v)
    state = bound.init_state(max_len=n, kv_heads=2, d_k=8, d_v=6, arrays=arrays)

    def step(state, x):
        out, state = bound.decode_step(*x, state, arrays=arrays)
        return state, out

    decoded = jax.jit(lambda s: jax.lax.scan(step, s, (q, k, v))[1])(state)
    assert_close(decoded, parallel, atol=1e-4, rtol=1e-3)


# ----------------------------------------------------------------------------- Efficient Attention


def efficient_reference(q, k, v, kv_mask):
    """E = rho_q(Q) (rho_k(K)^T V): softmax over each query's features, and over the
    (real) positions of each key feature."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    real = np.asarray(kv_mask)
    rep = q.shape[1] // k.shape[1]
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for h in range(q.shape[1]):
        kh, vh = k[real, h // rep], v[real, h // rep]
        rho_k = np.exp(kh) / np.exp(kh).sum(0, keepdims=True)  # [n_real, d_k], columns sum to 1
        rho_q = np.exp(q[:, h]) / np.exp(q[:, h]).sum(1, keepdims=True)  # [q_len, d_k], rows sum to 1
        out[:, h] = rho_q @ (rho_k.T @ vh)
    return out


def test_efficient_attention_is_eq_2_with_padding_grouped_heads_and_cross_lengths():
    q, k, v = qkv(8, 9, kv_len=14)
    kv_mask = jnp.arange(14) < 11
    fn = jax.jit(kernelized.efficient_attention)
    out = fn(q, k.at[11:].set(jnp.inf), v.at[11:].set(jnp.nan), kv_mask=kv_mask)
    assert_close(out, efficient_reference(q, k, v, kv_mask), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="causal"):
        kernelized.efficient_attention(q, k, v, causal=True)
