"""Records per second through `make_loader` for several read-ahead thread counts, side by
side in one process: Pathfinder-32 (contour length 6) and ListOps generated on the fly,
and a built Pathfinder split (docs/data.md, "Read-ahead threads").

    python scripts/bench_read_threads.py [--threads 16 0 1 2] [--batches 40]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from jxformers.data import make_loader, make_source
from jxformers.data.cache import build_split, read_split


def rate(source, *, threads: int, batches: int, batch: int = 8) -> float:
    """Records per second after the first batch, no worker processes."""
    iterator = iter(make_loader(source, batch_size=batch, seed=0, read_threads=threads))
    try:
        next(iterator)
        began = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return batches * batch / (time.perf_counter() - began)
    finally:
        iterator.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[16, 0, 1, 2])
    p.add_argument("--batches", type=int, default=40, help="batches of 8 per generated source (5x for the built split)")
    args = p.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f} at the start); records/s, batches of 8\n"
    )
    print("| source | " + " | ".join(f"{t} threads" for t in args.threads) + " |")
    print("|---|" + "---:|" * len(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        small = make_source("pathfinder", seed=0, size=2000, contour_length=6)
        build_split(small, os.path.join(tmp, "pathfinder"), processes=2, records_per_shard=500, progress=False)
        cases = [
            (
                "Pathfinder 32x32, contour 6",
                make_source("pathfinder", seed=0, size=100_000, contour_length=6),
                args.batches,
            ),
            ("ListOps", make_source("listops", seed=0, size=100_000), args.batches),
            ("a built Pathfinder split", read_split(tmp, "pathfinder", small), 5 * args.batches),
        ]
        for name, source, batches in cases:
            rates = [rate(source, threads=t, batches=batches) for t in args.threads]
            print(f"| {name} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |", flush=True)


if __name__ == "__main__":
    main()
