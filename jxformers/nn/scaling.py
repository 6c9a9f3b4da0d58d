"""The Scaling Transformer's sparse layers (Jaszczur et al. 2021, "Sparse is Enough in
Scaling Transformers", NeurIPS, section 3): the sparse feed-forward layer, whose low-rank
controller switches on one hidden unit in each block of N, and the sparse QKV layer, a
multiplicative dense layer followed by a convolution per Q, K and V.

    ffn = SparseFeedForward(d_model=64, d_ff=256, block_size=8, controller_rank=32, key=key)
    y = ffn(x, key=key)                      # [seq, d_model]; training: Gumbel choice, straight-through
    y = ffn(x, inference=True)               # argmax choice; fewer rows than N: only the chosen units
    qkv = SparseQKV(d_model=64, modules=4, conv_length=3, conv_modules=3, key=key)
    q, k, v = qkv(x)                         # each [seq, d_model]

Sparse FFN (section 3.1). The controller is two dense layers with no nonlinearity between
them, x C1 C2 + c (C1 `[d_model, r]`, C2 `[r, d_ff]`), its d_ff logits cut into d_ff / N
blocks of N; the layer is relu(x W1 + b1) * mask, then W2 + b2, where mask is one-hot in
each block. At inference (and decoding) the mask is the argmax of each block; in
training, the authors' code's straight-through Gumbel choice: the hard one-hot of
argmax(log softmax(logits) + t g), g standard Gumbel noise, t `temperature`, forward, and
the gradient of softmax(logits) backward (one-hot + p - stop_gradient(p)). Per call, with
probability 1 - `hard_fraction`, the soft mask p itself is used instead (the code's
`quant_prob`, 0.3 there). With fewer rows than N at inference (one decoded token), only
the chosen d_ff / N rows of W1 and W2 are read (`SparseFeedForward.chosen`): a gather,
O(d_model d_ff / N) per token after the controller's O(d_model r + r d_ff), against the
dense layer's O(d_model d_ff) (`sparse_ffn_flops`).

Sparse QKV (section 3.2). d_model is cut into S modules of M = d_model / S. The
multiplicative dense layer computes y_{s,m} = sum_d x_d D_{d,s} E_{d,m} (D `[d_model, S]`,
E `[d_model, M]`, d_model (S + M) parameters instead of d_model^2), plus a bias; its output
`[length, S, M]` is read as an image of length x S pixels with M channels, and a 2-D
convolution of kernel `conv_length` x `conv_modules` (F x F, 3 x 3 in the paper) with M
output channels makes each of Q, K and V from it (one multiplicative layer shared, three
convolutions, as the authors' code). The convolution is causal over the positions (a
position reads itself and the `conv_length - 1` before it; zeros before the first) and
centred over the modules (zero padding), so a causal model stays causal and decodes with
a window of the last `conv_length - 1` multiplicative outputs (`SparseQKVState`). Rows
marked padding by a mask are zeros before the convolution, so they never reach a real
row. Attentions that take their keys from the queries (Reformer's LSH, `shared_qk`)
build no K convolution.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import Linear, _lift
from jxformers.validate import Limits, check_fields, defaults, setting

# How an attention module makes its queries, keys and values (the `Attention` setting `projection`).
PROJECTIONS = ("dense", "sparse")
# What follows the heads of a sparse-QKV attention: the dense W_O, or nothing (the authors' code's default).
OUTPUT_PROJECTIONS = ("dense", "none")


# ----------------------------------------------------------------------------- sparse FFN


@typing.no_type_check  # values come from users' YAML: check_fields names the key instead
@dataclasses.dataclass(frozen=True)
class SparseFFNConfig:
    """The Scaling Transformer's sparse FFN as a model config's `ffn` component
    (`ffn: {kind: sparse, block_size: 32}`), the `SparseFeedForward` constructor's
    settings. Defaults are the authors' code's (trax `SparseFF`, `ConfigurableTransformer`)."""

    kind: str = setting("sparse", "the Scaling Transformer's sparse FFN (Jaszczur et al. 2021)", choices=("sparse",))
    d_ff: int | None = setting(None, "hidden width (None: 4 d_model), a multiple of block_size", limits=1)
    block_size: int = setting(32, "N: the hidden units of a block, one of which is active per token", limits=1)
    controller_rank: int | None = setting(
        None, "the controller's low-rank width r (x C1 C2, C1 [d_model, r]) (None: d_ff / block_size, the "
        "authors' code)", limits=1,
    )  # fmt: skip
    temperature: float = setting(
        0.1, "training: the scale of the Gumbel noise added to the log-probabilities before each block's argmax "
        "(the authors' code's 0.1; 0: the argmax in training too)", limits=0,
    )  # fmt: skip
    hard_fraction: float = setting(
        1.0, "training: the probability per step of the hard straight-through mask; else the soft mask (all units, "
        "weighted by the controller's softmax; the authors' code's quant_prob, 0.3 there)",
        limits=Limits(above=0, maximum=1),
    )  # fmt: skip

    def __post_init__(self):
        check_fields(self, "ffn.")

    def check_model(self, *, d_model: int) -> None:
        """d_ff (4 d_model when unset) must be a whole number of blocks."""
        width = self.d_ff or 4 * d_model
        if width % self.block_size:
            raise ValueError(
                f"ffn 'sparse' cuts d_ff into blocks of block_size units: d_ff must be a multiple of block_size; "
                f"got d_ff {width}{'' if self.d_ff else ' (4 d_model)'}, block_size {self.block_size}"
            )

    def settings(self) -> dict:
        """The `SparseFeedForward` constructor's keywords (every setting but kind and d_ff)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("kind", "d_ff")}


# The SparseFeedForward constructor's defaults (read from SparseFFNConfig).
_DEFAULTS = defaults(SparseFFNConfig)


def rank_of(d_ff: int, block_size: int, controller_rank: int | None) -> int:
    """The controller's rank r: as given, or d_ff / N (the authors' code)."""
    return controller_rank or d_ff // block_size


def sparse_ffn_flops(d_model: int, d_ff: int, block_size: int, controller_rank: int | None = None) -> dict[str, int]:
    """Multiply-adds x 2 per token: the dense FFN's (W1 and W2, 4 d_model d_ff), and the
    sparse FFN's at inference, controller (2 r (d_model + d_ff)) plus the chosen units
    (4 d_model d_ff / N), with r = d_ff / N unless given."""
    rank = rank_of(d_ff, block_size, controller_rank)
    chosen = 4 * d_model * (d_ff // block_size)
    controller = 2 * rank * (d_model + d_ff)
    return {"dense": 4 * d_model * d_ff, "sparse": controller + chosen, "controller": controller, "units": chosen}


class SparseFeedForward(eqx.Module):
    """The sparse feed-forward layer (see the module docstring): relu(x W1 + b1) times a
    one-hot mask per block of N units that a low-rank controller chooses, then W2 + b2.

    Arguments (constructor): `d_model`, `d_ff` (a multiple of `block_size`), `block_size`
    (N), `controller_rank` (r; None: d_ff / N), `temperature` (the Gumbel noise's scale in
    training), `hard_fraction` (the probability per call of the hard mask in training),
    `dropout` (on the hidden units), `key`.

    `__call__(x, *, key=None, inference=False)`: `[seq, d_model] -> [seq, d_model]`. In
    training the noise and the hard-or-soft draw come from `key` (none without one: the
    argmax, straight-through). At inference the mask is the argmax; with fewer rows than N
    only the chosen units are computed (`chosen`), else the dense product is masked
    (`masked`): the same numbers. Per token, so causal."""

    w_in: Float[Array, "blocks block_size d_model"]  # W1, unit (b, i) is row [b, i]
    b_in: Float[Array, "blocks block_size"]
    w_out: Float[Array, "blocks block_size d_model"]  # W2, unit (b, i)'s output row
    b_out: Float[Array, " d_model"]
    controller_in: Linear  # C1, no bias
    controller_out: Linear  # C2 and the logits' bias
    dropout: eqx.nn.Dropout
    block_size: int = eqx.field(static=True)
    temperature: float = eqx.field(static=True)
    hard_fraction: float = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        block_size: int = _DEFAULTS["block_size"],
        controller_rank: int | None = _DEFAULTS["controller_rank"],
        temperature: float = _DEFAULTS["temperature"],
        hard_fraction: float = _DEFAULTS["hard_fraction"],
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if block_size < 1 or d_ff % block_size:
            raise ValueError(f"d_ff ({d_ff}) must be a positive multiple of block_size ({block_size})")
        if temperature < 0 or not 0 < hard_fraction <= 1:
            raise ValueError(
                f"temperature must be >= 0 and hard_fraction in (0, 1]; got {temperature}, {hard_fraction}"
            )
        blocks = d_ff // block_size
        rank = rank_of(d_ff, block_size, controller_rank)
        k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
        bound_in, bound_out = 1 / math.sqrt(d_model), 1 / math.sqrt(d_ff)  # as Linear's, for the dense layer's sizes
        shape = (blocks, block_size, d_model)
        self.w_in = jax.random.uniform(k1, shape, minval=-bound_in, maxval=bound_in)
        self.b_in = jax.random.uniform(k2, shape[:2], minval=-bound_in, maxval=bound_in)
        self.w_out = jax.random.uniform(k3, shape, minval=-bound_out, maxval=bound_out)
        self.b_out = jax.random.uniform(k4, (d_model,), minval=-bound_out, maxval=bound_out)
        self.controller_in = Linear(d_model, rank, use_bias=False, key=k5)
        self.controller_out = Linear(rank, d_ff, key=k6)
        self.dropout = eqx.nn.Dropout(dropout)
        self.block_size, self.temperature, self.hard_fraction = block_size, float(temperature), float(hard_fraction)

    @property
    def blocks(self) -> int:
        return self.w_in.shape[0]

    def logits(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq blocks block_size"]:
        """The controller's logits x C1 C2 + c, by block, in float32."""
        return self.controller_out(self.controller_in(x)).astype(jnp.float32).reshape(x.shape[0], self.blocks, -1)

    def choice(self, x: Float[Array, "seq d_model"]) -> Int[Array, "seq blocks"]:
        """The unit each block switches on at inference: the argmax of its logits."""
        return jnp.argmax(self.logits(x), axis=-1)

    def mask(
        self, x: Float[Array, "seq d_model"], *, key: PRNGKeyArray | None = None, inference: bool = False
    ) -> Float[Array, "seq blocks block_size"]:
        """The mask of each row's units: one-hot per block at inference; in training the
        straight-through Gumbel one-hot (value one-hot, gradient of the softmax), or, with
        probability 1 - hard_fraction per call, the softmax itself."""
        logits = self.logits(x)
        if inference:
            return jax.nn.one_hot(jnp.argmax(logits, -1), self.block_size, dtype=jnp.float32)
        log_p = jax.nn.log_softmax(logits, axis=-1)
        p = jnp.exp(log_p)
        noisy = log_p
        if key is not None and self.temperature > 0:
            noisy = log_p + self.temperature * jax.random.gumbel(jax.random.fold_in(key, 0), log_p.shape)
        hard = jax.nn.one_hot(jnp.argmax(noisy, -1), self.block_size, dtype=jnp.float32)
        mask = hard + p - jax.lax.stop_gradient(p)
        if key is not None and self.hard_fraction < 1:
            mask = jnp.where(jax.random.uniform(jax.random.fold_in(key, 1)) < self.hard_fraction, mask, p)
        return mask

    def __call__(
        self, x: Float[Array, "seq d_model"], *, key: PRNGKeyArray | None = None, inference: bool = False
    ) -> Float[Array, "seq d_model"]:
        if inference and x.shape[0] < self.block_size:  # the chosen rows of W1, W2 weigh less than all of them
            return self.chosen(x)
        k_mask, k_drop = (None, None) if key is None else jax.random.split(key)
        return self.masked(x, self.mask(x, key=k_mask, inference=inference), key=k_drop, inference=inference)

    def masked(
        self,
        x: Float[Array, "seq d_model"],
        mask: Float[Array, "seq blocks block_size"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = True,
    ) -> Float[Array, "seq d_model"]:
        """relu(x W1 + b1) * mask, then W2 + b2, with every unit computed (training, and
        inference over many rows). Dropout on the hidden units."""
        h = jnp.einsum("nd,bkd->nbk", x, self.w_in.astype(x.dtype)) + self.b_in.astype(x.dtype)[None]
        h = jax.nn.relu(h) * mask.astype(x.dtype)
        h = self.dropout(h, key=key, inference=inference)
        return jnp.einsum("nbk,bkd->nd", h, self.w_out.astype(x.dtype)) + _lift(self.b_out.astype(x.dtype), 2)

    def chosen(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq d_model"]:
        """The inference output computing only the chosen unit of each block: its row of
        W1 and of W2 gathered, O(d_model d_ff / N) per row after the controller."""
        idx = self.choice(x)  # [n, blocks]
        block = jnp.arange(self.blocks)[None]
        w_in, w_out = self.w_in[block, idx].astype(x.dtype), self.w_out[block, idx].astype(x.dtype)  # [n, blocks, d]
        h = jax.nn.relu(jnp.einsum("nd,nbd->nb", x, w_in) + self.b_in[block, idx].astype(x.dtype))
        return jnp.einsum("nb,nbd->nd", h, w_out) + _lift(self.b_out.astype(x.dtype), 2)


# ----------------------------------------------------------------------------- sparse QKV


def check_sparse_qkv(
    *,
    d_model: int,
    num_heads: int,
    kv_heads: int | None = None,
    d_head: int | None = None,
    modules: int | None = None,
    conv_length: int = 3,
    conv_modules: int = 3,
    where: str = "attention",
) -> int:
    """S (`modules`, None: num_heads) after ValueErrors for what the sparse QKV layer
    cannot make: its Q, K and V are each d_model wide, cut into the heads, so every head
    is of d_model / num_heads with no grouped keys; S divides d_model; the kernel over the
    modules is odd (centred)."""
    s = num_heads if modules is None else modules
    if d_head is not None and d_head * num_heads != d_model:
        raise ValueError(
            f"{where}.projection 'sparse' makes Q, K, V of d_model = {d_model} features, cut into the heads: "
            f"d_head must be unset or d_model / num_heads = {d_model // num_heads}; got d_head {d_head}"
        )
    if kv_heads not in (None, num_heads):
        raise ValueError(
            f"{where}.projection 'sparse' makes K and V as wide as Q: no grouped-query attention; got kv_heads "
            f"{kv_heads}, num_heads {num_heads}"
        )
    if s < 1 or d_model % s:
        raise ValueError(f"{where}.modules (S) must divide d_model = {d_model}; got {s}")
    if conv_length < 1 or conv_modules < 1 or conv_modules % 2 == 0:
        raise ValueError(
            f"{where}.conv_length must be >= 1 and conv_modules odd (centred over the modules); got "
            f"conv_length {conv_length}, conv_modules {conv_modules}"
        )
    return s


class MultiplicativeDense(eqx.Module):
    """The multiplicative dense layer: y_{s,m} = sum_d x_d D_{d,s} E_{d,m} + b_{s,m}
    (Jaszczur et al. eq. in section 3.2), `[seq, d_model] -> [seq, S, M]`, d_model (S + M)
    + S M parameters. D starts N(0, 0.5^2) (the authors' code), E uniform +-1/sqrt(d_model)."""

    gates: Float[Array, "d_model modules"]  # D
    kernel: Float[Array, "d_model module_size"]  # E
    bias: Float[Array, "modules module_size"]

    def __init__(self, d_model: int, modules: int, module_size: int, *, key: PRNGKeyArray):
        kd, ke = jax.random.split(key)
        bound = 1 / math.sqrt(d_model)
        self.gates = 0.5 * jax.random.normal(kd, (d_model, modules))
        self.kernel = jax.random.uniform(ke, (d_model, module_size), minval=-bound, maxval=bound)
        self.bias = jnp.zeros((modules, module_size), jnp.float32)

    def __call__(self, x: Float[Array, "seq d_model"]) -> Float[Array, "seq modules module_size"]:
        dt = x.dtype
        y = jnp.einsum("nd,ds,dm->nsm", x, self.gates.astype(dt), self.kernel.astype(dt))
        return y + self.bias.astype(dt)[None]


class ModuleConv(eqx.Module):
    """A 2-D convolution over (positions, modules) with M channels in and out: causal over
    the positions (its input comes with the `length - 1` earlier rows before the first
    output's), zero-padded and centred over the modules."""

    weight: Float[Array, "length width m_in m_out"]
    bias: Float[Array, " m_out"]

    def __init__(self, length: int, width: int, channels: int, *, key: PRNGKeyArray):
        bound = 1 / math.sqrt(length * width * channels)
        kw, kb = jax.random.split(key)
        self.weight = jax.random.uniform(kw, (length, width, channels, channels), minval=-bound, maxval=bound)
        self.bias = jax.random.uniform(kb, (channels,), minval=-bound, maxval=bound)

    def __call__(self, y: Float[Array, "rows modules m"]) -> Float[Array, "seq modules m"]:
        """`y`: the rows of `seq + length - 1` positions (the first `length - 1` earlier
        ones, or zeros); returns the `seq` outputs."""
        half = self.weight.shape[1] // 2
        padded = jnp.pad(y, ((0, 0), (half, half), (0, 0)))
        out = jax.lax.conv_general_dilated(
            padded[None], self.weight.astype(y.dtype), (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )[0]
        return out + self.bias.astype(y.dtype)[None, None]


class SparseQKVState(eqx.Module):
    """A sparse-QKV attention's decoding state: the last `conv_length - 1` multiplicative
    outputs (zeros before the first token) and the attention core's own state."""

    window: Float[Array, "w modules module_size"]
    inner: Any


class SparseQKV(eqx.Module):
    """The sparse QKV layer (see the module docstring): one `MultiplicativeDense` shared by
    Q, K and V, then a `ModuleConv` for each (no K convolution with `shared_qk`: the core
    takes its keys from the queries).

    `__call__(x, mask=None)`: `[seq, d_model]` -> (q, k or None, v), each `[seq, d_model]`;
    `mask` (True for real rows): padded rows are zeros before the convolutions. `step(x,
    window)`: one position against the window of earlier multiplicative outputs."""

    multiplicative: MultiplicativeDense
    q_conv: ModuleConv
    k_conv: ModuleConv | None
    v_conv: ModuleConv
    conv_length: int = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        modules: int,
        conv_length: int = 3,
        conv_modules: int = 3,
        shared_qk: bool = False,
        key: PRNGKeyArray,
    ):
        check_sparse_qkv(d_model=d_model, num_heads=1, modules=modules, conv_length=conv_length,
                         conv_modules=conv_modules)  # fmt: skip
        size = d_model // modules
        km, kq, kk, kv = jax.random.split(key, 4)
        self.multiplicative = MultiplicativeDense(d_model, modules, size, key=km)
        self.q_conv = ModuleConv(conv_length, conv_modules, size, key=kq)
        self.k_conv = None if shared_qk else ModuleConv(conv_length, conv_modules, size, key=kk)
        self.v_conv = ModuleConv(conv_length, conv_modules, size, key=kv)
        self.conv_length = conv_length

    def _convolve(self, rows, n: int) -> tuple[Array, Array | None, Array]:
        flat = lambda c: c(rows).reshape(n, -1)  # noqa: E731
        return flat(self.q_conv), None if self.k_conv is None else flat(self.k_conv), flat(self.v_conv)

    def __call__(
        self, x: Float[Array, "seq d_model"], mask: Bool[Array, " seq"] | None = None
    ) -> tuple[Float[Array, "seq d_model"], Float[Array, "seq d_model"] | None, Float[Array, "seq d_model"]]:
        y = self.multiplicative(x)
        if mask is not None:  # where, not a product: a padded row holding NaN stays out
            y = jnp.where(mask[:, None, None], y, jnp.zeros((), y.dtype))
        rows = jnp.pad(y, ((self.conv_length - 1, 0), (0, 0), (0, 0)))
        return self._convolve(rows, x.shape[0])

    def init_window(self, dtype=jnp.float32) -> Float[Array, "w modules module_size"]:
        """The empty decoding window: the zeros before the first position."""
        modules, size = self.multiplicative.bias.shape
        return jnp.zeros((self.conv_length - 1, modules, size), dtype)

    def step(
        self, x: Float[Array, " d_model"], window: Float[Array, "w modules module_size"]
    ) -> tuple[tuple[Array, Array | None, Array], Float[Array, "w modules module_size"]]:
        """((q, k or None, v) of one position, each `[1, d_model]`; the next window)."""
        rows = jnp.concatenate([window, self.multiplicative(x[None]).astype(window.dtype)])
        return self._convolve(rows.astype(x.dtype), 1), rows[1:]
