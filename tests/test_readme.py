"""The README's Python examples run as written, each on its own in an empty namespace (a
reader copies one block, imports included). A reader who runs them top to bottom runs
the same statements: no block reads a name that another defines, or it would fail here
(so an in-order run in one namespace, which ran every example a second time, is not
repeated). The README stays a front
page (the rest lives in docs/, the site's pages, whose examples tests/test_docs_examples.py
runs) and its links lead somewhere."""

import pathlib
import re
import warnings

import pytest

from jxformers.nn.config import FlatConfigWarning

TEXT = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def run(block: str, namespace: dict, index: int) -> None:
    """Run one block; a FlatConfigWarning is an error: the README shows the component form."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatConfigWarning)
        exec(compile(block, f"README.md python block {index}", "exec"), namespace)


def test_readme_shows_python_usage():
    assert BLOCKS, "the README should show Python usage"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_on_its_own(index):
    run(BLOCKS[index], {}, index)


def test_readme_is_a_front_page():
    lines = TEXT.count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move detail to a page under docs/ and link it"


def test_readme_links_lead_to_files_and_headings():
    root = pathlib.Path(__file__).parents[1]
    for target in re.findall(r"\]\(([^)\s]+)\)", TEXT):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        page = root / path if path else root / "README.md"
        assert page.is_file(), f"README.md links to {target}, which is not a file"
        if anchor and page.suffix == ".md":
            slugs = {
                re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)
            }
            assert anchor in slugs, f"README.md links to {target}, but {path or 'README.md'} has no such heading"
