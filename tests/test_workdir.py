"""Everyday use of a work directory (issue 10): eval / generate read the run's saved
config, reruns are checked against it, one train per directory, plain errors for
missing or odd directories and YAML, honest messages and metrics."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml
from test_train import TINY, write_config

from jxformers.tools import cli
from jxformers.train import load_experiment, train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny copy run (12 steps, checkpoints at 8 and 12, evaluations at 6 and
    12) trained with a --set that the shipped config does not have (one layer more)."""
    root = tmp_path_factory.mktemp("trained")
    config = write_config(root)
    assert (
        cli.main(
            [
                "train",
                str(config),
                "--workdir",
                str(root / "run"),
                "--no-progress",
                "--set",
                "model.num_layers=2",
                "--set",
                "checkpoint.async_save=false",
            ]
        )
        == 0
    )
    return config, root / "run"


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _last_json(out: str):
    return json.loads(out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- item 1


def test_eval_and_generate_read_the_runs_config(trained, capsys):
    config, run = trained
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(run)]) == 0  # no config argument: the run's config.yaml
    assert _last_json(capsys.readouterr().out)["step"] == 12
    # The README's case: the config named again without the training --set builds another
    # model; the run's config is used and the difference is said.
    assert cli.main(["eval", str(config), "--workdir", str(run), "--set", "train.eval_batches=1"]) == 0
    captured = capsys.readouterr()
    assert _last_json(captured.out)["step"] == 12
    assert "model.num_layers: 2 in the run, 1 now" in captured.err and "using the run's config" in captured.err
    assert cli.main(["generate", "--workdir", str(run), "--prompt", "1 3 4 2", "--steps", "2"]) == 0
    assert capsys.readouterr().out.split()[:4] == ["1", "3", "4", "2"]


def test_eval_refuses_an_override_that_changes_the_model(trained, capsys):
    _, run = trained
    with pytest.raises(SystemExit):
        cli.main(["eval", "--workdir", str(run), "--set", "model.d_model=32"])
    err = capsys.readouterr().err
    assert "would change the model" in err and "model.d_model: 16 in the run, 32 now" in err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--workdir", str(run), "--set", "preset=paper"])
    assert "trained with preset None" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", "copy", "--workdir", str(run)])
    assert "holds a run of 'tiny', not 'copy'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- item 2


def test_a_rerun_that_changes_the_model_is_refused_before_config_yaml_changes(trained, tmp_path, capsys):
    config, run = trained
    run = _copy(run, tmp_path)
    before = (run / "config.yaml").read_text()
    assert (
        cli.main(
            [
                "train",
                str(config),
                "--workdir",
                str(run),
                "--no-progress",
                "--set",
                "model.num_layers=2",
                "--set",
                "model.max_len=8",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "config changed" in err and "model.max_len: 16 in the run, 8 now" in err
    assert (run / "config.yaml").read_text() == before
    # A resumable change (more steps) is taken, and the log says so.
    assert (
        cli.main(
            [
                "train",
                str(config),
                "--workdir",
                str(run),
                "--no-progress",
                "--set",
                "model.num_layers=2",
                "--set",
                "checkpoint.async_save=false",
                "--set",
                "train.steps=13",
            ]
        )
        == 0
    )
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 12, "config_changed": {"train.steps": [12, 13]}} in records
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 13


def test_a_run_saved_before_a_setting_existed_resumes_with_its_default(trained, tmp_path, capsys):
    config, run = trained
    run = _copy(run, tmp_path)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    del saved["model"]["stack"]["token_learner"], saved["train"]["redraw_every"]  # as an older version wrote it
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    assert (
        cli.main(
            [
                "train",
                str(config),
                "--workdir",
                str(run),
                "--no-progress",
                "--set",
                "model.num_layers=2",
                "--set",
                "checkpoint.async_save=false",
                "--set",
                "train.steps=13",
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "train",
                str(config),
                "--workdir",
                str(run),
                "--no-progress",
                "--set",
                "model.num_layers=2",
                "--set",
                "model.architecture=luna",
                "--set",
                "model.position=none",
                "--set",
                "model.attention=softmax",
            ]
        )
        == 1
    )
    assert "model.stack.kind: 'transformer' in the run, 'luna' now" in capsys.readouterr().err


def test_train_without_a_config_goes_on_with_the_runs_own(trained, tmp_path, capsys):
    _, run = trained
    run = _copy(run, tmp_path)
    assert cli.main(["train", "--workdir", str(run), "--no-progress", "--set", "train.steps=13"]) == 0
    assert _last_json(capsys.readouterr().out)["step"] == 13
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["num_layers"] == 2  # the run's model
    for args, message in [
        (["--set", "model.d_model=32"], "would change the model"),
        (["--workdir", str(tmp_path)], "holds no config.yaml to resume: name the experiment"),
    ]:
        with pytest.raises(SystemExit):
            cli.main(["train", "--workdir", str(run), "--no-progress", *args])
        assert message in capsys.readouterr().err


def test_a_run_saved_with_a_warmup_longer_than_the_run_still_evaluates(trained, tmp_path, capsys):
    # Before a warm-up beyond the run was refused (issue 36 item 5), the default 100 was saved for
    # shorter runs too: such a run's eval and generate read it as the default (cut to the run).
    _, run = trained
    run = _copy(run, tmp_path)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["train"]["warmup_steps"] = 100  # as an older version wrote it, for this 12-step run
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(run)]) == 0
    assert _last_json(capsys.readouterr().out)["step"] == 12
    with pytest.raises(SystemExit):  # set anew on the command line, it is refused as ever
        cli.main(["eval", "--workdir", str(run), "--set", "train.warmup_steps=13"])
    assert "train.warmup_steps=13 exceeds train.steps=12" in capsys.readouterr().err


# ----------------------------------------------------------------------------- item 4


def test_tokens_per_second_counts_real_tokens_not_padding(trained):
    _, run = trained
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_ms" in r]
    padded = TINY["train"]["batch_size"] * TINY["data"]["settings"]["max_len"]
    real = [r["tokens_per_s"] * r["step_ms"] / 1e3 for r in steps]
    assert all(r["padded_tokens_per_s"] * r["step_ms"] / 1e3 == pytest.approx(padded) for r in steps)
    assert all(x == pytest.approx(round(x)) and x <= padded for x in real)
    assert min(real) < padded  # copy sequences are padded: the real count is smaller


# ----------------------------------------------------------------------------- item 6


def test_generate_refuses_ids_outside_the_vocabulary(trained, capsys):
    _, run = trained
    with pytest.raises(SystemExit):
        cli.main(["generate", "--workdir", str(run), "--prompt", "1 5 99 2"])
    assert "token id 99 is outside the vocabulary of tiny (ids 0 to 6)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--workdir", str(run), "--prompt", " "])
    assert "--prompt is empty" in capsys.readouterr().err


def test_a_byte_level_text_model_takes_and_prints_text(tmp_path, capsys):
    texts = tmp_path / "texts"
    texts.mkdir()
    for name in ("a", "b"):
        (texts / f"{name}_gut.txt").write_text("ROMEO: But soft, what light through yonder window breaks? " * 4)
    experiment = load_experiment("shakespeare_lm", ["preset=tiny", f"data.settings.path={texts}"])
    parser = cli._experiment_parser("jxformers generate", "", run_config=True)
    assert cli._prompt_ids(parser, experiment, "ROMEO:") == list(b"ROMEO:")
    cli._print_generated(experiment, [list("ROMEO: hé".encode())])
    assert capsys.readouterr().out == "ROMEO: hé\n"


# ----------------------------------------------------------------------------- item 7


def test_a_second_train_on_a_locked_workdir_says_who_holds_it(tmp_path, capsys):
    from jxformers.train.workdir import workdir_lock

    config = write_config(tmp_path)
    (tmp_path / "run").mkdir()
    with workdir_lock(tmp_path / "run"):
        assert cli.main(["train", str(config), "--workdir", str(tmp_path / "run"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"in use by another jxformers train (pid {os.getpid()} on " in err and " since " in err
    assert not (tmp_path / "run" / "checkpoints").exists()
    # A lock left by a dead process (its file says so, but nobody holds it) does not block.
    (tmp_path / "run" / "lock").write_text(json.dumps({"pid": 999999, "host": "gone", "since": "yesterday"}))
    summary = train(
        load_experiment(config, ["train.steps=1", "train.warmup_steps=1"]), tmp_path / "run", progress=False
    )
    assert summary["step"] == 1


# ----------------------------------------------------------------------------- item 8


def test_missing_or_file_workdirs_and_yaml_errors_are_plain_errors(tmp_path, capsys):
    config = write_config(tmp_path)
    for command in (["eval"], ["generate", "--prompt", "1"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--workdir", str(tmp_path / "absent")])
        assert "does not exist: train first" in capsys.readouterr().err
        assert not (tmp_path / "absent").exists()
    (tmp_path / "file").write_text("")
    assert cli.main(["train", str(config), "--workdir", str(tmp_path / "file"), "--no-progress"]) == 1
    assert "is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", "--workdir", str(tmp_path / "file")])
    assert "is a file, not a directory" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntrain: {steps: 3\nmodel: {}\n")
    with pytest.raises(SystemExit):
        cli.main(["train", str(bad), "--workdir", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert f"{bad}:3:" in err and "YAML syntax error" in err and "<unicode string>" not in err


# ----------------------------------------------------------------------------- item 9


def test_non_finite_before_any_checkpoint_says_so_and_metrics_stay_json(tmp_path):
    config = write_config(tmp_path)
    blow_up = ["train.learning_rate=1e38", "train.clip_norm=null", "train.warmup_steps=0", "train.schedule=constant"]
    with pytest.raises(Exception, match="no checkpoint was saved yet") as info:
        train(load_experiment(config, blow_up), tmp_path / "run", progress=False)
    assert "last good checkpoint is kept" not in str(info.value)

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    records = [
        json.loads(x, parse_constant=refuse) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    skipped = next(r for r in records if r.get("skipped"))
    assert isinstance(skipped["loss"], str) and float(skipped["loss"]) != float(skipped["loss"])  # "NaN"


# ----------------------------------------------------------------------------- messages


def test_an_override_mapping_without_a_space_after_the_colon_is_explained(tmp_path):
    with pytest.raises(ValueError, match=r"put a space after the colon: \{window: 16\}"):
        load_experiment(write_config(tmp_path), ["model.attention=local", "model.attention_kwargs={window:16}"])


def test_a_checkpoint_fallback_during_eval_is_one_clean_line(trained, tmp_path, capsys):
    _, run = trained
    run = _copy(run, tmp_path)
    for f in (run / "checkpoints" / "12" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"garbage")
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(run)]) == 0
    captured = capsys.readouterr()
    assert _last_json(captured.out)["step"] == 8
    # One line, without Python's file:line and source line; "using", not "resuming".
    [line] = [x for x in captured.err.splitlines() if "step 12" in x]
    assert line.startswith("jxformers: warning: checkpoint at step 12 could not be restored (")
    assert line.endswith("; using step 8") and "resuming" not in line and len(line) < 300
    assert captured.err.count("\n") == 1


def test_version_and_eval_best(trained, capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("jxformers 0.1.0")
    _, run = trained
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}  # steps 6 and 12
    # Checkpoint 8 carries the evaluation of step 6, checkpoint 12 its own.
    best = 8 if evals[6] > evals[12] else 12
    assert cli.main(["eval", "--workdir", str(run), "--best"]) == 0
    assert _last_json(capsys.readouterr().out)["step"] == best


def test_progress_is_plain_lines_off_a_terminal_and_silent_when_off(tmp_path, capsys, monkeypatch):
    from jxformers.train import loop

    config = write_config(tmp_path, train={"steps": 3, "eval_every": 3})
    monkeypatch.setattr(loop, "PLAIN_PROGRESS_EVERY_S", 1e9)  # only the first and the last step
    train(load_experiment(config), tmp_path / "on", progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert [x.split(" loss")[0] for x in err.splitlines()] == ["tiny: step 1/3", "tiny: step 3/3"]
    assert all(re.search(r" step_ms [0-9.]+ tokens/s [0-9]+$", x) for x in err.splitlines())  # speed, too
    assert cli.main(["train", str(config), "--workdir", str(tmp_path / "off"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and len(captured.out.strip().splitlines()) == 1  # only the summary


def test_ctrl_c_is_acknowledged_at_once_and_says_what_was_saved(tmp_path):
    config = write_config(tmp_path, train={"steps": 4000}, checkpoint={"every": 1000})
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jxformers.tools.cli",
            "train",
            str(config),
            "--workdir",
            str(tmp_path / "run"),
            "--no-progress",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines, seen = [], {}
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), x)) for x in proc.stderr], daemon=True)
    reader.start()
    start = time.monotonic()
    while not (tmp_path / "run" / "lock").exists():  # the handlers are in place before the lock is taken
        assert proc.poll() is None and time.monotonic() - start < 120
        time.sleep(0.02)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=240) == 128 + signal.SIGINT
    reader.join(timeout=10)
    for when, line in lines:
        seen.setdefault(
            "ack"
            if "SIGINT received" in line
            else "done"
            if line.startswith("jxformers train: ") and ("saved step" in line or "nothing" in line)
            else "other",
            when,
        )
    assert "ack" in seen and "done" in seen, "".join(x for _, x in lines)[-2000:]
    assert seen["ack"] - sent < 5.0
    last = lines[-1][1]
    assert "nothing to save yet" in last or ("saved step" in last and "rerun to resume" in last)


def test_an_impossible_mesh_is_refused_before_any_file_is_written(tmp_path, capsys):
    config = write_config(tmp_path)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"mesh \{.*'fsdp': 3.*devices"):
        train(load_experiment(config, ["mesh.fsdp=3"]), run, progress=False)
    assert not run.exists()
    assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress", "--set", "mesh.fsdp=3"]) == 1
    assert "mesh" in capsys.readouterr().err and not run.exists()


def test_a_metrics_line_cut_short_is_ended_skipped_and_named_not_fatal(tmp_path):
    """A crash or a full disk mid-write leaves a partial last line: the next run's log
    starts on a line of its own, and readers (eval's last evaluation, plot, demo) skip
    the broken line with a warning naming file and line instead of refusing the log."""
    from jxformers.tools.plot import read_metrics
    from jxformers.train.workdir import METRICS, open_metrics_log, read_metrics_log, write_line

    path = tmp_path / METRICS
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "lo')  # cut mid-record
    fd = open_metrics_log(tmp_path)
    write_line(fd, json.dumps({"step": 3, "loss": 1.5}))
    os.close(fd)
    assert path.read_text().splitlines()[-1] == '{"step": 3, "loss": 1.5}'
    with pytest.warns(UserWarning, match=rf"{re.escape(str(path))}:2 is not a metrics record"):
        records = read_metrics_log(tmp_path)
    assert [r["step"] for r in records] == [1, 3]
    with pytest.warns(UserWarning, match=":2 is not"):
        assert read_metrics(tmp_path)["loss"] == {1: 2.5, 3: 1.5}


def test_the_metrics_log_is_never_written_through_a_symbolic_link(tmp_path):
    from jxformers.train.workdir import METRICS, open_metrics_log

    other = tmp_path / "someone_elses.txt"
    other.write_text("theirs\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS).symlink_to(other)
    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        open_metrics_log(run)
    assert other.read_text() == "theirs\n"


def test_a_run_whose_checkpoints_are_gone_is_refused_unless_started_fresh(trained, tmp_path, capsys):
    """Deleting checkpoints/ used to restart at step 0 silently, appending a second
    history to metrics.jsonl; now the rerun names the logged step and --fresh, which
    starts again with the old log set aside (and is refused where checkpoints exist)."""
    _, run = trained
    kept = _copy(run, tmp_path)
    assert cli.main(["train", "--workdir", str(kept), "--no-progress", "--fresh"]) == 1
    assert "holds checkpoints, which a fresh start would discard" in capsys.readouterr().err
    shutil.rmtree(kept / "checkpoints")
    log, config = (kept / "metrics.jsonl").read_text(), (kept / "config.yaml").read_text()
    assert cli.main(["train", "--workdir", str(kept), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "logs a run to step 12 with a checkpoint saved at step 12" in err and "--fresh" in err, err
    assert (kept / "metrics.jsonl").read_text() == log and (kept / "config.yaml").read_text() == config
    assert cli.main(["train", "--workdir", str(kept), "--no-progress", "--fresh"]) == 0
    assert "a fresh start; the old log is" in capsys.readouterr().err
    [aside] = kept.glob("metrics.jsonl.*.old")
    assert aside.read_text() == log
    records = [json.loads(x) for x in (kept / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))  # one history, from step 1


def test_a_checkpoint_whose_name_is_not_its_step_is_treated_as_damaged(trained, tmp_path):
    """Another step's checkpoint copied in as checkpoints/12 was restored as step 12, and a
    resumed run would go on from another history; the name is now checked against the
    step saved inside, and a mismatch falls back like other damage."""
    from jxformers.train.loop import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "12")
    shutil.copytree(run / "checkpoints" / "8", run / "checkpoints" / "12")
    with pytest.warns(UserWarning, match=r"step 12 could not be restored \(.*the state inside is step 8, not 12\)"):
        _, step = restore_model(load_run_experiment(run), run)
    assert step == 8


def test_a_file_system_error_is_one_line_naming_the_path_and_what_to_do(tmp_path, capsys):
    import errno

    config = write_config(tmp_path)
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)  # a directory where the log goes
    assert cli.main(["train", str(config), "--workdir", str(tmp_path / "run"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("jxformers train: Is a directory:") and "metrics.jsonl" in err and "move it away" in err
    full = cli.os_error_line(OSError(errno.ENOSPC, "No space left on device", "/runs/a/metrics.jsonl"))
    assert full == (
        "No space left on device: '/runs/a/metrics.jsonl'; free some space (the last checkpoint is kept; "
        "rerun to resume)"
    )
    assert "write access" in cli.os_error_line(PermissionError(errno.EACCES, "Permission denied", "/runs/a"))


def test_directories_the_run_cannot_write_in_are_refused_before_any_file_is_written(tmp_path, capsys, monkeypatch):
    """Issue 37 item 1: a checkpoints/ it could not save into used to train until the
    first save, then hang about 300 s in it. A file where the run makes a directory, and
    a directory that refuses a new file (mode 555 for a user; here the probe's OSError,
    as root writes anyway), are refused at start-up, naming the path."""
    import tempfile

    config = write_config(tmp_path)
    for name in ("checkpoints", "tensorboard"):
        run = tmp_path / f"file_{name}"
        run.mkdir()
        (run / name).write_text("not a directory")
        assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run / name} is a file where the run writes a directory" in err, err
        assert sorted(os.listdir(run)) == [name]  # no lock, config.yaml or log
    run = tmp_path / "unwritable"
    (run / "checkpoints").mkdir(parents=True)
    real_mkstemp = tempfile.mkstemp

    def refusing(*args, dir=None, **kwargs):
        if str(dir).endswith("checkpoints"):
            raise PermissionError(13, "Permission denied", str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refusing)
    with pytest.raises(ValueError, match=r"cannot write in .*checkpoints \(Permission denied\).*chmod u\+w"):
        train(load_experiment(config), run, progress=False)
    assert os.listdir(run) == ["checkpoints"] and os.listdir(run / "checkpoints") == []
    monkeypatch.undo()
    if os.geteuid() != 0:  # the real thing, where permissions bind
        (run / "checkpoints").chmod(0o555)
        try:
            with pytest.raises(ValueError, match="cannot write in"):
                train(load_experiment(config), run, progress=False)
        finally:
            (run / "checkpoints").chmod(0o755)


def test_a_deleted_config_yaml_is_read_back_from_the_checkpoints(trained, tmp_path, capsys):
    """Deleting config.yaml switched the rerun check off (train.batch_size=32 was then
    accepted on resume); every checkpoint now holds the run's config: the check uses it,
    eval reads it, and train writes config.yaml again."""
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    original = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").unlink()
    with pytest.warns(
        UserWarning, match=r"config.yaml is missing: using the run's config stored in its checkpoint of step 12"
    ):
        assert load_run_experiment(run).raw == original
    with pytest.warns(UserWarning, match="config.yaml is missing"):
        code = cli.main(["train", "--workdir", str(run), "--no-progress", "--set", "train.batch_size=32"])
    assert code == 1 and "train.batch_size: 8 in the run, 32 now" in capsys.readouterr().err
    assert not (run / "config.yaml").exists()  # nothing written by a refused rerun
    with pytest.warns(UserWarning, match="config.yaml is missing"):
        assert cli.main(["train", "--workdir", str(run), "--no-progress"]) == 0  # complete already: runs nothing
    assert '"complete": true' in capsys.readouterr().out
    assert yaml.safe_load((run / "config.yaml").read_text()) == original


def test_a_run_killed_during_its_first_async_save_starts_again_without_a_word(tmp_path):
    """Only a save the log proves finished counts: an async save is on disk once the next
    one started; a run killed during its first one has no checkpoint to lose."""
    from jxformers.train.workdir import check_history

    experiment = load_experiment(write_config(tmp_path), ["checkpoint.async_save=true"])
    run = tmp_path / "run"
    run.mkdir()
    log = [{"step": 4, "loss": 1.0}, {"step": 4, "checkpoint_save_ms": 3.0}, {"step": 5, "loss": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    assert check_history(run, experiment, fresh=False) is False
    log += [{"step": 8, "checkpoint_save_ms": 2.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    with pytest.raises(ValueError, match="with a checkpoint saved at step 4, but"):
        check_history(run, experiment, fresh=False)


# ----------------------------------------------------------------------------- issue 37 item 5


def test_a_flipped_bit_in_an_array_file_is_found_and_falls_back(trained, tmp_path):
    """A bit flipped inside a checkpoint's array data restored silently (the losses then
    differed); each checkpoint now holds checksums of its arrays, and a mismatch is damage:
    the previous checkpoint is used, naming the array."""
    from jxformers.train.loop import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    data = max((run / "checkpoints" / "12" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0x10  # inside the stored arrays
    data.write_bytes(bytes(raw))
    # Our checksum finds a flip in values that reach the restore; in some runs OCDBT lays the
    # file out so that this byte belongs to a record its own check refuses (DATA_LOSS):
    # damage found either way, and the previous checkpoint used.
    found = r"checksum of .* differs: saved 0x|DATA_LOSS|Error reading"
    with pytest.warns(UserWarning, match=rf"step 12 could not be restored \(.*({found})"):
        _, step = restore_model(load_run_experiment(run), run)
    assert step == 8


def test_an_edited_data_position_is_found_and_falls_back(trained, tmp_path):
    """An edited data-iterator position restored silently (the run then saw other
    batches); its checksum is now checked with the arrays'."""
    from jxformers.train.loop import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    (position,) = (run / "checkpoints" / "12" / "data").glob("process_*.json")
    state = json.loads(position.read_text())
    state["last_seen_indices"] = {worker: index - 8 for worker, index in state["last_seen_indices"].items()}
    position.write_text(json.dumps(state, indent=4))
    with pytest.warns(UserWarning, match=r"step 12 could not be restored \(.*checksum of the data position"):
        _, step = restore_model(load_run_experiment(run), run)
    assert step == 8


def test_a_resume_checks_the_records_consumed_against_the_steps_taken(trained, tmp_path, capsys):
    """Issue 37 item 5's second check: the restored data position must have consumed step
    x batch rows (here tested where the checkpoint holds no checksums, as one written
    before them: the position's digest would find the edit first)."""
    _, run = trained
    run = _copy(run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "12" / "checksums")
    (position,) = (run / "checkpoints" / "12" / "data").glob("process_*.json")
    state = json.loads(position.read_text())
    state["last_seen_indices"] = {worker: index - 3 for worker, index in state["last_seen_indices"].items()}
    position.write_text(json.dumps(state, indent=4))
    capsys.readouterr()
    assert cli.main(["train", "--workdir", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    import yaml

    batch = yaml.safe_load((run / "config.yaml").read_text())["train"]["batch_size"]
    assert f"has consumed {12 * batch - 3} records, not step 12 x {batch} rows = {12 * batch}" in err, err
    assert "resuming from step 8" in err, err


def test_reads_finishing_into_a_failed_restores_closed_loop_print_no_traceback(trained, tmp_path):
    """Issue 37 item 14: after a fallback from damaged OCDBT data, the restore's reads still
    in flight finished into orbax's closed event loop, and Python printed a `RuntimeError:
    Event loop is closed` traceback for each (through `sys.unraisablehook`, from
    tensorstore's threads; how many depends on timing). A failed restore now drops those
    reports, and those alone. Replayed deterministically: a callback scheduled on a closed
    loop from an object's finaliser is reported the same way."""
    import asyncio
    import gc
    import sys

    from jxformers.train.loop import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    data = max((run / "checkpoints" / "12" / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:100])  # DATA_LOSS from tensorstore
    before, reported = sys.unraisablehook, []
    sys.unraisablehook = lambda report: reported.append(str(report.exc_value))  # the hook before ours
    try:
        with pytest.warns(UserWarning, match="step 12 could not be restored"):
            _, step = restore_model(load_run_experiment(run), run)
        assert step == 8

        loop = asyncio.new_event_loop()
        loop.close()

        class LateRead:
            def __init__(self, error=None):
                self.error = error

            def __del__(self):
                if self.error is not None:
                    raise self.error
                loop.call_soon_threadsafe(print, "never")

        LateRead()
        gc.collect()
        # and an orbax read coroutine that turns the GeneratorExit of its closing into an
        # error (orbax's serialization: `except BaseException as e: raise Exception(...) from e`)
        namespace = {}
        source = "async def read(wait):\n    try:\n        await wait\n    except BaseException as e:\n"
        source += "        raise Exception('Encountered error while reading array index') from e\n"
        exec(compile(source, "/site-packages/orbax/checkpoint/serialization.py", "exec"), namespace)
        abandoned = namespace["read"](loop.create_future())
        abandoned.send(None)  # started, waiting on its read
        del abandoned
        gc.collect()
        assert reported == []  # dropped
        LateRead(RuntimeError("something else"))
        gc.collect()
        assert reported == ["something else"]  # passed on
    finally:
        sys.unraisablehook = before


# ----------------------------------------------------------------------------- issue 37 item 11


def test_junk_in_a_checkpoints_metrics_file_is_one_warning_not_a_stop(trained, tmp_path, capsys):
    """Junk in checkpoints/12/metrics/metrics stopped `train` and `eval` alike with
    "Expecting value: line 1 column 1" (orbax reads every metrics file when it opens the
    directory); the checkpoint is now used, only not as a candidate for the best."""
    _, run = trained
    run = _copy(run, tmp_path)
    (run / "checkpoints" / "12" / "metrics" / "metrics").write_text("junk{")
    assert cli.main(["eval", "--workdir", str(run)]) == 0
    out, err = capsys.readouterr()
    assert _last_json(out)["step"] == 12
    assert re.search(r"step 12: its metrics file .*12/metrics/metrics is unreadable .*JSONDecodeError", err)
    assert cli.main(["train", "--workdir", str(run), "--no-progress"]) == 0  # opens it too
    assert '"complete": true' in capsys.readouterr().out


def test_eval_reading_a_checkpoint_that_training_rotates_out_takes_the_newest_left(trained, tmp_path, monkeypatch):
    """`eval` during training (keep=1) read a checkpoint that the run then deleted and
    failed with a raw FileNotFoundError, or called it damaged "if the config changed"; a
    checkpoint deleted while read is now listed again, no warning."""
    import warnings

    from jxformers.train import checkpoint
    from jxformers.train.loop import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    read = checkpoint.Checkpointer._restore_step

    def rotated_while_read(self, step, template, iterator):
        if step == 12:
            shutil.rmtree(self.directory / "12")  # what the training run's rotation does
        return read(self, step, template, iterator)

    monkeypatch.setattr(checkpoint.Checkpointer, "_restore_step", rotated_while_read)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, step = restore_model(load_run_experiment(run), run)
    assert step == 8


@pytest.mark.parametrize("name", ["lock", "config.yaml"])
def test_the_runs_own_files_are_never_written_through_a_symbolic_link(tmp_path, capsys, name):
    """A planted `lock` link had its target truncated, a `config.yaml` link overwrote its
    target; the run now refuses such a link at start-up, before writing anything."""
    other = tmp_path / "someone_elses.txt"
    other.write_text("theirs\n")
    config = write_config(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(other)
    assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress"]) == 1
    assert f"run/{name} is a symbolic link (to {other})" in capsys.readouterr().err
    assert other.read_text() == "theirs\n"
    assert sorted(p.name for p in run.iterdir()) == [name]  # nothing else written


# ----------------------------------------------------------------------------- issue 37 item 12


def test_a_checkpoint_half_deleted_by_a_second_ctrl_c_is_set_aside_once(trained, tmp_path, capsys):
    """A second Ctrl-C exits at once, also while orbax deletes an old checkpoint; the
    half-deleted directory then made the next runs warn ("Metadata file does not exist")
    until the run's own rotation removed it. The next train moves it aside, saying so
    once; later runs are quiet."""
    _, run = trained
    run = _copy(run, tmp_path)
    shutil.rmtree(run / "checkpoints" / "8" / "state")  # what an interrupted rmtree leaves
    (run / "checkpoints" / "8" / "_CHECKPOINT_METADATA").unlink()
    assert cli.main(["train", "--workdir", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"checkpoint at step 8 is incomplete \(it has no _CHECKPOINT_METADATA.*moved to ", err), err
    assert "Metadata file does not exist" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12"]
    assert [p.name.split("-")[0] for p in (run / "checkpoints_damaged").iterdir()] == ["8"]
    assert cli.main(["train", "--workdir", str(run), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert '"complete": true' in out and "warning" not in err


# ----------------------------------------------------------------------------- issue 37 item 13


def test_a_run_that_dies_of_an_error_saves_its_last_step_first(trained, tmp_path, capsys, monkeypatch):
    """A full disk while logging ended the run with an OSError and no save (every step
    since the last checkpoint lost); the run now saves the step whose state and data
    position agree, then reports the error on one line, and a rerun resumes from there
    to the same losses as an uninterrupted run."""
    import errno

    from jxformers.train import loop

    config, done = trained
    run = tmp_path / "run"
    overrides = ["--set", "model.num_layers=2", "--set", "checkpoint.async_save=false"]
    write = loop.write_line

    def disk_full_at_step_10(fd, line):
        if line.startswith('{"step": 10, "accuracy"'):
            raise OSError(errno.ENOSPC, "No space left on device", str(run / "metrics.jsonl"))
        write(fd, line)

    monkeypatch.setattr(loop, "write_line", disk_full_at_step_10)
    assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress", *overrides]) == 1
    err = capsys.readouterr().err
    assert "saved step 10 before stopping on OSError" in err and "No space left on device" in err
    assert "Traceback" not in err
    assert max(int(p.name) for p in (run / "checkpoints").iterdir()) == 10  # every = 4: 8 before it
    monkeypatch.setattr(loop, "write_line", write)
    assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress", *overrides]) == 0
    final = _last_json(capsys.readouterr().out)
    uninterrupted = [r for r in map(json.loads, (done / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert final["step"] == 12 and final["loss"] == uninterrupted[-1]["loss"]


# ----------------------------------------------------------------------------- issue 37 item 8


def test_another_runs_checkpoint_under_a_step_of_this_run_is_treated_as_damaged(trained, tmp_path, capsys):
    """Another run's checkpoint copied in under a step this run also saved passed every
    check (name, step, checksums all its own) and was restored; each checkpoint now keeps
    the id of the run that wrote it (`run_id` in the work directory), and another id is
    damage. A deleted run_id file is taken back from the checkpoints."""
    from jxformers.train.loop import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, run = trained
    run = _copy(run, tmp_path)
    ident = (run / "run_id").read_text().strip()
    assert len(ident) == 32
    stored = run / "checkpoints" / "12" / "checksums" / "checksums"
    foreign = json.loads(stored.read_text()) | {"run": "f" * 32}
    stored.write_text(json.dumps(foreign))
    with pytest.warns(
        UserWarning,
        match=rf"step 12 could not be restored \(.*written by another run \(run id f{{32}}; this run's is {ident}\)",
    ):
        _, step = restore_model(load_run_experiment(run), run)
    assert step == 8
    (run / "run_id").unlink()
    shutil.rmtree(run / "checkpoints" / "12")
    assert cli.main(["train", "--workdir", str(run), "--no-progress", "--set", "train.steps=8"]) == 0
    assert (run / "run_id").read_text().strip() == ident
