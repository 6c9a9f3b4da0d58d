"""jxformers: efficient transformers in pure JAX.

    ops        pure attention functions (one file per family)
    registry   name -> attention spec (hyper-parameters, capabilities)
    nn         Equinox modules and models; ModelConfig and build_model
    decoding   incremental decoding states and generate
"""

from jxformers import decoding, nn, ops, registry
from jxformers.decoding import generate
from jxformers.nn import ModelConfig, build_model

__version__ = "0.1.0"
__all__ = ["ModelConfig", "build_model", "decoding", "generate", "nn", "ops", "registry"]
