"""What keeping non-finite values to the rows that read them costs the block-sparse
kernel: `block_sparse_attention` as shipped (one pass over k and v: each key whose value
holds a NaN or inf gets a NaN key, the value is zeroed) beside the same call with that
pass removed, side by side in one run, forward and forward+backward, bf16.

The pass moves about 4 * kv_len * kv_heads * d bytes (k and v read and written); the
kernel does 4 * q_len * visited_keys * heads * d FLOPs, so it costs most where a row
visits few keys (a narrow window) and least for dense attention.

    python scripts/bench_non_finite.py --out docs/kernel_runs/h100_non_finite.md
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import jax
import jax.numpy as jnp
from bench_kernels import batched, timed, with_grad, write_markdown

from jxformers import ops
from jxformers.kernels import block_sparse_attention
from jxformers.kernels import flash as flash_module
from jxformers.ops.local import local_pattern
from jxformers.ops.softmax import softmax_pattern
from jxformers.tools.help_text import description


@contextlib.contextmanager
def without_pass():
    """The kernel call with the non-finite pass removed (the baseline; never shipped)."""
    kept = flash_module.poison_keys
    flash_module.poison_keys = lambda k, v: (k, v)
    try:
        yield
    finally:
        flash_module.poison_keys = kept


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="A B rounds; the best of each kept")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n, h, d = args.length, args.heads, args.head_dim
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(x, (args.batch, n, h, d), jnp.bfloat16) for x in keys)
    patterns = {
        "dense causal": softmax_pattern(n, n, causal=True),
        "causal window 512": local_pattern(512, causal=True, q_len=n, kv_len=n),
        "causal window 128": local_pattern(128, causal=True, q_len=n, kv_len=n),
    }
    interpret = jax.default_backend() == "cpu"
    attends = {
        name: functools.partial(block_sparse_attention, pattern=pattern, interpret=interpret)
        for name, pattern in patterns.items()
    }
    # The causal op adds its own guard (every row from a non-finite key on is NaN) on top.
    impl = "interpret" if interpret else "pallas"
    attends["causal window 128, ops.local_attention"] = functools.partial(
        ops.local_attention, window=128, causal=True, impl=impl
    )
    rows = []
    for name, attend in attends.items():
        compiled = {}
        for label in ("shipped", "no pass"):
            with without_pass() if label == "no pass" else contextlib.nullcontext():
                # compiled inside the context: the executable keeps what it traced
                forward = jax.jit(batched(attend)).lower(q, k, v).compile()
                backward = with_grad(batched(attend)).lower(q, k, v, do).compile()
            compiled[label] = (forward, backward)
        # A B A B: each is timed in every round, the best round kept (clocks drift).
        times = {label: [float("inf"), float("inf")] for label in compiled}
        for _ in range(args.rounds):
            for label, (forward, backward) in compiled.items():
                times[label][0] = min(times[label][0], timed(forward, q, k, v, repeat=args.repeat))
                times[label][1] = min(times[label][1], timed(backward, q, k, v, do, repeat=args.repeat))
        (with_fwd, with_bwd), (base_fwd, base_bwd) = times["shipped"], times["no pass"]
        row = [name, base_fwd, with_fwd, with_fwd / base_fwd, base_bwd, with_bwd, with_bwd / base_bwd]
        rows.append([row[0], *(f"{x:.3f}" for x in row[1:])])
        print(" | ".join(rows[-1]), flush=True)
    header = [
        "pattern",
        "fwd ms, no pass",
        "fwd ms, shipped",
        "ratio",
        "fwd+bwd ms, no pass",
        "fwd+bwd ms, shipped",
        "ratio",
    ]
    setting = f"bf16, batch {args.batch}, N = {n}, {h} heads, d = {d}, median of {args.repeat}"
    setting += f"; the best of {args.rounds} alternating rounds each"
    if args.out:
        write_markdown(args.out, "bench_non_finite.py", sys.argv[1:] if argv is None else argv, setting, header, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
