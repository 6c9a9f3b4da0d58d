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
  Transformers to 1,000 Layers", section 3 and Figure 2);
* "admin": x_i = N(x_{i-1} w_i + f_i(x_{i-1})), post-norm with a learned vector w_i per
  branch on its skip term, set before training by a profile of one batch (Liu, Liu, Gao,
  Chen & Han 2020, "Understanding the Difficulty of Training Transformers", section 5):
  `admin_profile`;
* "fixup": x + s f(x - b) with no norm in the blocks, a scalar bias b and multiplier s per
  branch, more scalar biases inside the FFN, no vector biases, and Fixup's initialisation
  (Zhang, Dauphin & Ma 2019, "Fixup Initialization: Residual Learning Without
  Normalization", section 3's three rules as the authors apply them to the Transformer):
  `fixup_init`.

The block applies them (`jxformers.nn.blocks.Block`); `deepnorm_constants`,
`deepnorm_init`, `tfixup_scale`, `tfixup_init`, `fixup_scales` and `fixup_init` hold
DeepNet's, T-Fixup's and Fixup's numbers and initialisations, `admin_profile` and
`admin_omega` Admin's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jxformers.nn.layers import FeedForward
from jxformers.nn.produced import Path, ResidualMoments, follow

if TYPE_CHECKING:  # blocks.py reads this module's placements
    from jxformers.nn.blocks import Block

PLACEMENTS = ("pre", "post", "sandwich", "normformer", "rezero", "tfixup", "deepnorm", "admin", "fixup")
# Placements whose blocks hold no norm at all.
NORM_FREE = ("rezero", "tfixup", "fixup")
# Placements whose branch input is normalised (the rest normalise after the residual sum,
# or not at all).
INPUT_NORMED = ("pre", "sandwich", "normformer")
# Placements whose blocks end in a norm (after the residual sum).
OUTPUT_NORMED = ("post", "deepnorm", "admin")
# The matrices DeepNet and T-Fixup scale (`_redraw` names them): the value and output
# projections and the FFN's; the query and key projections keep the plain draw.
SCALED = ("v_proj", "o_proj", "w_in", "w_gate", "w_out")


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
    return _redraw(
        block, lambda k, shape, name: xavier_normal(k, shape, beta if name in SCALED else 1.0), key, "deepnorm"
    )


def _linears(block: Block, who: str) -> list[tuple[Callable[[Block], Any], str]]:
    """(getter, name) of every Linear of the block's attentions (self and cross: q_proj,
    k_proj, v_proj, o_proj) and of its dense FFN (w_in, w_gate, w_out); `who` names the
    scheme in the error for an FFN that is not dense."""
    found: list[tuple[Callable[[Block], Any], str]] = []
    for part in ("attention", "cross_attention"):
        attention = getattr(block, part)
        if attention is None:
            continue
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(attention, name) is not None:
                found.append((lambda b, p=part, n=name: getattr(getattr(b, p), n), name))
    if block.ffn is not None and not isinstance(block.ffn, FeedForward):  # None: a block without FFN
        raise ValueError(f"{who} initialises a dense FFN's matrices; got {type(block.ffn).__name__}")
    for name in ("w_in", "w_gate", "w_out"):
        if getattr(block.ffn, name, None) is not None:
            found.append((lambda b, n=name: getattr(b.ffn, n), name))
    return found


def _redraw(block: Block, draw: Callable[[jax.Array, tuple[int, ...], str], jax.Array], key, who: str) -> Block:
    """`block` with every matrix of its attentions and dense FFN (`_linears`) drawn again
    by `draw(key, shape, name)`, `name` the matrix's ("q_proj", ..., "w_out")."""
    linears = _linears(block, who)
    keys = jax.random.split(key, len(linears))
    new = [draw(k, get(block).weight.shape, name) for k, (get, name) in zip(keys, linears, strict=True)]
    return eqx.tree_at(lambda b: [get(b).weight for get, _ in linears], block, new)


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
    return _redraw(
        block, lambda k, shape, name: xavier_uniform(k, shape) * (scale if name in SCALED else 1.0), key, "tfixup"
    )


def xavier_uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Glorot & Bengio's uniform draw for an `[out, in]` matrix: U(-a, a), a = sqrt(6 / (in + out))."""
    fan_out, fan_in = shape
    bound = jnp.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, shape, minval=-bound, maxval=bound)


# ------------------------------------------------------------------ Fixup


def fixup_scales(branches: int) -> dict[str, float]:
    """Fixup's factor on each matrix's Xavier-uniform draw in a model of `branches`
    residual branches L (Zhang, Dauphin & Ma 2019, section 3: the last layer of each
    branch 0, the others times L^(-1/(2m-2)) for a branch of m layers), as the authors'
    Transformer applies them (their fairseq `transformer_zero`): the FFN (m = 2) has W1
    (and a gate's W3) times L^(-1/2) and W2 zero; the attention has q, k and v times
    L^(-1/6) (m = 4) and the output projection zero. L counts every branch of the model:
    2 per encoder or decoder-only block, 3 per cross-attending decoder block."""
    if branches < 1:
        raise ValueError(f"fixup needs at least one residual branch; got {branches=}")
    inner, ffn = branches ** (-1 / 6), branches**-0.5
    return {"q_proj": inner, "k_proj": inner, "v_proj": inner, "o_proj": 0.0, "w_in": ffn, "w_gate": ffn, "w_out": 0.0}


def fixup_init(block: Block, branches: int, *, key: jax.Array) -> Block:
    """`block` with Fixup's initialisation for a model of `branches` residual branches
    (`fixup_scales`): every matrix of its attentions and dense FFN drawn Xavier-uniform
    times its factor, and no vector biases (the authors' Linears have none: the block's
    and the FFN's scalar biases take their place)."""
    scales = fixup_scales(branches)
    block = _redraw(block, lambda k, shape, name: xavier_uniform(k, shape) * scales[name], key, "fixup")
    linears = _linears(block, "fixup")
    return eqx.tree_at(lambda b: [get(b).bias for get, _ in linears], block, [None] * len(linears), is_leaf=_none)


def _none(x) -> bool:
    return x is None


# ------------------------------------------------------------------ Admin


def admin_omega(moments: Any) -> float:
    """Admin's weight for the branch after the one with `moments` (`ResidualMoments.moments`,
    `[2, 3]`: its skip term x w and its output f(x), each (count, sum, sum of squares)):
    sqrt(Var[x w] + Var[f(x)]), each variance over all elements of the real rows of the
    profiled batch. This is the authors' running recurrence (Transformer-Clinic,
    `adaptive-profiling`), w_{i+1}^2 = Var[x_{i-1} w_i] + Var[f_i(x_{i-1})], which with
    x_{i-1} the previous norm's output (variance about 1) and w_1 = 1 unrolls to the
    paper's w_i^2 = sum_{j<i} Var[f_j] with the embeddings as the 0th term."""
    m = np.asarray(moments, np.float64)
    count, total, squares = m[:, 0], m[:, 1], m[:, 2]
    variances = squares / count - (total / count) ** 2
    return float(math.sqrt(max(float(variances.sum()), 0.0)))


def admin_profile(model, *inputs, key: jax.Array | None = None, **kwargs):
    """`model` with the skip weights w of its Admin blocks set by a profile of one batch
    (Liu et al. 2020, section 5; the authors profile the first training batch in training
    mode and stop). Each stack of blocks (a model's, an encoder's, a decoder's) starts at
    w = 1 and sets each next branch's w to `admin_omega` of the branch before, measured
    with the weights set so far: one forward pass per branch, jitted once. The weights
    are vectors of d_model, each filled with its branch's number, and train as any
    parameter afterwards. `jxformers train` profiles its first batch before step 0.

    Arguments:
        model: a model with blocks of placement "admin" (`build_model` with
            `norm.placement: admin`).
        inputs: the batch's arguments to `model.apply`, each with a leading batch axis
            (a language model or a classifier: tokens `[batch, seq]`, mask `[batch, seq]`
            or None); the variances are over the rows each block marks real.
        key: dropout's key (training mode, as the authors profile); None: inference mode.
        kwargs: more keyword arguments for `model.apply`, the same for every example.

    Returns:
        The model with its Admin weights set.
    """
    batch = next(x.shape[0] for x in jax.tree.leaves(inputs))
    keys = None if key is None else jax.random.split(key, batch)

    @eqx.filter_jit
    def measure(m) -> tuple[ResidualMoments, ...]:
        def one(row, k):
            return m.apply(*row, key=k, inference=key is None, **kwargs)[1].residual_moments

        return tuple(ResidualMoments(r.moments.sum(0), r.path) for r in jax.vmap(one)(inputs, keys))

    def pooled(m) -> dict[Path, np.ndarray]:
        """Each branch's moments over the batch, in call order; a branch called more than
        once (a dual tower) pools its calls."""
        out: dict[Path, np.ndarray] = {}
        for r in measure(m):
            out[r.path] = out.get(r.path, 0.0) + np.asarray(r.moments, np.float64)
        return out

    current = pooled(model)
    order = list(current)
    if not order:
        raise ValueError("admin_profile found no block with norm placement 'admin' in the model")
    for i, path in enumerate(order):
        later = [p for p in order[i + 1 :] if p[:-2] == path[:-2]]  # its stack's: the path less (block, branch)
        if not later:
            continue
        target = later[0]
        model = eqx.tree_at(
            lambda m, t=target: follow(m, t[:-1]).omegas[t[-1]],
            model,
            jnp.full_like(follow(model, target[:-1]).omegas[target[-1]], admin_omega(current[path])),
        )
        current = pooled(model)  # the branches after it see the new weight
    return model
