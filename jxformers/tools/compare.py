"""`jxformers compare CONFIG --attentions all`: train one experiment once per registered
attention (and the Fourier Transformer: softmax with the spectral filter of He et al. 2023,
arXiv 2305.15099) with the
same steps, seed, data and budget, then write one markdown table (final eval accuracy,
steps/s, compiled train-step memory, next to the task's shortcut baselines on the same
eval examples) and one plot, Long Range Arena's: accuracy against steps/s, point area
memory (the training curves go to curves.png).

Each attention trains in WORKDIR/NAME (a rerun resumes or reuses finished runs). An
attention that does not fit the task (it cannot build this model, or fails while
training) is listed under the table as skipped with its reason; the run goes on.

Steps/s is the median over the logged steps after the first (which compiles). Memory is
XLA's compiled temporary allocation of the train step (`memory_analysis()`: activations
and workspaces, the same figure for every backend; the parameters and optimizer state
are not in it), since a CPU reports no device peak.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import traceback

from jxformers import registry
from jxformers.data.baselines import baselines
from jxformers.tools.demo import _step_stats, eval_examples
from jxformers.tools.plot import plot_runs, plot_tradeoff, read_metrics
from jxformers.train import load_experiment, train

# The seed paper's model: softmax attention, the DCT filter before block 0 keeping 20%.
FOURIER = ("fourier_transformer", ["model.stack.filters={0: 0.2}"])


def candidates(names: list[str], *, fourier: bool = True) -> dict[str, list[str]]:
    """label -> the overrides that make its model ("all": every registered attention)."""
    if names == ["all"]:
        names = registry.names()
    for name in names:
        registry.get(name)  # an unknown name is a ValueError listing the registered ones
    runs = {name: [f"model.attention={name}"] for name in names}
    return runs | (dict([FOURIER]) if fourier else {})


def _final_eval(workdir: pathlib.Path) -> dict[str, float]:
    """The last logged eval accuracy and loss (also right for a finished run reused)."""
    series = read_metrics(workdir)
    out = {}
    for key in ("eval_accuracy", "eval_loss"):
        if series.get(key):
            out[key] = series[key][max(series[key])]
    return out


def run_one(config: str, overrides: list[str], workdir: pathlib.Path, *, progress: bool) -> dict:
    """Train one model; returns its row, or {"skipped": reason} when it cannot run."""
    try:
        experiment = load_experiment(config, overrides)
    except ValueError as e:  # the attention does not fit this model or task
        return {"skipped": f"does not build: {e}"}
    try:
        train(experiment, workdir, progress=progress)
    except Exception as e:  # noqa: BLE001 -- one failing attention must not end the comparison
        traceback.print_exc(file=sys.stderr)
        first_line = str(e).splitlines()[0] if str(e) else ""
        if type(e) is ValueError:  # the library's word for a setting it refuses (checked while building)
            return {"skipped": f"does not build: {first_line}"}
        return {"skipped": f"failed in training: {type(e).__name__}: {first_line}"}
    stats = _step_stats(workdir)
    row = _final_eval(workdir) | stats
    if stats.get("step_ms"):
        row["steps_per_s"] = 1e3 / stats["step_ms"]
    return row


def table(rows: dict[str, dict], scores: dict[str, float]) -> str:
    """The markdown table: one line per model that ran (best accuracy first), then the baselines."""
    ran = {k: r for k, r in rows.items() if "skipped" not in r}
    lines = ["| model | eval accuracy | eval loss | steps/s | step temp MiB |", "|---|---:|---:|---:|---:|"]
    nan = float("nan")
    for name in sorted(ran, key=lambda k: -ran[k].get("eval_accuracy", -1.0)):
        r = ran[name]
        lines.append(
            f"| {name} | {r.get('eval_accuracy', nan):.3f} | {r.get('eval_loss', nan):.3f} "
            f"| {r.get('steps_per_s', nan):.2f} | {r.get('step_temp_mib', nan):.1f} |"
        )
    lines += [f"| baseline: {name.replace('_', ' ')} | {value:.3f} | | | |" for name, value in scores.items()]
    skipped = {k: r["skipped"] for k, r in rows.items() if "skipped" in r}
    if skipped:
        lines += ["", "Skipped:", ""] + [f"* {name}: {reason}" for name, reason in skipped.items()]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jxformers compare", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="an experiment name in experiments/ (e.g. lra_listops) or a YAML path")
    p.add_argument(
        "--attentions",
        nargs="+",
        default=["all"],
        metavar="NAME",
        help="registered attentions to train, or 'all' (default)",
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
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="overrides for every run, e.g. --set preset=tiny --set train.steps=100",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        runs = candidates(args.attentions, fourier=not args.no_fourier)
        experiment = load_experiment(args.config, args.overrides)
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
    rows = {}
    for i, (name, overrides) in enumerate(runs.items()):
        print(f"== [{i + 1}/{len(runs)}] {name}: {t.steps} steps in {root / name}", file=sys.stderr)
        rows[name] = run_one(args.config, [*args.overrides, *overrides], root / name, progress=not args.no_progress)
        waiting = list(runs)[i + 1 :]  # the table so far, so that a stopped comparison still has one
        note = f"\nNot run yet: {', '.join(waiting)}.\n" if waiting else ""
        (root / "compare.md").write_text(intro + table(rows, scores) + "\n" + note)
    text = (root / "compare.md").read_text()
    print(text)
    ran = {name: r for name, r in rows.items() if "skipped" not in r}
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
        print(f"curves: {plot_runs([root / n for n in ran], root / 'curves.png', labels=list(ran))}", file=sys.stderr)
    print(f"table: {root / 'compare.md'}", file=sys.stderr)
    return 0
