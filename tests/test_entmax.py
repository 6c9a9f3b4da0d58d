"""Adaptively sparse attention and its normalisers (jxformers/ops/entmax.py) beyond the
generic suite: sparsemax against its closed form, softmax as alpha -> 1 and finite
differences for both gradients (scores and alpha), with alpha trained per head. Small
shapes throughout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, jitted_call, qkv

from jxformers import ModelConfig, build_model, nn, registry
from jxformers.ops import softmax_attention

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


def arrays_for(name, seed=1, heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V, **hp):
    return registry.bind(name, **hp).init_arrays(jax.random.key(seed), heads=heads, kv_heads=kv_heads, d_k=d_k, d_v=d_v)


def sparsemax_np(z, mask=None):
    """Sparsemax of each row by sorting (Martins & Astudillo 2016, Algorithm 1), numpy."""
    z = np.asarray(z, np.float64)
    mask = np.ones(z.shape, bool) if mask is None else np.broadcast_to(mask, z.shape)
    out = np.zeros_like(z)
    for idx in np.ndindex(z.shape[:-1]):
        real = mask[idx]
        if not real.any():
            continue
        row = z[idx][real]
        zs = np.sort(row)[::-1]
        ks = np.arange(1, len(zs) + 1)
        cs = np.cumsum(zs)
        size = ks[1 + ks * zs > cs].max()
        tau = (cs[size - 1] - 1) / size
        out[idx][real] = np.maximum(row - tau, 0)
    return out


def test_sparsemax_and_entmax_at_two_equal_the_closed_form():
    z = np.random.RandomState(0).randn(6, 9).astype(np.float32) * 2
    mask = np.random.RandomState(1).rand(6, 9) > 0.3
    mask[4] = False  # a row with nothing to attend
    expected = sparsemax_np(z, mask)
    assert_close(ops.sparsemax(z, mask), expected, atol=1e-6)
    assert_close(ops.entmax(z, 2.0, mask), expected, atol=1e-6)  # the bisection agrees with the sort
    assert float(np.abs(np.asarray(ops.sparsemax(z, mask))[~mask]).max()) == 0.0


def test_sparsemax_attention_equals_numpy_sparsemax_of_the_scores():
    n = 13
    q, k, v = qkv(0, n)
    kv_mask = jnp.arange(n) < 10
    out = call(ops.adaptive_sparse_attention, q, k, v, alpha=2.0, causal=True, kv_mask=kv_mask)
    kh = np.repeat(np.asarray(k), HEADS // KV_HEADS, axis=1)
    vh = np.repeat(np.asarray(v), HEADS // KV_HEADS, axis=1)
    scores = np.einsum("qhd,khd->hqk", np.asarray(q, np.float64), kh) / np.sqrt(D_K)
    allowed = np.tril(np.ones((n, n), bool)) & np.asarray(kv_mask)[None]
    p = sparsemax_np(scores, allowed[None])
    assert_close(out, np.einsum("hqk,khd->qhd", p, vh), atol=1e-5)


def test_entmax_near_one_approaches_softmax_and_is_sparse_at_larger_alpha():
    q, k, v = qkv(1, 16)
    dense = call(softmax_attention, q, k, v)
    errors = [
        float(jnp.abs(call(ops.adaptive_sparse_attention, q, k, v, alpha=a) - dense).max())
        for a in (1.5, 1.1, 1.01, 1.001)
    ]
    assert errors == sorted(errors, reverse=True), errors
    assert errors[-1] < 5e-3 and errors[0] > 2e-2
    # A learned alpha near 1 (a very negative a) too.
    near_one = call(ops.adaptive_sparse_attention, q, k, v, alpha_logit=jnp.full((HEADS,), -8.0))
    assert_close(near_one, dense, atol=5e-3)


def one_hot_values(n):
    """v = I: the output of query i is its row of attention weights, per head."""
    return jnp.broadcast_to(jnp.eye(n)[:, None, :], (n, KV_HEADS, n))


@pytest.mark.parametrize(
    "hp",
    [dict(alpha=1.5), dict(alpha=2.0), dict(alpha_logit=jnp.array([-1.0, 0.0, 1.0, 3.0]))],
    ids=["alpha=1.5", "sparsemax", "learned"],
)
def test_weights_sum_to_one_are_sparse_and_exactly_zero_where_masked(hp):
    n = 20
    q, k, _ = qkv(2, n, d=D_K)
    q = q * 3.0  # sharper scores: sparser weights
    kv_mask = jnp.arange(n) < 16
    w = np.asarray(call(ops.adaptive_sparse_attention, q, k, one_hot_values(n), causal=True, kv_mask=kv_mask, **hp))
    assert_close(w.sum(-1), np.ones((n, HEADS)), atol=1e-5)
    assert (w >= 0).all()
    future = np.triu(np.ones((n, n), bool), k=1)
    assert np.all(w.transpose(1, 0, 2)[:, future] == 0.0)  # causal: exactly zero, not small
    assert np.all(w[:, :, 16:] == 0.0)  # padded keys: exactly zero
    allowed = np.broadcast_to(~future[8:, None, :16], w[8:, :, :16].shape)
    zeros = (w[8:, :, :16] == 0) & allowed
    assert zeros.sum() > 0.5 * allowed.sum()  # most allowed keys get exactly 0 (softmax: none)


def test_entmax_gradients_match_finite_differences_in_scores_and_alpha():
    rng = np.random.RandomState(3)
    with jax.enable_x64(True):
        z = jnp.asarray(rng.randn(4, 7) * 2.0)
        alpha = jnp.asarray([1.2, 1.5, 1.8, 1.95])
        mask = jnp.asarray(rng.rand(4, 7) > 0.2)
        g = jnp.asarray(rng.randn(4, 7))

        @jax.jit
        def f(z, alpha):
            return jnp.sum(ops.entmax(z, alpha, mask) * g)

        @jax.jit
        def fs(z):
            return jnp.sum(ops.sparsemax(z, mask) * g)

        gz, galpha = jax.grad(f, argnums=(0, 1))(z, alpha)
        eps = 1e-6
        fd_z = np.array(
            [
                [(f(z.at[i, j].add(eps), alpha) - f(z.at[i, j].add(-eps), alpha)) / (2 * eps) for j in range(7)]
                for i in range(4)
            ]
        )
        fd_alpha = np.array([(f(z, alpha.at[i].add(eps)) - f(z, alpha.at[i].add(-eps))) / (2 * eps) for i in range(4)])
        fd_s = np.array(
            [[(fs(z.at[i, j].add(eps)) - fs(z.at[i, j].add(-eps))) / (2 * eps) for j in range(7)] for i in range(4)]
        )
        np.testing.assert_allclose(np.asarray(gz), fd_z, atol=1e-7)
        np.testing.assert_allclose(np.asarray(galpha), fd_alpha, atol=1e-7)
        assert np.abs(fd_alpha).max() > 1e-3  # alpha does move the loss
        np.testing.assert_allclose(np.asarray(jax.grad(fs)(z)), fd_s, atol=1e-7)
        assert float(jnp.abs(gz)[~mask].max()) == 0.0  # nothing flows through masked scores
        # A shared (scalar) alpha sums its rows' gradients.
        ga = jax.grad(lambda a: f(z, a))(jnp.asarray(1.5))
        np.testing.assert_allclose(float(ga), float(jax.grad(lambda a: f(z, jnp.full((4,), a)))(1.5)))


def test_attention_gradient_reaches_each_heads_alpha():
    q, k, v = qkv(4, 12)
    a = jnp.array([-1.0, 0.0, 0.5, 2.0])
    g = jax.jit(jax.grad(lambda a: jnp.sum(ops.adaptive_sparse_attention(q, k, v, alpha_logit=a, causal=True) ** 2)))(a)
    assert np.all(np.abs(np.asarray(g)) > 0)
    # Chain rule through alpha = 1 + sigmoid(a): compare with a finite difference in float32.
    eps = 1e-2

    @jax.jit
    def loss(a):
        return jnp.sum(ops.adaptive_sparse_attention(q, k, v, alpha_logit=a, causal=True) ** 2)

    fd = [float(loss(a.at[i].add(eps)) - loss(a.at[i].add(-eps))) / (2 * eps) for i in range(HEADS)]
    assert_close(g, fd, atol=2e-2, rtol=2e-2)


def test_alpha_is_a_learned_parameter_that_a_train_step_moves():
    import optax

    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    config = ModelConfig(
        task="lm",
        vocab_size=11,
        num_layers=1,
        d_model=16,
        num_heads=2,
        d_ff=16,
        max_len=16,
        attention="adaptive_sparse",
        attention_kwargs={"alpha": 1.5},
    )
    model = build_model(config, key=jax.random.key(0))
    params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))

    def paths(tree):
        return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]

    assert [p for p in paths(params) if "alpha_logit" in p]  # given to the optimizer
    assert not [p for p in paths(drawn) if "alpha_logit" in p]
    optimizer = optax.adam(1e-2)
    state = TrainState(
        params=params,
        drawn=drawn,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key(3),
    )
    tokens = jax.random.randint(jax.random.key(4), (4, 12), 0, 11)
    batch = {"tokens": tokens, "mask": jnp.ones((4, 12), bool), "loss_mask": jnp.ones((4, 12), bool)}
    before = [np.asarray(a.arrays["alpha_logit"]) for a in nn.attention_modules(model)]
    new_state, metrics = make_train_step(static, optimizer, grad_accum=1)(state, batch)
    assert bool(metrics["finite"])
    after = [np.asarray(a.arrays["alpha_logit"]) for a in nn.attention_modules(new_state.model(static))]
    for b, a in zip(before, after, strict=True):
        assert b.shape == (2,) and np.all(b == 0.0)  # alpha = 1.5 at the start: a = logit(0.5) = 0
        assert np.all(a != b)  # every head's alpha moved


def test_fixed_alpha_has_no_array_and_bad_alphas_name_alpha():
    assert arrays_for("adaptive_sparse", alpha=2.0, learned=False) == {}
    assert set(arrays_for("adaptive_sparse")) == {"alpha_logit"}
    q, k, v = qkv(0, 8)
    for bad in (1.0, 2.5, 0.5):
        with pytest.raises(ValueError, match="alpha"):
            ops.adaptive_sparse_attention(q, k, v, alpha=bad)
    with pytest.raises(ValueError, match="alpha"):
        arrays_for("adaptive_sparse", alpha=2.0)  # 1 + sigmoid(a) never reaches 2
    with pytest.raises(ValueError, match="alpha_logit"):
        ops.adaptive_sparse_attention(q, k, v, alpha_logit=jnp.zeros((3,)))
