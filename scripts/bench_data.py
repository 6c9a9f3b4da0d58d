"""Records per second of the tasks: made on the fly with 0 and N grain workers, built
once to disk (`jxformers data build`, N processes), and read back from the built split.
Prints a markdown table (the ones in docs/data.md).

    python scripts/bench_data.py [--workers N] [--seconds S]
    python scripts/bench_data.py --tasks listops fashion_mnist pathfinder --lra   # LRA's shapes only

Rows: ListOps (500-2000 tokens), the Image stand-in (Fashion-MNIST at 32x32, read from
--fashion-mnist DIR; left out when its files are not there), Pathfinder-32 at its three
difficulties and Path-X (128x128, contour length 14). `--lra`: only the rows at the
shapes of LRA's experiments (lra_listops, lra_image, lra_pathfinder, lra_pathx).

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

# (row name, task, settings, at an LRA experiment's shape): LRA's ListOps, the Image
# stand-in, Pathfinder-32 at its three difficulties (lra_pathfinder: 9) and Path-X.
CASES = [
    ("ListOps (500-2000 tokens)", "listops", {}, True),
    ("Image stand-in: Fashion-MNIST 32x32 (1,024 tokens)", "fashion_mnist", {"image_size": 32}, True),
    ("Pathfinder 32x32, contour 6", "pathfinder", {"contour_length": 6}, False),
    ("Pathfinder 32x32, contour 9", "pathfinder", {"contour_length": 9}, True),
    ("Pathfinder 32x32, contour 14", "pathfinder", {"contour_length": 14}, False),
    ("Path-X 128x128, contour 14 (16,384 tokens)", "pathfinder", {"image_size": 128, "contour_length": 14}, True),
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
        choices=sorted({task for _, task, _, _ in CASES}),
        help="measure only these tasks (default: all)",
    )
    p.add_argument("--lra", action="store_true", help="only the rows at the shapes of LRA's experiments")
    p.add_argument("--fashion-mnist", default="data/fashion-mnist", help="the directory of Fashion-MNIST's idx files")
    args = p.parse_args()
    n = args.workers
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f} at the start); command: python scripts/bench_data.py "
        f"--workers {n} --seconds {args.seconds:g} --batch {args.batch} --build-seconds {args.build_seconds:g}"
        + (f" --tasks {' '.join(args.tasks)}" if args.tasks else "")
        + (" --lra" if args.lra else "")
        + "\n"
    )
    rows = [
        f"| task | on the fly, 0 workers | on the fly, {n} workers | build ({n} processes) | read the built split "
        f"| built / on the fly (0 workers) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for case, (name, task, settings, lra) in enumerate(CASES):
            if (args.tasks and task not in args.tasks) or (args.lra and not lra):
                continue
            if task == "fashion_mnist":
                if not os.path.exists(os.path.join(args.fashion_mnist, "train-images-idx3-ubyte.gz")):
                    print(
                        f"left out: {name} (no Fashion-MNIST at {args.fashion_mnist}: scripts/fetch_fashion_mnist.sh)"
                    )
                    continue
                settings = {**settings, "path": args.fashion_mnist}
            source = make_source(task, seed=0, size=100_000, **settings)
            alone = loader_rate(source, batch=args.batch, workers=0, seconds=args.seconds)
            parallel = loader_rate(source, batch=args.batch, workers=n, seconds=args.seconds)
            size = max(4 * args.batch, int(parallel * args.build_seconds))
            small = make_source(task, seed=0, size=size, **settings)
            built = build_rate(small, os.path.join(tmp, f"case{case}"), processes=n)
            read = loader_rate(read_split(tmp, f"case{case}", small), batch=args.batch, workers=0, seconds=args.seconds)
            rows.append(
                f"| {name} | {alone:,.0f} | {parallel:,.0f} | {built:,.0f} | {read:,.0f} | {read / alone:,.0f}x |"
            )
            print(rows[-1], flush=True)
    print("\nrecords per second\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
