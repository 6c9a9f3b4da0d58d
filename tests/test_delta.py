"""The delta rule (Schlag, Irie & Schmidhuber 2021) and the gated delta rule (Yang, Kautz
& Hatamizadeh 2024) against their recurrences written step by step in numpy; the chunked
(WY) form against the recurrent one, in bfloat16 at 16K tokens too; DPFP against its
definition; padding, the token inputs (beta, alpha), decoding and the causal-only refusal.
The generic suites (tests/attention_facts.py rows) check the rest."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import forward_and_grad

from jxformers import ModelConfig, build_model, registry
from jxformers.ops import delta_attention, delta_rule, dpfp_features, gated_delta_attention, linear_attention
from jxformers.ops.delta import _unit_lower_inverse as unit_lower_inverse
from jxformers.ops.delta import beta_params, gated_delta_gates, gated_delta_params

# 13 tokens: chunks of 5 leave a tail of 3; grouped queries (two query heads per key head)
# against the numpy references, which read each key head's state from its query heads.
N, HEADS, KV_HEADS, D_K, D_V = 13, 4, 2, 6, 5


def inputs(seed, n=N, heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V):
    r = np.random.default_rng(seed)
    q = r.normal(size=(n, heads, d_k)).astype(np.float32)
    k = r.normal(size=(n, kv_heads, d_k)).astype(np.float32)
    v = r.normal(size=(n, kv_heads, d_v)).astype(np.float32)
    beta = (1 / (1 + np.exp(-r.normal(size=(n, kv_heads))))).astype(np.float32)
    alpha = np.exp(-np.log1p(np.exp(r.normal(size=(n, kv_heads))))).astype(np.float32)  # exp(-softplus) in (0, 1)
    return q, k, v, beta, alpha


@functools.cache
def jitted(op, **static):
    """`op` with these static arguments, compiled once per shape (eagerly, each primitive
    of the chunked form compiles alone: seconds a call)."""
    return jax.jit(functools.partial(op, **static))


@functools.cache
def both_forms(op, **static):
    """(recurrent, chunked) outputs of `op` in one compiled program."""
    return jax.jit(lambda *a, **kw: tuple(op(*a, form=f, **static, **kw) for f in ("recurrent", "chunked")))


# ----------------------------------------------------------------------------- numpy references


def np_dpfp(x, nu):
    """Schlag et al. 2021: r = [relu(x), relu(-x)], phi_{i + 2d (j-1)} = r_i r_{i+j} (mod 2d)."""
    r = np.concatenate([np.maximum(x, 0), np.maximum(-x, 0)], -1)
    two_d = r.shape[-1]
    out = np.zeros((*x.shape[:-1], two_d * nu), np.float64)
    for j in range(1, nu + 1):
        for i in range(two_d):
            out[..., i + two_d * (j - 1)] = r[..., i] * r[..., (i + j) % two_d]
    return out


def np_phi(x, feature_map, nu=2):
    if feature_map == "elu":
        f = np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    elif feature_map == "relu":
        f = np.maximum(x, 0)
    else:
        f = np_dpfp(x, nu)
    s = f.sum(-1, keepdims=True)
    return np.where(s == 0, 0, f / np.where(s == 0, 1, s))


def np_delta(q, k, v, beta, feature_map="elu", nu=2):
    """W_i = W_{i-1} + beta_i (v_i - W_{i-1} phi(k_i)) (x) phi(k_i), y_i = W_i phi(q_i), per key head."""
    n, heads = q.shape[:2]
    kv_heads, group = k.shape[1], heads // k.shape[1]
    pq, pk = np_phi(q.astype(np.float64), feature_map, nu), np_phi(k.astype(np.float64), feature_map, nu)
    out = np.zeros((n, heads, v.shape[2]))
    for h in range(kv_heads):
        w = np.zeros((v.shape[2], pk.shape[2]))
        for i in range(n):
            w = w + beta[i, h] * np.outer(v[i, h] - w @ pk[i, h], pk[i, h])
            for g in range(group):
                out[i, h * group + g] = w @ pq[i, h * group + g]
    return out


def np_gated_delta(q, k, v, beta, alpha):
    """S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T, o_t = S_t q_t,
    q and k L2-normalised (Yang et al. 2024), per key head."""
    n, heads = q.shape[:2]
    kv_heads, group = k.shape[1], heads // k.shape[1]

    def unit(x):
        x = x.astype(np.float64)
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    qn, kn = unit(q), unit(k)
    eye = np.eye(k.shape[2])
    out = np.zeros((n, heads, v.shape[2]))
    for h in range(kv_heads):
        s = np.zeros((v.shape[2], k.shape[2]))
        for t in range(n):
            kt = kn[t, h]
            s = s @ (alpha[t, h] * (eye - beta[t, h] * np.outer(kt, kt))) + beta[t, h] * np.outer(v[t, h], kt)
            for g in range(group):
                out[t, h * group + g] = s @ qn[t, h * group + g]
    return out


# ----------------------------------------------------------------------------- the formulas


def test_dpfp_is_the_papers_projection():
    x = np.random.default_rng(0).normal(size=(3, 2, 4)).astype(np.float32)
    for nu in (1, 3):
        assert_close(dpfp_features(x, nu), np_dpfp(x, nu), atol=1e-6)
    assert dpfp_features(x).shape == (3, 2, 16)  # 2 d nu with the default nu = 2


def test_linear_attention_takes_dpfp():
    q, k, v, _, _ = inputs(1)
    out = jitted(linear_attention, feature_map="dpfp")(q, k, v)
    pq = np_dpfp(q, 2)
    pk = np.repeat(np_dpfp(k, 2), 2, axis=1)
    vv = np.repeat(v, 2, axis=1)
    scores = np.einsum("ihm,jhm->hij", pq, pk)
    expected = np.einsum("hij,jhd->ihd", scores, vv) / scores.sum(-1).T[:, :, None]
    assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feature_map", ["elu", "dpfp"])
def test_delta_rule_is_the_papers_recurrence_in_both_forms(feature_map):
    q, k, v, beta, _ = inputs(2)
    want = np_delta(q, k, v, beta, feature_map, nu=3)
    order = {"dpfp_nu": 3} if feature_map == "dpfp" else {}
    for out in both_forms(delta_attention, feature_map=feature_map, chunk_size=5, **order)(q, k, v, beta=beta):
        assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_gated_delta_rule_is_the_papers_recurrence_in_both_forms():
    q, k, v, beta, alpha = inputs(3)
    want = np_gated_delta(q, k, v, beta, alpha)
    for out in both_forms(gated_delta_attention, chunk_size=5)(q, k, v, beta=beta, log_alpha=np.log(alpha)):
        assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_chunked_equals_recurrent_under_strong_decay_and_full_writes():
    # alpha down to e^-40 per token (gamma underflows within a chunk) and beta = 1.
    q, k, v, _, _ = inputs(4, n=29)
    log_alpha = -np.random.default_rng(5).uniform(0, 40, size=(29, KV_HEADS)).astype(np.float32)
    beta = np.ones((29, KV_HEADS), np.float32)
    forms = both_forms(gated_delta_attention, chunk_size=8)(q, k, v, beta=beta, log_alpha=log_alpha)
    assert_close(*forms, atol=1e-5, rtol=1e-5)
    assert_close(forms[0], np_gated_delta(q, k, v, beta, np.exp(log_alpha.astype(np.float64))), atol=1e-5)


def test_gradients_are_finite_and_agree_between_forms():
    # (the plain rule's gradients: the generic suite's jit/vmap/grad test)
    q, k, v, beta, alpha = inputs(6)

    def loss(q, k, v, b, a):
        recurrent, chunked = both_forms(gated_delta_attention, chunk_size=5)(q, k, v, beta=b, log_alpha=a)
        return jnp.sum(jnp.sin(recurrent)), jnp.sum(jnp.sin(chunked))

    grads = jax.jit(jax.jacrev(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, beta, np.log(alpha))
    for recurrent, chunked in zip(*grads, strict=True):
        assert np.all(np.isfinite(np.asarray(chunked))) and float(jnp.abs(chunked).max()) > 0
        assert_close(chunked, recurrent, atol=1e-4, rtol=1e-4)


def test_bf16_chunked_stays_close_to_the_float32_recurrence_at_16k_tokens():
    n = 16384
    r = np.random.default_rng(7)
    q, k, v = (r.normal(size=(n, 1, 8)).astype(np.float32) for _ in range(3))
    beta = (1 / (1 + np.exp(-r.normal(size=(n, 1))))).astype(np.float32)
    log_alpha = -0.05 * np.log1p(np.exp(r.normal(size=(n, 1)))).astype(np.float32)  # a memory of ~30 tokens
    half = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    got = jax.jit(lambda q, k, v, b, a: gated_delta_attention(q, k, v, beta=b, log_alpha=a))(
        *half, jnp.asarray(beta, jnp.bfloat16), jnp.asarray(log_alpha)
    )
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32))
    assert np.all(np.isfinite(got))
    # The reference: the float32 recurrence on the same (bf16-rounded) inputs.
    rounded = [np.asarray(x.astype(jnp.float32)) for x in half]
    beta_rounded = np.asarray(jnp.asarray(beta, jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(
        jax.jit(
            lambda q, k, v: gated_delta_attention(q, k, v, beta=beta_rounded, log_alpha=log_alpha, form="recurrent")
        )(*rounded)
    )
    err = np.abs(got - want)
    # Outputs reach |3|, where a bfloat16 half-ulp is 0.0078: float32 states leave the
    # output's rounding alone (mean 5e-4); states rounded to bfloat16 each step give a
    # mean of 2e-3 and a max of 2.5e-2 on these inputs.
    assert err.max() < 1e-2 and err.mean() < 1e-3, f"error max {err.max()}, mean {err.mean()} at 16K tokens"
    assert err[-1024:].mean() < 2 * err[:1024].mean() + 1e-3, "the error grows along the sequence"


# ----------------------------------------------------------------------------- padding, GQA, refusals


def test_padded_positions_never_write():
    """Padding in the middle: the real rows equal the op on the real tokens alone (the
    gated rule in both forms, the plain one chunked)."""
    q, k, v, beta, alpha = inputs(8)
    real = np.ones(N, bool)
    real[[2, 6, 7]] = False
    k_pad, v_pad = k.copy(), v.copy()
    k_pad[~real], v_pad[~real] = np.nan, 1e4
    la = np.log(alpha)
    gated, plain = both_forms(gated_delta_attention, chunk_size=5), jitted(delta_attention, chunk_size=5)
    alone = gated(q[real], k[real], v[real], beta=beta[real], log_alpha=la[real])
    for out, want in zip(gated(q, k_pad, v_pad, beta=beta, log_alpha=la, kv_mask=real), alone, strict=True):
        assert_close(np.asarray(out)[real], want, atol=1e-5)
    out = plain(q, k_pad, v_pad, beta=beta, kv_mask=real)
    assert_close(np.asarray(out)[real], plain(q[real], k[real], v[real], beta=beta[real]), atol=1e-5)


def test_non_causal_use_is_refused_with_a_reason():
    q, k, v, _, _ = inputs(10)
    for op in (delta_attention, gated_delta_attention):
        with pytest.raises(ValueError, match="causal only"):
            op(q, k, v, causal=False)
    for name in ("delta", "gated_delta"):
        with pytest.raises(ValueError, match="causal only"):
            registry.bind(name)(q, k, v, causal=False)
    with pytest.raises(ValueError, match="causal"):
        beta_params(jax.random.key(0), d_model=8, kv_heads=2, causal=False)


def test_delta_rule_refuses_gates_of_the_wrong_shape():
    q, k, v, beta, _ = inputs(11)
    with pytest.raises(ValueError, match="beta"):
        delta_rule(q, k, v, beta[:, :1])
    with pytest.raises(ValueError, match="form"):
        delta_rule(q, k, v, beta, form="scan")


# ----------------------------------------------------------------------------- token inputs, decoding


def test_gates_follow_the_papers_parametrisation():
    params = gated_delta_params(jax.random.key(1), d_model=8, kv_heads=3, causal=True)
    a = np.exp(np.asarray(params["a_log"]))
    dt = np.log1p(np.exp(np.asarray(params["dt_bias"])))
    assert np.all((a > 0) & (a <= 16)) and np.all((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7))
    x = jnp.asarray(np.random.default_rng(12).normal(size=(5, 8)), jnp.float32)
    got = gated_delta_gates(params, x, x, {})
    xn = np.asarray(x)
    pre = xn @ np.asarray(params["alpha_w"]) + np.asarray(params["dt_bias"])
    assert_close(got["log_alpha"], -a * np.log1p(np.exp(pre)), atol=1e-5, rtol=1e-5)
    assert_close(got["beta"], 1 / (1 + np.exp(-(xn @ np.asarray(params["beta_w"])))), atol=1e-6)
    assert np.all(np.asarray(got["log_alpha"]) < 0)


def test_decoding_with_the_gates_equals_every_prefix_of_the_parallel_forward():
    # (the plain rule decodes with its beta in the generic suite's language model)
    name = "gated_delta"
    q, k, v, beta, alpha = inputs(13)
    bound = registry.bind(name, chunk_size=4)
    gates = {"beta": beta, "log_alpha": np.log(alpha)}
    state = bound.init_state(max_len=N, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)
    step = jax.jit(lambda q, k, v, state, gates: bound.decode_step(q, k, v, state, arrays=gates))
    forward = jax.jit(lambda q, k, v, gates: bound(q, k, v, arrays=gates, causal=True))
    decoded = []
    for t in range(N):
        out, state = step(q[t], k[t], v[t], state, {n: g[t : t + 1] for n, g in gates.items()})
        decoded.append(out)
    full = forward(q, k, v, gates)
    assert_close(jnp.stack(decoded), full, atol=2e-5, rtol=2e-4)
    # A prefix's own forward (its own chunking: a tail of 2) ends where decoding was then.
    prefix = forward(q[:6], k[:6], v[:6], {n: g[:6] for n, g in gates.items()})
    assert_close(prefix, decoded[:6], atol=2e-5, rtol=2e-4)


def test_a_language_model_from_its_config_trains_its_gates():
    """`attention: {name: gated_delta, ...}` in a config: the loss's gradient reaches the
    gates' parameters (w_beta, w_alpha, A, b), finite and non-zero."""
    config = ModelConfig(
        task="lm", vocab_size=11, num_layers=1, d_model=16, num_heads=2, kv_heads=1, max_len=8, dropout=0.0,
        attention={"name": "gated_delta", "chunk_size": 4},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(0))
    _, grads = eqx.filter_jit(forward_and_grad)(model, jnp.arange(8) % 11)
    for name, g in grads.blocks[0].attention.token_params.items():
        assert np.all(np.isfinite(g)) and float(jnp.abs(g).max()) > 0, f"{name}: no gradient"


def test_the_chunked_form_and_its_gradient_use_no_triangular_solve():
    """jax 0.10.2's CPU backend sometimes never finishes a program with the gradient of a
    batched `lax.linalg.triangular_solve` (the attention benchmark hung at N = 1024): the
    chunk's (I + A)^-1 is forward substitution instead, checked against numpy."""
    q = jax.random.normal(jax.random.key(0), (40, 2, 4))

    def loss(q):
        return jnp.sum(delta_rule(q, q, q, jnp.full((40, 2), 0.5), form="chunked", chunk_size=8))

    assert "triangular_solve" not in str(jax.make_jaxpr(jax.grad(loss))(q))
    a = np.tril(np.random.default_rng(0).normal(size=(3, 6, 6)), -1)
    inverse = np.asarray(unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    assert_close(inverse, np.linalg.inv(np.eye(6) + a), atol=1e-4)
