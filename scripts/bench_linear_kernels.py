"""Benchmark the chunked linear-attention kernel (jxformers/kernels/linear*.py) against
our XLA chunked and scan forms, flash-linear-attention's Triton chunk kernels (PyTorch;
when importable), and causal softmax attention (our block-sparse flash kernel and cuDNN
through `jax.nn.dot_product_attention`), forward and forward+backward, side by side.

Each row: milliseconds (median of `--repeat` timed calls after warm-up), achieved
bandwidth on the HBM floor (read q, k, v and write out; the backward also reads out and
dout and writes dq, dk, dv: 8 and 24 bytes per token, head and dim in bf16), and TFLOP/s
on the chunked algorithm's count (per token and head: 2 (C m + C d_v + 2 m d_v) forward,
2 (3 C m + 2 C d_v + 6 m d_v) more backward, C the chunk (--chunk); the XLA forms are counted on the same
work); softmax rows on 2 N^2 d per head forward (causal), 3.5x that forward+backward.
The closing lines state the crossover: the shortest length at which the linear kernel
beats the faster of the two softmax baselines. `--block-v 32 64` adds "linear causal"
rows of the kernel called directly with its state walks split over d_v blocks
(`block_v`), beside the same call unsplit (`block_v=d`); `--impls` keeps only the rows
whose impl starts with one of its names.

    python scripts/bench_linear_kernels.py --out docs/kernel_runs/linear_h100.md   # GPU
    python scripts/bench_linear_kernels.py --quick --out /tmp/linear.md             # CPU smoke run
    python scripts/bench_linear_kernels.py --lengths 16384 --head-dims 128 --only 'linear causal' \
        --impls 'pallas block_v' --block-v 32 64 --no-fla                           # split against unsplit
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import os
import statistics
import sys
import time

HAVE_FLA = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("fla") is not None
if HAVE_FLA:  # JAX would otherwise take 75% of the GPU's memory before PyTorch asks
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import timed, with_grad, write_markdown  # noqa: E402 - the block-sparse benchmark's timing, shared

from jxformers import ops  # noqa: E402
from jxformers.kernels.linear import chunked_linear_attention  # noqa: E402
from jxformers.ops.kernelized import FEATURE_MAPS  # noqa: E402
from jxformers.tools.help_text import description  # noqa: E402

CHUNK = 64


def linear_flops(n: int, m: int, dv: int, chunk: int = CHUNK) -> tuple[float, float]:
    """(forward, forward+backward) FLOPs per head of the chunked algorithm."""
    fwd = 2.0 * n * (chunk * m + chunk * dv + 2 * m * dv)
    return fwd, fwd + 2.0 * n * (3 * chunk * m + 2 * chunk * dv + 6 * m * dv)


def configs(kernel_impl: str, chunk: int = CHUNK, d: int = 0, block_vs: tuple[int, ...] = ()):
    """name -> {impl label: attend(q, k, v) on one example}; with `block_vs`, "linear
    causal" also has the kernel's own call with each block_v up to the head size `d` and
    with block_v = d (unsplit), so the split is timed against the same call."""
    elu = FEATURE_MAPS["elu"]

    def linear(impl, form="chunked", causal=True):
        return functools.partial(ops.linear_attention, causal=causal, impl=impl, form=form, chunk_size=chunk)

    def gated(impl, form="chunked"):
        def attend(q, k, v, gate_logits):
            return ops.kernel_attention(
                elu(q),
                elu(k),
                v,
                causal=True,
                gate=jax.nn.sigmoid(gate_logits),
                form=form,
                chunk_size=chunk,
                impl=impl,
                dtype=q.dtype,
            )

        return attend

    def split(block_v):  # the ops take no block_v: the kernel's API
        def attend(q, k, v):
            return chunked_linear_attention(
                elu(q), elu(k), v, chunk_size=chunk, block_v=block_v, interpret=kernel_impl == "interpret"
            )

        return attend

    causal_rows = {"pallas": linear(kernel_impl), "xla chunked": linear("xla"), "xla scan": linear("xla", "scan")}
    if block_vs:
        causal_rows |= {f"pallas block_v={bv}": split(bv) for bv in sorted({d, *block_vs}, reverse=True) if bv <= d}
    yield "linear causal", causal_rows
    yield "linear gated", {"pallas": gated(kernel_impl), "xla chunked": gated("xla"), "xla scan": gated("xla", "scan")}

    def per_feature(q, k, v, gate_logits):  # gated linear attention's decay per feature (the kernel's API only)
        return chunked_linear_attention(
            elu(q),
            elu(k),
            v,
            log_gate=jax.nn.log_sigmoid(gate_logits),
            chunk_size=chunk,
            interpret=kernel_impl == "interpret",
        )

    yield "linear gated per feature", {"pallas": per_feature}
    yield "linear non-causal", {"pallas": linear(kernel_impl, causal=False), "xla": linear("xla", causal=False)}
    yield (
        "softmax causal",
        {
            "flash pallas": functools.partial(ops.softmax_attention, causal=True, impl=kernel_impl),
            "cudnn": functools.partial(jax.nn.dot_product_attention, implementation="cudnn", is_causal=True),
        },
    )


def compiled(name, impl, fn, q, k, v, gate_logits):
    """(jitted forward, jitted gradient taking an output cotangent, inputs) over the batch."""
    if name.startswith("linear gated"):
        if name.endswith("per feature"):
            gate_logits = jnp.broadcast_to(gate_logits[..., None], q.shape)
        fwd = jax.jit(jax.vmap(fn))
        grad = jax.jit(
            jax.grad(
                lambda q, k, v, g, do: jnp.sum(fwd(q, k, v, g).astype(jnp.float32) * do.astype(jnp.float32)),
                argnums=(0, 1, 2),
            )
        )
        return fwd, grad, (q, k, v, gate_logits)
    whole = impl == "cudnn"  # takes the batch itself
    return jax.jit(fn if whole else jax.vmap(fn)), with_grad(fn if whole else jax.vmap(fn)), (q, k, v)


def _rel(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def check(name, fwd, grad, inputs, do, reference) -> str:
    """Relative errors of a kernel's output and gradients against `reference` (an XLA
    form) run in float32 on the same inputs, at full float32 matmul precision."""
    got = (fwd(*inputs), *grad(*inputs, do))
    wide = tuple(x.astype(jnp.float32) for x in inputs)
    ref_fwd, ref_grad, _ = compiled(name, "xla", reference, *wide[:3], wide[3] if len(wide) > 3 else None)
    with jax.default_matmul_precision("highest"):
        want = (ref_fwd(*wide), *ref_grad(*wide, do.astype(jnp.float32)))
    finite = all(bool(jnp.isfinite(x).all()) for x in got)
    return ("" if finite else "NaN/Inf! ") + " / ".join(f"{_rel(a, b):.1e}" for a, b in zip(got, want, strict=True))


def fla_rows(n, d, batch, heads, repeat, backward: bool = True):
    """flash-linear-attention's chunk kernels (PyTorch), when importable:
    {(config, impl): (fwd ms, fwd+bwd ms or None)}."""
    import torch

    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        chunk_linear_attn = None
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        chunk_simple_gla = None
    try:
        from fla.ops.gla import chunk_gla
    except ImportError:
        chunk_gla = None
    if not torch.cuda.is_available():
        return {}

    def torch_timed(fn, repeat):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    shape = (batch, n, heads, d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    q_f, k_f = (torch.nn.functional.elu(x) + 1 for x in (q.detach(), k.detach()))
    q_f.requires_grad_(), k_f.requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn((batch, n, heads), device="cuda") + 2.0)
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    rows = {}
    calls = {}

    def call(fn, **kwargs):  # [B, T, H, d] inputs; older versions default to head-first
        if "head_first" in inspect.signature(fn).parameters:
            kwargs["head_first"] = False
        result = fn(q_f, k_f, v, scale=1.0, **kwargs)
        return result[0] if isinstance(result, tuple) else result  # (output, final state)

    if chunk_linear_attn is not None:
        calls[("linear causal", "fla chunk_linear_attn")] = lambda: call(chunk_linear_attn, normalize=True)
    if chunk_simple_gla is not None:
        calls[("linear gated", "fla chunk_simple_gla")] = lambda: call(chunk_simple_gla, g=g)
    if chunk_gla is not None:
        g_feature = g[..., None].expand(shape).contiguous()
        calls[("linear gated per feature", "fla chunk_gla")] = lambda: call(chunk_gla, g=g_feature)
    for key, run in calls.items():
        try:
            with torch.no_grad():
                fwd = torch_timed(run, repeat)
            bwd = torch_timed(lambda: run().backward(do), repeat) if backward else None  # noqa: B023 - called here
        except Exception as e:  # noqa: BLE001 - an optional baseline that fails is reported, not fatal
            print(f"{n} {d} {key}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows[key] = (fwd, bwd)
    q = k = v = q_f = k_f = g = do = calls = run = None  # frees the tensors (the lambdas share these cells)
    torch.cuda.empty_cache()
    return rows


def crossover(rows, which: int) -> str:
    """The shortest N at which the linear kernel (causal) beats the faster softmax baseline."""
    by_n = {}
    for n, d, config, impl, ms in ((r[0], r[1], r[2], r[3], r[which]) for r in rows):
        if ms == "-":
            continue
        slot = by_n.setdefault((d, n), {})
        if config == "linear causal" and impl == "pallas":
            slot["linear"] = float(ms)
        elif config == "softmax causal":
            slot["softmax"] = min(slot.get("softmax", float("inf")), float(ms))
    lines = []
    for d in sorted({d for d, _ in by_n}, key=int):
        both = {int(n): s for (dd, n), s in by_n.items() if dd == d and "linear" in s and "softmax" in s}
        wins = [n for n, s in both.items() if s["linear"] < s["softmax"]]
        if not both:
            lines.append(f"d = {d}: not measured")
        elif wins:
            lines.append(f"d = {d}: from N = {min(wins)} (measured N: {sorted(both)})")
        else:
            lines.append(f"d = {d}: none up to N = {max(both)}")
    return "; ".join(lines)


def write_table(args, argv, header, rows, note) -> None:
    footer = (
        f"\nCrossover (linear kernel faster than the faster of flash pallas and cuDNN, causal): forward: "
        f"{crossover(rows, 5)}. Forward+backward: {crossover(rows, 8)}.\n" + (f"\n{note}\n" if note else "")
    )
    setting = (
        f"{args.dtype}, {args.heads} heads, batch = {args.batch_tokens} tokens / N; chunk {args.chunk}; "
        "elu + 1 features"
    )
    write_markdown(args.out, "bench_linear_kernels.py", argv, setting, header, rows, footer)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=65536, help="batch = max(1, this / N)")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--only", nargs="*", help="config names to run (default: all)")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="chunk of the kernel and the XLA chunked form")
    parser.add_argument(
        "--block-v",
        type=int,
        nargs="*",
        default=[],
        help="also time 'linear causal' with the state walks split over d_v blocks of these sizes (and unsplit)",
    )
    parser.add_argument("--impls", nargs="*", help="impls to run, by prefix (default: all)")
    parser.add_argument("--scan-max", type=int, default=4096, help="skip the token-by-token XLA scan above this N")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=270.0,
        help="start no new measurement after this many seconds (the table says where it stopped)",
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="skip checking each kernel row's output and gradients against the XLA form in float32",
    )
    parser.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention even when importable")
    parser.add_argument(
        "--fla-forward-only",
        action="store_true",
        help="time flash-linear-attention's forward only (its backward autotunes for minutes)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes for a CPU smoke run (kernels in interpret mode)"
    )
    parser.add_argument("--out", help="write the markdown table here (after every row)")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.head_dims, args.heads, args.batch_tokens, args.repeat = [128, 256], [16], 2, 256, 2

    on_gpu = jax.default_backend() == "gpu"
    kernel_impl = "pallas" if jax.default_backend() != "cpu" else "interpret"
    dtype = jnp.dtype(args.dtype)
    started = time.perf_counter()
    header = (
        "N",
        "d",
        "config",
        "impl",
        "batch",
        "fwd ms",
        "fwd GB/s",
        "fwd TFLOP/s",
        "fwd+bwd ms",
        "fwd+bwd GB/s",
        "fwd+bwd TFLOP/s",
        "rel err out / dq / dk / dv",
    )
    rows, note = [], ""
    print(" | ".join(header), flush=True)
    for n in args.lengths:
        batch = max(1, args.batch_tokens // n)
        for d in args.head_dims:
            keys = jax.random.split(jax.random.PRNGKey(n + d), 5)
            shape = (batch, n, args.heads, d)
            q, k, v, do = (jax.random.normal(key, shape, dtype) for key in keys[:4])
            gate_logits = jax.random.normal(keys[4], (batch, n, args.heads)) + 2.0
            lin_fwd, lin_all = linear_flops(n, d, d, args.chunk)
            heads_total = batch * args.heads
            bytes_fwd, bytes_all = (
                8.0 * n * d * heads_total * dtype.itemsize / 2,
                24.0 * n * d * heads_total * dtype.itemsize / 2,
            )
            measured, errors = {}, {}
            for name, impls in configs(kernel_impl, args.chunk, d, tuple(args.block_v)):
                if args.only and name not in args.only:
                    continue
                for impl, fn in impls.items():
                    if args.impls and not any(impl.startswith(prefix) for prefix in args.impls):
                        continue
                    if time.perf_counter() - started > args.time_limit:
                        note = (
                            f"Stopped at the time limit ({args.time_limit:.0f} s) before "
                            f"N = {n}, d = {d}, {name}, {impl}."
                        )
                        break
                    if impl == "xla scan" and n > args.scan_max:
                        continue
                    if impl == "cudnn" and not on_gpu:
                        continue
                    fwd, grad, inputs = compiled(name, impl, fn, q, k, v, gate_logits)
                    try:
                        ms = timed(fwd, *inputs, repeat=args.repeat)
                        ms_all = timed(grad, *inputs, do, repeat=args.repeat)
                    except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
                        print(f"{n} {d} {name} {impl}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    measured[(name, impl)] = (ms, ms_all)
                    reference = next((r for r in ("xla chunked", "xla") if r in impls), None)
                    if impl.startswith("pallas") and reference is not None and not args.no_check:
                        errors[(name, impl)] = check(name, fwd, grad, inputs, do, impls[reference])
                if note:
                    break

            def emit(measured):  # rows out and written at once: a run cut short keeps what it measured
                for (name, impl), (ms, ms_all) in measured.items():
                    if name == "softmax causal":
                        f_fwd = 2.0 * n * n * d * heads_total  # noqa: B023 - called within this iteration
                        f_all = 3.5 * f_fwd
                    else:
                        f_fwd, f_all = lin_fwd * heads_total, lin_all * heads_total  # noqa: B023 - called within this iteration
                    row = (
                        str(n),  # noqa: B023
                        str(d),  # noqa: B023
                        name,
                        impl,
                        str(batch),  # noqa: B023
                        f"{ms:.3f}",
                        f"{bytes_fwd / ms / 1e6:.1f}",  # noqa: B023
                        f"{f_fwd / ms / 1e9:.1f}",
                        f"{ms_all:.3f}" if ms_all else "-",
                        f"{bytes_all / ms_all / 1e6:.1f}" if ms_all else "-",  # noqa: B023 - called within this iteration
                        f"{f_all / ms_all / 1e9:.1f}" if ms_all else "-",
                        errors.get((name, impl), "-"),  # noqa: B023
                    )
                    rows.append(row)
                    print(" | ".join(row), flush=True)
                if args.out:
                    write_table(args, argv, header, rows, note)  # noqa: B023 - called within this iteration

            emit(measured)
            if HAVE_FLA and on_gpu and not args.no_fla and not note:
                # fla autotunes each Triton kernel on its first call: its backward compiled
                # for over 5 minutes on an H100 (2026-11-25), hence --fla-forward-only.
                emit(fla_rows(n, d, batch, args.heads, args.repeat, backward=not args.fla_forward_only))
            if note:
                break
        if note:
            break
    print("crossover forward:", crossover(rows, 5), "| forward+backward:", crossover(rows, 8), flush=True)
    if note:
        print(note, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
