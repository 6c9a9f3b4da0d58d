"""Small layers: a linear map that computes in a chosen dtype, LayerNorm and RMSNorm
that always normalise in float32 (and PowerNorm, from `power_norm`), the position-wise feed-forward network with
ReLU, GELU (tanh approximation, or "gelu_exact": the erf form BERT uses), Swish/SiLU,
squared ReLU and gated (GEGLU, SwiGLU, ReGLU, bilinear) variants (Lin et al. 2021, "A
Survey of Transformers", arXiv 2106.04554, section 5.3), and the embedding-table lookup that
refuses ids outside the table (`lookup`)."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.power_norm import PowerNorm


def _relu_squared(h: Array) -> Array:
    return jnp.square(jax.nn.relu(h))


def _identity(h: Array) -> Array:
    return h


# The FFN's activation of each kind: act(x W1) alone, or act(x W1) * (x W3) for the gated
# kinds (Shazeer 2020, "GLU Variants Improve Transformer", arXiv 2002.05202, eqs. 5-6:
# GEGLU, SwiGLU, ReGLU, and the bilinear layer, whose "activation" is the identity).
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    # Swish with beta = 1 (Ramachandran et al. 2017, "Searching for Activation Functions")
    "silu": jax.nn.silu,
    # So et al. 2021 ("Primer: Searching for Efficient Transformers for Language Modeling"), section 3
    "relu2": _relu_squared,
    "geglu": functools.partial(jax.nn.gelu, approximate=True),
    "swiglu": jax.nn.silu,
    "reglu": jax.nn.relu,
    "bilinear": _identity,
}
GATED_KINDS = ("geglu", "swiglu", "reglu", "bilinear")
FFN_KINDS = tuple(ACTIVATIONS)
NORM_KINDS = ("layernorm", "rmsnorm", "scalenorm", "adanorm", "powernorm")


def check_ids(ids, size: int, what: str = "token ids") -> None:
    """A ValueError naming the ids outside [0, size) when `ids` are concrete (eager
    calls); nothing under a trace (jit, vmap, scan), where they cannot be read."""
    if isinstance(ids, jax.core.Tracer):
        return
    ids = np.asarray(ids)
    outside = (ids < 0) | (ids >= size)
    if outside.any():
        bad = np.unique(ids[outside])
        raise ValueError(
            f"{what} must be in [0, {size}) (the table's size); got {bad[:8].tolist()}"
            f"{' and more' if bad.size > 8 else ''} at {int(outside.sum())} position(s)"
        )


def check_tokens(tokens, mask=None) -> int:
    """The length of one example's `[seq]` token ids, after a ValueError for a batch
    passed without `jax.vmap`, for ids that are not integers, and for a mask not shaped
    like them."""
    shape = jnp.shape(tokens)
    if len(shape) != 1:
        raise ValueError(
            f"tokens must be one example's ids, shape [seq]; got shape {shape} (models take one "
            "example at a time: call them under jax.vmap for a batch)"
        )
    if not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"tokens must be integer ids; got dtype {jnp.result_type(tokens)}")
    if mask is not None and jnp.shape(mask) != shape:
        raise ValueError(f"mask must have shape ({shape[0]},) like the tokens; got {jnp.shape(mask)}")
    return shape[0]


def lookup(table: Float[Array, "size d"], ids: Int[Array, "*n"], what: str = "token ids") -> Float[Array, "*n d"]:
    """table[ids], never silently another row: an id outside [0, size) is a ValueError
    when the ids are concrete (`check_ids`), and a row of NaN under a trace (jit, vmap,
    scan), so whatever reads it turns NaN instead of using the clamped last row (JAX's
    indexing clamps out-of-range ids and wraps negative ones)."""
    check_ids(ids, table.shape[0], what)
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = table[jnp.clip(ids, 0, table.shape[0] - 1)]
    return jnp.where(valid[..., None], rows, jnp.asarray(jnp.nan, table.dtype))


def _lift(vector: Array, ndim: int) -> Array:
    """A feature vector shaped to broadcast against `ndim`-d activations (the tests
    forbid implicit rank promotion)."""
    return vector.reshape((1,) * (ndim - 1) + (-1,))


class Linear(eqx.Module):
    """y = x W^T + b with parameters kept in float32 and the product computed in the
    dtype of `x` (mixed precision: cast the activations, not the master weights)."""

    weight: Float[Array, "out_features in_features"]
    bias: Float[Array, " out_features"] | None

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True, key: PRNGKeyArray):
        bound = 1.0 / math.sqrt(in_features)
        wkey, bkey = jax.random.split(key)
        self.weight = jax.random.uniform(wkey, (out_features, in_features), minval=-bound, maxval=bound)
        self.bias = jax.random.uniform(bkey, (out_features,), minval=-bound, maxval=bound) if use_bias else None

    def __call__(self, x: Float[Array, "*batch in_features"]) -> Float[Array, "*batch out_features"]:
        y = x @ self.weight.T.astype(x.dtype)
        return y if self.bias is None else y + _lift(self.bias.astype(x.dtype), y.ndim)


class LayerNorm(eqx.Module):
    """LayerNorm over the last axis, computed in float32, returned in the input dtype."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5):
        self.weight, self.bias, self.eps = jnp.ones((dim,)), jnp.zeros((dim,)), eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        scaled = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (scaled * _lift(self.weight, x.ndim) + _lift(self.bias, x.ndim)).astype(x.dtype)


class RMSNorm(eqx.Module):
    """RMSNorm (Zhang & Sennrich, 2019): x / rms(x) * g, in float32."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight, self.eps = jnp.ones((dim,)), eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        scaled = xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)
        return (scaled * _lift(self.weight, x.ndim)).astype(x.dtype)


class ScaleNorm(eqx.Module):
    """ScaleNorm (Nguyen & Salazar 2019, "Transformers without Tears", arXiv 1910.05895,
    section 2.3): g x / max(||x||, eps) with one learned scalar g per norm, started at
    sqrt(dim) (their section 2.3: the l2 norm of a unit-variance x), in float32. The
    paper's code clamps the norm from below by eps, as here."""

    weight: Float[Array, ""]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5):
        self.weight, self.eps = jnp.asarray(math.sqrt(dim), jnp.float32), eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        # max(||x||, eps) as sqrt(max(||x||^2, eps^2)): the same number, and a finite
        # gradient at x = 0, where that of ||x|| is not
        inverse = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.square(xf), -1, keepdims=True), self.eps**2))
        return (self.weight * xf * inverse).astype(x.dtype)


class AdaNorm(eqx.Module):
    """AdaNorm (Xu et al. 2019, "Understanding and Improving Layer Normalization", NeurIPS,
    section 5): z = C (1 - k y) * y with y = (x - mean) / (std + eps), k = 1/10, and
    (1 - k y) treated as a constant in the backward pass (their eq. 12: its gradient is
    detached), so the scale adapts to each input without the gain and bias, which AdaNorm
    drops (no parameters). As the authors' code: std is the unbiased standard deviation,
    eps is added to it, C = 1 (their default `adanorm_scale`). In float32."""

    eps: float = eqx.field(static=True)
    k: float = eqx.field(static=True)
    c: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5, *, k: float = 0.1, c: float = 1.0):
        del dim  # no parameters: the signature of the other norms
        self.eps, self.k, self.c = eps, k, c

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        centred = xf - xf.mean(-1, keepdims=True)
        # unbiased, as torch.std; a 1-feature input has no spread to measure (std 0)
        std = jnp.sqrt(jnp.sum(jnp.square(centred), -1, keepdims=True) / max(x.shape[-1] - 1, 1))
        y = centred / (std + self.eps)
        return (self.c * (1.0 - self.k * jax.lax.stop_gradient(y)) * y).astype(x.dtype)


# Any norm `make_norm` builds.
Norm = LayerNorm | RMSNorm | ScaleNorm | AdaNorm | PowerNorm
_NORM_CLASSES = {
    "layernorm": LayerNorm,
    "rmsnorm": RMSNorm,
    "scalenorm": ScaleNorm,
    "adanorm": AdaNorm,
    "powernorm": PowerNorm,
}


def normalise(
    norm: Norm, x: Float[Array, "*batch dim"], mask: Bool[Array, "*batch"] | None
) -> Float[Array, "*batch dim"]:
    """norm(x), telling a norm that keeps statistics over the batch (PowerNorm) which
    rows are real tokens (`mask` True; None: all); the others normalise each row alone."""
    return norm(x, mask=mask) if isinstance(norm, PowerNorm) else norm(x)


def make_norm(kind: str, dim: int, eps: float | None = None) -> Norm:
    """A norm of `kind` (one of NORM_KINDS) over `dim` features; `eps` None: the class's default."""
    if kind not in NORM_KINDS:
        raise ValueError(f"norm must be one of {NORM_KINDS}; got {kind!r}")
    cls = _NORM_CLASSES[kind]
    return cls(dim) if eps is None else cls(dim, eps)


class FeedForward(eqx.Module):
    """Position-wise FFN: W2 act(W1 x), or W2 (act(W1 x) * W3 x) for the gated kinds
    (`ACTIVATIONS`, `GATED_KINDS`: GEGLU, SwiGLU, ReGLU and the bilinear layer; Shazeer
    2020).

    `mid_norm`: a norm of this kind (`norm_eps`) on the hidden layer, before W2: NormFormer's
    FFN LN (Shleifer et al. 2021, section 2); None: none.

    `shifts`: Fixup's two scalar biases inside the FFN, W2 (act(W1 x - b1) - b2), both
    started at 0 (Zhang, Dauphin & Ma 2019, section 3, rule 3: a scalar bias before each
    linear and element-wise activation layer; the one before W1 is the block's,
    `jxformers.nn.residual`).

    `chunk_size`: run the positions in chunks of this many, one after another
    (`lax.map`), so the `[seq, d_ff]` hidden layer is never held at once: Reformer's
    chunked feed-forward (Kitaev et al. section 4). The same function; None: one chunk."""

    kind: str = eqx.field(static=True)
    chunk_size: int | None = eqx.field(static=True)
    w_in: Linear
    w_gate: Linear | None
    w_out: Linear
    mid_norm: Norm | None  # NormFormer's norm on the hidden layer
    shifts: Float[Array, 2] | None  # Fixup's scalar biases before the activation and before W2
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        kind: str = "gelu",
        *,
        dropout: float = 0.0,
        chunk_size: int | None = None,
        mid_norm: str | None = None,
        norm_eps: float | None = None,
        shifts: bool = False,
        key: PRNGKeyArray,
    ):
        if kind not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {FFN_KINDS}; got {kind!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"{chunk_size=} must be None or an int >= 1")
        k1, k2, k3 = jax.random.split(key, 3)
        self.kind, self.chunk_size = kind, chunk_size
        self.w_in = Linear(d_model, d_ff, key=k1)
        self.w_gate = Linear(d_model, d_ff, key=k3) if kind in GATED_KINDS else None
        self.w_out = Linear(d_ff, d_model, key=k2)
        self.mid_norm = None if mid_norm is None else make_norm(mid_norm, d_ff, norm_eps)
        self.shifts = jnp.zeros((2,), jnp.float32) if shifts else None
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(
        self, x: Float[Array, "seq d_model"], *, key: PRNGKeyArray | None = None, inference: bool = False
    ) -> Float[Array, "seq d_model"]:
        n, c = x.shape[0], self.chunk_size
        if c is None or n <= c:
            return self._apply(x, key, inference)
        chunks = -(-n // c)
        xs = jnp.pad(x, ((0, chunks * c - n), (0, 0))).reshape(chunks, c, x.shape[1])
        keys = None if key is None else jax.random.split(key, chunks)
        out = jax.lax.map(lambda a: self._apply(a[0], a[1], inference), (xs, keys))
        return out.reshape(chunks * c, -1)[:n]

    def _apply(self, x, key, inference):
        h = self.w_in(x)
        if self.shifts is not None:
            h = h - self.shifts[0].astype(h.dtype)
        h = ACTIVATIONS[self.kind](h)
        if self.w_gate is not None:
            h = h * self.w_gate(x)
        h = self.dropout(h, key=key, inference=inference)
        if self.shifts is not None:
            h = h - self.shifts[1].astype(h.dtype)
        if self.mid_norm is not None:  # after the activation's dropout, as NormFormer's code (fairseq)
            h = self.mid_norm(h)
        return self.w_out(h)


def split_key(key: PRNGKeyArray | None, n: int) -> list:
    """`n` keys from `key`, or `n` Nones without one (inference: no dropout)."""
    return [None] * n if key is None else list(jax.random.split(key, n))
