"""Lite Transformer (Wu, Liu, Lin, Lin & Han 2020, "Lite Transformer with Long-Short
Range Attention", ICLR; the authors' code, mit-han-lab/lite-transformer): `LiteBlock`,
whose Long-Short Range Attention (LSRA, section 3) splits the channels in two, one half
through multi-head attention (any registered attention) for the global context, the other
through a convolution for the local one, concatenated; then the flattened FFN (section
3: d_ff = d_model, no bottleneck). `SequenceConv` is the convolution branch as the
authors' `DynamicConv` with `conv_linear` and `glu`: Linear(c, 2c), GLU, a dynamic (or
lightweight) convolution (Wu, Fan, Baevski, Dauphin & Auli 2019, "Pay Less Attention
with Lightweight and Dynamic Convolutions"), Linear(c, c). `LiteStack` is its config
(`stack: {kind: lite}`).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers import registry
from jxformers.nn.attention import Attention
from jxformers.nn.cells import MixerCell, convolve, convolve_step
from jxformers.nn.layers import FeedForward, Linear, make_norm, split_key
from jxformers.nn.produced import Produced
from jxformers.validate import check_fields, setting

if TYPE_CHECKING:
    from jxformers.nn.config.model import ModelConfig

CONV_KINDS = ("dynamic", "lightweight")
# The authors' encoder_kernel_size_list and decoder_kernel_size_list (one per layer).
KERNEL_SIZES = (3, 7, 15, 31, 31, 31)


class SequenceConv(eqx.Module):
    """The convolution branch of LSRA on c channels (the authors' `DynamicConv1dTBC` with
    `with_linear` and `glu`): h = GLU(x W_1 + b_1) (`glu` False: x W_1 + b_1, c wide),
    then per position i and channel j of head h(j) = j // (c / H)

        y_{i,j} = sum_t w_{i,h,t} h_{i + t - p, j},   w_{i,h,:} = softmax(k_{i,h,:})

    with k = h W_k (`kind` dynamic: a kernel predicted from the position, no bias) or a
    learned k `[H, K]` (lightweight), p the left padding (K - 1 causal, (K - 1) // 2
    centred), zeros outside the sequence and on padded rows; then y W_2 + b_2. DropConnect
    (`dropout`) on the normalised kernel in training, as the authors' weight_dropout.

    Shapes: `__call__(x [n, c], mask [n])` -> `[n, c]`; `step(x [c], state [K - 1, c])` ->
    (`[c]`, state), causal only: the state holds the last K - 1 GLU outputs. Cost O(n K c).
    """

    linear1: Linear
    kernel_proj: Linear | None  # dynamic: c -> H K
    kernel: Float[Array, "heads taps"] | None  # lightweight
    linear2: Linear
    dropout: eqx.nn.Dropout
    heads: int = eqx.field(static=True)
    taps: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    glu: bool = eqx.field(static=True)

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        *,
        heads: int,
        kind: str = "dynamic",
        causal: bool,
        glu: bool = True,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if kind not in CONV_KINDS:
            raise ValueError(f"kind must be one of {CONV_KINDS}; got {kind!r}")
        if kernel_size < 1 or heads < 1 or channels % heads:
            raise ValueError(
                f"a convolution of kernel_size >= 1 over channels ({channels}) divisible by heads ({heads}); "
                f"got {kernel_size=}"
            )
        k1, k2, k3 = jax.random.split(key, 3)
        self.linear1 = Linear(channels, 2 * channels if glu else channels, key=k1)
        self.kernel_proj = Linear(channels, heads * kernel_size, use_bias=False, key=k2) if kind == "dynamic" else None
        bound = (6 / (kernel_size + heads * kernel_size)) ** 0.5  # Xavier's, as fairseq's [H, 1, K] weight
        drawn = jax.random.uniform(k2, (heads, kernel_size), minval=-bound, maxval=bound)
        self.kernel = None if kind == "dynamic" else drawn
        self.linear2 = Linear(channels, channels, key=k3)
        self.dropout = eqx.nn.Dropout(dropout)
        self.heads, self.taps, self.causal, self.glu = heads, kernel_size, causal, glu

    def _inputs(self, x):
        h = self.linear1(x)
        return jax.nn.glu(h, axis=-1) if self.glu else h

    def _weights(self, h, key, inference) -> Float[Array, "n heads taps"]:
        """Each position's normalised kernel (float32): predicted from its own input h
        (dynamic) or the learned one (lightweight)."""
        if self.kernel_proj is not None:
            logits = self.kernel_proj(h).reshape(h.shape[0], self.heads, self.taps)
        else:
            assert self.kernel is not None
            logits = jnp.broadcast_to(self.kernel, (h.shape[0], self.heads, self.taps))
        w = jax.nn.softmax(logits.astype(jnp.float32), -1)
        return self.dropout(w, key=key, inference=inference)

    def _conv(self, padded: Array, w: Array) -> Array:
        """y_i = sum_t w_{i,t} padded_{i+t} per head's channels; padded `[n + K - 1, c]`."""
        n, c = w.shape[0], padded.shape[1]
        windows = jnp.stack([padded[t : t + n] for t in range(self.taps)], -1)  # [n, c, K]
        windows = windows.reshape(n, self.heads, c // self.heads, self.taps).astype(jnp.float32)
        return jnp.einsum("nhrt,nht->nhr", windows, w).reshape(n, c).astype(padded.dtype)

    def __call__(
        self,
        x: Float[Array, "n c"],
        mask: Bool[Array, " n"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "n c"]:
        h = self._inputs(x)
        w = self._weights(h, key, inference)
        y = convolve(lambda padded: self._conv(padded, w), h, mask, self.taps, self.causal)
        return self.linear2(y)

    def init_state(self, dtype: Any) -> Float[Array, "taps1 c"]:
        """The decoding state: the last K - 1 GLU outputs, zeros at the start."""
        return jnp.zeros((self.taps - 1, self.linear2.weight.shape[0]), dtype)

    def step(self, x: Float[Array, " c"], state: Array) -> tuple[Float[Array, " c"], Array]:
        """One token of the causal convolution: (its output, the new state)."""
        if not self.causal:
            raise ValueError("a centred convolution reads later positions: only a causal one decodes")
        h = self._inputs(x[None])
        w = self._weights(h, None, True)
        y, state = convolve_step(lambda padded: self._conv(padded, w), h[0], state)
        return self.linear2(y[None])[0].astype(x.dtype), state


class LiteState(eqx.Module):
    """A `LiteBlock`'s decoding state: the attention's and the convolution's last K - 1 inputs."""

    attention: Any
    conv: Array


class LiteBlock(MixerCell):
    """Lite Transformer's block (Wu et al. 2020, section 3, Figure 3): with post-norm
    (the authors' code)

        h = N_1(x + dropout(LSRA(x))),   LSRA(x) = [Attn(x[:, :d/2]) ; Conv(x[:, d/2:])]
        y = N_2(h + dropout(FFN(h)))

    (pre-norm: x + dropout(LSRA(N_1(x))), ...). Attn is an `Attention` of `num_heads` heads
    on d/2 channels (its projections d/2 -> d/2), Conv a `SequenceConv` of the other half,
    and FFN the flattened feed-forward network (d_ff = d_model in the paper).

    Shapes: `[n, d_model]` -> `[n, d_model]`; decoding (causal): `LiteState`, the
    attention's state and the convolution's last K - 1 inputs. Cost: the attention's on
    d/2 plus O(n K d).
    """

    attention: Attention
    conv: SequenceConv

    def __init__(
        self,
        attention: registry.BoundAttention,
        d_model: int,
        num_heads: int,
        *,
        kernel_size: int,
        conv: str = "dynamic",
        conv_heads: int = 4,
        glu: bool = True,
        d_ff: int,
        ffn: str = "relu",
        causal: bool,
        norm: str = "layernorm",
        norm_eps: float | None = None,
        pre_norm: bool = False,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if d_model % 2:
            raise ValueError(f"LSRA splits the channels in two halves: d_model must be even; got {d_model}")
        ka, kc, kf = jax.random.split(key, 3)
        half = d_model // 2
        self.attention = Attention(attention, half, num_heads, causal=causal, key=ka)
        self.conv = SequenceConv(
            half, kernel_size, heads=conv_heads, kind=conv, causal=causal, glu=glu, dropout=dropout, key=kc
        )
        self.ffn = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kf)
        self.norms = (make_norm(norm, d_model, norm_eps), make_norm(norm, d_model, norm_eps))
        self.dropout = eqx.nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def mix(
        self,
        x: Float[Array, "n d_model"],
        mask: Bool[Array, " n"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "n d_model"], Produced]:
        """LSRA: the attention on the first d/2 channels, the convolution on the others,
        concatenated (and what the attention produced)."""
        ka, kc = split_key(key, 2)
        half = x.shape[-1] // 2
        noise = None if ka is None or inference else ka  # a core's own training noise (Sinkhorn's)
        a, produced = self.attention.apply(x[:, :half], kv_mask=mask, key=noise, inference=inference)
        c = self.conv(x[:, half:], mask, key=kc, inference=inference)
        return jnp.concatenate([a, c], -1), produced.under("attention")

    def init_decode_state(self, max_len: int, dtype) -> LiteState:
        return LiteState(self.attention.init_decode_state(max_len, dtype), self.conv.init_state(dtype))

    def mix_step(self, x: Float[Array, " d_model"], state: LiteState) -> tuple[Float[Array, " d_model"], LiteState]:
        half = x.shape[-1] // 2
        a, inner = self.attention.decode_step(x[:half], state.attention)
        c, window = self.conv.step(x[half:], state.conv)
        return jnp.concatenate([a, c]), LiteState(inner, window)


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class LiteStack:
    """Lite Transformer (Wu et al. 2020): `num_layers` LSRA blocks (`LiteBlock`), half the
    channels through the model's attention (any registered attention; `num_heads` heads
    of d_model / (2 num_heads)), half through a convolution of the layer's kernel size;
    the FFN is the model's with d_ff = d_model unless `ffn.d_ff` is set (the paper's
    flattened FFN). Post-norm by default (the authors' code)."""

    kind: str = setting("lite", "Lite Transformer's LSRA blocks", choices=("lite",))
    conv: str = setting(
        "dynamic", "the convolution branch: dynamic (kernels predicted per position, the authors' configs) or "
        "lightweight (one learned kernel per head) (Wu et al. 2019)", choices=CONV_KINDS,
    )  # fmt: skip
    kernel_sizes: tuple[int, ...] = setting(
        KERNEL_SIZES, "each layer's kernel size K (one value: every layer's; a longer list is cut to num_layers, "
        "as the authors' code)", limits=1,
    )  # fmt: skip
    conv_heads: int = setting(4, "H, the convolution's heads, each sharing one kernel (the authors': 4)", limits=1)
    glu: bool = setting(True, "a GLU on the convolution branch's input projection (the authors' encoder_glu)")

    def __post_init__(self):
        if isinstance(self.kernel_sizes, int) and not isinstance(self.kernel_sizes, bool):
            object.__setattr__(self, "kernel_sizes", (self.kernel_sizes,))
        check_fields(self, "stack.")
        if not self.kernel_sizes:
            raise ValueError("stack.kernel_sizes lists at least one kernel size; got ()")

    def kernel_size(self, layer: int) -> int:
        """Block `layer`'s kernel size."""
        sizes = self.kernel_sizes
        return sizes[0] if len(sizes) == 1 else sizes[layer]

    def check_model(self, config: ModelConfig) -> None:
        """The contracts of LSRA with the rest of the model (ModelConfig calls it)."""
        sizes, layers = self.kernel_sizes, config.num_layers
        if len(sizes) != 1 and len(sizes) < layers:
            raise ValueError(
                f"stack.kernel_sizes gives one kernel size per layer (or one for all): {len(sizes)} sizes "
                f"{list(sizes)} for num_layers {layers}"
            )
        half = config.d_model // 2
        if config.d_model % (2 * config.num_heads) or half % self.conv_heads:
            raise ValueError(
                f"stack 'lite' splits d_model ({config.d_model}) in two halves of {half}: the attention's num_heads "
                f"({config.num_heads}) and the convolution's conv_heads ({self.conv_heads}) must divide d_model / 2"
            )

    def blocks(self, config: ModelConfig, *, causal: bool, key: PRNGKeyArray) -> list[LiteBlock]:
        """The model's blocks."""
        ffn = config.ffn
        return [
            LiteBlock(
                config.bound_attention(i),
                config.d_model,
                config.num_heads,
                kernel_size=self.kernel_size(i),
                conv=self.conv,
                conv_heads=self.conv_heads,
                glu=self.glu,
                d_ff=getattr(ffn, "d_ff", None) or config.d_model,
                ffn=ffn.kind,
                causal=causal,
                norm=config.norm.kind,
                norm_eps=config.norm.eps,
                pre_norm=config.norm.placement == "pre",
                dropout=config.dropout,
                key=k,
            )  # fmt: skip
            for i, k in enumerate(jax.random.split(key, config.num_layers))
        ]
