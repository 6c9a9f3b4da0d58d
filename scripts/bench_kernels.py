"""Benchmark the block-sparse flash-attention kernel on an accelerator against the
XLA ops of the same patterns, `jax.nn.dot_product_attention` (cuDNN and XLA) and JAX's
bundled Pallas `mha`, forward and forward+backward, side by side in one run.

Each row: milliseconds (median of `--repeat` timed calls after warm-up), the visited
fraction of the block grid, and TFLOP/s counted two ways: on the visited blocks (the
work the kernel does) and on the dense equivalent (4 * N^2 * d per head forward; the
backward counted as 2.5x the forward, FlashAttention's convention).

    python scripts/bench_kernels.py --out docs/kernels.md            # full table
    python scripts/bench_kernels.py --lengths 4096 --quick            # a smoke run
    python scripts/bench_kernels.py --lengths 8192 --head-dims 128 --only dense causal --mosaic
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import platform
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jxformers import ops
from jxformers.kernels import Alibi, BlockSizes, block_sparse_attention, visited_fraction
from jxformers.kernels.flash import default_block_sizes
from jxformers.nn import alibi_slopes
from jxformers.ops.local import local_pattern
from jxformers.ops.softmax import softmax_pattern
from jxformers.ops.sparse import (
    bigbird_pattern,
    bigbird_random_blocks,
    fixed_parts,
    longformer_pattern,
    strided_parts,
    summary_positions,
)
from jxformers.tools.help_text import description

BIGBIRD_KEY = jax.random.PRNGKey(7)


def timed(fn, *args, repeat: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def with_grad(attend):
    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def batched(fn):
    return jax.vmap(fn)


def configs(n: int, sizes: BlockSizes, heads: int):
    """name -> (op taking impl, visited fraction, dot_product_attention kwargs or None,
    bundled-mha causal flag or None)."""
    yield (
        "dense",
        (ops.softmax_attention, visited_fraction(softmax_pattern(n, n, causal=False), n, n, sizes), {}, False),
    )
    causal_fraction = visited_fraction(softmax_pattern(n, n, causal=True), n, n, sizes)
    yield "causal", (functools.partial(ops.softmax_attention, causal=True), causal_fraction, {"is_causal": True}, True)
    # ALiBi computed per tile by the kernel; the XLA op materialises the [heads, N, N] bias.
    yield (
        "causal alibi",
        (
            functools.partial(ops.softmax_attention, causal=True, bias=Alibi(alibi_slopes(heads))),
            causal_fraction,
            None,
            None,
        ),
    )
    for w in (256, 512):
        yield (
            f"causal window {w}",
            (
                functools.partial(ops.local_attention, window=w, causal=True),
                visited_fraction(local_pattern(w, causal=True, q_len=n, kv_len=n), n, n, sizes),
                {"is_causal": True, "local_window_size": (w, 0)},
                None,
            ),
        )
    rnd = bigbird_random_blocks(BIGBIRD_KEY, n, block_size=64)
    yield (
        "bigbird b64",
        (
            functools.partial(ops.bigbird_attention, block_size=64, key=BIGBIRD_KEY),
            visited_fraction(bigbird_pattern(n, 64, 3, 2), n, n, BlockSizes(64, 64), extra_blocks=rnd),
            None,
            None,
        ),
    )
    band, columns = strided_parts(128, causal=True, n=n)
    yield (
        "sparse_transformer strided s128 causal",
        (
            functools.partial(ops.sparse_transformer_attention, stride=128, pattern="strided", causal=True),
            visited_fraction(band, n, n, sizes) + visited_fraction(columns, n, n, sizes),
            None,
            None,
        ),
    )
    own, others = fixed_parts(128, 8, causal=True, n=n)
    keys = len(summary_positions(n, 128, 8))
    yield (
        "sparse_transformer fixed s128 c8 causal",
        (
            functools.partial(
                ops.sparse_transformer_attention, stride=128, pattern="fixed", num_summary=8, causal=True
            ),
            visited_fraction(own, n, n, sizes) + visited_fraction(others, n, keys, sizes) * keys / n,
            None,
            None,
        ),
    )
    yield (
        "longformer w256 g2",
        (
            functools.partial(ops.longformer_attention, window=256, global_indices=(0, 1)),
            visited_fraction(longformer_pattern(256, 1, (0, 1), causal=False, n=n), n, n, sizes),
            None,
            None,
        ),
    )


def mosaic_patterns(n: int):
    """name -> pattern of the configs whose op is one kernel call on that pattern: the rows
    `--mosaic` adds (`block_sparse_attention(backend="mosaic_gpu")`: the Mosaic GPU
    forward, the Triton backward)."""
    patterns = {"dense": softmax_pattern(n, n, causal=False), "causal": softmax_pattern(n, n, causal=True)}
    for w in (256, 512):
        patterns[f"causal window {w}"] = local_pattern(w, causal=True, q_len=n, kv_len=n)
    patterns["longformer w256 g2"] = longformer_pattern(256, 1, (0, 1), causal=False, n=n)
    return patterns


def write_markdown(path, script: str, argv, setting: str, header, rows, footer: str = "") -> None:
    """A benchmark's table as markdown: the command that made it, the device, jax and the
    setting, then the rows (and `footer`). Shared by the kernel benchmarks."""
    command = f"python scripts/{script} " + shlex.join(argv if argv is not None else sys.argv[1:])
    device = jax.devices()[0]
    with open(path, "w") as f:
        f.write(f"<!-- generated by: {command} -->\n")
        f.write(f"Device: {device.device_kind}; jax {jax.__version__}; {platform.platform()}; {setting}.\n\n")
        f.write("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
        for row in rows:
            f.write("| " + " | ".join(row) + " |\n")
        f.write(footer)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=32768, help="batch = max(1, this / N)")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="config names to run (default: all)")
    parser.add_argument("--impls", nargs="*", help="implementations to run, e.g. pallas cudnn (default: all)")
    parser.add_argument(
        "--no-xla-above", type=int, default=8192, help="skip the dense XLA baselines above this N (memory)"
    )
    defaults = BlockSizes()
    parser.add_argument("--block", type=int, nargs=2, default=[defaults.block_q, defaults.block_k], metavar=("Q", "K"))
    parser.add_argument("--block-bwd", type=int, nargs=2, default=list(defaults.backward), metavar=("Q", "K"))
    parser.add_argument("--warps", type=int, default=defaults.num_warps)
    parser.add_argument("--stages", type=int, default=defaults.num_stages)
    parser.add_argument("--stages-bwd", type=int, default=defaults.num_stages_bwd)
    parser.add_argument("--out", help="write the markdown table here")
    parser.add_argument(
        "--mosaic",
        action="store_true",
        help="also run the Mosaic GPU forward (backend='mosaic_gpu') on dense, causal, windows, Longformer",
    )
    parser.add_argument(
        "--mosaic-stages",
        type=int,
        nargs="+",
        help="K/V ring depths of the Mosaic GPU rows, one row each (default: --stages)",
    )
    args = parser.parse_args(argv)

    sizes = BlockSizes(
        *args.block, *args.block_bwd, num_warps=args.warps, num_stages=args.stages, num_stages_bwd=args.stages_bwd
    )
    contextlib.ExitStack().enter_context(default_block_sizes(sizes))  # what the ops' kernels run with
    rows = []
    header = (
        "N",
        "d",
        "pattern",
        "impl",
        "visited",
        "fwd ms",
        "fwd TFLOP/s (visited / dense)",
        "fwd+bwd ms",
        "fwd+bwd TFLOP/s (visited / dense)",
    )
    print(" | ".join(header), flush=True)
    for n in args.lengths:
        batch = max(1, args.batch_tokens // n)
        for d in args.head_dims:
            keys = jax.random.split(jax.random.PRNGKey(n + d), 4)
            shape = (batch, n, args.heads, d)
            q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
            dense_flops = 4.0 * batch * args.heads * n * n * d
            for name, (op, frac, cudnn, mha) in configs(n, sizes, args.heads):
                if args.only and name not in args.only:
                    continue
                impls = {"pallas": functools.partial(op, impl="pallas")}
                if n <= args.no_xla_above or not name.startswith(("dense", "causal")):
                    impls["xla op"] = functools.partial(op, impl="xla")
                if args.mosaic and name in mosaic_patterns(n):
                    for stages in args.mosaic_stages or [sizes.num_stages]:
                        label = "pallas mosaic_gpu" + (f" s{stages}" if args.mosaic_stages else "")
                        impls[label] = functools.partial(
                            block_sparse_attention,
                            pattern=mosaic_patterns(n)[name],
                            backend="mosaic_gpu",
                            block_sizes=dataclasses.replace(sizes, num_stages=stages),
                        )
                if cudnn is not None:
                    for impl in ("cudnn", "xla"):
                        if impl == "xla" and n > args.no_xla_above:
                            continue
                        impls[f"dot_product_attention {impl}"] = functools.partial(
                            jax.nn.dot_product_attention, implementation=impl, **cudnn
                        )
                if mha is not None:
                    from jax.experimental.pallas.ops.gpu import attention as bundled

                    impls["bundled pallas mha"] = functools.partial(
                        bundled.mha, segment_ids=None, causal=mha, sm_scale=d**-0.5
                    )
                for impl, fn in impls.items():
                    if args.impls and not any(impl.startswith(x) or impl.endswith(x) for x in args.impls):
                        continue
                    whole_batch = impl.startswith(("dot_product", "bundled"))
                    fwd = jax.jit(fn if whole_batch else batched(fn))
                    try:
                        ms = timed(fwd, q, k, v, repeat=args.repeat)
                        ms_bwd = timed(with_grad(fn if whole_batch else batched(fn)), q, k, v, do, repeat=args.repeat)
                    except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                        print(f"{n} {d} {name} {impl}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    flops = dense_flops * frac
                    row = (
                        str(n),
                        str(d),
                        name,
                        impl,
                        f"{frac:.3f}",
                        f"{ms:.3f}",
                        f"{flops / ms / 1e9:.0f} / {dense_flops / ms / 1e9:.0f}",
                        f"{ms_bwd:.3f}",
                        f"{3.5 * flops / ms_bwd / 1e9:.0f} / {3.5 * dense_flops / ms_bwd / 1e9:.0f}",
                    )
                    rows.append(row)
                    print(" | ".join(row), flush=True)
                    if args.out:  # after every row: a run cut short keeps what it measured
                        write_markdown(
                            args.out,
                            "bench_kernels.py",
                            argv,
                            f"bf16, {args.heads} heads, batch = {args.batch_tokens} tokens / N; kernel blocks {sizes}",
                            header,
                            rows,
                        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
