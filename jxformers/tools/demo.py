"""`make demo`: train softmax, linear-attention and Fourier-Transformer classifiers on
generated ListOps at a tiny size on a CPU (a few minutes), each from a few seeds, then
print a comparison table (eval accuracy as mean ± spread over the seeds, step time,
throughput, compiled step memory) with the task's baselines on the same eval examples
(majority class, root operator: `jxformers.data.baselines`), say which gaps are within
noise, and write the curves.

The Fourier Transformer here is softmax attention with the spectral filter before the
first block's attention keeping 20% of the sequence (`model.stack.filters={0: 0.2}`), as He et
al. 2023 ("Fourier Transformer: Fast Long Range Modeling by Removing Sequence Redundancy
with FFT Operator", arXiv 2305.15099) section 5.1.1 does ("80% of the input removed at
the first layer") and its official code (the filter inside layer 0, before its
attention): every block runs at 20% length.

`--attention NAME` (repeatable) adds a classifier with that registered attention at the
same settings, e.g. the learnable patterns: `jxformers demo --attention lsh --attention
routing --attention sinkhorn --attention clusterformer`. `--variant LABEL:KEY=VALUE;...`
(repeatable) adds one with those overrides, e.g. an attention option:
`--variant "adaptive span:model.attention.adaptive_span=32"`. A causal-only attention
(the delta rule: `delta`, `gated_delta`) trains a unidirectional classifier
(`model.causal=true`: every block causal, and `model.head.kind=last`: the last real
token's state is pooled), as RNN-like models are run on LRA; a line under the table names
those models.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import pathlib
import statistics
import sys

import jax
from jax.experimental.compilation_cache import compilation_cache

from jxformers import registry
from jxformers.data.baselines import baselines
from jxformers.tools.help_text import add_overrides
from jxformers.tools.plot import plot_runs
from jxformers.train import NonFiniteError, load_experiment, train
from jxformers.train.workdir import read_metrics_log

MODELS = {
    "softmax": [],
    "linear": ["model.attention=linear"],
    "fourier_transformer": ["model.stack.filters={0: 0.2}"],
}
SEEDS = 3
_JAX_MINOR = tuple(int(x) for x in jax.__version__.split(".")[:2])
# Two means differ clearly when their gap exceeds this many standard errors of the gap.
CLEAR_GAP_SE = 2.0


def _step_stats(workdir: pathlib.Path) -> dict[str, float]:
    timed = [r for r in read_metrics_log(workdir) if "step_ms" in r][1:]  # the first step includes compilation
    if not timed:
        return {}
    median = sorted(r["step_ms"] for r in timed)[len(timed) // 2]
    return {
        "step_ms": median,
        "tokens_per_s": sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2],
        "step_temp_mib": (timed[-1].get("step_temp_bytes") or 0) / 2**20,
    }


@contextlib.contextmanager
def shared_compilation(cache_dir: pathlib.Path):
    """Every seed of a model compiles the same programs: a persistent compilation cache
    in `cache_dir` lets the later seeds load the first one's executables instead of
    compiling again. A cache the user set up is left alone; ours is dropped on exit.
    None under jax 0.12: jaxlib 0.12.0.1 sometimes segfaults in LoadedExecutable.serialize()
    while writing to the cache (seen in the test suite, as tests/conftest.py says)."""
    if jax.config.jax_compilation_cache_dir or _JAX_MINOR >= (0, 12):
        yield
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


def run_dir(root: pathlib.Path, name: str, seed_index: int) -> pathlib.Path:
    """The first seed's run is `root/name`; the others `root/name_seedS`."""
    return root / (name if seed_index == 0 else f"{name}_seed{seed_index}")


def eval_examples(experiment) -> int:
    """How many eval examples the train loop's evaluation sees (whole batches only)."""
    t, size = experiment.train, experiment.data.eval_size
    batch = min(t.batch_size, size)
    return min(t.eval_batches, size // batch) * batch


def standard_error(accuracies: list[float], examples: int) -> float:
    """Standard error of the mean accuracy over seeds: the seed-to-seed variance over the
    number of seeds, plus the binomial sampling error of `examples` eval examples (a floor
    that keeps a few lucky seeds that agree from looking certain). The accuracy is
    smoothed by half an example each way so that 0.0 or 1.0 still has an error."""
    p = (statistics.fmean(accuracies) * examples + 0.5) / (examples + 1)
    seeds = statistics.variance(accuracies) / len(accuracies) if len(accuracies) > 1 else 0.0
    return math.sqrt(seeds + p * (1 - p) / examples)


def noise_verdict(accuracies: dict[str, list[float]], examples: int) -> str:
    """A plain sentence per pair of models: a clear gap, or within noise."""
    se = {name: standard_error(a, examples) for name, a in accuracies.items()}
    mean = {name: statistics.fmean(a) for name, a in accuracies.items()}
    clear, noise = [], []
    for a, b in itertools.combinations(sorted(mean, key=mean.get, reverse=True), 2):
        gap, gap_se = mean[a] - mean[b], math.hypot(se[a], se[b])
        (clear if gap > CLEAR_GAP_SE * gap_se else noise).append(f"{a} - {b} = {gap:+.3f} ({gap / gap_se:.1f} SE)")
    how = (
        f"mean eval accuracy over {len(next(iter(accuracies.values())))} seeds; a gap is clear above "
        f"{CLEAR_GAP_SE:g} standard errors (seed spread and the sampling error of {examples} eval examples)"
    )
    if not clear:
        return f"Every gap is within noise, so this run does not rank the models: {'; '.join(noise)} ({how})."
    text = f"Clear: {'; '.join(clear)}."
    return text + (f" Within noise: {'; '.join(noise)}." if noise else "") + f" ({how})"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`LABEL:KEY=VALUE;KEY=VALUE` -> (label, overrides); ValueError showing the text."""
    label, sep, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    if not sep or not label.strip() or not overrides or any("=" not in o for o in overrides):
        raise ValueError(f"--variant wants LABEL:KEY=VALUE[;KEY=VALUE...]; got {text!r}")
    return label.strip(), overrides


# What a causal-only attention's classifier adds: a unidirectional encoder read at its last real token.
UNIDIRECTIONAL = ["model.causal=true", "model.head.kind=last"]


def _attention_overrides(name: str) -> list[str]:
    """The overrides of `--attention NAME`: that attention; a causal-only one (ValueError
    for an unregistered name) in a unidirectional encoder (`UNIDIRECTIONAL`)."""
    causal_only = registry.get(name).causal_only
    return [f"model.attention={name}", *(UNIDIRECTIONAL if causal_only else [])]


def _models(attentions: list[str], variants: tuple[str, ...] | list[str] = ()) -> dict[str, list[str]]:
    """MODELS plus one model per attention named with --attention and per --variant."""
    extra = {name: _attention_overrides(name) for name in attentions if name not in MODELS}
    return MODELS | extra | dict(parse_variant(v) for v in variants)


def unidirectional(models: dict[str, list[str]]) -> list[str]:
    """The models of `models` whose encoder is causal (`model.causal=true` among their overrides)."""
    return [name for name, overrides in models.items() if "model.causal=true" in overrides]


def _train_all(root: pathlib.Path, args) -> dict[str, tuple[list[dict], list[dict]]]:
    """(summaries, step stats) per seed, for each model."""
    results = {}
    for name, overrides in _models(args.attentions, args.variants).items():
        summaries, stats = [], []
        for s in range(args.seeds):
            experiment = load_experiment("lra_listops", ["preset=tiny", *overrides, *args.overrides, f"train.seed={s}"])
            workdir = run_dir(root, name, s)
            print(f"== {name}, seed {s}: training {experiment.train.steps} steps in {workdir}", file=sys.stderr)
            try:
                summaries.append(train(experiment, workdir, progress=not args.no_progress))
            except NonFiniteError as e:  # one diverging option is a result, not the end of the comparison
                print(f"jxformers demo: {name}, seed {s} stopped: {e}", file=sys.stderr)
                summaries.append({"stopped": str(e).split(";")[0]})
            stats.append(_step_stats(workdir))
        results[name] = (summaries, stats)
    return results


def _row(name, summaries, stats) -> str:
    """A model's table row; a seed that stopped on non-finite values shows as `stopped`
    and is left out of the mean."""
    acc = [s["eval_accuracy"] for s in summaries if "eval_accuracy" in s]
    per_seed = " ".join(f"{s['eval_accuracy']:.3f}" if "eval_accuracy" in s else "stopped" for s in summaries)
    nan = float("nan")
    loss = statistics.fmean([s["eval_loss"] for s in summaries if "eval_loss" in s] or [nan])
    spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
    t = stats[0]
    return (
        f"| {name} | {statistics.fmean(acc or [nan]):.3f} ± {spread:.3f} | {per_seed} "
        f"| {loss:.3f} | {t.get('step_ms', float('nan')):.1f} | {t.get('tokens_per_s', float('nan')):,.0f} "
        f"| {t.get('step_temp_mib', float('nan')):.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jxformers demo", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workdir",
        default="runs/demo",
        help="one sub-directory per model and seed (NAME, NAME_seed1, ...), and demo.png",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=SEEDS,
        help="training seeds per model (train.seed 0, 1, ...); the table shows mean ± standard "
        "deviation over them (default %(default)s)",
    )
    add_overrides(p, "extra overrides for every run, e.g. train.steps=50")
    p.add_argument(
        "--attention",
        dest="attentions",
        action="append",
        default=[],
        metavar="NAME",
        help="also train a classifier with this registered attention (repeatable), e.g. lsh, routing, "
        "sinkhorn, clusterformer",
    )
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE;...",
        help="also train a classifier with these overrides (repeatable), e.g. "
        '"adaptive span:model.attention.adaptive_span=32"',
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    for text in args.variants:
        try:
            label, overrides = parse_variant(text)
            load_experiment("lra_listops", ["preset=tiny", *overrides, *args.overrides])
        except ValueError as e:
            p.error(str(e))
    for name in args.attentions:  # before any model trains
        try:
            load_experiment("lra_listops", ["preset=tiny", *_attention_overrides(name), *args.overrides])
        except ValueError as e:
            p.error(f"--attention {name}: {e}")
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1; got {args.seeds}")
    root = pathlib.Path(args.workdir)
    with shared_compilation(root / "compile_cache"):
        results = _train_all(root, args)
    lines = [
        f"| model | eval accuracy (mean ± sd, {args.seeds} seeds) | per seed | eval loss | step ms | tokens/s "
        "| step temp MiB |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    lines += [_row(name, summaries, stats) for name, (summaries, stats) in results.items()]
    experiment = load_experiment("lra_listops", ["preset=tiny", *args.overrides])
    train_source, eval_source = experiment.sources()
    examples = eval_examples(experiment)
    scores = baselines(train_source, eval_source, records=examples, workers=experiment.data.workers)
    lines += [f"| baseline: {name.replace('_', ' ')} | {value:.3f} | | | | | |" for name, value in scores.items()]
    causal = unidirectional(_models(args.attentions, args.variants))
    if causal:
        lines.append(
            f"\nUnidirectional (a causal encoder, its last real token pooled; the others bidirectional): "
            f"{', '.join(causal)}"
        )
    shown = ", ".join(f"{name.replace('_', ' ')} {value:.3f}" for name, value in scores.items())
    print(
        f"\nListOps, tiny preset (expressions of {eval_source.min_length + 1}-{eval_source.max_length - 1} tokens); "
        f"accuracy on {examples} eval examples; what cheap predictors score on them (baselines): {shown}\n"
    )
    print("\n".join(lines))
    accuracies = {
        name: [s["eval_accuracy"] for s in summaries]
        for name, (summaries, _) in results.items()
        if all("eval_accuracy" in s for s in summaries)
    }
    print("\n" + noise_verdict(accuracies, examples))
    for name, (summaries, _) in results.items():
        for seed, summary in enumerate(summaries):
            if "stopped" in summary:  # not compared: its mean would be over fewer seeds
                print(f"{name}, seed {seed}: {summary['stopped']}; {name} is left out of the comparison")
    out = plot_runs([root / name for name in _models(args.attentions)], root / "demo.png")
    print(f"\ncurves (first seed): {out}")
    return 0
