"""The package's import graph, read statically (`ast`, nothing imported): no import
circles, no module importing a higher layer, and `jxformers.validate` light.

The layers, lowest first (docs: DESIGN "Layout"):

    base        validate, registry, xla_cost and the private helpers (_typing, _arrays, _terminal):
                no jax model code, importable alone
    kernels     Pallas kernels
    decoding    the decoders (cache, ring buffer, recurrent state) the ops register
    ops         the attention functions, each registered with its decoder
    nn          the modules, ModelConfig, build_model, generation
    data        sources and the loader
    train       experiments, the train state and steps, checkpoints, the loop
    pretrained  checkpoint converters
    tools       the command and the benchmarks
    jxformers   the package itself: names re-exported lazily (its `__getattr__`)

A module may import its own layer and the layers below at module level. An import inside
a function runs only when called (a lazy import): it may reach a higher layer only if it
is listed in `LAZY_UPWARD` below, with its reason. Imports under `if TYPE_CHECKING:` never
run and are not counted. Circles are looked for among all imports, lazy ones included: a
lazy import breaks no circle, it only defers it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "jxformers"

LAYERS = (
    (
        "jxformers.validate",
        "jxformers.registry",
        "jxformers.xla_cost",
        "jxformers._typing",
        "jxformers._arrays",
        "jxformers._terminal",
    ),
    ("jxformers.kernels",),
    ("jxformers.decoding",),
    ("jxformers.ops",),
    ("jxformers.nn",),
    ("jxformers.data",),
    ("jxformers.train",),
    ("jxformers.pretrained",),
    ("jxformers.tools",),
    ("jxformers",),
)

# (importer, imported): lazy imports of a higher layer, each for a reason.
LAZY_UPWARD = {
    # the Shakespeare genre task tokenizes with a pretrained checkpoint's tokenizer when asked
    ("jxformers.data.genre", "jxformers.pretrained.tokenizer"),
    # `jxformers --version` reads the package's version
    ("jxformers.tools.cli", "jxformers"),
}

# `import jxformers.validate` (what a config dataclass needs) loads at most these.
VALIDATE_LOADS_AT_MOST = {"jxformers", "jxformers.validate", "jxformers._typing"}


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Module name -> (file, is a package)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, package: bool, known) -> list[str]:
    """The package modules an import statement loads (a name imported from a package is
    its submodule when one exists)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "jxformers" or a.name.startswith("jxformers.")]
    base = node.module or ""
    if node.level:
        here = module.split(".") if package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([base] if base else []))
    if base != "jxformers" and not base.startswith("jxformers."):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def imports() -> dict[str, dict[str, set[str]]]:
    """Module -> {"module": imports run at import time, "lazy": imports inside functions}."""
    known = modules()
    graph = {}
    for name, (path, package) in known.items():
        edges: dict[str, set[str]] = {"module": set(), "lazy": set()}

        def visit(node, lazy, name=name, package=package, edges=edges):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    for other in child.orelse:
                        visit(other, lazy)
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    edges["lazy" if lazy else "module"].update(_targets(child, name, package, known))
                visit(child, lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(), str(path)), False)
        edges["module"].discard(name)
        edges["lazy"] -= edges["module"] | {name}
        graph[name] = edges
    return graph


def layer(module: str) -> int:
    for index, members in enumerate(LAYERS):
        if any(module == m or module.startswith(m + ".") for m in members if m != "jxformers"):
            return index
    assert module == "jxformers", f"{module} is in no layer: add it to LAYERS"
    return len(LAYERS) - 1


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (one path per strongly connected component of more than one
    module, or a module importing itself)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_every_module_is_in_a_layer():
    for name in modules():
        layer(name)


def test_no_import_circles_lazy_imports_included():
    graph = {m: e["module"] | e["lazy"] for m, e in imports().items()}
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_higher_layer_at_import_time():
    upward = sorted((m, t) for m, e in imports().items() for t in e["module"] if layer(t) > layer(m))
    assert not upward, "imports of a higher layer:\n" + "\n".join(f"{m} -> {t}" for m, t in upward)


def test_lazy_imports_of_a_higher_layer_are_the_listed_ones():
    upward = {(m, t) for m, e in imports().items() for t in e["lazy"] if layer(t) > layer(m)}
    assert not upward - LAZY_UPWARD, f"lazy imports of a higher layer, not listed: {sorted(upward - LAZY_UPWARD)}"
    assert not LAZY_UPWARD - upward, f"listed lazy imports that are gone: {sorted(LAZY_UPWARD - upward)}"


def test_importing_validate_loads_only_validate():
    code = "import sys, jxformers.validate; print(sorted(m for m in sys.modules if m.split('.')[0] == 'jxformers'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = set(ast.literal_eval(out.stdout.strip().splitlines()[-1]))
    assert loaded <= VALIDATE_LOADS_AT_MOST, f"{len(loaded)} modules: {sorted(loaded - VALIDATE_LOADS_AT_MOST)}"


def test_the_package_names_load_on_first_use_and_the_registry_is_filled():
    code = (
        "import sys\nfrom jxformers import decoding, registry\nassert 'softmax' in registry.names(), registry.names()\n"
        "from jxformers import ModelConfig, ShortSequenceWarning, build_model, generate, nn, ops\n"
        "import jxformers\nassert jxformers.kernels.IMPLS and jxformers.ModelConfig is ModelConfig\n"
        "assert 'jxformers.train' not in sys.modules"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr


def test_the_registry_alone_finds_the_shipped_attentions():
    code = "import jxformers.registry as r; print(len(r.names()), r.get('performer').name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) >= 27 and out[1] == "performer"
