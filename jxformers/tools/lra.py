"""`jxformers lra`: the Long Range Arena (Tay et al. 2021, "Long Range Arena: A Benchmark
for Efficient Transformers") as one command, offline. It trains every chosen task x
attention x seed at one preset, each run in its own work directory (a rerun resumes the
unfinished runs and reuses the finished ones), and writes one table in LRA's layout:
per-task accuracy (mean ± sd over seeds), the average, the tasks' baselines, then step
time and train-step memory per attention and task. It also writes the rows as JSON, LRA's
figure (average accuracy against speed, point area memory), and prints the published LRA
and Fourier Transformer numbers beside ours, marked as other data where our task is a
stand-in.

The tasks are experiment configs (jxformers/experiments/lra_*.yaml). Text, Retrieval and
Image are stand-ins of LRA's shapes built from data these machines can have: Shakespeare's
plays for IMDB reviews and the ACL Anthology Network's papers, Fashion-MNIST for CIFAR-10.
Presets: `cpu` (each task learnable in minutes on a 2-core CPU, at shorter lengths than
LRA's), `paper` (LRA's per-task models and training, for a GPU) and `tiny` (a miniature
for tests). Each attention runs with the hyper-parameters the registry gives for the
task's length (`registry.scaled`, through `compare.candidates`), stated under the table;
one that cannot be sparse at a task's length is listed as skipped there, not run dense.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys

from jxformers.data.baselines import baselines
from jxformers.tools.compare import FOURIER, _summarised, candidates, run_one
from jxformers.tools.demo import eval_examples
from jxformers.tools.help_text import add_overrides, description
from jxformers.tools.plot import plot_tradeoff
from jxformers.train import load_experiment

# task -> its experiment config (LRA's five, then Path-X, which LRA reports every model failing)
TASKS = {
    "listops": "lra_listops",
    "text": "lra_text",
    "retrieval": "lra_retrieval",
    "image": "lra_image",
    "pathfinder": "lra_pathfinder",
    "pathx": "lra_pathx",
}
FIVE = ("listops", "text", "retrieval", "image", "pathfinder")
# what stands in for LRA's data (the tasks not listed are generated as LRA generates them)
STAND_INS = {
    "text": "byte-level comedy vs tragedy excerpts of Shakespeare's plays, for IMDB reviews",
    "retrieval": "same-play matching of two excerpts of Shakespeare's plays, for the ACL Anthology Network",
    "image": "Fashion-MNIST padded to 32x32, for grayscale CIFAR-10",
}
DEFAULT_ATTENTIONS = ("softmax", "local", "linear", "performer", "bigbird", "nystrom")

# Published accuracies (%), LRA's five tasks in FIVE's order, and the published average:
# He et al. 2023, "Fourier Transformer: Fast Long Range Modeling by Removing Sequence
# Redundancy with FFT Operator", Table 1, whose rows Transformer to Performer come from Tay
# et al. 2021's Table 1 and the others from each model's paper. Keyed by our candidate's
# name. Two cells differ from their sources, whose averages they break: He et al. print
# Performer's Pathfinder as 77.50 and Luna's as 77.32, but the averages they print (51.41,
# 61.24) are those of Tay et al.'s 77.05 and Ma et al.'s 77.72, used here. FNet's five cells
# average 55.35 against its printed 55.30; both are left as printed.
PUBLISHED_SOURCE = "He et al. 2023, Table 1 (Transformer to Performer from Tay et al. 2021, Table 1)"
PUBLISHED = {
    "softmax": ("Transformer", (36.37, 64.27, 57.46, 42.44, 71.40), 54.39),
    "longformer": ("Longformer", (35.63, 62.85, 56.89, 42.22, 69.71), 53.46),
    "linformer": ("Linformer", (35.70, 53.94, 52.27, 38.56, 76.34), 51.36),
    "lsh": ("Reformer", (37.27, 56.10, 53.40, 38.07, 68.50), 50.67),
    "synthesizer": ("Synthesizer", (36.99, 61.68, 54.67, 41.61, 69.45), 52.88),
    "bigbird": ("BigBird", (36.05, 64.02, 59.29, 40.83, 74.87), 55.01),
    "performer": ("Performer", (18.01, 65.40, 53.82, 42.77, 77.05), 51.41),
    "fnet": ("FNet", (35.55, 65.11, 59.61, 38.67, 77.80), 55.30),
    "nystrom": ("Nyströmformer", (37.15, 65.52, 79.56, 41.58, 70.94), 58.95),
    "luna": ("Luna-256", (37.25, 64.57, 79.29, 47.38, 77.72), 61.24),
    "fsat": ("FSAT", (46.85, 65.95, 81.11, 49.97, 77.32), 64.24),
    FOURIER[0]: ("Fourier Transformer", (40.73, 75.02, 85.35, 53.17, 83.43), 67.54),
}


def summary(results: dict) -> dict[str, dict[str, dict[str, float]]]:
    """candidate -> task -> its seeds as one row (`compare`'s: each metric's mean and, under
    "<metric>_sd", its standard deviation), with `accuracy` / `accuracy_sd` for the eval
    accuracy; a candidate skipped on a task: {"skipped": reason}; not run yet: {}."""
    out: dict[str, dict[str, dict]] = {}
    for task, entry in results["tasks"].items():
        for name, rows in entry["runs"].items():
            cell = _summarised(rows) if rows else {}
            if "eval_accuracy" in cell:
                cell["accuracy"], cell["accuracy_sd"] = cell["eval_accuracy"], cell["eval_accuracy_sd"]
            out.setdefault(name, {})[task] = cell
    return out


def _average(cells: dict[str, dict], tasks: list[str]) -> float | None:
    """The mean accuracy over `tasks`, or None unless every task has one (LRA's Avg.)."""
    values = [cells.get(t, {}).get("accuracy") for t in tasks]
    return None if any(v is None for v in values) else statistics.fmean(values)  # type: ignore[arg-type]


def _title(task: str) -> str:
    return {"listops": "ListOps", "pathx": "Path-X"}.get(task, task.capitalize()) + ("*" if task in STAND_INS else "")


def table(results: dict) -> str:
    """The Markdown report: header (preset, seeds, machine, settings), LRA's accuracy table
    with the baselines, step time and memory, and the published numbers."""
    tasks = list(results["tasks"])
    rows = summary(results)
    seeds = results["seeds"]
    lines = [
        f"# Long Range Arena, preset `{results['preset']}`",
        "",
        f"Command: `{results['command']}`  ",
        f"Machine: {results['machine']}  ",
        (
            f"Seeds {results['first_seed']}..{results['first_seed'] + seeds - 1} per model and task; accuracy on each "
            "task's eval split (mean ± sd over seeds)"
            if seeds > 1
            else f"Seed {results['first_seed']} alone; accuracy on each task's eval split"
        )
        + "; Avg. is the mean over the tasks, given only where every task "
        "finished. * marks a stand-in task (below): compare its numbers with the published ones as other data.",
        "",
    ]
    lines += [f"* {_title(t)}: {STAND_INS[t]}." for t in tasks if t in STAND_INS]
    lines += [
        "",
        "| model | " + " | ".join(_title(t) for t in tasks) + " | Avg. |",
        "|---|" + "---:|" * (len(tasks) + 1),
    ]
    ranked = sorted(rows, key=lambda n: -(_average(rows[n], tasks) or -1.0))
    for name in ranked:
        cells = []
        for t in tasks:
            c = rows[name].get(t, {})
            if "accuracy" in c:
                spread = f" ± {100 * c['accuracy_sd']:.2f}" if seeds > 1 else ""
                cells.append(f"{100 * c['accuracy']:.2f}{spread}")
            else:
                cells.append("skipped" if "skipped" in c else "-")
        avg = _average(rows[name], tasks)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'-' if avg is None else f'{100 * avg:.2f}'} |")
    names = sorted({b for t in tasks for b in results["tasks"][t].get("baselines", {})})
    for b in names:
        cells = []
        for t in tasks:
            v = results["tasks"][t].get("baselines", {}).get(b)
            cells.append("-" if v is None else f"{100 * v:.2f}")
        lines.append(f"| baseline: {b.replace('_', ' ')} | " + " | ".join(cells) + " | |")
    lines += [
        "",
        "Step time (ms, median after compilation) and train-step memory (MiB, XLA's compiled temporary "
        "allocation), mean over seeds:",
        "",
        "| model | " + " | ".join(f"{_title(t)} ms | {_title(t)} MiB" for t in tasks) + " |",
        "|---|" + "---:|" * (2 * len(tasks)),
    ]
    for name in ranked:
        cells = []
        for t in tasks:
            c = rows[name].get(t, {})
            cells.append(f"{c['step_ms']:.1f}" if "step_ms" in c else "-")
            cells.append(f"{c['step_temp_mib']:.1f}" if "step_temp_mib" in c else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Settings (each task's experiment at the preset, its length and budget, each attention's settings):",
        "",
    ]
    for t in tasks:
        entry = results["tasks"][t]
        where = f"`{entry['experiment']}`, max_len {entry['max_len']}, {entry['budget']}"
        lines.append(f"* {_title(t)}: {where}. {entry['settings']}")
    skipped = [(n, t, c["skipped"]) for n in ranked for t, c in rows[n].items() if "skipped" in c]
    if skipped:
        lines += ["", "Skipped:", ""] + [f"* {n} on {t}: {why}" for n, t, why in skipped]
    lines += ["", published_table(tasks)]
    return "\n".join(lines) + "\n"


def published_table(tasks: list[str]) -> str:
    """The published accuracies of the chosen tasks (other data: other models' sizes,
    LRA's real data where ours is a stand-in), for reference beside ours."""
    shown = [t for t in tasks if t in FIVE]
    if not shown:
        return ""
    lines = [
        f"Published (%, {PUBLISHED_SOURCE}; LRA's data and models, a GPU or TPU budget: other data, not "
        "comparable number for number; * our task is a stand-in):",
        "",
        "| ours | published model | " + " | ".join(_title(t) for t in shown) + " | Avg. (all five) |",
        "|---|---|" + "---:|" * (len(shown) + 1),
    ]
    for name, (model, values, average) in PUBLISHED.items():
        cells = [f"{values[FIVE.index(t)]:.2f}" for t in shown]
        lines.append(f"| {name} | {model} | " + " | ".join(cells) + f" | {average:.2f} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, out: pathlib.Path) -> pathlib.Path | None:
    """LRA's figure: average accuracy (y) against the geometric mean over the tasks of the
    training steps per second (x), point area the mean train-step memory; models that did
    not finish every task are left out."""
    tasks = list(results["tasks"])
    rows = summary(results)
    points = {}
    for name, cells in rows.items():
        avg = _average(cells, tasks)
        times = [cells[t].get("step_ms") for t in tasks]
        if avg is None or any(t is None for t in times):
            continue
        speed = math.exp(statistics.fmean(-math.log(t / 1e3) for t in times))  # type: ignore[operator]
        memory = statistics.fmean(cells[t].get("step_temp_mib", 0.0) for t in tasks)
        points[name] = (speed, avg, memory)
    if not points:
        return None
    return plot_tradeoff(points, out, title=f"Long Range Arena, preset {results['preset']} ({', '.join(tasks)})")


def machine() -> str:
    """The machine in words: processor, cores, the JAX device and version."""
    import jax

    device = jax.devices()[0]
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} on "
        f"{device.platform} ({device.device_kind})"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jxformers lra", description=description(__doc__))
    p.add_argument(
        "--tasks",
        nargs="+",
        default=list(FIVE),
        metavar="TASK",
        help=f"tasks to run, of {list(TASKS)} (default: LRA's five, {' '.join(FIVE)})",
    )
    p.add_argument(
        "--attentions",
        nargs="+",
        default=list(DEFAULT_ATTENTIONS),
        metavar="NAME",
        help="registered attentions, or 'all' (default: %(default)s); the Fourier Transformer is added "
        "unless --no-fourier",
    )
    p.add_argument("--no-fourier", action="store_true", help="leave out the Fourier Transformer")
    p.add_argument("--seeds", type=int, default=3, help="seeds per model and task (default %(default)s)")
    p.add_argument(
        "--preset",
        default="cpu",
        help="the experiments' preset: cpu (minutes each on a CPU), paper (LRA's models, for a GPU), tiny "
        "(default %(default)s)",
    )
    p.add_argument(
        "--workdir",
        default="runs/lra",
        help="TASK/MODEL/seedS run directories, lra.md, lra.json and lra.png go here (default %(default)s)",
    )
    add_overrides(p, "overrides for every run of every task, e.g. --set train.steps=100")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _plan(args) -> dict:
    """Every task's experiment loaded (preset and overrides applied) and its candidates:
    all checked before a run starts or a file is written."""
    unknown = [t for t in args.tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {list(TASKS)}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be at least 1; got {args.seeds}")
    plan = {}
    for task in dict.fromkeys(args.tasks):
        config = TASKS[task]
        try:
            experiment = load_experiment(config, [f"preset={args.preset}", *args.overrides])
        except ValueError as e:
            raise ValueError(f"task {task} ({config}): {e}") from e
        runs = candidates(
            args.attentions, fourier=not args.no_fourier, max_len=experiment.model.max_len, overrides=args.overrides
        )
        plan[task] = (config, experiment, runs)
    return plan


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        plan = _plan(args)
    except ValueError as e:
        p.error(str(e))
    root = pathlib.Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    first_seed = next(iter(plan.values()))[1].train.seed
    results: dict = {
        "preset": args.preset,
        "seeds": args.seeds,
        "first_seed": first_seed,
        "command": "jxformers lra " + " ".join(argv if argv is not None else sys.argv[2:]),
        "machine": machine(),
        "tasks": {},
    }
    for task, (config, experiment, runs) in plan.items():
        t = experiment.train
        known = root / task / "baselines.json"  # the baselines of a resumed suite are read back, not redrawn
        if known.is_file():
            scores = json.loads(known.read_text())
        else:
            train_source, eval_source = experiment.sources()
            scores = baselines(
                train_source, eval_source, records=eval_examples(experiment), workers=experiment.data.workers
            )
            known.parent.mkdir(parents=True, exist_ok=True)
            known.write_text(json.dumps(scores, indent=1))
        results["tasks"][task] = {
            "experiment": config,
            "max_len": experiment.model.max_len,
            "budget": f"{t.steps} steps of batch {t.batch_size}, {eval_examples(experiment)} eval examples",
            "baselines": scores,
            "candidates": dict(runs),
            "settings": runs.describe(experiment.model.max_len),
            "runs": {name: [{"skipped": why}] for name, why in runs.skipped.items()},
        }
    for task, (config, experiment, runs) in plan.items():
        entry = results["tasks"][task]
        for i, (name, overrides) in enumerate(runs.items()):
            entry["runs"][name] = []
            first = experiment.train.seed  # each task's own (the table's header gives the first task's)
            for seed in range(first, first + args.seeds):
                workdir = root / task / name / f"seed{seed}"
                print(f"== {task} [{i + 1}/{len(runs)}] {name}, seed {seed}: {workdir}", file=sys.stderr)
                made = [f"preset={args.preset}", *args.overrides, *overrides, f"train.seed={seed}"]
                entry["runs"][name].append(run_one(config, made, workdir, progress=not args.no_progress))
                _write(results, root)  # a stopped suite still has its table so far
    _write(results, root)
    print((root / "lra.md").read_text())
    figure = plot(results, root / "lra.png")
    if figure is not None:
        print(f"plot: {figure}", file=sys.stderr)
    print(f"table: {root / 'lra.md'}; rows: {root / 'lra.json'}", file=sys.stderr)
    return 0


def _write(results: dict, root: pathlib.Path) -> None:
    (root / "lra.json").write_text(json.dumps(results, indent=1))
    (root / "lra.md").write_text(table(results))
