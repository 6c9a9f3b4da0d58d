"""Task seq2seq end to end: the `transduction` data task's records (reverse, sort, add)
against independent references, the teacher-forced loss and its metrics against numpy,
greedy decoding (cached, recomputed) against the parallel decoder's argmax with and
without transparent attention and for the Evolved Transformer's encoder-decoder (So et al.
2019, `stack: evolved`) with its training steps, the command line's train / eval /
generate with an exact resume, and a 2x2x2 mesh against one device."""

from __future__ import annotations

import functools
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

from jxformers import build_model
from jxformers.data import make_source
from jxformers.data.tasks import BOS, EOS
from jxformers.nn import EncoderDecoder, Produced
from jxformers.nn.generation import transduce
from jxformers.train.step import loss_and_metrics

# ----------------------------------------------------------------------------- data


def _symbols(ids) -> list[int]:
    return [int(i) - 3 for i in ids]


def test_transduction_records_follow_each_operation():
    for operation in ("reverse", "sort", "add"):
        source = make_source("transduction", seed=4, size=40, max_len=12, symbols=5, operation=operation)
        assert source.model_task == "seq2seq" and source.vocab_size == 8 + (operation == "add")
        lengths = set()
        for i in range(40):
            r = source[i]
            assert set(r) == {"tokens", "mask", "target", "target_mask"}
            assert all(v.shape == (12,) for v in r.values())
            n, m = int(r["mask"].sum()), int(r["target_mask"].sum())
            assert r["mask"][:n].all() and not r["mask"][n:].any() and (r["tokens"][n:] == 0).all()
            assert r["target_mask"][:m].all() and not r["target_mask"][m:].any() and (r["target"][m:] == 0).all()
            target = r["target"][:m]
            assert target[0] == BOS == 1 and target[-1] == EOS == 2 and (target[1:-1] >= 3).all()
            x, y = _symbols(r["tokens"][:n]), _symbols(target[1:-1])
            if operation == "add":  # a + b in base 5, read as Python reads numbers
                plus = x.index(5)
                a, b = ("".join(map(str, d)) for d in (x[:plus], x[plus + 1 :]))
                assert all(len(d) == 1 or d[0] != "0" for d in (a, b))
                assert int("".join(map(str, y)), 5) == int(a, 5) + int(b, 5) and (len(y) == 1 or y[0] != 0)
            else:
                assert y == (x[::-1] if operation == "reverse" else sorted(x))
            lengths.add(n)
            np.testing.assert_array_equal(source[i]["tokens"], r["tokens"])  # a function of (seed, index)
        assert len(lengths) > 3  # sources of varying lengths
    other = make_source("transduction", seed=5, size=4, max_len=12)
    assert any((other[i]["tokens"] != make_source("transduction", seed=4, size=4, max_len=12)[i]["tokens"]).any()
               for i in range(4))  # fmt: skip


@pytest.mark.parametrize(
    "settings,match",
    [
        (dict(operation="copy"), "operation must be one of"),
        (dict(max_symbols=15, max_len=16), "a source of 15 and a target of 17 tokens"),
        (dict(operation="add", max_symbols=8, max_len=16), "a source of 17"),
        (dict(symbols=1), "symbols >= 2"),
    ],
)
def test_transduction_refuses_what_does_not_fit(settings, match):
    with pytest.raises(ValueError, match=match):
        make_source("transduction", seed=0, size=1, **settings)


# ----------------------------------------------------------------------------- the loss


class TableModel(eqx.Module):
    """logits[i] = table[target[i]] + 0.1 * (the source's real tokens' sum): tiny logits
    that read both sides, with `EncoderDecoder.apply`'s signature."""

    table: Float[Array, "vocab vocab"]

    def apply(self, source, target, source_mask, target_mask, *, key=None, inference=False):
        del target_mask, key, inference
        return self.table[target] + 0.1 * jnp.sum(source * source_mask), Produced()


def test_teacher_forced_loss_and_metrics_against_numpy():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(6, 6)).astype(np.float32)
    source = rng.integers(3, 6, (3, 5)).astype(np.int32)
    source_mask = np.arange(5) < np.array([[5], [3], [2]])
    target = np.array([[1, 3, 4, 2, 0, 0], [1, 5, 2, 0, 0, 0], [1, 4, 3, 5, 5, 2]], np.int32)
    target_mask = target > 0
    # row 1's target is what the model predicts (teacher-forced argmax): a right sequence
    for j in range(1, 3):
        target[1, j] = np.argmax(table[target[1, j - 1]] + 0.1 * (source[1] * source_mask[1]).sum())
    batch = {"tokens": source, "mask": source_mask, "target": target, "target_mask": target_mask}
    loss, aux = loss_and_metrics(TableModel(jnp.asarray(table)), batch, None, inference=True)

    total = count = correct = 0.0
    rows_right = 0
    for b in range(3):
        offset = 0.1 * float((source[b] * source_mask[b]).sum())
        row_right = True
        for i in range(5):  # row i read target[: i + 1], predicts target[i + 1]
            if not target_mask[b, i + 1]:
                continue
            logits = table[target[b, i]].astype(np.float64) + offset
            total += np.log(np.exp(logits).sum()) - logits[target[b, i + 1]]
            count += 1
            hit = np.argmax(logits) == target[b, i + 1]
            correct, row_right = correct + hit, row_right and hit
        rows_right += row_right
    np.testing.assert_allclose(float(loss), total / count, rtol=1e-5)
    np.testing.assert_allclose([float(x) for x in aux.stats], [total, correct, count], rtol=1e-5)
    assert [float(x) for x in aux.sequences] == [rows_right, 3] and rows_right >= 1


# ----------------------------------------------------------------------------- decoding

CONFIG = dict(
    task="seq2seq", vocab_size=9, num_layers=2, d_model=16, num_heads=2, max_len=10, ffn={"d_ff": 32},
    decoder={"num_layers": 2},
)  # fmt: skip


# the Evolved Transformer (So et al. 2019) as its paper's encoder-decoder: its cells hold their own FFNs
EVOLVED = {k: v for k, v in CONFIG.items() if k != "ffn"} | {
    "num_layers": 1, "decoder": {"num_layers": 1}, "stack": {"kind": "evolved", "wide_heads": 4},
}  # fmt: skip
# per stack: (the seed of the noise `tiny` adds, an end token the noised model writes for both test sources)
NOISE = {"transformer": (5, 8), "evolved": (16, 7)}


@functools.cache
def tiny(transparent: bool, stack: str = "transformer") -> EncoderDecoder:
    """A tiny model whose every parameter is moved by N(0, 1) noise (W off its uniform
    start too): at its initialisation greedy decoding writes one token over and over,
    whatever the source, which would make a weak test."""
    config = EVOLVED if stack == "evolved" else CONFIG
    config = config | {"decoder": config["decoder"] | {"transparent": transparent}}
    model = build_model(config, key=jax.random.key(1))
    assert isinstance(model, EncoderDecoder) and (model.layer_weights is not None) == transparent
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(NOISE[stack][0]), len(leaves))
    leaves = [x + jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), static)


@pytest.mark.parametrize(
    "transparent,stack", [(False, "transformer"), (True, "transformer"), (False, "evolved")]
)  # fmt: skip
def test_greedy_decoding_is_the_parallel_decoders_argmax(transparent, stack):
    """Cached greedy decoding (an Evolved Transformer's: its conv windows, self-attention
    caches and both attend-to-encoder branches' projected keys) writes the parallel
    decoder's argmax."""
    model = tiny(transparent, stack)
    source = jnp.array([[3, 7, 4, 8, 5, 6, 0, 0], [4, 4, 4, 4, 0, 0, 0, 0]])
    mask = source > 0
    steps, eos = 9, NOISE[stack][1]  # 1 + steps = max_len; an end the random model writes

    @eqx.filter_jit
    def run(model, source, mask):
        def one(s, m):
            write = functools.partial(transduce, model, s, m, steps=steps, bos=BOS, eos=eos)
            cached = write()  # through the decoder's caches (`ConditionedDecoder.decode_step`)
            parallel = model(s, cached[:-1], m, inference=True)  # the decoder over what was written
            return cached, parallel

        return jax.vmap(one)(source, mask)

    cached, parallel = (np.asarray(x) for x in run(model, source, mask))
    assert len({tuple(r) for r in cached[:, 1:].tolist()}) == 2  # the two sources give two targets
    written = np.ones(cached.shape, bool)  # BOS .. the first EOS: what transduce wrote
    for row, out in zip(written, cached, strict=True):
        ends = [j for j in range(1, len(out)) if out[j] == eos]
        if ends:
            row[ends[0] + 1 :] = False
    assert (cached[~written] == 0).all()  # after the EOS: padding
    assert not written.all()  # an EOS was written: the test covers the cut
    np.testing.assert_array_equal(np.argmax(parallel, -1)[written[:, 1:]], cached[:, 1:][written[:, 1:]])

    # the teacher-forced sequence accuracy counts a row right exactly when greedy decoding writes it
    targets = cached.copy()
    targets[1, 1] = (targets[1, 1] - 2) % 6 + 3  # row 1: another first token
    batch = {"tokens": source, "mask": mask, "target": targets, "target_mask": written}
    _, aux = eqx.filter_jit(lambda m, b: loss_and_metrics(m, b, None, inference=True))(model, batch)
    assert [float(x) for x in aux.sequences] == [1.0, 2.0]


def test_an_evolved_transformer_trains_on_the_transduction_task_through_its_config():
    """`stack: evolved`, task seq2seq (the paper's encoder-decoder), dropout on: AdamW steps
    of the training loop's step on a transduction batch lower the teacher-forced loss."""
    import optax

    from jxformers import ModelConfig
    from jxformers.data import make_loader
    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    config = ModelConfig(**EVOLVED | {"dropout": 0.1})
    source = make_source("transduction", seed=0, size=8, max_len=10, operation="reverse", symbols=6)
    assert source.vocab_size == config.vocab_size
    batch = next(iter(make_loader(source, batch_size=8, seed=0, shuffle=False)))
    params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))
    optimizer = optax.adamw(1e-2)
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    step = make_train_step(static, optimizer, grad_accum=1)
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        assert bool(metrics["finite"])
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------- the command line

EXPERIMENT = {
    "name": "tiny_seq2seq",
    "data": {"task": "transduction", "train_size": 256, "eval_size": 16,
             "settings": {"operation": "reverse", "max_len": 8, "symbols": 4}},
    "model": {"num_layers": 1, "d_model": 16, "num_heads": 2, "ffn": {"d_ff": 32}, "decoder": {"num_layers": 1}},
    "train": {"steps": 8, "batch_size": 8, "grad_accum": 2, "learning_rate": 0.003, "warmup_steps": 2,
              "eval_every": 4, "eval_batches": 2, "log_every": 1},
    "checkpoint": {"every": 4, "keep": 3, "best_metric": "eval_sequence_accuracy", "async_save": False},
}  # fmt: skip


@pytest.mark.heavy
def test_the_command_line_trains_evaluates_generates_and_resumes_exactly(tmp_path, capsys):
    import yaml
    from test_train import losses

    from jxformers.tools import cli

    config = tmp_path / "tiny_seq2seq.yaml"
    config.write_text(yaml.safe_dump(EXPERIMENT))
    run = str(tmp_path / "run")
    train = ["train", str(config), "--workdir", run, "--no-progress", "--set", "model.decoder.transparent=true"]
    assert cli.main(train) == 0
    straight = losses(run)
    assert len(straight) == 8
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    assert cli.main(train) == 0
    assert losses(run) == straight
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", run]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 8 and 0 <= result["eval_sequence_accuracy"] <= result["eval_accuracy"] <= 1
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result["eval_loss"] == [r for r in logged if "eval_loss" in r][-1]["eval_loss"]
    assert cli.main(["generate", "--workdir", run, "--prompt", "3 4 5 6"]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert len(written) <= 7 and all(0 <= int(t) < 7 for t in written)  # at most max_len - 1 after the BOS


# ----------------------------------------------------------------------------- 8 devices


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_with_the_losses_of_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    import optax
    from jxformers import build_model
    from jxformers.data import make_loader, make_source
    from jxformers.train.sharding import make_mesh, plan_sharding
    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import evaluate, make_eval_step, make_train_step
    from test_seq2seq import CONFIG, EVOLVED

    source = make_source("transduction", seed=0, size=8, max_len=10, operation="sort", symbols=6)
    batch = next(iter(make_loader(source, batch_size=8, seed=0, shuffle=False)))
    # plain and transparent decoders of transformer blocks and of the Evolved Transformer's cells
    configs = [c | {"decoder": c["decoder"] | {"transparent": t}} for c in (CONFIG, EVOLVED) for t in (False, True)]
    for config in configs:
        config = config | {"dropout": 0.1}
        out = {}
        for sharded in (False, True):
            params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))
            optimizer = optax.adamw(3e-3)
            state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
            plan = None
            if sharded:
                plan = plan_sharding(state, static, make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), batch_size=8)
                state = plan.place_state(state)
            step = make_train_step(static, optimizer, grad_accum=2, sharding=plan)
            feed = batch if plan is None else plan.place_batch(batch)
            losses = []
            for _ in range(3):
                state, m = step(state, feed)
                losses.append(float(m["loss"]))
            out[sharded] = losses, evaluate(make_eval_step(static), state, [feed], 1, sequences=True)
        np.testing.assert_allclose(out[True][0], out[False][0], rtol=1e-5)
        for name, value in out[False][1].items():
            np.testing.assert_allclose(out[True][1][name], value, rtol=1e-5, atol=1e-6)
        assert out[True][0][-1] < out[True][0][0]
    """
    )
