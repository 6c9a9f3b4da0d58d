"""`jxformers lra`: the suite on a miniature preset end to end (the table in LRA's layout,
the JSON rows, the plot), resumed with more seeds without retraining what finished, bad
input refused before anything is written, and the published numbers consistent with their
printed averages."""

import json
import statistics

import pytest

from jxformers.tools import cli, compare, lra

MINIATURE = [
    "train.steps=2",
    "train.warmup_steps=1",
    "train.batch_size=8",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.log_every=1",
    "checkpoint.every=2",
    "data.train_size=32",
    "data.eval_size=16",
    "model.num_layers=1",
    "model.d_model=16",
    "model.ffn.d_ff=32",
]


def _lra(tmp_path, *extra: str) -> int:
    sets = [x for kv in MINIATURE for x in ("--set", kv)]
    return cli.main(
        ["lra", "--preset", "tiny", "--tasks", "listops", "--workdir", str(tmp_path), "--no-progress", *sets, *extra]
    )


def test_the_suite_writes_lra_table_json_and_plot_and_resumes_without_retraining(tmp_path, monkeypatch):
    trained = []
    real_train = compare.train

    def train(experiment, workdir, **kw):
        trained.append(workdir.relative_to(tmp_path).as_posix())
        return real_train(experiment, workdir, **kw)

    monkeypatch.setattr(compare, "train", train)
    assert _lra(tmp_path, "--attentions", "softmax", "--no-fourier", "--seeds", "1") == 0
    assert trained == ["listops/softmax/seed0"]
    first = (tmp_path / "listops" / "softmax" / "seed0" / "metrics.jsonl").read_text()

    trained.clear()
    assert _lra(tmp_path, "--attentions", "softmax", "--no-fourier", "--seeds", "2") == 0
    # seed 0 finished: read from its log, not trained (nor restored) again; nothing is appended
    assert (tmp_path / "listops" / "softmax" / "seed0" / "metrics.jsonl").read_text() == first
    assert trained == ["listops/softmax/seed1"]

    results = json.loads((tmp_path / "lra.json").read_text())
    runs = results["tasks"]["listops"]["runs"]
    assert set(runs) == {"softmax"} and len(runs["softmax"]) == 2
    assert all(0.0 <= row["eval_accuracy"] <= 1.0 and row["step_ms"] > 0 for r in runs.values() for row in r)
    # the reused seed-0 run keeps what only its training summary held: parameters and FLOPs
    assert all(row["parameters"] > 0 and row["flops_per_token"] > 0 for row in runs["softmax"])
    text = (tmp_path / "lra.md").read_text()
    mean = statistics.fmean(r["eval_accuracy"] for r in runs["softmax"])
    assert f"| softmax | {100 * mean:.2f} ± " in text
    assert "| baseline: majority class |" in text and "| baseline: root operator |" in text
    assert "| softmax | Transformer | 36.37 |" in text  # the published row, for reference
    assert "Attention settings scale with the length" in text  # the settings each model ran with
    assert (tmp_path / "lra.png").stat().st_size > 0
    assert (tmp_path / "listops" / "baselines.json").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tasks", "listops", "imdb"], "unknown task"),
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--attentions", "no_such_attention"], "softmax"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys, args, message):
    workdir = tmp_path / "suite"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["lra", "--workdir", str(workdir), "--tasks", "listops", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not workdir.exists()


def test_the_fourier_transformer_joins_unless_left_out():
    args = lra.parser().parse_args(["--tasks", "listops", "--preset", "tiny", "--attentions", "softmax"])
    plan = lra._plan(args)
    assert list(plan["listops"][2]) == ["softmax", "fourier_transformer"]
    args.attentions = ["local"]  # at the tiny preset's 65 tokens, local runs with a window that fits them
    assert plan and lra._plan(args)["listops"][2].settings["local"]["window"] < 32
    args.no_fourier = True
    assert list(lra._plan(args)["listops"][2]) == ["local"]


def test_published_numbers_agree_with_their_printed_averages():
    for name, (model, values, average) in lra.PUBLISHED.items():
        assert len(values) == len(lra.FIVE), name
        assert abs(statistics.fmean(values) - average) < 0.06, (name, model)  # FNet's printed average is 0.05 off


def test_every_task_names_a_shipped_experiment_with_the_three_presets():
    import yaml

    from jxformers.train.experiment import EXPERIMENTS_DIR

    for task, config in lra.TASKS.items():
        path = EXPERIMENTS_DIR / f"{config}.yaml"
        assert path.is_file(), (task, path)
        presets = yaml.safe_load(path.read_text()).get("presets", {})
        assert {"cpu", "paper", "tiny"} <= set(presets), (task, sorted(presets))
