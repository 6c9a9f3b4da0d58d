"""The survey's combined attentions (jxformers/ops/survey.py) beyond the generic suite:
adaptively sparse attention against sparsemax's closed form, softmax as alpha -> 1 and
finite differences for both gradients (scores and alpha), with alpha trained per head;
the Long-Short Transformer and Poolingformer against numpy references written from
their papers. Small shapes throughout."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, jitted_call, qkv

from jxformers import ModelConfig, build_model, nn, ops, registry
from jxformers.ops import softmax_attention

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


def arrays_for(name, seed=1, heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V, **hp):
    return registry.bind(name, **hp).init_arrays(jax.random.key(seed), heads=heads, kv_heads=kv_heads, d_k=d_k, d_v=d_v)


# ----------------------------------------------------------------------------- adaptive sparse


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
    errors = [float(jnp.abs(call(ops.adaptive_sparse_attention, q, k, v, alpha=a) - dense).max())
              for a in (1.5, 1.1, 1.01, 1.001)]
    assert errors == sorted(errors, reverse=True), errors
    assert errors[-1] < 5e-3 and errors[0] > 2e-2
    # A learned alpha near 1 (a very negative a) too.
    near_one = call(ops.adaptive_sparse_attention, q, k, v, alpha_logit=jnp.full((HEADS,), -8.0))
    assert_close(near_one, dense, atol=5e-3)


def one_hot_values(n):
    """v = I: the output of query i is its row of attention weights, per head."""
    return jnp.broadcast_to(jnp.eye(n)[:, None, :], (n, KV_HEADS, n))


@pytest.mark.parametrize("hp", [dict(alpha=1.5), dict(alpha=2.0), dict(alpha_logit=jnp.array([-1.0, 0.0, 1.0, 3.0]))],
                         ids=["alpha=1.5", "sparsemax", "learned"])
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
        fd_z = np.array([[(f(z.at[i, j].add(eps), alpha) - f(z.at[i, j].add(-eps), alpha)) / (2 * eps)
                          for j in range(7)] for i in range(4)])
        fd_alpha = np.array([(f(z, alpha.at[i].add(eps)) - f(z, alpha.at[i].add(-eps))) / (2 * eps) for i in range(4)])
        fd_s = np.array([[(fs(z.at[i, j].add(eps)) - fs(z.at[i, j].add(-eps))) / (2 * eps) for j in range(7)]
                         for i in range(4)])
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

    config = ModelConfig(task="lm", vocab_size=11, num_layers=1, d_model=16, num_heads=2, d_ff=16, max_len=16,
                         attention="adaptive_sparse", attention_kwargs={"alpha": 1.5})
    model = build_model(config, key=jax.random.key(0))
    params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))

    def paths(tree):
        return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]

    assert [p for p in paths(params) if "alpha_logit" in p]  # given to the optimizer
    assert not [p for p in paths(drawn) if "alpha_logit" in p]
    optimizer = optax.adam(1e-2)
    state = TrainState(params=params, drawn=drawn, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                       rng=jax.random.key(3))
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


# ----------------------------------------------------------------------------- Long-Short


def layer_norm_np(x, params):
    """LayerNorm of each token over its heads and features together (DualLN), numpy."""
    mean = x.mean(axis=(-2, -1), keepdims=True)
    var = ((x - mean) ** 2).mean(axis=(-2, -1), keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * params[0] + params[1]


def softmax_np(s, real):
    s = np.where(real, s, -np.inf)
    if not real.any():
        return np.zeros_like(s)
    e = np.where(real, np.exp(s - s[real].max()), 0.0)
    return e / e.sum()


def long_short_np(q, k, v, arrays, *, window, segment_size, causal, kv_mask=None):
    """Transformer-LS from the paper, one query and one head at a time (numpy, float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    a = {name: np.asarray(x, np.float64) for name, x in arrays.items()}
    n, heads, d = q.shape
    group = heads // k.shape[1]
    real = np.ones(n, bool) if kv_mask is None else np.asarray(kv_mask)
    k_local, v_local = layer_norm_np(k, a["ln_local_k"]), layer_norm_np(v, a["ln_local_v"])
    rank = a["proj_w"].shape[-1]

    def project(lo, hi):  # P = softmax over the real positions of [lo, hi) of K W_P; -> K_bar, V_bar [rank, h, d]
        idx = np.arange(lo, min(hi, n))
        scores = np.einsum("lhd,hdr->lhr", k[idx], a["proj_w"])
        p = np.stack([np.stack([softmax_np(scores[:, h, r], real[idx]) for r in range(rank)], 1)
                      for h in range(k.shape[1])], 1)  # [l, h, r]
        kbar, vbar = np.einsum("lhr,lhd->rhd", p, k[idx]), np.einsum("lhr,lhd->rhd", p, v[idx])
        return layer_norm_np(kbar, a["ln_proj_k"]), layer_norm_np(vbar, a["ln_proj_v"]), real[idx].any()

    if not causal:
        whole = project(0, n)
    out = np.zeros((n, heads, v.shape[-1]))
    for i in range(n):
        j = np.arange(n)
        if causal:
            near = real & (j <= i) & (j > i - window)
            far = [project(c * segment_size, (c + 1) * segment_size) for c in range(i // segment_size)]
        else:
            start = (i // window) * window
            near = real & (j >= start - window // 2) & (j < start + window + window // 2)
            far = [whole]
        for hq in range(heads):
            h = hq // group
            keys = [k_local[near, h]] + [kb[:, h] for kb, _, ok in far if ok]
            values = [v_local[near, h]] + [vb[:, h] for _, vb, ok in far if ok]
            keys, values = np.concatenate(keys), np.concatenate(values)
            if len(keys) == 0:
                continue
            p = softmax_np(keys @ q[i, hq] / np.sqrt(d), np.ones(len(keys), bool))
            out[i, hq] = p @ values
    return out


def random_arrays(name, seed=7, **hp):
    """The attention's arrays with every entry random (LayerNorm gains and biases too)."""
    made = arrays_for(name, **hp)
    keys = jax.random.split(jax.random.key(seed), len(made))
    return {n: x + 0.3 * jax.random.normal(kk, x.shape) for kk, (n, x) in zip(keys, sorted(made.items()), strict=True)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, hp", [(19, dict(window=4, segment_size=5, rank=3)), (16, dict(window=6, segment_size=4, rank=2))])
def test_long_short_equals_the_papers_formula(causal, n, hp):
    q, k, v = qkv(8, n)
    arrays = random_arrays("long_short", rank=hp["rank"])
    kv_mask = jnp.arange(n) < n - 3
    out = call(ops.long_short_attention, q, k, v, window=hp["window"], segment_size=hp["segment_size"], causal=causal,
               kv_mask=kv_mask, **arrays)
    expected = long_short_np(q, k, v, arrays, window=hp["window"], segment_size=hp["segment_size"], causal=causal,
                             kv_mask=kv_mask)
    assert_close(out[: n - 3], expected[: n - 3], atol=2e-5, rtol=1e-4)


def test_long_short_projection_reaches_beyond_the_window_and_dual_ln_matters():
    n = 24
    q, k, v = qkv(9, n)
    hp = dict(window=4, segment_size=4)
    arrays = random_arrays("long_short", rank=2)
    for causal in (False, True):
        out = call(ops.long_short_attention, q, k, v, **hp, causal=causal, **arrays)
        # Query 20 sees token 2 only through the projection: changing token 2's value moves it.
        moved = call(ops.long_short_attention, q, k, v.at[2].add(3.0), **hp, causal=causal, **arrays)
        assert float(jnp.abs(moved[20] - out[20]).max()) > 1e-3
        # The two LayerNorms are separate: changing only the projected ones' gain changes the output.
        other = arrays | {"ln_proj_k": arrays["ln_proj_k"].at[0].multiply(2.0)}
        assert float(jnp.abs(call(ops.long_short_attention, q, k, v, **hp, causal=causal, **other) - out).max()) > 1e-3


def test_long_short_needs_its_projection():
    q, k, v = qkv(0, 8)
    with pytest.raises(ValueError, match="proj_w"):
        ops.long_short_attention(q, k, v, window=4)
    with pytest.raises(ValueError, match="proj_w"):
        ops.long_short_attention(q, k, v, window=4, proj_w=jnp.zeros((2, 5, 3)))


# ----------------------------------------------------------------------------- Poolingformer


def poolingformer_np(q, k, v, arrays, *, window, pool_window, pool_size, pool_stride, pooling, kv_mask=None):
    """Poolingformer's two levels from the paper, one query and head at a time (numpy, float64):
    y = window attention; z = attention of Y W'_Q to the pooled Y W'_K, Y W'_V slots inside
    the larger window; out = y + z."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    a = {name: np.asarray(x, np.float64) for name, x in arrays.items()}
    n, heads, d = q.shape
    group = heads // k.shape[1]
    real = np.ones(n, bool) if kv_mask is None else np.asarray(kv_mask)
    j = np.arange(n)
    y = np.zeros((n, heads, v.shape[-1]))
    for i in range(n):
        for hq in range(heads):
            p = softmax_np(k[:, hq // group] @ q[i, hq] / np.sqrt(d), real & (np.abs(i - j) <= window))
            y[i, hq] = p @ v[:, hq // group]
    flat = y.reshape(n, -1)
    q2, k2, v2 = (np.einsum("nc,chd->nhd", flat, a[name]) for name in ("level2_q", "level2_k", "level2_v"))
    starts = np.arange(0, n, pool_stride)
    pool = np.mean if pooling == "mean" else np.max
    slots = []  # (start, pooled key [heads, d], pooled value [heads, dv]) of slots holding a real token
    for s in starts:
        idx = np.arange(s, min(s + pool_size, n))
        idx = idx[real[idx]]
        if len(idx):
            slots.append((s, pool(k2[idx], axis=0), pool(v2[idx], axis=0)))
    z = np.zeros_like(y)
    for i in range(n):
        inside = [(kk, vv) for s, kk, vv in slots if s >= i - pool_window and s + pool_size - 1 <= i + pool_window]
        if not inside:
            continue
        keys, values = np.stack([kk for kk, _ in inside]), np.stack([vv for _, vv in inside])  # [m, heads, d]
        for hq in range(heads):
            p = softmax_np(keys[:, hq] @ q2[i, hq] / np.sqrt(d), np.ones(len(inside), bool))
            z[i, hq] = p @ values[:, hq]
    return y + z


@pytest.mark.parametrize("hp", [dict(window=2, pool_window=8, pool_size=3, pool_stride=2, pooling="mean"),
                                dict(window=1, pool_window=20, pool_size=4, pool_stride=3, pooling="max"),
                                dict(window=3, pool_window=5, pool_size=5, pool_stride=5, pooling="mean")],
                         ids=["mean", "max-wide", "kernel=stride"])
def test_poolingformer_equals_the_papers_two_levels(hp):
    n = 29
    q, k, v = qkv(10, n)
    arrays = arrays_for("poolingformer")
    kv_mask = jnp.arange(n) < 25
    out = call(ops.poolingformer_attention, q, k, v, **hp, kv_mask=kv_mask, **arrays)
    expected = poolingformer_np(q, k, v, arrays, **hp, kv_mask=kv_mask)
    assert_close(out[:25], expected[:25], atol=2e-5, rtol=1e-4)


def test_poolingformer_second_level_reads_the_first_levels_output_beyond_its_window():
    n = 32
    q, k, v = qkv(11, n)
    hp = dict(window=1, pool_window=12, pool_size=2, pool_stride=2)
    arrays = arrays_for("poolingformer")
    out = call(ops.poolingformer_attention, q, k, v, **hp, **arrays)
    # Token 20 is 10 away from token 10: outside level 1's window, inside level 2's.
    moved = call(ops.poolingformer_attention, q, k, v.at[20].add(5.0), **hp, **arrays)
    assert float(jnp.abs(moved[10] - out[10]).max()) > 1e-3
    # Without the second level's value projection there is only level 1: far tokens no longer matter.
    silent = arrays | {"level2_v": jnp.zeros_like(arrays["level2_v"])}
    a = call(ops.poolingformer_attention, q, k, v, **hp, **silent)
    b = call(ops.poolingformer_attention, q, k, v.at[20].add(5.0), **hp, **silent)
    assert_close(a[10], b[10], atol=1e-6)
    assert_close(a, call(ops.local_attention, q, k, v, window=1), atol=1e-5)


def test_poolingformer_refuses_causal_and_names_its_arrays():
    bound = registry.bind("poolingformer", window=2, pool_window=8, pool_size=3, pool_stride=2)
    assert not bound.spec.supports_causal
    q, k, v = qkv(0, 12)
    with pytest.raises(ValueError, match="causal"):
        bound(q, k, v, arrays=arrays_for("poolingformer"), causal=True)
    with pytest.raises(ValueError, match="causal"):
        ModelConfig(task="lm", vocab_size=11, num_layers=1, d_model=16, num_heads=2, d_ff=16, max_len=16,
                    attention="poolingformer")
    with pytest.raises(ValueError, match="level2_q"):
        ops.poolingformer_attention(q, k, v, window=2, pool_window=8)
    with pytest.raises(ValueError, match="level2_v"):
        ops.poolingformer_attention(q, k, v, window=2, pool_window=8,
                                    **(arrays_for("poolingformer") | {"level2_v": jnp.zeros((3, 4, 6))}))
