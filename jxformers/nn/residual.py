"""Where a transformer block's norms sit around its residual branches, and the schemes
that replace or rescale them (Lin et al. 2021, "A Survey of Transformers", arXiv
2106.04554, section 5.2), as `norm.placement`:

* "pre": x + f(N(x)) (Xiong et al. 2020, "On Layer Normalization in the Transformer
  Architecture"); "post": N(x + f(x)) (Vaswani et al. 2017);
* "sandwich": x + N'(f(N(x))), a second norm on each branch's output (Ding et al. 2021,
  "CogView: Mastering Text-to-Image Generation via Transformers", section 2.4,
  Sandwich-LN);
* "normformer": pre-norm plus NormFormer's three additions (Shleifer et al. 2021,
  "NormFormer: Improved Transformer Pretraining with Extra Normalization", section 2): a
  norm on the self-attention's output, a learned scale per head (`Attention`'s
  `head_scale`), and a norm on the FFN's hidden layer (`FeedForward`'s `mid_norm`);
* "rezero": x + a f(x) with one learned scalar a per block, started at 0, and no norm in
  the blocks (Bachlechner et al. 2020, "ReZero is All You Need: Fast Convergence at Large
  Depth"; the authors' code shares a between a block's sublayers);
* "deepnorm": N(alpha x + f(x)) with alpha > 1 from the depth, and the value, output and
  FFN weights drawn with Xavier-normal gain beta < 1 (Wang et al. 2022, "DeepNet: Scaling
  Transformers to 1,000 Layers", section 3 and Figure 2).

The block applies them (`jxformers.nn.blocks.Block`); `deepnorm_constants` and
`deepnorm_init` hold DeepNet's numbers and initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp

from jxformers.nn.layers import FeedForward

if TYPE_CHECKING:  # blocks.py reads this module's placements
    from jxformers.nn.blocks import Block

PLACEMENTS = ("pre", "post", "sandwich", "normformer", "rezero", "deepnorm")
# Placements whose branch input is normalised (the rest normalise after the residual sum,
# or not at all).
INPUT_NORMED = ("pre", "sandwich", "normformer")
# Placements whose blocks end in a norm (after the residual sum).
OUTPUT_NORMED = ("post", "deepnorm")


def deepnorm_constants(encoder_layers: int, decoder_layers: int, part: str) -> tuple[float, float]:
    """DeepNet's (alpha, beta) for the blocks of `part` ("encoder" or "decoder") of a model
    with `encoder_layers` and `decoder_layers` blocks (0: that side is absent), Wang et al.
    2022, Table 1 (N encoder, M decoder layers):

        encoder-only or decoder-only: alpha = (2 L)^(1/4), beta = (8 L)^(-1/4)
        encoder of an encoder-decoder: alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16)
        decoder of an encoder-decoder: alpha = (3 M)^(1/4),        beta = (12 M)^(-1/4)
    """
    if part not in ("encoder", "decoder"):
        raise ValueError(f"part must be 'encoder' or 'decoder'; got {part!r}")
    n, m = encoder_layers, decoder_layers
    if n < 0 or m < 0 or n + m == 0 or (n if part == "encoder" else m) == 0:
        raise ValueError(f"the {part} has no layers: {encoder_layers=}, {decoder_layers=}")
    if n == 0 or m == 0:  # one stack
        layers = n + m
        return (2 * layers) ** 0.25, (8 * layers) ** -0.25
    if part == "encoder":
        return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
    return (3 * m) ** 0.25, (12 * m) ** -0.25


def xavier_normal(key: jax.Array, shape: tuple[int, ...], gain: float) -> jax.Array:
    """Glorot & Bengio's normal draw for an `[out, in]` matrix: std = gain sqrt(2 / (in + out))."""
    fan_out, fan_in = shape  # a Linear's weight: [out, in]
    return gain * jnp.sqrt(2.0 / (fan_in + fan_out)) * jax.random.normal(key, shape)


def deepnorm_init(block: Block, beta: float, *, key: jax.Array) -> Block:
    """`block` with DeepNet's initialisation (Wang et al. 2022, Figure 2): Xavier normal
    with gain `beta` for the value and output projections of its attentions (self and
    cross) and the dense FFN's matrices, gain 1 for the query and key projections.
    Biases keep their draw (the figure sets none)."""
    paths: list[tuple[Callable[[Block], jax.Array], float]] = []
    for part in ("attention", "cross_attention"):
        attention = getattr(block, part)
        if attention is None:
            continue
        for name, gain in (("q_proj", 1.0), ("k_proj", 1.0), ("v_proj", beta), ("o_proj", beta)):
            if getattr(attention, name) is not None:
                paths.append((lambda b, p=part, n=name: getattr(getattr(b, p), n).weight, gain))
    if block.ffn is not None and not isinstance(block.ffn, FeedForward):  # None: a block without FFN
        raise ValueError(f"deepnorm initialises a dense FFN's matrices; got {type(block.ffn).__name__}")
    for name in ("w_in", "w_gate", "w_out"):
        if getattr(block.ffn, name) is not None:
            paths.append((lambda b, n=name: getattr(b.ffn, n).weight, beta))
    keys = jax.random.split(key, len(paths))
    new = [xavier_normal(k, get(block).shape, gain) for k, (get, gain) in zip(keys, paths, strict=True)]
    return eqx.tree_at(lambda b: [get(b) for get, _ in paths], block, new)
