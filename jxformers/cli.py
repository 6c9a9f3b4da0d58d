"""The `jxformers` command: `jxformers list` prints the attention registry,
`jxformers bench` runs the attention benchmark (see `jxformers bench --help`)."""

from __future__ import annotations

import argparse
import sys

USAGE = """usage: jxformers COMMAND [ARGS]

commands:
  list     print the attention registry (names, capabilities, hyper-parameters)
  bench    time and measure every attention against softmax (--help for options)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "list":
        argparse.ArgumentParser(prog="jxformers list", description="print the attention registry").parse_args(rest)
        from jxformers import registry

        print(registry.table())
        return 0
    if command == "bench":
        from jxformers import bench

        return bench.main(rest)
    print(f"jxformers: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
