"""The README's Python examples run as written: each on its own (a reader copies one
block, imports included) and all in order in one namespace."""

import pathlib
import re

import pytest

TEXT = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def run(block: str, namespace: dict, index: int) -> None:
    exec(compile(block, f"README.md python block {index}", "exec"), namespace)


def test_readme_shows_python_usage():
    assert BLOCKS, "the README should show Python usage"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs_on_its_own(index):
    run(BLOCKS[index], {}, index)


@pytest.mark.heavy
def test_readme_python_blocks_run_in_order():
    namespace: dict = {}
    for index, block in enumerate(BLOCKS):
        run(block, namespace, index)
