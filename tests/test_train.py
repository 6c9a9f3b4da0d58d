"""The training stack: configs and their errors, the optimizer, a tiny end-to-end run,
exact resume after SIGKILL, damaged-checkpoint fallback, SIGTERM, non-finite steps,
and the CLI's train / eval / generate."""

import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from jxformers.nn.config import FlatConfigWarning
from jxformers.tools import cli
from jxformers.train import NonFiniteError, load_experiment, make_optimizer, train
from jxformers.train.experiment import EXPERIMENTS_DIR
from jxformers.train.optim import decay_mask, learning_rate_schedule
from jxformers.train.tensorboard import crc32c, encode_event, read_records

TINY = {
    "name": "tiny",
    "data": {"task": "copy", "train_size": 256, "eval_size": 16, "settings": {"max_len": 16, "symbols": 4}},
    "model": {"attention": "linear", "num_layers": 1, "d_model": 16, "num_heads": 2, "ffn": {"d_ff": 32}},
    "train": {
        "steps": 12,
        "batch_size": 8,
        "learning_rate": 0.003,
        "warmup_steps": 2,
        "eval_every": 6,
        "eval_batches": 2,
        "log_every": 1,
    },
    "checkpoint": {"every": 4, "keep": 2},
}


def write_config(tmp_path, **sections):
    config = {k: (v | sections.get(k, {}) if isinstance(v, dict) else v) for k, v in TINY.items()}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(workdir):
    """step -> loss, the last record for each step (a resumed run repeats some)."""
    out = {}
    for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


# ----------------------------------------------------------------------------- configs


REAL_DATA = {
    "fmnist_classify", "fmnist_generate", "glam", "shakespeare_lm", "shakespeare_moe", "shakespeare_txl",
    "shakespeare_scene", "lra_text", "lra_retrieval", "lra_image",
}  # fmt: skip


def test_every_shipped_experiment_and_preset_validates(tmp_path):
    root = pathlib.Path(__file__).parents[1] / "jxformers" / "experiments"  # package data
    assert EXPERIMENTS_DIR.resolve() == root.resolve()
    names = sorted(p.stem for p in root.glob("*.yaml"))
    assert {"copy", "lra_listops", "lra_pathfinder", "fmnist_classify", "fmnist_generate", "shakespeare_lm"} <= set(
        names
    )
    fixtures = _real_data_fixtures(tmp_path)
    for name in names:
        presets = yaml.safe_load((root / f"{name}.yaml").read_text()).get("presets", {})
        assert {"tiny", "paper"} <= set(presets)
        for preset in presets:
            extra = [f"data.settings.path={fixtures[name]}"] if name in REAL_DATA else []
            experiment = load_experiment(name, [f"preset={preset}", *extra])
            assert experiment.model.vocab_size == experiment.sources()[0].vocab_size
        if name in REAL_DATA:  # without the files: the error says how to get them
            with pytest.raises(ValueError, match="apt install|fetch_shakespeare"):
                load_experiment(name, ["preset=tiny", f"data.settings.path={tmp_path / 'absent'}"])


def _real_data_fixtures(tmp_path):
    import gzip

    import numpy as np

    fm, texts = tmp_path / "fmnist", tmp_path / "texts"
    fm.mkdir()
    texts.mkdir()
    for split in ("train", "t10k"):
        images = np.zeros((3, 28, 28), np.uint8)
        header = b"\0\0\x08\x03" + b"".join(n.to_bytes(4, "big") for n in (3, 28, 28))
        (fm / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(header + images.tobytes()))
        (fm / f"{split}-labels-idx1-ubyte.gz").write_bytes(
            gzip.compress(b"\0\0\x08\x01" + (3).to_bytes(4, "big") + bytes([0, 1, 2]))
        )
    for i in range(8):
        (texts / f"play{i}_gut.txt").write_bytes(b"to be or not to be " * 100)
    streams = tmp_path / "streams"  # 32 rows of segments of 256 bytes: longer texts
    streams.mkdir()
    for i in range(8):
        (streams / f"play{i}_gut.txt").write_bytes(b"to be or not to be " * 1100)
    from jxformers.data.genre import PLAY_GENRE

    scenes = tmp_path / "scenes"  # every Folio play, one scene of two speeches
    scenes.mkdir()
    for play in PLAY_GENRE:
        (scenes / f"{play}_gut.txt").write_text("Scene I. A room.\n\nHam.\nTo be.\n\nOph.\nOr not.\n")
    speeches = tmp_path / "speeches"  # every Folio play, one speech of 9,100 bytes: two of LRA's windows
    speeches.mkdir()
    for play in PLAY_GENRE:
        (speeches / f"{play}_gut.txt").write_text("Ham.\n" + "to be or not " * 700 + "\n")
    return {
        "lra_text": speeches,
        "lra_retrieval": speeches,
        "shakespeare_scene": scenes,
        "fmnist_classify": fm,
        "fmnist_generate": fm,
        "lra_image": fm,
        "shakespeare_lm": texts,
        "shakespeare_moe": texts,
        "glam": streams,  # the paper preset reads 1025-byte records
        "shakespeare_txl": streams,
    }


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["train.stepz=3"], r"train: unknown key\(s\) \['stepz'\]"),
        (["train.steps=ten"], "train.steps must be int"),
        (["train.optimizer=sgd"], "optimizer must be one of"),
        (["preset=huge"], "unknown preset"),
        (["model.attention=flashy"], "unknown attention 'flashy'"),
        (["model.attention=nystrom"], "needs causal attention"),
        (["model.vocab_size=7"], "comes from the data"),
        (["data.settings.lenght=3"], "unknown setting"),
        (["train.batch_size=6", "train.grad_accum=4"], "divisible"),
        (["train.learning_rate=-1"], r"train.learning_rate must be > 0; got -1"),
        (["train.learning_rate=0"], r"train.learning_rate must be > 0; got 0"),
        (["train.learning_rate=nan"], r"train.learning_rate must be > 0; got nan"),
        (["train.weight_decay=-0.1"], r"train.weight_decay must be >= 0; got -0.1"),
        (["train.clip_norm=-1"], r"train.clip_norm must be > 0, or 0 or null"),
        (["train.adam_b2=1"], r"train.adam_b2 must be in \[0, 1\); got 1"),
        (["train.adam_b1=-0.5"], r"train.adam_b1 must be in \[0, 1\); got -0.5"),
        (["train.adam_eps=0"], r"train.adam_eps must be > 0; got 0"),
        (["train.warmup_steps=13"], r"train.warmup_steps=13 exceeds train.steps=12: .* at most 12"),
        (["train.steps=1"], r"train.warmup_steps=2 exceeds train.steps=1"),  # the file's warm-up is set too
        (["colour=red"], "unknown section"),
        (["train.steps"], "key=value"),
    ],
)
def test_config_errors(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        load_experiment(write_config(tmp_path), overrides)


def test_missing_config_lists_the_shipped_ones():
    with pytest.raises(ValueError, match="lra_listops"):
        load_experiment("no_such_experiment")


def test_overrides_and_presets():
    e = load_experiment(
        "copy",
        [
            "preset=tiny",
            "train.steps=7",
            "train.warmup_steps=3",
            "model.embedding.position=rope",
            "train.clip_norm=0.5",
        ],
    )
    assert e.train.steps == 7 and e.model.embedding.position == "rope" and e.train.clip_norm == 0.5
    assert e.model.num_layers == 2 and e.model.ffn.d_ff == 128  # from the preset


def test_flat_overrides_of_earlier_versions_still_work(recwarn):
    e = load_experiment("copy", ["preset=tiny", "model.position=rope", "model.d_ff=96", "model.filters={}"])
    assert e.model.embedding.position == "rope" and e.model.ffn.d_ff == 96
    assert [str(w.message) for w in recwarn if w.category is FlatConfigWarning] == [
        "flat model config keys are deprecated and were converted: position -> embedding.position, d_ff -> "
        "ffn.d_ff, filters -> stack.filters"
    ]


def test_a_component_named_anew_keeps_what_still_applies():
    # Pathfinder's tiny preset sets axial's width; softmax has no such hyper-parameter.
    assert load_experiment("lra_pathfinder", ["preset=tiny"]).model.attention.hyper_parameters == {"width": 16}
    e = load_experiment("lra_pathfinder", ["preset=tiny", "model.attention=softmax"])
    assert (e.model.attention.name, e.model.attention.hyper_parameters) == ("softmax", {})
    same = load_experiment("lra_pathfinder", ["preset=tiny", "model.attention=axial"])
    assert same.model.attention.hyper_parameters == {"width": 16}
    given = load_experiment("lra_pathfinder", ["preset=tiny", "model.attention=local", "model.attention.window=8"])
    assert given.model.attention.hyper_parameters == {"window": 8}
    flat = load_experiment(
        "lra_pathfinder", ["preset=tiny", "model.attention=local", "model.attention_kwargs={window: 8}"]
    )
    assert flat.model.attention == given.model.attention
    # Another dense FFN keeps the width; another stack keeps none of the transformer's settings.
    swiglu = load_experiment("lra_pathfinder", ["preset=tiny", "model.ffn=swiglu"]).model.ffn
    assert (swiglu.kind, swiglu.d_ff) == ("swiglu", 64)
    moe = load_experiment("copy", ["preset=tiny", "model.ffn=moe", "model.ffn.num_experts=2"]).model.ffn
    assert (moe.kind, moe.d_ff, moe.num_experts) == ("moe", 128, 2)


def test_a_2d_attention_whose_width_is_not_the_images_warns():
    with pytest.warns(UserWarning, match=r"axial attention's width 16 is not the images' width 32"):
        load_experiment("lra_pathfinder", ["preset=tiny", "data.settings.image_size=32"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_experiment("lra_pathfinder", ["preset=tiny"])


def test_an_unset_warmup_is_the_default_cut_to_a_short_run(tmp_path):
    # Only a warm-up that is set is refused beyond the run; the default (100) is cut to it.
    from jxformers.train.state import make_experiment_optimizer

    unset = {k: v for k, v in TINY["train"].items() if k != "warmup_steps"}
    (tmp_path / "unset.yaml").write_text(yaml.safe_dump(TINY | {"train": unset}))
    short = load_experiment(tmp_path / "unset.yaml")
    assert short.train.steps == 12 and short.train.warmup_steps is None and short.raw["train"]["warmup_steps"] is None
    _, schedule = make_experiment_optimizer(short)
    assert float(schedule(6)) == pytest.approx(0.003 / 2) and float(schedule(12)) == pytest.approx(0.003)
    _, schedule = make_experiment_optimizer(load_experiment(tmp_path / "unset.yaml", ["train.steps=1000"]))
    assert float(schedule(50)) == pytest.approx(0.003 / 2) and float(schedule(100)) == pytest.approx(0.003)
    assert load_experiment(write_config(tmp_path), ["train.warmup_steps=12"]).train.warmup_steps == 12  # the whole run
    assert load_experiment(write_config(tmp_path), ["train.steps=1", "train.warmup_steps=null"]).train.steps == 1


# ----------------------------------------------------------------------------- optimizer


def test_weight_decay_skips_vectors_and_schedules_warm_up():
    params = {"w": jnp.ones((3, 3)), "b": jnp.ones((3,)), "scale": jnp.ones((3,))}
    assert decay_mask(params) == {"w": True, "b": False, "scale": False}
    opt, _ = make_optimizer(learning_rate=0.0, weight_decay=0.5, clip_norm=None, warmup_steps=0, schedule="constant")
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.update(zero, opt.init(params), params)
    assert float(jnp.abs(updates["b"]).max()) == 0.0  # lr 0: nothing moves, and vectors never decay
    for kind in ("cosine", "inverse_sqrt", "constant"):
        lr = learning_rate_schedule(peak=1.0, warmup_steps=10, total_steps=100, kind=kind)
        assert float(lr(0)) == pytest.approx(0.0) and float(lr(10)) == pytest.approx(1.0, rel=1e-3)
    assert float(
        learning_rate_schedule(peak=1.0, warmup_steps=10, total_steps=100, kind="inverse_sqrt")(40)
    ) == pytest.approx(0.5, rel=1e-3)
    radam, _ = make_optimizer(optimizer="radam", learning_rate=1e-2, weight_decay=0.1)
    assert radam.update(zero, radam.init(params), params)[0]["w"].shape == (3, 3)


def test_the_experiments_adam_decays_reach_the_optimizer(tmp_path):
    # Adam's second step differs with b2 and eps (its first is sign-like whatever b2): two
    # steps of the experiment's optimizer against optax.adamw with the same decays
    from jxformers.train.state import make_experiment_optimizer

    params = {"w": jnp.ones((2, 2))}
    grads = [{"w": jnp.array([[1.0, -2.0], [0.5, 3.0]])}, {"w": jnp.array([[-1.0, 0.1], [2.0, 0.2]])}]

    def two_steps(opt):
        state, out = opt.init(params), []
        for g in grads:
            update, state = opt.update(g, state, params)
            out.append(update["w"])
        return out[-1]

    settings = ["preset=tiny", "train.clip_norm=0", "train.weight_decay=0", "train.schedule=constant"]
    settings += [
        "train.optimizer=adamw",
        "train.warmup_steps=0",
        "train.adam_b1=0.5",
        "train.adam_b2=0.98",
        "train.adam_eps=0.1",
    ]
    experiment = load_experiment("copy", settings)
    ours, _ = make_experiment_optimizer(experiment)
    lr = experiment.train.learning_rate
    want = two_steps(optax.adamw(lr, b1=0.5, b2=0.98, eps=0.1, weight_decay=0.0))
    np.testing.assert_allclose(two_steps(ours), want, rtol=1e-6)
    for other in ({"b2": 0.999, "eps": 0.1}, {"b2": 0.98, "eps": 1e-8}):  # each setting matters here
        assert not np.allclose(want, two_steps(optax.adamw(lr, b1=0.5, weight_decay=0.0, **other)), rtol=1e-3)


# ----------------------------------------------------------------------------- training


def test_tiny_training_run_logs_evaluates_and_checkpoints(tmp_path):
    experiment = load_experiment(write_config(tmp_path), ["train.grad_accum=2"])
    summary = train(experiment, tmp_path / "run", progress=False)
    assert summary["step"] == 12 and 0.0 <= summary["eval_accuracy"] <= 1.0
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(1, 13))
    assert [r["step"] for r in records if "eval_loss" in r] == [6, 12]
    first = next(r for r in records if "loss" in r)
    assert first["tokens_per_s"] > 0 and first["step_temp_bytes"] > 0
    assert [r["step"] for r in records if "compile_seconds" in r] == [1]  # the first step's compile, once
    first = next(r for r in records if "compile_seconds" in r)
    assert first["compile_seconds"] > 0
    # what the summary says of the train step is logged too, for a finished run read back
    assert first["parameters"] == summary["parameters"] and first["train_step_flops"] == summary["train_step_flops"]
    assert summary["compile_seconds"] > 0
    assert not any("resumed_from_step" in r for r in records)  # a fresh run
    kept = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-2:] == [8, 12]
    assert (tmp_path / "run" / "config.yaml").exists()
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and len(read_records(events[0])) >= 1 + 12 + 2  # version, steps, evals
    # Training again on a finished work directory resumes at the end, does nothing and
    # says so, with the last evaluation (not a summary of nulls).
    again = train(experiment, tmp_path / "run", progress=False)
    assert again["step"] == 12 and again["complete"] is True and "already complete" in again["note"]
    assert again["eval_accuracy"] == summary["eval_accuracy"] and None not in again.values()


def test_eval_agrees_with_the_training_log_and_takes_eval_batches(tmp_path):
    from jxformers.train import evaluate_checkpoint

    # 32 eval examples in batches of 8: training evaluates its eval_batches = 2 of the 4.
    config = write_config(tmp_path, data={"eval_size": 32})
    experiment = load_experiment(config)
    summary = train(experiment, tmp_path / "run", progress=False)
    got = evaluate_checkpoint(experiment, tmp_path / "run")
    assert got["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)
    assert got["eval_accuracy"] == pytest.approx(summary["eval_accuracy"], abs=1e-6)
    one = evaluate_checkpoint(load_experiment(config, ["train.eval_batches=1"]), tmp_path / "run")
    whole = evaluate_checkpoint(experiment, tmp_path / "run", batches="all")
    assert len({one["eval_loss"], got["eval_loss"], whole["eval_loss"]}) == 3  # 1, 2 and 4 batches
    assert evaluate_checkpoint(experiment, tmp_path / "run", batches=4)["eval_loss"] == whole["eval_loss"]
    with pytest.raises(ValueError, match="batches must be None"):
        evaluate_checkpoint(experiment, tmp_path / "run", batches=0)


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, monkeypatch):
    experiment = load_experiment(write_config(tmp_path), ["checkpoint.async_save=false"])
    train(experiment, tmp_path / "run", progress=False)
    latest = tmp_path / "run" / "checkpoints" / "12" / "state"
    for f in latest.rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    more = load_experiment(write_config(tmp_path), ["checkpoint.async_save=false", "train.steps=14"])
    # Where it cannot be moved aside (issue 37 item 12: a PermissionError traceback after
    # the fallback was found), one error says what to do, and nothing is changed.
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "move", lambda *a: (_ for _ in ()).throw(PermissionError(13, "Permission denied", a[0])))
        with pytest.raises(ValueError, match=r"step 12 could not be restored .* nor moved aside .*Permission denied"):
            train(more, tmp_path / "run", progress=False)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["12", "8"]
    with pytest.warns(UserWarning, match="checkpoint at step 12 could not be restored.*resuming from step 8"):
        summary = train(more, tmp_path / "run", progress=False)
    assert summary["step"] == 14
    assert [
        json.loads(x)["step"]
        for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(x)
    ][-6:] == [9, 10, 11, 12, 13, 14]  # resumed from step 8
    # the log marks the resume, so the steps 9-12 logged twice can be told apart
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["resumed_from_step"] for r in records if "resumed_from_step" in r] == [8]


def test_a_changed_config_does_not_touch_the_checkpoints(tmp_path):
    train(load_experiment(write_config(tmp_path), ["train.steps=4"]), tmp_path / "run", progress=False)
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="config changed"):
        train(
            load_experiment(write_config(tmp_path), ["train.steps=8", "model.d_model=32"]),
            tmp_path / "run",
            progress=False,
        )
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_non_finite_steps_stop_or_are_skipped(tmp_path):
    config = write_config(tmp_path)
    with pytest.raises(NonFiniteError, match="at step 2"):
        train(
            load_experiment(
                config,
                ["train.learning_rate=1e38", "train.clip_norm=null", "train.warmup_steps=0", "train.schedule=constant"],
            ),
            tmp_path / "stop",
            progress=False,
        )
    summary = train(
        load_experiment(
            config,
            [
                "train.learning_rate=1e38",
                "train.clip_norm=null",
                "train.warmup_steps=0",
                "train.schedule=constant",
                "train.on_nonfinite=skip",
                "train.steps=4",
            ],
        ),
        tmp_path / "skip",
        progress=False,
    )
    assert summary["step"] == 4 and summary["skipped_steps"] == 3  # said in the summary
    records = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [2, 3, 4]
    # Skipping has a limit: a run that never recovers stops instead of ending "successfully".
    endless = ["train.learning_rate=1e38", "train.clip_norm=null", "train.warmup_steps=0", "train.schedule=constant"]
    endless += ["train.on_nonfinite=skip", "train.steps=4", "train.max_consecutive_skips=2"]
    with pytest.raises(
        NonFiniteError, match=r"2 non-finite steps in a row \(steps 2-3, train.max_consecutive_skips = 2\)"
    ):
        train(load_experiment(config, endless), tmp_path / "endless", progress=False)


def test_performer_features_are_redrawn_and_a_resumed_run_redraws_the_same_way(tmp_path):
    from jxformers.train import restore_train_state
    from jxformers.train.state import init_train_state

    config = write_config(
        tmp_path,
        model={"attention": "performer", "attention_kwargs": {"num_features": 8}},
        train={"steps": 8, "redraw_every": 3, "eval_every": 8},
    )
    experiment = load_experiment(config, ["checkpoint.async_save=false"])
    run = tmp_path / "run"
    train(experiment, run, progress=False)
    straight, straight_drawn = losses(run), restore_train_state(experiment, run)[0].drawn
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    train(experiment, run, progress=False)  # steps 5-8 again, redrawing at step 6
    assert losses(run) == straight  # exact, step by step
    resumed_drawn = restore_train_state(experiment, run)[0].drawn
    initial = init_train_state(experiment)[0].drawn
    for a, b, first in zip(*(jax.tree.leaves(x) for x in (straight_drawn, resumed_drawn, initial)), strict=True):
        assert bool(jnp.all(a == b)) and not bool(jnp.allclose(a, first))  # redrawn, the same way


def _run_cli(config, workdir, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jxformers.tools.cli",
            "train",
            str(config),
            "--workdir",
            str(workdir),
            "--no-progress",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def _wait_for_checkpoint(workdir, step, proc, timeout=240):
    target = pathlib.Path(workdir) / "checkpoints" / str(step)
    start = time.time()
    while not target.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() - start < timeout, "no checkpoint appeared"
        time.sleep(0.05)


@pytest.mark.heavy
def test_killed_run_resumes_with_the_same_losses_bit_for_bit(tmp_path):
    config = write_config(tmp_path, train={"steps": 16})
    straight = _run_cli(config, tmp_path / "straight")
    assert straight.wait(timeout=600) == 0, straight.stderr.read().decode()[-2000:]
    killed = _run_cli(config, tmp_path / "killed")
    _wait_for_checkpoint(tmp_path / "killed", 4, killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = _run_cli(config, tmp_path / "killed")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read().decode()[-2000:]
    expected, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(got) == list(range(1, 17))
    assert got == expected  # exact float equality, step by step


def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    config = write_config(tmp_path, train={"steps": 4000}, checkpoint={"every": 1000})
    proc = _run_cli(config, tmp_path / "run")
    metrics = tmp_path / "run" / "metrics.jsonl"
    start = time.time()
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert proc.poll() is None and time.time() - start < 240
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    stopped = records[-1]
    assert stopped["interrupted"] == "SIGTERM"
    assert (tmp_path / "run" / "checkpoints" / str(stopped["step"])).exists()


def test_cli_train_eval_generate(tmp_path, capsys):
    config = write_config(tmp_path)
    assert (
        cli.main(["train", str(config), "--workdir", str(tmp_path / "run"), "--no-progress", "--set", "train.steps=4"])
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    assert cli.main(["eval", str(config), "--workdir", str(tmp_path / "run"), "--set", "train.steps=4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 4 and 0 <= result["eval_accuracy"] <= 1
    assert result["eval_bits_per_token"] == pytest.approx(result["eval_loss"] / 0.6931471805599453)
    assert (
        cli.main(
            [
                "generate",
                str(config),
                "--workdir",
                str(tmp_path / "run"),
                "--prompt",
                "1 3 4 2",
                "--steps",
                "5",
                "--count",
                "3",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    rows = captured.out.strip().splitlines()
    assert len(rows) == 3 and all(len(r.split()) == 9 and r.split()[:4] == ["1", "3", "4", "2"] for r in rows)
    assert "sequences/s" in captured.err
    # --recompute reruns the whole forward at every step: greedy, the same tokens as the cache.
    assert (
        cli.main(
            [
                "generate",
                str(config),
                "--workdir",
                str(tmp_path / "run"),
                "--prompt",
                "1 3 4 2",
                "--steps",
                "5",
                "--count",
                "3",
                "--recompute",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip().splitlines() == rows
    with pytest.raises(SystemExit):
        cli.main(["eval", str(config), "--workdir", str(tmp_path / "empty")])
    with pytest.raises(SystemExit):
        cli.main(["train", str(config), "--workdir", str(tmp_path / "x"), "--set", "train.steps=zero"])
    shutil.rmtree(tmp_path / "run")


def test_plot_draws_several_runs(tmp_path):
    from jxformers.tools.plot import read_metrics

    for i, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": s, "loss": 2.0 - 0.1 * s - i}) for s in range(1, 6)]
        lines.append(json.dumps({"step": 5, "eval_accuracy": 0.5 + 0.1 * i}))
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert read_metrics(tmp_path / "a")["loss"][5] == pytest.approx(1.5)
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(SystemExit):
        cli.main(["plot", str(tmp_path / "missing"), "--out", str(out)])


@pytest.mark.heavy
def test_demo_trains_three_models_from_two_seeds_and_prints_the_table(tmp_path, capsys):
    args = [
        "--workdir",
        str(tmp_path),
        "--no-progress",
        "--seeds",
        "2",
        "--set",
        "train.steps=2",
        "--set",
        "train.warmup_steps=1",  # the tiny preset's 30 would outlast the run
        "--set",
        "train.eval_batches=1",
        "--set",
        "data.eval_size=16",
        "--set",
        "train.batch_size=8",
        "--set",
        "data.train_size=16",
    ]
    assert cli.main(["demo", *args]) == 0
    out = capsys.readouterr().out
    for name in ("softmax", "linear", "fourier_transformer"):
        assert f"| {name} |" in out
        assert (tmp_path / name / "metrics.jsonl").exists() and (tmp_path / f"{name}_seed1" / "metrics.jsonl").exists()
    assert "| baseline: majority class |" in out and "| baseline: root operator |" in out
    assert "eval accuracy (mean ± sd, 2 seeds)" in out and "within noise" in out
    assert (tmp_path / "demo.png").exists()


def test_demo_reports_a_seed_that_stopped_on_non_finite_values_and_goes_on(tmp_path, monkeypatch, capsys):
    """A variant whose training diverged ended `jxformers demo` with a NonFiniteError
    traceback, losing the comparison of every model; the seed is now reported in one line,
    shown as `stopped` in its row, and left out of the mean."""
    import argparse

    from jxformers.tools import demo
    from jxformers.train import NonFiniteError

    def fake_train(experiment, workdir, progress):
        if "diverges" in str(workdir) and experiment.train.seed == 1:
            raise NonFiniteError("non-finite loss or gradients at step 33 (loss 2.3); the update was not applied")
        return {"eval_accuracy": 0.25 + 0.1 * experiment.train.seed, "eval_loss": 1.5}

    monkeypatch.setattr(demo, "train", fake_train)
    monkeypatch.setattr(demo, "_step_stats", lambda workdir: {})
    monkeypatch.setattr(demo, "MODELS", {"softmax": []})
    variants = ["diverges:train.learning_rate=1e6"]
    args = argparse.Namespace(attentions=[], variants=variants, seeds=2, overrides=[], no_progress=True)
    results = demo._train_all(tmp_path, args)
    err = capsys.readouterr().err
    assert "jxformers demo: diverges, seed 1 stopped: non-finite loss or gradients at step 33" in err, err
    row = demo._row("diverges", *results["diverges"])
    assert row.startswith("| diverges | 0.250 ± 0.000 | 0.250 stopped | 1.500 |"), row
    assert demo._row("softmax", *results["softmax"]).startswith("| softmax | 0.300 ± 0.071 | 0.250 0.350 |")


def test_tensorboard_records_are_framed_and_encoded_like_tensorflows():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    event = encode_event(wall_time=1.5, step=3, scalars={"loss": 0.25})
    # wall_time (field 1, double), step (field 2, varint), summary (field 5) > value > tag, simple_value
    assert event.startswith(b"\x09" + struct.pack("<d", 1.5))
    assert b"\x10\x03" in event and b"\x0a\x04loss\x15\x00\x00\x80\x3e" in event


def test_checkpointer_keeps_the_latest_and_the_best(tmp_path):
    from jxformers.data import make_loader, make_source
    from jxformers.train.checkpoint import Checkpointer

    iterator = iter(make_loader(make_source("copy", seed=0, size=16, max_len=8), batch_size=2, seed=0))
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2, best_metric="eval_accuracy", best_mode="max", async_save=False)
    for step, acc in enumerate([0.1, 0.9, 0.2, 0.3, 0.4], start=1):
        next(iterator)
        ckpt.save(step, {"x": jnp.full((2,), float(step))}, iterator, {"eval_accuracy": acc})
    ckpt.wait()
    assert ckpt.steps() == [2, 4, 5]  # the best (step 2) and the latest two
    fresh = iter(make_loader(make_source("copy", seed=0, size=16, max_len=8), batch_size=2, seed=0))
    step, state = ckpt.restore_latest({"x": jnp.zeros((2,))}, fresh)
    assert step == 5 and float(state["x"][0]) == 5.0
    expected = iter(make_loader(make_source("copy", seed=0, size=16, max_len=8), batch_size=2, seed=0))
    for _ in range(5):
        next(expected)
    assert (next(fresh)["tokens"] == next(expected)["tokens"]).all()  # the iterator resumed too
    ckpt.close()


# ----------------------------------------------------------------------------- typed sections


def test_config_sections_are_typed_frozen_dataclasses_with_defaults():
    import dataclasses

    from jxformers.train import CheckpointConfig, DataConfig, TrainConfig
    from jxformers.validate import check_fields, from_mapping

    t = TrainConfig()
    assert (t.steps, t.batch_size, t.optimizer, t.learning_rate, t.clip_norm, t.redraw_every) == (
        1000,
        32,
        "adamw",
        1e-3,
        1.0,
        1000,
    )  # Performer's features are redrawn by default
    assert DataConfig().settings == {} and CheckpointConfig().async_save is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.steps = 3
    assert TrainConfig(learning_rate="1e-3").learning_rate == 0.001  # YAML 1.1 reads 1e-3 as a string
    assert TrainConfig(weight_decay=0).weight_decay == 0.0 and TrainConfig(clip_norm=None).clip_norm is None
    for kwargs, match in [
        ({"steps": "ten"}, "train.steps must be int; got 'ten'"),
        ({"steps": True}, "train.steps must be int; got True"),
        ({"clip_norm": "big"}, "train.clip_norm must be float or None"),
        ({"schedule": "linear"}, r"train.schedule must be one of \['cosine'"),
        ({"steps": 0}, "train.steps must be >= 1; got 0"),
        ({"batch_size": 6, "grad_accum": 4}, "divisible"),
    ]:
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kwargs)
    with pytest.raises(ValueError, match=r"checkpoint.best_mode must be one of \['max', 'min'\]"):
        CheckpointConfig(best_mode="up")
    with pytest.raises(ValueError, match=r"data.settings must be dict"):
        DataConfig(settings=3)
    with pytest.raises(ValueError, match=r"checkpoint: unknown key\(s\) \['evry'\]; known: \['async_save'"):
        from_mapping(CheckpointConfig, {"evry": 3}, "checkpoint")

    @dataclasses.dataclass(frozen=True)
    class Model:  # the shape of ModelConfig's use: another prefix, its own choices
        num_layers: int = 2
        ffn: str = "gelu"

        def __post_init__(self):
            check_fields(self, "config ", {"ffn": ("gelu", "relu")})

    with pytest.raises(ValueError, match="config num_layers must be int; got '2'"):
        Model(num_layers="2")
    with pytest.raises(ValueError, match=r"config ffn must be one of \['gelu', 'relu'\]"):
        Model(ffn="tanh")

    e = load_experiment("copy", ["preset=tiny", "train.steps=7", "train.warmup_steps=null"])  # tiny's warm-up: 20
    assert e.train.steps == 7
    assert e.raw["train"] == dataclasses.asdict(e.train)


# ----------------------------------------------------------------------------- state and checkpoints


def _checkpointer(path):
    from jxformers.data import make_loader, make_source
    from jxformers.train.checkpoint import Checkpointer

    iterator = iter(make_loader(make_source("copy", seed=0, size=16, max_len=8), batch_size=2, seed=0))
    return Checkpointer(path, keep=2, best_metric="eval_accuracy", best_mode="max", async_save=False), iterator


def test_checkpoints_restore_each_leaf_by_its_path_not_its_position(tmp_path):
    import equinox as eqx

    from jxformers.train.state import TrainState, load_state_dict, state_dict

    class QK(eqx.Module):
        q: jax.Array
        k: jax.Array

    class KQ(eqx.Module):  # the same fields, declared in the other order
        k: jax.Array
        q: jax.Array

    def state(params):
        return TrainState(
            params=params,
            drawn={"key": jax.random.key(3)},
            opt_state=(jnp.zeros(()),),
            step=jnp.asarray(5, jnp.int32),
            rng=jax.random.key(1),
        )

    saved = state(QK(q=jnp.full((2, 2), 1.0), k=jnp.full((2, 2), 2.0)))
    ckpt, iterator = _checkpointer(tmp_path / "ckpt")
    ckpt.save(5, state_dict(saved), iterator)
    ckpt.wait()
    template = state(KQ(k=jnp.zeros((2, 2)), q=jnp.zeros((2, 2))))
    assert [float(x[0, 0]) for x in jax.tree.leaves(template.params)] == [0.0, 0.0]
    step, values = ckpt.restore_latest(state_dict(template), iterator)
    restored = load_state_dict(values, template)
    ckpt.close()
    assert step == 5 and int(restored.step) == 5
    assert float(restored.params.q[0, 0]) == 1.0 and float(restored.params.k[0, 0]) == 2.0
    assert (jax.random.key_data(restored.drawn["key"]) == jax.random.key_data(jax.random.key(3))).all()
    # A dict whose insertion order differs restores by key too.
    flat = state_dict(saved)
    again = load_state_dict(dict(reversed(list(flat.items()))), saved)
    assert float(again.params.q[0, 0]) == 1.0 and float(again.params.k[0, 0]) == 2.0


def test_a_renamed_or_reshaped_leaf_is_refused_naming_its_path(tmp_path):
    ckpt, iterator = _checkpointer(tmp_path / "ckpt")
    ckpt.save(
        8, {"['params'].blocks[0].attention.q_proj.weight": jnp.zeros((16, 16)), "['step']": jnp.zeros(())}, iterator
    )
    ckpt.wait()
    with pytest.raises(
        ValueError,
        match=r"checkpoint at step 8: parameter \['params'\]\.blocks\[0\]\.attention\."
        r"q_proj\.weight has shape \(16, 16\); the model expects \(32, 16\)",
    ):
        ckpt.restore_latest(
            {"['params'].blocks[0].attention.q_proj.weight": jnp.zeros((32, 16)), "['step']": jnp.zeros(())}, iterator
        )
    with pytest.raises(
        ValueError,
        match=r"parameter \['params'\]\.blocks\[0\]\.attention\.query\.weight is "
        r"missing.*q_proj\.weight is unexpected.*config changed",
    ):
        ckpt.restore_latest(
            {"['params'].blocks[0].attention.query.weight": jnp.zeros((16, 16)), "['step']": jnp.zeros(())}, iterator
        )
    assert ckpt.steps() == [8]  # nothing was set aside
    ckpt.close()


def test_old_list_layout_checkpoints_are_refused_with_an_explanation(tmp_path):
    import numpy as np

    experiment = load_experiment(write_config(tmp_path), ["train.steps=4"])
    ckpt, iterator = _checkpointer(tmp_path / "run" / "checkpoints")
    ckpt.save(
        4,
        {
            "params": [jnp.zeros((7, 16)), jnp.zeros((16,))],
            "frozen": [],
            "opt_state": [jnp.zeros(())],
            "step": np.asarray(4, np.int64),
            "key": np.asarray(jax.random.key_data(jax.random.key(0))),
        },
        iterator,
    )
    ckpt.close()
    from jxformers.train import restore_model

    with pytest.raises(
        ValueError,
        match="written by jxformers before checkpoints stored arrays by tree path.*Retrain.*check out the older",
    ):
        restore_model(experiment, tmp_path / "run")
    with pytest.raises(ValueError, match="before checkpoints stored arrays by tree path"):
        train(experiment, tmp_path / "run", progress=False)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]


def test_one_constructor_builds_the_state_for_train_restore_and_eval(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    from jxformers.train import evaluate_checkpoint, loop, restore_model
    from jxformers.train.state import init_train_state, split_model

    calls = []
    monkeypatch.setattr(loop, "init_train_state", lambda e: calls.append(e) or init_train_state(e))
    experiment = load_experiment(write_config(tmp_path), ["train.steps=4", "checkpoint.async_save=false"])
    train(experiment, tmp_path / "run", progress=False)
    model, step = restore_model(experiment, tmp_path / "run")
    assert step == 4 and evaluate_checkpoint(experiment, tmp_path / "run", batches=1)["step"] == 4
    assert len(calls) == 3  # train, restore_model, evaluate_checkpoint
    saved = ocp.StandardCheckpointer().restore(tmp_path / "run" / "checkpoints" / "4" / "state")
    params, _, _ = split_model(model)
    initial, _, _, _ = init_train_state(experiment)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert leaves and all((x == saved["['params']" + jax.tree_util.keystr(p)]).all() for p, x in leaves)
    assert any((x != y).any() for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(initial.params), strict=True))
    wider = load_experiment(write_config(tmp_path), ["train.steps=4", "model.d_model=32"])
    with pytest.raises(
        ValueError,
        match=r"parameter \['params'\]\.\S+ has shape \(.*16\); the model expects "
        r"\(.*32\).*config changed",
    ):
        restore_model(wider, tmp_path / "run")


def test_an_async_save_in_flight_too_long_is_waited_for(tmp_path, monkeypatch):
    """What a SIGKILL can lose is bounded: a save still being written max_steps_in_flight
    steps after it started is waited for (logged as checkpoint_wait_ms)."""
    from jxformers.train.checkpoint import Checkpointer

    monkeypatch.setattr(Checkpointer, "saving", lambda self: True)  # as if every save were slow
    experiment = load_experiment(write_config(tmp_path), ["checkpoint.async_save=true"])
    assert experiment.checkpoint.save_lag == 1  # every 4 // 4
    train(
        load_experiment(write_config(tmp_path), ["checkpoint.max_steps_in_flight=2"]), tmp_path / "run", progress=False
    )
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "checkpoint_wait_ms" in r] == [6, 10]  # saves at 4, 8 (12: the end)
    with pytest.raises(ValueError, match="max_steps_in_flight"):
        load_experiment(write_config(tmp_path), ["checkpoint.max_steps_in_flight=0"])
