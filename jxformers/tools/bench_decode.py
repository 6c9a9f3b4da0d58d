"""Decoding benchmark: tokens per second of generation against context length for a
language model whose attention is softmax with its key/value cache, softmax without a
cache (every step reruns the parallel forward: the recompute baseline of Katharopoulos
et al. 2020, "Transformers are RNNs", arXiv 2006.16236, Table 1), linear attention and
Performer with their recurrent states; side by side in one run, with each decoding
state's size and the step's compiled temporary memory.

    python scripts/bench_decode.py --out docs/decode.md

A step's cost depends only on the state's shape, not on what it holds: the cache
attends all `max_len` slots (the unwritten ones masked), so timing steps from an empty
state of `max_len` = N measures the step at context length N.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from tqdm import tqdm

from jxformers.nn import ModelConfig, build_model
from jxformers.tools.bench import Claim, machine, print_report, render_notes
from jxformers.xla_cost import compile_with_cost

FULL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass(frozen=True)
class Method:
    label: str
    attention: str
    attention_kwargs: tuple[tuple[str, object], ...] = ()
    cache: bool = True


METHODS = (
    Method("softmax, cache", "softmax"),
    Method("softmax, no cache", "softmax", cache=False),
    Method("linear, recurrent", "linear"),
    Method("performer, recurrent", "performer", (("num_features", 64),)),
)


@dataclasses.dataclass
class Row:
    label: str
    length: int
    seconds_per_token: float
    state_bytes: int
    temp_bytes: int


def _model(method: Method, length: int, d_model: int, layers: int):
    config = ModelConfig(
        task="lm",
        vocab_size=256,
        num_layers=layers,
        d_model=d_model,
        num_heads=4,
        max_len=length,
        attention={"name": method.attention, **dict(method.attention_kwargs)},
        embedding={"position": "rope"},
    )
    return build_model(config, key=jax.random.key(0))


def _steps_fn(method: Method, steps: int):
    """`steps` decoding steps from (model, state or token buffer, first token)."""
    if method.cache:

        def run(model, state, token):
            def step(carry, _):
                state, token = carry
                logits, state = model.decode_step(token, state)
                return (state, jnp.argmax(logits).astype(jnp.int32)), None

            return jax.lax.scan(step, (state, token), None, length=steps)[0]
    else:

        def run(model, buffer, token):
            def step(carry, i):
                buffer, token = carry
                pos = buffer.shape[0] - steps + i
                buffer = buffer.at[pos].set(token)
                return (buffer, jnp.argmax(model(buffer)[pos]).astype(jnp.int32)), None

            return jax.lax.scan(step, (buffer, token), jnp.arange(steps))[0]

    return run


def build(method: Method, length: int, *, steps: int, d_model: int, layers: int):
    """Compile `steps` decoding steps; returns (run(), state bytes, temp bytes)."""
    model = _model(method, length, d_model, layers)
    params, static = eqx.partition(model, eqx.is_array)
    state = model.init_decode_state(length) if method.cache else jnp.zeros((length,), jnp.int32)
    token = jnp.zeros((), jnp.int32)
    run = _steps_fn(method, steps)
    compiled, cost = compile_with_cost(lambda p, s, t: run(eqx.combine(p, static), s, t), params, state, token)
    temp = cost.temp_bytes
    jax.block_until_ready(compiled(params, state, token))  # warm up
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state)) if method.cache else 0
    return (lambda: jax.block_until_ready(compiled(params, state, token))), state_bytes, temp


def measure(length: int, *, steps: int, no_cache_steps: int, d_model: int, layers: int, repeats: int) -> list[Row]:
    """Every method at one length; repeats interleaved across methods, minimum kept."""
    built = {}
    for method in METHODS:
        n = min(length, steps if method.cache else no_cache_steps)
        built[method.label] = (n, *build(method, length, steps=n, d_model=d_model, layers=layers))
    best = {label: float("inf") for label in built}
    for _ in range(repeats):
        for label, (n, run, _, _) in built.items():
            start = time.perf_counter()
            run()
            best[label] = min(best[label], (time.perf_counter() - start) / n)
    return [Row(label, length, best[label], state, temp) for label, (_, _, state, temp) in built.items()]


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table(rows: list[Row]) -> str:
    base = {r.length: r for r in rows if r.label == METHODS[0].label}
    lines = [
        "| N | method | tokens/s | ms/token | tokens/s / softmax cache | state MiB | step temp MiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = base.get(r.length)
        ratio = _num(b.seconds_per_token / r.seconds_per_token) if b else "-"
        lines.append(
            f"| {r.length} | {r.label} | {_num(1 / r.seconds_per_token)} | {_num(1e3 * r.seconds_per_token)} | {ratio} "
            f"| {r.state_bytes / 2**20:.2f} | {r.temp_bytes / 2**20:.2f} |"
        )
    return "\n".join(lines)


# Said only where the run measured the lengths a claim quotes (`bench.Claim`); every method
# runs at every length. The numbers are this project's CPU run (docs/decode.md).
NOTES = (
    (
        "Per-step cost",
        (
            Claim(
                "With the cache a step is O(N d) per layer (the new query against all N cache slots); "
                "without it, O(N^2 d) (the whole causal forward again); the recurrent forms are O(m d) per "
                "layer whatever N. Their state is a constant m x d matrix per head, and their step time "
                "stays flat in N."
            ),
            Claim(
                "Linear attention's state is 0.03 MiB here at every N, against 16 MiB of cache at N = 8192; "
                "the spread of the recurrent forms' ms/token across rows (about 0.13 to 0.4 ms on this "
                "shared 2-core machine) is noise, not a trend, while the cache's step time grows about 14x "
                "from N = 256 to 8192.",
                lengths=(256, 8192),
            ),
        ),
    ),
    (
        "Where each wins",
        (
            Claim(
                "At N = 256 to 2048 the cache's step costs about the same as a recurrent step (a few small "
                "matmuls; fixed per-step overheads dominate on a CPU).",
                lengths=(256, 2048),
            ),
            Claim(
                "From N = 4096 the recurrent forms are several times faster (about 12x at 8192).",
                lengths=(4096, 8192),
            ),
            Claim(
                "The recompute baseline loses everywhere, by a factor that grows with N: this is Table 1 of "
                'Katharopoulos et al. 2020 ("Transformers are RNNs", arXiv 2006.16236), the RNN view of '
                "linear attention against a softmax transformer without a cache."
            ),
            Claim("At N = 8192 it is tens of thousands of times slower than the recurrent forms.", lengths=(8192,)),
        ),
    ),
    (
        "Memory",
        (
            Claim(
                '"state" is the decoding state (the cache holds 2 * layers * N * d floats; zero for the '
                "recompute baseline, which instead needs the N x N logits: see its step temp); "
                '"step temp" is XLA\'s temporary allocation for the compiled steps.'
            ),
        ),
    ),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(FULL_LENGTHS))
    p.add_argument("--steps", type=int, default=32, help="decoding steps timed per measurement")
    p.add_argument("--no-cache-steps", type=int, default=2, help="steps timed for the recompute baseline")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="write the markdown report to this file")
    args = p.parse_args(argv)
    if any(n < 2 for n in args.lengths) or args.steps < 1 or args.no_cache_steps < 1:
        p.error("--lengths must be >= 2 and --steps, --no-cache-steps >= 1")
    rows = []
    for length in tqdm(args.lengths, desc="decode", file=sys.stderr):
        rows += measure(
            length,
            steps=args.steps,
            no_cache_steps=args.no_cache_steps,
            d_model=args.d_model,
            layers=args.layers,
            repeats=args.repeats,
        )
    command = " ".join(["python scripts/bench_decode.py", *(argv if argv is not None else sys.argv[1:])])
    text = (
        "# Decoding benchmark\n\n"
        f"Command: `{command}`  \nMachine: {machine()}  \nDate: {datetime.date.today().isoformat()}  \n"
        f"Model: decoder-only LM, {args.layers} layers, d_model {args.d_model}, 4 heads, vocab 256, rotary "
        "positions, float32, batch 1, greedy. Performer: 64 features.\n\n"
        + table(rows)
        + "\n\n"
        + render_notes(NOTES, [], args.lengths)
    )
    print_report(text, args.out)
    return 0
