"""docs/fidelity.md has a row for every registered attention and every architecture, so a
new one cannot land without saying how it compares with its paper."""

import pathlib

from jxformers import registry
from jxformers.nn.config import ARCHITECTURES

ROWS = [
    line.split("|")[1]
    for line in (pathlib.Path(__file__).parents[1] / "docs" / "fidelity.md").read_text().splitlines()
    if line.startswith("| ") and not line.startswith("| model / option")
]


def missing_rows(attentions) -> list[str]:
    """The attentions of `attentions` that docs/fidelity.md has no row for."""
    names = {r.strip().split(",")[0].split(" ")[0].strip("`").lower() for r in ROWS}
    text = " ".join(ROWS)
    return [n for n in attentions if n not in names and f"`{n}`" not in text]


def test_every_registered_attention_and_architecture_has_a_fidelity_row():
    text = " ".join(ROWS)
    shipped = [n for n in registry.names() if registry.get(n).op.__module__.startswith("jxformers.")]  # not tests' toys
    missing = missing_rows(shipped)
    missing += [
        a
        for a in ARCHITECTURES
        if a != "transformer" and f"stack `{a}`" not in text and f"stack: {{kind: {a}" not in text
    ]
    assert not missing, f"docs/fidelity.md lacks rows for {missing}"
