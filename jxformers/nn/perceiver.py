"""Perceiver's encoder (Jaegle et al. 2021, section 2): a learned latent array
`[num_latents, d_model]` cross-attends to the embedded input, then a latent Transformer
(self-attention blocks over the latents only) refines it; with `cross_attends` > 1 the
pair repeats, reading the input again each time.

Weights as the paper's ImageNet model: the latent Transformer is shared by every
repeat, and every cross-attend after the first shares one set of weights (the first has
its own). Cross-attention has one head (the paper's choice); each cross-attend
normalises the input and the latents before attending (pre-norm, as the paper), then
adds an MLP. Cost O(N M) for the cross-attends plus O(M^2) per latent block, for N
inputs and M latents: independent of N beyond the cross-attends.

The output is the final latent array (with the final norm), all of it real; a
`Classifier` averages it (head "mean", the paper's) or pools it with PMA. The
cross-attention reads the input as a set: with positions off (ModelConfig
embedding position "none") the output does not depend on the input's order.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.blocks import Block
from jxformers.nn.layers import Norm, check_tokens, make_norm, split_key
from jxformers.nn.models import Embedding
from jxformers.nn.produced import Produced
from jxformers.nn.set_transformer import MAB


class PerceiverEncoder(eqx.Module):
    """Latent array, cross-attends and a shared latent tower (see the module docstring).

    Arguments (constructor):
        embedding: token embedding (with absolute positions, or none).
        tower: the latent Transformer's blocks (non-causal self-attention).
        norm: the final norm.
        num_latents: M, the latent array's length; cross_attends: how often the latents
            read the input (>= 1); d_ff, ffn, norm_kind, pre_norm, dropout: of the
            cross-attend blocks; max_len: longest input.

    `encoder(tokens [n], mask [n]) -> (latents [M, d_model], mask [M] all True)`;
    padded tokens (mask False) are never read.
    """

    embedding: Embedding
    latents: Float[Array, "num_latents d_model"]
    input_norms: tuple[Norm, ...]
    cross: tuple[MAB, ...]
    tower: tuple[Block, ...]
    norm: Norm
    cross_attends: int = eqx.field(static=True)
    max_len: int = eqx.field(static=True)

    def __init__(
        self,
        embedding: Embedding,
        tower: list[Block],
        norm: Norm,
        *,
        num_latents: int,
        cross_attends: int = 1,
        d_ff: int,
        ffn: str = "gelu",
        norm_kind: str = "layernorm",
        pre_norm: bool = True,
        dropout: float = 0.0,
        max_len: int,
        key: PRNGKeyArray,
    ):
        if num_latents < 1 or cross_attends < 1:
            raise ValueError(
                f"Perceiver needs num_latents >= 1 and cross_attends >= 1; got {num_latents=}, {cross_attends=}"
            )
        d_model = embedding.table.shape[1]
        kl, kc = jax.random.split(key)
        distinct = min(cross_attends, 2)  # the first cross-attend, and the one the repeats share
        self.embedding, self.tower, self.norm = embedding, tuple(tower), norm
        self.latents = jax.random.normal(kl, (num_latents, d_model)) / math.sqrt(d_model)
        self.input_norms = tuple(make_norm(norm_kind, d_model) for _ in range(distinct))
        self.cross = tuple(
            MAB(d_model, 1, d_ff=d_ff, ffn=ffn, norm=norm_kind, pre_norm=pre_norm, dropout=dropout, key=k)
            for k in jax.random.split(kc, distinct)
        )
        self.cross_attends, self.max_len = cross_attends, max_len

    @property
    def cls(self) -> None:
        """No CLS token: the latents are pooled."""
        return None

    def __call__(
        self, tokens: Int[Array, " seq"], mask: Bool[Array, " seq"] | None = None, **kwargs
    ) -> tuple[Float[Array, "num_latents d_model"], Bool[Array, " num_latents"]]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, " seq"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[tuple[Float[Array, "num_latents d_model"], Bool[Array, " num_latents"]], Produced]:
        """((latents [M, d_model], mask [M] all True), what the latent tower's blocks made:
        every repeat of a shared block adds its k-means inputs under that block's path)."""
        n = check_tokens(tokens, mask)
        if n > self.max_len:
            raise ValueError(f"sequence length {n} exceeds the model's max_len {self.max_len}")
        x = self.embedding(tokens, jnp.arange(n))
        z, produced = self.latents.astype(x.dtype), Produced()
        for r, k in enumerate(split_key(key, self.cross_attends)):
            kc, kt = split_key(k, 2)
            which = min(r, 1)
            z = self.cross[which](z, self.input_norms[which](x), y_mask=mask, key=kc, inference=inference)
            for j, (block, kb) in enumerate(zip(self.tower, split_key(kt, len(self.tower)), strict=True)):
                z, made = block.apply(z, key=kb, inference=inference)
                produced = produced + made.under("tower", j)
        return (self.norm(z), jnp.ones((z.shape[0],), bool)), produced
