"""Pathfinder's shortcut check: held-out accuracy of baselines that look only at cues a
model should not need (marker distance, total ink, component count, ink near the
markers, ink on the line between them, ink facing the other marker, all together), for
each difficulty. Each should sit near 0.5; a test bounds them at 0.56.

    python scripts/pathfinder_shortcuts.py                      # 4000 images per length
    python scripts/pathfinder_shortcuts.py --n 2000 --lengths 6 9 14 --size 32
"""

import argparse
import sys
import time

from jxformers.data import pathfinder
from jxformers.data.pathfinder_check import baselines, render_many


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4000, help="images per contour length (half fit, half held out)")
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 9, 14])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    columns, speed = {}, {}
    for length in args.lengths:
        start = time.process_time()
        images, labels = render_many(args.seed, args.n, size=args.size, contour_length=length)
        speed[length] = args.n / (time.process_time() - start)
        columns[length] = baselines(images, labels)
    print(
        f"Pathfinder {args.size}x{args.size}, {args.n} images per length (seed {args.seed}); "
        "held-out accuracy of each baseline (chance 0.5):\n"
    )
    print("| baseline | " + " | ".join(f"length {n}" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    for name in columns[args.lengths[0]]:
        if name != "images used":
            print(f"| {name} | " + " | ".join(f"{columns[n][name]:.3f}" for n in args.lengths) + " |")
    print(
        "| distractors | " + " | ".join(str(pathfinder.default_distractors(args.size, n)) for n in args.lengths) + " |"
    )
    print("| images/s on one core | " + " | ".join(f"{speed[n]:.0f}" for n in args.lengths) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
