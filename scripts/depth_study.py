"""The norms and residual schemes of Lin et al. 2021 ("A Survey of Transformers", arXiv
2106.04554, section 5.2) trained side by side at two depths: the comparison the survey
describes (post-norm needs care when deep, pre-norm and the norm-free schemes train
without it), measured here on generated ListOps at the tiny preset's size.

Each variant is one `model.norm` setting (`jxformers.nn.residual`) on the tiny ListOps
classifier (`lra_listops`, preset tiny, d_model 64), trained at each depth from each seed
with the same data, optimiser and schedule. A run that produces a non-finite loss stops
(`NonFiniteError`) and counts as diverged. The table gives the final eval accuracy and
loss (mean ± standard deviation over the seeds that finished), the train loss at the end,
and which seeds diverged; the plot, the train loss curves of every run.

    python scripts/depth_study.py --out docs/depth_study.md --plot docs/depth_study.png
    python scripts/depth_study.py --layers 4 12 24 --only pre post admin --norms layernorm scalenorm adanorm

About 2.5 minutes a run at depth 16 on a 2-core CPU (seeds after the first load the
first one's compiled programs): the whole study takes about an hour.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import shlex
import statistics
import sys
import tempfile
import time

import jax

from jxformers.nn.layers import NORM_KINDS
from jxformers.tools.demo import shared_compilation
from jxformers.train import NonFiniteError, load_experiment, train
from jxformers.train.workdir import read_metrics_log

# label -> the model.norm overrides (each a scheme of jxformers.nn.residual, or a norm kind)
VARIANTS = {
    "post": ["model.norm.placement=post"],
    "pre": ["model.norm.placement=pre"],
    "sandwich": ["model.norm.placement=sandwich"],
    "normformer": ["model.norm.placement=normformer"],
    "rezero": ["model.norm.placement=rezero", "model.norm.final=false"],
    "tfixup": ["model.norm.placement=tfixup", "model.norm.final=false"],
    "deepnorm": ["model.norm.placement=deepnorm"],
    "admin": ["model.norm.placement=admin"],
    "fixup": ["model.norm.placement=fixup", "model.norm.final=false"],
    "pre, scalenorm": ["model.norm.placement=pre", "model.norm.kind=scalenorm"],
    "post, adanorm": ["model.norm.placement=post", "model.norm.kind=adanorm"],
    "pre, powernorm": ["model.norm.placement=pre", "model.norm.kind=powernorm"],
}


def variants(only: list[str] | None, norms: list[str] | None) -> dict[str, list[str]]:
    """label -> overrides of the rows to run: `only`'s (default every row of VARIANTS),
    and with `norms`, each of those schemes once per norm kind instead ("pre, scalenorm":
    the scheme's overrides and `model.norm.kind`; a row that names its kind keeps it)."""
    chosen = {label: VARIANTS[label] for label in only or VARIANTS}
    if not norms:
        return chosen
    out = {}
    for label, overrides in chosen.items():
        if any(o.startswith("model.norm.kind=") for o in overrides):
            out[label] = overrides
            continue
        for kind in norms:
            out[label if kind == "layernorm" else f"{label}, {kind}"] = [*overrides, f"model.norm.kind={kind}"]
    return out


def run(label: str, overrides: list[str], depth: int, seed: int, root: pathlib.Path, extra: list[str]) -> dict:
    overrides = ["preset=tiny", *overrides, f"model.num_layers={depth}", f"train.seed={seed}", *extra]
    experiment = load_experiment("lra_listops", overrides)
    workdir = root / f"{label.replace(', ', '_')}_L{depth}_s{seed}"
    started = time.perf_counter()
    try:
        summary = train(experiment, workdir, progress=False)
        diverged = None
    except NonFiniteError as e:
        summary, diverged = {}, str(e).split(";")[0]
    records = read_metrics_log(workdir)
    curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
    return {
        "label": label,
        "depth": depth,
        "seed": seed,
        "eval_accuracy": summary.get("eval_accuracy"),
        "eval_loss": summary.get("eval_loss"),
        "final_loss": curve[-1][1] if curve and diverged is None else None,
        "diverged": diverged,
        "curve": curve,
        "seconds": time.perf_counter() - started,
    }


def _mean(values: list[float]) -> str:
    if not values:
        return "-"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {spread:.3f}"


def table(results: list[dict], depths: list[int]) -> str:
    lines = [
        "| scheme | depth | eval accuracy | eval loss | final train loss | diverged | s a run |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for label in dict.fromkeys(r["label"] for r in results):  # in run order
        for depth in depths:
            rows = [r for r in results if r["label"] == label and r["depth"] == depth]
            if not rows:
                continue
            done = [r for r in rows if r["diverged"] is None]
            diverged = ", ".join(f"seed {r['seed']}" for r in rows if r["diverged"] is not None) or "none"
            lines.append(
                f"| {label} | {depth} | {_mean([r['eval_accuracy'] for r in done])} "
                f"| {_mean([r['eval_loss'] for r in done])} | {_mean([r['final_loss'] for r in done])} "
                f"| {diverged} | {statistics.fmean(r['seconds'] for r in rows):.0f} |"
            )
    return "\n".join(lines)


def plot(results: list[dict], depths: list[int], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(depths), figsize=(6 * len(depths), 4.5), sharey=True, squeeze=False)
    labels = list(dict.fromkeys(r["label"] for r in results))
    colors = dict(zip(labels, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2, strict=False))
    for ax, depth in zip(axes[0], depths, strict=True):
        for r in results:
            if r["depth"] != depth or not r["curve"]:
                continue
            steps, losses = zip(*r["curve"], strict=True)
            first = r["seed"] == min(x["seed"] for x in results if x["label"] == r["label"])
            ax.plot(steps, losses, color=colors[r["label"]], alpha=0.7, label=r["label"] if first else None)
        ax.set_title(f"{depth} layers")
        ax.set_xlabel("step")
        ax.set_ylim(top=3.5)
    axes[0][0].set_ylabel("train loss (ListOps, 10 classes)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see `main`)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layers", "--depths", dest="depths", type=int, nargs="+", default=[4, 16],
        help="numbers of layers, e.g. 4 12 24 (default 4 16)",
    )  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, help="seeds per scheme and depth (default 3)")
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), help="these schemes only")
    p.add_argument(
        "--norms", nargs="+", choices=NORM_KINDS,
        help="run each scheme once per norm kind (rows 'pre, scalenorm', ...; default: the rows as listed)",
    )  # fmt: skip
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE", help="more overrides")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    p.add_argument("--out", help="write the markdown report here")
    p.add_argument("--plot", help="write the loss curves here (PNG)")
    args = p.parse_args(argv)
    if any(d < 1 for d in args.depths):
        p.error(f"--layers must be positive; got {args.depths}")
    if args.seeds < 1:
        p.error(f"--seeds must be at least 1; got {args.seeds}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = variants(args.only, args.norms)
    results = []
    with tempfile.TemporaryDirectory(prefix="jxformers-depth-") as tmp, shared_compilation(pathlib.Path(tmp) / "cache"):
        root = pathlib.Path(args.workdir or tmp)
        for depth in args.depths:
            for label, overrides in rows.items():
                for seed in range(args.seeds):
                    r = run(label, overrides, depth, seed, root, args.extra)
                    results.append(r)
                    state = (
                        f"diverged ({r['diverged']})" if r["diverged"] else f"eval accuracy {r['eval_accuracy']:.3f}"
                    )
                    print(f"{label}, {depth} layers, seed {seed}: {state} in {r['seconds']:.0f} s", flush=True)
    report = table(results, args.depths)
    command = "python scripts/depth_study.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    head = (
        f"Command: `{command}`  \nMachine: {platform.platform()}, jax {jax.__version__} on "
        f"{jax.default_backend()}  \nDate: {time.strftime('%Y-%m-%d')}\n\n"
    )
    print(report)
    if args.out:
        pathlib.Path(args.out).write_text(f"<!-- generated by: {command} -->\n{head}{report}\n")
    if args.plot:
        plot(results, args.depths, pathlib.Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
