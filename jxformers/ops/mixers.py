"""Token mixers that replace attention with a learned mixing along the sequence, as FNet
(`fourier.py`) does with a Fourier transform: MLP-Mixer's token-mixing MLP (Tolstikhin et
al. 2021, "MLP-Mixer: An all-MLP Architecture for Vision") and gMLP's spatial gating unit
(Liu, Dai, So & Le 2021, "Pay Attention to MLPs").

Both sit in the attention slot and q and k are not read. The mixer is registered
`mixes_input`, so in a model it mixes the layer input itself (no W_Q, W_K, W_V, W_O, as the
paper); gMLP mixes the values V (the module's W_V x). Their weights are indexed by
position, so a hyper-parameter `max_len` sizes them
(the registry's `covers_length`: models fill it with their own `max_len`), and a sequence
shorter than `max_len` uses the leading rows and columns, as Linformer's E and F do.
Padded positions are zeroed before mixing and never reach the real outputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._typing import ArrayLike
from jxformers.decoding import KVCache, cache_append, full_cache_init
from jxformers.ops._common import (
    causal_never_reads_non_finite_future,
    check_mask_shape,
    check_positive,
    check_qkv,
    out_dtype,
    zero_padded,
)
from jxformers.registry import Decoder, register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = ["gmlp_attention", "mixer_attention", "spatial_gating"]

# LayerNorm's epsilon in gMLP's spatial gating unit (flax's and PyTorch's default scale).
LN_EPSILON = 1e-6


def _check_covered(n: int, max_len: int, what: str) -> None:
    if n > max_len:
        raise ValueError(f"{what} covers max_len={max_len} positions but the sequence has {n}; raise max_len")


def _flat_values(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, kv_mask: ArrayLike | None
) -> tuple[Float[Array, "n channels"], Bool[Array, " n"]]:
    """The values as `[n, kv_heads * d_v]` float32 channels with padded rows zeroed, and
    the mask of real rows (all True without `kv_mask`)."""
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    n = v.shape[0]
    real = jnp.ones((n,), bool) if kv_mask is None else jnp.asarray(kv_mask)
    x = jnp.where(real[:, None], v.reshape(n, -1).astype(jnp.float32), 0.0)
    return x, real


def _per_query_head(mixed: Float[Array, "n channels"], q: ArrayLike, v: ArrayLike, dtype) -> Array:
    """`[n, kv_heads * d_v]` back to `[n, heads, d_v]`, each key/value head repeated for its query group."""
    n, kv_heads, d_v = v.shape
    out = mixed.reshape(n, kv_heads, d_v)
    return jnp.repeat(out, q.shape[1] // kv_heads, axis=1).astype(dtype)


# ----------------------------------------------------------------------------- MLP-Mixer


def mixer_attention(
    q: Float[ArrayLike, "n heads d_k"],
    k: Float[ArrayLike, "_n kv_heads _d_k"],
    v: Float[ArrayLike, "_n _kv_heads d_v"],
    *,
    w1: Float[ArrayLike, "hidden max_len"],
    b1: Float[ArrayLike, " _hidden"],
    w2: Float[ArrayLike, "_max_len _hidden"],
    b2: Float[ArrayLike, " _max_len"],
    kv_mask: Bool[ArrayLike, " _n"] | None = None,
) -> Float[Array, "n heads d_v"]:
    """MLP-Mixer's token-mixing MLP (Tolstikhin et al. 2021, eq. 1, first line) on the values.

    Each channel c of V (a column of `[n, kv_heads * d_v]`) goes through one MLP across
    the positions, U_{:,c} = W2 GELU(W1 V_{:,c} + b1) + b2, with W1 `[hidden, max_len]`
    and W2 `[max_len, hidden]` shared by every channel and every head (the paper shares
    them across its channels; heads are channels here). q and k are not read. In a model
    (registered `mixes_input`) v is the layer input itself, one "head" of width d_model.

    Arguments:
        q, k, v: as `softmax_attention`, self-attention only (q_len == kv_len <= max_len).
        w1, b1, w2, b2: the MLP's learned weights (`mixer_arrays`). A sequence of n <
            max_len positions uses W1's first n columns and W2's and b2's first n rows.
        kv_mask: optional `[n]`; padded values are zeroed first, so a padded sequence's
            real outputs equal those of the unpadded one (zero inputs add nothing to W1 V).

    Returns:
        `[n, heads, d_v]`; all zeros when every position is padded.

    GELU is the tanh approximation (flax's `nn.gelu`, which the authors' code calls).
    Time O(N * hidden * heads * d_v). Not causal: the hidden units read every position
    (the paper has no causal form).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    x, real = _flat_values(q, k, v, kv_mask)
    n = x.shape[0]
    _check_covered(n, w1.shape[1], "mixer's token MLP (w1)")
    if w2.shape != (w1.shape[1], w1.shape[0]) or b1.shape != (w1.shape[0],) or b2.shape != (w1.shape[1],):
        raise ValueError(
            f"w2 must be [max_len, hidden] = {(w1.shape[1], w1.shape[0])}, b1 [{w1.shape[0]}], b2 [{w1.shape[1]}]; "
            f"got w2 {tuple(w2.shape)}, b1 {tuple(b1.shape)}, b2 {tuple(b2.shape)}"
        )
    f32 = jnp.float32
    hidden = jax.nn.gelu(w1[:, :n].astype(f32) @ x + b1.astype(f32)[:, None], approximate=True)  # [hidden, C]
    mixed = w2[:n].astype(f32) @ hidden + b2[:n].astype(f32)[:, None]  # [n, C]
    mixed = jnp.where(jnp.any(real), mixed, 0.0)  # nothing real to mix: zeros, as the other ops
    return _per_query_head(mixed, q, v, out_dtype(q, k, v))


def mixer_arrays(key: PRNGKeyArray, *, hidden: int = 256, max_len: int = 512) -> dict[str, Array]:
    """The token MLP's weights at flax `nn.Dense`'s initialisation (the authors' code):
    kernels normal with std 1/sqrt(fan_in), biases zero."""
    check_positive("hidden", hidden)
    check_positive("max_len", max_len)
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (hidden, max_len)) / math.sqrt(max_len),
        "b1": jnp.zeros((hidden,)),
        "w2": jax.random.normal(k2, (max_len, hidden)) / math.sqrt(hidden),
        "b2": jnp.zeros((max_len,)),
    }


register(
    "mixer",
    mixer_attention,
    family="token mixing",
    paper="Tolstikhin et al. 2021",
    complexity="O(N h d)",
    supports_causal=False,
    exact=False,
    content_based=False,
    mixes_input=True,  # the paper's token MLP reads the (normalised) layer input: no W_Q, W_K, W_V, W_O
    init_arrays=mixer_arrays,
    covers_length="max_len",
    docs={"hidden": "the token MLP's hidden width D_S", "max_len": "longest sequence the token MLP covers"},
    summary="MLP-Mixer's token-mixing MLP over positions, per channel of the layer input",
    limits={"hidden": 1, "max_len": 1},
)


# ----------------------------------------------------------------------------- gMLP


def spatial_gating(
    z1: Float[ArrayLike, "rows half"],
    z2: Float[ArrayLike, "n _half"],
    real: Bool[ArrayLike, " _n"],
    *,
    spatial_w: Float[ArrayLike, "_rows cols"],
    spatial_b: Float[ArrayLike, " _rows"],
    ln_scale: Float[ArrayLike, " _half"],
    ln_bias: Float[ArrayLike, " _half"],
    causal: bool,
) -> Float[Array, "rows half"]:
    """gMLP's s(Z) = Z1 ⊙ (W LayerNorm(Z2) + b) (Liu et al. 2021, eq. 2 and 3) for the
    `rows` positions whose rows of W and b are given (all n in the forward; the one being
    decoded in a step, with `z1` its own row).

    Arguments:
        z1: `[rows, half]` the gated half; z2: `[n, half]` the half that is normalised
            and mixed along the n positions (padded rows are dropped after the norm).
        real: `[n]` True for positions that take part.
        spatial_w: `[rows, >= n]` W's rows (only its first n columns are read); with
            `causal` the rows are those of positions n - rows .. n - 1 and W is read
            lower-triangular (position i mixes positions j <= i).
        spatial_b: `[rows]` b.
        ln_scale, ln_bias: LayerNorm's affine parameters `[half]`.

    Returns:
        `[rows, half]`, in float32.
    """
    f32 = jnp.float32
    z2 = jnp.asarray(z2, f32)
    mean = jnp.mean(z2, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(z2 - mean), axis=-1, keepdims=True)
    affine = ln_scale.astype(f32)[None, :], ln_bias.astype(f32)[None, :]
    normed = (z2 - mean) * jax.lax.rsqrt(var + LN_EPSILON) * affine[0] + affine[1]
    normed = jnp.where(jnp.asarray(real)[:, None], normed, 0.0)  # LayerNorm(0) = beta: keep padding out
    n, rows = z2.shape[0], spatial_w.shape[0]
    w = spatial_w[:, :n].astype(f32)
    if causal:
        query_pos = jnp.arange(n - rows, n)[:, None]
        w = jnp.where(jnp.arange(n)[None, :] <= query_pos, w, 0.0)
    return jnp.asarray(z1, f32) * (w @ normed + spatial_b.astype(f32)[:, None])


def _gmlp_halves(v_flat: Array) -> tuple[Array, Array]:
    half = v_flat.shape[-1] // 2
    return v_flat[..., :half], v_flat[..., half:]


def _gmlp_output(gated: Array, channels: int) -> Array:
    """s(Z) `[n, C/2]` as the layer's `[n, C]` channels: s(Z) first, zeros after (see `gmlp_attention`)."""
    return jnp.concatenate([gated, jnp.zeros((gated.shape[0], channels - gated.shape[1]), gated.dtype)], axis=-1)


def _check_gmlp(v: ArrayLike, spatial_w: ArrayLike, spatial_b: ArrayLike, ln_scale: ArrayLike) -> None:
    channels = v.shape[1] * v.shape[2]
    if channels % 2:
        raise ValueError(
            f"gmlp splits the value channels kv_heads * d_v = {v.shape[1]} * {v.shape[2]} = {channels} "
            "into two halves: it must be even"
        )
    if spatial_w.shape[0] != spatial_w.shape[1] or spatial_b.shape != (spatial_w.shape[0],):
        raise ValueError(
            f"spatial_w must be [max_len, max_len] and spatial_b [max_len]; got {tuple(spatial_w.shape)} "
            f"and {tuple(spatial_b.shape)}"
        )
    if ln_scale.shape != (channels // 2,):
        raise ValueError(f"ln_scale must have shape [kv_heads * d_v / 2] = [{channels // 2}]; got {ln_scale.shape}")


@causal_never_reads_non_finite_future()
def gmlp_attention(
    q: Float[ArrayLike, "n heads d_k"],
    k: Float[ArrayLike, "_n kv_heads _d_k"],
    v: Float[ArrayLike, "_n _kv_heads d_v"],
    *,
    spatial_w: Float[ArrayLike, "max_len _max_len"],
    spatial_b: Float[ArrayLike, " _max_len"],
    ln_scale: Float[ArrayLike, " half"],
    ln_bias: Float[ArrayLike, " _half"],
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _n"] | None = None,
) -> Float[Array, "n heads d_v"]:
    """gMLP's spatial gating unit (Liu et al. 2021, §2.1, eq. 2-3) on the values.

    The values' channels `[n, kv_heads * d_v]` (the paper's Z = σ(XU), here the module's
    W_V X) are split in two halves Z1, Z2 along the channels; s(Z) = Z1 ⊙ (W LN(Z2) + b)
    with one W `[n, n]` mixing positions, shared by every channel (and head), LN a
    LayerNorm over Z2's channels per position. s(Z) has half the channels: the output is
    s(Z) in the first kv_heads * d_v / 2 channels and zeros in the rest, so the module's
    W_O reads s(Z) with its first half (the paper's output projection) and its second
    half stays idle. q and k are not read.

    Arguments:
        q, k, v: as `softmax_attention`, self-attention only (n <= max_len);
            kv_heads * d_v must be even.
        spatial_w, spatial_b: W `[max_len, max_len]` and b `[max_len]` (`gmlp_arrays`:
            W near zero and b = 1, the paper's initialisation, so the unit starts as
            the identity on Z1). A shorter sequence uses the leading block.
        ln_scale, ln_bias: LayerNorm's affine parameters `[kv_heads * d_v / 2]`.
        causal: W read lower-triangular, position i mixing j <= i (the paper's causal
            gMLP for autoregressive language modelling); decodes from a cache of values.
        kv_mask: optional `[n]`; padded values are zeroed and their normalised rows
            dropped, so a padded sequence's real outputs equal the unpadded ones.

    Returns:
        `[n, heads, d_v]` (each key/value head repeated for its query group).

    Time O(N^2 * heads * d_v) (W is dense over positions), memory O(max_len^2) for W.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    x, real = _flat_values(q, k, v, kv_mask)
    _check_gmlp(v, spatial_w, spatial_b, ln_scale)
    _check_covered(x.shape[0], spatial_w.shape[0], "gmlp's spatial weights (spatial_w)")
    n = x.shape[0]
    z1, z2 = _gmlp_halves(x)
    gated = spatial_gating(
        z1,
        z2,
        real,
        spatial_w=spatial_w[:n],
        spatial_b=spatial_b[:n],
        ln_scale=ln_scale,
        ln_bias=ln_bias,
        causal=causal,
    )
    return _per_query_head(_gmlp_output(gated, x.shape[1]), q, v, out_dtype(q, k, v))


# The paper initialises W "as near-zero values"; this is the half-width of the uniform
# draw at max_len 1, divided by max_len (as the row sums of W then stay <= 1e-3).
SPATIAL_INIT = 1e-3


def gmlp_arrays(key: PRNGKeyArray, *, kv_heads: int, d_v: int, max_len: int = 512) -> dict[str, Array]:
    """W uniform in ±SPATIAL_INIT / max_len (near zero) and b = 1, the paper's
    initialisation (the unit starts as Z1 itself); LayerNorm's scale 1 and bias 0."""
    check_positive("max_len", max_len)
    half = kv_heads * d_v // 2
    eps = SPATIAL_INIT / max_len
    return {
        "spatial_w": jax.random.uniform(key, (max_len, max_len), minval=-eps, maxval=eps),
        "spatial_b": jnp.ones((max_len,)),
        "ln_scale": jnp.ones((half,)),
        "ln_bias": jnp.zeros((half,)),
    }


def _gmlp_step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
    """One causal position t: W's row t against the cached values of positions <= t."""
    state = cache_append(state, k, v)
    t = state.length - 1
    slots = state.v.shape[0]
    _check_covered(slots, arrays["spatial_w"].shape[0], "gmlp's spatial weights (spatial_w)")
    x = state.v.reshape(slots, -1).astype(jnp.float32)
    z1, z2 = _gmlp_halves(x)
    row_w = jax.lax.dynamic_slice_in_dim(arrays["spatial_w"][:, :slots], t, 1, axis=0)  # [1, slots]
    row_b = jax.lax.dynamic_slice_in_dim(arrays["spatial_b"], t, 1)
    written = state.slot_pos >= 0  # slots <= t (later ones are empty)
    gated = spatial_gating(
        jax.lax.dynamic_slice_in_dim(z1, t, 1),
        z2,
        written,
        spatial_w=row_w,
        spatial_b=row_b,
        ln_scale=arrays["ln_scale"],
        ln_bias=arrays["ln_bias"],
        causal=False,  # the empty slots after t are masked out already
    )
    out = _per_query_head(_gmlp_output(gated, x.shape[1]), q[None], v[None], q.dtype)[0]
    return out, state


register(
    "gmlp",
    gmlp_attention,
    family="token mixing",
    paper="Liu et al. 2021",
    complexity="O(N^2 d)",
    exact=False,
    content_based=False,
    init_arrays=gmlp_arrays,
    covers_length="max_len",
    decoder=Decoder("cache", full_cache_init, _gmlp_step),
    docs={"max_len": "longest sequence the spatial weights W cover"},
    summary="gMLP's spatial gating unit Z1 * (W LayerNorm(Z2) + b) over the value channels",
    limits={"max_len": 1},
)
