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


# ----------------------------------------------------------------------------- RoPE with linear attention


def eq19_reference(q, k, v, q_pos, k_pos, causal, base=10000.0):
    """RoFormer eq. 19 in numpy: sum_j (R_i phi(q_i))^T (R_j phi(k_j)) v_j / sum_j phi(q_i)^T phi(k_j),
    phi = elu + 1, R turning the pairs (i, i + d/2) by p base^(-2i/d)."""
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))  # noqa: E731
    fq, fk = phi(np.asarray(q, np.float64)), phi(np.asarray(k, np.float64))
    d = fq.shape[-1]
    freq = base ** (-np.arange(d // 2) * 2 / d)

    def turn(x, pos):
        angle = np.asarray(pos, np.float64)[:, None, None] * freq
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x1 * np.sin(angle) + x2 * np.cos(angle)], -1)

    rep = q.shape[1] // k.shape[1]
    rq, rk = turn(fq, q_pos), np.repeat(turn(fk, k_pos), rep, axis=1)
    fk, v = np.repeat(fk, rep, axis=1), np.repeat(np.asarray(v, np.float64), rep, axis=1)
    mask = np.tril(np.ones((q.shape[0], k.shape[0]))) if causal else np.ones((q.shape[0], k.shape[0]))
    num = np.einsum("qhm,khm,qk,khd->qhd", rq, rk, mask, v)
    den = np.einsum("qhm,khm,qk->qh", fq, fk, mask)
    return num / den[:, :, None]


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_with_rope_is_roformer_eq_19_and_depends_on_offsets_only(causal):
    from jxformers.nn import Attention, Rotary

    n = 12
    q, k, v = qkv(9, n)
    pos = jnp.arange(n) + 3.0
    rope = Rotary()
    tables = {"q_rotation": rope.table(pos, 8, keys=False), "k_rotation": rope.table(pos, 8, keys=True)}
    linear = jax.jit(kernelized.linear_attention, static_argnames=("causal", "form", "chunk_size"))
    for form in ("chunked", "scan", "quadratic") if causal else ("chunked",):
        out = linear(q, k, v, causal=causal, form=form, chunk_size=5, **tables)
        assert_close(out, eq19_reference(q, k, v, pos, pos, causal), atol=2e-5, rtol=2e-5)
    # the module passes the tables: shifting every position leaves the output unchanged
    layer = Attention("linear", 16, 2, rope=True, causal=causal, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (n, 16))
    apply = jax.jit(lambda p: layer.apply(x, positions=p)[0])
    base, shifted = apply(jnp.arange(n)), apply(jnp.arange(n) + 37)
    assert_close(base, shifted, atol=2e-5, rtol=2e-5)
    # turning q and k before phi (what the module did before) moves with the shift
    before = jax.jit(lambda p: kernelized.linear_attention(rope.queries(q, p), rope.keys(k, p), v, causal=causal))
    assert not np.allclose(before(pos), before(pos + 37), atol=1e-3)
