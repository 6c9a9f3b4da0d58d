"""Improved multi-heads (`jxformers.nn.heads`), each against a numpy reference written from
its paper's equations: collaborative heads (Cordonnier et al. 2020), disagreement
regularisation (Li et al. 2018) and routing-by-agreement (Li et al. 2019); then through
models (decoding, padding, jit/vmap/grad, bf16), the train step's metrics and the config."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import decode_all, forward

from jxformers.nn import Attention, ModelConfig, build_model
from jxformers.nn.heads import HeadEMRouting, HeadRouting, attention_weights, concatenated_mixing

D_MODEL, HEADS, D_HEAD = 16, 4, 4


def f64(a):
    return np.asarray(a, np.float64)


def linear(layer, x):
    return f64(x) @ f64(layer.weight).T + f64(layer.bias)


def softmax_rows(s, allowed):
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def allowed_keys(n, causal, kv_mask=None):
    allowed = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
    return allowed if kv_mask is None else allowed & np.asarray(kv_mask)[None, :]


def reference_heads(attention, x, causal=False, kv_mask=None):
    """Per head: the attention matrix A^h [n, n] and output O^h [n, d] of the dense softmax
    attention; collaborative heads' logits (X W_Q diag(m_h)) (X W_K)^T / sqrt(d_k)."""
    n, d = len(x), attention.d_head
    v = linear(attention.v_proj, x).reshape(n, attention.kv_heads, d)
    group = attention.num_heads // attention.kv_heads
    if attention.mixing is None:
        q = linear(attention.q_proj, x).reshape(n, attention.num_heads, d)
        k = linear(attention.k_proj, x).reshape(n, attention.kv_heads, d)
        logits = [q[:, h] @ k[:, h // group].T / math.sqrt(d) for h in range(attention.num_heads)]
    else:
        q, k, m = linear(attention.q_proj, x), linear(attention.k_proj, x), f64(attention.mixing)
        logits = [(q * m[h]) @ k.T / math.sqrt(d) for h in range(attention.num_heads)]
    a = np.stack([softmax_rows(s, allowed_keys(n, causal, kv_mask)) for s in logits], 1)  # [n, H, n]
    o = np.stack([a[:, h] @ v[:, h // group] for h in range(attention.num_heads)], 1)  # [n, H, d]
    return a, o, v


def project(attention, heads_out):
    return heads_out.reshape(len(heads_out), -1) @ f64(attention.o_proj.weight).T + f64(attention.o_proj.bias)


# ------------------------------------------------------------------ collaborative heads


@pytest.mark.parametrize("causal", [False, True])
def test_collaborative_logits_mix_one_shared_query_and_key_per_head(causal):
    attention = Attention("softmax", D_MODEL, HEADS, kv_heads=2, collaborative=12, causal=causal, key=jax.random.key(0))
    assert attention.q_proj.weight.shape == attention.k_proj.weight.shape == (12, D_MODEL)  # one W_Q, one W_K
    mixing = jax.random.normal(jax.random.key(1), (HEADS, 12))
    attention = eqx.tree_at(lambda a: a.mixing, attention, mixing)
    x = jax.random.normal(jax.random.key(2), (7, D_MODEL))
    _, o, _ = reference_heads(attention, x, causal)
    got = np.asarray(attention(x))
    np.testing.assert_allclose(got, project(attention, o), atol=2e-5)
    # the paper's 1/sqrt(d_k) (d_k the head size), not 1/sqrt(D̃_k): the other scale is off
    wrong = eqx.tree_at(lambda a: a.mixing, attention, mixing * math.sqrt(D_HEAD / 12))
    _, o_wrong, _ = reference_heads(wrong, x, causal)
    assert not np.allclose(got, project(attention, o_wrong), atol=1e-3)


def test_collaborative_heads_start_as_concatenated_heads():
    """With D̃_k = heads * d_k and the initial mixing (m_i: head i's slice), the layer is
    the concatenated multi-head attention with the same weights (the paper's special case)."""
    np.testing.assert_array_equal(np.asarray(concatenated_mixing(2, 4)), [[1, 1, 0, 0], [0, 0, 1, 1]])
    collaborative = Attention("softmax", D_MODEL, HEADS, collaborative=HEADS * D_HEAD, key=jax.random.key(3))
    concatenated = Attention("softmax", D_MODEL, HEADS, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (6, D_MODEL))
    np.testing.assert_allclose(np.asarray(collaborative(x)), np.asarray(concatenated(x)), atol=1e-6)


# ------------------------------------------------------------------ disagreement


def reference_disagreement(a, o, v, rows, keys):
    """D_subspace, D_position, D_output of Li et al. 2018 (each -1/H^2 sum_{i,j})."""

    def cos(x):
        flat = x.transpose(1, 0, 2).reshape(x.shape[1], -1)
        unit = flat / np.linalg.norm(flat, axis=1, keepdims=True)
        return -(unit @ unit.T).sum() / x.shape[1] ** 2

    a = a[rows]
    position = -sum((a[:, i] * a[:, j]).sum() for i in range(a.shape[1]) for j in range(a.shape[1])) / a.shape[1] ** 2
    return {"subspace": cos(v[keys]), "position": position, "output": cos(o[rows])}


@pytest.mark.parametrize("causal", [False, True])
def test_disagreement_losses_are_minus_lambda_times_the_papers_terms(causal):
    terms = ("subspace", "position", "output")
    attention = Attention(
        "softmax", D_MODEL, HEADS, causal=causal, disagreement=terms, disagreement_weight=0.5, key=jax.random.key(5)
    )
    x = jax.random.normal(jax.random.key(6), (7, D_MODEL))
    kv_mask = jnp.arange(7) < 5
    apply = eqx.filter_jit(lambda layer, x, **kw: layer.apply(x, **kw))  # compiled, not op by op
    out, produced = apply(attention, x, kv_mask=kv_mask)
    a, o, v = reference_heads(attention, x, causal, kv_mask)
    expected = reference_disagreement(a, o, v, np.asarray(kv_mask), np.asarray(kv_mask))
    assert set(produced.layer_losses) == {f"disagreement_{t}" for t in terms}
    for term in terms:  # J = L + λD is maximised: the objective (minimised) adds -λD
        np.testing.assert_allclose(
            float(produced.layer_losses[f"disagreement_{term}"]), -0.5 * expected[term], rtol=1e-5
        )
    assert expected["position"] < 0 < float(produced.layer_losses["disagreement_position"])
    # padded rows (even NaN) change neither the real outputs nor the losses
    poisoned = x.at[5:].set(jnp.nan)
    out2, produced2 = apply(attention, poisoned, kv_mask=kv_mask)
    np.testing.assert_allclose(np.asarray(out2[:5]), np.asarray(out[:5]), atol=1e-6)
    for name, value in produced.layer_losses.items():
        np.testing.assert_allclose(float(produced2.layer_losses[name]), float(value), rtol=1e-6)
    assert not apply(attention, x, kv_mask=kv_mask, inference=True)[1].layer_losses  # training only


@pytest.mark.parametrize("options", [{"top_k": 2, "softcap": 5.0}, {"talking_heads": True}], ids=str)
def test_the_position_term_reads_the_softmax_cores_own_matrix(options):
    """With score options the matrix is still the core's: A V is the core's output."""
    attention = Attention(
        "softmax", D_MODEL, HEADS, kv_heads=2, causal=True, attention_kwargs=options, key=jax.random.key(17)
    )
    x = jax.random.normal(jax.random.key(18), (6, D_MODEL))
    q, k, v = attention._queries(x), attention._keys(x), attention._heads(x, attention.v_proj, 2)
    arrays = attention._core_arrays(x, x)
    a = attention_weights(attention.core, q, k, v, arrays=arrays, causal=True, kv_mask=None, bias=None)
    out = attention.core(q, k, v, arrays=arrays, causal=True)
    np.testing.assert_allclose(
        np.asarray(jnp.einsum("qhk,khd->qhd", a, jnp.repeat(v, 2, 1))), np.asarray(out), atol=1e-5
    )
    assert float(jnp.max(jnp.triu(jnp.moveaxis(a, 1, 0), 1))) == 0.0  # causal: no weight on the future


def test_minimising_the_losses_makes_the_heads_disagree():
    terms = ("subspace", "position", "output")
    attention = Attention("softmax", D_MODEL, HEADS, disagreement=terms, key=jax.random.key(7))
    x = jax.random.normal(jax.random.key(8), (9, D_MODEL))
    params, static = eqx.partition(attention, eqx.is_inexact_array)

    def losses(p):
        return eqx.combine(p, static).apply(x)[1].layer_losses

    def disagreement(p):  # the paper's D of each term, from the numpy reference
        a, o, v = reference_heads(eqx.combine(p, static), x)
        return reference_disagreement(a, o, v, slice(None), slice(None))

    step = jax.jit(jax.grad(lambda p: sum(losses(p).values())))
    before = disagreement(params)
    for _ in range(20):
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, step(params))
    after = disagreement(params)
    for term in terms:  # gradient descent on the objective raised each D: the heads disagree more
        assert after[term] > before[term], (term, before[term], after[term])


# ------------------------------------------------------------------ routing-by-agreement


def reference_routing(u, w, iterations):
    """Li et al. 2019's simple routing, position by position: votes V_{h→n} = Ω_h W_{h→n};
    C = softmax_n(B); Ω_n = squash(sum_h C V); B += Ω_n · V."""
    out = np.zeros((u.shape[0], w.shape[1], w.shape[3]))
    for p in range(u.shape[0]):
        votes = np.einsum("hd,hnde->hne", u[p], w)
        b = np.zeros(votes.shape[:2])
        for _ in range(iterations):
            c = np.exp(b) / np.exp(b).sum(1, keepdims=True)
            s = (c[:, :, None] * votes).sum(0)
            norm = np.linalg.norm(s, axis=-1, keepdims=True)
            omega = norm**2 / (1 + norm**2) * s / norm
            b = b + (votes * omega[None]).sum(-1)
        out[p] = omega
    return out


def test_routing_by_agreement_follows_the_papers_iterations():
    routing = HeadRouting(HEADS, D_HEAD, 3, key=jax.random.key(9))
    u = 2.0 * jax.random.normal(jax.random.key(10), (5, HEADS, D_HEAD))
    got = np.asarray(routing(u))
    np.testing.assert_allclose(got, reference_routing(f64(u), f64(routing.votes), 3), atol=1e-5)
    assert not np.allclose(got, reference_routing(f64(u), f64(routing.votes), 1), atol=1e-3)  # iterations count
    assert np.all(np.linalg.norm(got, axis=-1) < 1)  # squashed

    attention = Attention("softmax", D_MODEL, HEADS, head_aggregation="routing", key=jax.random.key(11))
    x = jax.random.normal(jax.random.key(12), (6, D_MODEL))
    _, o, _ = reference_heads(attention, x)
    capsules = reference_routing(o, f64(attention.routing.votes), 3)
    np.testing.assert_allclose(np.asarray(attention(x)), project(attention, capsules), atol=2e-5)
    assert not np.allclose(np.asarray(attention(x)), project(attention, o), atol=1e-3)  # not the concatenation


def reference_em_routing(u, routing, iterations, lam=HeadEMRouting.INVERSE_TEMPERATURE):
    """EM routing over vector capsules (Hinton, Sabour & Frosst 2018 as Li et al. 2019 use
    it), position by position: a_h = sigmoid(w_a · Ω_h + b_a); R = 1/N; per iteration
    M: μ, σ² the R·a-weighted mean and variance of the votes, a_out = sigmoid(λ(β_a -
    sum_k (β_u + log σ_k) S)); E (not after the last): R ∝ a_out N(V; μ, σ²). Returns μ."""
    w, act_w, act_b = f64(routing.votes), f64(routing.activation_w), float(routing.activation_b)
    beta_u, beta_a = f64(routing.beta_u), f64(routing.beta_a)
    out = np.zeros((u.shape[0], w.shape[1], w.shape[3]))
    for p in range(u.shape[0]):
        votes = np.einsum("hd,hnde->hne", u[p], w)  # [H, N, d]
        a_in = 1 / (1 + np.exp(-(u[p] @ act_w + act_b)))
        r = np.full(votes.shape[:2], 1 / votes.shape[1])
        for step in range(iterations):
            rw = r * a_in[:, None]
            s = rw.sum(0) + HeadEMRouting.EPS_S
            mu = (rw[:, :, None] * votes).sum(0) / s[:, None]
            if step + 1 == iterations:
                break
            var = (rw[:, :, None] * (votes - mu) ** 2).sum(0) / s[:, None] + HeadEMRouting.EPS
            cost = ((beta_u[:, None] + np.log(np.sqrt(var))) * s[:, None]).sum(-1)
            a_out = 1 / (1 + np.exp(-lam * (beta_a - cost)))
            p_ = np.prod(np.exp(-((votes - mu) ** 2) / (2 * var)) / np.sqrt(2 * np.pi * var), -1)
            r = a_out * p_ / (a_out * p_).sum(1, keepdims=True)
        out[p] = mu
    return out


def test_em_routing_follows_the_m_and_e_steps():
    routing = HeadEMRouting(HEADS, D_HEAD, 3, key=jax.random.key(9))
    # learned β's and activation bias away from their zero start, so each term is checked
    routing = eqx.tree_at(
        lambda r: (r.beta_u, r.beta_a, r.activation_b),
        routing,
        (jnp.array([0.5, -1.0, 2.0, 0.0]), jnp.array([300.0, -200.0, 0.0, 100.0]), jnp.array(0.3)),
    )
    u = 0.5 * jax.random.normal(jax.random.key(10), (5, HEADS, D_HEAD))
    got = np.asarray(routing(u))
    np.testing.assert_allclose(got, reference_em_routing(f64(u), routing, 3), atol=1e-5)
    for other in (reference_em_routing(f64(u), routing, 2), reference_em_routing(f64(u), routing, 3, lam=1.0)):
        assert not np.allclose(got, other, atol=1e-4)  # the iterations and λ count
    # one M-step: μ is the activation-weighted mean of the votes
    votes = np.einsum("phd,hnde->phne", f64(u), f64(routing.votes))
    a_in = 1 / (1 + np.exp(-(f64(u) @ f64(routing.activation_w) + 0.3)))
    mean = (a_in[..., None, None] * votes).sum(1) / (a_in.sum(1)[:, None, None] + HeadEMRouting.EPS_S)
    one = HeadEMRouting(HEADS, D_HEAD, 1, key=jax.random.key(9))
    one = eqx.tree_at(lambda r: r.activation_b, one, jnp.array(0.3))
    np.testing.assert_allclose(np.asarray(one(u)), mean, atol=1e-5)

    attention = Attention("softmax", D_MODEL, HEADS, head_aggregation="em_routing", key=jax.random.key(11))
    x = jax.random.normal(jax.random.key(12), (6, D_MODEL))
    _, o, _ = reference_heads(attention, x)
    capsules = reference_em_routing(o, attention.routing, 3)
    np.testing.assert_allclose(np.asarray(attention(x)), project(attention, capsules), atol=2e-5)
    assert not np.allclose(np.asarray(attention(x)), project(attention, o), atol=1e-3)  # not the concatenation
    grads = eqx.filter_grad(lambda a: a(x).sum())(attention).routing  # every parameter is learned
    for name in ("votes", "activation_w", "activation_b", "beta_u", "beta_a"):
        assert float(jnp.abs(getattr(grads, name)).sum()) > 0, name


def test_em_routing_stays_finite_when_an_output_capsule_gets_no_votes():
    """An output capsule whose activation underflows gets no votes after an E-step (S_n = 0):
    its μ was 0/0 and the gradient of log a_out infinite; seen as non-finite gradients in
    the demo's ListOps training (step 33). S_n gets EPS_S, and log a_out is a log-sigmoid."""
    routing = HeadEMRouting(HEADS, D_HEAD, 3, key=jax.random.key(0))
    routing = eqx.tree_at(lambda r: r.beta_a, routing, jnp.array([-1e6, 0.0, 0.0, 0.0]))
    u = jax.random.normal(jax.random.key(1), (5, HEADS, D_HEAD))
    out, grads = jax.value_and_grad(lambda r: jnp.sum(r(u) ** 2))(routing)
    assert bool(jnp.isfinite(out))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array)))


# ------------------------------------------------------------------ models


def lm_config(attention, **extra):
    sizes = dict(vocab_size=19, num_layers=2, d_model=D_MODEL, num_heads=HEADS, kv_heads=2, max_len=12)
    return ModelConfig(task="lm", attention=attention, **sizes | extra)


ALL = {"collaborative": 12, "head_aggregation": "routing", "disagreement": ["subspace", "position", "output"]}


@pytest.mark.parametrize(
    "attention",
    [{"name": "performer", "num_features": 16, "collaborative": 12}, {"name": "softmax", **ALL}],
    ids=["collaborative-performer", "all"],  # "all": collaborative softmax heads, routed
)
def test_language_models_decode_like_their_parallel_forward(attention):
    # one layer: decoding parity is each layer's own (the cache of its shared keys)
    config = lm_config(attention, num_layers=1, embedding={"position": "rope"})
    model = build_model(config, key=jax.random.key(13))
    tokens = jnp.arange(12) % 19
    logits = forward(model, tokens)  # compiled: eagerly every primitive compiles on its own
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(logits), atol=2e-4)
    layer = model.blocks[0].attention
    if layer.drawn:  # the drawn features are sized by the shared key size
        assert jax.tree.map(jnp.shape, layer.redraw(jax.random.key(1)).drawn) == jax.tree.map(jnp.shape, layer.drawn)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: m(tokens).sum()))(model)
    assert float(jnp.abs(grads.blocks[0].attention.mixing).sum()) > 0
    if attention.get("head_aggregation") == "routing":
        assert float(jnp.abs(grads.blocks[0].attention.routing.votes).sum()) > 0


def test_a_collaborative_cross_attention_decodes_against_a_padded_source():
    config = ModelConfig(
        task="seq2seq",
        vocab_size=19,
        num_layers=1,
        d_model=D_MODEL,
        num_heads=HEADS,
        max_len=10,
        attention={"name": "softmax", "head_aggregation": "em_routing"},
        decoder={"cross_attention": {"name": "softmax", **ALL}},
    )
    model = build_model(config, key=jax.random.key(16))
    source, source_mask = jnp.arange(10) % 19, jnp.arange(10) < 7
    target = (jnp.arange(8) * 3) % 19
    condition = eqx.filter_jit(lambda model, source, mask: model.conditioned(source, mask))  # compiled
    conditioned = condition(model, source, source_mask)
    logits = forward(conditioned, target)
    np.testing.assert_allclose(np.asarray(decode_all(conditioned, target)), np.asarray(logits), atol=2e-4)
    moved = condition(model, source.at[7:].set(0), source_mask)  # the padded source tokens are not read
    np.testing.assert_allclose(np.asarray(forward(moved, target)), np.asarray(logits), atol=1e-5)
    made = eqx.filter_jit(lambda m: m.apply(source, target, source_mask))(model)[1].layer_losses
    assert {f"disagreement_{t}/decoder.blocks.0.cross_attention" for t in ALL["disagreement"]} == set(made)


def test_jit_vmap_grad_and_bfloat16_through_a_padded_classifier():
    config = ModelConfig(
        task="classify",
        vocab_size=19,
        num_classes=3,
        num_layers=1,
        d_model=D_MODEL,
        num_heads=HEADS,
        max_len=10,
        dtype="bfloat16",
        attention={"name": "softmax", **ALL},
    )
    model = build_model(config, key=jax.random.key(14))
    tokens = jax.random.randint(jax.random.key(15), (2, 9), 0, 19)  # and the CLS token
    mask = jnp.arange(9)[None, :] < jnp.array([[9], [6]])

    @eqx.filter_jit
    def loss(m, t):
        logits, produced = jax.vmap(lambda a, b: m.apply(a, b))(t, mask)
        return logits.astype(jnp.float32).sum() + sum(v.mean() for v in produced.layer_losses.values()), logits

    (value, logits), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, tokens)
    assert bool(jnp.isfinite(value)) and bool(jnp.all(jnp.isfinite(logits)))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)))
    # padding: other tokens in the padded tail change nothing
    changed = tokens.at[1, 6:].set((tokens[1, 6:] + 1) % 19)
    np.testing.assert_allclose(np.asarray(loss(model, changed)[1]), np.asarray(logits), atol=1e-2)


def test_the_train_step_adds_and_logs_each_layers_disagreement():
    import optax

    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    def one_step(weight):
        attention = {"name": "softmax", "disagreement": ["subspace", "output"], "disagreement_weight": weight}
        params, drawn, static = split_model(build_model(lm_config(attention, dropout=0.0), key=jax.random.key(0)))
        optimizer = optax.sgd(0.0)
        state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
        tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 19)
        batch = {"tokens": tokens, "mask": jnp.ones((2, 12), bool), "loss_mask": jnp.ones((2, 12), bool)}
        return make_train_step(static, optimizer, grad_accum=1)(state, batch)[1]

    once, twice = one_step(1.0), one_step(2.0)
    names = {f"disagreement_{t}/blocks.{i}.attention" for t in ("subspace", "output") for i in range(2)}
    assert names <= set(once)
    added = sum(float(once[n]) for n in names)
    np.testing.assert_allclose(float(twice["loss"]) - float(once["loss"]), added, rtol=1e-4)  # in the objective


# ------------------------------------------------------------------ config


def test_the_settings_are_reached_from_yaml_and_set():
    from jxformers.train.experiment import load_experiment

    experiment = load_experiment(
        "copy",
        [
            "preset=tiny",
            "model.attention.collaborative=8",
            "model.attention.disagreement=[subspace, position]",
            "model.attention.disagreement_weight=0.1",
            "model.attention.head_aggregation=routing",
            "model.attention.routing_iterations=2",
        ],
    )
    attention = experiment.model.attention
    assert (attention.collaborative, attention.disagreement, attention.disagreement_weight) == (
        8,
        ("subspace", "position"),
        0.1,
    )
    assert (attention.head_aggregation, attention.routing_iterations) == ("routing", 2)
    assert ModelConfig.from_dict(experiment.model.to_dict()) == experiment.model
    text = "task: lm\nvocab_size: 11\nmax_len: 8\nattention: {name: softmax, disagreement: output, collaborative: 4}\n"
    assert ModelConfig.from_yaml(text).attention.disagreement == ("output",)


@pytest.mark.parametrize(
    "attention, match",
    [
        ({"collaborative": 0}, "attention.collaborative must be >= 1; got 0"),
        ({"disagreement": ["subspace", "heads"]}, r"distinct terms among \('subspace', 'position', 'output'\); got"),
        ({"disagreement_weight": -1.0}, "disagreement_weight must be > 0; got -1.0"),
        (
            {"head_aggregation": "sum"},
            r"head_aggregation must be one of \['concat', 'routing', 'em_routing'\]; got 'sum'",
        ),
        ({"routing_iterations": 0}, "routing_iterations must be >= 1; got 0"),
        ({"name": "fnet", "collaborative": 8}, "'fnet' cannot use: its weights do not depend on q and k"),
        ({"name": "lsh", "collaborative": 8}, "'lsh' cannot use: it takes its keys from q"),
        ({"collaborative": 8, "qk_norm": "l2"}, "qk_norm='l2' would normalise"),
        (
            {"name": "performer", "disagreement": ["position"]},
            r"'performer' has no such matrix to read \(allowed: \['softmax'\]\)",
        ),
    ],
)
def test_bad_settings_are_refused_at_config_time(attention, match):
    task = "classify" if attention.get("name") == "fnet" else "lm"
    with pytest.raises(ValueError, match=match):
        ModelConfig(task=task, vocab_size=11, max_len=8, attention={"name": "softmax"} | attention)


def test_rope_needs_an_even_shared_key_size():
    with pytest.raises(ValueError, match="block 0's attention.collaborative must be even; got collaborative=7"):
        ModelConfig(
            task="lm",
            vocab_size=11,
            max_len=8,
            embedding={"position": "rope"},
            attention={"name": "softmax", "collaborative": 7},
        )
