"""jxformers: efficient transformers in pure JAX."""

from jxformers import ops, registry

__version__ = "0.1.0"
__all__ = ["ops", "registry"]
