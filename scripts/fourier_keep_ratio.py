"""The keep-ratio sweep of the Fourier Transformer: He et al. 2023, "Fourier Transformer:
Fast Long Range Modeling by Removing Sequence Redundancy with FFT Operator" (arXiv
2305.15099), section 5.3 and Figure 3, which sweeps the share r of frequency components
the spectral filter keeps and finds the model stable down to about r = 0.3.

Here on one LRA task (default `lra_listops`): for each r, softmax attention with the
filter before block 0 keeping ceil(r n) tokens (`model.stack.filters={0: r}`), and the same
model without the filter, each trained from `--seeds` seeds with the same data and budget
by `jxformers compare`'s `run_one`; then a table of r against the final eval accuracy
(mean ± sd over the seeds), steps/s relative to the model without the filter, the train
step's compiled temporary memory and its FLOPs per token, and a plot of accuracy and
speed against r. `compare`'s own table of the same runs follows.

    python scripts/fourier_keep_ratio.py --set preset=tiny --seeds 3 \\
        --doc docs/fourier_analyses.md --plot docs/fourier_keep_ratio.png

Steps/s are measured on a shared machine: compare them only within one run of this
script. At the tiny preset (about 40 s a run on a 2-core CPU) the sequences are 11-59
tokens, where attention is a small part of a step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

from fourier_spectrum import header, write_section

from jxformers.data.baselines import baselines
from jxformers.tools.compare import run_one, table
from jxformers.tools.demo import eval_examples, shared_compilation
from jxformers.train import load_experiment

RATIOS = (0.1, 0.2, 0.3, 0.5, 0.75)
NO_FILTER = "no filter"  # the row of the model as configured: the speed reference (r = 1)


def sweep(ratios: list[float]) -> dict[str, list[str]]:
    """label -> the overrides of its model: the model as configured, then one filter per r."""
    bad = [r for r in ratios if not 0 < r <= 1]
    if bad or len(set(ratios)) != len(ratios):
        raise ValueError(f"keep ratios must be distinct and in (0, 1]; got {ratios}")
    return {NO_FILTER: []} | {f"r = {r:g}": [f"model.stack.filters={{0: {r:g}}}"] for r in sorted(ratios)}


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def sweep_table(rows: dict[str, list[dict]]) -> str:
    """Markdown: one line per label of `sweep` (in its order): eval accuracy mean ± sd,
    steps/s and train FLOPs per token relative to the no-filter row's means, step memory.
    A label with a skipped seed shows the reason; "-" where there is nothing to relate to."""
    reference: dict[str, float] = {}
    for key in ("steps_per_s", "flops_per_token"):
        values = [r[key] for r in rows.get(NO_FILTER, []) if key in r]
        if values:
            reference[key] = statistics.fmean(values)

    def relative(value: float | None, key: str) -> str:
        return "-" if value is None or key not in reference else f"{value / reference[key]:.2f}"

    lines = [
        "| keep ratio r | eval accuracy | steps/s | steps/s relative | step temp MiB | train FLOPs/token relative |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, runs in rows.items():
        skipped = [r["skipped"] for r in runs if "skipped" in r]
        if skipped:
            lines.append(f"| {label} | skipped: {skipped[0]} | | | | |")
            continue
        acc, acc_sd = _stats([r["eval_accuracy"] for r in runs])
        speed, speed_sd = _stats([r["steps_per_s"] for r in runs])
        memory = _stats([r["step_temp_mib"] for r in runs])[0]
        flops = _stats([r["flops_per_token"] for r in runs])[0] if all("flops_per_token" in r for r in runs) else None
        cells = [
            f"{acc:.3f} ± {acc_sd:.3f}",
            f"{speed:.2f} ± {speed_sd:.2f}",
            relative(speed, "steps_per_s"),
            f"{memory:.1f}",
            relative(flops, "flops_per_token"),
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict[str, list[dict]], scores: dict[str, float], path: pathlib.Path, title: str) -> None:
    """Accuracy (mean, sd bars; the baselines dashed) and steps/s relative to the
    no-filter model against r; the no-filter model at r = 1, marked apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = {k: v for k, v in rows.items() if not any("skipped" in r for r in v)}
    reference = _stats([r["steps_per_s"] for r in ran[NO_FILTER]])[0] if NO_FILTER in ran else None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    points = []
    for label, runs in ran.items():
        r = 1.0 if label == NO_FILTER else float(label.split("=")[1])
        points.append((r, label, *_stats([x["eval_accuracy"] for x in runs]), _stats([x["steps_per_s"] for x in runs])))
    filtered = sorted(p for p in points if p[1] != NO_FILTER)
    if filtered:
        left.errorbar(
            [p[0] for p in filtered],
            [p[2] for p in filtered],
            [p[3] for p in filtered],
            marker="o",
            capsize=3,
            label="with the filter",
        )
        if reference:
            right.plot([p[0] for p in filtered], [p[4][0] / reference for p in filtered], "o-", label="with the filter")
    for p in points:
        if p[1] == NO_FILTER:
            left.errorbar([1.0], [p[2]], [p[3]], marker="s", color="C3", capsize=3, linestyle="none", label=NO_FILTER)
            right.plot([1.0], [1.0], "s", color="C3", label=NO_FILTER)
    for i, (name, value) in enumerate(scores.items()):
        left.axhline(value, color="0.5", ls="--" if i == 0 else ":", lw=1, label=f"baseline: {name.replace('_', ' ')}")
    left.set(xlabel="keep ratio r", ylabel="eval accuracy", title=title)
    right.set(xlabel="keep ratio r", ylabel="steps/s relative to no filter")
    right.axhline(1.0, color="0.8", lw=0.8, zorder=0)
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="lra_listops", help="an experiment (default %(default)s)")
    p.add_argument(
        "--ratios", type=float, nargs="+", default=list(RATIOS), help="keep ratios in (0, 1] (default %(default)s)"
    )
    p.add_argument("--seeds", type=int, default=2, help="seeds per model (train.seed and the next ones; default 2)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="overrides for every run, e.g. --set preset=tiny",
    )  # fmt: skip
    p.add_argument(
        "--workdir", help="keep the runs here (a rerun reuses finished ones; default: a temporary directory)"
    )
    p.add_argument("--doc", help="write the tables into this page, between its keep-ratio:start and :end markers")
    p.add_argument("--plot", help="write the plot here (PNG)")
    p.add_argument("--json", help="write every run's row here (JSON)")
    p.add_argument("--progress", action="store_true", help="progress bars")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1; got {args.seeds}")
    try:
        args.runs = sweep(args.ratios)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    experiment = load_experiment(args.config, args.overrides)
    train_source, eval_source = experiment.sources()
    examples = eval_examples(experiment)
    scores = baselines(train_source, eval_source, records=examples, workers=experiment.data.workers)
    t = experiment.train
    seeds = range(t.seed, t.seed + args.seeds)
    rows: dict[str, list[dict]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="jxformers-keep-ratio-") as tmp,
        shared_compilation(pathlib.Path(tmp) / "cache"),
    ):
        root = pathlib.Path(args.workdir or tmp)
        for label, overrides in args.runs.items():
            name = "no_filter" if label == NO_FILTER else f"r{label.split('=')[1].strip()}"
            rows[label] = []
            for seed in seeds:
                print(f"== {label}, seed {seed}: {t.steps} steps in {root / name / f'seed{seed}'}", file=sys.stderr)
                made = [*args.overrides, *overrides, f"train.seed={seed}"]
                rows[label].append(run_one(args.config, made, root / name / f"seed{seed}", progress=args.progress))
    intro = (
        f"{header('fourier_keep_ratio.py', argv)}  \n{experiment.name}: {t.steps} steps of batch {t.batch_size}, "
        f"max_len {experiment.model.max_len}, seeds {seeds[0]}-{seeds[-1]} (mean ± sd), the same data for every "
        f"model; accuracy on {examples} eval examples. Steps/s: median after compilation; relative: to the "
        "no-filter model's mean. Memory: XLA's compiled temporary allocation of the train step."
    )
    report = f"{intro}\n\n{sweep_table(rows)}\n\n`jxformers compare`'s table of the same runs:\n\n{table(rows, scores)}"
    print(report)
    if args.doc:
        write_section(pathlib.Path(args.doc), "keep-ratio", report)
    if args.plot:
        plot(rows, scores, pathlib.Path(args.plot), f"{experiment.name}, {t.steps} steps")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"baselines": scores, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
