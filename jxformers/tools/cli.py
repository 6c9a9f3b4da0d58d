"""The `jxformers` command: `list` prints the attention registry, `bench` runs the
attention benchmark, `train` / `eval` / `generate` run experiments (see each `--help`)."""

from __future__ import annotations

import argparse
import json
import sys

USAGE = """usage: jxformers COMMAND [ARGS]

commands:
  list      print the attention registry (names, capabilities, hyper-parameters)
  bench     time and measure every attention against softmax (--help for options)
  train     train an experiment: jxformers train CONFIG --workdir DIR [--set key=value ...]
  eval      evaluate the newest checkpoint of a work directory on the eval split
  generate  sample from a trained language model
  plot      draw the curves of several work directories into one PNG
  demo      train softmax, linear and Fourier-Transformer models on tiny ListOps and compare
"""


def _experiment_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("config", help="an experiment name in experiments/ (e.g. copy) or a YAML path")
    p.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and config.yaml go here")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 --set preset=tiny")
    return p


def _load(p, args):
    from jxformers.train import load_experiment

    try:
        return load_experiment(args.config, args.overrides)
    except ValueError as e:
        p.error(str(e))


def _train(rest: list[str]) -> int:
    p = _experiment_parser("jxformers train", "train (or resume) an experiment in a work directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(rest)
    experiment = _load(p, args)
    from jxformers.train import NonFiniteError, train

    try:
        summary = train(experiment, args.workdir, progress=not args.no_progress)
    except (NonFiniteError, ValueError) as e:
        print(f"jxformers train: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


def _eval(rest: list[str]) -> int:
    p = _experiment_parser("jxformers eval", "evaluate the newest checkpoint on the eval split")
    p.add_argument("--batches", type=int, default=None, help="eval batches (default: the whole split)")
    args = p.parse_args(rest)
    experiment = _load(p, args)
    from jxformers.train import evaluate_checkpoint

    try:
        print(json.dumps(evaluate_checkpoint(experiment, args.workdir, batches=args.batches)))
    except ValueError as e:
        p.error(str(e))
    return 0


def _generate(rest: list[str]) -> int:
    p = _experiment_parser("jxformers generate", "continue a prompt of token ids with a trained language model")
    p.add_argument("--prompt", required=True, help="space-separated token ids, e.g. '1 5 7'")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=1, help="sequences generated in parallel (one per line); "
                   "the throughput (sequences/s, e.g. images/s for fmnist_generate) goes to stderr")
    args = p.parse_args(rest)
    if args.count < 1 or args.steps < 0:
        p.error("--count must be >= 1 and --steps >= 0")
    experiment = _load(p, args)
    if experiment.model.task != "lm":
        p.error(f"generate needs a language-model experiment; {experiment.name} is {experiment.model.task!r}")
    try:
        prompt = [int(t) for t in args.prompt.split()]
    except ValueError:
        p.error("--prompt must be space-separated integer token ids")
    import time

    import jax
    import jax.numpy as jnp

    from jxformers.nn.generation import generate
    from jxformers.train import restore_model

    try:
        model, _ = restore_model(experiment, args.workdir)
        prompt_ids = jnp.asarray(prompt, jnp.int32)

        def many(keys):
            return jax.vmap(lambda k: generate(model, prompt_ids, args.steps, key=k, temperature=args.temperature,
                                               top_k=args.top_k))(keys)

        keys = jax.random.split(jax.random.key(args.seed), args.count)
        compiled = jax.jit(many).lower(keys).compile()
    except ValueError as e:
        p.error(str(e))
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    seconds = time.perf_counter() - start
    for row in out:
        print(" ".join(str(int(t)) for t in row))
    print(f"generated {args.count} sequences of {args.steps} new tokens in {seconds:.3f} s: "
          f"{args.count / seconds:.2f} sequences/s, {args.count * args.steps / seconds:.0f} tokens/s "
          f"(after compilation)", file=sys.stderr)
    return 0


def _plot(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jxformers plot", description="curves of several runs in one PNG")
    p.add_argument("workdirs", nargs="+", help="work directories of `jxformers train`")
    p.add_argument("--out", default="curves.png")
    p.add_argument("--metrics", nargs="+", default=None, help="default: loss eval_accuracy")
    args = p.parse_args(rest)
    from jxformers.tools.plot import DEFAULT_METRICS, plot_runs

    try:
        print(plot_runs(args.workdirs, args.out, metrics=args.metrics or DEFAULT_METRICS))
    except ValueError as e:
        p.error(str(e))
    return 0


def _demo(rest: list[str]) -> int:
    from jxformers.tools import demo

    return demo.main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "list":
        argparse.ArgumentParser(prog="jxformers list", description="print the attention registry").parse_args(rest)
        from jxformers import registry

        print(registry.table())
        return 0
    if command == "bench":
        from jxformers.tools import bench

        return bench.main(rest)
    commands = {"train": _train, "eval": _eval, "generate": _generate, "plot": _plot, "demo": _demo}
    if command in commands:
        return commands[command](rest)
    print(f"jxformers: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
