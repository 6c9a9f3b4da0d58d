"""Transparent attention (Bapna, Chen, Firat, Cao & Wu 2018, "Training Deeper Neural
Machine Translation Models with Transparent Attention", EMNLP, section 3): decoder
block j of an encoder-decoder cross-attends its own weighted combination of every
encoder layer's output (`ModelConfig` task seq2seq, `decoder: {transparent: true}`;
`EncoderDecoder(..., transparent=True)` holds W and calls `combine_layers`):

    s_{i,j} = exp(W_{i,j}) / Σ_{k=0..N} exp(W_{k,j}),     c_j = Σ_{i=0..N} s_{i,j} h_i,

h_0 the embeddings (the encoder's input rows), h_i the output of encoder layer i, W a
learned `[N + 1, M]` matrix (N encoder layers, M decoder blocks). A plain decoder reads
h_N alone; these weights let the gradient reach every encoder layer directly, which is
how the paper trains deep encoders.

Each h_i is read through the encoder's final norm, as the plain decoder reads h_N
(`Encoder.apply(layers=True)`): a pre-norm residual stream grows with depth, and one norm
puts the layers on one scale before they are mixed. W starts at zero, so every block
starts from the plain average of the layers. Decoding is the plain decoder's:
`conditioned(source)` binds the M combinations to one source (`ConditionedDecoder` with
one memory per block), whose keys and values each block projects once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def transparent_weights(encoder, decoder) -> Float[Array, "sources targets"]:
    """W `[N + 1, M]` at zero for an `Encoder` of N blocks and a `LanguageModel` decoder of
    M cross-attending blocks; a ValueError for an encoder whose layers' outputs differ in
    length (filters, a token learner) or are not formed one by one (reversible wiring)."""
    if encoder.filters or encoder.token_learner is not None or encoder.reversible:
        raise ValueError(
            "transparent attention mixes every encoder layer's output row by row: no filters, token learner or "
            f"reversible wiring; got filters={dict(encoder.filters)}, token_learner="
            f"{encoder.token_learner is not None}, reversible={encoder.reversible}"
        )
    if any(getattr(b, "cross_attention", None) is None for b in decoder.blocks):
        raise ValueError("transparent attention needs a decoder whose every block cross-attends")
    return jnp.zeros((len(encoder.blocks) + 1, len(decoder.blocks)), jnp.float32)


def combine_layers(
    weights: Float[Array, "sources targets"], states: Float[Array, "sources ctx d_model"]
) -> Float[Array, "targets ctx d_model"]:
    """c_j = Σ_i softmax_i(W)_{i,j} h_i for every decoder block j.

    Arguments:
        weights: W, the softmax taken over the encoder layers (axis 0).
        states: h_0 .. h_N, every encoder layer's output (the embeddings first).
    Returns:
        `[M, ctx, d_model]`, decoder block j's context in row j.
    """
    s = jax.nn.softmax(weights, axis=0).astype(states.dtype)
    return jnp.einsum("ij,icd->jcd", s, states)
