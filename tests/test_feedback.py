"""The Feedback Transformer (Fan et al. 2020, `stack: {kind: feedback}`,
jxformers/nn/feedback.py): its memory against a numpy walk over a few positions written
from the paper's equations, decoding parity, gradients, the config's refusals, training,
evaluation and generation from the command line, exact resume, and 8 simulated devices."""

from __future__ import annotations

import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import train_losses
from test_train import losses, write_config

from jxformers import ModelConfig, build_model, generate
from jxformers.nn.feedback import FeedbackLM
from jxformers.tools import cli
from jxformers.train import load_experiment, train

D, HEADS, LAYERS, VOCAB = 8, 2, 2, 11


def small(**over) -> FeedbackLM:
    config = dict(
        task="lm", vocab_size=VOCAB, num_layers=LAYERS, d_model=D, num_heads=HEADS, max_len=12,
        ffn={"kind": "relu", "d_ff": 16}, stack={"kind": "feedback"},
    ) | over  # fmt: skip
    model = build_model(config, key=jax.random.key(0))
    assert isinstance(model, FeedbackLM)
    # weights off their start (uniform layer mix, unit norm gains) so that a wrong one shows
    arrays, rest = eqx.partition(model, eqx.is_inexact_array)
    leaves, tree = jax.tree.flatten(arrays)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    moved = [x + 0.3 * jax.random.normal(k, x.shape) if x.ndim <= 1 else x for x, k in zip(leaves, keys, strict=True)]
    return eqx.combine(jax.tree.unflatten(tree, moved), rest)


def np_layernorm(v, gain, bias, eps=1e-5):
    centred = v - v.mean(-1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * gain + bias


def f64(x):
    return np.asarray(x, np.float64)


def np_feedback(model: FeedbackLM, tokens, *, real=None, span=None, pre=True):
    """Logits by the paper's equations, position by position: m_τ = Σ_l softmax(w)_l x_τ^l
    over l = 0..L, z_t^l = Attn(x_t^{l-1}; keys W_k^l m_τ, values W_v^l m_τ, τ < t), one
    memory for every layer; pre-norm normalises the query input and the memory with the
    layer's first norm (the authors' code), post-norm the residual sums."""
    n = len(tokens)
    real = np.ones(n, bool) if real is None else np.asarray(real)
    x0 = f64(model.embedding(jnp.asarray(tokens), jnp.arange(n)))
    w = f64(model.layer_weights)
    w = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
    memory, out = [], []
    for t in range(n):
        x, states = x0[t], [x0[t]]
        for layer in model.layers:
            n1 = lambda v, ln=layer.norms[0]: np_layernorm(v, f64(ln.weight), f64(ln.bias))  # noqa: E731
            n2 = lambda v, ln=layer.norms[1]: np_layernorm(v, f64(ln.weight), f64(ln.bias))  # noqa: E731
            q = (f64(layer.q_proj.weight) @ (n1(x) if pre else x)).reshape(HEADS, -1)
            attended = np.zeros((HEADS, D // HEADS))
            read = [tau for tau in range(t) if real[tau] and (span is None or tau >= t - span)]
            if read:
                m = np.stack([memory[tau] for tau in read])
                m = np.stack([n1(r) for r in m]) if pre else m
                k = (m @ f64(layer.k_proj.weight).T).reshape(len(read), HEADS, -1)
                v = (m @ f64(layer.v_proj.weight).T).reshape(len(read), HEADS, -1)
                for h in range(HEADS):
                    s = k[:, h] @ q[h] / np.sqrt(D // HEADS)
                    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                    attended[h] = p @ v[:, h]
            a = f64(layer.o_proj.weight) @ attended.reshape(-1)
            x = x + a if pre else n1(x + a)
            h_in = n2(x) if pre else x
            ffn = layer.ffn
            f = f64(ffn.w_out.weight) @ np.maximum(f64(ffn.w_in.weight) @ h_in + f64(ffn.w_in.bias), 0)
            f = f + f64(ffn.w_out.bias)
            x = x + f if pre else n2(x + f)
            states.append(x)
        memory.append(sum(wl * s for wl, s in zip(w, states, strict=True)))
        out.append(x)
    out = np.stack(out)
    if model.norm is not None:
        out = np_layernorm(out, f64(model.norm.weight), f64(model.norm.bias))
    return out @ f64(model.embedding.table).T


TOKENS = np.array([3, 1, 4, 1, 5, 9, 2])


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_memory_of_all_layers_matches_a_numpy_walk(placement):
    model = small(norm={"placement": placement})
    assert (model.norm is None) == (placement == "post")
    want = np_feedback(model, TOKENS, pre=placement == "pre")
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), want, rtol=2e-4, atol=2e-4)


def test_a_span_and_padding_limit_the_memory_read():
    model = small(stack={"kind": "feedback", "span": 2})
    want = np_feedback(model, TOKENS, span=2)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), want, rtol=2e-4, atol=2e-4)
    # a padded position is never read: the others' logits are those of a walk that skips it
    real = np.array([True, True, False, True, True, True, True])
    model = small()
    got = np.asarray(model(jnp.asarray(TOKENS), jnp.asarray(real)))
    want = np_feedback(model, TOKENS, real=real)
    np.testing.assert_allclose(got[real], want[real], rtol=2e-4, atol=2e-4)
    # (and the walk that reads it differs: the test can fail)
    assert np.abs(np_feedback(model, TOKENS)[3:] - want[3:]).max() > 1e-3


def test_higher_layers_of_the_past_reach_the_first_layer():
    """What sets it apart from a transformer: the first layer at t reads the top layer at
    t - 1; with all the memory's weight on the top layer (w), the logits at t depend on it."""
    model = small()
    top = eqx.tree_at(lambda m: m.layer_weights, model, jnp.array([-30.0, -30.0, 30.0]))
    bottom = eqx.tree_at(lambda m: m.layer_weights, model, jnp.array([30.0, -30.0, -30.0]))
    a, b = top(jnp.asarray(TOKENS)), bottom(jnp.asarray(TOKENS))
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-5)  # the first position reads nothing
    assert float(jnp.abs(a[1:] - b[1:]).max()) > 1e-2


def test_decoding_token_by_token_equals_the_sequential_forward():
    model = small(stack={"kind": "feedback", "span": 3})
    state, rows = model.init_decode_state(10), []
    for token in TOKENS:
        logits, state = model.decode_step(jnp.asarray(token), state)
        rows.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.stack(rows)), np.asarray(model(jnp.asarray(TOKENS))), atol=1e-5)
    greedy = generate(model, jnp.asarray(TOKENS[:3]), 4, key=jax.random.key(0), temperature=0.0)
    again = generate(model, jnp.asarray(TOKENS[:3]), 4, key=jax.random.key(0), temperature=0.0, use_cache=False)
    assert greedy.tolist() == again.tolist()


def test_gradients_are_finite_and_reach_the_layer_weights():
    model = small(dropout=0.1)

    def loss(m):
        logits = m(jnp.asarray(TOKENS[:-1]), key=jax.random.key(1))
        return -jax.nn.log_softmax(logits)[jnp.arange(6), jnp.asarray(TOKENS[1:])].mean()

    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert float(jnp.abs(grads.layer_weights).min()) > 0


def test_one_training_step_through_the_config_lowers_the_loss():
    losses_, _ = train_losses(small(), steps=4, vocab=VOCAB)
    assert all(np.isfinite(losses_)) and losses_[-1] < losses_[0]


def test_yaml_and_refusals():
    config = ModelConfig.from_yaml("task: lm\nnum_layers: 1\nstack: {kind: feedback, span: 4}\n")
    assert config.stack.span == 4 and config.norm.placement == "pre" and config.embedding.position == "sinusoidal"
    bad = [
        (dict(task="classify"), "serves tasks"),
        (dict(attention="linear"), "builds its own softmax"),
        (dict(embedding={"position": "rope"}), "positions added to the embeddings"),
        (dict(norm={"kind": "powernorm"}), "powernorm"),
        (dict(norm={"placement": "sandwich"}), "take 'pre' or 'post'"),
        (dict(ffn={"kind": "moe"}), "takes a dense ffn"),
        (dict(kv_heads=1), "grouped-query"),
        (dict(stack={"kind": "feedback", "span": 0}), "span"),
    ]
    for over, message in bad:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**(dict(task="lm", stack={"kind": "feedback"}) | over))


FEEDBACK = {"attention": "softmax", "stack": {"kind": "feedback"}}


def test_train_eval_generate_from_the_command_line_and_resume_exactly(tmp_path, capsys):
    config = write_config(tmp_path, model=FEEDBACK, train={"steps": 8, "eval_every": 8})
    run = tmp_path / "run"
    assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress"]) == 0
    capsys.readouterr()
    assert cli.main(["eval", str(config), "--workdir", str(run)]) == 0
    assert 0 <= json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval_accuracy"] <= 1
    argv = ["generate", str(config), "--workdir", str(run), "--prompt", "1 3 4 2", "--steps", "3"]
    assert cli.main([*argv, "--temperature", "0"]) == 0
    assert len(capsys.readouterr().out.split()) == 7
    straight = losses(run)
    experiment = load_experiment(config, ["checkpoint.async_save=false"])
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    train(experiment, run, progress=False)
    assert losses(run) == straight and len(straight) == 8  # exact, step by step


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_with_the_losses_of_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    from mesh_runs import lm_batch, same_leaves, same_losses, train_both

    config = dict(task="lm", vocab_size=31, num_layers=2, d_model=16, num_heads=2, max_len=12,
                  ffn={"d_ff": 32}, stack={"kind": "feedback", "span": 6})
    runs = train_both(config, lm_batch(length=12, shortest=6))
    same_losses(runs)
    same_leaves(runs[True].state.params.layer_weights, runs[False].state.params.layer_weights)
    """
    )


def test_the_cost_script_compares_the_same_sizes_and_writes_its_table(tmp_path):
    """scripts/bench_feedback.py: both sides one size but the stack, and its table (no
    timing here: the numbers are made up)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "scripts"))
    import bench_feedback as bench

    args = bench.parse_args(["--lengths", "16", "32", "--out", str(tmp_path / "cost.md")])
    plain, feedback = (bench.config(s, 16, args) for s in bench.STACKS)
    assert {k: v for k, v in plain.items() if k != "stack"} == {k: v for k, v in feedback.items() if k != "stack"}
    row = {"params": 10, "compile": 1.0, "step": 2.0, "gflop": 0.5, "temp": 1.0}
    rows = {(s, n): row | {"step": 2.0 * (1 + 9 * (s == "feedback"))} for s in bench.STACKS for n in (16, 32)}
    text = bench.table(rows, args, "python scripts/bench_feedback.py")
    assert "loses the transformer's parallelism" in text and "| 16 | 10 | 10 | 2.0 | 20.0 | 10.0x |" in text
    with pytest.raises(SystemExit):
        bench.parse_args(["--lengths", "1"])
