"""Adaptive computation (issue 32, Lin et al. 2021's survey section 6.3;
`jxformers.nn.adaptive`): the Universal Transformer with ACT (Dehghani et al. 2019, as
tensor2tensor computes Graves 2016's halting), CCT's gated sub-layers (Bapna et al. 2020)
and early exit (Elbayad et al. 2020's depth-adaptive decoding, Zhou et al. 2020's PABEE).

Each rule is checked against a numpy reference written from the paper's (or the reference
code's) formula: a hand-computed ACT example and the whole recurrent stack, the CCT gate,
controller, gated residuals and budget loss, the confidence and patience exit rules and
the weighted exit losses; then as models: decoding parity, causality, padding, gradients,
training steps through the config, the tallies the step logs and evaluation averages,
train / eval / generate from the command line with an exact resume, the refusals, and
sharded training on the simulated 8-device mesh.

Mutations each reference test was seen to fail (by hand, once): ACT's remainder taken
after adding it to the halting probability (1 - 1 = 0); n_updates not counting the
halting step; the step embedding added once instead of before every step; the
interpolated state without (1 - w); CCT's gate left continuous at inference (decoding
parity and the skip test fail); PABEE's counter not reset on a changed prediction; the
confidence rule exiting at the last block's threshold only; PABEE's weights uniform.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from suites import decode_all, finite_grads, forward_and_grad, train_steps

from jxformers import ModelConfig, build_model
from jxformers.nn.adaptive import (
    Controller,
    act_update,
    confidence_exit,
    exit_weights,
    gate,
    patience_exit,
)
from jxformers.nn.positions import sinusoidal
from jxformers.train.step import evaluate, loss_and_metrics, make_eval_step

TINY = dict(vocab_size=23, num_layers=2, d_model=16, num_heads=4, max_len=40)
N = 9


def _np(x):
    return np.asarray(x, np.float64)


@eqx.filter_jit
def infer(model, tokens, mask=None):
    return model(tokens, mask, inference=True)


@eqx.filter_jit
def train_forward(model, tokens, mask=None):
    return model(tokens, mask)


def _tokens(seed=1, n=N):
    return jax.random.randint(jax.random.key(seed), (n,), 0, TINY["vocab_size"])


# ----------------------------------------------------------------------------- ACT


def _act_reference(ps, threshold):
    """tensor2tensor's position-wise ACT loop, one position, plain floats: (weights per
    step, N, R)."""
    halting = remainder = n = 0.0
    halted, weights = False, []
    for p in ps:
        running = 0.0 if halted else 1.0
        new_halted = running * float(halting + p * running > threshold)
        still = running * float(halting + p * running <= threshold)
        halting += p * still
        remainder += new_halted * (1 - halting)
        halting += new_halted * remainder
        n += still + new_halted
        weights.append(p * still + new_halted * remainder)
        halted = halted or new_halted > 0
    return weights, n, remainder


def test_act_update_on_a_hand_computed_example():
    # position 0: 0.5 + 0.3 = 0.8 <= 0.99, then 0.8 + 0.4 > 0.99 halts with R = 0.2 (N = 3);
    # position 1: 0.995 > 0.99 at once, R = 1 (N = 1); position 2 never halts: N = 3, R = 0
    ps = jnp.array([[0.5, 0.995, 0.1], [0.3, 0.7, 0.1], [0.4, 0.9, 0.1]])
    state = (jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), jnp.zeros(3, bool))
    weights = []
    for p in ps:
        *state, w = act_update(p, *state, 0.99)
        weights.append(w)
    halting, remainders, n_updates, halted = state
    assert_close(jnp.stack(weights).T, jnp.array([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0], [0.1, 0.1, 0.1]]), atol=1e-6)
    assert_close(n_updates, jnp.array([3.0, 1.0, 3.0]), atol=0)
    assert_close(remainders, jnp.array([0.2, 1.0, 0.0]), atol=1e-6)
    assert_close(halting, jnp.array([1.0, 1.0, 0.3]), atol=1e-6)
    assert halted.tolist() == [True, True, False]
    for j in range(3):  # and the reference loop agrees
        w, n, r = _act_reference(np.asarray(ps[:, j]), 0.99)
        assert_close(jnp.array(w), jnp.stack(weights)[:, j], atol=1e-6)
        assert (n, pytest.approx(r)) == (float(n_updates[j]), float(remainders[j]))


def _ut_reference(stack, x, mask, act_state):
    """The Universal Transformer's stack in numpy around its own blocks (the transition
    function): P_t = sinusoid(position) + sinusoid(t), p = sigmoid(w . s + b), ACT as
    `_act_reference`, output sum_t w_t T_t or the interpolation."""
    n, d = x.shape
    signal = _np(sinusoidal(jnp.arange(n), d))
    steps = _np(sinusoidal(jnp.arange(stack.max_steps), d))
    w_h, b_h = _np(stack.halting.weight)[0], float(stack.halting.bias[0])
    state, out = _np(x), np.zeros((n, d))
    halting, remainder, count = np.zeros(n), np.zeros(n), np.zeros(n)
    halted = np.zeros(n, bool)
    for t in range(stack.max_steps):
        s = state + signal + steps[t]
        p = 1 / (1 + np.exp(-(s @ w_h + b_h)))
        transformed = np.asarray(stack.blocks[0](jnp.asarray(s, jnp.float32), kv_mask=mask), np.float64)
        for i in range(n):
            running = 0.0 if halted[i] else 1.0
            total = halting[i] + p[i] * running
            new_halted, still = running * (total > stack.threshold), running * (total <= stack.threshold)
            halting[i] += p[i] * still
            remainder[i] += new_halted * (1 - halting[i])
            halting[i] += new_halted * remainder[i]
            count[i] += still + new_halted
            w = p[i] * still + new_halted * remainder[i]
            kept = out[i] if act_state == "accumulated" else (1 - w) * out[i]
            out[i] = kept + w * transformed[i]
            halted[i] |= new_halted > 0
        state = transformed
    return out, count, remainder


@pytest.mark.parametrize("act_state", ["accumulated", "interpolated"])
def test_the_universal_stack_is_its_reference(act_state):
    stack_cfg = {"kind": "universal", "max_steps": 4, "act_state": act_state, "halting_bias": -0.5}
    model = build_model(ModelConfig(task="lm", **TINY | {"num_layers": 1}, stack=stack_cfg), key=jax.random.key(3))
    stack = model.blocks[0]
    x = jax.random.normal(jax.random.key(4), (N, TINY["d_model"]))
    mask = jnp.arange(N) < 7
    out, produced = stack.apply(x, kv_mask=mask, inference=True)
    want, count, remainder = _ut_reference(stack, x, mask, act_state)
    assert_close(out, want, atol=2e-5)
    real = np.asarray(mask)
    assert_close(produced.tallies["act_steps"], jnp.array([count[real].sum(), real.sum()]), atol=1e-4)
    ponder = 0.01 * (count + remainder)[real].mean()
    assert float(produced.layer_losses["ponder_loss"]) == pytest.approx(ponder, rel=1e-5)
    assert 1 < count[real].mean() <= 4  # it halts at different steps


UT_VARIANTS = {
    "act": dict(stack={"kind": "universal", "max_steps": 3, "halting_bias": -1.0}),
    "interpolated-learned": dict(
        stack={"kind": "universal", "max_steps": 3, "act_state": "interpolated", "step_embedding": "learned"}
    ),
    "rope-no-act-linear": dict(
        attention="linear",
        embedding={"position": "rope"},
        stack={"kind": "universal", "max_steps": 2, "act": False, "position_signal": False},
    ),  # fmt: skip
    "cct": dict(stack={"cct": {"budgets": [0.5, 1.0], "budget": 0.5}}),
    "exit": dict(stack={"early_exit": {}}, num_layers=3),  # its threshold: `_exit_lm`
}


def _exit_lm(key=0):
    """A 3-block early-exit language model whose threshold is the median confidence of its
    first exit on `_tokens()`, so that some tokens leave early and some do not."""
    values = dict(task="lm", **TINY | {"num_layers": 3}, head={"kind": "softmax", "tie_embeddings": False})
    model = build_model(ModelConfig(**values, stack={"early_exit": {"threshold": 0.5}}), key=jax.random.key(key))
    tokens = _tokens()
    h = model.blocks[0].blocks[0](model.embedding(tokens, jnp.arange(N)), positions=jnp.arange(N))
    threshold = float(np.median(_np(jax.nn.softmax(model._logits(h), -1)).max(-1)))
    return build_model(ModelConfig(**values, stack={"early_exit": {"threshold": threshold}}), key=jax.random.key(key))


@pytest.mark.parametrize("variant", list(UT_VARIANTS))
def test_language_models_decode_like_their_inference_forward_and_are_causal(variant):
    model = build_model(ModelConfig(task="lm", **TINY | UT_VARIANTS[variant]), key=jax.random.key(0))
    if variant == "exit":
        model = _exit_lm()
    tokens = _tokens()
    want = infer(model, tokens)
    assert_close(decode_all(model, tokens), want, atol=3e-5)
    other = infer(model, tokens.at[-1].set((tokens[-1] + 1) % TINY["vocab_size"]))
    assert_close(other[:-1], want[:-1], atol=1e-6)


def test_the_step_and_position_signals_reach_every_step():
    model = build_model(ModelConfig(**TINY, stack={"kind": "universal", "max_steps": 3}), key=jax.random.key(1))
    stack = model.encoder.blocks[0]
    assert model.encoder.embedding.positions.kind == "none"  # the stack's own coordinates
    signal = stack._signal(jnp.arange(5), TINY["d_model"])
    want = _np(sinusoidal(jnp.arange(5), 16))[None] + _np(sinusoidal(jnp.arange(3), 16))[:, None]
    assert_close(signal, want, atol=1e-6)


# ----------------------------------------------------------------------------- CCT


def test_cct_gates_are_noised_sigmoids_in_training_and_discrete_at_inference():
    logits = jnp.array([-2.0, -0.1, 0.0, 0.3, 4.0])
    key = jax.random.key(7)
    eps = _np(jax.random.normal(key, (5,)))
    assert_close(gate(logits, noise=0.5, key=key, inference=False), 1 / (1 + np.exp(-(_np(logits) + 0.5 * eps))))
    assert_close(gate(logits, noise=0.5, key=None, inference=False), 1 / (1 + np.exp(-_np(logits))))
    assert gate(logits, noise=0.5, key=key, inference=True).tolist() == [0, 0, 0, 1, 1]


def test_the_controller_reads_the_state_and_the_budget():
    c = Controller(6, 4, 3, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 6))
    for b in range(3):
        h = _np(x) @ _np(c.hidden.weight).T + _np(c.hidden.bias) + _np(c.budget_table[b])
        want = np.maximum(h, 0) @ _np(c.out.weight)[0] + float(c.out.bias[0])
        assert_close(c(x, jnp.asarray(b)), want, atol=1e-5)


def test_the_gated_stack_is_its_reference_and_a_closed_gate_skips():
    config = ModelConfig(task="lm", **TINY, stack={"cct": {"budgets": [0.5, 1.0], "budget": 1.0}})
    stack = build_model(config, key=jax.random.key(2)).blocks[0]
    x = jax.random.normal(jax.random.key(3), (N, 16))
    mask = jnp.arange(N) < 8
    out, produced = stack.apply(x, kv_mask=mask, inference=True)
    h, gates = x, []
    for block, (ca, cf) in zip(stack.blocks, stack.controllers, strict=True):
        g = _np(ca(h, jnp.asarray(1))) > 0
        h = h + jnp.asarray(g[:, None]) * block.attention_branch(h, kv_mask=mask, inference=True)[0]
        g2 = _np(cf(h, jnp.asarray(1))) > 0
        h = h + jnp.asarray(g2[:, None]) * block.ffn_branch(h, mask=mask, inference=True)[0]
        gates += [g, g2]
    assert_close(out, h, atol=1e-5)
    used = np.stack(gates).mean(0)[:8]
    assert float(produced.layer_losses["budget_loss"]) == pytest.approx((used.mean() - 1.0) ** 2, rel=1e-5)
    assert_close(produced.tallies["cct_depth"], jnp.array([used.sum() * 2, 8.0]), atol=1e-5)
    # every controller closed (its output bias far below 0): the stack is the identity
    closed = eqx.tree_at(
        lambda s: [c.out.bias for pair in s.controllers for c in pair],
        stack,
        [jnp.full((1,), -1e4)] * 4,
    )
    assert_close(closed.apply(x, kv_mask=mask, inference=True)[0], x, atol=0)


# ----------------------------------------------------------------------------- early exit


def _patience_reference(preds, patience):
    count = 0
    for i, p in enumerate(preds):
        count = count + 1 if i > 0 and p == preds[i - 1] else 0
        if count >= patience:
            return i
    return len(preds) - 1


def test_the_patience_rule_on_hand_examples_and_random_ones():
    # [1, 2, 2, 2, 3] with t = 2: counts 0, 0, 1, 2 -> exits at block 3 (0-based)
    assert int(patience_exit(jnp.array([1, 2, 2, 2, 3]), 2)) == 3
    assert int(patience_exit(jnp.array([1, 2, 1, 2, 1]), 1)) == 4  # never patient: the last block
    assert int(patience_exit(jnp.array([5, 5, 5, 5]), 1)) == 1
    preds = np.random.default_rng(0).integers(0, 2, (6, 40))
    for t in (1, 2, 3):
        got = patience_exit(jnp.asarray(preds), t)
        assert got.tolist() == [_patience_reference(list(preds[:, j]), t) for j in range(40)]


def test_the_confidence_rule_exits_at_the_first_confident_block():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(4) * 0.5, (5, 30))
    got = confidence_exit(jnp.asarray(probs, jnp.float32), 0.7)
    want = [next((i for i in range(5) if probs[i, j].max() >= 0.7), 4) for j in range(30)]
    assert got.tolist() == want


def test_exit_weights_are_uniform_aligned_and_pabee_weighted():
    assert_close(exit_weights("aligned", 4), jnp.full((4,), 0.25))
    assert_close(exit_weights("weighted", 3), jnp.array([1, 2, 3]) / 6)


def _classifier(**exit_settings):
    config = ModelConfig(**TINY | {"num_layers": 3}, head="mean", stack={"early_exit": exit_settings})
    return build_model(config, key=jax.random.key(5))


def test_pabee_classifier_exits_where_its_internal_classifiers_agree():
    model = _classifier(patience=1)
    tokens, mask = _tokens(), jnp.arange(N) < 7
    (h, m), produced = model.encoder.apply(tokens, mask, readout=model._exit_readout)
    per_layer = produced.exits.logits  # training: every block's internal classifier
    # each internal classifier: its own head on the mean-pooled, finally normalised state of its block
    x = model.encoder.embedding(tokens, jnp.arange(N))
    stack = model.encoder.blocks[0]
    for i in range(3):
        x = stack.blocks[i](x, kv_mask=mask, positions=jnp.arange(N, dtype=jnp.float32))
        pooled = _np(model.encoder._final(x, mask))[:7].mean(0)
        head = model.exit_heads[i] if i < 2 else model.head
        assert_close(per_layer[i], pooled @ _np(head.weight).T + _np(head.bias), atol=1e-4)
    at = _patience_reference(list(np.argmax(_np(per_layer), -1)), 1)
    logits, made = model.apply(tokens, mask, inference=True)
    assert_close(logits, per_layer[at], atol=1e-5)
    assert_close(made.tallies["exit_depth"], jnp.array([at + 1.0, 1.0]), atol=0)


def test_the_exits_losses_are_weighted_in_the_objective():
    model = _classifier()
    tokens = jnp.stack([_tokens(1), _tokens(2)])
    batch = {"tokens": tokens, "mask": jnp.ones(tokens.shape, bool), "label": jnp.array([0, 1])}
    objective, _ = loss_and_metrics(model, batch, None)
    per_layer = jax.vmap(lambda t: model.encoder.apply(t, readout=model._exit_readout)[1].exits.logits)(tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(per_layer, batch["label"][:, None]).mean(0)
    assert float(objective) == pytest.approx(float((ce * jnp.array([1, 2, 3]) / 6).sum()), rel=1e-5)


def test_a_language_model_copies_an_exited_tokens_state_upward():
    model = _exit_lm()
    threshold = model.blocks[0].threshold
    tokens = _tokens()
    _, produced = model.apply(tokens, inference=True)
    depth = float(produced.tallies["exit_depth"][0]) / N
    assert 1 < depth < 3, depth  # some tokens leave early, some do not
    # an exited token's prediction is its exit block's readout of its state there
    x = model.embedding(tokens, jnp.arange(N))
    stack, exited = model.blocks[0], np.zeros(N, bool)
    out = np.zeros((N, TINY["vocab_size"]))
    for i in range(3):
        y = stack.blocks[i](x, positions=jnp.arange(N))
        x = jnp.where(jnp.asarray(exited)[:, None], x, y)
        probs = _np(jax.nn.softmax(model._logits(x), -1))
        leaving = ~exited & ((probs.max(-1) >= threshold) | (i == 2))
        out[leaving] = _np(model._logits(x))[leaving]
        exited |= leaving
    assert_close(infer(model, tokens), out, atol=1e-5)


def test_mixed_training_draws_an_exit_per_token_and_trains():
    config = ModelConfig(task="lm", **TINY, stack={"early_exit": {"training": "mixed", "samples": 2}})
    model = build_model(config, key=jax.random.key(0))
    _, produced = model.apply(_tokens(), key=jax.random.key(3))
    assert produced.exits.logits.shape == (2, N, TINY["vocab_size"])
    assert_close(produced.exits.weights, jnp.array([0.5, 0.5]))
    tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, 23)
    _, losses = train_steps(model, tokens, jnp.ones((4, 8), bool), steps=3)
    assert all(np.isfinite(losses))


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    "stack",
    [
        {"kind": "universal", "max_steps": 3},
        {"cct": {}},
        {"early_exit": {}},
    ],
    ids=["universal", "cct", "pabee"],
)
def test_encoders_keep_padding_out_and_have_finite_gradients(stack):
    model = build_model(ModelConfig(**TINY, head="cls", stack=stack), key=jax.random.key(5))
    tokens, mask = _tokens(), jnp.arange(N) < 6
    out, grads = forward_and_grad(model, tokens, mask)
    assert finite_grads(grads)
    assert_close(train_forward(model, tokens.at[6:].set(5), mask), out, atol=1e-5)
    assert_close(infer(model, tokens.at[6:].set(5), mask), infer(model, tokens, mask), atol=1e-5)


@pytest.mark.parametrize(
    ("task", "stack", "tally", "loss"),
    [
        ("lm", {"kind": "universal", "max_steps": 3}, "act_steps", "ponder_loss/blocks.0"),
        ("classify", {"kind": "universal", "max_steps": 3}, "act_steps", "ponder_loss/encoder.blocks.0"),
        ("lm", {"cct": {}}, "cct_depth", "budget_loss/blocks.0"),
        ("lm", {"early_exit": {}}, "exit_depth", None),
        ("classify", {"early_exit": {}}, "exit_depth", None),
    ],
)
def test_the_train_step_adds_the_losses_and_logs_the_depth_and_evaluation_averages_it(task, stack, tally, loss):
    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    model = build_model(ModelConfig(task=task, **TINY, stack=stack), key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, 23)
    mask = jnp.arange(8)[None] < jnp.array([[8], [6], [8], [5]])
    batch = {"tokens": tokens, "mask": mask, "loss_mask": mask}
    if task == "classify":
        batch = {"tokens": tokens, "mask": mask, "label": jnp.arange(4) % 2}
    params, drawn, static = split_model(model)
    optimizer = optax.adamw(3e-3)
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    step = jax.jit(make_train_step(static, optimizer, grad_accum=2))
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert tally in metrics and 1 <= float(metrics[tally]) <= (3 if "universal" in str(stack) else 2)
    if loss is not None:
        assert float(metrics[loss]) > 0
    result = evaluate(make_eval_step(static), state, [batch, batch], 2, language_model=task == "lm")
    assert 1 <= result[f"eval_{tally}"] <= 3


YAML = """
task: lm
vocab_size: 23
num_layers: 1
d_model: 16
num_heads: 4
max_len: 32
attention: {name: local, window: 3}
stack: {kind: universal, max_steps: 4, act_threshold: 0.9, ponder_weight: 0.05, step_embedding: learned}
"""


def test_the_settings_reach_the_modules_from_yaml():
    config = ModelConfig.from_yaml(YAML)
    assert ModelConfig.from_dict(config.to_dict()) == config
    stack = build_model(config, key=jax.random.key(0)).blocks[0]
    assert (stack.max_steps, stack.threshold, stack.ponder_weight) == (4, 0.9, 0.05)
    assert stack.step_table.shape == (4, 16) and stack.blocks[0].attention.core.spec.name == "local"
    exits = ModelConfig(**TINY, stack={"early_exit": {"patience": 3}})
    model = build_model(exits, key=jax.random.key(0))
    assert model.encoder.blocks[0].rule == "patience" and model.encoder.blocks[0].patience == 3
    assert len(model.exit_heads) == 1


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (dict(stack={"kind": "universal", "act": False, "act_threshold": 0.5}), "set act true"),
        (dict(stack={"kind": "universal", "act_threshold": 1.5}), r"in \(0, 1\]"),
        (dict(stack={"kind": "universal"}, embedding={"position": "rope"}), "position_signal false"),
        (dict(stack={"kind": "universal"}, task="seq2seq"), "serves tasks"),
        (dict(stack={"kind": "universal", "position_signal": False}, embedding={"position": "shaw"}), "refused"),
        (dict(stack={"kind": "universal"}, ffn={"kind": "moe"}), "takes a dense ffn"),
        (dict(stack={"early_exit": {}, "cct": {}}), "choose one"),
        (dict(stack={"early_exit": {"rule": "patience"}}, task="lm"), "PABEE"),
        (dict(stack={"early_exit": {"training": "mixed"}}), "task lm"),
        (dict(stack={"early_exit": {"samples": 2}}), "set training 'mixed'"),
        (dict(stack={"early_exit": {"threshold": 0.5, "rule": "patience"}}), r"\['threshold'\]"),
        (dict(stack={"early_exit": {}}, num_layers=1), "num_layers >= 2"),
        (dict(stack={"early_exit": {}}, head="pma"), "pma"),
        (dict(stack={"early_exit": {}, "reversible": True}), r"\['reversible'\]"),
        (dict(stack={"cct": {}}, norm={"placement": "post"}), "norm.placement 'pre'"),
        (dict(stack={"cct": {"budget": 0.3}}), "one of budgets"),
        (dict(stack={"cct": {"budgets": [0.5, 1.5]}}), "distinct fractions"),
        (dict(stack={"cct": {}}, embedding={"extra_tokens": 2}), "extra tokens"),
        (dict(stack={"cct": {}, "sharing": "all"}), r"\['sharing'\]"),
        (dict(stack={"early_exit": {}, "layerdrop": 0.2, "macaron": True}), r"\['layerdrop', 'macaron'\]"),
    ],
)
def test_config_refusals_name_the_setting_and_the_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**TINY | values)


# ----------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "stack",
    [{"kind": "universal", "max_steps": 3}, {"early_exit": {"threshold": 0.5}}],
    ids=["universal", "exit"],
)
def test_cli_trains_evaluates_generates_and_resumes_exactly(tmp_path, capsys, stack):
    import json
    import shutil

    from test_train import losses, write_config

    from jxformers.tools import cli
    from jxformers.train import load_experiment, train

    model = {"attention": "softmax", "stack": stack, "num_layers": 2}
    config = write_config(tmp_path, model=model, train={"steps": 8, "eval_every": 8})
    experiment = load_experiment(config, ["checkpoint.async_save=false"])
    run = tmp_path / "run"
    train(experiment, run, progress=False)
    straight = losses(run)
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    train(experiment, run, progress=False)
    assert losses(run) == straight  # exact, step by step
    capsys.readouterr()
    assert cli.main(["eval", str(config), "--workdir", str(run)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    name = "eval_act_steps" if stack.get("kind") == "universal" else "eval_exit_depth"
    assert 1 <= result[name] <= 3
    args = ["generate", str(config), "--workdir", str(run), "--prompt", "1 3 4 2", "--steps", "4"]
    assert cli.main(args) == 0
    assert len(capsys.readouterr().out.split()) == 8


# ----------------------------------------------------------------------------- sharded


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_the_adaptive_models_like_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    from mesh_runs import lm_batch, same_losses, train_both

    for stack in ({"kind": "universal", "max_steps": 3}, {"cct": {}}, {"early_exit": {"threshold": 0.5}}):
        config = dict(task="lm", vocab_size=31, num_layers=2, d_model=16, num_heads=2, max_len=16,
                      ffn={"d_ff": 32}, stack=stack)
        runs = train_both(config, lm_batch())
        same_losses(runs, learns=False)  # the ponder, budget and exit losses are part of it
        depth = lambda run: [[v for k, v in m.items() if k in ("act_steps", "cct_depth", "exit_depth")]
                             for m in run.metrics]
        np.testing.assert_allclose(depth(runs[True]), depth(runs[False]), rtol=1e-5)
        assert all(len(d) == 1 for d in depth(runs[True]))
    """
    )
