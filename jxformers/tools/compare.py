"""`jxformers compare CONFIG --attentions all`: train one experiment once per registered
attention (and the Fourier Transformer: softmax with the spectral filter of He et al. 2023,
arXiv 2305.15099) with the
same steps, seed, data and budget, then write one markdown table (final eval accuracy,
steps/s, compiled train-step memory, next to the task's shortcut baselines on the same
eval examples) and one plot, Long Range Arena's: accuracy against steps/s, point area
memory (the training curves go to curves.png).

Whole models compare the same way: `--model LABEL KEY=VALUE ...` (repeatable) names a
candidate by its overrides (`--model albert model.stack.sharing=all`; `--model plain` is
the experiment as configured), and `--seeds N` trains each candidate from N seeds (the
experiment's seed and the next ones; the table gives mean ± standard deviation). The
table then also has each model's trainable parameters, its train step's FLOPs per token
position (XLA's count of the compiled forward and backward over batch × max_len; XLA
counts a loop's body once, so a model that runs a `lax.scan` or `while_loop` over its
positions or steps, the Feedback and Universal Transformers, is undercounted) and any other
evaluation metric the model logs (`eval_act_steps`, `eval_exit_depth` of adaptive-depth
models).

Each attention trains with its hyper-parameters for the experiment's max_len
(`jxformers.registry.scaled`: sparse or low-rank at that length, within its paper's
ratios; the defaults were chosen for thousands of tokens), stated in the table's header; a
`--set model.attention.KEY=VALUE` of the user's wins for every attention that takes KEY.
One that cannot be sparse at all at that length is not trained (a dense copy of softmax)
but listed as skipped with the reason. `candidates(names, max_len=...)` gives the runs
(`jxformers lra` takes the same).

Each candidate trains in WORKDIR/NAME (WORKDIR/NAME/seedS with several seeds; a rerun
resumes or reuses finished runs). A candidate that does not fit the task (it cannot
build this model, or fails while training) is listed under the table as skipped with
its reason; the run goes on.

Steps/s is the median over the logged steps after the first (which compiles). Memory is
XLA's compiled temporary allocation of the train step (`memory_analysis()`: activations
and workspaces, the same figure for every backend; the parameters and optimizer state
are not in it), since a CPU reports no device peak.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from jxformers import registry
from jxformers.data.baselines import baselines
from jxformers.tools.demo import _step_stats, eval_examples
from jxformers.tools.help_text import add_overrides
from jxformers.tools.plot import plot_runs, plot_tradeoff, read_metrics
from jxformers.train import load_experiment, train
from jxformers.train.experiment import parse_override
from jxformers.train.workdir import METRICS, check_rerun

# The seed paper's model: softmax attention, the DCT filter before block 0 keeping 20%.
FOURIER = ("fourier_transformer", ["model.stack.filters={0: 0.2}"])


class Candidates(dict[str, list[str]]):
    """label -> the overrides that make its model, with what `jxformers compare` and
    `jxformers lra` say about them: `settings` (label -> the attention's hyper-parameters
    for this length and the user's, as trained) and `skipped` (label -> why it is not
    trained: no settings of it are sparse at this length, `registry.DenseAtLength`)."""

    def __init__(self, runs=(), *, settings=None, skipped=None):
        super().__init__(runs)
        self.settings: dict[str, dict[str, Any]] = dict(settings or {})
        self.skipped: dict[str, str] = dict(skipped or {})

    def describe(self, max_len: int) -> str:
        """The settings in words, for the table's header."""
        changed = {k: v for k, v in self.settings.items() if v and k in self}
        same = [k for k in self if k in registry.names() and not self.settings.get(k)]
        words = ", ".join(f"{k} ({', '.join(f'{n}={v!r}' for n, v in hp.items())})" for k, hp in changed.items())
        text = (
            f"Attention settings scale with the length (`jxformers.registry.scaled`, at max_len {max_len}), so "
            "that each efficient attention is sparse or low-rank there; an explicit `--set "
            "model.attention.KEY=VALUE` wins"
        )
        text += f": {words}" if words else ""
        text += f"; at their defaults: {', '.join(same)}" if same else ""
        return text + "."


def _given(overrides: Sequence[str]) -> dict[str, Any]:
    """The attention settings a user's `--set` gives (`model.attention.KEY=VALUE`,
    `model.attention={KEY: VALUE}`, `model.attention_kwargs...`), the name left out."""
    given: dict[str, Any] = {}
    for path, value in (parse_override(o) for o in overrides):
        if path[:1] != ["model"] or len(path) < 2 or path[1] not in ("attention", "attention_kwargs"):
            continue
        if len(path) == 3:
            given[path[2]] = value
        elif len(path) == 2 and isinstance(value, Mapping):
            given |= {k: v for k, v in value.items() if k != "name"}
    return given


def candidates(
    names: list[str], *, fourier: bool = True, max_len: int | None = None, overrides: Sequence[str] = ()
) -> Candidates:
    """label -> the overrides that make its model ("all": every registered attention).

    `max_len`: the model's length; each attention then trains with its hyper-parameters
    for that length (`registry.scaled`), and one that cannot be sparse there is in
    `.skipped` with the reason instead. `overrides`: the user's `--set` ones; the attention
    settings among them (`model.attention.KEY=VALUE`) win over the scaled ones, for each
    attention that takes KEY (a KEY no attention takes, e.g. `impl`, goes to all)."""
    if names == ["all"]:
        names = registry.names()
    for name in names:
        registry.get(name)  # an unknown name is a ValueError listing the registered ones
    given = _given(overrides)
    taken = {p.name for n in registry.names() for p in registry.get(n).hyper_parameters}
    runs, settings, skipped = {}, {}, {}
    for name in names:
        own = {p.name for p in registry.get(name).hyper_parameters}
        mine = {k: v for k, v in given.items() if k in own or k not in taken}
        try:
            scaled = {} if max_len is None else registry.scaled(name, max_len)
        except registry.DenseAtLength as e:
            if not set(mine) & own:  # the user's own settings are tried as given
                skipped[name] = str(e)
                continue
            scaled = {}
        settings[name] = scaled | mine
        if settings[name]:
            runs[name] = [f"model.attention={json.dumps({'name': name} | settings[name])}"]
        else:
            runs[name] = [f"model.attention={name}"]
    runs |= dict([FOURIER]) if fourier else {}
    return Candidates(runs, settings=settings, skipped=skipped)


def model_candidates(models: list[list[str]]) -> dict[str, list[str]]:
    """label -> overrides from `--model LABEL KEY=VALUE ...` arguments (each a list: the
    label, then its overrides), refusing a repeated label or an override without '='."""
    runs: dict[str, list[str]] = {}
    for label, *overrides in models:
        if label in runs:
            raise ValueError(f"--model {label!r} is given twice; each candidate needs its own label")
        bad = [o for o in overrides if "=" not in o]
        if bad or "=" in label:
            raise ValueError(f"--model takes a label, then KEY=VALUE overrides; got {[label, *overrides]}")
        runs[label] = overrides
    return runs


def _final_eval(workdir: pathlib.Path) -> dict[str, float]:
    """The last logged value of each evaluation metric (eval accuracy, loss and any other
    the model logs; also right for a finished run reused)."""
    series = read_metrics(workdir)
    return {key: values[max(values)] for key, values in series.items() if key.startswith("eval_") and values}


def _finished(experiment, workdir: pathlib.Path) -> bool:
    """Whether `workdir` holds this experiment's run trained and evaluated to its last
    step, its config unchanged: its row is then read from its log without restoring a
    checkpoint (one written by an older version of the library may not restore)."""
    if not (workdir / METRICS).is_file():
        return False
    try:
        if check_rerun(workdir, experiment):  # an accepted change (more steps, ...): train goes on
            return False
    except ValueError:  # a refused change: train() says what differs
        return False
    return experiment.train.steps in read_metrics(workdir).get("eval_loss", {})


def run_one(config: str, overrides: list[str], workdir: pathlib.Path, *, progress: bool) -> dict:
    """Train one model; returns its row, or {"skipped": reason} when it cannot run."""
    try:
        experiment = load_experiment(config, overrides)
    except ValueError as e:  # the attention does not fit this model or task
        return {"skipped": f"does not build: {e}"}
    try:
        summary = {} if _finished(experiment, workdir) else train(experiment, workdir, progress=progress) or {}
    except Exception as e:  # noqa: BLE001 -- one failing attention must not end the comparison
        traceback.print_exc(file=sys.stderr)
        first_line = str(e).splitlines()[0] if str(e) else ""
        if type(e) is ValueError:  # the library's word for a setting it refuses (checked while building)
            return {"skipped": f"does not build: {first_line}"}
        return {"skipped": f"failed in training: {type(e).__name__}: {first_line}"}
    logged = read_metrics(workdir)  # a finished run reused returns no summary: its final record has these
    for key in ("parameters", "train_step_flops"):
        if not summary.get(key) and logged.get(key):
            summary[key] = logged[key][max(logged[key])]
    stats = _step_stats(workdir)
    row = _final_eval(workdir) | stats
    if stats.get("step_ms"):
        row["steps_per_s"] = 1e3 / stats["step_ms"]
    if summary.get("parameters"):
        row["parameters"] = float(summary["parameters"])
    if summary.get("train_step_flops"):  # per token position of a step: batch x max_len
        row["flops_per_token"] = summary["train_step_flops"] / (experiment.train.batch_size * experiment.model.max_len)
    return row


def _summarised(rows: list[dict]) -> dict:
    """One candidate's seeds as one row: each metric's mean and its standard deviation
    (under "<metric>_sd"; 0 for one seed), or {"skipped": reason} when a seed was."""
    skipped = [r["skipped"] for r in rows if "skipped" in r]
    if skipped:
        return {"skipped": skipped[0]}
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        values = [r[key] for r in rows if key in r]
        out[key] = statistics.fmean(values)
        out[f"{key}_sd"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return out


# (column, metric, format) of the table; the evaluation metrics a model adds follow these.
COLUMNS = (
    ("eval accuracy", "eval_accuracy", "{:.3f}"),
    ("eval loss", "eval_loss", "{:.3f}"),
    ("steps/s", "steps_per_s", "{:.2f}"),
    ("step temp MiB", "step_temp_mib", "{:.1f}"),
    ("parameters", "parameters", "{:,.0f}"),
    ("train MFLOPs/token", "flops_per_token", "{:.3g}"),
)
_SCALE = {"flops_per_token": 1e-6}
_USUAL = {"eval_accuracy", "eval_loss", "eval_bits_per_token"}


def table(rows: Mapping[str, dict | list[dict]], scores: dict[str, float]) -> str:
    """The markdown table: one line per model that ran (best accuracy first; a list of
    rows, one per seed, as mean ± standard deviation), then the baselines."""
    merged = {k: _summarised(r if isinstance(r, list) else [r]) for k, r in rows.items()}
    seeds = max((len(r) for r in rows.values() if isinstance(r, list)), default=1)
    ran = {k: r for k, r in merged.items() if "skipped" not in r}
    extra = sorted({k for r in ran.values() for k in r if k.startswith("eval_") and k[:-3] not in _USUAL} - _USUAL)
    extra = [k for k in extra if not k.endswith("_sd")]
    columns = [*COLUMNS, *((k.removeprefix("eval_").replace("_", " "), k, "{:.3f}") for k in extra)]
    lines = ["| model | " + " | ".join(c[0] for c in columns) + " |", "|---|" + "---:|" * len(columns)]

    def cell(r, key, fmt):
        if key not in r:
            return "-"
        scale = _SCALE.get(key, 1.0)
        text = fmt.format(r[key] * scale)
        return text + (" ± " + fmt.format(r[f"{key}_sd"] * scale) if seeds > 1 else "")

    for name in sorted(ran, key=lambda k: -ran[k].get("eval_accuracy", -1.0)):
        lines.append(f"| {name} | " + " | ".join(cell(ran[name], key, fmt) for _, key, fmt in columns) + " |")
    blank = " |" * (len(columns) - 1)
    lines += [f"| baseline: {name.replace('_', ' ')} | {value:.3f} |{blank}" for name, value in scores.items()]
    skipped = {k: r["skipped"] for k, r in merged.items() if "skipped" in r}
    if skipped:
        lines += ["", "Skipped:", ""] + [f"* {name}: {reason}" for name, reason in skipped.items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jxformers compare", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="an experiment name in experiments/ (e.g. lra_listops) or a YAML path")
    p.add_argument(
        "--attentions",
        nargs="+",
        default=None,
        metavar="NAME",
        help="registered attentions to train, or 'all' (the default without --model)",
    )
    p.add_argument(
        "--model",
        dest="models",
        action="append",
        nargs="+",
        default=[],
        metavar="LABEL [KEY=VALUE",
        help="a candidate model: a label, then the overrides that make it (repeatable; "
        "e.g. --model albert model.stack.sharing=all; --model plain: the experiment as configured)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="train each candidate from this many seeds (train.seed and the next ones); default 1",
    )
    p.add_argument(
        "--no-fourier",
        action="store_true",
        help="leave out the Fourier Transformer (softmax + model.stack.filters={0: 0.2})",
    )
    p.add_argument(
        "--workdir",
        default="runs/compare",
        help="one sub-directory per model; compare.md, "
        "compare.png (accuracy against steps/s) and curves.png go here (default %(default)s)",
    )
    add_overrides(p, "overrides for every run, e.g. --set preset=tiny --set train.steps=100")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        if args.seeds < 1:
            raise ValueError(f"--seeds must be at least 1; got {args.seeds}")
        attentions = args.attentions or ([] if args.models else ["all"])
        experiment = load_experiment(args.config, args.overrides)
        max_len = experiment.model.max_len
        runs = Candidates()
        if attentions:
            runs = candidates(attentions, fourier=not args.no_fourier, max_len=max_len, overrides=args.overrides)
        runs |= model_candidates(args.models)
    except ValueError as e:
        p.error(str(e))
    root = pathlib.Path(args.workdir)
    train_source, eval_source = experiment.sources()
    examples = eval_examples(experiment)
    scores = baselines(train_source, eval_source, records=examples, workers=experiment.data.workers)
    t = experiment.train
    intro = (
        f"{experiment.name}: {t.steps} steps of batch {t.batch_size}, seed {t.seed}, the same data for every "
        f"model; accuracy on {examples} eval examples (baselines on the same examples). Steps/s: median "
        "after compilation. Memory: XLA's compiled temporary allocation of the train step.\n\n"
    )
    if args.seeds > 1:
        intro = intro.replace(f"seed {t.seed},", f"seeds {t.seed}-{t.seed + args.seeds - 1} (mean ± sd),")
    if attentions:
        intro += runs.describe(max_len) + "\n\n"
    rows: dict[str, list[dict]] = {name: [{"skipped": why}] for name, why in runs.skipped.items()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "compare.md").write_text(intro + table(rows, scores) + "\n")  # also when every candidate is skipped
    for i, (name, overrides) in enumerate(runs.items()):
        rows[name] = []
        for seed in range(t.seed, t.seed + args.seeds):
            workdir = root / name if args.seeds == 1 else root / name / f"seed{seed}"
            print(f"== [{i + 1}/{len(runs)}] {name}: {t.steps} steps in {workdir}", file=sys.stderr)
            made = [*args.overrides, *overrides, f"train.seed={seed}"]
            rows[name].append(run_one(args.config, made, workdir, progress=not args.no_progress))
        waiting = list(runs)[i + 1 :]  # the table so far, so that a stopped comparison still has one
        note = f"\nNot run yet: {', '.join(waiting)}.\n" if waiting else ""
        (root / "compare.md").write_text(intro + table(rows, scores) + "\n" + note)
    text = (root / "compare.md").read_text()
    print(text)
    merged = {name: _summarised(r) for name, r in rows.items()}
    ran = {name: r for name, r in merged.items() if "skipped" not in r}
    points = {
        name: (r["steps_per_s"], r["eval_accuracy"], r.get("step_temp_mib", 0.0))
        for name, r in ran.items()
        if "steps_per_s" in r and "eval_accuracy" in r
    }
    if points:
        print(
            f"plot: {plot_tradeoff(points, root / 'compare.png', baselines=scores, title=experiment.name)}",
            file=sys.stderr,
        )
    if ran:
        first = [root / n if args.seeds == 1 else root / n / f"seed{t.seed}" for n in ran]  # one curve a model
        print(f"curves: {plot_runs(first, root / 'curves.png', labels=list(ran))}", file=sys.stderr)
    print(f"table: {root / 'compare.md'}", file=sys.stderr)
    return 0
