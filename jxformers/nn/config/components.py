"""The components a `ModelConfig` is composed of: each a typed, frozen dataclass whose
fields (type, default, one-line doc, allowed values) are declared once, here or beside
the module they configure (`MoEConfig` in nn/moe.py, `PKMConfig` in nn/pkm.py,
`TokenLearnerConfig` in nn/tokenlearner.py), and are what that module is built from.

A component with variants is a union tagged by `kind` (`ffn`, `stack`, `head`): a
setting exists only on the variant it belongs to (`mem_len` only on a recurrent stack,
`num_keys` only on a product-key memory), so an impossible combination cannot be
written. In YAML a component is a mapping, or a string naming its kind (attention:
its name) with every other setting at its default:

    attention: {name: performer, num_features: 64}     # or: attention: performer
    ffn: {kind: moe, num_experts: 8, top_k: 2}          # or: ffn: swiglu
    stack: {kind: transformer_xl, mem_len: 64}
    head: mean
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from jxformers.kernels import IMPLS
from jxformers.nn.adaptive import ACT_STATES, EXIT_RULES, EXIT_TRAININGS, STEP_EMBEDDINGS
from jxformers.nn.attention import QK_NORMS
from jxformers.nn.average import check_aan
from jxformers.nn.blocks import NORM_PLACEMENTS
from jxformers.nn.cross_layer import MAP_KINDS
from jxformers.nn.delight import DelightStack
from jxformers.nn.evolved import EvolvedStack
from jxformers.nn.floater import FLOATER_DELTA, FLOATER_STEPS
from jxformers.nn.heads import DISAGREEMENTS, HEAD_AGGREGATIONS
from jxformers.nn.hierarchical import HibertStack, HiTransformerStack
from jxformers.nn.layers import FFN_KINDS, NORM_KINDS
from jxformers.nn.layouts import DROP_UNITS, SHARINGS
from jxformers.nn.lite import LiteStack
from jxformers.nn.local import CELLS
from jxformers.nn.models import DOWNSAMPLE_KINDS, EXTRA_TOKEN_KINDS, POOLING_KINDS
from jxformers.nn.moe import MoEConfig
from jxformers.nn.pkm import PKMConfig
from jxformers.nn.positions import POSITION_KINDS, ROPE_SCALINGS, ROTARY_KINDS, Rotary
from jxformers.nn.relative import SHAW_MAX_DISTANCE
from jxformers.nn.scaling import OUTPUT_PROJECTIONS, PROJECTIONS, SparseFFNConfig
from jxformers.nn.tokenlearner import TokenLearnerConfig
from jxformers.nn.transformer_xl import COMPRESSION_LOSSES, COMPRESSIONS
from jxformers.validate import Limits, check_at_least, check_fields, setting

# The output heads of a language model (the pooled heads of an encoder are POOLING_KINDS).
OUTPUT_HEADS = ("softmax", "mixture_of_logistics")


# ------------------------------------------------------------------ attention


@typing.no_type_check  # values come from users' YAML: check_fields names the key instead
@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """A registered attention and its hyper-parameters. In YAML the hyper-parameters sit
    beside the name: `{name: performer, num_features: 64}`; a bare name is the attention
    with its defaults."""

    name: str = setting("softmax", "a registered attention (`jxformers list`)")
    hyper_parameters: dict = setting(factory=dict, doc="the op's keyword hyper-parameters (`jxformers list NAME`)")
    impl: str = setting("auto", "how it runs where it has a Pallas kernel (jxformers.kernels.impl)", choices=IMPLS)
    qk_norm: str = setting(
        "none", "queries and keys normalised before the core: l2 (QKNorm) or layernorm (ViT-22B)", choices=QK_NORMS
    )
    d_head: int | None = setting(
        None, "each head's query/key/value size, decoupled from d_model / num_heads (Bhojanapalli et al. 2020)"
    )
    collaborative: int | None = setting(
        None, "collaborative heads: a query/key projection of this size shared by the heads (Cordonnier et al. 2020)"
    )
    disagreement: tuple[str, ...] = setting(
        (), f"disagreement terms added to the loss in training, any of {DISAGREEMENTS} (Li et al. 2018)"
    )
    disagreement_weight: float = setting(1.0, "λ, the weight of each disagreement term", limits=Limits(above=0))
    head_aggregation: str = setting(
        "concat",
        "concat: heads concatenated; routing: routing-by-agreement, dynamic routing; em_routing: by EM routing "
        "(Li et al. 2019; Gu & Feng 2019)",
        choices=HEAD_AGGREGATIONS,
    )
    routing_iterations: int = setting(
        3, "routing iterations of head_aggregation routing or em_routing (EM: M-steps)", limits=1
    )
    aan: bool = setting(
        False,
        "attention 'average' as the average attention network (Zhang et al. 2018): the average of the "
        "layer input itself, an FFN of the block's d_ff and the gating layer, in place of the projections",
    )
    aan_ffn: bool = setting(
        True, "with aan: the FFN on the average (eq. 1); false: the authors' recommended variant without it"
    )
    # The Scaling Transformer's sparse QKV layer (Jaszczur et al. 2021, section 3.2; jxformers.nn.scaling)
    projection: str = setting(
        "dense",
        "how q, k, v are made: dense (W_Q, W_K, W_V) or sparse, the Scaling Transformer's sparse QKV layer "
        "(Jaszczur et al. 2021): a multiplicative layer of S modules, then a convolution per q, k, v over "
        "(positions, causal; modules); self-attention, heads of d_model / num_heads",
        choices=PROJECTIONS,
    )
    modules: int | None = setting(None, "projection sparse: S, the modules of d_model (None: num_heads)", limits=1)
    conv_length: int = setting(
        3, "projection sparse: the convolutions' kernel over the positions (this one and the ones before)", limits=1
    )
    conv_modules: int = setting(
        3,
        "projection sparse: the convolutions' kernel over the modules (odd, centred)",
        limits=Limits(minimum=1, odd=True),
    )
    output_projection: str = setting(
        "dense", "projection sparse: W_O after the heads (dense), or none (the authors' code's default)",
        choices=OUTPUT_PROJECTIONS,
    )  # fmt: skip

    def __post_init__(self):
        if isinstance(self.disagreement, str):  # one term: `--set model.attention.disagreement=position`
            object.__setattr__(self, "disagreement", (self.disagreement,))
        check_fields(self, "attention.")
        check_at_least(self, "attention.", 1, "d_head", "collaborative")
        bad = [t for t in self.disagreement if t not in DISAGREEMENTS]
        if bad or len(set(self.disagreement)) != len(self.disagreement):
            raise ValueError(
                f"attention.disagreement takes distinct terms among {DISAGREEMENTS}; got {self.disagreement}"
            )
        if not self.aan_ffn and not self.aan:
            raise ValueError("attention.aan_ffn: false drops the average attention network's FFN; set aan: true")
        if self.aan:
            check_aan(self.name, d_head=self.d_head, collaborative=self.collaborative,
                      disagreement=self.disagreement, head_aggregation=self.head_aggregation)  # fmt: skip
        sparse = {n: getattr(self, n) for n in _SPARSE_QKV if getattr(self, n) != _SPARSE_QKV[n]}
        if sparse and self.projection != "sparse":
            raise ValueError(
                f"attention {sorted(sparse)} size the sparse QKV layer: set projection 'sparse'; got {sparse}"
            )
        for name in _MODULE:
            if name in self.hyper_parameters:
                raise ValueError(f"attention: give {name} as the component's {name}, not among its hyper-parameters")

    @classmethod
    def from_value(cls, value: Any, where: str = "attention") -> AttentionConfig:
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(name=value)
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{where} must be an attention name or a mapping {{name: ..., <hyper-parameter>: ...}}; got {value!r}"
            )
        values = dict(value)
        if "hyper_parameters" in values:  # the dataclass's own spelling (dataclasses.asdict)
            values |= values.pop("hyper_parameters") or {}
        # The module's own settings (impl, qk_norm) sit beside the op's hyper-parameters.
        module = {n: values.pop(n) for n in _MODULE if n in values}
        return cls(name=values.pop("name", "softmax"), hyper_parameters=values, **module)

    def to_value(self) -> dict[str, Any]:
        """The YAML form: the name, the hyper-parameters beside it, and the module's settings."""
        module = {n: getattr(self, n) for n in _MODULE}
        return {"name": self.name, **self.hyper_parameters, **module, "disagreement": list(self.disagreement)}


# The settings of the module around the op: every field but the op's name and hyper-parameters.
_MODULE = tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name not in ("name", "hyper_parameters"))
# The sparse QKV layer's settings, passed to the module as they are; the sizes' defaults (projection 'sparse' only).
SPARSE_QKV_OPTIONS = ("projection", "modules", "conv_length", "conv_modules", "output_projection")
_SPARSE_QKV = {f.name: f.default for f in dataclasses.fields(AttentionConfig) if f.name in SPARSE_QKV_OPTIONS[1:]}
# Those of the improved multi-heads (`jxformers.nn.heads`), passed to the module as they are.
HEAD_OPTIONS = ("collaborative", "disagreement", "disagreement_weight", "head_aggregation", "routing_iterations")


# ------------------------------------------------------------------ embedding, norm


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class CPEConfig:
    """Conditional positional encodings (Chu et al. 2021, "Conditional Positional
    Encodings for Vision Transformers"): a PEG, x + DWConv(x) over the positions
    (`jxformers.nn.local.PEG`), after each block of `after`; causal in a language model.
    Beside `embedding.position` (none: CPE alone, CPVT's model; or with absolute, rotary,
    bias or relative positions)."""

    kernel_size: int = setting(
        3, "k, the depthwise convolution's taps over the positions (CPVT's 3x3 in 2-D); odd where it is centred "
        "(an encoder)", limits=1,
    )  # fmt: skip
    after: tuple[int, ...] = setting(
        (0,), "the blocks after which a PEG sits, each its own (-1: on the embeddings, before block 0; CPVT: 0, "
        "after the first block)", limits=-1,
    )  # fmt: skip

    def __post_init__(self):
        if isinstance(self.after, int) and not isinstance(self.after, bool):  # one block: `after: 0`
            object.__setattr__(self, "after", (self.after,))
        check_fields(self, "embedding.cpe.")
        if not self.after or len(set(self.after)) != len(self.after):
            raise ValueError(f"embedding.cpe.after lists distinct block indices (at least one); got {self.after}")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """Token embeddings and positions. The rope_* and xpos_* settings configure the
    rotary kinds (`jxformers.nn.positions.Rotary`, which `rotary()` builds from them),
    relative_max_distance the clipped ones (shaw, deberta), deberta_buckets DeBERTa v2's
    log buckets, tupe_relative TUPE and floater_* FLOATER's ODE; each is refused with any
    other position."""

    position: str | None = setting(
        None,
        "positions: added to the embeddings (sinusoidal, scaled_sinusoidal: FLASH's sinusoids times a learned "
        "scalar, learned), rotary (rope; xpos: rope with a decay, causal lm only), a logit bias (alibi, t5; "
        "tupe: TUPE's untied positional correlation, Ke et al. 2021), or relative score terms inside each "
        "attention (shaw: Shaw et al. 2018; transformer_xl: Dai et al. 2019's u, v and W_{k,R} R_{i-j}; "
        "deberta: He et al. 2021's disentangled attention), each block's own position from a neural ODE added to "
        "its attention's input (floater: Liu et al. 2020's FLOATER), or the token embedding turned by position "
        "(complex: Wang et al. 2020's complex word embeddings, real and imaginary parts as features) (None: none "
        "for the recurrent stacks, whose own are relative, and with embedding.cpe or stack.local_rnn, which give "
        "the order; sinusoidal otherwise)",
        choices=(*POSITION_KINDS, None),
    )
    relative_max_distance: int | None = setting(
        None,
        f"k of shaw (distances j - i clipped to [-k, k]; None: {SHAW_MAX_DISTANCE}, the paper's) and deberta "
        "(δ(i, j) = clip(i - j + k, 0, 2k - 1); None: max_len, every distance of a sequence its own bucket)",
        limits=1,
    )
    deberta_buckets: int | None = setting(
        None,
        "deberta: DeBERTa v2's log buckets, b of them each way (v2's position_buckets; its models use 256), reaching "
        "distance relative_max_distance (v2's max_relative_positions); None: v1's linear clipping",
        limits=2,
    )
    floater_delta: float = setting(
        FLOATER_DELTA,
        "floater: Δ, position i at t_i = i Δ of the ODE (the authors' code: 0.01)",
        limits=Limits(above=0),
    )
    floater_steps: int = setting(
        FLOATER_STEPS, "floater: fixed RK4 steps per interval Δ (the authors' code: 5, step Δ/5)", limits=1
    )
    tupe_relative: bool = setting(
        False, "tupe: TUPE-R, T5's relative bias b_{j-i} added to the positional correlation; false: TUPE-A"
    )
    rope_base: float = setting(
        10000.0, "θ of rope and xpos: feature pair i turns by p θ^(-2i/d)", limits=Limits(above=1)
    )
    rope_scaling: str = setting(
        "none",
        "rope stretched to a context rope_factor times longer: linear, position interpolation (Chen et al. "
        "2023: positions divided by the factor); ntk, NTK-aware scaling (bloc97 2023: θ times factor^(d/(d-2)))",
        choices=ROPE_SCALINGS,
    )
    rope_factor: float = setting(
        1.0, "s = L'/L of rope_scaling, the new context over the trained one (1: with rope_scaling none)", limits=1
    )
    xpos_gamma: float = setting(
        0.4, "γ of xpos's decay ζ_i = (i/(d/2) + γ)/(1 + γ) (Sun et al. 2022)", limits=Limits(above=0)
    )
    xpos_scale_base: float = setting(
        512.0, "B of xpos: q scaled by ζ^(p/B), k by ζ^(-p/B) (Sun et al. 2022)", limits=Limits(above=0)
    )
    scale: bool = setting(True, "multiply token embeddings by sqrt(d_model) (Vaswani et al.); BERT does not")
    norm: bool = setting(False, "a norm on the summed embeddings (BERT's embedding LayerNorm)")
    type_vocab_size: int = setting(0, "token-type (segment) embeddings added to the tokens (0: none; BERT: 2)")
    extra_tokens: int = setting(
        0,
        "m learned tokens every layer processes beside the input (0: none); they count against max_len",
    )
    cpe: CPEConfig | None = setting(
        None,
        "conditional positional encodings: PEGs after chosen blocks (Chu et al. 2021; {} for CPVT's); "
        "with position None, CPE alone",
    )
    factorized: int | None = setting(
        None,
        "E of ALBERT's factorised embedding (Lan et al. 2020): a vocab x E table then an E x d_model map; "
        "token types, added positions and the embedding norm act in E (None: a vocab x d_model table)",
        limits=1,
    )
    extra_kind: str = setting(
        "memory",
        "memory: [mem; CLS; x], kept in the encoder's output (Burtsev et al. 2020, Memory Transformer; "
        "a causal lm's real tokens all attend them); registers: [CLS; reg; x], discarded at the output "
        "(Darcet et al. 2023, Vision Transformers Need Registers; encoders only)",
        choices=EXTRA_TOKEN_KINDS,
    )

    def __post_init__(self):
        if self.cpe is not None and not isinstance(self.cpe, CPEConfig):
            object.__setattr__(self, "cpe", component(self.cpe, {None: CPEConfig}, "embedding.cpe"))
        check_fields(self, "embedding.")
        check_at_least(self, "embedding.", 0, "type_vocab_size", "extra_tokens")
        given = {n: getattr(self, n) for n in _ROTARY_SETTINGS if getattr(self, n) != _ROTARY_DEFAULTS[n]}
        if given and self.position not in ROTARY_KINDS:
            raise ValueError(
                f"embedding settings {given} turn rotary positions: they need embedding.position one of "
                f"{list(ROTARY_KINDS)}; got position={self.position!r}"
            )
        wanted = _ROTARY_TAKES.get(self.position or "none", ())
        foreign = sorted(set(given) - set(wanted))
        if foreign:
            raise ValueError(
                f"embedding.position={self.position!r} takes {list(wanted)} of the rotary settings; "
                f"got {foreign} (rope_scaling and rope_factor stretch rope; xpos_* configure xpos)"
            )
        if self.relative_max_distance is not None and self.position not in ("shaw", "deberta"):
            raise ValueError(
                f"embedding.relative_max_distance is k of positions 'shaw' and 'deberta'; got position="
                f"{self.position!r}"
            )
        if self.deberta_buckets is not None and self.position != "deberta":
            raise ValueError(
                f"embedding.deberta_buckets is DeBERTa v2's log buckets: it needs position 'deberta'; got "
                f"{self.position!r}"
            )
        defaults = {"floater_delta": FLOATER_DELTA, "floater_steps": FLOATER_STEPS}
        floater = {n: getattr(self, n) for n, v in defaults.items() if getattr(self, n) != v}
        if floater and self.position != "floater":
            raise ValueError(f"embedding settings {floater} solve FLOATER's ODE: they need position 'floater'; got "
                             f"{self.position!r}")  # fmt: skip
        if self.factorized is not None and self.position == "complex":
            raise ValueError(
                f"embedding.factorized={self.factorized} with position 'complex': the complex embedding turns the "
                "d_model token features by position, which a factorised table has not; use another position"
            )
        if self.tupe_relative and self.position != "tupe":
            raise ValueError(f"embedding.tupe_relative is TUPE-R: it needs position 'tupe'; got {self.position!r}")
        if (self.rope_scaling == "none") != (self.rope_factor == 1):
            raise ValueError(
                f"embedding.rope_factor s > 1 goes with rope_scaling one of {list(ROPE_SCALINGS[1:])}, and "
                f"rope_scaling 'none' with rope_factor 1; got rope_scaling={self.rope_scaling!r}, "
                f"rope_factor={self.rope_factor}"
            )

    def max_distance(self, max_len: int) -> int:
        """k of the clipped relative kinds (0 for the others): Shaw's clip, DeBERTa's 2k buckets."""
        if self.position == "shaw":
            return self.relative_max_distance or SHAW_MAX_DISTANCE
        if self.position == "deberta":
            return self.relative_max_distance or max_len
        return 0

    def rotary(self) -> Rotary | None:
        """How the attentions turn q and k by position (None: position is not rotary)."""
        if self.position not in ROTARY_KINDS:
            return None
        return Rotary(
            kind=self.position, base=self.rope_base, scaling=self.rope_scaling, factor=self.rope_factor,
            xpos_gamma=self.xpos_gamma, xpos_scale_base=self.xpos_scale_base,
        )  # fmt: skip


# The settings of the rotary positions (EmbeddingConfig.rotary) and their defaults.
_ROTARY_SETTINGS = ("rope_base", "rope_scaling", "rope_factor", "xpos_gamma", "xpos_scale_base")
_ROTARY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EmbeddingConfig) if f.name in _ROTARY_SETTINGS}
# Which of them each rotary kind takes: scaling stretches RoPE only (`Rotary`).
_ROTARY_TAKES = {
    "rope": ("rope_base", "rope_scaling", "rope_factor"),
    "xpos": ("rope_base", "xpos_gamma", "xpos_scale_base"),
}


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Every norm of the model."""

    kind: str = setting(
        "layernorm",
        "layernorm, rmsnorm, scalenorm (Nguyen & Salazar 2019: g x / ||x||), adanorm (Xu et al. 2019: "
        "(1 - y / 10) y with y the normalised x, no gain or bias) or powernorm (Shen et al. 2020: each feature "
        "over a running quadratic mean of the batches, updated by the train step and checkpointed, with its "
        "approximate backward; jxformers.nn.power_norm)",
        choices=NORM_KINDS,
    )
    placement: str | None = setting(
        None,
        "pre or post the residual branch (None: the stack's paper; pre for the "
        "transformer, the stable choice of Xiong et al. 2020; post with ffn none, the all-attention layer's); "
        "transformer stack only: sandwich (CogView's x + N(f(N(x)))), normformer (pre plus a norm on the "
        "attention's output, head scales, a norm in the FFN; Shleifer et al. 2021), rezero (x + a f(x), a "
        "learned from 0, no norms; Bachlechner et al. 2020), tfixup (no norms, T-Fixup's init; Huang et al. "
        "2020), deepnorm (N(alpha x + f(x)) and DeepNet's init; "
        "Wang et al. 2022), admin (N(x w + f(x)), w learned per branch and set by a profile of the first "
        "batch; Liu et al. 2020), fixup (x + s f(x - b), scalar s and b, no norms, Fixup's init; Zhang et "
        "al. 2019)",
        choices=(*NORM_PLACEMENTS, None),
    )
    eps: float | None = setting(
        None, "epsilon (None: LayerNorm 1e-5, RMSNorm 1e-6, ScaleNorm 1e-5, AdaNorm 1e-5, PowerNorm 1e-5; BERT 1e-12)"
    )
    final: bool = setting(True, "a norm after the last block; BERT's post-norm encoder has none")

    def __post_init__(self):
        check_fields(self, "norm.")
        if self.eps is not None and not 0 < self.eps < 1:
            raise ValueError(f"norm.eps must be None or in (0, 1); got {self.eps}")


# ------------------------------------------------------------------ feed-forward


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class FeedForwardConfig:
    """A dense feed-forward network (`jxformers.nn.layers.FeedForward`)."""

    kind: str = setting(
        "gelu",
        "the activation: relu, gelu (tanh), gelu_exact (erf), silu (Swish), relu2 (Primer's squared ReLU); "
        "gated (Shazeer 2020): geglu, swiglu, reglu, bilinear",
        choices=FFN_KINDS,
    )
    d_ff: int | None = setting(None, "hidden width (None: 4 d_model)")
    chunk_size: int | None = setting(None, "run over chunks of this many positions (Reformer's chunked FFN)")

    def __post_init__(self):
        check_fields(self, "ffn.")
        check_at_least(self, "ffn.", 1, "d_ff", "chunk_size")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class NoFeedForward:
    """No feed-forward sublayer: each block is the all-attention layer of Sukhbaatar et al.
    2019 ("Augmenting Self-attention with Persistent Memory", section 4), whose attention's
    persistent key/value vectors (`persistent_kv` > 0, required) stand in for the FFN."""

    kind: str = setting("none", "no FFN sublayer (the all-attention layer)", choices=("none",))

    def __post_init__(self):
        check_fields(self, "ffn.")


FFN_COMPONENTS: dict[str, type] = {kind: FeedForwardConfig for kind in FFN_KINDS} | {
    "moe": MoEConfig,
    "pkm": PKMConfig,
    "sparse": SparseFFNConfig,
    "none": NoFeedForward,
}
FFNConfig = FeedForwardConfig | MoEConfig | PKMConfig | SparseFFNConfig | NoFeedForward


def d_ff(ffn: FFNConfig, d_model: int) -> int:
    """The FFN's hidden width (4 d_model unless set); a product-key memory has none."""
    return getattr(ffn, "d_ff", None) or 4 * d_model


# ------------------------------------------------------------------ per-block overrides


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """What one block of a transformer stack does differently (None: the model's)."""

    attention: AttentionConfig | None = setting(None, "this block's self-attention")
    ffn: FFNConfig | None = setting(None, "this block's FFN (Switch and GShard put experts in every other block)")

    def __post_init__(self):
        if self.attention is not None:
            object.__setattr__(self, "attention", AttentionConfig.from_value(self.attention, "layer attention"))
        if self.ffn is not None:
            object.__setattr__(self, "ffn", component(self.ffn, FFN_COMPONENTS, "layer ffn"))
        check_fields(self, "layer.")


# ------------------------------------------------------------------ stacks


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class LocalRNNConfig:
    """R-Transformer's LocalRNN (Wang et al. 2019, "R-Transformer: Recurrent Neural Network
    Enhanced Transformer"): in every block, before the attention, an RNN over the window
    of the M positions ending at each position, its last hidden state replacing the token,
    with a residual and a norm (`jxformers.nn.local.LocalRNN`)."""

    window: int = setting(
        7, "M, the positions each window holds, the position itself included (the authors' code: 7 on pixel "
        "MNIST and character PTB, 6 on music, 9 on word PTB)", limits=1,
    )  # fmt: skip
    cell: str = setting(
        "gru", "the recurrent cell: gru (the authors' default on three of their four tasks), lstm, rnn (tanh)",
        choices=CELLS,
    )  # fmt: skip
    layers: int = setting(
        1, "LocalRNN sublayers before each block's attention (the authors' n: 1, 2 on MNIST)", limits=1
    )

    def __post_init__(self):
        check_fields(self, "stack.local_rnn.")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class EarlyExitConfig:
    """An exit after every block (`jxformers.nn.adaptive.ExitStack`): a language model's
    exits share its readout, a classifier's each have a linear head on the pooled state.
    Depth-adaptive decoding (Elbayad et al. 2020, "Depth-Adaptive Transformer") for task
    lm, PABEE (Zhou et al. 2020, "BERT Loses Patience") for classify."""

    rule: str | None = setting(
        None, "how a token (lm) or an example (classify) exits at inference: confidence (the first block whose "
        "top probability reaches threshold; Elbayad et al.) or patience (classify: the first block whose "
        "prediction has stood for `patience` blocks; PABEE) (None: confidence for lm, patience for classify)",
        choices=(*EXIT_RULES, None),
    )  # fmt: skip
    threshold: float = setting(0.9, "the confidence rule's threshold on the top probability, in (0, 1)")
    patience: int = setting(2, "PABEE's t: blocks in a row whose prediction did not change", limits=1)
    training: str | None = setting(
        None, "the exits' losses: aligned (uniform weights; Elbayad et al.), weighted (block j weighted j / sum j; "
        "PABEE) or mixed (lm: `samples` draws of an exit per token, states copied above it; Elbayad et al.) "
        "(None: aligned for lm, weighted for classify)",
        choices=(*EXIT_TRAININGS, None),
    )  # fmt: skip
    samples: int = setting(1, "mixed training: M, the exit draws per sequence", limits=1)

    def __post_init__(self):
        check_fields(self, "stack.early_exit.")
        if not 0 < self.threshold < 1:
            raise ValueError(f"stack.early_exit.threshold must be in (0, 1); got {self.threshold}")
        if self.samples != 1 and self.training != "mixed":
            raise ValueError(
                f"stack.early_exit.samples counts mixed training's draws: set training 'mixed'; got training "
                f"{self.training!r}, samples {self.samples}"
            )


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class CCTConfig:
    """Gated sub-layers (Bapna et al. 2020, "Controlling Computation versus Quality for
    Neural Sequence Models", CCT; `jxformers.nn.adaptive.GatedStack`): a control network per
    self-attention and FFN gives each token a gate conditioned on a computation budget,
    noised and continuous in training, skip-or-run at inference."""

    budgets: tuple[float, ...] = setting(
        (0.25, 0.5, 0.75, 1.0), "the budgets (fractions of sub-layers to run) trained as tasks, one drawn per example"
    )
    budget: float = setting(1.0, "the budget at evaluation and decoding, one of budgets")
    budget_weight: float = setting(1.0, "λ of the budget loss λ (used fraction - budget)^2", limits=Limits(above=0))
    noise: float = setting(1.0, "the standard deviation of the noise on the gates' logits in training", limits=0)
    d_control: int = setting(16, "the control networks' hidden width", limits=1)

    def __post_init__(self):
        if isinstance(self.budgets, (list, tuple)):
            object.__setattr__(self, "budgets", tuple(self.budgets))
        check_fields(self, "stack.cct.")
        bad = [b for b in self.budgets if not (isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b <= 1)]
        if bad or not self.budgets or len(set(self.budgets)) != len(self.budgets):
            raise ValueError(f"stack.cct.budgets lists distinct fractions in (0, 1]; got {self.budgets}")
        if self.budget not in self.budgets:
            raise ValueError(
                f"stack.cct.budget conditions the trained controllers: one of budgets {list(self.budgets)}; got "
                f"{self.budget}"
            )


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class TransformerStack:
    """`num_layers` blocks of the named attention (Vaswani et al. 2017), with the
    options that act between blocks."""

    kind: str = setting("transformer", "blocks of the named attention", choices=("transformer",))
    layer_overrides: dict = setting(factory=dict, doc="block index -> {attention, ffn} of that block")
    reversible: bool = setting(False, "Reformer's reversible residual wiring (pre-norm; no filters)")
    filters: dict = setting(
        factory=dict,
        doc="block index -> keep ratio of the downsampling right before it "
        "(the Fourier Transformer's LRA setting: {0: 0.2})",
    )
    downsample: str = setting(
        "fourier", "fourier (DCT), fourier_rescaled or funnel (Dai et al.'s pooled queries)", choices=DOWNSAMPLE_KINDS
    )
    token_learner: TokenLearnerConfig | None = setting(None, "TokenLearner (Ryoo et al. 2021) after a block")
    local_rnn: LocalRNNConfig | None = setting(
        None, "R-Transformer's LocalRNN before every block's attention (Wang et al. 2019; {} for its defaults)"
    )
    dman: bool = setting(
        False, "Mask Attention Networks (Fan et al. 2021): a dynamic mask attention sublayer (DMAN: softmax "
        "attention times a learned mask sigmoid(x_t w + P[s - t] + U_h)) before every block's attention, so each "
        "block is DMAN -> SAN -> FFN (jxformers.nn.mask_attention)",
    )  # fmt: skip
    # Cross-layer attention maps (jxformers.nn.cross_layer): a setting of the stack, since they
    # pass between its blocks; every block's attention must be the dense softmax.
    attention_maps: str = setting(
        "none",
        "attention maps carried from layer to layer: residual (RealFormer, He et al. 2020: each layer's "
        "pre-softmax scores plus the previous layer's) or lazy (LazyFormer, Ying et al. 2021: the first "
        "layer of each lazy block computes the probabilities, the others reuse them) or predictive "
        "(Evolving Attention, Wang et al. 2021: the previous layer's logits mixed in and convolved; "
        "non-causal tasks); softmax attention only",
        choices=MAP_KINDS,
    )
    lazy_block: int = setting(2, "layers per LazyFormer lazy block, the first computing the maps (attention_maps lazy)")
    map_alpha: float = setting(
        1.0, "predictive maps: the convolution's weight, A = alpha CNN(A_in) + (1 - alpha) A_in, in [0, 1]"
    )
    map_beta: float = setting(
        0.5, "predictive maps: the previous layer's weight, A_in = (1 - beta) S + beta A_prev, in [0, 1]"
    )
    early_exit: EarlyExitConfig | None = setting(
        None, "an exit after every block: depth-adaptive decoding (lm; Elbayad et al. 2020) or PABEE (classify; "
        "Zhou et al. 2020) ({} for the task's paper's defaults)",
    )  # fmt: skip
    cct: CCTConfig | None = setting(
        None, "gated sub-layers under a computation budget (Bapna et al. 2020's CCT; {} for its defaults)"
    )
    # Layouts, sharing and LayerDrop (jxformers.nn.layouts; Lin et al. 2021 section 6.5 and around it)
    order: str | None = setting(
        None,
        "the sublayer order, a string of s (self-attention) and f (FFN), as Press et al. 2020's 'sfsfff...' "
        "(None: (sf)^num_layers); one s per block, so num_layers s's",
    )
    sandwich: int = setting(
        0, "k of the Sandwich Transformer (Press et al. 2020): the order s^k (sf)^(n-k) f^k, n = num_layers "
        "(0: none)", limits=0,
    )  # fmt: skip
    macaron: bool = setting(
        False, "Macaron Net's blocks (Lu et al. 2019): FFN/2, attention, FFN/2, each FFN's output times 1/2"
    )
    sharing: str = setting(
        "none",
        "ALBERT's cross-layer sharing (Lan et al. 2020): all (every block is block 0), attention (its "
        "attention sublayer), ffn (its FFN sublayers); one array, trained as one",
        choices=SHARINGS,
    )
    layerdrop: float = setting(
        0.0, "LayerDrop's p (Fan et al. 2020): each block skipped whole with this probability in training",
        limits=Limits(minimum=0, below=1),
    )  # fmt: skip
    layerdrop_unit: str = setting(
        "batch", "batch: one draw per block for the batch (the authors' code); example: one per example",
        choices=DROP_UNITS,
    )  # fmt: skip
    keep_layers: tuple[int, ...] | None = setting(
        None, "the blocks evaluation and generation run (LayerDrop's pruning; None: all); may change after "
        "training", limits=0,
    )  # fmt: skip
    prune: float | None = setting(
        None, "LayerDrop's 'every other' pruning at rate p: blocks at depth d = 1..L with d = 0 mod floor(1/p) "
        "skipped at inference (0.5: keep 0, 2, 4...); may change after training", limits=Limits(above=0, below=1),
    )  # fmt: skip

    def __post_init__(self):
        overrides = {}
        for index, layer in _int_keys("stack.layer_overrides", self.layer_overrides).items():
            if isinstance(layer, Mapping):
                unknown = sorted(set(layer) - {"attention", "ffn"}, key=str)
                if unknown:
                    raise ValueError(f"stack.layer_overrides[{index}] may set attention and ffn; got {unknown}")
                where = f"stack.layer_overrides[{index}]"
                layer = LayerConfig(
                    attention=None
                    if layer.get("attention") is None
                    else AttentionConfig.from_value(layer["attention"], f"{where}.attention"),
                    ffn=None if layer.get("ffn") is None else component(layer["ffn"], FFN_COMPONENTS, f"{where}.ffn"),
                )
            overrides[index] = layer
        object.__setattr__(self, "layer_overrides", overrides)
        object.__setattr__(self, "filters", _int_keys("stack.filters", self.filters))
        if isinstance(self.token_learner, Mapping):
            object.__setattr__(
                self, "token_learner", component(self.token_learner, {None: TokenLearnerConfig}, "stack.token_learner")
            )
        if isinstance(self.local_rnn, Mapping):
            object.__setattr__(self, "local_rnn", component(self.local_rnn, {None: LocalRNNConfig}, "stack.local_rnn"))
        if isinstance(self.early_exit, Mapping):
            exits = component(self.early_exit, {None: EarlyExitConfig}, "stack.early_exit")
            object.__setattr__(self, "early_exit", exits)
        if isinstance(self.cct, Mapping):
            object.__setattr__(self, "cct", component(self.cct, {None: CCTConfig}, "stack.cct"))
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "lazy_block")
        if self.lazy_block != 2 and self.attention_maps != "lazy":
            raise ValueError(
                f"stack.lazy_block sizes LazyFormer's lazy blocks: set attention_maps 'lazy'; got "
                f"attention_maps={self.attention_maps!r}, lazy_block={self.lazy_block}"
            )
        for name in ("map_alpha", "map_beta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
                raise ValueError(f"stack.{name} must be a number in [0, 1]; got {value!r}")
        if (self.map_alpha, self.map_beta) != (1.0, 0.5) and self.attention_maps != "predictive":
            raise ValueError(
                f"stack.map_alpha and map_beta mix the predictive maps: set attention_maps 'predictive'; got "
                f"attention_maps={self.attention_maps!r}, map_alpha={self.map_alpha}, map_beta={self.map_beta}"
            )
        for index, ratio in self.filters.items():
            if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio <= 1):
                raise ValueError(f"stack.filters maps a block index to a keep ratio in (0, 1]; got {index}: {ratio!r}")
        self._check_layouts()

    def _check_layouts(self):
        """The sublayer order, Macaron, sharing and LayerDrop settings among themselves."""
        if self.order is not None and (not self.order or set(self.order) - {"s", "f"} or "s" not in self.order):
            raise ValueError(f"stack.order is a string of s and f with at least one s (e.g. 'sfsfff'); got "
                             f"{self.order!r}")  # fmt: skip
        layouts = {n: getattr(self, n) for n in ("order", "sandwich", "macaron") if getattr(self, n)}
        if len(layouts) > 1:
            raise ValueError(f"stack.order, sandwich and macaron each set the blocks' sublayers: give one; got "
                             f"{layouts}")  # fmt: skip
        if self.keep_layers is not None and self.prune is not None:
            raise ValueError(f"stack.keep_layers and stack.prune both choose the blocks run at inference: give one; "
                             f"got keep_layers={list(self.keep_layers)}, prune={self.prune}")  # fmt: skip
        if self.keep_layers is not None and (
            not self.keep_layers or len(set(self.keep_layers)) < len(self.keep_layers)
        ):
            raise ValueError(f"stack.keep_layers lists distinct block indices (at least one); got {self.keep_layers}")
        if self.sharing != "none" and self.layer_overrides:
            raise ValueError(
                f"stack.sharing={self.sharing!r} runs one set of shared sublayers in every block; "
                f"stack.layer_overrides {sorted(self.layer_overrides)} would make blocks differ"
            )


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class ISABStack:
    """Set Transformer's induced set attention blocks (Lee et al. 2019), softmax inside."""

    kind: str = setting("isab", "induced set attention blocks", choices=("isab",))
    num_inducing: int = setting(16, "learned inducing points of each block")

    def __post_init__(self):
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "num_inducing")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class LunaStack:
    """Luna layers carrying a packed sequence from layer to layer (Ma et al. 2021)."""

    kind: str = setting("luna", "Luna layers", choices=("luna",))
    packed_len: int = setting(16, "length of the packed sequence")

    def __post_init__(self):
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "packed_len")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class PerceiverStack:
    """A latent array cross-attending the input, each time followed by a shared latent
    tower of `num_layers` blocks (Jaegle et al. 2021)."""

    kind: str = setting("perceiver", "a Perceiver encoder", choices=("perceiver",))
    num_latents: int = setting(16, "rows of the latent array")
    cross_attends: int = setting(1, "cross-attentions to the input, each followed by the latent tower")
    fourier_bands: int = setting(
        0,
        "K > 0: the paper's Fourier position features, [x_d, sin(f_k π x_d), cos(f_k π x_d)] with K bands "
        "f_k from 1 to μ/2, concatenated to each input row (embedding.position 'none'); 0: none",
    )
    fourier_grid: tuple[int, ...] | None = setting(
        None, "the grid the input positions lie on, row-major (None: (max_len,); an image: [H, W], H W = max_len)"
    )
    fourier_max_freq: tuple[float, ...] | None = setting(
        None, "μ per grid dimension (None: the grid's sizes, each dimension's sampling rate)"
    )

    def __post_init__(self):
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "num_latents", "cross_attends")
        check_at_least(self, "stack.", 0, "fourier_bands")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class TransformerXLStack:
    """Segment-level recurrence with relative positions (Dai et al. 2019): each layer
    reads the last `mem_len` hidden states it saw (stop-gradient)."""

    kind: str = setting("transformer_xl", "Transformer-XL", choices=("transformer_xl",))
    mem_len: int = setting(16, "hidden states each layer remembers")
    eval_mem_len: int | None = setting(None, "the memory in evaluation (None: mem_len)")

    def __post_init__(self):
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "mem_len")
        check_at_least(self, "stack.", 0, "eval_mem_len")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class CompressiveStack:
    """Transformer-XL plus a compressed memory (Rae et al. 2020): evicted memories are
    compressed at `compression_rate` by `compression`, trained by `compression_loss`."""

    kind: str = setting("compressive", "the Compressive Transformer", choices=("compressive",))
    mem_len: int = setting(18, "hidden states each layer remembers (a multiple of compression_rate)")
    eval_mem_len: int | None = setting(None, "the memory in evaluation (None: mem_len)")
    cmem_len: int = setting(6, "compressed memory slots")
    compression: str = setting(
        "conv",
        "the compression function f_c (Rae et al. 2020, section 3.1): conv (kernel and stride c), mean or max "
        "pooling, dilated_conv (kernel c, dilation n / c), most_used (the states that received the most attention)",
        choices=COMPRESSIONS,
    )
    compression_rate: int = setting(3, "states per compressed slot")
    compression_loss: str = setting(
        "attention",
        "what trains f_c (section 3.2): attention (the attention-reconstruction loss) or autoencoding (the "
        "evicted states reconstructed from their compression by a learned g)",
        choices=COMPRESSION_LOSSES,
    )

    def __post_init__(self):
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "mem_len", "cmem_len", "compression_rate")
        check_at_least(self, "stack.", 0, "eval_mem_len")
        bad = {
            n: v
            for n, v in (("mem_len", self.mem_len), ("eval_mem_len", self.eval_mem_len))
            if v is not None and v % self.compression_rate
        }
        if bad:
            raise ValueError(
                f"stack 'compressive' compresses whole windows of compression_rate "
                f"({self.compression_rate}) states (segments must be too): {sorted(bad)} must be "
                f"multiples of it; got {bad}"
            )


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class ErnieDocStack:
    """ERNIE-Doc's recurrence (Ding et al. 2021, `jxformers.nn.transformer_xl`): Transformer-XL
    whose layer l remembers its own outputs of earlier segments (the enhanced, same-layer
    recurrence), optionally with the retrospective feed (each record read twice)."""

    kind: str = setting("ernie_doc", "ERNIE-Doc", choices=("ernie_doc",))
    mem_len: int = setting(16, "hidden states each layer remembers (its own outputs)")
    eval_mem_len: int | None = setting(None, "the memory in evaluation (None: mem_len)")
    retrospective: bool = setting(
        False, "the retrospective feed: each record (the document) read twice, a skimming pass then a "
        "retrospective pass whose loss is trained; it reads the memory of the whole record, targets included, "
        "so it is no next-token predictor and cannot generate",
    )  # fmt: skip
    segment_len: int | None = setting(
        None, "tokens per segment within a record (None: the record is one segment)", limits=1
    )

    def __post_init__(self):
        check_fields(self, "stack.")
        check_at_least(self, "stack.", 1, "mem_len")
        check_at_least(self, "stack.", 0, "eval_mem_len")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class MemformerStack:
    """Memformer (Wu et al. 2020, `jxformers.nn.memformer`): blocks of the named causal
    attention, each reading a memory of `num_slots` slots by cross-attention; the memory
    written by slot attention with biased normalisation after every segment."""

    kind: str = setting("memformer", "Memformer", choices=("memformer",))
    num_slots: int = setting(8, "k, the memory's slots", limits=1)
    segment_len: int = setting(
        16, "tokens read between two memory writes; a training record (data max_len - 1 tokens) is a whole "
        "number of segments, back-propagated through together", limits=1,
    )  # fmt: skip
    write_temperature: float = setting(
        0.5, "τ of the writer's softmax (eq. 7, τ < 1 sharpens it; the paper gives no value)", limits=Limits(above=0)
    )
    replay: bool = setting(
        True, "memory replay back-propagation: each segment's step under jax.checkpoint, the backward keeping "
        "only the memories and replaying the segments; false: every activation kept",
    )  # fmt: skip

    def __post_init__(self):
        check_fields(self, "stack.")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class UniversalStack:
    """The Universal Transformer (Dehghani et al. 2019, "Universal Transformers"): one
    shared step of `num_layers` blocks of the named attention (the paper's: 1) applied
    recurrently, the position and step embeddings added before each step, with
    per-position ACT halting and its ponder cost (`jxformers.nn.adaptive.UniversalStack`)."""

    kind: str = setting("universal", "the Universal Transformer", choices=("universal",))
    max_steps: int = setting(
        8, "T, the steps at most (ACT forces none beyond; tensor2tensor: 2 x its layers; without act: the steps)",
        limits=1,
    )  # fmt: skip
    act: bool = setting(True, "per-position adaptive computation time (Graves 2016); false: max_steps steps")
    act_threshold: float = setting(0.99, "1 - ε: a position halts when its summed halting probability passes it")
    ponder_weight: float = setting(
        0.01, "the ponder cost's weight on mean(N + R) (tensor2tensor's act_loss_weight)", limits=0
    )
    halting_bias: float = setting(1.0, "the halting unit's initial bias (tensor2tensor's act_halting_bias_init)")
    act_state: str = setting(
        "accumulated", "the output: accumulated, sum_t w_t T_t (Graves's; tensor2tensor's act_type accumulated), or "
        "interpolated, o_t = w_t T_t + (1 - w_t) o_{t-1} (its act_type basic, precedence fixed)",
        choices=ACT_STATES,
    )  # fmt: skip
    step_embedding: str = setting(
        "sinusoidal", "the step's embedding added before each step: sinusoidal (the paper's) or learned "
        "(tensor2tensor's default)", choices=STEP_EMBEDDINGS,
    )  # fmt: skip
    position_signal: bool = setting(
        True, "the position's sinusoid added before every step with the step's (the paper's coordinate embedding; "
        "embedding.position none then); false: positions from embedding.position",
    )  # fmt: skip

    def __post_init__(self):
        check_fields(self, "stack.")
        if not 0 < self.act_threshold <= 1:
            raise ValueError(f"stack.act_threshold is 1 - ε, in (0, 1]; got {self.act_threshold}")
        defaults = {"act_threshold": 0.99, "ponder_weight": 0.01, "halting_bias": 1.0, "act_state": "accumulated"}
        given = {n: getattr(self, n) for n, v in defaults.items() if getattr(self, n) != v}
        if given and not self.act:
            raise ValueError(f"stack {given} configure ACT halting: set act true; got act false")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class FeedbackStack:
    """The Feedback Transformer (Fan et al. 2020, `jxformers.nn.feedback`): every layer at
    position t attends to one memory of the softmax-weighted sum of all layers' states at
    the earlier positions; trained position after position (a causal lm)."""

    kind: str = setting("feedback", "the Feedback Transformer", choices=("feedback",))
    span: int | None = setting(
        None, "earlier positions each position reads (None: all; the authors' --attn-lim)", limits=1
    )

    def __post_init__(self):
        check_fields(self, "stack.")


STACK_COMPONENTS: dict[str, type] = {
    cls.kind: cls
    for cls in (  # type: ignore[attr-defined]
        TransformerStack,
        ISABStack,
        LunaStack,
        PerceiverStack,
        TransformerXLStack,
        CompressiveStack,
        ErnieDocStack,
        MemformerStack,
        *(LiteStack, DelightStack, EvolvedStack),
        UniversalStack,
        FeedbackStack,
        HibertStack,
        HiTransformerStack,
    )
}
StackConfig = (
    TransformerStack | ISABStack | LunaStack | PerceiverStack | TransformerXLStack | CompressiveStack
    | ErnieDocStack | MemformerStack | LiteStack | DelightStack | EvolvedStack | UniversalStack | FeedbackStack
    | HibertStack | HiTransformerStack
)  # fmt: skip
RECURRENT_STACKS = ("transformer_xl", "compressive", "ernie_doc")  # built as transformer_xl.RecurrentLM
ENCODER_OR_LM = ("classify", "retrieval", "lm")
# stack kind -> (the norm placement its paper uses, the tasks it serves, what it is)
STACKS = {
    "transformer": ("pre", ("classify", "retrieval", "lm", "seq2seq"), "blocks of the named attention"),
    "isab": ("post", ("classify", "retrieval"), "Set Transformer's ISAB blocks (Lee et al. 2019)"),
    "luna": (
        "post",
        ("classify", "retrieval", "lm", "seq2seq"),
        "Luna layers carrying a packed sequence (Ma et al. 2021)",
    ),
    "perceiver": ("pre", ("classify", "retrieval"), "latent array cross-attending the input (Jaegle et al. 2021)"),
    "transformer_xl": ("post", ("lm",), "segment-level recurrence, relative positions (Dai et al. 2019)"),
    "compressive": ("post", ("lm",), "Transformer-XL plus a compressed memory (Rae et al. 2020)"),
    "ernie_doc": ("post", ("lm",), "same-layer recurrence, retrospective feed (Ding et al. 2021)"),
    "memformer": ("pre", ("lm",), "a memory of slots read by every layer, written per segment (Wu et al. 2020)"),
    "universal": ("post", ("classify", "lm"), "a shared block applied recurrently, ACT halting (Dehghani et al. 2019)"),
    "feedback": ("pre", ("lm",), "every layer attends to a memory of all layers' states (Fan et al. 2020)"),
}
# The whole-model designs whose blocks take the model's attention (jxformers.nn.cells),
# each with its config's check_model and blocks (jxformers.nn.lite, .delight, .evolved).
CELL_STACK_TYPES = (LiteStack, DelightStack, EvolvedStack)
CELL_STACKS = {cls.kind: cls for cls in CELL_STACK_TYPES}  # type: ignore[attr-defined]
STACKS |= {
    "lite": ("post", ENCODER_OR_LM, "Lite Transformer's long-short range attention (Wu et al. 2020)"),
    "delight": ("post", ENCODER_OR_LM, "DeLighT's DExTra blocks, scaled block-wise (Mehta et al. 2021)"),
    "evolved": ("pre", (*ENCODER_OR_LM, "seq2seq"), "the Evolved Transformer's searched cells (So et al. 2019)"),
}
# The hierarchical document encoders (jxformers.nn.hierarchical): records of sentences, tokens [S, W].
HIERARCHICAL_STACK_TYPES = (HibertStack, HiTransformerStack)
STACKS |= {
    "hibert": ("post", ("classify",), "a sentence encoder, then a document encoder (Zhang et al. 2019)"),
    "hi_transformer": ("post", ("classify",), "sentence and document blocks interacting (Wu et al. 2021)"),
}


# ------------------------------------------------------------------ decoder (seq2seq)


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The decoder of an encoder-decoder (task seq2seq)."""

    num_layers: int | None = setting(None, "decoder blocks (None: the model's num_layers)")
    cross_attention: AttentionConfig = setting(factory=AttentionConfig, doc="the decoder's cross-attention")
    ffn: bool = setting(
        True,
        'an FFN sublayer in each decoder block; false drops it (Yang et al. 2020, "On the Sub-Layer '
        "Functionalities of Transformer Decoder\": the decoder's FFNs can go with little loss)",
    )
    transparent: bool = setting(
        False,
        "transparent attention (Bapna et al. 2018): each decoder block cross-attends its own learned "
        "softmax-weighted sum of every encoder layer's output, the embeddings included (jxformers.nn.transparent)",
    )

    def __post_init__(self):
        object.__setattr__(
            self, "cross_attention", AttentionConfig.from_value(self.cross_attention, "decoder.cross_attention")
        )
        check_fields(self, "decoder.")
        check_at_least(self, "decoder.", 1, "num_layers")


# ------------------------------------------------------------------ heads


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class PooledHead:
    """A classifier's pooling and linear head (tasks classify, retrieval)."""

    kind: str = setting(
        "cls",
        "cls (a prepended token), mean, pma (Set Transformer's pooling by attention), or last (the last real "
        "token's state: a causal encoder's readout)",
        choices=POOLING_KINDS,
    )
    pma_seeds: int = setting(1, "PMA's learned seeds (kind pma)")

    def __post_init__(self):
        check_fields(self, "head.")
        check_at_least(self, "head.", 1, "pma_seeds")
        if self.pma_seeds != 1 and self.kind != "pma":
            raise ValueError(f"head.pma_seeds ({self.pma_seeds}) is PMA's number of seeds: set head kind 'pma'")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class SoftmaxHead:
    """A softmax over the vocabulary (tasks lm, seq2seq)."""

    kind: str = setting("softmax", "a softmax over the vocabulary", choices=("softmax",))
    tie_embeddings: bool = setting(True, "the output projection shares the embedding table")

    def __post_init__(self):
        check_fields(self, "head.")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class MixtureHead:
    """PixelCNN++'s discretized mixture of logistics over the pixel values 0..255
    (Salimans et al. 2017; `jxformers.nn.mixture`): task lm, transformer stack."""

    kind: str = setting(
        "mixture_of_logistics", "a mixture of logistics over pixel values", choices=("mixture_of_logistics",)
    )
    components: int = setting(10, "logistics in the mixture")

    def __post_init__(self):
        check_fields(self, "head.")
        check_at_least(self, "head.", 1, "components")


HEAD_COMPONENTS: dict[str, type] = {kind: PooledHead for kind in POOLING_KINDS} | {
    "softmax": SoftmaxHead,
    "mixture_of_logistics": MixtureHead,
}
HeadConfig = PooledHead | SoftmaxHead | MixtureHead


# ------------------------------------------------------------------ parsing


def component(value: Any, table: Mapping[Any, type], where: str, *, default_kind: Any = None) -> Any:
    """The component `value` names: an instance of one of `table`'s classes (kept), a
    kind (a string, every other setting at its default) or a mapping of settings (its
    `kind` picks the class; `default_kind` when absent). ValueErrors name `where`, the
    unknown keys and the known ones, and missing required settings."""
    classes = tuple(set(table.values()))
    if isinstance(value, classes):
        return value
    if isinstance(value, str):
        value = {"kind": value}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where} must be a kind ({sorted(k for k in table if k)}) or a mapping of settings; got {value!r}"
        )
    values = dict(value)
    kind = values.get("kind", default_kind)
    if kind not in table:
        raise ValueError(f"{where} kind must be one of {sorted(k for k in table if k)}; got {kind!r}")
    cls = table[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields), key=str)
    if unknown:
        label = f" {kind!r}" if kind else ""
        raise ValueError(f"{where}{label}: unknown setting(s) {unknown}; known: {sorted(fields)}")
    missing = [
        n
        for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        docs = "; ".join(f"{n}: {fields[n].metadata.get('doc', '')}" for n in missing)
        raise ValueError(f"{where}{' ' + repr(kind) if kind else ''} needs {missing} ({docs}); got {dict(value)}")
    return cls(**values)


def to_value(instance: Any) -> Any:
    """A component as YAML: a mapping of all its settings (nested components too), so
    that a saved config compares key by key with another."""
    if isinstance(instance, AttentionConfig):
        return instance.to_value()
    if dataclasses.is_dataclass(instance):
        return {f.name: to_value(getattr(instance, f.name)) for f in dataclasses.fields(instance)}
    if isinstance(instance, Mapping):
        return {k: to_value(v) for k, v in instance.items()}
    return instance


def _int_keys(name: str, mapping: Any) -> dict:
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{name} must be a mapping of block indices; got {mapping!r}")
    out = {}
    for key, value in mapping.items():
        if isinstance(key, bool):
            raise ValueError(f"{name} keys must be block indices (ints); got {key!r}")
        try:
            out[int(key)] = value
        except (TypeError, ValueError):
            raise ValueError(f"{name} keys must be block indices (ints); got {key!r}") from None
    return out
