"""jxformers: efficient transformers in pure JAX.

    ops        pure attention functions (one file per family), each registered beside its op
    registry   the registry's machinery: name -> spec, binding, capabilities
    decoding   decoder factories (key/value cache, ring buffer, recurrent state)
    kernels    Pallas kernels beside the pure-JAX ops they accelerate; the `impl` choice
    nn         Equinox modules and models; ModelConfig and build_model; generation
    data       grain sources, the loader, built splits
    train      experiment configs, train state, the train loop, checkpoints
    pretrained converters from published checkpoints (BERT) to jxformers models
    tools      the `jxformers` command, benchmarks, demo, plots
    validate   the one validator of typed config dataclasses
    xla_cost   XLA's FLOPs and memory of a compiled program (benchmarks, tests, the train loop)
    experiments  one YAML config per experiment (package data)

Each subpackage's docstring lists its files. Importing the package imports none of them:
each name below loads on first use (`from jxformers import ModelConfig, ops`), so
`import jxformers.validate` loads the validator alone. `registry` (and `decoding`, which
imports it) load `ops` first, whose modules register every attention: ask for the registry
as `from jxformers import registry`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jxformers import decoding, nn, ops, registry
    from jxformers.nn import ModelConfig, build_model
    from jxformers.nn.config import ShortSequenceWarning
    from jxformers.nn.generation import generate

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ShortSequenceWarning", "build_model", "decoding", "generate", "nn", "ops", "registry"]

# name -> the module that defines it
_NAMES = {
    "ModelConfig": "jxformers.nn",
    "build_model": "jxformers.nn",
    "ShortSequenceWarning": "jxformers.nn.config",
    "generate": "jxformers.nn.generation",
}
# `jxformers.<name>` without an import statement loads these too
_SUBMODULES = (
    "data",
    "decoding",
    "kernels",
    "nn",
    "ops",
    "pretrained",
    "registry",
    "tools",
    "train",
    "validate",
    "xla_cost",
)


def __getattr__(name: str):
    if name in ("registry", "decoding"):
        importlib.import_module("jxformers.ops")  # its modules fill the registry (and import decoding)
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in __all__ or name in _SUBMODULES:
        value = importlib.import_module(f"jxformers.{name}")
    else:
        raise AttributeError(f"module 'jxformers' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
