"""The README's Python examples run as written (in order, sharing one namespace)."""

import pathlib
import re


def test_readme_python_blocks_run():
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the README should show Python usage"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
