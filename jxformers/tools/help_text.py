"""Command-line pieces the commands share: `description(__doc__)` is the docstring's first
paragraph on one line (its first line alone would cut a sentence), and `add_overrides`
adds the repeatable `--set KEY=VALUE` every experiment command takes."""

import argparse


def description(doc: str | None) -> str:
    """The first paragraph of `doc`, its lines joined by single spaces."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    """`--set KEY=VALUE` (repeatable), collected into `args.overrides`."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)
