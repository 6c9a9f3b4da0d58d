"""Deprecated: `jxformers.nn.transformer_xl` (Transformer-XL, the Compressive Transformer)."""

import sys
import warnings

from jxformers.nn import transformer_xl

warnings.warn("jxformers.nn.recurrent is now jxformers.nn.transformer_xl", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = transformer_xl
