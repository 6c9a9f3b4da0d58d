"""XLA's own accounting of a compiled program: FLOPs from its cost analysis and the
temporary memory from its memory analysis. One place reads both (benchmarks, tests,
the train loop), because their return shapes differ across jax versions and backends.

FLOPs are counted on the lowered program (before the backend's passes) when it is at
hand: a GPU's compiled program calls cuBLAS and cuDNN for its matrix products, and XLA's
cost analysis of the compiled program leaves those calls out. The LRA ListOps model of
LRA's size counted 2.9 MFLOP a token on an H200 that way, where its own ops (and the
CPU's count of the same step) are 192 MFLOP a token."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Cost:
    """flops: XLA-counted floating-point operations (nan when the backend gives none);
    temp_bytes: compiled temporary memory (activations, workspaces), 0 when unknown;
    argument_bytes: the inputs the program holds while it runs (parameters, optimizer
    state, batch), 0 when unknown."""

    flops: float
    temp_bytes: int
    argument_bytes: int = 0


def _flops(stage) -> float:
    analysis = stage.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return float((analysis or {}).get("flops", float("nan")))


def cost_of(compiled, lowered=None) -> Cost:
    """The cost of an already compiled program (`jax.jit(f).lower(...).compile()`);
    with `lowered` (the `.lower(...)` it was compiled from) its FLOPs are counted there,
    library calls included (see the module docstring)."""
    flops = _flops(compiled if lowered is None else lowered)
    memory = compiled.memory_analysis()
    temp = int(getattr(memory, "temp_size_in_bytes", 0)) if memory is not None else 0
    arguments = int(getattr(memory, "argument_size_in_bytes", 0)) if memory is not None else 0
    return Cost(flops, temp, arguments)


def compile_with_cost(fn: Callable, *args) -> tuple[Callable, Cost]:
    """Compile `fn` for `args` (arrays or `jax.ShapeDtypeStruct`s) once; return the
    compiled callable and its cost."""
    lowered = jax.jit(fn).lower(*args)
    compiled = lowered.compile()
    return compiled, cost_of(compiled, lowered)
