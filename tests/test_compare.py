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
    assert "Attention settings scale with the length" in text and "at their defaults: softmax, linear" in text
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


def test_whole_models_by_their_overrides_from_several_seeds(tmp_path):
    """`--model LABEL KEY=VALUE ...` candidates, `--seeds 2`: one run per seed in its own
    directory, the table's cells mean ± sd, with parameters and train FLOPs per token."""
    args = ["compare", "lra_listops", "--model", "plain", "--model", "wide", "model.d_model=32"]
    args += ["--seeds", "2", "--workdir", str(tmp_path), "--no-progress", "--no-fourier"]
    assert cli.main(args + [x for kv in [*TINY, "train.steps=1"] for x in ("--set", kv)]) == 0
    assert all((tmp_path / name / f"seed{s}" / "metrics.jsonl").exists() for name in ("plain", "wide") for s in (0, 1))
    text = (tmp_path / "compare.md").read_text()
    assert "seeds 0-1 (mean ± sd)" in text and "| parameters | train MFLOPs/token |" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines}
    plain, wide = rows["plain"], rows["wide"]
    assert " ± " in plain[0] and plain[4].endswith("± 0")  # accuracy varies by seed; the size does not
    parameters = [float(r[4].split(" ± ")[0].replace(",", "")) for r in (plain, wide)]
    flops = [float(r[5].split(" ± ")[0]) for r in (plain, wide)]
    assert parameters[1] > 2 * parameters[0] and flops[1] > 2 * flops[0]  # d_model 16 -> 32


def test_the_table_summarises_seeds_and_adds_the_metrics_a_model_logs():
    rows = {
        "ut": [
            {"eval_accuracy": 0.5, "eval_loss": 1.0, "eval_avg_depth": 3.0},
            {"eval_accuracy": 0.7, "eval_loss": 0.8, "eval_avg_depth": 5.0},
        ],
        "plain": [{"eval_accuracy": 0.4, "eval_loss": 1.2}, {"skipped": "failed in training: boom"}],
    }
    text = compare.table(rows, {"majority_class": 0.1})
    assert "| avg depth |" in text.splitlines()[0]
    assert "| ut | 0.600 ± 0.141 | 0.900 ± 0.141 | - | - | - | - | 4.000 ± 1.414 |" in text
    assert "* plain: failed in training: boom" in text and "| baseline: majority class | 0.100 |" in text


def test_model_candidates_refuse_a_repeated_label_or_a_bare_override(capsys):
    assert compare.model_candidates([["a", "model.d_model=8"], ["b"]]) == {"a": ["model.d_model=8"], "b": []}
    with pytest.raises(ValueError, match="twice"):
        compare.model_candidates([["a"], ["a", "x=1"]])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        compare.model_candidates([["a", "model.d_model"]])
    with pytest.raises(SystemExit):
        cli.main(["compare", "lra_listops", "--model", "a", "--seeds", "0"])
    assert "--seeds must be at least 1" in capsys.readouterr().err
