"""Training curves of several runs in one PNG (`jxformers plot DIR... --out FILE`): one
panel per metric, one line per work directory, read from each `metrics.jsonl` (for a
resumed run, the last record of each step wins)."""

from __future__ import annotations

import pathlib

from jxformers.train.workdir import METRICS, read_metrics_log

DEFAULT_METRICS = ("loss", "eval_accuracy")


def read_metrics(workdir: str | pathlib.Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} from `workdir/metrics.jsonl`."""
    if not (pathlib.Path(workdir) / METRICS).exists():
        raise ValueError(f"{workdir}: no {METRICS} (is it a `jxformers train` work directory?)")
    series: dict[str, dict[int, float]] = {}
    for record in read_metrics_log(workdir):
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(key, {})[int(record["step"])] = float(value)
    return series


def plot_runs(workdirs, out: str | pathlib.Path, *, metrics=DEFAULT_METRICS, labels=None) -> pathlib.Path:
    """Draw `metrics` of every run into `out` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_metrics(w) for w in workdirs]
    labels = labels or [pathlib.Path(w).name for w in workdirs]
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for run, label in zip(runs, labels, strict=True):
            if metric in run:
                steps = sorted(run[metric])
                ax.plot(steps, [run[metric][s] for s in steps], label=label, marker="." if len(steps) < 30 else None)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, out)


def plot_tradeoff(
    points: dict[str, tuple[float, float, float]],
    out: str | pathlib.Path,
    *,
    baselines: dict[str, float] | None = None,
    title: str = "",
) -> pathlib.Path:
    """Long Range Arena's figure: accuracy (y) against training steps per second (x, log
    scale), one labelled point per model with its area proportional to its memory, the
    baselines as dashed lines. `points`: label -> (steps/s, accuracy, memory bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    largest = max((m for _, _, m in points.values()), default=1) or 1
    for label, (speed, accuracy, memory) in points.items():
        ax.scatter(speed, accuracy, s=20 + 400 * memory / largest, alpha=0.5)
        ax.annotate(label, (speed, accuracy), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for name, value in (baselines or {}).items():
        ax.axhline(value, linestyle="--", color="grey", linewidth=0.8)
        ax.annotate(
            name.replace("_", " "),
            (0, value),
            xycoords=("axes fraction", "data"),
            fontsize=7,
            color="grey",
            xytext=(3, 2),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlabel("training steps / s (log scale)")
    ax.set_ylabel("eval accuracy")
    ax.set_title(f"{title} (point area: train-step memory)" if title else "point area: train-step memory")
    ax.grid(alpha=0.3)
    return _save(fig, out)


def _save(fig, out: str | pathlib.Path) -> pathlib.Path:
    """Write `fig` as a PNG to `out` (its folder made if needed), close it, return the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
