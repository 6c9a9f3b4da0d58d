"""The documentation site (mkdocs.yml, docs/): the Python examples of its pages run as
written, each on its own in an empty namespace (a reader copies one block, imports
included; one who runs a page top to bottom runs the same statements, since no block
can read a name another defines and pass here, so the page is not run again in one
namespace); every page is in the nav; the parts pages include from the
README exist; the pages written for the site cite papers, not the project's source
files. `mkdocs build --strict` itself runs in CI, not here.

Blocks a page includes from README.md (`--8<-- "README.md:model"`) run in
tests/test_readme.py, not again here."""

import pathlib
import re
import warnings

import pytest
import yaml

from jxformers.nn.config import FlatConfigWarning, legacy

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)
SNIPPET = re.compile(r'^--8<-- "([^":]+):([\w-]+)"$', flags=re.M)

# Pages whose Python blocks are excerpts to read, not programs to run.
EXCERPTS = {
    "adding_an_attention.md": "fragments of an op, its registration and its test facts, written with `...`",
    "moe.md": "expert_parallel_moe on a mesh of 8 devices, which XLA_FLAGS must create before jax starts",
}


def section(path: str, name: str) -> str:
    """The text between the snippet markers `[start:name]` and `[end:name]` of `path`."""
    text = (ROOT / path).read_text()
    match = re.search(rf"<!-- --8<-- \[start:{name}\] -->\n(.*?)<!-- --8<-- \[end:{name}\] -->", text, flags=re.S)
    assert match, f"{path} has no snippet section {name!r}"
    return match.group(1)


def expanded(page: str) -> str:
    """The page as the site shows it: its `--8<--` lines replaced by what they include."""
    return SNIPPET.sub(lambda m: section(m.group(1), m.group(2)), (DOCS / page).read_text())


def own_blocks(page: str) -> list[str]:
    return BLOCK.findall((DOCS / page).read_text())


PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
RUN = [page for page in PAGES if page not in EXCERPTS and own_blocks(page)]
OWN = [(page, i) for page in RUN for i in range(len(own_blocks(page)))]


def run(block: str, namespace: dict, where: str) -> None:
    """Run one block; a FlatConfigWarning is an error: the pages show the component form
    (the migration section of guide/config.md shows the flat form inside
    `warnings.catch_warnings`, which sets its own filter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatConfigWarning)
        exec(compile(block, where, "exec"), namespace)


@pytest.mark.parametrize(("page", "index"), OWN, ids=[f"{page}-{i}" for page, i in OWN])
def test_docs_python_block_runs_on_its_own(page, index):
    run(own_blocks(page)[index], {}, f"docs/{page} python block {index}")


def test_excerpt_pages_exist_and_hold_python():
    for page in EXCERPTS:
        assert own_blocks(page), f"docs/{page} no longer holds Python excerpts: drop it from EXCERPTS"


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_nav_lists_every_page_once_and_only_pages_that_exist():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    twice = sorted({page for page in nav if nav.count(page) > 1})
    assert not twice, f"pages listed twice in mkdocs.yml's nav: {twice}"
    assert not set(PAGES) - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(set(PAGES) - set(nav))}"
    assert not set(nav) - set(PAGES), f"nav entries without a page under docs/: {sorted(set(nav) - set(PAGES))}"


def test_every_included_snippet_exists():
    for page in PAGES:
        expanded(page)  # raises naming the missing section


SITE_PAGES = ["index.md"] + [p for p in PAGES if p.startswith(("guide/", "api/"))]


@pytest.mark.parametrize("page", SITE_PAGES)
def test_site_pages_cite_papers_not_seed_files(page):
    """The project's source documents are not in the repository: a page names the paper
    (authors, year, title, arXiv id), never "seed 00N"."""
    assert not re.search(r"\bseed 0\d\d\b", expanded(page), flags=re.I), f"docs/{page} cites a seed file"


def test_config_page_maps_every_flat_key_where_legacy_moves_it():
    """guide/config.md's table of flat keys is jxformers.nn.config.legacy.MOVED, row for row."""
    text = (DOCS / "guide" / "config.md").read_text()
    table = text[text.index("| flat key | now |") :]
    rows = dict(re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|$", table, flags=re.M))
    assert rows == legacy.MOVED
