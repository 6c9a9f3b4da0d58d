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

Positions: added to the embeddings (the model's `embedding.position`), or the paper's
Fourier features (section 2 and appendix: `fourier_features`) concatenated to each
input row, then read by the cross-attends (their input norm and K/V projections take
the wider rows).

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


def fourier_features(
    index: Int[Array, " n"], *, grid: tuple[int, ...], bands: int, max_freq: tuple[float, ...]
) -> Float[Array, "n features"]:
    """Perceiver's Fourier position features (Jaegle et al. 2021, section 2, "Position
    encodings"): each input position is a point x of a grid of `grid` sizes (one per
    dimension d; a sequence's index p is (p // W, p % W) on a grid (H, W), or p itself
    on (N,)), each coordinate x_d scaled to [-1, 1] (-1 + 2 i_d / (size_d - 1)); the
    features are [x_d for each d, sin(f_{d,k} π x_d), cos(f_{d,k} π x_d) for each d and
    k], with K = `bands` frequencies f_{d,k} spaced linearly from 1 to μ_d / 2 (μ_d =
    `max_freq[d]`, the dimension's sampling rate): D (2K + 1) features.

    Arguments:
        index: `[n]` positions in the flattened grid (row-major).
        grid: the grid's sizes, one per dimension (each >= 2, or 1: x = 0).
        bands: K. max_freq: μ per dimension.

    Returns:
        `[n, D (2K + 1)]`: the raw coordinates, then the sines (dimension-major), then
        the cosines.
    """
    coords, rest = [], index
    for size in reversed(grid):  # row-major: the last dimension varies fastest
        coords.append(rest % size)
        rest = rest // size
    coords = coords[::-1]
    x = jnp.stack(
        [(-1.0 + 2.0 * c / (size - 1)) if size > 1 else 0.0 * c for c, size in zip(coords, grid, strict=True)], -1
    ).astype(jnp.float32)  # [n, D]
    freqs = jnp.stack([jnp.linspace(1.0, mu / 2, bands) for mu in max_freq])  # [D, K]
    angles = (x[:, :, None] * freqs[None] * jnp.pi).reshape(x.shape[0], -1)  # [n, D K]
    return jnp.concatenate([x, jnp.sin(angles), jnp.cos(angles)], -1)


def check_fourier(
    bands: int, grid: tuple[int, ...] | None, max_freq: tuple[float, ...] | None, max_len: int
) -> tuple[tuple[int, ...], int, tuple[float, ...]] | None:
    """(grid, K, μ) of Perceiver's Fourier features with their defaults filled in (see
    `PerceiverEncoder`), None for K = 0; ValueError naming the values that do not fit."""
    if bands < 0:
        raise ValueError(f"fourier_bands must be >= 0; got {bands}")
    if bands == 0:
        if grid is not None or max_freq is not None:
            raise ValueError(f"fourier_grid and fourier_max_freq need fourier_bands > 0; got {grid=}, {max_freq=}")
        return None
    grid = (max_len,) if grid is None else tuple(grid)
    if not grid or any(g < 1 for g in grid) or math.prod(grid) != max_len:
        raise ValueError(f"fourier_grid's sizes must be >= 1 and multiply to max_len ({max_len}); got {grid}")
    max_freq = tuple(float(g) for g in grid) if max_freq is None else tuple(float(m) for m in max_freq)
    if len(max_freq) != len(grid) or any(m < 2 for m in max_freq):
        raise ValueError(
            f"fourier_max_freq needs one μ >= 2 per grid dimension (the bands span 1 .. μ/2); got {max_freq} for "
            f"grid {grid}"
        )
    return grid, bands, max_freq


class PerceiverEncoder(eqx.Module):
    """Latent array, cross-attends and a shared latent tower (see the module docstring).

    Arguments (constructor):
        embedding: token embedding (with absolute positions, or none).
        tower: the latent Transformer's blocks (non-causal self-attention).
        norm: the final norm.
        num_latents: M, the latent array's length; cross_attends: how often the latents
            read the input (>= 1); d_ff, ffn, norm_kind, pre_norm, dropout: of the
            cross-attend blocks; max_len: longest input.
        fourier_bands: K > 0: the Fourier features (`fourier_features`) of each input
            position concatenated to its embedding (0: none). fourier_grid: the
            grid the positions lie on (None: `(max_len,)`, a sequence; `(H, W)` with
            H W = max_len: an image read row by row). fourier_max_freq: μ per
            dimension (None: each the grid's size, the Nyquist rate of the input's
            own sampling).

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
    fourier: tuple[tuple[int, ...], int, tuple[float, ...]] | None = eqx.field(static=True)  # (grid, K, μ)

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
        fourier_bands: int = 0,
        fourier_grid: tuple[int, ...] | None = None,
        fourier_max_freq: tuple[float, ...] | None = None,
        key: PRNGKeyArray,
    ):
        if num_latents < 1 or cross_attends < 1:
            raise ValueError(
                f"Perceiver needs num_latents >= 1 and cross_attends >= 1; got {num_latents=}, {cross_attends=}"
            )
        self.fourier = check_fourier(fourier_bands, fourier_grid, fourier_max_freq, max_len)
        d_model = embedding.table.shape[1]
        d_input = d_model + (0 if self.fourier is None else len(self.fourier[0]) * (2 * fourier_bands + 1))
        kl, kc = jax.random.split(key)
        distinct = min(cross_attends, 2)  # the first cross-attend, and the one the repeats share
        self.embedding, self.tower, self.norm = embedding, tuple(tower), norm
        self.latents = jax.random.normal(kl, (num_latents, d_model)) / math.sqrt(d_model)
        self.input_norms = tuple(make_norm(norm_kind, d_input) for _ in range(distinct))
        self.cross = tuple(
            MAB(d_model, 1, d_ff=d_ff, ffn=ffn, norm=norm_kind, pre_norm=pre_norm, dropout=dropout, d_y=d_input, key=k)
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
        if self.fourier is not None:
            grid, bands, max_freq = self.fourier
            features = fourier_features(jnp.arange(n), grid=grid, bands=bands, max_freq=max_freq)
            x = jnp.concatenate([x, features.astype(x.dtype)], -1)
        z, produced = self.latents.astype(x.dtype), Produced()
        for r, k in enumerate(split_key(key, self.cross_attends)):
            kc, kt = split_key(k, 2)
            which = min(r, 1)
            z = self.cross[which](z, self.input_norms[which](x), y_mask=mask, key=kc, inference=inference)
            for j, (block, kb) in enumerate(zip(self.tower, split_key(kt, len(self.tower)), strict=True)):
                z, made = block.apply(z, key=kb, inference=inference)
                produced = produced + made.under("tower", j)
        return (self.norm(z), jnp.ones((z.shape[0],), bool)), produced
