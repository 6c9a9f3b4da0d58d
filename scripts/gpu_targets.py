"""The kernel issue's speed targets read off benchmark tables: each target, the measured
value, and whether it was met (or "not measured" when no table holds the rows it needs).
Reads the markdown tables bench_kernels.py and bench_linear_kernels.py write, and the
grouped-matmul line of bench_moe.py; the campaign prints it last.

    python scripts/gpu_targets.py docs/kernel_runs/*.md docs/moe_runs/gpu.md

Ratios are taken within one table (one run on one machine), never across tables.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    n: int
    d: int
    pattern: str
    impl: str
    visited: float
    fwd: float
    fwd_bwd: float | None


def read_rows(text: str) -> list[Row]:
    """The rows of bench_kernels.py tables (N | d | pattern | impl | visited | fwd ms | ...)
    and bench_linear_kernels.py tables (N | d | config | impl | batch | fwd ms | ...)."""
    rows = []
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| N |"):
            # Only the kernel tables (a head-size column); the models benchmark's table
            # (| N | batch | model | ...) has no per-kernel rows.
            header = cells if "d" in cells else None
            continue
        if header is None or not line.startswith("| ") or not cells[0].isdigit():
            continue
        cell = dict(zip(header, cells, strict=False))

        def number(name, cell=cell):
            value = cell.get(name, "-")
            return None if value in ("-", "") else float(value)

        rows.append(
            Row(
                int(cell["N"]),
                int(cell["d"]),
                cell.get("pattern") or cell.get("config"),
                cell["impl"],
                number("visited") if "visited" in cell else 1.0,
                number("fwd ms"),
                number("fwd+bwd ms"),
            )
        )
    return rows


def best(
    rows: list[Row], n: int, d: int, pattern: str, impl_prefix: str, field: str = "fwd", exact: bool = False
) -> float | None:
    """The fastest `field` among rows of this shape whose impl starts with (or, `exact`,
    is) `impl_prefix`."""
    times = [
        getattr(r, field)
        for r in rows
        if (r.n, r.d, r.pattern) == (n, d, pattern)
        and (r.impl == impl_prefix if exact else r.impl.startswith(impl_prefix))
        and getattr(r, field) is not None
    ]
    return min(times) if times else None


def visited(rows: list[Row], n: int, d: int, pattern: str) -> float | None:
    return next((r.visited for r in rows if (r.n, r.d, r.pattern) == (n, d, pattern)), None)


def targets(rows: list[Row], grouped_matmul_percent: float | None) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each target; met None when not measured."""
    out = []

    def ratio(name, num, den, goal, higher_is_better=True, unit="x"):
        if num is None or den is None:
            out.append((name, "not measured", None))
            return
        value = num / den
        out.append((name, f"{value:.2f}{unit}", value >= goal if higher_is_better else value <= goal))

    d = 128
    # Speed relative to cuDNN is cuDNN's time over ours.
    ratio(
        "dense forward at 8K >= 0.8x cuDNN",
        best(rows, 8192, d, "dense", "dot_product_attention cudnn"),
        best(rows, 8192, d, "dense", "pallas"),
        0.8,
    )
    ratio(
        "dense forward+backward at 8K >= 0.7x cuDNN",
        best(rows, 8192, d, "dense", "dot_product_attention cudnn", "fwd_bwd"),
        best(rows, 8192, d, "dense", "pallas", "fwd_bwd"),
        0.7,
    )
    # The same kernel on both patterns: the target is about cost following density.
    impls = sorted({r.impl for r in rows if r.pattern == "causal window 512" and r.impl.startswith("pallas")})
    window = [
        (best(rows, 16384, d, "causal", i, exact=True), best(rows, 16384, d, "causal window 512", i, exact=True))
        for i in impls
    ]
    window = [(a, b) for a, b in window if a is not None and b is not None]
    ratio(
        "causal window 512 at 16K >= 12x faster than dense causal (same kernel)",
        *(max(window, key=lambda ab: ab[0] / ab[1]) if window else (None, None)),
        12.0,
    )
    for pattern in (
        "bigbird b64",
        "longformer w256 g2",
        "sparse_transformer strided s128 causal",
        "sparse_transformer fixed s128 c8 causal",
    ):
        for n in (8192, 16384):
            ms, frac, dense = (
                best(rows, n, d, pattern, "pallas", exact=True),
                visited(rows, n, d, pattern),
                best(rows, n, d, "dense", "pallas", exact=True),
            )
            per_block = None if ms is None or frac is None else ms / frac
            ratio(
                f"{pattern} at {n}: time per visited block <= 1.3x the dense kernel's",
                per_block,
                dense,
                1.3,
                higher_is_better=False,
            )
    for form, field in (("forward", "fwd"), ("forward+backward", "fwd_bwd")):
        fla = [r for r in rows if (r.n, r.d, r.pattern) == (16384, d, "linear causal") and r.impl.startswith("fla")]
        ratio(
            f"linear attention at 16K {form} <= 1.25x flash-linear-attention's time",
            best(rows, 16384, d, "linear causal", "pallas", field),
            min((getattr(r, field) for r in fla if getattr(r, field) is not None), default=None),
            1.25,
            higher_is_better=False,
        )
    out.append(
        (
            "MoE grouped matmul >= 50% of a dense matmul",
            "not measured" if grouped_matmul_percent is None else f"{grouped_matmul_percent:.0f}%",
            None if grouped_matmul_percent is None else grouped_matmul_percent >= 50,
        )
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the kernel issue's speed targets read off benchmark tables")
    parser.add_argument("tables", nargs="+", help="markdown files written by the GPU benchmarks")
    args = parser.parse_args(argv)
    measured_anywhere = set()
    names = []
    for path in args.tables:  # ratios within one table only: one run, one machine
        with open(path) as f:
            text = f.read()
        found = re.search(r"grouped_matmul.*?: (\d+)% of dense", text)
        results = targets(read_rows(text), float(found.group(1)) if found else None)
        names = [name for name, _, _ in results]
        shown = [(name, value, met) for name, value, met in results if met is not None]
        if shown:
            print(f"{path}:")
        for name, value, met in shown:
            measured_anywhere.add(name)
            print(f"  {'met' if met else 'MISSED':7s} {name}: {value}")
    for name in names:
        if name not in measured_anywhere:
            print(f"  {'-':7s} {name}: not measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
