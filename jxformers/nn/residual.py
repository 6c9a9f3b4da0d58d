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
* "tfixup": x + f(x) with no norm in the blocks, made trainable by the initialisation
  alone (Huang et al. 2020, "Improving Transformer Optimization Through Better
  Initialization", section 3.3): Xavier weights, the value, output and FFN matrices of
  each block scaled by 0.67 N^(-1/4) (two sublayers) or (9 M)^(-1/4) (three: a decoder
  block with cross-attention), the token embeddings (std d^(-1/2)) by (9 L)^(-1/4);
* "deepnorm": N(alpha x + f(x)) with alpha > 1 from the depth, and the value, output and
  FFN weights drawn with Xavier-normal gain beta < 1 (Wang et al. 2022, "DeepNet: Scaling
  Transformers to 1,000 Layers", section 3 and Figure 2).

The block applies them (`jxformers.nn.blocks.Block`); `deepnorm_constants`,
`deepnorm_init`, `tfixup_scale` and `tfixup_init` hold DeepNet's and T-Fixup's numbers
and initialisations.
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

PLACEMENTS = ("pre", "post", "sandwich", "normformer", "rezero", "tfixup", "deepnorm")
# Placements whose blocks hold no norm at all.
NORM_FREE = ("rezero", "tfixup")
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
    return _redraw(block, lambda k, shape, scaled: xavier_normal(k, shape, beta if scaled else 1.0), key, "deepnorm")


def _redraw(block: Block, draw: Callable[[jax.Array, tuple[int, ...], bool], jax.Array], key, who: str) -> Block:
    """`block` with every matrix of its attentions and dense FFN drawn again by
    `draw(key, shape, scaled)`; `scaled` is True for the value and output projections
    and the FFN's matrices (the ones DeepNet and T-Fixup scale), False for q and k."""
    paths: list[tuple[Callable[[Block], jax.Array], bool]] = []
    for part in ("attention", "cross_attention"):
        attention = getattr(block, part)
        if attention is None:
            continue
        for name, scaled in (("q_proj", False), ("k_proj", False), ("v_proj", True), ("o_proj", True)):
            if getattr(attention, name) is not None:
                paths.append((lambda b, p=part, n=name: getattr(getattr(b, p), n).weight, scaled))
    if block.ffn is not None and not isinstance(block.ffn, FeedForward):  # None: a block without FFN
        raise ValueError(f"{who} initialises a dense FFN's matrices; got {type(block.ffn).__name__}")
    for name in ("w_in", "w_gate", "w_out"):
        if getattr(block.ffn, name, None) is not None:
            paths.append((lambda b, n=name: getattr(b.ffn, n).weight, True))
    keys = jax.random.split(key, len(paths))
    new = [draw(k, get(block).shape, scaled) for k, (get, scaled) in zip(keys, paths, strict=True)]
    return eqx.tree_at(lambda b: [get(b) for get, _ in paths], block, new)


def tfixup_scale(layers: int, *, cross: bool) -> float:
    """T-Fixup's factor for the value, output and FFN matrices of the blocks of a stack
    of `layers` blocks (Huang et al. 2020, section 3.3, steps 2-3): (9 L)^(-1/4) for
    blocks of three sublayers (the paper's decoder: cross-attention), 0.67 L^(-1/4) for
    two (the paper's encoder; also a decoder-only LM's blocks, which have two)."""
    if layers < 1:
        raise ValueError(f"tfixup needs at least one block; got {layers=}")
    return (9 * layers) ** -0.25 if cross else 0.67 * layers**-0.25


def tfixup_init(block: Block, scale: float, *, key: jax.Array) -> Block:
    """`block` with T-Fixup's initialisation (Huang et al. 2020, section 3.3): every
    matrix of its attentions and dense FFN drawn Xavier-uniform, then the value and
    output projections and the FFN's matrices times `scale` (`tfixup_scale`). Biases
    keep their draw."""
    return _redraw(block, lambda k, shape, scaled: xavier_uniform(k, shape) * (scale if scaled else 1.0), key, "tfixup")


def xavier_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Glorot & Bengio's uniform draw for an `[out, in]` matrix: U(-a, a), a = sqrt(6 / (in + out))."""
    fan_out, fan_in = shape
    bound = jnp.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, shape, minval=-bound, maxval=bound)
