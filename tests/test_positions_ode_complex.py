"""Issue 31's positions from the survey's section 5.1 (Lin et al. 2021): FLOATER (Liu et
al. 2020, positions from a neural ODE), complex word embeddings (Wang et al. 2020) and
DeBERTa v2's log-bucketed relative positions (He et al. 2021). Each against a numpy
reference written from the paper's formula or the authors' code (float64), decoding
parity in a causal language model, finite gradients, one training step through the
config, the settings from YAML and the refusals.

Mutations each reference test was seen to fail (by hand, once): RK4's k2 taken at t
instead of t + dt/2; h without the time appended to its second layer; every block
started from block 0's p(0); FLOATER's position added to the queries' input only (not
the keys' and values'); the decoding step advancing the ODE before this token's
position is read (parity fails); complex's ω pos added with the wrong sign; the log
bucket's ceil written as floor; DeBERTa's position-to-content term read at the
unbucketed distance.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import decode_all, finite_grads, forward, loss_grad, train_losses

from jxformers import ModelConfig, build_model
from jxformers.nn import Attention, Positions
from jxformers.nn.floater import Floater, FlowDynamics, rk4_interval
from jxformers.nn.positions import complex_order
from jxformers.nn.relative import RelativeTerms, SharedTerms, log_buckets

D_MODEL, HEADS, VOCAB = 16, 4, 13
SIZES = dict(vocab_size=VOCAB, num_layers=2, d_model=D_MODEL, num_heads=HEADS, max_len=24)


def _np(x):
    return np.asarray(x, np.float64)


# ----------------------------------------------------------------------------- FLOATER


def _h_reference(dynamics, t, p):
    """The authors' flow_func_linear: Linear_t, ReLU, Linear_t, each Linear_t reading [x; t]."""
    w1, b1 = _np(dynamics.first.weight), _np(dynamics.first.bias)
    w2, b2 = _np(dynamics.second.weight), _np(dynamics.second.bias)
    with_t = lambda x: np.concatenate([x, np.full(x.shape[:-1] + (1,), t)], -1)  # noqa: E731
    return with_t(np.maximum(with_t(p) @ w1.T + b1, 0.0)) @ w2.T + b2


def _rk4_reference(f, y, t0, t1, steps):
    """Classical RK4 from t0 to t1 in `steps` equal steps (float64)."""
    dt = (t1 - t0) / steps
    t = t0
    for _ in range(steps):
        k1 = f(t, y)
        k2 = f(t + dt / 2, y + dt / 2 * k1)
        k3 = f(t + dt / 2, y + dt / 2 * k2)
        k4 = f(t + dt, y + dt * k3)
        y, t = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4), t + dt
    return y


def test_rk4_solves_a_known_ode_to_fourth_order():
    # dy/dt = -t y: y(t) = y(0) e^{-t^2 / 2}. Halving the step cuts the error ~16x.
    f = lambda t, y: -t * y  # noqa: E731
    y0, delta = jnp.array([1.0, -2.0]), 0.5
    errors = []
    for steps in (2, 4):
        y = y0
        for i in range(4):  # t: 0 -> 2
            y = rk4_interval(f, y, jnp.asarray(i), delta=delta, steps=steps)
        errors.append(float(jnp.max(jnp.abs(y - y0 * math.exp(-2.0)))))
    assert errors[1] < 1e-4 and errors[0] / errors[1] > 10, errors


def test_floater_grid_is_each_blocks_ode_solution_at_i_delta():
    # p^(n)(t_i) = p^(n)(0) + ∫_0^{t_i} h(τ, p^(n)(τ)) dτ, t_i = i Δ, one h for every block.
    delta, steps, n = 0.4, 3, 6
    floater = Floater(layers=3, dim=8, delta=delta, steps=steps, key=jax.random.key(0))
    floater = eqx.tree_at(lambda f: f.start, floater, jax.random.normal(jax.random.key(1), (3, 8)))  # distinct starts
    h = lambda t, p: _h_reference(floater.dynamics, t, p)  # noqa: E731
    x = np.random.default_rng(0).normal(size=(4, 8))
    assert_close(floater.dynamics(jnp.asarray(0.7), jnp.asarray(x, jnp.float32)), h(0.7, x), atol=1e-5, rtol=1e-5)
    want = np.zeros((3, n, 8))
    for layer in range(3):
        p = _np(floater.start[layer])
        for i in range(n):
            want[layer, i] = p
            p = _rk4_reference(h, p, i * delta, (i + 1) * delta, steps)
    got = floater.grid(n)
    assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert float(jnp.abs(got[:, -1] - got[:, 0]).max()) > 0.05  # the positions do move
    for i in range(n - 1):  # one interval at a time (decoding) gives the grid's numbers
        assert_close(floater.advance(got[:, i], jnp.asarray(i)), got[:, i + 1], atol=1e-6)


def test_floater_dynamics_init_as_the_authors_linear_t():
    dynamics = FlowDynamics(64, key=jax.random.key(0))
    assert float(jnp.abs(dynamics.first.bias).max()) == 0.0 and float(jnp.abs(dynamics.second.bias).max()) == 0.0
    std = float(jnp.std(dynamics.first.weight))
    assert std == pytest.approx(math.sqrt(2 / (64 + 65)), rel=0.1)  # Xavier-normal of 65 -> 64


def test_floater_adds_its_blocks_position_to_the_attentions_input():
    # q, k, v = W (x + p^(n)) + b: the same attention without the term, fed x + p^(n).
    relative = RelativeTerms("floater", d_model=D_MODEL, heads=HEADS, d_head=4, layer=1, key=jax.random.key(0))
    attention = Attention("softmax", D_MODEL, HEADS, causal=True, relative=relative, key=jax.random.key(1))
    plain = eqx.tree_at(lambda a: a.relative, attention, None, is_leaf=lambda x: x is None)
    x = jax.random.normal(jax.random.key(2), (5, D_MODEL))
    flow = jax.random.normal(jax.random.key(3), (2, 5, D_MODEL))
    assert_close(attention(x, bias=SharedTerms(flow=flow)), plain(x + flow[1]), atol=1e-6)
    with pytest.raises(ValueError, match=r"needs the model's solved positions \(SharedTerms.flow\).*NoneType"):
        attention(x)


@pytest.mark.parametrize(
    "options",
    [
        {"attention": "softmax"},
        {"attention": "linear"},  # any attention: FLOATER changes the input, not the scores
        {"attention": "softmax", "embedding": {"extra_tokens": 2}, "stack": {"reversible": True}},
    ],
    ids=["softmax", "linear", "memory-reversible"],
)
def test_floater_language_models_decode_like_their_parallel_forward(options):
    embedding = {"position": "floater", "floater_delta": 0.5, "floater_steps": 2} | options.get("embedding", {})
    config = ModelConfig(
        task="lm", **SIZES, ffn={"d_ff": 24}, attention=options["attention"], embedding=embedding,
        stack=options.get("stack", {}),
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (10,), 0, VOCAB)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)
    grads = loss_grad(model, x)
    assert finite_grads(grads)
    floater = grads.embedding.positions.floater
    assert float(jnp.abs(floater.start).max()) > 0 and float(jnp.abs(floater.dynamics.first.weight).max()) > 0


def test_floater_encoder_blocks_each_read_their_own_row():
    config = ModelConfig(task="classify", **SIZES, embedding={"position": "floater", "floater_delta": 0.5})
    model = build_model(config, key=jax.random.key(0))
    assert [b.attention.relative.layer for b in model.encoder.blocks] == [0, 1]
    positions = model.encoder.embedding.positions
    assert positions.floater.start.shape == (2, D_MODEL)
    assert_close(positions.embed(jnp.arange(3)), Positions("sinusoidal", dim=D_MODEL, heads=HEADS, max_len=8,
                 causal=False, key=jax.random.key(0)).embed(jnp.arange(3)))  # fmt: skip
    x = jax.random.randint(jax.random.key(1), (9,), 0, VOCAB)
    assert finite_grads(loss_grad(model, x))


# ----------------------------------------------------------------------------- complex word embeddings


def test_complex_order_is_r_e_to_the_i_omega_pos_plus_theta():
    # f(j, pos) = r_j e^{i(ω_j pos + θ_j)} per complex feature; real parts then imaginary.
    rng = np.random.default_rng(0)
    z, omega = rng.normal(size=(5, 8)), rng.normal(size=(5, 4))
    pos = np.array([0.0, 1, 2, 7, 30])
    r, theta = np.abs(z[:, :4] + 1j * z[:, 4:]), np.angle(z[:, :4] + 1j * z[:, 4:])
    f = r * np.exp(1j * (omega * pos[:, None] + theta))
    got = complex_order(jnp.asarray(z, jnp.float32), jnp.asarray(omega, jnp.float32), jnp.asarray(pos))
    assert_close(got, np.concatenate([f.real, f.imag], -1), atol=1e-5, rtol=1e-5)


def test_complex_embedding_of_the_model():
    config = ModelConfig(task="lm", **SIZES, embedding={"position": "complex", "scale": False})
    embedding = build_model(config, key=jax.random.key(0)).embedding
    omega = embedding.positions.table
    assert omega.shape == (VOCAB, D_MODEL // 2)
    assert_close(omega[3], 10000.0 ** (-np.arange(8) / 8))  # the sinusoids' frequencies to start
    omega = jax.random.uniform(jax.random.key(1), omega.shape)  # each word its own
    embedding = eqx.tree_at(lambda e: e.positions.table, embedding, omega)
    tokens, pos = jnp.array([3, 3, 7, 1]), jnp.array([0, 5, 5, 11])
    table = _np(embedding.table)[np.asarray(tokens)]
    z = table[:, :8] + 1j * table[:, 8:]
    f = z * np.exp(1j * _np(omega)[np.asarray(tokens)] * np.asarray(pos)[:, None])
    assert_close(embedding(tokens, pos), np.concatenate([f.real, f.imag], -1), atol=1e-5)
    # the tied readout is each word's embedding at position 0: the table itself
    assert_close(embedding(jnp.arange(VOCAB), jnp.zeros(VOCAB, jnp.int32)), embedding.table, atol=1e-6)


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_complex_language_models_decode_like_their_parallel_forward(attention):
    config = ModelConfig(task="lm", **SIZES, ffn={"d_ff": 24}, attention=attention, embedding={"position": "complex"})
    model = build_model(config, key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (10,), 0, VOCAB)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)
    grads = loss_grad(model, x)
    assert finite_grads(grads) and float(jnp.abs(grads.embedding.positions.table).max()) > 0  # ω is learned


# ----------------------------------------------------------------------------- DeBERTa v2's log buckets


def _log_bucket_reference(relative_pos, bucket_size, max_position):
    """DeBERTa v2's make_log_bucket_position (numpy, float64), transcribed."""
    sign = np.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = np.where((relative_pos < mid) & (relative_pos > -mid), mid - 1, np.abs(relative_pos))
    log_pos = np.ceil(np.log(abs_pos / mid) / np.log((max_position - 1) / mid) * (mid - 1)) + mid
    return np.where(abs_pos <= mid, relative_pos, log_pos * sign).astype(int)


@pytest.mark.parametrize(("buckets", "max_position"), [(4, 8), (6, 20), (16, 64), (256, 512)])
def test_log_buckets_are_deberta_v2s_make_log_bucket_position(buckets, max_position):
    relative = np.arange(-3 * max_position, 3 * max_position + 1)
    got = log_buckets(jnp.asarray(relative, jnp.int32), buckets, max_position)
    np.testing.assert_array_equal(np.asarray(got), _log_bucket_reference(relative, buckets, max_position))
    assert int(got[relative == max_position - 1][0]) == 2 * (buckets // 2) - 1


def test_deberta_with_log_buckets_is_eq_4_at_the_bucketed_distance():
    # As test_relative_positions' DeBERTa test, δ(i, j) = clip(bucket(i - j) + b, 0, 2b - 1).
    n, buckets, reach, dh = 12, 4, 7, D_MODEL // HEADS
    relative = RelativeTerms("deberta", d_model=D_MODEL, heads=HEADS, d_head=dh, max_distance=reach,
                             position_buckets=buckets, key=jax.random.key(3))  # fmt: skip
    attention = Attention("softmax", D_MODEL, HEADS, relative=relative, key=jax.random.key(4))
    shared = SharedTerms.make("deberta", heads=HEADS, d_head=dh, d_model=D_MODEL, max_distance=reach,
                              position_buckets=buckets, key=jax.random.key(5))  # fmt: skip
    assert shared.table.shape == (2 * buckets, D_MODEL)
    x = jax.random.normal(jax.random.key(6), (n, D_MODEL))
    lin = lambda layer, v: v @ _np(layer.weight).T + (0 if layer.bias is None else _np(layer.bias))  # noqa: E731
    q, k, v = (lin(p, _np(x)).reshape(n, HEADS, dh) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    q_r = lin(relative.pos_q, _np(shared.table)).reshape(2 * buckets, HEADS, dh)
    k_r = lin(relative.pos_k, _np(shared.table)).reshape(2 * buckets, HEADS, dh)

    def delta(i, j):
        return int(np.clip(_log_bucket_reference(np.array(i - j), buckets, reach) + buckets, 0, 2 * buckets - 1))

    logits = np.zeros((HEADS, n, n))
    for h in range(HEADS):
        for i in range(n):
            for j in range(n):
                c2p, p2c = q[i, h] @ k_r[delta(i, j), h], k[j, h] @ q_r[delta(j, i), h]
                logits[h, i, j] = (q[i, h] @ k[j, h] + c2p + p2c) / math.sqrt(3 * dh)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = lin(attention.o_proj, np.einsum("hij,jhd->ihd", p, v).reshape(n, D_MODEL))
    assert_close(attention(x, bias=shared), want, atol=2e-5, rtol=1e-4)


def test_deberta_log_buckets_decode_like_the_parallel_forward():
    embedding = {"position": "deberta", "deberta_buckets": 4, "relative_max_distance": 8}
    model = build_model(ModelConfig(task="lm", **SIZES, embedding=embedding), key=jax.random.key(0))
    assert model.embedding.positions.shared.table.shape == (8, D_MODEL)
    assert model.blocks[0].attention.relative.position_buckets == 4
    x = jax.random.randint(jax.random.key(1), (14,), 0, VOCAB)  # distances up to 13: past the reach 8
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- config


def test_the_settings_reach_the_modules_from_yaml():
    common = "vocab_size: 13\nmax_len: 24\nd_model: 16\nnum_heads: 4\nnum_layers: 3\n"
    config = ModelConfig.from_yaml(common + "task: lm\nembedding: {position: floater, floater_delta: 0.1, "
                                   "floater_steps: 3}\n")  # fmt: skip
    assert ModelConfig.from_dict(config.to_dict()) == config
    floater = build_model(config, key=jax.random.key(0)).embedding.positions.floater
    assert (floater.delta, floater.steps, floater.start.shape) == (0.1, 3, (3, 16))
    config = ModelConfig.from_yaml(common + "task: seq2seq\ndecoder: {num_layers: 2}\nembedding: {position: floater}\n")
    model = build_model(config, key=jax.random.key(0))
    assert model.encoder.embedding.positions.floater.start.shape == (3, 16)
    assert model.decoder.embedding.positions.floater.start.shape == (2, 16)
    assert model.decoder.blocks[0].cross_attention.relative is None  # self-attention only
    config = ModelConfig.from_yaml(common + "task: classify\nembedding: {position: deberta, deberta_buckets: 8}\n")
    assert ModelConfig.from_dict(config.to_dict()) == config
    deberta = build_model(config, key=jax.random.key(0)).encoder
    assert deberta.embedding.positions.shared.table.shape == (16, 16)
    assert deberta.blocks[2].attention.relative.max_distance == 24  # reach: max_len unless set
    config = ModelConfig.from_yaml(common + "task: classify\nstack: luna\nembedding: {position: complex}\n")
    assert build_model(config, key=jax.random.key(0)).encoder.embedding.positions.table.shape == (13, 8)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"embedding": {"position": "sinusoidal", "floater_steps": 2}},
         r"\{'floater_steps': 2\} solve FLOATER's ODE: they need position 'floater'; got 'sinusoidal'"),
        ({"embedding": {"position": "floater", "floater_delta": 0}}, r"embedding.floater_delta must be > 0; got 0"),
        ({"embedding": {"position": "floater", "floater_steps": 0}}, r"embedding.floater_steps must be >= 1; got 0"),
        ({"embedding": {"position": "floater"}, "stack": "luna"},
         r"stack 'luna' takes positions added .*got 'floater'"),
        ({"embedding": {"position": "floater"}, "stack": "transformer_xl"},
         r"stack 'transformer_xl' has its own relative positions .*got 'floater'"),
        ({"embedding": {"position": "floater"}, "task": "classify", "stack": {"filters": {0: 0.5}}},
         r"position 'floater' with stack.filters \{0: 0.5\}: refused, its ODE is read at t_i = i Δ"),
        ({"embedding": {"position": "floater"}, "stack": {"attention_maps": "residual"}},
         r"position 'floater' adds each block's own position .*carried attention maps"),
        ({"embedding": {"position": "floater"}, "attention": {"name": "average", "aan": True}},
         r"position 'floater' .*average attention network \(attention.aan\) has none: blocks \[0, 1\]"),
        ({"embedding": {"position": "floater"}, "task": "classify",
          "stack": {"token_learner": {"after_layer": 0, "num_tokens": 2}}},
         r"learned tokens have no positions.*got 'floater'"),
        ({"embedding": {"position": "complex"}, "d_model": 9, "num_heads": 3},
         r"position 'complex' reads the embedding as d_model / 2 complex features .*needs an even d_model; got 9"),
        ({"embedding": {"position": "complex"}, "stack": "transformer_xl"},
         r"stack 'transformer_xl' has its own relative positions .*got 'complex'"),
        ({"embedding": {"position": "shaw", "deberta_buckets": 4}},
         r"deberta_buckets is DeBERTa v2's log buckets: it needs position 'deberta'; got 'shaw'"),
        ({"embedding": {"position": "deberta", "deberta_buckets": 1}}, r"embedding.deberta_buckets must be >= 2"),
        ({"embedding": {"position": "deberta", "deberta_buckets": 16, "relative_max_distance": 9}},
         r"deberta_buckets b = 16 keeps distances up to b // 2 = 8 .*got relative_max_distance 9"),
    ],
)  # fmt: skip
def test_config_refusals_name_the_setting_and_the_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**(SIZES | {"task": "lm", "vocab_size": 11} | values))


def test_python_refusals():
    with pytest.raises(ValueError, match=r"even d_model and vocab_size >= 1; got d_model=15, vocab_size=0"):
        Positions("complex", dim=15, heads=3, max_len=8, causal=False, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"goes with kind 'deberta', b >= 2 .*position_buckets=8, max_distance=5"):
        RelativeTerms("deberta", d_model=16, heads=4, d_head=4, max_distance=5, position_buckets=8,
                      key=jax.random.key(0))  # fmt: skip
    with pytest.raises(ValueError, match=r"layers >= 1, steps >= 1 and Δ > 0; got layers=2, steps=0"):
        Floater(layers=2, dim=8, steps=0, key=jax.random.key(0))
    positions = Positions("floater", dim=16, heads=4, max_len=8, causal=False, layers=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"solved on the integer grid"):
        positions.bias(jnp.arange(3) * 1.5, jnp.arange(3) * 1.5)


# ----------------------------------------------------------------------------- one training step


@pytest.mark.parametrize(
    "embedding",
    [{"position": "floater"}, {"position": "complex"}, {"position": "deberta", "deberta_buckets": 4}],
    ids=["floater", "complex", "deberta-v2"],
)
def test_one_training_step_through_the_config(embedding):
    config = ModelConfig(task="lm", **SIZES | {"vocab_size": 11}, ffn={"d_ff": 24}, dropout=0.0, embedding=embedding)
    losses, params = train_losses(build_model(config, key=jax.random.key(0)))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
