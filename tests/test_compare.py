"""`jxformers compare`: every registered attention is a candidate, each trains in its own
work directory, one that cannot build or fails is listed as skipped with its reason, and
the table carries the task's baselines."""

import pytest

from jxformers import registry
from jxformers.tools import cli, compare

TINY = [
    "preset=tiny",
    "model.num_layers=1",
    "model.d_model=16",
    "model.d_ff=32",
    "train.steps=2",
    "train.warmup_steps=1",  # the tiny preset's 30 would outlast the run
    "train.batch_size=8",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.log_every=1",
    "checkpoint.every=2",
    "data.train_size=64",
    "data.eval_size=48",
]


def test_all_means_every_registered_attention_and_the_fourier_transformer():
    runs = compare.candidates(["all"])
    assert list(runs) == [*registry.names(), "fourier_transformer"]
    assert runs["linear"] == ["model.attention=linear"] and runs["fourier_transformer"] == [
        "model.stack.filters={0: 0.2}"
    ]
    assert "fourier_transformer" not in compare.candidates(["softmax"], fourier=False)
    with pytest.raises(ValueError, match="softmax"):  # the error lists what is registered
        compare.candidates(["no_such_attention"])


def test_an_attention_that_does_not_build_is_skipped_with_its_reason(tmp_path):
    row = compare.run_one(
        "lra_listops",
        [*TINY, "model.attention=local", "model.attention_kwargs={window: -1}"],
        tmp_path / "local",
        progress=False,
    )
    assert row["skipped"].startswith("does not build") and "window" in row["skipped"]


def test_compare_writes_one_table_and_plot_and_lists_failures(tmp_path, monkeypatch, capsys):
    real_train = compare.train

    def train(experiment, workdir, **kw):
        if workdir.name == "linear":
            raise FloatingPointError("made to fail")
        return real_train(experiment, workdir, **kw)

    monkeypatch.setattr(compare, "train", train)
    args = ["compare", "lra_listops", "--attentions", "softmax", "linear", "--workdir", str(tmp_path), "--no-progress"]
    assert cli.main(args + [x for kv in TINY for x in ("--set", kv)]) == 0
    text = (tmp_path / "compare.md").read_text()
    assert "| softmax |" in text and "| fourier_transformer |" in text and "| linear |" not in text
    assert "* linear: failed in training: FloatingPointError: made to fail" in text
    assert "baseline: majority class" in text and "baseline: root operator" in text
    assert (tmp_path / "compare.png").stat().st_size > 0 and (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "softmax" / "metrics.jsonl").exists()
    softmax_row = next(line for line in text.splitlines() if line.startswith("| softmax |"))
    cells = [c.strip() for c in softmax_row.split("|")[2:-1]]
    assert all(c != "nan" for c in cells), softmax_row  # accuracy, loss, steps/s and memory all measured


def test_compare_refuses_an_unknown_attention(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", "lra_listops", "--attentions", "no_such_attention"])
    assert exit_info.value.code == 2 and "softmax" in capsys.readouterr().err
