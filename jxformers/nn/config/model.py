"""`ModelConfig`: a model composed of its components, and the contracts between them.

Each component checks its own values (components.py); what is checked here is only what
spans components: a causal task needs attentions that support causal, a bias position
needs attentions that take a bias (both through the registry's capability flags), a stack
serves some tasks, an option acts on one stack. Every attention is bound once, here, so
a bad hyper-parameter is refused before any array is made.
"""

from __future__ import annotations

import dataclasses
import os
import typing
import warnings
from collections.abc import Mapping
from typing import Any

import yaml

from jxformers import registry
from jxformers.nn.attention import check_input_mixer, check_qk_norm
from jxformers.nn.config import legacy
from jxformers.nn.config.binding import bind_attention
from jxformers.nn.config.components import (
    CELL_STACK_TYPES,
    CELL_STACKS,
    FFN_COMPONENTS,
    HEAD_COMPONENTS,
    HEAD_OPTIONS,
    HIERARCHICAL_STACK_TYPES,
    RECURRENT_STACKS,
    STACK_COMPONENTS,
    STACKS,
    AttentionConfig,
    DecoderConfig,
    EmbeddingConfig,
    FeedForwardConfig,
    FFNConfig,
    HeadConfig,
    MemformerStack,
    MixtureHead,
    NoFeedForward,
    NormConfig,
    PerceiverStack,
    PooledHead,
    SoftmaxHead,
    StackConfig,
    TransformerStack,
    UniversalStack,
    component,
    to_value,
)
from jxformers.nn.cross_layer import check_maps
from jxformers.nn.heads import check_head_options
from jxformers.nn.layers import FFN_KINDS, NORM_KINDS
from jxformers.nn.mixture import PIXEL_VALUES
from jxformers.nn.moe import MoEConfig
from jxformers.nn.perceiver import check_fourier
from jxformers.nn.pkm import PKMConfig
from jxformers.nn.positions import ADDED_KINDS, BIAS_KINDS, ROTARY_KINDS, xpos_max_len
from jxformers.nn.relative import INPUT_KINDS, RELATIVE_KINDS, SCORE_KINDS, check_relative
from jxformers.nn.residual import NORM_FREE, OUTPUT_NORMED
from jxformers.nn.scaling import SparseFFNConfig, check_sparse_qkv
from jxformers.validate import check_at_least, check_fields, setting

TASKS = ("classify", "retrieval", "lm", "seq2seq")
ENCODER_TASKS = ("classify", "retrieval")
CAUSAL_TASKS = ("lm", "seq2seq")  # causal by the task: the language model, the seq2seq decoder
DTYPES = ("float32", "bfloat16", "float16")
_NORMS = {kind: NormConfig for kind in NORM_KINDS}


class BlockConfig(typing.NamedTuple):
    """One block's attention and FFN, its overrides applied (`ModelConfig.layer`)."""

    attention: AttentionConfig
    ffn: FFNConfig


@typing.no_type_check  # values come from users' YAML: check_fields names the key instead
@dataclasses.dataclass(frozen=True, init=False)
class ModelConfig:
    """Everything that defines a model: a few shared sizes and the components.

        ModelConfig(task="lm", vocab_size=256, attention={"name": "performer", "num_features": 64},
                    ffn={"kind": "swiglu", "d_ff": 256}, stack={"kind": "transformer", "reversible": True})

    A component is given as its dataclass, a mapping of its settings, or a string naming
    its kind (attention: its name). The flat keyword form of jxformers before the component configs
    (`attention_kwargs=...`, `position=...`, `architecture=...`) is converted with one
    `FlatConfigWarning` naming the new keys.
    """

    task: str = setting(
        "classify",
        "classify (tokens -> class logits), retrieval (two sequences -> class "
        "logits, dual tower), lm (causal language model) or seq2seq",
        choices=TASKS,
    )
    vocab_size: int = setting(256, "token ids are in [0, vocab_size)")
    num_classes: int = setting(2, "classes of classify and retrieval")
    num_layers: int = setting(2, "blocks of the stack (the encoder's in seq2seq; a Perceiver's latent tower)")
    d_model: int = setting(64, "model width")
    num_heads: int = setting(4, "attention heads")
    kv_heads: int | None = setting(None, "key/value heads, grouped-query attention (None: num_heads)")
    max_len: int = setting(512, "longest sequence, the CLS token included")
    dropout: float = setting(0.0, "dropout on residual branches and FFN hidden units")
    dtype: str = setting("float32", "compute dtype (parameters stay float32)", choices=DTYPES)
    causal: bool | None = setting(
        None,
        "causal attention (None: the task's, causal for lm and seq2seq's decoder); true on classify or "
        "retrieval makes the encoder unidirectional (causal-only attentions, head last); false is refused on lm "
        "and seq2seq",
    )
    embedding: EmbeddingConfig = setting(factory=EmbeddingConfig, doc="token embeddings and positions")
    attention: AttentionConfig = setting(factory=AttentionConfig, doc="every block's self-attention")
    norm: NormConfig = setting(factory=NormConfig, doc="every norm")
    ffn: FFNConfig = setting(factory=FeedForwardConfig, doc="every block's FFN: dense, moe or pkm")
    stack: StackConfig = setting(factory=TransformerStack, doc="the layer stack (architecture)")
    decoder: DecoderConfig | None = setting(None, "the decoder of task seq2seq (None: its defaults there)")
    head: HeadConfig | None = setting(None, "the output head (None: the task's, cls pooling or a softmax)")

    if typing.TYPE_CHECKING:  # set by __post_init__, not a setting
        _bound: tuple[registry.BoundAttention, ...]

    def __init__(self, **values: Any):
        flat = legacy.flat_keys(values)
        if flat:
            values = legacy.convert(values)
            warnings.warn(legacy.message(flat), legacy.FlatConfigWarning, stacklevel=2)
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(values) - fields, key=str)
        if unknown:
            raise ValueError(f"unknown model config key(s) {unknown}; known: {sorted(fields)}")
        for f in dataclasses.fields(self):
            if f.name in values:
                value = values[f.name]
            elif f.default is not dataclasses.MISSING:
                value = f.default
            else:
                value = typing.cast(Any, f.default_factory)()
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.causal is None:  # the task's: every check below reads the resolved value
            set_("causal", self.task in CAUSAL_TASKS)
        set_("embedding", component(self.embedding, {None: EmbeddingConfig}, "model.embedding"))
        set_("attention", AttentionConfig.from_value(self.attention, "model.attention"))
        set_("norm", component(self.norm, _NORMS, "model.norm", default_kind="layernorm"))
        set_("ffn", component(self.ffn, FFN_COMPONENTS, "model.ffn", default_kind="gelu"))
        set_("stack", component(self.stack, STACK_COMPONENTS, "model.stack", default_kind="transformer"))
        if self.decoder is not None:
            set_("decoder", component(self.decoder, {None: DecoderConfig}, "model.decoder"))
        elif self.task == "seq2seq":
            set_("decoder", DecoderConfig())
        if self.head is not None:
            set_("head", component(self.head, HEAD_COMPONENTS, "model.head"))
        elif isinstance(self.task, str):
            # a hierarchical stack has no CLS token: its sentence vectors are averaged; a causal
            # encoder's CLS token (position 0) would see nothing: it reads its last real token
            kind = "mean" if isinstance(self.stack, HIERARCHICAL_STACK_TYPES) else "cls"
            pooled = PooledHead("last" if self.causal is True else kind)
            set_("head", pooled if self.task in ENCODER_TASKS else SoftmaxHead())
        check_fields(self, "model.")
        if self.embedding.position is None:  # CPE or a LocalRNN alone where set (CPVT's, R-Transformer's models)
            local = self.embedding.cpe is not None or getattr(self.stack, "local_rnn", None) is not None
            local = local or getattr(self.stack, "position_signal", False)  # the Universal Transformer's own
            position = "none" if self.stack.kind in RECURRENT_STACKS or local else "sinusoidal"
            set_("embedding", dataclasses.replace(self.embedding, position=position))
        if self.norm.placement is None:  # the paper's: the all-attention layer (ffn none) is post-norm
            placement = "post" if isinstance(self.ffn, NoFeedForward) else STACKS[self.stack.kind][0]
            set_("norm", dataclasses.replace(self.norm, placement=placement))
        self._check_sizes()
        self._check_causal()
        self._check_stack()
        self._check_head()
        self._check_ffns()
        self._check_norm_placement()
        self._check_embedding()
        self._check_local()
        self._check_cross_block()
        set_("_bound", self._bind())
        self._check_attentions()
        if isinstance(self.stack, HIERARCHICAL_STACK_TYPES):  # after binding: it reads the attentions' specs
            self.stack.check_model(self)
        self._check_adaptive()
        self._check_layouts()
        self._check_memformer()

    # ------------------------------------------------------------------ io

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        if not isinstance(values, Mapping):
            raise ValueError(f"model must be a mapping of keys to values; got {values!r}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike) -> ModelConfig:
        """From YAML text, or the path of a YAML file."""
        text = str(source)
        if isinstance(source, os.PathLike) or (text.endswith((".yaml", ".yml")) and "\n" not in text):
            with open(source) as f:
                text = f.read()
        values = yaml.safe_load(text)
        if not isinstance(values, Mapping):
            raise ValueError(f"a YAML model config must be a mapping; got {type(values).__name__}")
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        """The config as YAML-ready values, each component in its short form."""
        return {f.name: to_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    # ------------------------------------------------------------------ per block

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.decoder is None or self.decoder.num_layers is None else self.decoder.num_layers

    @property
    def causal_encoder(self) -> bool:
        """An encoder task (classify, retrieval) with `causal: true`: a unidirectional encoder."""
        return bool(self.causal) and self.task in ENCODER_TASKS

    def _blocks(self) -> int:
        document = getattr(self.stack, "document_layers", None) or 0  # HIBERT's document encoder may be deeper
        return max(self.num_layers, self.decoder_layers if self.task == "seq2seq" else 0, document)

    def layer(self, index: int) -> BlockConfig:
        """Block `index`'s attention and FFN, overrides applied; with experts every k-th
        block (`ffn.every`), the blocks between have a dense FFN of the experts' kind and width."""
        override = self.stack.layer_overrides.get(index) if isinstance(self.stack, TransformerStack) else None
        ffn = self.ffn
        if isinstance(ffn, MoEConfig) and index % ffn.every:
            ffn = FeedForwardConfig(kind=ffn.dense_ffn or ffn.ffn, d_ff=ffn.d_ff)
        return BlockConfig(
            attention=(override and override.attention) or self.attention, ffn=(override and override.ffn) or ffn
        )

    def head_size(self, attention: AttentionConfig) -> int:
        """The head size of an attention: its `d_head`, or d_model / num_heads."""
        return attention.d_head if attention.d_head is not None else self.d_model // self.num_heads

    def _attention_configs(self) -> list[tuple[str, AttentionConfig]]:
        """(where, config) of every attention component: the blocks' and the decoder's cross-attention."""
        found = [(f"block {i}'s attention", self.layer(i).attention) for i in range(self._blocks())]
        if self.decoder is not None:
            found.append(("decoder.cross_attention", self.decoder.cross_attention))
        return found

    def bound_attention(self, index: int) -> registry.BoundAttention:
        """Block `index`'s self-attention, bound (once, when the config was made)."""
        return self._bound[index]

    def bound_cross_attention(self) -> registry.BoundAttention:
        return self._bound[-1]

    def _bind(self) -> tuple:
        bound = [bind_attention(self.layer(i).attention, self.max_len) for i in range(self._blocks())]
        if self.decoder is not None:
            bound.append(bind_attention(self.decoder.cross_attention, self.max_len))
        return tuple(bound)

    # ------------------------------------------------------------------ contracts

    def _check_sizes(self):
        check_at_least(
            self, "model.", 1, "vocab_size", "num_classes", "num_layers", "d_model", "num_heads", "kv_heads", "max_len"
        )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1); got {self.dropout}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % (self.kv_heads or self.num_heads):
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        position = self.embedding.position
        if position in ROTARY_KINDS:
            for where, attention in self._attention_configs():
                if self.head_size(attention) % 2:
                    raise ValueError(
                        f"position {position!r} needs an even head size; {where}'s is {self.head_size(attention)} "
                        f"(d_model / num_heads = {self.d_model // self.num_heads} unless its d_head is set)"
                    )
                if self.embedding.rope_scaling == "ntk" and self.head_size(attention) <= 2:
                    raise ValueError(
                        f"embedding.rope_scaling 'ntk' multiplies θ by s^(d/(d-2)): it needs a head size d > 2; "
                        f"{where}'s is {self.head_size(attention)}"
                    )
        if position == "xpos":
            self._check_xpos()
        if position == "complex" and self.d_model % 2:
            raise ValueError(
                f"position 'complex' reads the embedding as d_model / 2 complex features (real parts, then "
                f"imaginary): it needs an even d_model; got {self.d_model}"
            )
        if self.decoder is not None and self.task != "seq2seq":
            raise ValueError(f"model.decoder configures the decoder of task seq2seq; got task {self.task!r}")

    def _check_xpos(self):
        """xPos (Sun et al. 2022) is defined for causal attention, and its scales must fit the dtype."""
        if self.task != "lm":
            raise ValueError(
                f"position 'xpos' decays q.k by ζ^((m-n)/B) for keys n before the query m, as a causal attention "
                f"sees them; a non-causal one would scale keys after the query up with the distance. It needs "
                f"task 'lm' (every attention causal); got task {self.task!r}"
            )
        emb = self.embedding
        longest = xpos_max_len(self.dtype, gamma=emb.xpos_gamma, scale_base=emb.xpos_scale_base)
        if self.max_len > longest:
            raise ValueError(
                f"position 'xpos' scales keys by up to ζ_0^(-max_len/B) = ((1+γ)/γ)^(max_len/B): with "
                f"xpos_gamma={emb.xpos_gamma}, xpos_scale_base={emb.xpos_scale_base} and dtype {self.dtype!r} "
                f"max_len must be <= {longest} (half the dtype's exponent range); got max_len={self.max_len}"
            )

    def _check_attention(self, bound: registry.BoundAttention) -> None:
        spec = bound.spec
        needs = f"task {self.task!r}" if self.task in CAUSAL_TASKS else f"model.causal true (task {self.task!r})"
        if self.causal and not spec.supports_causal:
            raise ValueError(
                f"{needs} needs causal attention; {spec.name!r} is not causal. "
                f"Causal attentions: {registry.names(supports_causal=True)}"
            )
        if self.causal and (why := bound.causal_refused()):
            raise ValueError(f"{needs} needs causal attention; {spec.name!r} cannot be causal: {why}")
        if spec.causal_only and self.task == "seq2seq":
            raise ValueError(
                f"task 'seq2seq' has a non-causal encoder (its blocks share the attention with the decoder); "
                f"{spec.name!r} is causal only (it has no non-causal form): use it with task 'lm', or with "
                f"classify / retrieval and model.causal: true, or another attention: "
                f"{registry.names(causal_only=False)}"
            )
        if spec.causal_only and not self.causal:
            raise ValueError(
                f"task {self.task!r} has non-causal attention (a bidirectional encoder: model.causal "
                f"{self.causal}); {spec.name!r} is causal only (it has no non-causal form): set model.causal: true "
                f"(a unidirectional encoder, read by head last or mean), or use another attention here: "
                f"{registry.names(causal_only=False)}"
            )
        position = self.embedding.position
        if position in BIAS_KINDS and position not in SCORE_KINDS and not spec.takes_bias:  # tupe: _check_relative
            raise ValueError(
                f"position {self.embedding.position!r} adds a logit bias, which {spec.name!r} attention "
                f"does not take; use one of {[*ADDED_KINDS, *ROTARY_KINDS, 'none']}, or one of "
                f"{registry.names(takes_bias=True)}"
            )
        windows = bound.hyper_parameters.get("head_windows")
        if windows is not None and len(windows) != self.num_heads:
            raise ValueError(
                f"attention {spec.name!r}: head_windows gives {len(windows)} windows ({list(windows)}); "
                f"one per head is needed, num_heads = {self.num_heads}"
            )

    def _check_relative(self):
        """The positions computed with each attention's scores (shaw, transformer_xl,
        deberta, tupe: `jxformers.nn.relative`) fit every block's attention and the stack."""
        position = self.embedding.position
        if position not in (*SCORE_KINDS, *INPUT_KINDS) or not isinstance(self.stack, TransformerStack):
            return  # other stacks refuse them (_check_stack)
        if position == "deberta" and self.embedding.deberta_buckets is not None:
            buckets, reach = self.embedding.deberta_buckets, self.embedding.max_distance(self.max_len)
            if reach - 1 <= buckets // 2:
                raise ValueError(
                    f"embedding.deberta_buckets b = {buckets} keeps distances up to b // 2 = {buckets // 2} and "
                    f"log-buckets the rest up to relative_max_distance - 1 (DeBERTa v2's max_relative_positions): "
                    f"it must exceed b // 2 + 1; got relative_max_distance {reach} (None: max_len)"
                )
        if position in INPUT_KINDS:
            aan = [i for i in range(self._blocks()) if self.layer(i).attention.aan]
            if aan:
                raise ValueError(
                    f"position {position!r} adds each block's position to its attention's input before the "
                    f"projections; the average attention network (attention.aan) has none: blocks {aan}"
                )
        stack = self.stack
        for index in range(self._blocks()):
            attention = self.layer(index).attention
            check_relative(
                position, self._bound[index].spec, qk_norm=attention.qk_norm,
                collaborative=attention.collaborative is not None, maps=stack.attention_maps != "none",
                where=f"block {index}'s attention",
            )  # fmt: skip
        sizes = sorted({self.head_size(self.layer(i).attention) for i in range(self._blocks())})
        if position == "transformer_xl" and len(sizes) > 1:
            raise ValueError(
                f"position 'transformer_xl' shares u and v [heads, d_head] across the layers: every block needs "
                f"one head size; got {sizes} (attention.d_head in stack.layer_overrides)"
            )
        if stack.filters and position in ("transformer_xl", "tupe", *INPUT_KINDS):
            why = {
                "transformer_xl": "its W_{k,R} R_{i-j} is projected once per integer distance of the grid; a "
                "shortened grid's distances are fractional and span the input's length, which would need the "
                "sinusoid of every pair (O(n^2 d_model) memory)",
                "tupe": "its positional correlation reads the absolute embedding p_i of each token's position; a "
                "filtered token mixes many positions (DCT or pooling) and sits at a fractional one",
                "floater": "its ODE is read at t_i = i Δ of the integer grid, each block's input at its own "
                "positions; a filtered token mixes many positions and sits at a fractional one",
            }[position]
            raise ValueError(f"position {position!r} with stack.filters {stack.filters}: refused, {why}")

    def _check_causal(self):
        """`causal` false is refused where the task is causal; true on an encoder task
        (a unidirectional encoder) takes the plain transformer stack, whose blocks and
        sublayers are built causal, without what mixes positions outside the attention."""
        if self.causal is False and self.task in CAUSAL_TASKS:
            raise ValueError(
                f"model.causal false: task {self.task!r} is causal (a language model; seq2seq's decoder); "
                f"leave model.causal unset (None) or true"
            )
        if not self.causal_encoder:
            return
        stack, head = self.stack, self.head
        why = [
            (not isinstance(stack, TransformerStack), f"stack {stack.kind!r} (its blocks are built bidirectional; "
             "a unidirectional encoder takes stack 'transformer')"),
            (bool(getattr(stack, "filters", None)), f"stack.filters {getattr(stack, 'filters', None)} (Funnel "
             "pooling and the Fourier filter mix later positions into each kept token)"),
            (getattr(stack, "token_learner", None) is not None, "stack.token_learner (its learned tokens are "
             "weighted sums over the whole sequence)"),
            (getattr(head, "kind", None) == "cls", "head 'cls' (the CLS token at position 0 would see no token: "
             "use head last, the last real token, or mean)"),
        ]  # fmt: skip
        refused = [reason for on, reason in why if on]
        if refused:
            raise ValueError(
                f"model.causal true on task {self.task!r} (a unidirectional encoder) is refused with "
                f"{'; '.join(refused)}"
            )

    def _check_stack(self):
        kind, stack = self.stack.kind, self.stack
        if isinstance(stack, HIERARCHICAL_STACK_TYPES):  # transformer Blocks of the named attention: checked bound
            return
        tasks = STACKS[kind][1]
        if self.task not in tasks:
            raise ValueError(f"stack {kind!r} serves tasks {list(tasks)}; got task {self.task!r}")
        if isinstance(stack, TransformerStack):
            self._check_transformer_stack(stack)
            return
        if isinstance(stack, UniversalStack):  # blocks of the named attention: _check_adaptive
            return
        if isinstance(stack, MemformerStack):  # blocks of the named attention: _check_memformer
            return
        if kind in CELL_STACKS:
            self._check_cell_stack()
        elif self.attention != AttentionConfig():
            raise ValueError(
                f"stack {kind!r} builds its own softmax attentions; leave model.attention at its "
                f"default (got {self.attention.to_value()!r})"
            )
        decoder = self.decoder
        if kind == "luna" and decoder is not None:
            given = {
                "cross_attention": decoder.cross_attention != AttentionConfig(),
                "ffn false": not decoder.ffn,
                "transparent": decoder.transparent,
            }
            if any(given.values()):
                raise ValueError(
                    f"stack 'luna' builds its decoder's encoder attention (Luna's pack and unpack) and FFN itself; "
                    f"leave decoder's {sorted(n for n, on in given.items() if on)} at their defaults"
                )
        if self.kv_heads not in (None, self.num_heads):
            raise ValueError(
                f"stack {kind!r} has no grouped-query attention; kv_heads ({self.kv_heads}) must equal "
                f"num_heads ({self.num_heads}) or be left unset"
            )
        position = self.embedding.position
        if kind in RECURRENT_STACKS:
            if position != "none":
                raise ValueError(
                    f"stack {kind!r} has its own relative positions (R, u, v): set embedding.position "
                    f"'none'; got {position!r}"
                )
            if self.dtype != "float32":
                raise ValueError(f"stack {kind!r} runs in float32 only; got dtype {self.dtype!r}")
        elif position in (*BIAS_KINDS, *ROTARY_KINDS, *RELATIVE_KINDS, *INPUT_KINDS):
            raise ValueError(
                f"stack {kind!r} takes positions added to the embeddings ({', '.join(ADDED_KINDS)}) or none; "
                f"got {position!r}"
            )
        if kind == "perceiver" and getattr(self.head, "kind", None) == "cls":
            raise ValueError(
                "a perceiver has no CLS token: pool its latents with head 'mean' (the paper's average) or 'pma'"
            )
        if isinstance(stack, PerceiverStack):
            check_fourier(stack.fourier_bands, stack.fourier_grid, stack.fourier_max_freq, self.max_len)
            if stack.fourier_bands and position != "none":
                raise ValueError(
                    f"stack.fourier_bands ({stack.fourier_bands}) gives the Perceiver its positions as Fourier "
                    f"features, concatenated: set embedding.position 'none' (got {position!r})"
                )

    def _check_cell_stack(self):
        """A whole-model design whose blocks take the model's attention at their own widths
        (`jxformers.nn.cells`): the attention module's options are the transformer
        stack's, and its norms are the blocks' own (layernorm, rmsnorm, scalenorm, adanorm)."""
        stack, plain = self.stack, AttentionConfig()
        attentions = {"model.attention": self.attention}
        if self.decoder is not None:  # a seq2seq decoder's cells build their attend-to-encoder branches from it
            attentions["decoder.cross_attention"] = self.decoder.cross_attention
        for where, attention in attentions.items():
            given = {
                f.name: getattr(attention, f.name)
                for f in dataclasses.fields(AttentionConfig)
                if f.name not in ("name", "hyper_parameters", "impl")
                and getattr(attention, f.name) != getattr(plain, f.name)
            }
            if given:
                raise ValueError(
                    f"stack {stack.kind!r} builds its attentions at its own widths and head counts: an attention's "
                    f"name, hyper-parameters and impl; the module options {given} of {where} are stack "
                    "'transformer''s"
                )
        if self.norm.kind == "powernorm":
            raise ValueError(
                f"stack {stack.kind!r}: norm 'powernorm' keeps running statistics that only the "
                "transformer stack's blocks thread; use layernorm, rmsnorm, scalenorm or adanorm"
            )
        assert isinstance(stack, CELL_STACK_TYPES)
        stack.check_model(self)

    def _check_transformer_stack(self, stack: TransformerStack):
        for index in stack.layer_overrides:
            if not 0 <= index < self._blocks():
                raise ValueError(
                    f"stack.layer_overrides: block {index} does not exist (num_layers = {self.num_layers})"
                )
        if stack.reversible and (self.task == "seq2seq" or self.norm.placement != "pre" or stack.filters):
            raise ValueError(
                "stack.reversible needs norm placement 'pre', no filters, and task classify, retrieval or lm"
            )
        if stack.filters and self.task == "lm":
            raise ValueError("stack.filters (downsampling) apply to encoders: tasks classify, retrieval, seq2seq")
        for index in stack.filters:
            if not 0 <= index < self.num_layers:
                raise ValueError(
                    f"stack.filters maps an encoder block index in [0, {self.num_layers}) to a keep "
                    f"ratio; got block {index}"
                )
        tl = stack.token_learner
        if tl is not None:
            tl.check_layers(self.num_layers)
            if self.task not in ENCODER_TASKS:
                raise ValueError(
                    f"stack.token_learner pools tokens across the whole sequence, so it serves encoders "
                    f"(tasks classify, retrieval); a causal {self.task!r} model cannot use it"
                )
            if stack.reversible or stack.filters:
                raise ValueError(
                    f"stack.token_learner needs no filters and no reversible wiring; got filters "
                    f"{stack.filters}, reversible {stack.reversible}"
                )
            if self.embedding.position not in (*ADDED_KINDS, "none"):
                raise ValueError(
                    f"stack.token_learner: learned tokens have no positions, so position must be added "
                    f"to the embeddings ({', '.join(ADDED_KINDS)}) or none; got {self.embedding.position!r}"
                )

    def _check_head(self):
        head = self.head
        assert head is not None  # resolved from the task in __post_init__
        if isinstance(head, PooledHead) != (self.task in ENCODER_TASKS):
            serves = "classify, retrieval" if isinstance(head, PooledHead) else "lm, seq2seq"
            raise ValueError(f"head {head.kind!r} serves tasks {serves}; got task {self.task!r}")
        if isinstance(head, MixtureHead):
            if self.task != "lm" or not isinstance(self.stack, TransformerStack):
                raise ValueError(
                    f"head {head.kind!r} needs task 'lm' and stack 'transformer'; got task "
                    f"{self.task!r}, stack {self.stack.kind!r}"
                )
            if self.vocab_size not in (PIXEL_VALUES, PIXEL_VALUES + 1):
                raise ValueError(
                    f"head {head.kind!r} models pixel values 0..255: vocab_size must be {PIXEL_VALUES} "
                    f"(pixels) or {PIXEL_VALUES + 1} (pixels and a start token); got {self.vocab_size}"
                )

    def _check_norm_placement(self):
        """The placements beyond pre and post are the transformer block's (nn.residual)."""
        placement = self.norm.placement
        if placement in ("pre", "post"):
            return
        if not isinstance(self.stack, TransformerStack) or getattr(self.head, "kind", None) == "pma":
            raise ValueError(
                f"norm.placement {placement!r} is built into the transformer stack's blocks; stacks isab, luna, "
                f"perceiver, transformer_xl, compressive and the pma head take 'pre' or 'post'; got stack "
                f"{self.stack.kind!r}, head {getattr(self.head, 'kind', None)!r}"
            )
        if placement in ("deepnorm", "normformer", "tfixup", "fixup"):
            kinds = sorted({self.layer(i).ffn.kind for i in range(self._blocks())} - set(FFN_KINDS))
            if kinds:
                what = {"deepnorm": "draws the dense FFN's matrices with DeepNet's gain",
                        "tfixup": "draws the dense FFN's matrices with T-Fixup's scale",
                        "fixup": "draws the dense FFN's matrices with Fixup's scales and adds its scalar biases",
                        "normformer": "normalises the dense FFN's hidden layer"}[placement]  # fmt: skip
                raise ValueError(
                    f"norm.placement {placement!r} {what}; it takes a dense ffn in every block "
                    f"({list(FFN_KINDS)}); got {kinds}"
                )
        if placement == "normformer" and any(self.layer(i).attention.aan for i in range(self._blocks())):
            raise ValueError(
                "norm.placement 'normformer' scales each head's output; the attention 'average' has no heads"
            )

    def _check_ffns(self):
        """Dense FFNs go anywhere; the sparse FFN in transformer blocks; moe and pkm in
        transformer blocks of classify and lm, without reversible wiring."""
        ffns = [self.layer(i).ffn for i in range(self._blocks())]
        if not isinstance(self.ffn, FeedForwardConfig) and not isinstance(self.stack, TransformerStack):
            raise ValueError(
                f"stack {self.stack.kind!r} takes a dense ffn ({sorted(FFN_KINDS)}); got {self.ffn.kind!r}"
            )
        self._check_all_attention(ffns)
        overrides = getattr(self.stack, "layer_overrides", {})
        placed = sorted(i for i, o in overrides.items() if isinstance(o.ffn, MoEConfig) and o.ffn.every != 1)
        if placed:
            raise ValueError(
                f"ffn.every places the model's experts every k-th block; a block override's ffn is that block's "
                f"alone: drop every from stack.layer_overrides of blocks {placed}"
            )
        sparse = [f for f in ffns if isinstance(f, (MoEConfig, PKMConfig, SparseFFNConfig))]
        if not sparse:
            return
        routed = [f for f in sparse if not isinstance(f, SparseFFNConfig)]
        reversible = getattr(self.stack, "reversible", False)
        if routed and (reversible or self.task not in ("classify", "lm")):
            raise ValueError(
                f"ffn {routed[0].kind!r} needs stack 'transformer', task classify or lm, and no reversible "
                f"wiring; got task {self.task!r}, reversible {reversible}"
            )
        if not isinstance(self.ffn, FeedForwardConfig) and getattr(self.head, "kind", None) == "pma":
            raise ValueError(
                f"head 'pma' builds its own FeedForward of the model's ffn: with ffn {self.ffn.kind!r} "
                f"make the model's ffn dense and put {self.ffn.kind!r} in blocks through "
                f"stack.layer_overrides"
            )
        for ffn in sparse:
            if isinstance(ffn, MoEConfig):
                ffn.check_causal(bool(self.causal))
            elif isinstance(ffn, PKMConfig):
                ffn.check_model(d_model=self.d_model, causal=bool(self.causal))
            else:
                ffn.check_model(d_model=self.d_model)
        self._check_token_ids(ffns)

    def _check_token_ids(self, ffns: list[FFNConfig]):
        """Hash routing reads each row's token id: the rows of an encoder block after a
        filter (downsampling, Funnel) or the TokenLearner are no tokens, so a hash-routed
        MoE is refused there."""
        stack = self.stack
        if not isinstance(stack, TransformerStack):
            return
        last, why = self.num_layers, ""
        if stack.filters:
            last, why = min(stack.filters), f"stack.filters {stack.filters} shortens the rows before block"
        tl = stack.token_learner
        if tl is not None and tl.after_layer + 1 < last:
            last = tl.after_layer + 1
            why = f"stack.token_learner learns tokens after block {tl.after_layer}, from block"
        for index, ffn in enumerate(ffns):
            if isinstance(ffn, MoEConfig) and ffn.router == "hash" and index >= last:
                raise ValueError(
                    f"ffn moe router 'hash' at block {index} routes by token id, but {why} {last}: its rows are no "
                    f"tokens; use hash routing in blocks before {last} (stack.layer_overrides) or another router"
                )

    def _check_all_attention(self, ffns: list[FFNConfig]):
        """ffn none (the all-attention layer, Sukhbaatar et al. 2019 section 4) replaces the
        FFN by the attention's persistent vectors: refused without them."""
        for index, ffn in enumerate(ffns):
            if not isinstance(ffn, NoFeedForward):
                continue
            persistent = self.layer(index).attention.hyper_parameters.get("persistent_kv", 0)
            if not persistent:
                raise ValueError(
                    f"ffn 'none' at block {index} (the all-attention layer) replaces the FFN by persistent "
                    f"key/value vectors: give that block's attention persistent_kv > 0 (softmax, chunked); got "
                    f"attention {self.layer(index).attention.name!r} with persistent_kv={persistent}"
                )
            if getattr(self.stack, "reversible", False):
                raise ValueError("ffn 'none': reversible wiring pairs each attention with an FFN; got reversible True")
            if getattr(self.head, "kind", None) == "pma":
                raise ValueError(
                    "head 'pma' builds its own FeedForward of the model's ffn: with ffn 'none' make the model's ffn "
                    "dense and put 'none' in blocks through stack.layer_overrides"
                )

    def _check_extra_tokens(self):
        """Memory tokens and registers (`embedding.extra_tokens`) need one transformer
        stack at one length that holds them."""
        m, kind = self.embedding.extra_tokens, self.embedding.extra_kind
        if not m:
            if kind != "memory":
                raise ValueError(f"embedding.extra_kind {kind!r} needs embedding.extra_tokens > 0; got {m}")
            return
        stack = self.stack
        if not isinstance(stack, TransformerStack):
            raise ValueError(
                f"embedding.extra_tokens={m} ({kind}) run through every layer of stack 'transformer'; got stack "
                f"{stack.kind!r} (its own latents, packed sequence or recurrent memory play that part)"
            )
        if stack.filters or stack.token_learner is not None:
            raise ValueError(
                f"embedding.extra_tokens={m} sit at fixed rows of one sequence length: no stack.filters and no "
                f"stack.token_learner; got filters={stack.filters}, token_learner={stack.token_learner}"
            )
        if self.task == "lm" and kind != "memory":
            raise ValueError(
                f"embedding.extra_kind={kind!r} in a causal lm: registers follow the real tokens, so no real token "
                "could attend them; use 'memory' (prepended, attended by every token)"
            )
        cls = int(self.task in ENCODER_TASKS and getattr(self.head, "kind", None) == "cls")
        if m + cls >= self.max_len:
            raise ValueError(
                f"embedding.extra_tokens={m} (+{cls} CLS) leave no room for a token within max_len={self.max_len}: "
                f"need extra_tokens + CLS < max_len"
            )

    def _check_embedding(self):
        """BERT's options (embedding scale, norm and token types; norm epsilon; no final
        norm) are built by the transformer stack only."""
        given = {
            f"embedding.{k}": v
            for k, v in dataclasses.asdict(self.embedding).items()
            if k != "position" and v != getattr(EmbeddingConfig(), k)
        }
        given |= {
            f"norm.{k}": getattr(self.norm, k)
            for k in ("eps", "final")
            if getattr(self.norm, k) != getattr(NormConfig(), k)
        }
        self._check_extra_tokens()
        if given and not isinstance(self.stack, TransformerStack):
            raise ValueError(
                f"{sorted(given)} apply to stack 'transformer'; got stack {self.stack.kind!r} with {given}"
            )
        ends_normed = self.norm.placement in OUTPUT_NORMED and self.task in ENCODER_TASKS
        if not self.norm.final and not ends_normed and self.norm.placement not in NORM_FREE:
            normed, free = " or ".join(map(repr, OUTPUT_NORMED)), " or ".join(map(repr, NORM_FREE))
            raise ValueError(
                f"norm.final False needs blocks that end normalised (placement {normed}; BERT's encoder) and an "
                f"encoder task (classify, retrieval), or placement {free} (the papers' models have no norm at all); "
                f"got placement "
                f"{self.norm.placement!r}, task {self.task!r}"
            )

    def _check_local(self):
        """CPE's PEGs sit between transformer blocks of one token grid, and R-Transformer's
        LocalRNN or Mask Attention Networks' DMAN runs before each block's attention: where
        any would read rows that are no grid (learned tokens), skip a block's keys (Funnel)
        or break the wiring (reversible), they are refused (`jxformers.nn.local`,
        `jxformers.nn.mask_attention`)."""
        stack, cpe = self.stack, self.embedding.cpe
        if not isinstance(stack, TransformerStack):
            return  # cpe: _check_embedding refuses it there; local_rnn is the transformer stack's
        if cpe is not None:
            layers = min(self.num_layers, self.decoder_layers) if self.task == "seq2seq" else self.num_layers
            bad = [a for a in cpe.after if not -1 <= a < layers]
            if bad:
                decoder = f", decoder layers {self.decoder_layers}" if self.task == "seq2seq" else ""
                raise ValueError(
                    f"embedding.cpe.after names blocks in [-1, {layers}) (-1: the embeddings; num_layers "
                    f"{self.num_layers}{decoder}); got {bad}"
                )
            if self.task != "lm" and cpe.kernel_size % 2 == 0:
                raise ValueError(
                    f"embedding.cpe.kernel_size must be odd in an encoder (task {self.task!r}): its centred kernel "
                    f"pads k // 2 zeros on each side; got {cpe.kernel_size} (a causal lm takes any k)"
                )
            if stack.reversible and max(cpe.after) >= 0:
                raise ValueError(
                    f"embedding.cpe with stack.reversible: reversible wiring recomputes each block from its output, "
                    f"which a PEG between blocks would break; PEGs on the embeddings only (after [-1]); got after "
                    f"{list(cpe.after)}"
                )
            tl = stack.token_learner
            if tl is not None and max(cpe.after) >= tl.after_layer:
                raise ValueError(
                    f"embedding.cpe.after {list(cpe.after)}: the tokens are learned after block {tl.after_layer} "
                    f"(stack.token_learner), a set with no order for a PEG to convolve; put PEGs before it "
                    f"(after < {tl.after_layer})"
                )
        local = stack.local_rnn
        if local is None and not stack.dman:
            return
        name = "stack.local_rnn" if local is not None else "stack.dman"
        if local is not None and stack.dman:
            raise ValueError(
                "stack.local_rnn and stack.dman each put sublayers before every block's attention (R-Transformer's "
                "LocalRNN, Mask Attention Networks' DMAN): choose one"
            )
        if self.norm.placement not in ("pre", "post"):
            raise ValueError(
                f"{name}'s sublayers have their own norm: on their input (pre) or after their residual sum "
                f"(post, both papers'); got norm.placement {self.norm.placement!r}"
            )
        why = [
            (stack.reversible, "reversible", "reversible wiring runs each block as one attention and one FFN"),
            (stack.token_learner is not None, "token_learner", "the learned tokens are a set, with no window of "
             "preceding positions nor distances between them"),
            (stack.downsample == "funnel" and bool(stack.filters), "funnel", "Funnel's pooling block takes its keys "
             "from the unpooled stream, which its sublayers before the attention would not see"),
        ]  # fmt: skip
        refused = {setting: reason for on, setting, reason in why if on}
        if refused:
            raise ValueError(f"{name} is refused with {sorted(refused)}: {'; '.join(refused.values())}")

    def _check_heads(self, attention: AttentionConfig, spec: registry.AttentionSpec, where: str) -> None:
        """The improved multi-heads (`jxformers.nn.heads`) fit the attention they are set on."""
        options = {n: getattr(attention, n) for n in HEAD_OPTIONS}
        rope = self.embedding.position in ROTARY_KINDS
        check_head_options(spec, qk_norm=attention.qk_norm, rope=rope, where=where, **options)
        check_input_mixer(
            spec, cross=where == "decoder.cross_attention", num_heads=self.num_heads, kv_heads=self.kv_heads,
            d_head=attention.d_head, rope=rope, head_scale=self.norm.placement == "normformer",
            projection=attention.projection, head_options=options, where=where,
        )  # fmt: skip

    def _check_sparse_qkv(self):
        """The sparse QKV layer (`attention.projection: sparse`, `jxformers.nn.scaling`)
        makes the self-attention of one sequence's blocks of the transformer stack: its
        sizes fit the model, and what reads or feeds the projections otherwise is refused."""
        stack = self.stack
        for where, attention in self._attention_configs():
            if attention.projection != "sparse":
                continue
            check_sparse_qkv(
                d_model=self.d_model, num_heads=self.num_heads, kv_heads=self.kv_heads, d_head=attention.d_head,
                modules=attention.modules, conv_length=attention.conv_length, conv_modules=attention.conv_modules,
                where=where,
            )  # fmt: skip
            refused = {
                "decoder.cross_attention": where == "decoder.cross_attention",
                f"stack {stack.kind!r} (the transformer stack's blocks only)": not isinstance(stack, TransformerStack),
                "attention.aan or collaborative heads (projections of their own)": bool(
                    attention.aan or attention.collaborative
                ),
            }
            if isinstance(stack, TransformerStack):
                refused["stack.attention_maps (formed from dense projections)"] = stack.attention_maps != "none"
                refused["stack.downsample 'funnel' (pooled queries, unpooled keys)"] = (
                    stack.downsample == "funnel" and bool(stack.filters)
                )
            bad = [n for n, on in refused.items() if on]
            if bad:
                raise ValueError(
                    f"{where}: projection 'sparse' (the sparse QKV layer) convolves one sequence's positions into "
                    f"its q, k and v; refused with {bad}"
                )

    def _check_attentions(self):
        """The capability contracts of every bound attention."""
        self._check_sparse_qkv()
        for index in range(self._blocks()):
            self._check_attention(self._bound[index])
            check_qk_norm(self.layer(index).attention.qk_norm, self._bound[index].spec, self.max_len)
            self._check_heads(self.layer(index).attention, self._bound[index].spec, f"block {index}'s attention")
        self._check_relative()
        tied = sorted({b.name for b in self._bound if b.layer_shared})
        if tied and not isinstance(self.stack, TransformerStack):
            raise ValueError(
                f"attention {tied} shares its arrays across layers (Linformer's sharing 'layerwise'), which the "
                f"transformer stack's layers hold once; stack {self.stack.kind!r} holds its layers otherwise: use "
                "sharing 'kv' or 'headwise' there"
            )
        if self.decoder is not None:
            spec = self._bound[-1].spec
            check_qk_norm(self.decoder.cross_attention.qk_norm, spec, self.max_len)
            self._check_heads(self.decoder.cross_attention, spec, "decoder.cross_attention")
            if not spec.supports_cross:
                raise ValueError(
                    f"decoder.cross_attention {spec.name!r} cannot cross-attend; ones that can: "
                    f"{registry.names(supports_cross=True)}"
                )
        stack = self.stack
        if isinstance(stack, TransformerStack) and stack.attention_maps != "none":
            kind = stack.attention_maps
            if stack.reversible or stack.filters or stack.token_learner is not None:
                raise ValueError(
                    f"stack.attention_maps={kind!r} passes a [heads, n, n] map from block to block: it needs "
                    f"plain wiring and one length throughout; got reversible={stack.reversible}, "
                    f"filters={stack.filters}, token_learner={stack.token_learner}"
                )
            if kind == "predictive" and self.causal:
                raise ValueError(
                    f"stack.attention_maps='predictive' convolves the previous layer's maps over the query axis, "
                    f"so a query would read later queries' rows: tasks classify and retrieval only; got task "
                    f"{self.task!r}" + (", model.causal true (a unidirectional encoder)" if self.causal_encoder else "")
                )
            for index in range(self._blocks()):
                check_maps(kind, self._bound[index], f"block {index}'s attention")
                attention = self.layer(index).attention
                heads = {
                    "collaborative": attention.collaborative is not None,
                    "disagreement": bool(attention.disagreement),
                    "head_aggregation": attention.head_aggregation != "concat",
                }
                if any(heads.values()):
                    raise ValueError(
                        f"stack.attention_maps={kind!r} forms each layer's maps from plain heads; block {index}'s "
                        f"attention sets {[n for n, on in heads.items() if on]} (improved multi-heads), "
                        "which the carried maps do not take"
                    )
        if isinstance(stack, TransformerStack) and stack.downsample == "funnel":
            for index in stack.filters:
                spec = self._bound[index].spec
                if not spec.supports_cross:
                    raise ValueError(
                        f"stack.downsample 'funnel' at block {index}: its attention takes pooled "
                        f"queries and unpooled keys, which {spec.name!r} cannot; use one of "
                        f"{registry.names(supports_cross=True)} there (stack.layer_overrides)"
                    )

    def _check_adaptive(self):
        """The adaptive-computation models (`jxformers.nn.adaptive`): the Universal
        Transformer's shared step, CCT's gated sub-layers and the early exits run plain
        blocks of one sequence, so what reshapes the sequence, wires blocks otherwise or
        keeps per-step state outside the blocks is refused."""
        stack = self.stack
        universal = isinstance(stack, UniversalStack)
        exits = getattr(stack, "early_exit", None)
        cct = getattr(stack, "cct", None)
        if not (universal or exits is not None or cct is not None):
            return
        name = "stack 'universal'" if universal else ("stack.early_exit" if exits is not None else "stack.cct")
        if exits is not None and cct is not None:
            raise ValueError("stack.early_exit and stack.cct each drive the blocks' depth: choose one")
        if self.task not in ("classify", "lm"):
            raise ValueError(f"{name} serves tasks classify and lm; got task {self.task!r}")
        if isinstance(stack, TransformerStack):
            why = {
                "layer_overrides": bool(stack.layer_overrides) and cct is not None,
                "reversible": stack.reversible,
                "filters": bool(stack.filters),
                "token_learner": stack.token_learner is not None,
                "attention_maps": stack.attention_maps != "none",
                "local_rnn": stack.local_rnn is not None and cct is not None,
                "dman": stack.dman and cct is not None,
                # the layouts of jxformers.nn.layouts arrange a stack of Blocks; these stacks are one module
                "order": stack.order is not None,
                "sandwich": stack.sandwich > 0,
                "macaron": stack.macaron,
                "sharing": stack.sharing != "none",
                "layerdrop": stack.layerdrop > 0,
                "keep_layers": stack.keep_layers is not None,
                "prune": stack.prune is not None,
            }
            refused = sorted(n for n, on in why.items() if on)
            if refused:
                raise ValueError(
                    f"{name} runs plain blocks of one sequence, one after another; refused with stack settings "
                    f"{refused}"
                )
        if self.embedding.cpe is not None or self.embedding.extra_tokens:
            raise ValueError(
                f"{name}: no conditional positions (embedding.cpe) or extra tokens between or beside its blocks; got "
                f"cpe={self.embedding.cpe}, extra_tokens={self.embedding.extra_tokens}"
            )
        position = self.embedding.position
        if position in (*SCORE_KINDS, *INPUT_KINDS) and (universal or cct is not None):
            raise ValueError(
                f"{name}: positions computed inside each attention ({sorted({*SCORE_KINDS, *INPUT_KINDS})}) are "
                f"refused; use added, rotary or bias positions; got {position!r}"
            )
        bad = sorted({b.spec.name for b in self._bound if b.spec.updates_arrays})
        if universal and bad:
            raise ValueError(
                f"stack 'universal' runs its shared step under a scan: attentions that move arrays outside the "
                f"gradient (k-means centroids) are refused; got {bad}"
            )
        if cct is not None and (self.norm.placement != "pre" or isinstance(self.ffn, NoFeedForward)):
            raise ValueError(
                f"stack.cct gates x + g f(N(x)), skipping to the residual stream: norm.placement 'pre' and an FFN; "
                f"got placement {self.norm.placement!r}, ffn {self.ffn.kind!r}"
            )
        if universal:
            if stack.position_signal and position != "none":
                raise ValueError(
                    f"stack 'universal' adds the position's sinusoid before every step (position_signal): set "
                    f"embedding.position none, or position_signal false to use {position!r}"
                )
            return
        if exits is None:
            return
        rule = exits.rule or ("confidence" if self.task == "lm" else "patience")
        training = exits.training or ("aligned" if self.task == "lm" else "weighted")
        if self.task == "lm" and rule == "patience":
            raise ValueError(
                "stack.early_exit.rule 'patience' is PABEE's, over a classifier's internal predictions: task "
                "classify; a language model exits by confidence"
            )
        if self.task == "classify" and training == "mixed":
            raise ValueError(
                "stack.early_exit.training 'mixed' draws an exit per token of a sequence (Elbayad et al.): task lm; "
                "a classifier trains aligned or weighted"
            )
        if getattr(self.head, "kind", None) == "pma":
            raise ValueError("stack.early_exit: internal classifiers pool by cls or mean; got head 'pma'")
        if self.num_layers < 2:
            raise ValueError(f"stack.early_exit needs blocks to exit between: num_layers >= 2; got {self.num_layers}")
        given = {
            "threshold": (exits.threshold != 0.9, rule == "confidence"),
            "patience": (exits.patience != 2, rule == "patience"),
        }
        foreign = sorted(n for n, (set_, used) in given.items() if set_ and not used)
        if foreign:
            raise ValueError(f"stack.early_exit {foreign} belong to another rule than {rule!r}")

    def _check_cross_block(self):
        """The cross-block connections (Lin et al. 2021, section 6.2): transparent attention
        reads every encoder layer's output at one length; the Feedback Transformer's norms
        run per position inside its scan."""
        if self.decoder is not None and self.decoder.transparent:
            filters = getattr(self.stack, "filters", {})
            if filters:  # seq2seq takes no token learner or reversible wiring (_check_transformer_stack)
                raise ValueError(
                    f"decoder.transparent sums every encoder layer's output row by row, which needs one length "
                    f"throughout; stack.filters {filters} shorten the sequence between layers"
                )
        if self.stack.kind == "feedback" and self.norm.kind == "powernorm":
            raise ValueError(
                "stack 'feedback' with norm.kind 'powernorm': PowerNorm counts its running statistics over the "
                "rows of each call, and the Feedback Transformer's norms also normalise the memory at every "
                "position, which would count it; use layernorm, rmsnorm, scalenorm or adanorm"
            )

    def _check_memformer(self):
        """Memformer's blocks run once per segment inside a scan (`jxformers.nn.memformer`):
        what a block makes besides its output must reduce over the segments, and the
        segment must fit the positions."""
        stack = self.stack
        if not isinstance(stack, MemformerStack):
            return
        if stack.segment_len > self.max_len:
            raise ValueError(f"stack.segment_len ({stack.segment_len}) must be <= max_len ({self.max_len})")
        updating = [b.name for b in self._bound if b.spec.updates_arrays]
        if updating:
            raise ValueError(
                f"stack 'memformer' runs its blocks once per segment inside a scan; attention {updating[0]!r} "
                "moves its k-means centroids from every call's inputs, which the scan does not hand out"
            )
        if self.norm.kind == "powernorm":
            raise ValueError(
                "stack 'memformer' with norm.kind 'powernorm': its running statistics are threaded by the "
                "transformer stack alone; use layernorm, rmsnorm, scalenorm or adanorm"
            )
        if self.embedding.extra_tokens:
            raise ValueError(
                f"stack 'memformer' keeps its memory in its slots; embedding.extra_tokens "
                f"({self.embedding.extra_tokens}) would be a second memory: set 0"
            )

    def _check_layouts(self):
        """The sublayer orders (Sandwich), Macaron, ALBERT's sharing and factorised
        embedding, and LayerDrop fit the model (`jxformers.nn.layouts`)."""
        stack = self.stack
        if not isinstance(stack, TransformerStack):
            return
        layers = (self.num_layers, self.decoder_layers) if self.task == "seq2seq" else (self.num_layers,)
        if stack.sandwich and stack.sandwich >= min(layers):
            raise ValueError(
                f"stack.sandwich k orders s^k (sf)^(n-k) f^k: it needs k < num_layers (n); got k={stack.sandwich}, "
                f"num_layers={min(layers)}"
            )
        if stack.order is not None and stack.order.count("s") != self.num_layers:
            raise ValueError(
                f"stack.order has one s per block: {stack.order!r} has {stack.order.count('s')}, num_layers is "
                f"{self.num_layers}"
            )
        ordered = stack.order is not None or stack.sandwich > 0
        if ordered and self.task == "seq2seq":
            raise ValueError(
                "stack.order and stack.sandwich order a stack of s and f sublayers; a seq2seq decoder's blocks hold a "
                "third (cross-attention) the order does not place: tasks classify, retrieval, lm"
            )
        if ordered or stack.macaron:
            what = "stack.macaron" if stack.macaron else "stack.order" if stack.order else "stack.sandwich"
            ffns = sorted({self.layer(i).ffn.kind for i in range(self._blocks())} - set(FFN_KINDS))
            why = [
                (self.norm.placement not in ("pre", "post"), f"norm.placement {self.norm.placement!r} (pre or post: "
                 "each FFN sublayer has its own norm)"),
                (bool(ffns), f"ffn {ffns} (a dense FFN: its FFN sublayers are dense)"),
                (stack.reversible, "stack.reversible (it pairs one attention with one FFN)"),
                (stack.local_rnn is not None, "stack.local_rnn (R-Transformer's block is LocalRNN, attention, FFN)"),
                (stack.dman, "stack.dman (Mask Attention Networks' block is DMAN, SAN, FFN)"),
                (stack.downsample == "funnel" and bool(stack.filters), "funnel filters (the pooled keys would skip "
                 "the FFNs before an attention)"),
                (self.decoder is not None and not self.decoder.ffn, "decoder.ffn false (Macaron's decoder keeps its "
                 "two half FFNs)"),
            ]  # fmt: skip
            refused = [reason for on, reason in why if on]
            if refused:
                raise ValueError(f"{what} is refused with {'; '.join(refused)}")
        if stack.sharing != "none":
            spec = [self._bound[i].spec.name for i in range(self._blocks()) if self._bound[i].spec.updates_arrays]
            why = [
                (ordered and stack.sharing != "attention", "stack.order / sandwich (its blocks differ in their FFN "
                 "sublayers; sharing 'attention' takes them)"),
                (stack.attention_maps != "none", f"stack.attention_maps {stack.attention_maps!r} (its blocks differ: "
                 "the first computes maps, the others reuse or convolve them)"),
                (self.embedding.position == "floater", "position 'floater' (each block reads its own row of the "
                 "ODE's solution)"),
                (self.norm.placement == "admin", "norm.placement 'admin' (its profile sets each block's own skip "
                 "weights)"),
                (self.norm.kind == "powernorm", "norm.kind 'powernorm' (its running statistics are one block's)"),
                (bool(spec), f"attention {spec[:1]} (it updates per-layer arrays outside the gradient)"),
            ]  # fmt: skip
            refused = [reason for on, reason in why if on]
            if refused:
                raise ValueError(f"stack.sharing={stack.sharing!r} is refused with {'; '.join(refused)}")
        pruned = stack.keep_layers is not None or stack.prune is not None
        if stack.layerdrop or pruned:
            bad = [i for i in stack.keep_layers or () if i >= min(layers)]
            if bad:
                raise ValueError(f"stack.keep_layers names blocks in [0, {min(layers)}); got {bad}")
            updating = [self._bound[i].spec.name for i in range(self._blocks()) if self._bound[i].spec.updates_arrays]
            tl = stack.token_learner
            why = [
                (stack.reversible, "stack.reversible (its backward recomputes every block from the next)"),
                (stack.attention_maps != "none", f"stack.attention_maps {stack.attention_maps!r} (a skipped block "
                 "would leave the next without its maps)"),
                (tl is not None and tl.fuse, "stack.token_learner with fuse (each later block is its own "
                 "TokenLearner, TokenFuser pair)"),
                (bool(stack.layerdrop) and self.norm.placement == "admin", "norm.placement 'admin' (its profile "
                 "reads every branch)"),
                (bool(stack.layerdrop) and self.norm.kind == "powernorm", "norm.kind 'powernorm' (a skipped "
                 "block's statistics would be updated from nothing)"),
                (bool(stack.layerdrop) and bool(updating), f"attention {updating[:1]} (its k-means centroids are "
                 "updated from every block's inputs)"),
            ]  # fmt: skip
            refused = [reason for on, reason in why if on]
            if refused:
                what = "stack.layerdrop" if stack.layerdrop else "stack.keep_layers / prune"
                raise ValueError(f"{what} is refused with {'; '.join(refused)}")
