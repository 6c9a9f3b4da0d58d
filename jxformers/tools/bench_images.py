"""Katharopoulos et al. 2020 ("Transformers are RNNs", arXiv 2006.16236), Table 1, speed
column: images per second of autoregressive generation of
whole 784-pixel images, with sampling, batch 10, after compilation, through
`jxformers.nn.generation.generate` (what `jxformers generate` runs) for

* softmax recomputing the whole forward at every step (`--recompute`; the paper's
  softmax row),
* softmax with its key/value cache,
* linear attention with its recurrent state (the paper's linear row).

    python scripts/bench_image_generation.py            # the paper's size: 8 layers, 8 heads, d 256

The recompute baseline's step always runs the whole 785-token forward, so every one of
its steps costs the same: it is timed for `--recompute-steps` steps (the last ones of
an image, from a 785 - K token prompt) and its full-image time is 784 x that per-step
time, an estimate labelled as such unless K = 784. The weights are random: a step's cost
does not depend on them (the mixture head's cost, which does not either, is in
`--head`). Decoding speed against context length is `bench_decode.py`'s table.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time

import jax
import jax.numpy as jnp

from jxformers.nn import build_model
from jxformers.nn.config import OUTPUT_HEADS
from jxformers.nn.generation import generate
from jxformers.tools.bench import machine
from jxformers.tools.bench_decode import _num

PIXELS, START = 784, 256  # fashion_mnist's generate mode: a start token, then 784 pixels (vocabulary 257)
MODES = (
    ("softmax, recompute", "softmax", False),
    ("softmax, cache", "softmax", True),
    ("linear, recurrent", "linear", True),
)


@dataclasses.dataclass
class Row:
    label: str
    steps: int  # steps timed per image
    seconds: float  # for those steps, the whole batch (best of the repeats)

    def image_seconds(self) -> float:
        """Seconds for one batch of full images (784 steps; scaled from `steps`)."""
        return self.seconds * PIXELS / self.steps


def measure(
    label: str,
    attention: str,
    use_cache: bool,
    *,
    steps: int,
    batch: int,
    layers: int,
    heads: int,
    d_model: int,
    head: str,
    repeats: int,
) -> Row:
    config = dict(
        task="lm",
        vocab_size=START + 1,
        num_layers=layers,
        num_heads=heads,
        d_model=d_model,
        max_len=PIXELS + 1,
        attention=attention,
        embedding={"position": "learned"},
        head=head,
    )
    model = build_model(config, key=jax.random.key(0))
    prompt = jnp.zeros((PIXELS + 1 - steps,), jnp.int32).at[0].set(START)  # the last `steps` pixels are generated

    @jax.jit
    def images(keys):
        return jax.vmap(lambda k: generate(model, prompt, steps, key=k, temperature=1.0, use_cache=use_cache))(keys)

    keys = jax.random.split(jax.random.key(1), batch)
    compiled = images.lower(keys).compile()
    jax.block_until_ready(compiled(keys))  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(keys))
        best = min(best, time.perf_counter() - start)
    return Row(label, steps, best)


def table(rows: list[Row], batch: int) -> str:
    base = rows[0].image_seconds()
    lines = [
        "| method | steps timed per image | images/s | ms per step (batch) | x recompute |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        estimated = " (estimate: 784 x step)" if r.steps < PIXELS else ""
        lines.append(
            f"| {r.label} | {r.steps} | {_num(batch / r.image_seconds())}{estimated} "
            f"| {_num(1e3 * r.seconds / r.steps)} | {_num(base / r.image_seconds())} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_image_generation", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--recompute-steps",
        type=int,
        default=4,
        help=f"steps timed for the recompute baseline (the full image: {PIXELS})",
    )
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--head", choices=OUTPUT_HEADS, default="softmax", help="the output head")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if not 1 <= args.recompute_steps <= PIXELS or args.batch < 1 or args.repeats < 1:
        p.error(f"--recompute-steps must be in [1, {PIXELS}]; --batch and --repeats >= 1")
    rows = []
    for label, attention, use_cache in MODES:
        steps = PIXELS if use_cache else args.recompute_steps
        rows.append(
            measure(
                label,
                attention,
                use_cache,
                steps=steps,
                batch=args.batch,
                layers=args.layers,
                heads=args.heads,
                d_model=args.d_model,
                head=args.head,
                repeats=args.repeats,
            )
        )
        print(f"{label}: {rows[-1]}", file=sys.stderr)
    command = " ".join(["python scripts/bench_image_generation.py", *(argv if argv is not None else sys.argv[1:])])
    print(
        f"Command: `{command}`  \nMachine: {machine()}  \nDate: {datetime.date.today().isoformat()}  \n"
        f"Model: {args.layers} layers, {args.heads} heads, d_model {args.d_model}, FFN 4x, learned positions, "
        f"output head {args.head}, float32; batch {args.batch}, 784 pixels sampled at temperature 1.\n"
    )
    print(table(rows, args.batch))
    return 0
