"""The Fourier family: the orthonormal DCT-II and its inverse computed with the FFT, the
Fourier Transformer's spectral filter (He et al. 2023, "Fourier Transformer: Fast Long
Range Modeling by Removing Sequence Redundancy with FFT Operator", arXiv 2305.15099) and
FNet token mixing (Lee-Thorp et al., 2021), and the paper's spectrum analysis (its
Figure 1): `dct_power`, the power per DCT frequency of hidden states along the sequence,
and `cumulative_energy` / `energy_share`, the share of that power in the lowest
frequencies (what the filter keeps).

`dct` follows He et al.'s eq. 1-6: interleave even and (reversed) odd samples, take an FFT,
rotate by exp(-i pi k / 2N) and keep the real part, O(N log N) for any length.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.core import Tracer
from jaxtyping import Array, Bool, Float, Int

from jxformers._typing import ArrayLike
from jxformers.ops._common import check_mask_shape, check_qkv, out_dtype, zero_padded
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "cumulative_energy",
    "dct",
    "dct_power",
    "energy_share",
    "fnet_attention",
    "fnet_mixing",
    "fourier_downsample",
    "fourier_downsample_padded",
    "idct",
    "nearest_upsample",
]


def _alpha(n: int) -> Array:
    """Orthonormal scale of eq. 2: sqrt(1/N) for k = 0, sqrt(2/N) otherwise."""
    return jnp.full((n,), math.sqrt(2.0 / n)).at[0].set(math.sqrt(1.0 / n))


def _last_axis(vec: ArrayLike, ndim: int) -> Array:
    """Shape a [n] vector to broadcast along the last axis of a rank-`ndim` array."""
    return vec.reshape((1,) * (ndim - 1) + vec.shape)


def _check_axis(x: ArrayLike, axis: int) -> int:
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be in [{-x.ndim}, {x.ndim}) for an array of rank {x.ndim}; got {axis}")
    if x.shape[axis] == 0:
        raise ValueError("the transformed axis must not be empty")
    return axis % x.ndim


def dct(x: Float[ArrayLike, " ..."], axis: int = 0) -> Float[Array, " ..."]:
    """Orthonormal DCT-II along `axis` (He et al. 2023, eq. 1): y_k = a_k sum_n x_n cos(pi k (2n + 1) / 2N).

    Computed with one length-N FFT (eq. 4-6), any N; float32 (or float64) result.
    """
    axis = _check_axis(x, axis)
    xm = jnp.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    u = jnp.concatenate([xm[..., ::2], xm[..., 1::2][..., ::-1]], axis=-1).astype(dtype)  # eq. 4
    v = jnp.fft.fft(u, axis=-1)  # eq. 5
    k = jnp.arange(n, dtype=dtype)
    rot = jnp.exp(-1j * jnp.pi * k / (2 * n))
    y = jnp.real(v * _last_axis(rot, v.ndim)) * _last_axis(_alpha(n).astype(dtype), v.ndim)  # eq. 6, orthonormal
    return jnp.moveaxis(y, -1, axis)


def idct(y: Float[ArrayLike, " ..."], axis: int = 0) -> Float[Array, " ..."]:
    """Inverse of `dct` (He et al. 2023, eq. 3): x_n = sum_k a_k y_k cos(pi k (2n + 1) / 2N)."""
    axis = _check_axis(y, axis)
    ym = jnp.moveaxis(y, axis, -1)
    n = ym.shape[-1]
    dtype = jnp.promote_types(y.dtype, jnp.float32)
    c = ym.astype(dtype) / _last_axis(_alpha(n).astype(dtype), ym.ndim)  # unnormalised coefficients
    c_rev = jnp.concatenate([jnp.zeros_like(c[..., :1]), c[..., :0:-1]], axis=-1)  # C_{N-k}, C_N = 0
    k = jnp.arange(n, dtype=dtype)
    v = _last_axis(jnp.exp(1j * jnp.pi * k / (2 * n)), c.ndim) * (c - 1j * c_rev)
    u = jnp.real(jnp.fft.ifft(v, axis=-1))
    half = (n + 1) // 2
    x = jnp.zeros_like(u)
    x = x.at[..., ::2].set(u[..., :half])
    x = x.at[..., 1::2].set(u[..., half:][..., ::-1])
    return jnp.moveaxis(x, -1, axis)


def kept_length(n: int, keep_ratio: float) -> int:
    """ceil(keep_ratio * n), at least 1: the length after the spectral filter."""
    if not (isinstance(keep_ratio, (int, float)) and 0.0 < keep_ratio <= 1.0):
        raise ValueError(f"keep_ratio must be in (0, 1]; got {keep_ratio!r}")
    return max(1, math.ceil(keep_ratio * n - 1e-9))


def fourier_downsample(
    x: Float[ArrayLike, " ..."], keep_ratio: float, axis: int = 0, *, rescale: bool = False
) -> Float[Array, " ..."]:
    """The Fourier Transformer's spectral filter (He et al. 2023, section 4.1, eq. 7-8).

    DCT along `axis`, keep the first M = ceil(keep_ratio * N) coefficients, inverse DCT at
    length M. Two amplitudes:

    * `rescale=False` (the paper's, and the default): eq. 8 is the orthonormal inverse
      DCT at the new length, as in the official code (`idct(..., norm='ortho')`), so the
      output is sqrt(N / M) times the band-limited resampling: a constant c becomes
      c sqrt(N / M) (2.24 c at keep_ratio 0.2). Use it to reproduce the paper or to load
      weights trained with it: the layers after the filter learnt that scale.
    * `rescale=True`: times sqrt(M / N) on top, the band-limited resampling itself, so a
      constant stays the same constant and a sum of the kept cosines
      cos(pi k (2n + 1) / 2N) becomes the same sum of cos(pi k (2m + 1) / 2M). Use it to
      keep the residual stream's scale, e.g. when inserting filters into a pretrained
      plain transformer without further pretraining, or when stacking many filters
      (the paper's form multiplies the stream by sqrt(N / M) at each).

    Arguments:
        x: any array; only `axis` (the sequence) is transformed.
        keep_ratio: r in (0, 1].
        axis: the sequence axis.
        rescale: multiply by sqrt(M / N) (see above).

    Returns:
        `x` with `axis` shortened to M, in x's dtype (computed in float32). Time
        O(N log N) per feature.
    """
    axis = _check_axis(x, axis)
    n = x.shape[axis]
    m = kept_length(n, keep_ratio)
    y = idct(jnp.take(dct(x, axis), jnp.arange(m), axis=axis), axis)
    return (y * math.sqrt(m / n) if rescale else y).astype(x.dtype)


def dct_power(x: Float[ArrayLike, " ..."], axis: int = 0) -> Float[Array, " n"]:
    """Power spectrum along `axis` (He et al. 2023, section 3.2 and Figure 1, with the DCT-II
    in place of the paper's FFT): `dct(x, axis) ** 2` averaged over every other axis (the
    channels, and the windows of a batch `[windows, n, d]` with `axis=1`).

    The DCT is orthonormal, so the powers sum to the mean over those axes of
    `sum_n x_n ** 2` (Parseval); bin 0 is the mean along `axis` (times sqrt(N)), bin k
    the cosine of k half-periods.

    Returns:
        `[n]` float32 (float64 for float64 input), n = x.shape[axis].
    """
    axis = _check_axis(x, axis)
    y = jnp.moveaxis(dct(x, axis), axis, -1)
    return jnp.mean(jnp.square(y).reshape(-1, y.shape[-1]), axis=0)


def cumulative_energy(power: Float[ArrayLike, " ... n"]) -> Float[Array, " ... n"]:
    """Share of the total power in bins 0..k, for each k, along the last axis (ends at 1);
    `power` must be non-negative with a positive total (a ValueError otherwise, when
    concrete)."""
    power = jnp.asarray(power)
    if power.ndim == 0 or power.shape[-1] == 0:
        raise ValueError(f"power needs a non-empty last axis; got shape {power.shape}")
    total = jnp.sum(power, axis=-1, keepdims=True)
    if not isinstance(power, Tracer) and (bool(jnp.any(power < 0)) or bool(jnp.any(total <= 0))):
        raise ValueError(f"power must be >= 0 with a positive total; got min {power.min()}, totals {total.ravel()}")
    return jnp.cumsum(power, axis=-1) / total


def energy_share(power: Float[ArrayLike, " ... n"], keep_ratio: float) -> Float[Array, " ..."]:
    """Share of the power in the lowest `kept_length(n, keep_ratio)` = ceil(r n) bins along
    the last axis: the energy the spectral filter at keep ratio r keeps
    (`fourier_downsample` keeps those DCT coefficients). White noise gives about r."""
    power = jnp.asarray(power)
    return cumulative_energy(power)[..., kept_length(power.shape[-1], keep_ratio) - 1]


# Bluestein's chirps need j^2 mod 4L for j < 2L: exact in uint32 while (2n)^2 < 2^32.
_CHIRP_MAX_LEN = 2**15 - 1


def _chirp(j: Array, length: Array, sign: int) -> Array:
    """exp(sign i pi j^2 / (2 length)) for integer j (any sign): the phase j^2 is reduced
    modulo 4 length in integers first, so it stays exact for long sequences."""
    j = (j % (2 * length)).astype(jnp.uint32)
    phase = (j * j) % (4 * length).astype(jnp.uint32)
    return jnp.exp(sign * 1j * jnp.pi * phase.astype(jnp.float32) / (2 * length.astype(jnp.float32)))


def _chirp_dft(u: Array, length: Array, out_len: int, sign: int) -> Array:
    """z_k = sum_n u_n exp(sign i pi k n / length) for k < out_len, u `[n, d]` complex, with
    a traced `length` (Bluestein: k n = (k^2 + n^2 - (k - n)^2) / 2 turns the sum into a
    convolution with a chirp, done by FFTs of a static power-of-two size >= n + out_len - 1).
    O((n + out_len) log(n + out_len)) per feature."""
    n = u.shape[0]
    size = 1 << max(n + out_len - 2, 0).bit_length()
    length = jnp.maximum(length, 1)
    a = u * _chirp(jnp.arange(n), length, sign)[:, None]
    lag = jnp.arange(size)
    lag = jnp.where(lag < out_len, lag, lag - size)  # circular index of k - n, from -(n - 1) to out_len - 1
    kernel = jnp.fft.fft(jnp.conj(_chirp(lag, length, sign)))
    conv = jnp.fft.ifft(jnp.fft.fft(a, size, axis=0) * kernel[:, None], axis=0)[:out_len]
    return conv * _chirp(jnp.arange(out_len), length, sign)[:, None]


def _alpha_at(rows: int, length: Array) -> Array:
    """`_alpha` of a traced length, for the first `rows` coefficients."""
    size = jnp.maximum(length, 1).astype(jnp.float32)
    return jnp.where(jnp.arange(rows) == 0, jnp.sqrt(1.0 / size), jnp.sqrt(2.0 / size))


def _dct_padded(flat: Array, length: Array, rows: int) -> Array:
    """The first `rows` orthonormal DCT-II coefficients of `flat[:length]` `[n, d]`."""
    k = jnp.arange(rows, dtype=jnp.float32)[:, None]
    size = jnp.maximum(length, 1).astype(jnp.float32)
    z = _chirp_dft(flat.astype(jnp.complex64), length, rows, -1)
    return jnp.real(jnp.exp(-1j * jnp.pi * k / (2 * size)) * z) * _alpha_at(rows, length)[:, None]


def _idct_padded(coef: Array, length: Array) -> Array:
    """Orthonormal inverse DCT at a traced `length` of `coef[:length]` `[m, d]` (rows past
    `length` must be zero); rows past `length` of the result are not meaningful."""
    m = coef.shape[0]
    k = jnp.arange(m, dtype=jnp.float32)[:, None]
    size = jnp.maximum(length, 1).astype(jnp.float32)
    v = coef * _alpha_at(m, length)[:, None] * jnp.exp(1j * jnp.pi * k / (2 * size))
    return jnp.real(_chirp_dft(v, length, m, 1))


def _dct_matrix(rows: int, cols: int, length: ArrayLike) -> Array:
    """Orthonormal DCT-II basis [k, n] of a signal of (traced) `length` <= cols, rows k,
    zero for n >= length; its transpose is the inverse at that length."""
    k = jnp.arange(rows, dtype=jnp.float32)[:, None]
    n = jnp.arange(cols, dtype=jnp.float32)[None, :]
    size = jnp.maximum(length, 1).astype(jnp.float32)
    basis = jnp.cos(math.pi * (2 * n + 1) * k / (2 * size)) * jnp.sqrt(2.0 / size)
    basis = jnp.where(k == 0, basis / math.sqrt(2.0), basis)
    return jnp.where(n < length, basis, 0.0)


def fourier_downsample_padded(
    x: Float[ArrayLike, " n *rest"], length: Int[ArrayLike, ""] | int, keep_ratio: float, *, rescale: bool = False
) -> tuple[Float[Array, " m *rest"], Bool[Array, " m"]]:
    """`fourier_downsample` of the real prefix `x[:length]` of a padded sequence.

    The prefix of length L is filtered to M_L = ceil(keep_ratio * L) samples, written to the
    front of an output of static length M = ceil(keep_ratio * n) with the mask
    `arange(M) < M_L`; positions past `length` never enter. `length` may be traced (one
    per example under vmap): the DCT at length L and the inverse at M_L are computed
    with Bluestein's chirp transform, FFTs of a static size, O(n log n) per feature
    (for n > 32767, where its integer phases would overflow, two dense DCT matrices,
    O(M n)). Unpadded sequences can take `fourier_downsample` (one plain FFT each way).

    Returns:
        `(y [M, ...], mask [M])`; `y[:M_L]` equals
        `fourier_downsample(x[:L], keep_ratio, rescale=rescale)`.
    """
    n = x.shape[0]
    m = kept_length(n, keep_ratio)
    length = jnp.clip(jnp.asarray(length, jnp.int32), 0, n)
    kept = jnp.clip(jnp.ceil(keep_ratio * length.astype(jnp.float32) - 1e-6).astype(jnp.int32), min(1, n), m)
    kept = jnp.where(length > 0, kept, 0)
    mask = jnp.arange(m) < kept
    flat = jnp.where((jnp.arange(n) < length)[:, None], x.reshape(n, -1).astype(jnp.float32), 0.0)
    if n > _CHIRP_MAX_LEN:
        forward = jnp.where(mask[:, None], _dct_matrix(m, n, length), 0.0)  # [M, n]
        y = _dct_matrix(m, m, kept).T @ (forward @ flat)
    else:
        y = _idct_padded(jnp.where(mask[:, None], _dct_padded(flat, length, m), 0.0), kept)
    if rescale:
        y = y * jnp.sqrt(kept / jnp.maximum(length, 1).astype(jnp.float32))
    y = jnp.where(mask[:, None], y, 0.0)
    return y.reshape(m, *x.shape[1:]).astype(x.dtype), mask


def nearest_upsample(x: Float[ArrayLike, " ..."], length: int, axis: int = 0) -> Float[Array, " ..."]:
    """Parameter-free nearest-neighbour upsampling to `length` along `axis` (position n
    takes sample floor(n * M / length)); the Fourier Transformer's encoder-decoder setting
    upsamples every block's output this way before summing them (He et al. 2023, section 4.1)."""
    axis = _check_axis(x, axis)
    m = x.shape[axis]
    if not isinstance(length, int) or length < m:
        raise ValueError(f"length must be an int >= the current length {m}; got {length!r}")
    idx = (jnp.arange(length) * m) // length
    return jnp.take(x, idx, axis=axis)


def fnet_mixing(x: Float[ArrayLike, "seq hidden"]) -> Float[Array, "seq hidden"]:
    """FNet token mixing: Re(FFT_seq(FFT_hidden(x))), no parameters, O(N log N)."""
    return jnp.real(jnp.fft.fft2(x.astype(jnp.promote_types(x.dtype, jnp.float32)))).astype(x.dtype)


def fnet_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
) -> Float[Array, "seq heads d_v"]:
    """FNet's Fourier sublayer (Lee-Thorp et al. 2021) as a registered attention:
    `fnet_mixing` of the values flattened to `[seq, kv_heads * d_v]` (q and k are
    ignored; FNet has no attention weights). Registered with `mixes_input`, so
    `nn.Attention` makes no projections and passes the layer input `[seq, 1, d_model]`
    as v: the layer is the paper's parameter-free Re(FFT_seq(FFT_hidden(X))). Padded
    positions are zeroed before mixing, so their content never reaches the output (the
    real outputs still depend on the padded length, as FNet's do).

    Arguments:
        q, k: read for their shapes only. v: `[seq, kv_heads, d_v]`.
        kv_mask: optional `[seq]`, True for real tokens.

    Returns:
        `[seq, heads, d_v]`, each query head the mixing of its kv head's group.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_qkv(q, k, v, self_attention=True)
    check_mask_shape("kv_mask", kv_mask, (k.shape[0],))
    if kv_mask is not None:
        v = jnp.where(kv_mask[:, None, None], v, 0)
    n, kv_heads, d_v = v.shape
    mixed = fnet_mixing(v.reshape(n, kv_heads * d_v)).reshape(n, kv_heads, d_v)
    return jnp.repeat(mixed, q.shape[1] // kv_heads, axis=1).astype(out_dtype(q, k, v))


register(
    "fnet",
    fnet_attention,
    family="fourier",
    paper="Lee-Thorp et al. 2021",
    complexity="O(N log N)",
    exact=False,
    content_based=False,
    mixes_input=True,
    summary="Re(FFT2) token mixing of the layer input (FNet), no parameters",
)
