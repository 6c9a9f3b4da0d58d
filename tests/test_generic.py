"""Registry-driven properties every attention must have. A newly registered attention is
tested here the moment it is registered (and must add its small test settings below)."""

import functools

import jax
import jax.numpy as jnp
import masks
import numpy as np
import pytest
from conftest import assert_close, qkv
from hypothesis import given
from hypothesis import strategies as st

from jxformers import decoding, registry
from jxformers.ops import softmax_attention

# Small hyper-parameters that make every pattern non-trivial at the test lengths.
VARIANTS = {
    "softmax": [{}],
    "chunked": [{"chunk_size": 8}],
    "local": [{"window": 3}],
    "block_local": [{"block_size": 5}],
    "dilated": [{"window": 2, "dilation": 3}],
    "sparse_transformer": [{"stride": 5}, {"stride": 5, "pattern": "fixed", "num_summary": 2}],
    "longformer": [{"window": 2, "global_indices": (0, 11)}],
    "bigbird": [{"block_size": 4, "num_random_blocks": 2}],
    "axial": [{"width": 6}, {"width": 5, "order": "column"}],
    "memory_compressed": [{"stride": 3}],
    "linear": [{"chunk_size": 8}, {"form": "scan", "feature_map": "relu"}],
    "performer": [{"num_features": 32, "chunk_size": 8}, {"num_features": 16, "kernel": "relu", "form": "quadratic"}],
    "rfa": [{"num_features": 16, "chunk_size": 5}],
    "linformer": [{"proj_len": 8, "max_len": 64}],
    "synthesizer": [{"max_len": 40}, {"kind": "dense", "max_len": 40, "hidden": 8, "dot_weight": 1.0},
                    {"kind": "factorized_random", "max_len": 40, "rank": 3}],
    "nystrom": [{"num_landmarks": 5}],
    "induced": [{"num_inducing": 4}],
    "fnet": [{}],
}


def cases(**capabilities):
    """(name, hyper-parameters) for every registered attention with these capabilities."""
    return [
        pytest.param(name, hp, id="-".join([name, *(f"{k}={v}" for k, v in hp.items())]))
        for name in registry.names(**capabilities)
        for hp in VARIANTS.get(name, [{}])
    ]

# One odd length (tails of blocks and chunks) for most properties; the dense-mask
# equivalence also runs a length that divides evenly. Each length is a compilation.
LENGTH = st.just(37)
LENGTHS = st.sampled_from([24, 37])
SEEDS = st.integers(0, 2**16)


@functools.cache
def _compiled(name, hp_items, causal):
    spec, hp = registry.get(name), dict(hp_items)

    def f(q, k, v, kv_mask, key):
        arrays = spec.init_arrays(key, heads=q.shape[1], kv_heads=k.shape[1], d_k=k.shape[2], d_v=v.shape[2], **hp)
        return spec(q, k, v, arrays=arrays, causal=causal, kv_mask=kv_mask, **hp)

    return jax.jit(f)


def run(name, hp, q, k, v, *, causal=False, kv_mask=None, seed=0):
    """The registered op under jit (one compilation per shape keeps the suite fast)."""
    return _compiled(name, tuple(sorted(hp.items())), causal)(q, k, v, kv_mask, jax.random.key(seed + 1))


def causal_modes(name):
    return [False, True] if registry.get(name).causal else [False]


def test_every_attention_has_test_settings():
    missing = [n for n in registry.names() if n not in VARIANTS]
    assert not missing, f"add small test hyper-parameters to VARIANTS for {missing}"


def test_every_exact_attention_has_an_independent_mask():
    missing = [n for n in registry.names(exact=True) if not hasattr(masks, n)]
    assert not missing, f"add a dense mask builder to tests/masks.py for {missing}"


@pytest.mark.parametrize("name,hp", cases())
@given(n=LENGTH, seed=SEEDS)
def test_shape_dtype_finite(name, hp, n, seed):
    q, k, v = qkv(seed, n)
    for causal in causal_modes(name):
        out = run(name, hp, q, k, v, causal=causal)
        assert out.shape == (n, q.shape[1], v.shape[2])
        assert out.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("name,hp", cases())
def test_jit_vmap_grad(name, hp):
    q, k, v = qkv(0, 24)
    causal = registry.get(name).causal
    f = lambda q, k, v: run(name, hp, q, k, v, causal=causal)  # noqa: E731
    eager = f(q, k, v)
    assert_close(jax.jit(f)(q, k, v), eager, atol=1e-5)

    qb, kb, vb = (jnp.stack([x, 0.5 * x[::-1]]) for x in (q, k, v))
    batched = jax.vmap(f)(qb, kb, vb)
    assert_close(batched[0], eager, atol=1e-5)
    assert_close(batched[1], f(qb[1], kb[1], vb[1]), atol=1e-5)

    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    used = (0, 1, 2) if registry.get(name).content_based else (2,)  # FNet / Synthesizer ignore q, k
    for i, g in enumerate(grads):
        assert bool(jnp.all(jnp.isfinite(g)))
        if i in used:
            assert float(jnp.abs(g).max()) > 0


@pytest.mark.parametrize("name,hp", cases(causal=True))
@given(n=LENGTH, seed=SEEDS, data=st.data())
def test_causal_never_reads_the_future(name, hp, n, seed, data):
    i = data.draw(st.integers(0, n - 2), label="position")
    q, k, v = qkv(seed, n)
    k2 = k.at[i + 1 :].set(jax.random.normal(jax.random.key(seed + 7), k[i + 1 :].shape))
    v2 = v.at[i + 1 :].set(100.0)
    a = run(name, hp, q, k, v, causal=True)
    b = run(name, hp, q, k2, v2, causal=True)
    assert_close(a[: i + 1], b[: i + 1], atol=1e-5)
    assert not np.allclose(a[i + 1 :], b[i + 1 :]), "the perturbation should change later outputs"


@pytest.mark.parametrize("name,hp", cases(kv_mask=True))
@given(n=LENGTH, seed=SEEDS, data=st.data())
def test_padded_keys_never_change_real_outputs(name, hp, n, seed, data):
    real_len = data.draw(st.integers(n // 2, n - 1), label="real length")
    q, k, v = qkv(seed, n)
    kv_mask = jnp.arange(n) < real_len
    k2 = k.at[real_len:].set(jax.random.normal(jax.random.key(seed + 3), k[real_len:].shape) * 10)
    v2 = v.at[real_len:].set(1e4)
    for causal in causal_modes(name):
        a = run(name, hp, q, k, v, causal=causal, kv_mask=kv_mask)
        b = run(name, hp, q, k2, v2, causal=causal, kv_mask=kv_mask)
        assert bool(jnp.all(jnp.isfinite(a)))
        assert_close(a[:real_len], b[:real_len], atol=1e-5)


@pytest.mark.parametrize("name,hp", cases(kv_mask=True))
def test_all_keys_padded_gives_zeros_not_nan(name, hp):
    q, k, v = qkv(1, 24)
    out = run(name, hp, q, k, v, kv_mask=jnp.zeros((24,), bool))
    assert_close(out, jnp.zeros_like(out), atol=0)
    g = jax.grad(lambda q: run(name, hp, q, k, v, kv_mask=jnp.zeros((24,), bool)).sum())(q)
    assert bool(jnp.all(jnp.isfinite(g)))


@pytest.mark.parametrize("name,hp", cases(exact=True))
@given(n=LENGTHS, seed=SEEDS, padded=st.booleans())
def test_exact_equals_softmax_with_the_dense_mask(name, hp, n, seed, padded):
    spec = registry.get(name)
    hp_full = spec.validate(hp)
    q, k, v = qkv(seed, n)
    kv_mask = (jnp.arange(n) < n - 5) if padded else None
    arrays = spec.init_arrays(jax.random.key(seed + 1), heads=4, kv_heads=2, d_k=8, d_v=6, **hp)
    for causal in causal_modes(name):
        out = run(name, hp, q, k, v, causal=causal, kv_mask=kv_mask, seed=seed)
        expected = v
        for m in getattr(masks, name)(n, hp_full, arrays, causal):
            keys = jnp.repeat(k, expected.shape[1] // k.shape[1], axis=1)  # values may be per query head
            expected = softmax_attention(q, keys, expected, mask=jnp.asarray(m), kv_mask=kv_mask)
        assert_close(out, expected, atol=2e-5)


@pytest.mark.parametrize("name,hp", cases())
def test_bf16_close_to_float32(name, hp):
    q, k, v = qkv(2, 37)
    for causal in causal_modes(name):
        full = run(name, hp, q, k, v, causal=causal)
        half = run(name, hp, *(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=causal)
        assert half.dtype == jnp.bfloat16
        assert_close(half, full, atol=6e-2, rtol=6e-2)


@pytest.mark.parametrize("name,hp", cases(decode=True))
def test_decoding_token_by_token_equals_the_causal_forward(name, hp):
    n = 24
    q, k, v = qkv(3, n)
    spec = registry.get(name)
    arrays = spec.init_arrays(jax.random.key(5), heads=4, kv_heads=2, d_k=8, d_v=6, **hp)
    parallel = spec(q, k, v, arrays=arrays, causal=True, **hp)
    state = decoding.init_state(name, max_len=n, kv_heads=2, d_k=8, d_v=6, arrays=arrays, **hp)

    @jax.jit
    def step(q_t, k_t, v_t, state):
        return decoding.decode_step(name, q_t, k_t, v_t, state, arrays=arrays, **hp)

    for t in range(n):
        out, state = step(q[t], k[t], v[t], state)
        assert_close(out, parallel[t], atol=2e-5, rtol=2e-4)
    assert int(state.length) == n


@pytest.mark.parametrize("name", registry.names(supports_cross=True))
def test_cross_attention_lengths(name):
    q, k, v = qkv(4, 10, kv_len=27)
    hp = VARIANTS[name][0]
    out = run(name, hp, q, k, v)
    assert out.shape == (10, 4, 6)
    assert bool(jnp.all(jnp.isfinite(out)))


@pytest.mark.parametrize("name", [n for n in registry.names() if n not in registry.names(supports_cross=True)])
def test_self_attention_only_rejects_cross_lengths(name):
    q, k, v = qkv(4, 10, kv_len=27)
    with pytest.raises(ValueError, match="q_len"):
        run(name, VARIANTS[name][0], q, k, v)
