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
    experiments  one YAML config per experiment (package data)

Each subpackage's docstring lists its files.
"""

# ops first: importing it registers every attention, and it uses decoding
# isort: off
from jxformers import ops, registry, decoding, nn
# isort: on
from jxformers.nn import ModelConfig, build_model
from jxformers.nn.config import ShortSequenceWarning
from jxformers.nn.generation import generate

__version__ = "0.1.0"
__all__ = ["ModelConfig", "ShortSequenceWarning", "build_model", "decoding", "generate", "nn", "ops", "registry"]
