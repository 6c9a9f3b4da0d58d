"""XLA's own accounting of a compiled program: FLOPs from its cost analysis and the
temporary memory from its memory analysis. One place reads both (benchmarks, tests,
the train loop), because their return shapes differ across jax versions and backends.

On a GPU the FLOP count is too low: the compiled program hands its matrix products to
cuBLAS and cuDNN, and XLA's cost analysis leaves those calls out (the LRA ListOps model
of LRA's size counted 2.9 MFLOP a token on an H200, 192 on a CPU). Counting the lowered
program instead includes them but counts a cumulative sum as the quadratic reduce-window
it is written as (the causal linear attentions' FLOPs then grow as N^2), so neither is
used there yet; GPU tables mark their FLOP columns."""

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


def cost_of(compiled) -> Cost:
    """The cost of an already compiled program (`jax.jit(f).lower(...).compile()`)."""
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    flops = float((analysis or {}).get("flops", float("nan")))
    memory = compiled.memory_analysis()
    temp = int(getattr(memory, "temp_size_in_bytes", 0)) if memory is not None else 0
    arguments = int(getattr(memory, "argument_size_in_bytes", 0)) if memory is not None else 0
    return Cost(flops, temp, arguments)


def compile_with_cost(fn: Callable, *args) -> tuple[Callable, Cost]:
    """Compile `fn` for `args` (arrays or `jax.ShapeDtypeStruct`s) once; return the
    compiled callable and its cost."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, cost_of(compiled)
