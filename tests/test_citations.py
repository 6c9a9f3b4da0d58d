"""Docs and docstrings cite papers (authors, year, title, arXiv id), never the documents
the project started from (its numbered "seeds"), which are not in this repository."""

import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
SEED = re.compile(r"\bseeds?[\s\"'#*+]+0{2}\d|\bseeds/", flags=re.I)


def test_no_file_cites_a_seed_document():
    files = [
        p
        for folder in ("jxformers", "scripts", "tests", "docs")
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and p.suffix in {".py", ".md", ".yaml", ".sh", ".sbatch", ".txt"}
    ]
    files.append(ROOT / "README.md")
    found = [
        f"{p.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for p in files
        for text in [p.read_text()]
        for m in SEED.finditer(text)
    ]
    assert not found, "cite the paper instead of a seed document: " + ", ".join(found)
