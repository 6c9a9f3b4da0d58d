"""What each attention option costs beside the plain attention: step time (forward and
backward of one attention layer over a batch), XLA-counted FLOPs and compiled temporary
memory, at N = 512 and 2048, side by side in one run (issue 30's overhead table).

    python scripts/bench_attention_options.py                       # prints the table
    python scripts/bench_attention_options.py --repeats 5 --out docs/attention_options.md

Each option is one `jxformers.nn.Attention` (softmax core, d_model 256, 4 heads, causal)
differing from the plain one only in that option; every configuration is compiled once,
then the timed calls alternate between configurations repeat by repeat (A B C ... A B C)
so all see the same load, and a ratio is the option's median over the plain one's. The
floor: softmax attention's FLOPs are about 4 N^2 d per head forward (two matmuls) and
twice that backward; an option adds O(N^2) elementwise work per head (the cap's tanh, the
top-k selection, one more softmax column), so its FLOP ratio stays near 1 and what it
costs in time is memory traffic over the N^2 logits, which is what the step ratio shows.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from jxformers import registry
from jxformers.nn import Attention
from jxformers.xla_cost import compile_with_cost

D_MODEL, HEADS, BATCH = 256, 4, 4
# (row label, op hyper-parameters, module settings)
OPTIONS = (
    ("plain", {}, {}),
    ("softcap 30", {"softcap": 30.0}, {}),
    ("top_k 32", {"top_k": 32}, {}),
    ("sinks zero", {"sinks": "zero"}, {}),
    ("sinks learned", {"sinks": "learned"}, {}),
    ("talking_heads", {"talking_heads": True}, {}),
    ("persistent_kv 16", {"persistent_kv": 16}, {}),
    ("qk_norm l2", {}, {"qk_norm": "l2"}),
    ("qk_norm layernorm", {}, {"qk_norm": "layernorm"}),
    # Priors (Lin et al. section 4.5): biases and masks over the N^2 logits.
    ("localness", {"localness": True}, {}),
    ("gaussian_prior", {"gaussian_prior": True}, {}),
    ("adaptive_span 128", {"adaptive_span": 128}, {}),
    ("head_windows 8/32/128/all", {"head_windows": (8, 32, 128, -1)}, {}),
    # Improved multi-heads (section 4.6): module settings.
    ("collaborative 128", {}, {"collaborative": 128}),
    ("disagreement all three", {}, {"disagreement": ("subspace", "position", "output")}),
    ("routing 3 iterations", {}, {"head_aggregation": "routing"}),
    ("em_routing 3 iterations", {}, {"head_aggregation": "em_routing"}),
)


def step_fn(module: Attention):
    """Forward and backward of the layer over a batch: grads of a scalar of its output
    plus the layer's own losses (adaptive span's, the disagreement terms), in training."""

    def loss(m, x):
        out, produced = jax.vmap(m.apply)(x)
        return jnp.sum(out**2) + sum(v.sum() for v in produced.layer_losses.values())

    return lambda m, x: eqx.filter_grad(loss)(m, x)


def measure(lengths, repeats, calls):
    rows = []
    for n in lengths:
        x = jax.random.normal(jax.random.key(0), (BATCH, n, D_MODEL))
        built = []
        for label, hp, module in OPTIONS:
            attention = Attention(
                registry.bind("softmax", **hp),
                D_MODEL,
                HEADS,
                causal=True,
                key=jax.random.key(1),
                qk_norm_length=n,
                **module,
            )
            params, static = eqx.partition(attention, eqx.is_array)
            fn = step_fn(attention)
            compiled, cost = compile_with_cost(
                lambda p, x, fn=fn, static=static: fn(eqx.combine(p, static), x), params, x
            )
            jax.block_until_ready(compiled(params, x))  # warm
            built.append((label, compiled, params, cost, []))
        for _ in range(repeats):  # interleaved: every configuration sees the same load
            for _, compiled, params, _, times in built:
                start = time.perf_counter()
                for _ in range(calls):
                    out = compiled(params, x)
                jax.block_until_ready(out)
                times.append((time.perf_counter() - start) / calls)
        base_time = statistics.median(built[0][4])
        base = built[0][3]
        for label, _, _, cost, times in built:
            t = statistics.median(times)
            rows.append(
                (
                    n,
                    label,
                    t * 1e3,
                    t / base_time,
                    cost.flops / 1e9,
                    cost.flops / base.flops,
                    cost.temp_bytes / 2**20,
                    cost.temp_bytes / max(base.temp_bytes, 1),
                )
            )
    return rows


def table(rows, command) -> str:
    lines = [
        "# Attention options: overhead against the plain attention",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()} {platform.processor() or ''} ({jax.devices()[0].platform}, "
        f"{jax.device_count()} device(s)), jax {jax.__version__}, {datetime.date.today()}  ",
        f"One causal softmax attention layer, d_model {D_MODEL}, {HEADS} heads, batch {BATCH}, forward and "
        "backward (float32); medians over interleaved repeats; ratios against `plain` at the same N.",
        "",
        "| N | option | step ms | step / plain | GFLOPs | FLOPs / plain | temp MiB | temp / plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, label, ms, ratio, gflops, fratio, mib, mratio in rows:
        lines.append(
            f"| {n} | {label} | {ms:.2f} | {ratio:.2f} | {gflops:.2f} | {fratio:.3f} | {mib:.1f} | {mratio:.2f} |"
        )
    longest = max(r[0] for r in rows)
    last = [r for r in rows if r[0] == longest and r[1] != "plain"]
    slow = max(last, key=lambda r: r[3])
    big = max(last, key=lambda r: r[7])
    flops = max(last, key=lambda r: r[5])
    lines += [
        "",
        f"At N = {longest}: the slowest option is {slow[1]} ({slow[3]:.2f}x plain's step), the most "
        f"memory {big[1]} ({big[7]:.2f}x plain's temporaries), the most FLOPs {flops[1]} "
        f"({flops[5]:.3f}x). Every option adds O(N^2) elementwise work to the 4 N^2 d matmul FLOPs "
        "per head (QK-norm only O(N d)), so the FLOP ratios stay near 1 and what an option costs is "
        "time and memory over the N^2 logits: a row sort for top-k (`lax.top_k`), the tanh kept for "
        "the backward pass for the cap, a second [heads, N, N] mixing each way for talking heads. "
        "Each runs through the XLA softmax here; on a GPU the cap and the sinks also run in the flash "
        "kernel (O(N) memory), while every other option gives up the kernel's O(N) memory. The priors "
        "add a bias or mask "
        "over the logits (localness also a d x d projection of each query); collaborative heads change "
        "the projections' sizes; the disagreement's position term forms every head's weights a second "
        "time; routing (dynamic or EM) adds d x d votes per pair of heads and its iterations, "
        "O(N h^2 d^2). The "
        "cross-layer maps (stack.attention_maps) and memory tokens act across layers, outside one layer.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per repeat")
    parser.add_argument("--out", help="write the table (markdown) here")
    args = parser.parse_args(argv)
    command = "python scripts/bench_attention_options.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = table(measure(args.lengths, args.repeats, args.calls), command.strip())
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
