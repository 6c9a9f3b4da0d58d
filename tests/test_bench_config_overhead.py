"""scripts/bench_config_overhead.py (issue 29 item 6): its arguments, the two config
forms of its reference models, and the table it writes; not the timing itself."""

import pathlib
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_config_overhead as bench  # noqa: E402  (a script, importable once scripts/ is on the path)


def test_defaults_compare_the_flat_config_commit_with_head():
    args = bench.parse_args([])
    assert (args.before, args.after) == ("437731b", "HEAD")
    assert args.models == ["softmax_lm", "performer_classifier", "moe_lm"]
    assert args.repeats >= 3 and args.child is None
    args = bench.parse_args(["--before", "abc", "--after", "def", "--models", "moe_lm", "--repeats", "5"])
    assert (args.before, args.after, args.models, args.repeats) == ("abc", "def", ["moe_lm"], 5)


@pytest.mark.parametrize(
    "argv", [["--models", "nope"], ["--models", ""], ["--repeats", "0"], ["--warmup", "-1"], ["--steps", "0"]]
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


@pytest.mark.parametrize("model", bench.MODELS)
def test_the_flat_and_component_forms_are_one_model(model):
    """The flat keywords the old tree is given convert to exactly the component config the
    new tree is given, so the benchmark compares the same model."""
    from jxformers.nn.config import FlatConfigWarning, ModelConfig

    forms = bench.model_configs(model, d_model=32, layers=2, seq=256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the component form must not go through the flat converter
        component = ModelConfig(**forms["component"])
    with pytest.warns(FlatConfigWarning):
        flat = ModelConfig(**forms["flat"])
    assert flat == component
    assert "attention_kwargs" not in str(forms["component"]) and "moe=" not in str(forms["component"])


def fake(model, side, repeat, step, compile_s=5.0):
    return {
        "model": model,
        "side": side,
        "repeat": repeat,
        "import": 1.0,
        "config": 0.1,
        "build": 3.0,
        "compile": compile_s,
        "step": step,
    }


def test_medians_ratios_and_verdicts():
    results = []
    for repeat, (b, a) in enumerate([(100.0, 102.0), (110.0, 300.0), (90.0, 101.0)]):  # one outlier pair
        results += [fake("softmax_lm", "before", repeat, b), fake("softmax_lm", "after", repeat, a)]
    for repeat in range(3):
        results += [fake("moe_lm", "before", repeat, 200.0, 5.0), fake("moe_lm", "after", repeat, 200.0, 5.5)]
    rows = {(r.model, r.metric): r for r in bench.summarize(results)}
    lm = rows["softmax_lm", "step"]
    assert (lm.before, lm.after) == (100.0, 102.0)  # medians, the outlier ignored
    assert lm.ratio == pytest.approx(1.02) and lm.verdict == "ok"
    assert lm.pair_ratios == pytest.approx([1.02, 300 / 110, 101 / 90])
    assert rows["moe_lm", "compile"].ratio == pytest.approx(1.1) and rows["moe_lm", "compile"].verdict == "MISSED"
    assert rows["moe_lm", "step"].verdict == "ok"
    assert bench.Row("m", "step", 100.0, 94.0, 0.94, []).verdict == "MISSED"  # faster by more than 5% too
    assert bench.Row("m", "step", 100.0, 105.0, 1.05, []).verdict == "ok"

    text = bench.write_markdown(bench.summarize(results), header={"command": "`x`", "machine": "CPU"}, notes=["a note"])
    assert "- machine: CPU" in text and "- a note" in text
    assert "| softmax_lm | step (ms) | 100.0 | 102.0 | 1.020 | 1.020, 2.727, 1.122 | ok |" in text
    assert "| moe_lm | compile (s) | 5.000 | 5.500 | 1.100 | 1.100, 1.100, 1.100 | MISSED |" in text
    assert "Target (compile and step within 5%): MISSED for moe_lm compile" in text
    assert "softmax_lm step" not in text.split("Target")[1]


def test_the_target_is_met_when_every_gated_ratio_is_within_five_percent():
    results = [
        fake("moe_lm", side, r, 200.0 if side == "before" else 206.0) for r in range(3) for side in ("before", "after")
    ]
    results[1]["config"] = 0.5  # config construction is reported, not part of the target
    text = bench.write_markdown(bench.summarize(results), header={}, notes=[])
    assert "Target (compile and step within 5%): met" in text
    assert "| moe_lm | config (ms) | 0.100 | 0.100 |" in text  # median of 0.5, 0.1, 0.1
