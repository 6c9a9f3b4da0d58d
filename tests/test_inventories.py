"""Inventories are written once and read everywhere else: each package's docstring names
every file in it (and nothing that is not there), and the values of `impl` are listed
only beside `jxformers.kernels.IMPLS` (`jxformers/kernels/impl.py`); other docstrings and
docs refer to it."""

import ast
import pathlib
import re

import pytest

from jxformers.kernels import IMPLS

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "jxformers"
SUBPACKAGES = sorted(p.parent for p in PACKAGE.rglob("*/__init__.py"))


def docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def named(text: str, module: str) -> bool:
    """`module` appears as `module.py` or `` `module` `` (or a line's first word)."""
    m = re.escape(module)
    return bool(re.search(rf"(?<![\w/.]){m}\.py\b|`{m}`|^\s*{m}\s", text, flags=re.M))


@pytest.mark.parametrize("package", SUBPACKAGES, ids=lambda p: p.name)
def test_each_package_docstring_names_its_files_and_only_them(package):
    text = docstring(package / "__init__.py")
    modules = sorted(p.stem for p in package.glob("*.py") if not p.name.startswith("_"))
    subpackages = sorted(p.parent.name for p in package.glob("*/__init__.py"))
    assert not [m for m in modules if not named(text, m)], f"{package.name}/__init__.py's docstring omits these files"
    assert not [s for s in subpackages if f"{s}/" not in text], f"{package.name}/__init__.py omits these subpackages"
    listed = set(re.findall(r"(?<![\w/.])(\w+)\.py\b", text))
    assert not listed - set(modules), f"{package.name}/__init__.py's docstring names files that are not there"


def test_the_package_docstring_names_every_subpackage_and_module():
    text = docstring(PACKAGE / "__init__.py")
    entries = sorted(
        p.stem
        for p in PACKAGE.iterdir()
        if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or p.is_dir() and p.name != "__pycache__")
    )
    assert not [e for e in entries if not named(text, e)], "jxformers/__init__.py's docstring omits these"


_IMPL = "|".join(IMPLS)
# Three or more impl values in a row ("auto", "xla", "pallas" or "interpret"; auto | xla | pallas):
# an enumeration that drifts when a value is added.
ENUMERATION = re.compile(rf'"?\b(?:{_IMPL})\b"?(?:\s*(?:,|\||\bor\b|\band\b)\s*(?:or\s+)?"?\b(?:{_IMPL})\b"?){{2,}}')


def test_impl_values_are_enumerated_only_beside_IMPLS():
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
    ]
    found = [
        f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
        for path in files
        if path != PACKAGE / "kernels" / "impl.py"
        for text in [path.read_text()]
        for m in ENUMERATION.finditer(text)
    ]
    assert not found, "refer to jxformers.kernels.IMPLS instead of listing impl values:\n" + "\n".join(found)


def test_the_impl_inventory_describes_every_value():
    text = docstring(PACKAGE / "kernels" / "impl.py")
    assert [v for v in IMPLS if f'impl="{v}"' not in text] == []
