"""The attention priors (`jxformers.ops._priors`, Lin et al. 2021 section 4.5) against
their papers' formulas written in numpy: Yang et al. 2018's predicted local window, Guo
et al. 2019's Gaussian prior, Sukhbaatar et al. 2019's adaptive span (its soft mask, its
loss, the chunks it lets the chunked op skip), Guo et al. 2020's per-head windows, and
You et al. 2020's hard-coded Gaussian attention; decoding token by token, and reached
from a model config with the span loss in the train step's metrics."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, jitted
from suites import decode_all, decode_op, forward

from jxformers import registry
from jxformers.nn import ModelConfig, build_model

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D = 4, 2, 8


def qkv(seed, n):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (n, HEADS, D))
    k = jax.random.normal(keys[1], (n, KV_HEADS, D))
    v = jax.random.normal(keys[2], (n, KV_HEADS, D))
    return q, k, v


def reference(q, k, v, *, causal=False, kv_mask=None, prior=None, weight=None, allowed_fn=None):
    """Attention one query row at a time in float64 numpy: logits q.k/sqrt(d) plus
    `prior(h, i, q_i, visible)` [keys], weights times `weight(h, i)` [keys] (a soft
    mask) and keys narrowed by `allowed_fn(h, i)`."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n = q.shape[0]
    group = HEADS // KV_HEADS
    out = np.zeros((n, HEADS, v.shape[2]))
    for h in range(HEADS):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(n):
            allowed = np.ones(n, bool)
            if causal:
                allowed &= np.arange(n) <= i
            if kv_mask is not None:
                allowed &= np.asarray(kv_mask)
            visible = allowed.sum()
            s = kh @ q[i, h] / np.sqrt(D)
            if prior is not None:
                s = s + prior(h, i, q[i, h], visible)
            m = np.ones(n) if weight is None else weight(h, i)
            if allowed_fn is not None:
                allowed &= allowed_fn(h, i)
            allowed &= m > 0
            e = np.where(allowed, m * np.exp(s - s[allowed].max(initial=0.0)), 0.0)
            out[i, h] = e @ vh / e.sum() if e.sum() > 0 else 0.0
    return out


def close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=atol, rtol=1e-4)


def arrays_for(name, **hp):
    bound = registry.bind(name, **hp)
    return bound, bound.init_arrays(jax.random.key(3), heads=HEADS, kv_heads=KV_HEADS, d_k=D, d_v=D)


@pytest.mark.parametrize("causal, padded", [(False, False), (False, True), (True, False)])
def test_localness_is_a_gaussian_around_a_centre_and_window_predicted_per_query(causal, padded):
    """Yang et al. 2018 eq. 6-9: P_i = I sigmoid(U_p^T tanh(W_p q_i)), D_i = I
    sigmoid(U_d^T tanh(W_p q_i)), G_ij = -2 (j - P_i)^2 / D_i^2, I the keys it sees."""
    n = 11
    q, k, v = qkv(0, n)
    kv_mask = (jnp.arange(n) < 8) if padded else None
    bound, arrays = arrays_for("softmax", localness=True)
    w, up, ud = (np.asarray(arrays[n_], np.float64) for n_ in ("localness_w", "localness_up", "localness_ud"))

    def prior(h, i, qi, visible):
        hidden = np.tanh(qi @ w)
        centre = visible / (1 + np.exp(-(hidden @ up)))
        window = visible / (1 + np.exp(-(hidden @ ud)))
        return -2.0 * (np.arange(1, n + 1) - centre) ** 2 / window**2  # keys j = 1..I

    out = jitted(bound)(q, k, v, arrays=arrays, causal=causal, kv_mask=kv_mask)
    close(out, reference(q, k, v, causal=causal, kv_mask=kv_mask, prior=prior), atol=1e-4)
    plain = ops.softmax_attention(q, k, v, causal=causal, kv_mask=kv_mask)
    assert float(jnp.abs(out - plain).max()) > 1e-2  # the prior changes the answer


def test_gaussian_prior_is_minus_abs_of_w_d2_plus_b_with_w_and_b_kept_in_range():
    """Guo et al. 2019 as Lin et al. write it: G_ij = -|w (i - j)^2 + b|, w >= 0, b <= 0."""
    n = 9
    q, k, v = qkv(1, n)
    bound, _ = arrays_for("softmax", gaussian_prior=True)
    bound = jitted(bound)
    for w, b, w_used, b_used in [(0.3, -2.0, 0.3, -2.0), (-0.5, 1.0, 0.0, 0.0)]:
        arrays = {"gaussian_w": jnp.float32(w), "gaussian_b": jnp.float32(b)}

        def prior(h, i, qi, visible, w=w_used, b=b_used):
            return -np.abs(w * (i - np.arange(n)) ** 2 + b)

        close(bound(q, k, v, arrays=arrays), reference(q, k, v, prior=prior))


def span_mask(z, ramp, causal, n):
    def weight(h, i):
        x = i - np.arange(n) if causal else np.abs(i - np.arange(n))
        return np.clip((ramp + z[h] - x) / ramp, 0.0, 1.0)

    return weight


@pytest.mark.parametrize("causal", [False, True])
def test_adaptive_span_weights_are_the_soft_mask_times_exp_and_learn_z(causal):
    """Sukhbaatar et al. 2019 eq. 3-4: a_ij = m_z(i - j) exp(s_ij) / sum_r m_z(i - r)
    exp(s_ir), m_z(x) = clamp((R + z - x) / R, 0, 1), z = S span_z per head."""
    n, span, ramp = 13, 6, 3
    q, k, v = qkv(2, n)
    bound, _ = arrays_for("softmax", adaptive_span=span, span_ramp=ramp)
    span_z = jnp.array([0.0, 0.25, 0.5, 1.0])
    op = jitted(bound)
    out = op(q, k, v, arrays={"span_z": span_z}, causal=causal)
    weight = span_mask(span * np.asarray(span_z), ramp, causal, n)
    close(out, reference(q, k, v, causal=causal, weight=weight))
    grad = jax.jit(jax.grad(lambda z: bound(q, k, v, arrays={"span_z": z}, causal=causal).sum()))(span_z)
    assert np.all(np.abs(np.asarray(grad)) > 0)  # every head's span learns through its ramp
    # Past the span the mask is 0: a key that far never matters.
    far = op(q, k, v.at[0].set(100.0), arrays={"span_z": span_z}, causal=causal)
    np.testing.assert_array_equal(np.asarray(far[span + ramp :]), np.asarray(out[span + ramp :]))


def test_head_windows_give_each_head_its_own_window():
    """Guo et al. 2020: head h attends the keys within w_h on either side; -1 is all."""
    n, windows = 10, (0, 1, 3, -1)
    q, k, v = qkv(3, n)
    bound, arrays = arrays_for("softmax", head_windows=windows)
    bound = jitted(bound)

    def allowed(h, i):
        return np.ones(n, bool) if windows[h] < 0 else np.abs(i - np.arange(n)) <= windows[h]

    for causal in (False, True):
        close(bound(q, k, v, arrays=arrays, causal=causal), reference(q, k, v, causal=causal, allowed_fn=allowed))
    # Window 0: the query's own value alone.
    out = bound(q, k, v, arrays=arrays)
    close(out[:, 0], np.asarray(v[:, 0], np.float64))


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_equals_dense_with_every_prior_and_skips_chunks_past_the_span(causal):
    n = 64
    q, k, v = qkv(4, n)
    hp = {"localness": True, "gaussian_prior": True, "adaptive_span": 4, "span_ramp": 2, "head_windows": (1, 3, 5, -1)}
    dense, arrays = arrays_for("softmax", **hp)
    arrays = arrays | {"span_z": jnp.array([0.1, 0.5, 0.9, 1.0]), "gaussian_w": jnp.float32(0.05)}
    chunked = registry.bind("chunked", chunk_size=8, **hp)
    kv_mask = jnp.arange(n) < 60

    @eqx.filter_jit
    def value_and_grad(op):  # the output and the gradient of its sum, one pass each op
        out, pullback = jax.vjp(lambda q: op(q, k, v, arrays=arrays, causal=causal, kv_mask=kv_mask), q)
        return out, pullback(jnp.ones_like(out))[0]

    (a, ga), (b, gb) = value_and_grad(dense), value_and_grad(chunked)
    close(b, np.asarray(a, np.float64))
    close(gb, np.asarray(ga, np.float64), atol=1e-4)
    # The reach S + R = 6 bounds the key chunks each query chunk visits: 3 of 8.
    hlo = jax.jit(lambda q: chunked(q, k, v, arrays=arrays, causal=causal)).lower(q).as_text()
    assert "dynamic-slice" in hlo or "dynamic_slice" in hlo


def test_priors_decode_token_by_token_as_the_causal_forward():
    n = 12
    q, k, v = qkv(5, n)
    hp = {"localness": True, "gaussian_prior": True, "adaptive_span": 4, "span_ramp": 2, "head_windows": (1, 2, 4, -1)}
    bound, arrays = arrays_for("softmax", **hp)
    arrays = arrays | {"span_z": jnp.array([0.1, 0.5, 0.9, 1.0])}
    parallel = jitted(bound)(q, k, v, arrays=arrays, causal=True)
    close(decode_op(bound, q, k, v, arrays), np.asarray(parallel))
    g = registry.bind("hard_gaussian", offsets=(-1, 0))
    close(decode_op(g, q, k, v, {}), np.asarray(jitted(g)(q, k, v, causal=True)))


def test_hard_coded_gaussian_weights_are_a_normal_around_i_plus_the_head_offset():
    """You et al. 2020: head h's weights N(j; i + o_h, sigma^2), normalised over the
    keys the query may attend; q and k are not read."""
    n, offsets, std = 9, (-1, 1, 0), 1.5
    q, k, v = qkv(6, n)
    out = ops.hard_gaussian_attention(q, k, v, offsets=offsets, std=std)

    def weight(h, i):
        return np.exp(-((np.arange(n) - (i + offsets[h % 3])) ** 2) / (2 * std**2))

    zero = jnp.zeros_like(q)
    close(out, reference(zero, jnp.zeros_like(k), v, weight=weight))
    np.testing.assert_array_equal(
        np.asarray(out), np.asarray(ops.hard_gaussian_attention(zero, k * 3, v, offsets=offsets, std=std))
    )
    causal = ops.hard_gaussian_attention(q, k, v, offsets=offsets, std=std, causal=True)
    close(causal, reference(zero, jnp.zeros_like(k), v, causal=True, weight=weight))


def test_bad_priors_are_refused_with_their_values():
    q, k, v = qkv(7, 6)
    with pytest.raises(ValueError, match=r"head_windows must give one int >= 0 \(or -1: every key\) per head, 4"):
        ops.softmax_attention(q, k, v, head_windows=(1, 2))
    with pytest.raises(ValueError, match=r"localness=True needs localness_w of shape \(8, 8\)"):
        ops.softmax_attention(q, k, v, localness=True)
    with pytest.raises(ValueError, match=r"adaptive_span needs span_z of shape \(4,\)"):
        ops.softmax_attention(q, k, v, adaptive_span=4)
    with pytest.raises(ValueError, match="adaptive_span"):
        registry.bind("softmax", adaptive_span=0)
    with pytest.raises(ValueError, match="localness"):
        registry.bind("performer", localness=True)  # no logits to add a prior to
    bound, arrays = arrays_for("chunked", chunk_size=4, adaptive_span=2, persistent_kv=2)
    with pytest.raises(ValueError, match="not both"):
        bound(q, k, v, arrays=arrays)
    with pytest.raises(ValueError, match="std must be a number > 0"):
        ops.hard_gaussian_attention(q, k, v, std=0.0)
    with pytest.raises(ValueError, match="head_windows gives 2 windows"):  # at config time
        ModelConfig(
            task="lm", vocab_size=5, d_model=8, num_heads=4, attention={"name": "softmax", "head_windows": (1, 2)}
        )
    with pytest.raises(ValueError, match="never compares"):
        ModelConfig(
            task="lm", vocab_size=5, d_model=8, num_heads=2, attention={"name": "hard_gaussian", "qk_norm": "l2"}
        )


def test_a_model_config_reaches_the_priors_and_the_train_step_logs_each_layers_span_loss():
    import optax

    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    attention = {"name": "softmax", "adaptive_span": 8, "span_loss_weight": 0.5, "localness": True}
    config = ModelConfig(
        task="lm", vocab_size=11, num_layers=2, d_model=16, num_heads=2, max_len=8, attention=attention
    )
    model = build_model(config, key=jax.random.key(0))
    tokens = jnp.arange(8) % 11
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(forward(model, tokens)), atol=2e-4)
    apply = eqx.filter_jit(lambda model, tokens, **kw: model.apply(tokens, **kw))
    _, produced = apply(model, tokens, key=jax.random.key(1))
    assert set(produced.layer_losses) == {"span_loss/blocks.0.attention", "span_loss/blocks.1.attention"}
    _, at_inference = apply(model, tokens, inference=True)
    assert not at_inference.layer_losses

    params, drawn, static = split_model(model)
    optimizer = optax.adam(1e-2)
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    batch = {"tokens": jnp.tile(tokens, (2, 1)), "mask": jnp.ones((2, 8), bool), "loss_mask": jnp.ones((2, 8), bool)}
    state, metrics = make_train_step(static, optimizer, grad_accum=1)(state, batch)
    # z starts at 0 (a span of R); the loss is lambda * S * mean(z) = 0, then the spans move.
    assert float(metrics["span_loss/blocks.1.attention"]) == 0.0
    z = state.params.blocks[0].attention.arrays["span_z"]
    assert float(jnp.abs(z).max()) > 0
