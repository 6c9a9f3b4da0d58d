"""Records per second of the generated tasks: made on the fly with 0 and N grain
workers, built once to disk (`jxformers data build`, N processes), and read back from
the built split. Prints a markdown table (the one in docs/data.md).

    python scripts/bench_data.py [--workers N] [--seconds S]

Every rate is measured through `make_loader` (batches of --batch records), after the
first batch (which pays for starting the workers); rates taken in one run, side by
side, compare; absolute ones hold only for the machine (the command prints it).
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

from jxformers.data import make_loader, make_source
from jxformers.data.cache import build_split, read_split

# (row name, task, settings): LRA's ListOps and Pathfinder-32 at its three difficulties.
CASES = [
    ("ListOps (500-2000 tokens)", "listops", {}),
    ("Pathfinder 32x32, contour 6", "pathfinder", {"contour_length": 6}),
    ("Pathfinder 32x32, contour 9", "pathfinder", {"contour_length": 9}),
    ("Pathfinder 32x32, contour 14", "pathfinder", {"contour_length": 14}),
]


def loader_rate(source, *, batch: int, workers: int, seconds: float) -> float:
    """Records per second after the first batch."""
    iterator = iter(make_loader(source, batch_size=batch, seed=0, workers=workers))
    try:
        next(iterator)
        began, batches = time.perf_counter(), 0
        while time.perf_counter() - began < seconds:
            next(iterator)
            batches += 1
        return batches * batch / (time.perf_counter() - began)
    finally:
        iterator.close()


def build_rate(source, directory, *, processes: int) -> float:
    began = time.perf_counter()
    build_split(
        source, directory, processes=processes, records_per_shard=max(1, len(source) // (2 * processes)), progress=False
    )
    return len(source) / (time.perf_counter() - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="workers / build processes (default: CPUs)")
    p.add_argument("--seconds", type=float, default=8.0, help="time per on-the-fly measurement")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--build-seconds",
        type=float,
        default=20.0,
        help="about how long each build runs (its size is set from the on-the-fly rate)",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        choices=sorted({task for _, task, _ in CASES}),
        help="measure only these tasks (default: all)",
    )
    args = p.parse_args()
    n = args.workers
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f} at the start); command: python scripts/bench_data.py "
        f"--workers {n} --seconds {args.seconds:g} --batch {args.batch} --build-seconds {args.build_seconds:g}"
        + (f" --tasks {' '.join(args.tasks)}" if args.tasks else "")
        + "\n"
    )
    rows = [
        f"| task | on the fly, 0 workers | on the fly, {n} workers | build ({n} processes) | read the built split "
        f"| built / on the fly (0 workers) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, task, settings in CASES:
            if args.tasks and task not in args.tasks:
                continue
            source = make_source(task, seed=0, size=100_000, **settings)
            alone = loader_rate(source, batch=args.batch, workers=0, seconds=args.seconds)
            parallel = loader_rate(source, batch=args.batch, workers=n, seconds=args.seconds)
            size = max(4 * args.batch, int(parallel * args.build_seconds))
            small = make_source(task, seed=0, size=size, **settings)
            built = build_rate(small, os.path.join(tmp, task + str(settings)), processes=n)
            read = loader_rate(
                read_split(tmp, task + str(settings), small), batch=args.batch, workers=0, seconds=args.seconds
            )
            rows.append(
                f"| {name} | {alone:,.0f} | {parallel:,.0f} | {built:,.0f} | {read:,.0f} | {read / alone:,.0f}x |"
            )
            print(rows[-1], flush=True)
    print("\nrecords per second\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
