"""The training cost of the Feedback Transformer (Fan et al. 2020, `stack: {kind:
feedback}`) against a plain transformer language model of the same size, side by side in
one run, written as a table to docs/feedback_cost.md.

    python scripts/bench_feedback.py                               # CPU, lengths 32 64 128
    python scripts/bench_feedback.py --lengths 64 256 1024 --out docs/feedback_cost.md

Both models: the same d_model, layers, heads, FFN and vocabulary (the Feedback model adds
L + 1 layer weights); the library's own train step (`make_train_step`: value_and_grad of
the next-token loss over a vmapped batch, AdamW), compiled once per model and length
(`compile_with_cost`: XLA's FLOP count and temporary memory), then timed as the median of
`--steps` steps after `--warmup`, each waited for. The Feedback model's step runs its
positions one after another (`lax.scan`): its step time grows with the length even where
the transformer's, parallel over positions, stays flat; XLA's FLOP count of a scan body is
counted once, not per step, so the table leaves the Feedback model's FLOPs out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

from jxformers import build_model
from jxformers.tools.bench import machine
from jxformers.train.state import TrainState, split_model
from jxformers.train.step import make_train_step
from jxformers.xla_cost import compile_with_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STACKS = ("transformer", "feedback")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Feedback Transformer training cost against a plain transformer")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128], help="tokens per example")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="examples per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after compiling")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "feedback_cost.md"), help="markdown table written here")
    args = p.parse_args(argv)
    for name in ("d_model", "layers", "heads", "batch", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0 or min(args.lengths) < 2:
        p.error(f"--warmup must be >= 0 and every length >= 2; got {args.warmup}, {args.lengths}")
    return args


def config(stack: str, length: int, args: argparse.Namespace) -> dict:
    """The model config of one side: the same sizes, only the stack differs."""
    return dict(
        task="lm", vocab_size=256, num_layers=args.layers, d_model=args.d_model, num_heads=args.heads,
        max_len=length, ffn={"kind": "gelu", "d_ff": 4 * args.d_model}, stack={"kind": stack},
    )  # fmt: skip


def measure(stack: str, length: int, args: argparse.Namespace) -> dict:
    """{params, compile s, step ms, GFLOP, temp MiB} of one train step."""
    params, drawn, static = split_model(build_model(config(stack, length, args), key=jax.random.key(0)))
    optimizer = optax.adamw(1e-3)
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (args.batch, length), 0, 256)
    mask = jnp.ones((args.batch, length), bool)
    batch = {"tokens": tokens, "mask": mask, "loss_mask": mask}
    start = time.perf_counter()
    step, cost = compile_with_cost(make_train_step(static, optimizer, grad_accum=1), state, batch)
    compile_s = time.perf_counter() - start
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    count = sum(x.size for x in jax.tree.leaves(params))
    return {
        "params": count,
        "compile": compile_s,
        "step": 1e3 * statistics.median(times),
        "gflop": cost.flops / 1e9 if stack == "transformer" else float("nan"),
        "temp": cost.temp_bytes / 2**20,
    }


def table(rows: dict[tuple[str, int], dict], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# Feedback Transformer: the cost of training position by position",
        "",
        'The Feedback Transformer (Fan et al. 2020, "Addressing Some Limitations of Transformers with Feedback '
        "Memory\"; `stack: {kind: feedback}`) lets every layer at position t read a memory of all layers' states "
        "at the earlier positions. Position t's first layer needs position t - 1's last layer, so **a training "
        "step runs its positions one after another (`lax.scan`): the model loses the transformer's parallelism "
        "over the sequence**, and its step time grows with the length where the transformer's is spread over "
        "the positions at once. Its scan also keeps every step's key/value buffers for the backward pass, "
        "O(L n² d) memory per sequence (the temp columns). Decoding goes one position per step in both models; "
        "the cost here is training's (and that of scoring a whole sequence).",
        "",
        f"Written by `{command}` on {datetime.date.today().isoformat()}, {machine()}. Both models: d_model "
        f"{args.d_model}, {args.layers} layers, {args.heads} heads, GELU FFN {4 * args.d_model}, vocabulary 256 "
        "(the Feedback projections have no biases, as the authors' code; it adds L + 1 layer weights), "
        f"batch {args.batch}; the library's train step (AdamW), median of {args.steps} steps after "
        f"{args.warmup} warm-up. Step times are ratios measured side by side in one run; only a GPU's absolute "
        "times mean much. XLA counts a scan body's FLOPs once, so the Feedback column has none.",
        "",
        "| N | params transformer | params feedback | transformer step ms | feedback step ms | feedback / "
        "transformer | transformer GFLOP | transformer temp MiB | feedback temp MiB | compile s (t / f) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.lengths:
        t, f = rows[("transformer", n)], rows[("feedback", n)]
        lines.append(
            f"| {n} | {t['params']:,} | {f['params']:,} | {t['step']:.1f} | {f['step']:.1f} | "
            f"{f['step'] / t['step']:.1f}x | {t['gflop']:.2f} | {t['temp']:.1f} | {f['temp']:.1f} | "
            f"{t['compile']:.1f} / {f['compile']:.1f} |"
        )
    first, last = min(args.lengths), max(args.lengths)
    if last > first:
        grow = {s: rows[(s, last)]["step"] / rows[(s, first)]["step"] for s in STACKS}
        temp = {s: rows[(s, last)]["temp"] / rows[(s, first)]["temp"] for s in STACKS}
        lines += [
            "",
            f"Reading: from N = {first} to N = {last} ({last / first:g}x the tokens) the transformer's step took "
            f"{grow['transformer']:.1f}x as long and the Feedback model's {grow['feedback']:.1f}x; their compiled "
            f"temporary memory grew {temp['transformer']:.1f}x and {temp['feedback']:.1f}x (the scan's per-step "
            "key/value buffers, quadratic in N). On a CPU of few cores the transformer is itself nearly serial, so "
            "these ratios understate what a GPU, which runs a transformer's positions at once, loses.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = {}
    for n in args.lengths:
        for stack in STACKS:
            rows[(stack, n)] = measure(stack, n, args)
            print(f"N={n} {stack}: {rows[(stack, n)]}", file=sys.stderr)
    command = "python scripts/bench_feedback.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(rows, args, command.strip())
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
