"""Memformer (Wu et al. 2020, `stack: {kind: memformer}`, jxformers/nn/memformer.py) and
ERNIE-Doc (Ding et al. 2021, `stack: {kind: ernie_doc}`, jxformers/nn/transformer_xl.py):
the memory writer and reader against numpy written from the papers' equations, segments
with the memory against segment-by-segment calls, memory replay back-propagation's
gradients and compiled memory against the plain unroll, the same-layer recurrence and the
retrospective feed against compositions of the layers, decoding parity, the config's
refusals, training through the config and the command line with exact resume, and 8
simulated devices."""

from __future__ import annotations

import math
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import decode_all
from test_train import losses

from jxformers import ModelConfig, build_model
from jxformers.nn.memformer import MemformerLM
from jxformers.nn.transformer_xl import RecurrentLM
from jxformers.train import load_experiment, restore_train_state, train
from jxformers.train.step import loss_and_metrics

VOCAB, D, HEADS, SLOTS, SEGMENT = 13, 16, 2, 3, 4
BASE = dict(task="lm", vocab_size=VOCAB, num_layers=2, d_model=D, num_heads=HEADS, max_len=16, ffn={"d_ff": 32})


def memformer(**stack) -> MemformerLM:
    config = BASE | {"stack": {"kind": "memformer", "num_slots": SLOTS, "segment_len": SEGMENT} | stack}
    model = build_model(config, key=jax.random.key(0))
    assert isinstance(model, MemformerLM)
    return model


def ernie(**stack) -> RecurrentLM:
    model = build_model(BASE | {"stack": {"kind": "ernie_doc", "mem_len": 8} | stack}, key=jax.random.key(1))
    assert isinstance(model, RecurrentLM)
    return model


@pytest.fixture(scope="module")
def model():
    return memformer()


@eqx.filter_jit
def call(f, *args, **kwargs):
    """f(*args, **kwargs) compiled (op-by-op dispatch with runtime type checks is slow)."""
    return f(*args, **kwargs)


def f64(x):
    return np.asarray(x, np.float64)


def tokens(seed, n):
    return jax.random.randint(jax.random.key(seed), (n,), 0, VOCAB)


# ----------------------------------------------------------------------------- Memformer's equations


def np_write(writer, memory, x, mask, temperature):
    """Eq. 4-9 slot by slot and head by head: slot i's scores over [itself; the valid
    tokens], softmax(scores / τ) times [m^i; V_x], then (m' + v_b^i) / ||m' + v_b^i||."""
    wq, wk, wv = (f64(p.weight) for p in (writer.q_proj, writer.k_proj, writer.v_proj))
    memory, x, bias = f64(memory), f64(x), f64(writer.bias)
    dh = D // HEADS
    out = np.zeros_like(memory)
    for i in range(memory.shape[0]):
        m = memory[i]
        for h in range(HEADS):
            cut = slice(h * dh, (h + 1) * dh)
            q = (m @ wq.T)[cut]
            keys = [(m @ wk.T)[cut]] + [(x[j] @ wk.T)[cut] for j in range(len(x)) if mask[j]]
            values = [m[cut]] + [(x[j] @ wv.T)[cut] for j in range(len(x)) if mask[j]]
            scores = np.array([q @ k for k in keys]) / math.sqrt(dh) / temperature
            p = np.exp(scores - scores.max())
            out[i, cut] = (p / p.sum()) @ np.array(values)
        out[i] += bias[i]
        out[i] /= np.linalg.norm(out[i])
    return out


def test_the_writer_is_slot_attention_with_biased_normalisation(model):
    writer = model.writer
    memory = jax.random.normal(jax.random.key(2), (SLOTS, D))
    x = jax.random.normal(jax.random.key(3), (5, D))
    mask = np.array([1, 1, 0, 1, 1], bool)
    got = call(lambda w, m, x, k: w(m, x, k), writer, memory, x, jnp.asarray(mask))
    np.testing.assert_allclose(got, np_write(writer, memory, x, mask, 0.5), atol=1e-5)
    # M_0 = v_b / ||v_b||, and a slot never reads another slot
    unit = f64(writer.bias) / np.linalg.norm(f64(writer.bias), axis=-1)[:, None]
    np.testing.assert_allclose(writer.initial(), unit, atol=1e-6)
    moved = memory.at[1].add(3.0)
    again = call(lambda w, m, x, k: w(m, x, k), writer, moved, x, jnp.asarray(mask))
    np.testing.assert_allclose(again[0], got[0], atol=1e-6)
    assert float(jnp.abs(again[1] - got[1]).max()) > 1e-3


def test_every_layer_reads_the_memory_by_cross_attention(model):
    """Eq. 1-3 for layer 0's reader: softmax((x W_Q)(M W_K)^T / sqrt(d_head)) M W_V, then W_O."""
    block = model.lm.blocks[0]
    reader = block.cross_attention
    x = jax.random.normal(jax.random.key(4), (5, D))
    memory = jax.random.normal(jax.random.key(5), (SLOTS, D))
    got = call(lambda a, x, m: a(x, m), reader, x, memory)
    lin = lambda p, v: f64(v) @ f64(p.weight).T + (0 if p.bias is None else f64(p.bias))  # noqa: E731
    q, k, v = lin(reader.q_proj, x), lin(reader.k_proj, memory), lin(reader.v_proj, memory)
    dh, heads = D // HEADS, []
    for h in range(HEADS):
        cut = slice(h * dh, (h + 1) * dh)
        s = q[:, cut] @ k[:, cut].T / math.sqrt(dh)
        p = np.exp(s - s.max(-1, keepdims=True))
        heads.append((p / p.sum(-1, keepdims=True)) @ v[:, cut])
    np.testing.assert_allclose(got, lin(reader.o_proj, np.concatenate(heads, -1)), atol=1e-5)
    assert all(b.cross_attention is not None for b in model.lm.blocks)
    seg = tokens(6, SEGMENT)
    a = call(lambda m, t, s: m.segment(s, t, None, None, True)[0], model, seg, memory)
    b = call(lambda m, t, s: m.segment(s, t, None, None, True)[0], model, seg, memory.at[0].add(1.0))
    assert float(jnp.abs(a - b).max()) > 1e-4


def test_segments_with_the_memory_equal_segment_by_segment_calls(model):
    """apply over three segments (one scan) = three calls each after the last one's memory;
    the memory after the first is the writer on M_0 and the first segment's last-layer states."""
    seq = tokens(7, 3 * SEGMENT)
    logits, produced = call(lambda m, t: m.apply(t, memory=m.init_memory()), model, seq)
    memory, parts = model.init_memory(), []
    for s in range(3):
        out, made = call(lambda m, t, mem: m.apply(t, memory=mem), model, seq[s * SEGMENT : (s + 1) * SEGMENT], memory)
        parts.append(out)
        if s == 0:
            states = call(lambda m, t: m.lm.features(t, context=m.writer.initial())[0], model, seq[:SEGMENT])
            written = call(lambda w, x: w(w.initial(), x), model.writer, states)
            np.testing.assert_allclose(made.memory["slots"], written, atol=1e-5)
        memory = made.memory
    np.testing.assert_allclose(logits, jnp.concatenate(parts), atol=1e-5)
    np.testing.assert_allclose(produced.memory["slots"], memory["slots"], atol=1e-5)
    assert int(produced.memory["written"]) == 3
    no_memory = call(lambda m, t: m(t), model, seq)  # the generic call: the same segments from M_0
    np.testing.assert_allclose(no_memory, logits, atol=1e-5)
    with pytest.raises(ValueError, match="segments of segment_len 4 when it carries a memory; got 6 tokens"):
        model.apply(seq[:6], memory=model.init_memory())


def test_decoding_token_by_token_matches_the_parallel_segments(model):
    seq = tokens(8, 2 * SEGMENT + 3)  # two written segments and a partial one
    np.testing.assert_allclose(decode_all(model, seq), call(lambda m, t: m(t), model, seq), atol=2e-5, rtol=2e-5)


def test_memory_replay_back_propagation_gives_the_unrolled_gradients_in_less_memory():
    """MRBP (section 3.3): the scan with each segment's step under jax.checkpoint keeps only
    the memories and replays the segments; the gradients are the plain unroll's, through
    every segment's memory (the first segment's tokens move the last one's loss), and the
    compiled backward's temporaries are smaller."""
    config = BASE | {"num_layers": 1, "d_model": 32, "num_heads": 4, "max_len": 16, "ffn": {"d_ff": 128}}
    seq, compiled = tokens(9, 4 * 8), {}
    for replay in (True, False):
        m = build_model(config | {"stack": {"kind": "memformer", "num_slots": 4, "segment_len": 8, "replay": replay}},
                        key=jax.random.key(0))  # fmt: skip
        params, static = eqx.partition(m, eqx.is_array)

        def loss(p, t, static=static):
            m = eqx.combine(p, static)
            return m.apply(t, memory=m.init_memory())[0][-8:].sum()  # the last segment's logits only

        compiled[replay] = params, jax.jit(jax.grad(loss)).lower(params, seq).compile()
    got, want = (compiled[r][1](compiled[r][0], seq) for r in (True, False))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert float(jnp.abs(got.writer.bias).max()) > 0  # v_b enters the loss through the memory alone
    temp = {r: compiled[r][1].memory_analysis().temp_size_in_bytes for r in compiled}
    assert temp[True] < 0.7 * temp[False], temp


def test_yaml_and_refusals():
    config = ModelConfig.from_yaml("task: lm\nstack: {kind: memformer, num_slots: 4, segment_len: 8, replay: false}\n")
    assert config.stack.num_slots == 4 and not config.stack.replay and config.norm.placement == "pre"
    assert build_model(BASE | {"attention": "linear", "stack": {"kind": "memformer", "segment_len": 4}},
                       key=jax.random.key(0)).lm.blocks[0].attention.core.name == "linear"  # fmt: skip
    bad = [
        (dict(task="classify"), "serves tasks"),
        (dict(stack={"kind": "memformer", "segment_len": 32}), r"segment_len \(32\) must be <= max_len \(16\)"),
        (dict(stack={"kind": "memformer", "num_slots": 0}), "num_slots"),
        (dict(stack={"kind": "memformer", "write_temperature": 0.0}), "write_temperature"),
        (dict(stack={"kind": "memformer"}, attention="routing"), "k-means"),
        (dict(stack={"kind": "memformer"}, ffn={"kind": "moe"}), "takes a dense ffn"),
        (dict(stack={"kind": "memformer"}, norm={"kind": "powernorm"}), "powernorm"),
        (dict(stack={"kind": "memformer"}, embedding={"extra_tokens": 2}), "extra_tokens"),
        (dict(stack={"kind": "ernie_doc", "mem_len": 4}, embedding={"position": "rope"}), "set embedding.position"),
        (dict(stack={"kind": "ernie_doc", "mem_len": 4, "segment_len": 0}), "segment_len"),
    ]
    for over, message in bad:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**(BASE | {"stack": {"kind": "memformer", "segment_len": 4}} | over))


# ----------------------------------------------------------------------------- ERNIE-Doc


def walk(model: RecurrentLM, seq, memory):
    """One segment layer by layer from a memory of per-layer states (None: empty), by
    eq. 1 of ERNIE-Doc: layer n reads [SG(m_n); h^{n-1}]; returns the logits and each
    layer's (input, output)."""
    n = len(seq)
    mem_len = 0 if memory is None else memory.shape[1]
    allowed = jnp.arange(mem_len + n)[None] <= mem_len + jnp.arange(n)[:, None]
    x = model.table[seq] * math.sqrt(D)
    pairs = []
    for i, layer in enumerate(model.layers):
        context = jnp.zeros((0, D)) if memory is None else memory[i]
        h = layer(x, context, allowed, model.u, model.v, inference=True)
        pairs.append((x, h))
        x = h
    return model._logits(x), pairs


def test_the_enhanced_recurrence_remembers_each_layers_own_outputs():
    """After a segment, layer n's memory is its output h^n (Transformer-XL's: its input
    h^{n-1}); the next segment's logits are the layers run on those memories."""
    doc, txl = ernie(), build_model(BASE | {"stack": {"kind": "transformer_xl", "mem_len": 8}}, key=jax.random.key(1))
    seq = tokens(10, 8)
    _, memory, _ = call(lambda m, t, mem: m.forward(t, mem), doc, seq[:4], doc.init_memory())
    _, pairs = call(walk, doc, seq[:4], None)
    outputs, inputs = jnp.stack([h for _, h in pairs]), jnp.stack([x for x, _ in pairs])
    np.testing.assert_allclose(memory["hidden"][:, -4:], outputs, atol=1e-5)
    second, _, _ = call(lambda m, t, mem: m.forward(t, mem), doc, seq[4:], memory)
    full = jnp.concatenate([jnp.zeros((2, 4, D)), outputs], 1)  # 4 empty slots on the left stay masked
    np.testing.assert_allclose(second, call(walk, doc, seq[4:], outputs)[0], atol=1e-5)
    assert full.shape == memory["hidden"].shape
    # Transformer-XL with the same weights remembers the inputs, and reads otherwise
    txl = eqx.tree_at(lambda m: m.layers, txl, doc.layers)
    txl = eqx.tree_at(lambda m: (m.table, m.u, m.v), txl, (doc.table, doc.u, doc.v))
    _, txl_memory, _ = call(lambda m, t, mem: m.forward(t, mem), txl, seq[:4], txl.init_memory())
    np.testing.assert_allclose(txl_memory["hidden"][:, -4:], inputs, atol=1e-5)
    other, _, _ = call(lambda m, t, mem: m.forward(t, mem), txl, seq[4:], txl_memory)
    assert float(jnp.abs(other - second).max()) > 1e-3


def test_the_retrospective_feed_reads_the_record_twice_and_trains_the_second_pass():
    model = ernie(retrospective=True, segment_len=4)
    seq = tokens(11, 8)
    logits, produced = call(lambda m, t: m.apply(t, memory=m.init_memory()), model, seq)
    memory, outs = model.init_memory(), []
    for s in (0, 4, 0, 4):  # skimming [S1, S2], then retrospective [S1, S2]
        out, memory, _ = call(lambda m, t, mem: m.forward(t, mem), model, seq[s : s + 4], memory)
        outs.append(out)
    np.testing.assert_allclose(logits, jnp.concatenate(outs[2:]), atol=1e-5)
    np.testing.assert_allclose(produced.memory["hidden"], memory["hidden"], atol=1e-5)
    assert float(jnp.abs(logits - jnp.concatenate(outs[:2])).max()) > 1e-3  # the second pass differs
    with pytest.raises(ValueError, match="retrospective feed cannot generate"):
        model.init_decode_state(8)
    with pytest.raises(ValueError, match="no whole number of segments of segment_len 4"):
        model.apply(seq[:6], memory=model.init_memory())
    # through the train step's loss (a record of one segment, read twice): finite, gradients reach every layer
    model = ernie(retrospective=True)
    batch = {"tokens": jnp.tile(tokens(12, 5), (2, 1)), "mask": jnp.ones((2, 5), bool)}
    batch["loss_mask"] = batch["mask"]
    memory = jax.tree.map(lambda x: jnp.repeat(x[None], 2, 0), model.init_memory())
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: loss_and_metrics(m, batch, None, memory=memory)[0]))(model)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert all(float(jnp.abs(layer.q_proj.weight).max()) > 0 for layer in grads.layers)


def test_ernie_doc_decodes_one_segment_as_the_parallel_call():
    model = ernie()
    seq = tokens(13, 9)
    np.testing.assert_allclose(decode_all(model, seq), call(lambda m, t: m(t), model, seq), atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- training


def _stream_run(texts) -> list[str]:
    """The overrides of a tiny 8-step run of shakespeare_txl on the `texts` fixture,
    checkpointed every 4 steps."""
    return [
        "preset=tiny", f"data.settings.path={texts}", "data.settings.max_len=9", "data.settings.rows=2",
        "data.train_size=32", "data.eval_size=4", "train.batch_size=2", "model.num_layers=1", "model.d_model=16",
        "model.num_heads=2", "model.ffn.d_ff=32", "model.max_len=16", "train.steps=8", "train.warmup_steps=2",
        "train.eval_every=8", "train.eval_batches=1", "train.log_every=1", "checkpoint.every=4",
        "checkpoint.async_save=false",
    ]  # fmt: skip


@pytest.mark.heavy
def test_ernie_doc_resumes_exactly_with_its_same_layer_memory_from_the_command_line(texts, tmp_path):
    """`jxformers train` with ERNIE-Doc's retrospective feed: the same-layer memory is
    checkpointed, and a run resumed from step 4's checkpoint logs the same losses."""
    from jxformers.tools import cli

    overrides = [
        *_stream_run(texts), "model.embedding.position=none",
        "model.stack={kind: ernie_doc, mem_len: 8, retrospective: true, segment_len: 4}",
    ]  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "shakespeare_txl", "--workdir", str(run), "--no-progress"]
    argv += [x for o in overrides for x in ("--set", o)]
    assert cli.main(argv) == 0
    straight = losses(run)
    memory = restore_train_state(load_experiment("shakespeare_txl", overrides), run)[0].memory
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    assert cli.main(argv) == 0
    assert losses(run) == straight and len(straight) == 8
    resumed = restore_train_state(load_experiment("shakespeare_txl", overrides), run)[0].memory
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(memory), jax.tree.leaves(resumed), strict=True))


@pytest.mark.heavy
def test_train_resume_exactly_with_the_memory_from_the_command_line(texts, tmp_path, capsys):
    """`jxformers train` on a stream with Memformer (two segments per record, MRBP): the
    memory is carried in the state and checkpointed, and a run resumed from step 4's
    checkpoint logs the same losses; ERNIE-Doc's retrospective feed trains through the
    same experiment; generation decodes."""
    from jxformers.tools import cli

    common = _stream_run(texts)
    stack = "model.stack={kind: memformer, num_slots: 2, segment_len: 4}"
    run = tmp_path / "run"
    argv = ["train", "shakespeare_txl", "--workdir", str(run), "--no-progress"]
    assert cli.main([*argv, *(x for o in [*common, stack] for x in ("--set", o))]) == 0
    e = load_experiment("shakespeare_txl", [*common, stack])
    memory = restore_train_state(e, run)[0].memory
    assert memory["slots"].shape == (2, 2, 16) and (np.asarray(memory["written"]) == 16).all()
    straight = losses(run)
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    train(e, run, progress=False)
    assert losses(run) == straight and len(straight) == 8  # exact: step 5 read step 4's memory
    resumed = restore_train_state(e, run)[0].memory
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(memory), jax.tree.leaves(resumed), strict=True))
    capsys.readouterr()
    sets = [x for o in [*common, stack] for x in ("--set", o)]
    gen = ["generate", "shakespeare_txl", "--workdir", str(run), "--prompt", "97 98 99", "--steps", "6"]
    assert cli.main([*gen, "--temperature", "0", *sets]) == 0
    out = capsys.readouterr().out.rstrip("\n")
    assert out.startswith("97 98 99") and len(out) == 8 + 6  # the prompt's bytes and 6 more
    retro = "model.stack={kind: ernie_doc, mem_len: 8, retrospective: true, segment_len: 4}"
    assert load_experiment("shakespeare_txl", [*common, retro]).model.stack.retrospective
    with pytest.raises(ValueError, match=r"segment_len \(3\)"):
        load_experiment("shakespeare_txl", [*common, "model.stack={kind: memformer, segment_len: 3}"])


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_memformer_and_ernie_doc_with_the_losses_of_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    from mesh_runs import lm_batch, same_leaves, same_losses, train_both

    base = dict(task="lm", vocab_size=31, num_layers=2, d_model=16, num_heads=2, max_len=16, ffn={"d_ff": 32})
    stacks = [{"kind": "memformer", "num_slots": 2, "segment_len": 4},
              {"kind": "ernie_doc", "mem_len": 4, "retrospective": True, "segment_len": 4}]
    batch = lm_batch(length=9, shortest=9)  # whole segments: no padding
    for stack in stacks:
        runs = train_both(base | {"stack": stack}, batch)
        same_losses(runs)
        same_leaves(runs[True].state.memory, runs[False].state.memory, atol=1e-5)
    """
    )
