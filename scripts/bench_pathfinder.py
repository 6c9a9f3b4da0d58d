"""Images per second on one core of Pathfinder generators, side by side in one process:
this checkout's `jxformers.data.pathfinder` (one image at a time with `render`, and
many at once with `render_batch`, as the loader's read-ahead and `jxformers data build`
do) and any older versions given as files (each
with its own default settings but the contour length, one image at a time). Rates are
CPU time (process time), the best of --repeats interleaved rounds, so that a shared
machine's load hurts them all alike.

    git show 5f7cd1f^:jxformers/data/pathfinder.py > /tmp/pf_before.py   # before issue 11
    python scripts/bench_pathfinder.py /tmp/pf_before.py [--n 128] [--lengths 6 9 14]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time

from jxformers.data import pathfinder


def load(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path).removesuffix(".py"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rate(module, n: int, length: int, seed: int, batch: bool) -> float:
    began = time.process_time()
    if batch:
        module.render_batch(seed, range(n), contour_length=length)
    else:
        for index in range(n):
            module.render(seed, index, contour_length=length)
    return n / (time.process_time() - began)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("older", nargs="*", help="files holding older versions of pathfinder.py")
    p.add_argument("--n", type=int, default=128, help="images per generator, length and round")
    p.add_argument("--lengths", type=int, nargs="+", default=[6, 9, 14])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    generators = {path: (load(path), False) for path in args.older}
    generators |= {"this checkout, render": (pathfinder, False), "this checkout, render_batch": (pathfinder, True)}
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(load average {os.getloadavg()[0]:.1f}); images/s on one core, best of {args.repeats}\n"
    )
    print("| contour length | " + " | ".join(generators) + " |")
    print("|---|" + "---:|" * len(generators))
    for length in args.lengths:
        best = dict.fromkeys(generators, 0.0)
        for repeat in range(args.repeats):
            for name, (module, batch) in generators.items():
                best[name] = max(best[name], rate(module, args.n, length, seed=100 + repeat, batch=batch))
        print(f"| {length} | " + " | ".join(f"{best[name]:.0f}" for name in generators) + " |", flush=True)


if __name__ == "__main__":
    main()
