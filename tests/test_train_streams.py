"""Training Transformer-XL / the Compressive Transformer on a stream: the stream source's
rows continue from batch to batch, the memory is carried in the train state (it holds the
last mem_len states each row read), saved in checkpoints and the same after a resume,
evaluation carries its own (longer) memory, and the experiment checks its data."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import losses

from jxformers.data import make_loader, make_source
from jxformers.train import (
    init_train_state,
    load_experiment,
    restore_train_state,
    train,
)
from jxformers.train.step import evaluate, loss_and_metrics, make_eval_step


def experiment(texts, *extra):
    return load_experiment(
        "shakespeare_txl",
        [
            "preset=tiny",
            f"data.settings.path={texts}",
            "data.settings.max_len=9",
            "data.settings.rows=4",
            "data.train_size=64",
            "data.eval_size=8",
            "train.batch_size=4",
            "model.mem_len=6",
            "model.eval_mem_len=12",
            "model.d_model=16",
            "model.num_heads=2",
            "model.d_ff=32",
            "train.steps=8",
            "train.warmup_steps=4",  # at most the shortest run here (the tiny preset's 20 would outlast them)
            "train.eval_every=4",
            "train.eval_batches=2",
            "train.log_every=1",
            "checkpoint.every=4",
            "checkpoint.async_save=false",
            *extra,
        ],
    )


def test_stream_rows_continue_from_batch_to_batch(texts):
    source = make_source("shakespeare_stream", seed=0, size=24, path=str(texts), max_len=9, rows=4)
    stream = b"".join((texts / f"play{i}_gut.txt").read_bytes() for i in range(7))  # the train plays
    piece = len(stream) // 4
    batches = list(zip(range(3), make_loader(source, batch_size=4, seed=0, shuffle=False), strict=False))
    for t, batch in batches:
        for b in range(4):
            start = b * piece + 8 * t
            assert bytes(batch["tokens"][b].astype(np.uint8)) == stream[start : start + 9]
    assert (batches[1][1]["tokens"][:, 0] == batches[0][1]["tokens"][:, -1]).all()  # overlap by the last target
    with pytest.raises(ValueError, match=r"size \(10\) must be a multiple of rows \(4\)"):
        make_source("shakespeare_stream", seed=0, size=10, path=str(texts), max_len=9, rows=4)


@pytest.mark.heavy
def test_memory_is_carried_checkpointed_and_resumed(texts, tmp_path):
    e = experiment(texts)
    run = tmp_path / "run"
    summary = train(e, run, progress=False)
    assert summary["step"] == 8 and math.isfinite(summary["eval_loss"])
    state, _ = restore_train_state(e, run)
    memory = state.memory
    assert memory["hidden"].shape == (4, 2, 6, 16) and (np.asarray(memory["length"]) == 6).all()
    # layer 0's memory: the scaled embeddings (of step 8's parameters, before its update) of the last 6 inputs
    # of each row (bytes 8 * 8 - 6 .. 8 * 8 - 1); the nearest rows of the updated table name those bytes
    stream = b"".join((texts / f"play{i}_gut.txt").read_bytes() for i in range(7))
    piece = len(stream) // 4
    table = state.params.table
    for b in range(4):
        read = np.frombuffer(stream[b * piece + 58 : b * piece + 64], np.uint8)
        distance = jnp.linalg.norm(memory["hidden"][b, 0][:, None] - table[None] * math.sqrt(16), axis=-1)
        assert np.asarray(jnp.argmin(distance, -1)).tolist() == read.tolist()
        np.testing.assert_allclose(memory["hidden"][b, 0], table[read] * math.sqrt(16), atol=0.05)
    straight = losses(run)
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    train(e, run, progress=False)
    assert losses(run) == straight  # exact, step by step: step 5 read step 4's memory from the checkpoint
    resumed = restore_train_state(e, run)[0].memory
    for a, b in zip(jax.tree.leaves(memory), jax.tree.leaves(resumed), strict=True):
        assert bool(jnp.all(a == b))
    # and the memory matters: a resume that dropped it would log other losses
    batch = next(iter(make_loader(e.sources()[0], batch_size=4, seed=0, shuffle=False)))
    model = state.model(init_train_state(e)[1])
    with_memory = loss_and_metrics(model, batch, None, inference=True, memory=memory)[0]
    empty = loss_and_metrics(model, batch, None, inference=True, memory=jax.tree.map(jnp.zeros_like, memory))[0]
    assert abs(float(with_memory) - float(empty)) > 1e-4
    # evaluation carries its own memory of eval_mem_len slots across the batches, emptied by each evaluate()
    static = init_train_state(e)[1]
    eval_step = make_eval_step(static)
    loader = list(zip(range(3), make_loader(e.sources()[1], batch_size=4, seed=0, shuffle=False), strict=False))
    first = evaluate(eval_step, state, [b for _, b in loader], 3, language_model=True)
    assert eval_step.memory["hidden"].shape == (4, 2, 12, 16) and (np.asarray(eval_step.memory["length"]) == 12).all()
    assert evaluate(eval_step, state, [b for _, b in loader], 3, language_model=True) == first


def test_compressive_trains_on_the_stream(texts, tmp_path):
    e = experiment(
        texts,
        "model.architecture=compressive",
        "model.cmem_len=4",
        "model.compression_rate=2",
        "model.eval_mem_len=8",
        "model.stack.compression=most_used",  # its usage is memory too: carried, saved and restored
        "model.stack.compression_loss=autoencoding",
        "train.steps=4",
        "data.settings.max_len=9",
    )
    train(e, tmp_path / "run", progress=False)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("autoencoding_loss", 0) > 0 for r in records)
    memory = restore_train_state(e, tmp_path / "run")[0].memory
    assert (np.asarray(memory["compressed_length"]) == 4).all()  # 4 segments of 8 through a memory of 6
    assert memory["usage"].shape == memory["hidden"].shape[:3] and float(np.asarray(memory["usage"]).sum()) > 0


@pytest.mark.parametrize(
    "extra,match",
    [
        (["data.task=shakespeare", "data.settings={path: X, max_len: 9}"], "stream of consecutive segments"),
        (["data.settings.rows=2"], r"rows \(2\) must equal train.batch_size \(4\)"),
        (["model.architecture=compressive", "model.cmem_len=4", "model.compression_rate=3"], "multiple"),
    ],
)
def test_experiment_checks_its_stream(texts, extra, match):
    extra = [x.replace("X", str(texts)) for x in extra]
    with pytest.raises(ValueError, match=match):
        experiment(texts, *extra)


def test_gradient_accumulation_splits_the_rows_with_their_memories(texts):
    from jxformers.train.state import init_train_state as init
    from jxformers.train.step import make_train_step

    e = experiment(texts, "model.dropout=0.0")
    state, static, optimizer, _ = init(e)
    batches = [
        b for _, b in zip(range(2), make_loader(e.sources()[0], batch_size=4, seed=0, shuffle=False), strict=False)
    ]
    results = []
    for accum in (1, 2):
        s = state
        step = make_train_step(static, optimizer, grad_accum=accum)
        for b in batches:
            s, metrics = step(jax.tree.map(jnp.copy, s), b)
        results.append((s, metrics))
    (a, ma), (b, mb) = results
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.memory), jax.tree.leaves(b.memory), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-4)
