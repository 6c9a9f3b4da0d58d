"""DeLighT (Mehta, Ghazvininejad, Iyer, Zettlemoyer & Hajishirzi 2021, "DeLighT: Deep
and Light-weight Transformer", ICLR; the authors' code, sacmehta/delight):

* `GroupLinear`: a group linear transformation (GLT): the input split into g groups, each
  mapped by its own matrix (N M / g weights for N inputs and M outputs), the outputs
  shuffled across groups (feature shuffling, ShuffleNet's channel shuffle), each group
  normalised (LayerNorm over M / g) and activated (swish).
* `DExTra`: the expand-reduce transformation (section 3.1, eq. 1): N GLT layers, the
  first ceil(N/2) widening the input towards w_m d_m, the rest narrowing it to d_o = d_m
  / 2; every layer after the first reads the input mixer H(X, Y^{l-1}), the input X and
  the previous output each split into the layer's g groups and concatenated group by
  group.
* `DelightBlock`: DExTra, single-head attention in d_o (its output projected back to
  d_m), the light-weight FFN (d_m -> d_m / r -> d_m), each a residual sublayer.
* `DelightStack`: the config (`stack: {kind: delight}`), with block-wise scaling (section
  3.3, eq. 4): block b of B has N^b = N_min + (N_max - N_min) b / (B - 1) GLT layers
  (floored, as the authors' code) and width multiplier w_m^b = w_m + (N_max - N_min) b /
  (N_min (B - 1)).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from jxformers import registry
from jxformers.nn.attention import Attention
from jxformers.nn.cells import MixerCell, check_own_ffn
from jxformers.nn.layers import FeedForward, LayerNorm, Linear, make_norm
from jxformers.nn.produced import AttentionInputs, Produced
from jxformers.validate import check_fields, setting

if TYPE_CHECKING:
    from jxformers.nn.config.model import ModelConfig

# The authors' code: GLT widths are multiples of 8 ("to maximize tensor usage") and of
# the groups on both sides; MIN_ELEMENTS_PER_GROUP sets the default g_max.
WIDTH_MULTIPLE = 8
MIN_ELEMENTS_PER_GROUP = 32


def glt_groups(depth: int, max_groups: int) -> tuple[int, ...]:
    """g^l of DExTra's N = `depth` layers (eq. 2): min(2^(l-1), g_max) for l <= ceil(N/2),
    then mirrored, g^l = g^(N+1-l), so that the reduction undoes the expansion's groups
    (the paper's g^(N-l) would reach g^0 at l = N)."""
    mid = math.ceil(depth / 2)
    first = [min(2 ** (layer - 1), max_groups) for layer in range(1, mid + 1)]
    return tuple(first + first[: depth - mid][::-1])


def dextra_sizes(d_in: int, d_out: int, d_max: int, depth: int, max_groups: int) -> dict[str, tuple[int, ...]]:
    """Each GLT layer's input width, output width and groups (the authors' dextra_config,
    with `glt_groups`): outputs spaced linearly from d_in to d_max over the ceil(N/2)
    expansion layers and back, the last d_out; each rounded up to a multiple of 8 and of
    the groups on both sides; layer l + 1 reads its input mixer, out^l + d_in wide."""
    groups = glt_groups(depth, max_groups)
    mid = math.ceil(depth / 2)
    rising = np.linspace(d_in, d_max, mid).astype(int).tolist()
    falling = rising[::-1] if depth % 2 == 0 else rising[::-1][1:]
    outs = (rising + falling)[: depth - 1]
    ins = [d_in]
    for i in range(depth - 1):
        g = max(groups[i], groups[i + 1], WIDTH_MULTIPLE)
        outs[i] = -(-outs[i] // g) * g
        ins.append(outs[i] + d_in)
    return {"in": tuple(ins), "out": (*outs, d_out), "groups": groups}


class GroupLinear(eqx.Module):
    """A group linear transformation (Mehta et al. 2021, section 3.1; the authors'
    `GroupLinear`): x `[N]` split into g groups x_k `[N/g]`, y_k = x_k W_k + b_k `[M/g]`;
    with `shuffle` (g > 1) the outputs are interleaved, y' = reshape(transpose(y [g, M/g]),
    [g, M/g]) (ShuffleNet's channel shuffle); then LayerNorm over each group's M/g
    features (one gain and bias shared by the groups) and swish. Weights drawn as Xavier
    uniform, biases 0 (the authors'). Parameters: N M / g + M + 2 M / g.

    Shapes: `[n, N]` -> `[n, M]`.
    """

    weight: Float[Array, "groups d_in d_out"]
    bias: Float[Array, "groups d_out"]
    norm: LayerNorm
    shuffle: bool = eqx.field(static=True)

    def __init__(self, d_in: int, d_out: int, groups: int, *, shuffle: bool = True, key: PRNGKeyArray):
        if d_in % groups or d_out % groups:
            raise ValueError(f"a GLT splits its {d_in} inputs and {d_out} outputs into {groups} groups: not divisible")
        i, o = d_in // groups, d_out // groups
        bound = math.sqrt(6 / (i * o + groups * o)) if groups > 1 else math.sqrt(6 / (d_in + d_out))
        self.weight = jax.random.uniform(key, (groups, i, o), minval=-bound, maxval=bound)
        self.bias = jnp.zeros((groups, o), jnp.float32)
        self.norm = LayerNorm(o)
        self.shuffle = shuffle and groups > 1

    @property
    def groups(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: Float[Array, "n d_in"]) -> Float[Array, "n d_out"]:
        n, g = x.shape[0], self.groups
        y = jnp.einsum("ngi,gio->ngo", x.reshape(n, g, -1), self.weight.astype(x.dtype))
        y = y + self.bias.astype(x.dtype)[None]
        if self.shuffle:
            y = y.transpose(0, 2, 1).reshape(n, g, -1)
        return jax.nn.silu(self.norm(y)).reshape(n, -1)


def mix(x: Float[Array, "n a"], y: Float[Array, "n b"], groups: int) -> Float[Array, "n ab"]:
    """DExTra's input mixer H(X, Y) (the authors' split-and-mix): X and Y each split into
    `groups` groups, group k of the result [X_k ; Y_k]."""
    n = x.shape[0]
    return jnp.concatenate([x.reshape(n, groups, -1), y.reshape(n, groups, -1)], -1).reshape(n, -1)


class _Dense(eqx.Module):
    """A linear layer, LayerNorm and swish: DExTra's input and output layers (the
    authors' `get_weight_layer('linear', norm_type='ln', act_type='swish')`)."""

    linear: Linear
    norm: LayerNorm

    def __init__(self, d_in: int, d_out: int, *, key: PRNGKeyArray):
        self.linear, self.norm = Linear(d_in, d_out, key=key), LayerNorm(d_out)

    def __call__(self, x: Float[Array, "n d_in"]) -> Float[Array, "n d_out"]:
        return jax.nn.silu(self.norm(self.linear(x)))


class DExTra(eqx.Module):
    """The DeLighT transformation (Mehta et al. 2021, section 3.1, eq. 1; the authors'
    `DExTraUnit`): X = dense(x) (d_m -> d_m / 2, the code's input layer), then N GLT
    layers, Y^1 = F(X, g^1) and Y^l = F(H(X, Y^(l-1)), g^l), widths from `dextra_sizes`
    (expanding to w_m d_m, reducing to d_o), and the output layer dense([X ; Y^N]) -> d_o.

    Shapes: `[n, d_model]` -> `[n, d_out]`; cost per token the parameter count (N M / g
    per GLT).
    """

    input_layer: _Dense
    layers: tuple[GroupLinear, ...]
    output_layer: _Dense

    def __init__(
        self, d_model: int, d_out: int, *, depth: int, width_mult: float, max_groups: int, shuffle: bool = True,
        key: PRNGKeyArray,
    ):  # fmt: skip
        if depth < 2 or d_model % 2:
            raise ValueError(f"DExTra needs depth N >= 2 and an even d_model; got {depth=}, {d_model=}")
        d_in = d_model // 2
        sizes = dextra_sizes(d_in, d_out, int(d_model * width_mult), depth, max_groups)
        ki, kl, ko = jax.random.split(key, 3)
        self.input_layer = _Dense(d_model, d_in, key=ki)
        self.layers = tuple(
            GroupLinear(i, o, g, shuffle=shuffle, key=k)
            for i, o, g, k in zip(sizes["in"], sizes["out"], sizes["groups"], jax.random.split(kl, depth), strict=True)
        )
        self.output_layer = _Dense(d_out + d_in, d_out, key=ko)

    def __call__(self, x: Float[Array, "n d_model"]) -> Float[Array, "n d_out"]:
        x = self.input_layer(x)
        y = self.layers[0](x)
        for layer in self.layers[1:]:
            y = layer(mix(x, y, layer.groups))
        return self.output_layer(jnp.concatenate([x, y], -1))


class DelightBlock(MixerCell):
    """DeLighT's block (Mehta et al. 2021, section 3.2, Figure 1b; post-norm as the
    authors' code, pre-norm on request):

        h = N_1(x + dropout(Attn(DExTra(x))))     (Attn: one head in d_o, output -> d_m)
        y = N_2(h + dropout(W_2 swish(W_1 h)))    (the light-weight FFN, d_m / r wide)

    The attention is any registered attention with one head of d_o = d_m / 2 (its q, k
    and v projections d_o -> d_o, the output d_o -> d_m).

    Shapes: `[n, d_model]` -> `[n, d_model]`; decoding (causal): the attention's state.
    """

    dextra: DExTra
    attention: Attention  # its q, k, v projections and core (no output projection: `out`)
    out: Linear

    def __init__(
        self,
        attention: registry.BoundAttention,
        d_model: int,
        *,
        depth: int,
        width_mult: float,
        max_groups: int,
        shuffle: bool = True,
        ffn_reduction: int = 4,
        causal: bool,
        norm: str = "layernorm",
        norm_eps: float | None = None,
        pre_norm: bool = False,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        kd, ka, ko, kf = jax.random.split(key, 4)
        d_out = d_model // 2
        self.dextra = DExTra(
            d_model, d_out, depth=depth, width_mult=width_mult, max_groups=max_groups, shuffle=shuffle, key=kd
        )
        # q, k, v d_o -> d_o; the output d_o -> d_m is the block's own `out` (Attention's is d_o -> d_o)
        single = Attention(attention, d_out, 1, causal=causal, key=ka)
        self.attention = eqx.tree_at(lambda a: a.o_proj, single, None, is_leaf=lambda v: v is None)
        self.out = Linear(d_out, d_model, key=ko)
        self.ffn = FeedForward(d_model, d_model // ffn_reduction, "silu", dropout=dropout, key=kf)
        self.norms = (make_norm(norm, d_model, norm_eps), make_norm(norm, d_model, norm_eps))
        self.dropout = eqx.nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def _qkv(self, h):
        """The single head's q, k, v `[n, 1, d_o]` and the core's arrays, from DExTra's output h."""
        a = self.attention
        q, k, v = (p(h)[:, None, :] for p in (a.q_proj, a.k_proj, a.v_proj))  # type: ignore[misc]
        return q, k, v, a.arrays | jax.lax.stop_gradient(a.drawn) | a.core.token_arrays(a.token_params, h, h)

    def mix(self, x, mask, *, key, inference):
        """Single-head attention on DExTra(x), its output projected back to d_m (and what
        the attention produced: a core's span loss, k-means inputs)."""
        a = self.attention
        q, k, v, arrays = self._qkv(self.dextra(x))
        noise = a.core.spec.noise_key
        if noise is not None and key is not None and not inference:  # a core's own training noise (Sinkhorn's)
            arrays = arrays | {noise: key}
        out = a.core(q, k, v, arrays=arrays, causal=a.causal, kv_mask=mask)
        produced = Produced()
        if not inference:
            produced = a.span_loss()
            if a.core.spec.updates_arrays:
                produced = produced + Produced(attention_inputs=(AttentionInputs(q, k, mask),))
        return self.out(out[:, 0].astype(x.dtype)), produced.under("attention")

    def init_decode_state(self, max_len: int, dtype) -> Any:
        return self.attention.init_decode_state(max_len, dtype)

    def mix_step(self, x, state):
        q, k, v, arrays = self._qkv(self.dextra(x[None]))
        out, state = self.attention.core.decode_step(q[0], k[0], v[0], state, arrays=arrays)
        return self.out(out[0].astype(x.dtype)), state


def block_scaling(
    blocks: int, min_depth: int, max_depth: int, width_mult: float
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Block-wise scaling (Mehta et al. 2021, eq. 4): each block's DExTra depth N^b and
    width multiplier w_m^b, b = 0 .. B - 1; uniform (N_min, w_m) for one block or N_min =
    N_max. N^b is floored and w_m^b rounded to 3 decimals, as the authors' code."""
    if blocks == 1 or min_depth == max_depth:
        return (min_depth,) * blocks, (float(width_mult),) * blocks
    step = (max_depth - min_depth) / (blocks - 1)
    depths = tuple(int(min_depth + step * b) for b in range(blocks))
    widths = tuple(round(width_mult + step * b / min_depth, 3) for b in range(blocks))
    return depths, widths


def default_max_groups(d_model: int) -> int:
    """The authors' g_max: 2^ceil(log2(d_m / 32)), at least 1."""
    ratio = d_model // MIN_ELEMENTS_PER_GROUP
    return 2 ** math.ceil(math.log2(ratio)) if ratio >= 1 else 1


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class DelightStack:
    """DeLighT (Mehta et al. 2021): `num_layers` blocks (`DelightBlock`), block b's
    DExTra N^b layers deep and w_m^b wide by block-wise scaling; each block's attention
    is the model's (any registered attention) with one head in d_m / 2; the FFN is the
    light-weight one (d_m / ffn_reduction, swish), so the model's ffn stays at its
    default. Post-norm by default (the authors' code)."""

    kind: str = setting("delight", "DeLighT blocks", choices=("delight",))
    min_depth: int = setting(4, "N_min, the first block's DExTra layers (the authors': 4)", limits=2)
    max_depth: int = setting(8, "N_max, the last block's DExTra layers (the authors': 8)", limits=2)
    width_mult: float = setting(2.0, "w_m, the first block's width multiplier (DExTra widens to w_m d_m)", limits=1)
    max_groups: int | None = setting(
        None, "g_max, the most groups of a GLT (None: the authors' 2^ceil(log2(d_model / 32)), at least 1)", limits=1
    )
    ffn_reduction: int = setting(4, "r, the light-weight FFN's reduction: d_m -> d_m / r -> d_m", limits=1)
    shuffle: bool = setting(True, "feature shuffling between the groups of each GLT")

    def __post_init__(self):
        check_fields(self, "stack.")
        if self.min_depth > self.max_depth:
            raise ValueError(f"stack.min_depth (N_min {self.min_depth}) exceeds max_depth (N_max {self.max_depth})")
        if self.width_mult < 1 or not math.isfinite(self.width_mult):
            raise ValueError(f"stack.width_mult w_m must be a finite number >= 1; got {self.width_mult}")

    def groups_max(self, d_model: int) -> int:
        return self.max_groups or default_max_groups(d_model)

    def check_model(self, config: ModelConfig) -> None:
        """DeLighT's contracts with the rest of the model (ModelConfig calls it)."""
        d, g = config.d_model, self.groups_max(config.d_model)
        if d % (2 * g) or (d // 2) % WIDTH_MULTIPLE or d % self.ffn_reduction:
            raise ValueError(
                f"stack 'delight' maps d_model ({d}) to d_o = d_model / 2, split into up to g_max = {g} groups and "
                f"widths that are multiples of {WIDTH_MULTIPLE}, and its FFN to d_model / ffn_reduction "
                f"({self.ffn_reduction}): d_model must be a multiple of 2 g_max, of {2 * WIDTH_MULTIPLE} and of "
                f"ffn_reduction"
            )
        check_own_ffn(config, "its light-weight FFN (d_model / ffn_reduction, swish, the paper's)")

    def blocks(self, config: ModelConfig, *, causal: bool, key: PRNGKeyArray) -> list[DelightBlock]:
        """The model's blocks, scaled block-wise."""
        depths, widths = block_scaling(config.num_layers, self.min_depth, self.max_depth, self.width_mult)
        return [
            DelightBlock(
                config.bound_attention(i),
                config.d_model,
                depth=n,
                width_mult=w,
                max_groups=self.groups_max(config.d_model),
                shuffle=self.shuffle,
                ffn_reduction=self.ffn_reduction,
                causal=causal,
                norm=config.norm.kind,
                norm_eps=config.norm.eps,
                pre_norm=config.norm.placement == "pre",
                dropout=config.dropout,
                key=k,
            )  # fmt: skip
            for i, (n, w, k) in enumerate(zip(depths, widths, jax.random.split(key, config.num_layers), strict=True))
        ]
