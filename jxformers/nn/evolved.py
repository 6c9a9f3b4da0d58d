"""The Evolved Transformer (So, Liang & Le 2019, "The Evolved Transformer", ICML; Figure
3 and the authors' tensor2tensor code, models/evolved_transformer.py): the encoder and
decoder cells found by architecture search, each a stack of pre-norm residual branches
(t2t's layer_preprocess "n", layer_postprocess "da").

* `EvolvedEncoderCell` (d = d_model): a gated linear unit, x + V(N(x)) ⊙ σ(G(N(x)));
  then two branches of N(x), ReLU(1x1 dense to 4d) + ReLU(3x1 convolution to d/2, zero
  padded to 4d), summed, normalised, a 9x1 separable convolution to d/2 (zero padded to
  d), added to x; then self-attention (num_heads heads) and a 4d ReLU FFN.
* `EvolvedDecoderCell`: x + the wide-head self-attention (16 heads), beside it, in an
  encoder-decoder, the first attend-to-encoder attention (num_heads heads) on the same
  N(x); then two branches of N(x), ReLU(11x1 separable convolution to 2d) + 7x1
  separable convolution to d/2 (zero padded to 2d), summed, normalised, a 7x1 separable
  convolution to d, added to x; then self-attention (num_heads heads), in an
  encoder-decoder the second attend-to-encoder attention, and a swish FFN with a norm on
  its 4d hidden layer. Its convolutions are causal (left padding k - 1): decoding holds
  the last 10 inputs of the first two and the last 6 of the third, and, in an
  encoder-decoder, the encoder's keys and values projected once (`project_context`).

`SeparableConv` is t2t's SeparableConv1D (a depthwise kernel, no bias, then a pointwise
dense layer with its bias), `Conv` a standard 1-D convolution. `EvolvedStack` is the
config (`stack: evolved`): encoder cells for tasks classify and retrieval, decoder cells
for lm, both for seq2seq (the paper's translation model).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers import registry
from jxformers.nn.attention import Attention
from jxformers.nn.cells import Cell, check_own_ffn, convolve, convolve_step, depthwise, sublayer
from jxformers.nn.layers import Linear, Norm, make_norm, normalise, split_key
from jxformers.nn.produced import Produced
from jxformers.validate import check_fields, setting

if TYPE_CHECKING:
    from jxformers.nn.config.model import ModelConfig

# The searched cells' kernel sizes: encoder 3x1 and 9x1, decoder 11x1 and 7x1 (Figure 3).
ENCODER_KERNELS = (3, 9)
DECODER_KERNELS = (11, 7)
WIDE_HEADS = 16  # the decoder's first self-attention: max(16, num_heads) heads in t2t


def _draw(key, shape, fan_in: int):
    bound = 1 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, minval=-bound, maxval=bound)


class SeparableConv(eqx.Module):
    """A depthwise-separable convolution over the positions (t2t's SeparableConv1D,
    depth multiplier 1): z_i = sum_t w_t ⊙ x_{i + t - p} (`depth` `[k, c_in]`, no bias),
    then y_i = z_i P + b (`pointwise` c_in -> c_out); p = k - 1 causal, (k - 1) // 2
    centred; zeros outside the sequence and on padded rows.

    Shapes: `__call__(x [n, c_in], mask)` -> `[n, c_out]`; `rows(padded [m, c_in])` ->
    `[m - k + 1, c_out]` (a decoding step's window). Parameters: k c_in + c_in c_out + c_out.
    """

    depth: Float[Array, "kernel c_in"]
    pointwise: Linear
    causal: bool = eqx.field(static=True)

    def __init__(self, c_in: int, c_out: int, kernel: int, *, causal: bool, key: PRNGKeyArray):
        kd, kp = jax.random.split(key)
        self.depth = _draw(kd, (kernel, c_in), kernel)
        self.pointwise = Linear(c_in, c_out, key=kp)
        self.causal = causal

    @property
    def kernel(self) -> int:
        return self.depth.shape[0]

    def rows(self, padded: Float[Array, "m c_in"]) -> Float[Array, "n c_out"]:
        return self.pointwise(depthwise(padded, self.depth))

    def __call__(self, x: Float[Array, "n c_in"], mask: Bool[Array, " n"] | None = None) -> Float[Array, "n c_out"]:
        return convolve(self.rows, x, mask, self.kernel, self.causal)


class Conv(eqx.Module):
    """A standard convolution over the positions (t2t's Conv1D, padding "SAME"): y_i =
    b + sum_t x_{i + t - (k - 1) // 2} W_t, W `[k, c_in, c_out]`, zeros outside the
    sequence and on padded rows. Parameters: k c_in c_out + c_out."""

    weight: Float[Array, "kernel c_in c_out"]
    bias: Float[Array, " c_out"]

    def __init__(self, c_in: int, c_out: int, kernel: int, *, key: PRNGKeyArray):
        kw, kb = jax.random.split(key)
        self.weight, self.bias = _draw(kw, (kernel, c_in, c_out), kernel * c_in), _draw(kb, (c_out,), kernel * c_in)

    def rows(self, padded: Float[Array, "m c_in"]) -> Float[Array, "n c_out"]:
        k = self.weight.shape[0]
        n = padded.shape[0] - k + 1
        w = self.weight.astype(padded.dtype)
        return sum((padded[t : t + n] @ w[t] for t in range(k)), self.bias.astype(padded.dtype)[None])

    def __call__(self, x: Float[Array, "n c_in"], mask: Bool[Array, " n"] | None = None) -> Float[Array, "n c_out"]:
        return convolve(self.rows, x, mask, self.weight.shape[0], False)


def _widen(x: Array, width: int) -> Array:
    """x zero padded on the features to `width` (t2t's tf.pad of the narrower branch)."""
    return jnp.pad(x, ((0, 0), (0, width - x.shape[-1])))


class _Common(Cell):
    """What both cells hold: their norms (one per normalised input), dropout, and the
    residual sublayers around their branches."""

    norms: tuple[Norm, ...]
    dropout: eqx.nn.Dropout

    def _sub(self, x, f, index: int, key, inference, mask):
        return sublayer(
            x, f, self.norms[index], pre_norm=True, dropout=self.dropout, key=key, inference=inference, mask=mask
        )

    def _attend(self, attention: Attention, name: str, mask, key, inference, context=None):
        """h -> (attention of h, what it produced under `name`); keys and values from
        `context` (`[ctx, d_model]`, `mask` its padding) when given, from h otherwise."""
        noise = None if key is None or inference else jax.random.fold_in(key, 1)

        def f(h):
            y, produced = attention.apply(h, context, kv_mask=mask, key=noise, inference=inference)
            return y, produced.under(name)

        return f


class EvolvedEncoderCell(_Common):
    """The Evolved Transformer's encoder cell (So et al. 2019, Figure 3 left; t2t's
    evolved_transformer_encoder), d = d_model, every branch's input N_i(x):

        x = x + dropout(V h ⊙ σ(G h))                                  (GLU, h = N_0(x))
        s = dropout(ReLU(h W_L)) + pad_4d(dropout(ReLU(Conv3x1(h))))    (h = N_1(x): 4d, d/2)
        x = x + dropout(pad_d(SepConv9x1(N_2(s))))                       (4d -> d/2)
        x = x + dropout(Attn(N_3(x)))                                    (num_heads heads)
        x = x + dropout(W_2 dropout(ReLU(W_1 N_4(x))))                   (4d)

    Padded rows enter the convolutions as zeros (t2t multiplies by the non-padding mask).
    Shapes: `[n, d_model]` -> `[n, d_model]`; non-causal (no decoding).
    """

    values: Linear
    gates: Linear
    left: Linear
    right: Conv
    sep9: SeparableConv
    attention: Attention
    ffn_in: Linear
    ffn_out: Linear

    def __init__(
        self,
        attention: registry.BoundAttention,
        d_model: int,
        num_heads: int,
        *,
        norm: str = "layernorm",
        norm_eps: float | None = None,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        d = d_model
        ks = jax.random.split(key, 8)
        self.values, self.gates = Linear(d, d, key=ks[0]), Linear(d, d, key=ks[1])
        self.left = Linear(d, 4 * d, key=ks[2])
        self.right = Conv(d, d // 2, ENCODER_KERNELS[0], key=ks[3])
        self.sep9 = SeparableConv(4 * d, d // 2, ENCODER_KERNELS[1], causal=False, key=ks[4])
        self.attention = Attention(attention, d, num_heads, key=ks[5])
        self.ffn_in, self.ffn_out = Linear(d, 4 * d, key=ks[6]), Linear(4 * d, d, key=ks[7])
        widths = (d, d, 4 * d, d, d)
        self.norms = tuple(make_norm(norm, w, norm_eps) for w in widths)
        self.dropout = eqx.nn.Dropout(dropout)

    def _forward(self, x, mask, *, key, inference):
        ks = split_key(key, 9)
        d = x.shape[-1]
        drop = lambda v, k: self.dropout(v, key=k, inference=inference)  # noqa: E731

        def glu(h):
            return self.values(h) * jax.nn.sigmoid(self.gates(h)), Produced()

        def branches(h):
            left = drop(jax.nn.relu(self.left(h)), ks[1])
            right = drop(jax.nn.relu(self.right(h, mask)), ks[2])
            s = normalise(self.norms[2], left + _widen(right, 4 * d), mask)
            return _widen(self.sep9(s, mask), d), Produced()

        def ffn(h):
            return self.ffn_out(drop(jax.nn.relu(self.ffn_in(h)), ks[7])), Produced()

        x, _ = self._sub(x, glu, 0, ks[0], inference, mask)
        x, _ = self._sub(x, branches, 1, ks[3], inference, mask)
        x, produced = self._sub(x, self._attend(self.attention, "attention", mask, ks[4], inference), 3, ks[5],
                                inference, mask)  # fmt: skip
        x, _ = self._sub(x, ffn, 4, ks[8], inference, mask)
        return x, produced


class EvolvedDecoderState(eqx.Module):
    """An `EvolvedDecoderCell`'s decoding state: its two self-attentions' states, the last
    10 normalised inputs of the 11x1 and first 7x1 convolutions, the last 6 of the second
    7x1. (The encoder's keys and values are the model's context, `project_context`.)"""

    wide: Any
    attention: Any
    inputs: Array
    mid: Array


class EvolvedDecoderCell(_Common):
    """The Evolved Transformer's decoder cell (So et al. 2019, Figure 3 right; t2t's
    evolved_transformer_decoder), d = d_model, causal convolutions, e the encoder's output:

        h = N_0(x)
        x = x + dropout(Attn_16(h)) [+ dropout(Enc_1(h, e))]            (wide_heads; num_heads)
        s = dropout(ReLU(SepConv11x1(h))) + pad_2d(dropout(SepConv7x1(h)))   (h = N_1(x): 2d, d/2)
        x = x + dropout(SepConv7x1(N_2(s)))                              (2d -> d)
        x = x + dropout(Attn(N_3(x)))                                    (num_heads heads)
        [x = x + dropout(Enc_2(N_6(x), e))]                              (num_heads heads)
        x = x + dropout(W_2 N_5(dropout(swish(W_1 N_4(x)))))             (4d)

    The bracketed attend-to-encoder branches (`first_encoder`, `second_encoder`: queries
    from the decoder, keys and values from e under the encoder's padding mask) exist in
    an encoder-decoder's cell (`cross_attention` given) and are absent in a language
    model's. The first sits beside the 16-head self-attention on the same normalised
    input, each branch with its own dropout, as the paper's Figure 3 and t2t's code.

    Shapes: `[n, d_model]` (context `[ctx, d_model]`) -> `[n, d_model]`; decoding:
    `EvolvedDecoderState` plus `project_context`'s keys and values. The self-attentions
    are causal whenever the cell is (`causal`).
    """

    wide: Attention
    first_encoder: Attention | None
    sep11: SeparableConv
    sep7: SeparableConv
    sep7_out: SeparableConv
    attention: Attention
    second_encoder: Attention | None
    ffn_in: Linear
    ffn_out: Linear

    def __init__(
        self,
        attention: registry.BoundAttention,
        d_model: int,
        num_heads: int,
        *,
        wide_heads: int = WIDE_HEADS,
        causal: bool = True,
        cross_attention: registry.BoundAttention | None = None,
        norm: str = "layernorm",
        norm_eps: float | None = None,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        """`cross_attention`: the attention of the two attend-to-encoder branches (one
        that can cross-attend), None for a language model's cell (no branches)."""
        d = d_model
        ks = jax.random.split(key, 7)
        self.wide = Attention(attention, d, wide_heads, causal=causal, key=ks[0])
        self.sep11 = SeparableConv(d, 2 * d, DECODER_KERNELS[0], causal=causal, key=ks[1])
        self.sep7 = SeparableConv(d, d // 2, DECODER_KERNELS[1], causal=causal, key=ks[2])
        self.sep7_out = SeparableConv(2 * d, d, DECODER_KERNELS[1], causal=causal, key=ks[3])
        self.attention = Attention(attention, d, num_heads, causal=causal, key=ks[4])
        self.ffn_in, self.ffn_out = Linear(d, 4 * d, key=ks[5]), Linear(4 * d, d, key=ks[6])
        widths = (d, d, 2 * d, d, d, 4 * d)
        self.first_encoder = self.second_encoder = None
        if cross_attention is not None:  # keys drawn apart, so a language model's cell keeps its draw
            k1, k2 = jax.random.split(jax.random.fold_in(key, 7))
            self.first_encoder = Attention(cross_attention, d, num_heads, cross=True, key=k1)
            self.second_encoder = Attention(cross_attention, d, num_heads, cross=True, key=k2)
            widths += (d,)  # N_6, the second attend-to-encoder branch's
        self.norms = tuple(make_norm(norm, w, norm_eps) for w in widths)
        self.dropout = eqx.nn.Dropout(dropout)

    @property
    def cross_attention(self) -> Attention | None:
        """The first attend-to-encoder attention (None in a language model's cell)."""
        return self.first_encoder

    def project_context(self, context: Float[Array, "ctx d_model"]) -> tuple[tuple[Array, Array], tuple[Array, Array]]:
        """The keys and values of both attend-to-encoder branches, computed once for decoding."""
        if self.first_encoder is None or self.second_encoder is None:
            raise ValueError("this EvolvedDecoderCell has no attend-to-encoder branches (a language model's cell)")
        return self.first_encoder.project_context(context), self.second_encoder.project_context(context)

    def _mid(self, left, right, width, mask=None):
        return normalise(self.norms[2], left + _widen(right, width), mask)

    def _ffn(self, h, key, inference):
        h = self.dropout(jax.nn.silu(self.ffn_in(h)), key=key, inference=inference)
        return self.ffn_out(normalise(self.norms[5], h, None))

    def _forward(self, x, mask, *, key, inference):
        return self._forward_with_context(x, mask, None, None, key=key, inference=inference)

    def _forward_with_context(self, x, mask, context, context_mask, *, key, inference):
        ks = split_key(key, 8)
        # the attend-to-encoder branches' keys (0-3) and the FFN output's dropout key (4)
        ke = split_key(None if key is None else jax.random.fold_in(key, 8), 5)
        d = x.shape[-1]
        drop = lambda v, k: self.dropout(v, key=k, inference=inference)  # noqa: E731

        def branches(h):
            left = drop(jax.nn.relu(self.sep11(h, mask)), ks[2])
            right = drop(self.sep7(h, mask), ks[3])
            return self.sep7_out(self._mid(left, right, 2 * d, mask), mask), Produced()

        h = normalise(self.norms[0], x, mask)  # the first branch pair's one input
        y, produced = self._attend(self.wide, "wide", mask, ks[0], inference)(h)
        x = x + drop(y, ks[1])
        if self.first_encoder is not None:
            y, made = self._attend(self.first_encoder, "first_encoder", context_mask, ke[0], inference, context)(h)
            x, produced = x + drop(y, ke[1]), produced + made
        x, _ = self._sub(x, branches, 1, ks[4], inference, mask)
        x, more = self._sub(x, self._attend(self.attention, "attention", mask, ks[5], inference), 3, ks[6],
                            inference, mask)  # fmt: skip
        produced = produced + more
        if self.second_encoder is not None:
            attend = self._attend(self.second_encoder, "second_encoder", context_mask, ke[2], inference, context)
            x, more = self._sub(x, attend, 6, ke[3], inference, mask)
            produced = produced + more
        x, _ = self._sub(x, lambda h: (self._ffn(h, ks[7], inference), Produced()), 4, ke[4], inference, mask)
        return x, produced

    def init_decode_state(self, max_len: int, dtype) -> EvolvedDecoderState:
        d = self.ffn_in.weight.shape[1]
        return EvolvedDecoderState(
            self.wide.init_decode_state(max_len, dtype),
            self.attention.init_decode_state(max_len, dtype),
            jnp.zeros((DECODER_KERNELS[0] - 1, d), dtype),
            jnp.zeros((DECODER_KERNELS[1] - 1, 2 * d), dtype),
        )

    def _step(self, x, state: EvolvedDecoderState) -> tuple[Array, EvolvedDecoderState]:
        return self._step_with_context(x, state, None, None)

    def _step_with_context(self, x, state: EvolvedDecoderState, context_kv, context_mask):
        made = {}
        d = x.shape[-1]
        common = dict(key=None, inference=True, mask=None)

        def branches(h):
            window = jnp.concatenate([state.inputs, h.astype(state.inputs.dtype)])  # the last 11 inputs
            made["inputs"] = window[1:]
            left = jax.nn.relu(self.sep11.rows(window))
            right = self.sep7.rows(window[-DECODER_KERNELS[1] :])
            s = self._mid(left, right, 2 * d)
            y, made["mid"] = convolve_step(self.sep7_out.rows, s[0], state.mid)
            return y[None], Produced()

        def attend(h):
            y, made["attention"] = self.attention.decode_step(h[0], state.attention)
            return y[None], Produced()

        def encoder(attention: Attention, kv):
            return lambda h: (attention.cross_step(h[0], *kv, kv_mask=context_mask)[None], Produced())

        h = normalise(self.norms[0], x[None], None)
        y, wide = self.wide.decode_step(h[0], state.wide)
        if self.first_encoder is not None:
            y = y + encoder(self.first_encoder, context_kv[0])(h)[0][0]
        h = x[None] + y[None]
        h, _ = self._sub(h, branches, 1, **common)
        h, _ = self._sub(h, attend, 3, **common)
        if self.second_encoder is not None:
            h, _ = self._sub(h, encoder(self.second_encoder, context_kv[1]), 6, **common)
        h, _ = self._sub(h, lambda v: (self._ffn(v, None, True), Produced()), 4, **common)
        new = EvolvedDecoderState(wide, made["attention"], made["inputs"], made["mid"])
        return h[0], new


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class EvolvedStack:
    """The Evolved Transformer (So et al. 2019): `num_layers` searched cells, the encoder
    cell (`EvolvedEncoderCell`) for tasks classify and retrieval, the decoder cell
    (`EvolvedDecoderCell`, causal convolutions) for lm, and for seq2seq the paper's
    translation model: `num_layers` encoder cells and `decoder.num_layers` decoder cells
    with their two attend-to-encoder branches (the attention `decoder.cross_attention`).
    Every self-attention in them is the model's (any registered attention), with
    num_heads heads and the decoder's first one with `wide_heads`. Pre-norm, as the
    authors' code; the cells hold their own FFNs, so the model's ffn stays at its default."""

    kind: str = setting("evolved", "the Evolved Transformer's cells", choices=("evolved",))
    wide_heads: int = setting(
        WIDE_HEADS, "heads of the decoder cell's first self-attention (the paper's 16; t2t: max(16, num_heads))",
        limits=1,
    )  # fmt: skip

    def __post_init__(self):
        check_fields(self, "stack.")

    def check_model(self, config: ModelConfig) -> None:
        """The cells' contracts with the rest of the model (ModelConfig calls it)."""
        d = config.d_model
        decoder = config.task in ("lm", "seq2seq")
        if d % 2 or d % config.num_heads or (decoder and d % self.wide_heads):
            raise ValueError(
                f"stack 'evolved' needs an even d_model (its d/2 branches) divisible by num_heads ({config.num_heads})"
                f" and, for the decoder cell (tasks lm, seq2seq), by wide_heads ({self.wide_heads}); got d_model {d}"
            )
        check_own_ffn(config, "the cells' own FFNs (4d ReLU in the encoder, 4d swish with a norm in the decoder)")
        if config.norm.placement != "pre":
            raise ValueError(
                f"stack 'evolved' is pre-norm (every branch reads N(x), as the searched cells): norm.placement 'pre'; "
                f"got {config.norm.placement!r}"
            )
        if config.decoder is not None and not config.decoder.ffn:
            raise ValueError(
                "stack 'evolved': decoder.ffn false drops a transformer decoder block's FFN (Yang et al. 2020); the "
                "decoder cell's swish dense layers are part of its searched structure: leave decoder.ffn true"
            )

    def blocks(
        self, config: ModelConfig, *, causal: bool, key: PRNGKeyArray, count: int | None = None, cross: bool = False
    ) -> list[EvolvedDecoderCell] | list[EvolvedEncoderCell]:
        """The model's cells: decoder cells when causal (with their attend-to-encoder
        branches when `cross`: a seq2seq decoder's), encoder cells otherwise; `count`
        cells (None: num_layers)."""
        count = config.num_layers if count is None else count
        keys = jax.random.split(key, count)
        norm, eps, dropout = config.norm.kind, config.norm.eps, config.dropout
        if causal:
            return [
                EvolvedDecoderCell(
                    config.bound_attention(i),
                    config.d_model,
                    config.num_heads,
                    wide_heads=self.wide_heads,
                    cross_attention=config.bound_cross_attention() if cross else None,
                    norm=norm,
                    norm_eps=eps,
                    dropout=dropout,
                    key=k,
                )  # fmt: skip
                for i, k in enumerate(keys)
            ]
        return [
            EvolvedEncoderCell(
                config.bound_attention(i),
                config.d_model,
                config.num_heads,
                norm=norm,
                norm_eps=eps,
                dropout=dropout,
                key=k,
            )  # fmt: skip
            for i, k in enumerate(keys)
        ]
