"""Reversible residual blocks (Reformer; Kitaev et al., 2020, section 3 after Gomez et
al.'s RevNet): the activations are two streams, and each block maps

    y1 = x1 + F(x2)        F = self-attention branch (pre-norm)
    y2 = x2 + G(y1)        G = feed-forward branch (pre-norm)

F and G are the block's own branch functions (`Block.attention_branch`, `ffn_branch`),
dropout included, so a reversible model trains like the same weights wired plainly.

which can be inverted, x2 = y2 - G(y1), x1 = y1 - F(x2). `reversible_stack` has a custom
backward pass that reconstructs every block's inputs from its outputs instead of storing
them, so training memory for activations does not grow with the number of layers (at
the price of recomputing each block once more). The stack's input is x duplicated into
both streams; its output is their mean.
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.kernels.alibi import Alibi
from jxformers.nn.blocks import Block
from jxformers.nn.produced import Produced
from jxformers.nn.relative import SharedTerms


def _attention_branch(block: Block, x, inputs, key, inference=None) -> tuple[Array, Produced]:
    """The block's attention branch; `inference` None: inference exactly when no key
    (the custom backward replays dropout from the keys alone)."""
    bias, mask, positions = inputs
    inference = key is None if inference is None else inference
    return block.attention_branch(x, kv_mask=mask, bias=bias, positions=positions, key=key, inference=inference)


def _ffn_branch(block: Block, x, key, inference=None) -> tuple[Array, Produced]:
    return block.ffn_branch(x, key=key, inference=key is None if inference is None else inference)


def _keys(key_data, i):
    if key_data is None:
        return None, None
    k = jax.random.wrap_key_data(key_data[i])
    return tuple(jax.random.split(k))


def _run(blocks, x1, x2, bias, rest, inference=None):
    """The plain forward: (y1, y2, what the blocks produced, under their indices)."""
    mask, positions, key_data = rest
    produced = Produced()
    for i, block in enumerate(blocks):
        kf, kg = _keys(key_data, i)
        f, made_f = _attention_branch(block, x2, (bias, mask, positions), kf, inference)
        x1 = x1 + f
        g, made_g = _ffn_branch(block, x1, kg, inference)
        x2 = x2 + g
        produced = produced + (made_f + made_g).under(i)
    return x1, x2, produced


def _forward(static, params, x1, x2, bias, rest):
    blocks = [eqx.combine(p, s) for s, p in zip(static, params, strict=True)]
    return _run(blocks, x1, x2, bias, rest)[:2]


def _zero_cotangent(x):
    if x is None:
        return None
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stack(static, params, x1, x2, bias, rest):
    return _forward(static, params, x1, x2, bias, rest)


def _stack_fwd(static, params, x1, x2, bias, rest):
    y1, y2 = _forward(static, params, x1, x2, bias, rest)
    return (y1, y2), (params, y1, y2, bias, rest)  # no per-block activations kept


def _stack_bwd(static, residuals, cotangents):
    params, y1, y2, bias, rest = residuals
    mask, positions, key_data = rest
    g1, g2 = cotangents
    grads: list[Any] = [None] * len(params)
    g_bias = jax.tree.map(jnp.zeros_like, bias)  # an array, an Alibi (its slopes), SharedTerms or None
    for i in reversed(range(len(params))):
        s, p = static[i], params[i]
        kf, kg = _keys(key_data, i)
        # y2 = x2 + G(y1): recover x2, and push g2 into G's parameters and into y1.
        g_out, g_vjp = jax.vjp(lambda p, y: _ffn_branch(eqx.combine(p, s), y, kg)[0], p, y1)  # noqa: B023 - called within this iteration
        x2 = y2 - g_out
        dp_g, dy1 = g_vjp(g2)
        g1 = g1 + dy1
        # y1 = x1 + F(x2): recover x1, and push g1 into F's parameters, x2 and the bias.
        f_out, f_vjp = jax.vjp(
            lambda p, x, b: _attention_branch(eqx.combine(p, s), x, (b, mask, positions), kf)[0],  # noqa: B023
            p,
            x2,
            bias,
        )
        x1 = y1 - f_out
        dp_f, dx2, db = f_vjp(g1)
        g2 = g2 + dx2
        g_bias = jax.tree.map(jnp.add, g_bias, db)
        grads[i] = jax.tree.map(jnp.add, dp_f, dp_g)
        y1, y2 = x1, x2
    return tuple(grads), g1, g2, g_bias, jax.tree.map(_zero_cotangent, rest)


_stack.defvjp(_stack_fwd, _stack_bwd)


def reversible_stack(
    blocks: tuple[Block, ...], x: Float[Array, "seq d_model"], **kwargs
) -> Float[Array, "seq d_model"]:
    """`reversible_apply(...)`'s output alone (the arguments are its)."""
    return reversible_apply(blocks, x, **kwargs)[0]


def reversible_apply(
    blocks: tuple[Block, ...],
    x: Float[Array, "seq d_model"],
    *,
    kv_mask: Bool[Array, " seq"] | None = None,
    bias: Float[Array, "heads seq seq"] | Alibi | SharedTerms | None = None,
    positions: Int[Array, " seq"] | None = None,
    key: PRNGKeyArray | None = None,
    inference: bool = False,
) -> tuple[Float[Array, "seq d_model"], Produced]:
    """Run pre-norm self-attention blocks as a reversible stack (see the module
    docstring): the same parameters as ordinary blocks, a different residual wiring,
    and activation memory independent of depth in the backward pass.

    Arguments:
        blocks: pre-norm blocks without cross-attention.
        x: `[seq, d_model]`; kv_mask, bias, positions: as `Block`.
        key, inference: dropout (the backward pass replays the same dropout masks).

    Returns:
        `([seq, d_model], Produced)`: the mean of the two output streams, and what the
        blocks produced under their indices (k-means inputs; see below).

    In training, a stack whose attentions update arrays (k-means centroids) runs its
    blocks with plain autodiff instead, so that their inputs come out as values and not
    through the custom backward pass: the same outputs and gradients, with activation
    memory that grows with depth.
    """
    for block in blocks:
        if not block.pre_norm or block.cross_attention is not None:
            raise ValueError("reversible blocks must be pre-norm self-attention blocks (no cross-attention)")
    params, static = zip(*(eqx.partition(b, eqx.is_array) for b in blocks), strict=True) if blocks else ((), ())
    key_data = None
    if key is not None and not inference:
        key_data = jax.random.key_data(jax.random.split(key, len(blocks)))
    rest = (kv_mask, positions, key_data)
    if not inference and any(b.attention.core.spec.updates_arrays for b in blocks):
        y1, y2, produced = _run(blocks, x, x, bias, rest, inference)
        return (y1 + y2) / 2, produced
    y1, y2 = _stack(tuple(static), tuple(params), x, x, bias, rest)
    return (y1 + y2) / 2, Produced()


def reversible_decode_step(blocks, x, states, *, bias_fn=None):
    """One token through a reversible stack with each block's decoding state."""
    x1 = x2 = x
    new = []
    for block, state in zip(blocks, states, strict=True):
        h, state = block.attention.decode_step(block.norms[0](x2), state, bias_fn=bias_fn)
        x1 = x1 + h
        x2 = x2 + block.ffn_branch(x1[None], inference=True)[0][0]
        new.append(state)
    return (x1 + x2) / 2, tuple(new)
