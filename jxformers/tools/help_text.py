"""Command-line help drawn from module docstrings: `description(__doc__)` is the
docstring's first paragraph on one line (its first line alone would cut a sentence)."""


def description(doc: str | None) -> str:
    """The first paragraph of `doc`, its lines joined by single spaces."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())
