"""`ModelConfig` and `build_model`: a model from a name and hyper-parameters.

    >>> config = ModelConfig(task="lm", vocab_size=256, attention="performer",
    ...                      attention_kwargs={"num_features": 64})
    >>> model = build_model(config, key=jax.random.key(0))
    >>> logits = model(tokens)              # [seq, 256]

A config can also be a plain dict or YAML (text or a path). Everything is checked before
any array is made: unknown keys, ill-typed or out-of-range values, an unknown attention
or hyper-parameter, and an attention that cannot do what the task needs (a non-causal
attention in a language model, a bias position scheme with an attention that takes no
bias) are ValueErrors that list the options.
"""

import dataclasses
import os
import typing
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import yaml

from jxformers import registry
from jxformers.kernels import IMPLS
from jxformers.validate import check_fields, from_mapping
from jxformers.nn.attention import Attention
from jxformers.nn.blocks import NORM_PLACEMENTS, Block
from jxformers.nn.layers import FFN_KINDS, NORM_KINDS, FeedForward, make_norm
from jxformers.nn.luna import LunaStack
from jxformers.nn.mixture import PIXEL_VALUES, MixtureOfLogistics
from jxformers.nn import moe as moe_lib
from jxformers.nn import pkm as pkm_lib
from jxformers.nn.models import (
    DOWNSAMPLE_KINDS,
    POOLING_KINDS,
    Classifier,
    DualClassifier,
    Embedding,
    Encoder,
    EncoderDecoder,
    LanguageModel,
)
from jxformers.nn.perceiver import PerceiverEncoder
from jxformers.nn.recurrent import COMPRESSIONS, RECURRENT_ARCHITECTURES, RecurrentLM
from jxformers.nn.positions import BIAS_KINDS, POSITION_KINDS, Positions
from jxformers.nn.set_transformer import ISAB, PMA
from jxformers.nn import tokenlearner as tokenlearner_lib

TASKS = ("classify", "retrieval", "lm", "seq2seq")
DTYPES = ("float32", "bfloat16", "float16")
OUTPUT_HEADS = ("softmax", "mixture_of_logistics")
OVERRIDABLE = ("attention", "attention_kwargs", "impl", "ffn", "d_ff")
# FFN choices of a config: the FeedForward kinds, a mixture of experts, a product-key memory
CONFIG_FFNS = (*FFN_KINDS, "moe", "pkm")
# architecture -> (the norm placement its paper uses, the tasks it serves, what it is)
_ARCHITECTURES = {
    "transformer": ("pre", TASKS, "blocks of the named attention"),
    "isab": ("post", ("classify", "retrieval"), "Set Transformer's ISAB blocks (Lee et al. 2019)"),
    "luna": ("post", ("classify", "retrieval", "lm"), "Luna layers carrying a packed sequence (Ma et al. 2021)"),
    "perceiver": ("pre", ("classify", "retrieval"), "latent array cross-attending the input (Jaegle et al. 2021)"),
    "transformer_xl": ("post", ("lm",), "segment-level recurrence, relative positions (Dai et al. 2019)"),
    "compressive": ("post", ("lm",), "Transformer-XL plus a compressed memory (Rae et al. 2020)"),
}
ARCHITECTURES = tuple(_ARCHITECTURES)
_CHOICES = {
    "architecture": ARCHITECTURES, "task": TASKS, "ffn": CONFIG_FFNS, "position": POSITION_KINDS, "norm": NORM_KINDS,
    "norm_placement": NORM_PLACEMENTS, "pooling": POOLING_KINDS, "dtype": DTYPES, "downsample": DOWNSAMPLE_KINDS,
    "impl": IMPLS, "compression": COMPRESSIONS, "output_head": OUTPUT_HEADS,
}


# Not runtime type-checked by jaxtyping: values come from users' YAML, and the checks in
# __post_init__ give errors that name the key and the allowed values.
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a model.

    Fields:
        task: "classify" (tokens -> class logits), "retrieval" (two token sequences ->
            class logits, dual tower), "lm" (causal language model) or "seq2seq".
        vocab_size, num_classes: token ids in [0, vocab_size); classes for classify/retrieval.
        num_layers: encoder (or decoder-only) blocks; decoder_layers: seq2seq decoder
            blocks (default num_layers).
        d_model, num_heads, kv_heads (grouped-query; default num_heads), d_ff (default 4 d_model).
        max_len: longest sequence (including the CLS token).
        attention, attention_kwargs: registry name and hyper-parameters of self-attention.
        cross_attention, cross_attention_kwargs: of seq2seq cross-attention.
        ffn: relu, gelu, geglu, swiglu, moe (a mixture of experts, `jxformers.nn.moe.MoE`,
            set by `moe`) or pkm (a product-key memory, set by `pkm`); per block through
            layer_overrides (Switch and GShard put experts in every other block).
            ffn_chunk_size: run the FFN over chunks of this many positions (Reformer's
            chunked feed-forward; None: all at once).
        moe: MoE settings (`jxformers.nn.moe.SETTINGS`): num_experts, top_k, router
            (token_choice, expert_choice), ffn (the experts' kind), second_policy,
            capacity_factor, eval_capacity_factor, min_capacity, dropless,
            dropless_method, shared_expert, jitter_eps, balance_weight, z_loss_weight; the weighted
            auxiliary losses are added to the training loss. Tasks classify and lm,
            architecture transformer, not reversible.
        pkm: product-key memory settings (`jxformers.nn.pkm.REQUIRED` and `SETTINGS`):
            num_keys (required), top_k, heads, d_key, query_norm (not in causal models).
        position: sinusoidal, learned, rope, alibi, t5, none.
        norm: layernorm or rmsnorm; norm_placement: pre or post (default: post for isab and luna, as
            their papers; pre for transformer and perceiver: Perceiver's paper, and for
            the transformer the stable choice (Xiong et al. 2020), not Vaswani's post).
        dropout: on residual branches and FFN hidden units.
        pooling: cls, mean or pma (Set Transformer's pooling by multihead attention
            with `pma_seeds` learned seeds; classify, retrieval). dtype: compute dtype
            (parameters stay float32).
        architecture: the layer stack. "transformer": `num_layers` blocks of the named
            attention. "isab": Set Transformer's induced set attention blocks (two full
            attention blocks each, through `memory_size` learned inducing points).
            "luna": Luna layers carrying a packed sequence of length `memory_size`
            from layer to layer (causal in an lm). "perceiver": a latent array of
            `memory_size` rows cross-attends to the input `cross_attends` times, each
            followed by a shared latent tower of `num_layers` blocks. The last three
            use softmax attention inside, as their papers. "transformer_xl": Dai et
            al.'s segment-level recurrence (each layer reads the last `mem_len` hidden
            states it saw, stop-gradient) with their relative positions (position must
            be "none"); "compressive": the same plus Rae et al.'s compressed memory of
            `cmem_len` slots, filled with evicted memories compressed at rate
            `compression_rate` by `compression` (conv, mean or max), trained by the
            attention-reconstruction loss. Both are `jxformers.nn.recurrent.RecurrentLM`
            (task lm); `eval_mem_len` (default mem_len) is the memory used in evaluation.
        tie_embeddings: output projection shares the embedding table (lm, seq2seq).
        filters: encoder block index i -> keep ratio r of the downsampling that sits
            right before block i, ahead of its attention, so block i and all later ones
            run at the shorter length; {0: 0.2} is seed 001's LRA setting (80% removed
            at the first layer). (Until this definition, i meant "after block i": old
            configs with {0: r} now shorten one block earlier.)
        downsample: "fourier" (seed 001's DCT filter with the paper's amplitude),
            "fourier_rescaled" (the same, scaled to keep the stream's amplitude) or
            "funnel" (Dai et al.'s pooled queries over the unpooled keys and values);
            see `Encoder`.
        impl: "auto", "xla", "pallas" or "interpret": how every attention the config
            names runs where it has a Pallas kernel (`jxformers.kernels.impl`); an
            `impl` in attention_kwargs wins. "pallas"/"interpret" with an attention that
            has no kernel is an error; "auto" uses a kernel where one fits.
        layer_overrides: block index -> any of attention, attention_kwargs, impl, ffn, d_ff.
        reversible: Reformer's reversible residual wiring (pre-norm; classify, retrieval
            and lm; no filters): activation memory independent of depth in training.
        token_learner: TokenLearner (Ryoo et al. 2021, `jxformers.nn.tokenlearner`):
            {after_layer: i, num_tokens: k, fuse: False, maps: "sigmoid" or "softmax",
            bottleneck: 64}: after encoder block i the tokens (not CLS) become k learned
            tokens for the later blocks; fuse: a TokenLearner and TokenFuser around
            every later block instead. Encoders only (classify, retrieval), architecture
            transformer, absolute positions (sinusoidal, learned, none), no filters,
            not reversible. Empty: none.
        embed_scale: multiply token embeddings by sqrt(d_model) (Vaswani et al.); BERT
            does not (False). embed_norm: a norm (kind `norm`) on the summed
            embeddings, BERT's embedding LayerNorm. type_vocab_size: token-type
            (segment) embeddings added to the tokens (0: none; BERT: 2); encoders take
            them as `token_types`. norm_eps: every norm's epsilon (None: LayerNorm
            1e-5, RMSNorm 1e-6; BERT 1e-12); architecture transformer. final_norm: the
            norm after the last block; BERT's post-norm encoder has none (False, only
            with norm_placement post and architecture transformer).
        output_head: "softmax" (a softmax over the vocabulary) or "mixture_of_logistics"
            (PixelCNN++'s discretized mixture of `mixture_components` logistics over the
            pixel values 0..255, seed 002's image head; `jxformers.nn.mixture`): task lm,
            architecture transformer, a vocabulary of the 256 values plus at most one
            start token; the loss is the mixture's negative log-likelihood.
    """

    task: str = "classify"
    vocab_size: int = 256
    num_classes: int = 2
    num_layers: int = 2
    d_model: int = 64
    num_heads: int = 4
    kv_heads: int | None = None
    d_ff: int | None = None
    max_len: int = 512
    attention: str = "softmax"
    attention_kwargs: dict = dataclasses.field(default_factory=dict)
    cross_attention: str = "softmax"
    cross_attention_kwargs: dict = dataclasses.field(default_factory=dict)
    ffn: str = "gelu"
    ffn_chunk_size: int | None = None
    position: str = "sinusoidal"
    norm: str = "layernorm"
    norm_placement: str | None = None
    dropout: float = 0.0
    pooling: str = "cls"
    dtype: str = "float32"
    tie_embeddings: bool = True
    decoder_layers: int | None = None
    filters: dict = dataclasses.field(default_factory=dict)
    downsample: str = "fourier"
    impl: str = "auto"
    layer_overrides: dict = dataclasses.field(default_factory=dict)
    moe: dict = dataclasses.field(default_factory=dict)
    pkm: dict = dataclasses.field(default_factory=dict)
    reversible: bool = False
    architecture: str = "transformer"
    memory_size: int = 16
    cross_attends: int = 1
    pma_seeds: int = 1
    token_learner: dict = dataclasses.field(default_factory=dict)
    mem_len: int = 0
    eval_mem_len: int | None = None
    cmem_len: int = 0
    compression: str = "conv"
    compression_rate: int = 3
    embed_scale: bool = True
    embed_norm: bool = False
    type_vocab_size: int = 0
    norm_eps: float | None = None
    final_norm: bool = True
    output_head: str = "softmax"
    mixture_components: int = 10

    def __post_init__(self):
        if self.norm_placement is None and isinstance(self.architecture, str):
            object.__setattr__(self, "norm_placement", _ARCHITECTURES.get(self.architecture, ("pre",))[0])
        check_fields(self, "config ", _CHOICES)
        object.__setattr__(self, "filters", _int_keys("filters", self.filters))
        object.__setattr__(self, "layer_overrides", _int_keys("layer_overrides", self.layer_overrides))
        object.__setattr__(self, "_layers", {})  # block index -> bound attention, ffn, d_ff
        self._check()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        return from_mapping(cls, values, "model", unknown_message="unknown model config key(s) {unknown}; known: {known}")

    @classmethod
    def from_yaml(cls, source: str | os.PathLike) -> "ModelConfig":
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
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ checks

    def _positive(self, name, value, minimum=1):
        if value is not None and value < minimum:
            raise ValueError(f"config {name} must be >= {minimum}; got {value}")

    def layer(self, index: int) -> dict[str, Any]:
        """Block `index`'s bound self-attention (`attention`), `ffn` and `d_ff` (bound once
        per config and remembered)."""
        if index in self._layers:
            return self._layers[index]
        values = {"attention": self.attention, "attention_kwargs": self.attention_kwargs, "impl": self.impl,
                  "ffn": self.ffn, "d_ff": self.d_ff or 4 * self.d_model} | dict(self.layer_overrides.get(index, {}))
        bound = bind_attention(values.pop("attention"), values.pop("attention_kwargs"), self.max_len,
                               impl=values.pop("impl"))
        self._layers[index] = values | {"attention": bound}
        return self._layers[index]

    def bound_cross_attention(self) -> registry.BoundAttention:
        return bind_attention(self.cross_attention, self.cross_attention_kwargs, self.max_len, impl=self.impl)

    def _check(self):
        for name in ("vocab_size", "num_classes", "num_layers", "d_model", "num_heads", "kv_heads", "d_ff", "max_len",
                     "decoder_layers", "memory_size", "cross_attends", "pma_seeds", "ffn_chunk_size"):
            self._positive(name, getattr(self, name))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"config dropout must be in [0, 1); got {self.dropout}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % (self.kv_heads or self.num_heads):
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.position == "rope" and (self.d_model // self.num_heads) % 2:
            raise ValueError(f"position 'rope' needs an even head size; d_model / num_heads = {self.d_model // self.num_heads}")
        for index, override in self.layer_overrides.items():
            if not 0 <= index < max(self.num_layers, self.decoder_layers or 0):
                raise ValueError(f"layer_overrides: block {index} does not exist (num_layers = {self.num_layers})")
            if not isinstance(override, Mapping) or set(override) - set(OVERRIDABLE):
                raise ValueError(f"layer_overrides[{index}] may set only {list(OVERRIDABLE)}; got {override!r}")
            if override.get("ffn", self.ffn) not in CONFIG_FFNS:
                raise ValueError(f"layer_overrides[{index}].ffn must be one of {list(CONFIG_FFNS)}")
        causal = self.task in ("lm", "seq2seq")
        self._check_sparse_ffns(causal)
        layers = (self.decoder_layers or self.num_layers) if self.task == "seq2seq" else self.num_layers
        for i in range(max(layers, self.num_layers)):
            spec = self.layer(i)["attention"].spec
            if causal and not spec.supports_causal:
                raise ValueError(
                    f"task {self.task!r} needs causal attention; {spec.name!r} is not causal. "
                    f"Causal attentions: {registry.names(supports_causal=True)}"
                )
            if self.position in BIAS_KINDS and not spec.takes_bias:
                raise ValueError(
                    f"position {self.position!r} adds a logit bias, which {spec.name!r} attention does not take; "
                    f"use rope, sinusoidal, learned or none, or one of {registry.names(takes_bias=True)}"
                )
        if self.task == "seq2seq":
            spec = self.bound_cross_attention().spec
            if not spec.supports_cross:
                raise ValueError(
                    f"cross_attention {spec.name!r} cannot cross-attend; ones that can: "
                    f"{registry.names(supports_cross=True)}"
                )
        if self.reversible and (self.task == "seq2seq" or self.norm_placement != "pre" or self.filters):
            raise ValueError("reversible blocks need norm_placement 'pre', no filters, and task classify, retrieval or lm")
        self._check_architecture()
        self._check_token_learner()
        self._check_embedding()
        self._check_output_head()
        if self.filters and self.task == "lm":
            raise ValueError("filters (downsampling) apply to encoders: tasks classify, retrieval, seq2seq")
        for index, ratio in self.filters.items():
            if not 0 <= index < self.num_layers or not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
                raise ValueError(
                    f"filters maps an encoder block index in [0, {self.num_layers}) to a keep ratio in (0, 1]; "
                    f"got {index}: {ratio!r}"
                )
            spec = self.layer(index)["attention"].spec
            if self.downsample == "funnel" and not spec.supports_cross:
                raise ValueError(
                    f"downsample 'funnel' at block {index}: its attention takes pooled queries and unpooled keys, "
                    f"which {spec.name!r} cannot; use one of {registry.names(supports_cross=True)} there "
                    f"(layer_overrides)"
                )


    def _check_embedding(self):
        """The BERT-style options (embedding scale, norm and token types; norm epsilon;
        no final norm): where they apply."""
        if self.type_vocab_size < 0:
            raise ValueError(f"config type_vocab_size must be >= 0 (0: no token types); got {self.type_vocab_size}")
        if self.norm_eps is not None and not (isinstance(self.norm_eps, (int, float)) and 0 < self.norm_eps < 1):
            raise ValueError(f"config norm_eps must be None or in (0, 1); got {self.norm_eps!r}")
        defaults = _defaults()
        names = ("embed_scale", "embed_norm", "type_vocab_size", "norm_eps", "final_norm")
        given = {n: getattr(self, n) for n in names if getattr(self, n) != defaults[n]}
        if given and self.architecture != "transformer":
            raise ValueError(f"{sorted(given)} apply to architecture 'transformer'; got architecture "
                             f"{self.architecture!r} with {given}")
        if not self.final_norm and (self.norm_placement != "post" or self.task not in ("classify", "retrieval")):
            raise ValueError(f"final_norm False (BERT's encoder) needs norm_placement 'post', whose blocks end "
                             f"normalised, and an encoder task (classify, retrieval); got norm_placement "
                             f"{self.norm_placement!r}, task {self.task!r}")

    def _check_output_head(self):
        """The mixture head models pixel values: an lm over 0..255 (plus a start token)."""
        if self.output_head == "softmax":
            if self.mixture_components != _defaults()["mixture_components"]:
                raise ValueError(f"config mixture_components ({self.mixture_components}) applies to output_head "
                                 f"'mixture_of_logistics' only; got output_head {self.output_head!r}")
            return
        self._positive("mixture_components", self.mixture_components)
        if self.task != "lm" or self.architecture != "transformer":
            raise ValueError(f"output_head {self.output_head!r} needs task 'lm' and architecture 'transformer'; got "
                             f"task {self.task!r}, architecture {self.architecture!r}")
        if self.vocab_size not in (PIXEL_VALUES, PIXEL_VALUES + 1):
            raise ValueError(f"output_head {self.output_head!r} models pixel values 0..255: vocab_size must be "
                             f"{PIXEL_VALUES} (pixels) or {PIXEL_VALUES + 1} (pixels and a start token); got "
                             f"{self.vocab_size}")

    def _check_token_learner(self):
        """TokenLearner reduces an encoder's tokens between blocks: what it combines with."""
        if not self.token_learner:
            return
        if not isinstance(self.token_learner, Mapping):
            raise ValueError(f"config token_learner must be a mapping of settings; got {self.token_learner!r}")
        tokenlearner_lib.check_settings(self.token_learner, num_layers=self.num_layers, prefix="config ")
        if self.task not in ("classify", "retrieval"):
            raise ValueError(f"config token_learner pools tokens across the whole sequence, so it serves encoders "
                             f"(tasks classify, retrieval); a causal {self.task!r} model cannot use it")
        if self.architecture != "transformer" or self.reversible or self.filters:
            raise ValueError(f"config token_learner needs architecture 'transformer', no filters and no reversible "
                             f"wiring; got architecture {self.architecture!r}, filters {self.filters}, "
                             f"reversible {self.reversible}")
        if self.position not in ("sinusoidal", "learned", "none"):
            raise ValueError(f"config token_learner: learned tokens have no positions, so position must be added to "
                             f"the embeddings (sinusoidal, learned) or none; got {self.position!r}")

    def _check_sparse_ffns(self, causal: bool):
        """The moe and pkm settings, and where those FFNs can go."""
        layers = max(self.num_layers, self.decoder_layers or 0)
        kinds = {self.layer_overrides.get(i, {}).get("ffn", self.ffn) for i in range(layers)}
        for kind, settings in (("moe", self.moe), ("pkm", self.pkm)):
            if kind not in kinds:
                if settings:
                    raise ValueError(f"config {kind} settings are given but no block has ffn {kind!r}")
                continue
            if self.architecture != "transformer" or self.reversible or self.task not in ("classify", "lm"):
                raise ValueError(f"ffn {kind!r} needs architecture 'transformer', task classify or lm, and no "
                                 f"reversible wiring; got architecture {self.architecture!r}, task {self.task!r}, "
                                 f"reversible {self.reversible}")
            if self.ffn == kind and self.pooling == "pma":
                raise ValueError(f"pooling 'pma' builds its own FeedForward of kind ffn: with ffn {kind!r} set ffn to "
                                 f"one of {list(FFN_KINDS)} and put {kind!r} in blocks through layer_overrides")
            if kind == "moe":
                moe_lib.check_settings(self.moe, causal=causal, prefix="config moe: ")
            else:
                pkm_lib.check_settings(self.pkm, d_model=self.d_model, causal=causal, prefix="config pkm: ")

    def _check_architecture(self):
        """What the isab, luna and perceiver stacks (their own softmax attentions, their
        own wiring) and the PMA pooling can be combined with."""
        arch, defaults = self.architecture, _defaults()
        tasks = _ARCHITECTURES[arch][1]
        if self.task not in tasks:
            raise ValueError(f"architecture {arch!r} serves tasks {list(tasks)}; got task {self.task!r}")
        if self.pooling == "pma" and self.task not in ("classify", "retrieval"):
            raise ValueError(f"pooling 'pma' pools a classifier's sequence (tasks classify, retrieval); got {self.task!r}")
        if self.pma_seeds != 1 and self.pooling != "pma":
            raise ValueError(f"pma_seeds ({self.pma_seeds}) is PMA's number of seeds: set pooling 'pma' or leave it 1")
        if self.cross_attends != 1 and arch != "perceiver":
            raise ValueError(f"cross_attends ({self.cross_attends}) applies to architecture 'perceiver' only")
        self._check_recurrence(arch, defaults)
        if arch == "transformer":
            if self.memory_size != defaults["memory_size"]:
                raise ValueError(f"memory_size ({self.memory_size}) applies to architectures isab, luna and perceiver")
            return
        own = {name: getattr(self, name) for name in ("attention", "attention_kwargs", "layer_overrides", "filters",
                                                        "reversible") if getattr(self, name) != defaults[name]}
        if own:
            raise ValueError(f"architecture {arch!r} builds its own softmax attentions and wiring; leave {sorted(own)} "
                             f"at their defaults (got {own})")
        if self.kv_heads not in (None, self.num_heads):
            raise ValueError(f"architecture {arch!r} has no grouped-query attention; kv_heads ({self.kv_heads}) must "
                             f"equal num_heads ({self.num_heads}) or be left unset")
        if arch in RECURRENT_ARCHITECTURES and self.position != "none":
            raise ValueError(f"architecture {arch!r} has its own relative positions (R, u, v): set position 'none'; "
                             f"got {self.position!r}")
        if self.position in BIAS_KINDS or self.position == "rope":
            raise ValueError(f"architecture {arch!r} takes positions added to the embeddings (sinusoidal, learned) or "
                             f"none; got {self.position!r}")
        if arch in RECURRENT_ARCHITECTURES and self.dtype != "float32":
            raise ValueError(f"architecture {arch!r} runs in float32 only; got dtype {self.dtype!r}")
        if arch == "perceiver" and self.pooling == "cls":
            raise ValueError("a perceiver has no CLS token: pool its latents with pooling 'mean' (the paper's average) "
                             "or 'pma'")

    def _check_recurrence(self, arch, defaults):
        """mem_len, eval_mem_len, cmem_len, compression and its rate: only for the
        recurrent architectures, and consistent there."""
        names = ("mem_len", "eval_mem_len", "cmem_len", "compression", "compression_rate")
        if arch not in RECURRENT_ARCHITECTURES:
            given = {n: getattr(self, n) for n in names if getattr(self, n) != defaults[n]}
            if given:
                raise ValueError(f"{sorted(given)} apply to architectures {list(RECURRENT_ARCHITECTURES)}; got {given}")
            return
        if self.memory_size != defaults["memory_size"]:
            raise ValueError(f"memory_size ({self.memory_size}) does not apply to {arch!r}: its memory is mem_len")
        for name in ("mem_len", "eval_mem_len", "cmem_len"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"config {name} must be >= 0; got {getattr(self, name)}")
        if self.compression_rate < 1:
            raise ValueError(f"config compression_rate must be >= 1; got {self.compression_rate}")
        if self.ffn not in FFN_KINDS:
            raise ValueError(f"architecture {arch!r} takes ffn one of {list(FFN_KINDS)}; got {self.ffn!r}")
        if arch == "transformer_xl":
            if self.mem_len < 1:
                raise ValueError(f"architecture 'transformer_xl' needs mem_len >= 1; got {self.mem_len}")
            extra = {n: getattr(self, n) for n in names[2:] if getattr(self, n) != defaults[n]}
            if extra:
                raise ValueError(f"{sorted(extra)} apply to architecture 'compressive' only; got {extra}")
            return
        rate = self.compression_rate
        if self.cmem_len < 1 or self.mem_len < 1:
            raise ValueError(f"architecture 'compressive' needs mem_len >= 1 and cmem_len >= 1; got mem_len "
                             f"{self.mem_len}, cmem_len {self.cmem_len}")
        bad = {n: v for n, v in (("mem_len", self.mem_len), ("eval_mem_len", self.eval_mem_len))
               if v is not None and v % rate}
        if bad:
            raise ValueError(f"architecture 'compressive' compresses whole windows of compression_rate ({rate}) "
                             f"states (segments must be too): {sorted(bad)} must be multiples of it; got {bad}")


def architectures_table() -> str:
    """The architectures and poolings a ModelConfig can name (printed by `jxformers list`)."""
    rows = [f"  {name:<14} {', '.join(tasks):<32} {what}" for name, (_, tasks, what) in _ARCHITECTURES.items()]
    return "\n".join(["architectures (ModelConfig architecture; memory_size, cross_attends; mem_len, cmem_len):", *rows,
                      f"poolings (ModelConfig pooling; pma_seeds): {', '.join(POOLING_KINDS)}"])


def _defaults() -> dict[str, Any]:
    return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
            for f in dataclasses.fields(ModelConfig)}


def _int_keys(name, mapping):
    out = {}
    for key, value in mapping.items():
        try:
            out[int(key)] = value
        except (TypeError, ValueError):
            raise ValueError(f"config {name} keys must be block indices (ints); got {key!r}") from None
    return out


class ShortSequenceWarning(UserWarning):
    """An attention's hyper-parameters make it dense at the model's max_len (a window or
    blocks spanning the whole sequence, a low-rank summary no shorter than it): it then
    costs at least softmax's time and memory and saves nothing. Silence it with
    `warnings.simplefilter("ignore", ShortSequenceWarning)`."""


# How far one query reaches, in keys (or, for the low-rank and kernelized ones, the rows
# or features it summarises the keys into), from the pattern each op's docstring defines.
# Defaults were chosen for sequences in the thousands; at a max_len this width reaches
# the op is dense (BigBird's default blocks at N = 256 take 2.5x softmax's memory).
_WIDTH = {
    "local": ("its window (2 window + 1 keys)", lambda hp, n: 2 * hp["window"] + 1),
    "longformer": ("its window and globals (2 window + 1 + globals keys)",
                   lambda hp, n: 2 * hp["window"] + 1 + len(hp["global_indices"])),
    "block_local": ("its block (block_size keys)", lambda hp, n: hp["block_size"]),
    "bigbird": ("its blocks (block_size x (window + global + random blocks) keys)",
                lambda hp, n: hp["block_size"] * (hp["num_window_blocks"] + hp["num_global_blocks"]
                                                  + hp["num_random_blocks"])),
    "sparse_transformer": ("its pattern (stride + max_len / stride keys)",
                           lambda hp, n: hp["stride"] + -(-n // hp["stride"]) * (
                               hp["num_summary"] if hp["pattern"] == "fixed" else 1)),
    "axial": ("its row and column (width + max_len / width keys)", lambda hp, n: hp["width"] + -(-n // hp["width"])),
    "linformer": ("its projected length (proj_len)", lambda hp, n: hp["proj_len"]),
    "nystrom": ("its landmarks (num_landmarks)", lambda hp, n: hp["num_landmarks"]),
    "induced": ("its inducing points (num_inducing)", lambda hp, n: hp["num_inducing"]),
    "performer": ("its random features (num_features)", lambda hp, n: hp["num_features"]),
    "rfa": ("its random features (num_features)", lambda hp, n: hp["num_features"]),
    "lsh": ("its chunks (2 chunk_size keys per hash round)", lambda hp, n: 2 * hp["chunk_size"]),
    "routing": ("its clusters (max_len / n_clusters keys)", lambda hp, n: -(-n // hp["n_clusters"])),
    "sinkhorn": ("its own and sorted blocks (2 block_size keys)", lambda hp, n: 2 * hp["block_size"]),
    "clusterformer": ("its chunks (chunk_size keys)", lambda hp, n: hp["chunk_size"]),
    "etc": ("its local radius and global tokens (2 local_radius + 1 + num_global keys per long token)",
            lambda hp, n: 2 * hp["local_radius"] + 1 + hp["num_global"]),
    "image_local_2d": ("its memory block ((memory_height + query_height) x (query_width + 2 memory_width) pixels)",
                       lambda hp, n: (hp["memory_height"] + hp["query_height"])
                       * (hp["query_width"] + 2 * hp["memory_width"])),
}


def warn_if_dense(bound: registry.BoundAttention, max_len: int) -> None:
    """ShortSequenceWarning when `bound` is no sparser (or lower-rank) than softmax at max_len."""
    name = bound.spec.name
    if name not in _WIDTH:
        return
    what, width_of = _WIDTH[name]
    width = width_of(bound.hyper_parameters, max_len)
    if width >= max_len:
        warnings.warn(
            f"{name} attention at max_len {max_len}: {what} spans {width} >= {max_len}, so it is dense at this "
            f"length and costs at least softmax's time and memory; use softmax, or smaller hyper-parameters "
            f"(now {dict(bound.hyper_parameters)})",
            ShortSequenceWarning, stacklevel=3,
        )


def bind_attention(name: str, hyper_parameters: Mapping[str, Any], max_len: int, *,
                   impl: str = "auto") -> registry.BoundAttention:
    """The attention bound with its hyper-parameters. The one that bounds the sequence
    length (the spec's `covers_length`, e.g. Linformer's `max_len`) defaults to the
    model's max_len and may not be smaller. `impl` fills the op's `impl` unless the
    hyper-parameters give one; an attention without a kernel refuses "pallas" and
    "interpret"."""
    spec = registry.get(name)
    hyper_parameters = dict(hyper_parameters)
    if any(p.name == "impl" for p in spec.hyper_parameters):
        hyper_parameters.setdefault("impl", impl)
    elif impl not in ("auto", "xla"):
        with_kernels = [n for n in registry.names() if any(p.name == "impl" for p in registry.get(n).hyper_parameters)]
        raise ValueError(f"impl {impl!r}: {name} attention has no Pallas kernel; attentions with one: {with_kernels} "
                         "(set impl per layer with layer_overrides)")
    role = spec.covers_length
    if role is not None:
        hyper_parameters.setdefault(role, max_len)
    bound = spec.bind(**hyper_parameters)
    if role is not None and bound.hyper_parameters[role] < max_len:
        raise ValueError(
            f"{name}: attention_kwargs {role} ({bound.hyper_parameters[role]}) must cover the model's max_len ({max_len})"
        )
    warn_if_dense(bound, max_len)
    return bound


def _as_config(config) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, Mapping):
        return ModelConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return ModelConfig.from_yaml(config)
    raise ValueError(f"config must be a ModelConfig, a dict or YAML; got {type(config).__name__}")


def _ffn(config: ModelConfig, layer: dict[str, Any], *, causal: bool, key):
    """A block's FFN: a FeedForward, an MoE or a product-key memory."""
    if layer["ffn"] == "moe":
        settings = moe_lib.check_settings(config.moe, causal=causal)
        return moe_lib.MoE(config.d_model, layer["d_ff"], **settings, causal=causal, dropout=config.dropout, key=key)
    if layer["ffn"] == "pkm":
        settings = pkm_lib.check_settings(config.pkm, d_model=config.d_model, causal=causal)
        return pkm_lib.ProductKeyMemory(config.d_model, **settings, dropout=config.dropout, key=key)
    return FeedForward(config.d_model, layer["d_ff"], layer["ffn"], dropout=config.dropout,
                       chunk_size=config.ffn_chunk_size, key=key)


def _blocks(
    config: ModelConfig, count: int, *, causal: bool, cross: bool, key, pooled: frozenset[int] = frozenset()
) -> list[Block]:
    """`count` blocks; those in `pooled` (Funnel's pooling layers) get a self-attention
    that takes its keys and values from a separate sequence."""
    blocks = []
    for i, k in enumerate(jax.random.split(key, count)):
        layer = config.layer(i)
        ka, kc, kf = jax.random.split(k, 3)
        attention = Attention(
            layer["attention"], config.d_model, config.num_heads, kv_heads=config.kv_heads, causal=causal,
            cross=i in pooled, rope=config.position == "rope", key=ka,
        )
        cross_attention = None
        if cross:
            cross_attention = Attention(
                config.bound_cross_attention(), config.d_model, config.num_heads, kv_heads=config.kv_heads, cross=True,
                key=kc,
            )
        blocks.append(Block(
            attention, _ffn(config, layer, causal=causal, key=kf), d_model=config.d_model, norm=config.norm,
            pre_norm=config.norm_placement == "pre",
            cross_attention=cross_attention, dropout=config.dropout, norm_eps=config.norm_eps,
        ))
    return blocks


def _stack(config: ModelConfig, *, causal: bool, key, pooled: frozenset[int] = frozenset()) -> list:
    """The blocks of an Encoder (or LanguageModel) for the config's architecture;
    `pooled`: Funnel's pooling layers (transformer blocks only)."""
    common = dict(d_ff=config.d_ff or 4 * config.d_model, ffn=config.ffn, norm=config.norm,
                  pre_norm=config.norm_placement == "pre", dropout=config.dropout)
    if config.architecture == "isab":
        return [ISAB(config.d_model, config.num_heads, num_inducing=config.memory_size, **common, key=k)
                for k in jax.random.split(key, config.num_layers)]
    if config.architecture == "luna":
        return [LunaStack(config.d_model, config.num_heads, num_layers=config.num_layers,
                          packed_len=config.memory_size, causal=causal, **common, key=key)]
    return _blocks(config, config.num_layers, causal=causal, cross=False, key=key, pooled=pooled)


def _pma(config: ModelConfig, key) -> PMA | None:
    if config.pooling != "pma":
        return None
    return PMA(config.d_model, config.num_heads, num_seeds=config.pma_seeds, d_ff=config.d_ff or 4 * config.d_model,
               ffn=config.ffn, norm=config.norm, pre_norm=config.norm_placement == "pre", dropout=config.dropout,
               key=key)


def build_model(config: ModelConfig | Mapping[str, Any] | str, *, key: jax.Array):
    """The model a config describes: `Classifier` (classify), `DualClassifier`
    (retrieval), `LanguageModel` (lm) or `EncoderDecoder` (seq2seq).

    Arguments:
        config: a `ModelConfig`, a dict of its fields, or YAML (text or a file path).
        key: PRNG key for every parameter and drawn array.
    """
    config = _as_config(config)
    keys = jax.random.split(key, 8)

    def embedding(k, causal):
        positions = Positions(
            config.position, dim=config.d_model, heads=config.num_heads, max_len=config.max_len, causal=causal, key=k
        )
        kt, _ = jax.random.split(k)
        norm = make_norm(config.norm, config.d_model, config.norm_eps) if config.embed_norm else None
        return Embedding(config.vocab_size, config.d_model, positions, dtype=config.dtype, scale=config.embed_scale,
                         type_vocab_size=config.type_vocab_size, norm=norm, key=kt)

    funnel_layers = frozenset(config.filters) if config.downsample == "funnel" else frozenset()

    def token_learner():
        if not config.token_learner:
            return None
        settings = tokenlearner_lib.check_settings(config.token_learner, num_layers=config.num_layers)
        return tokenlearner_lib.TokenLearnerStage(config.d_model, num_layers=config.num_layers, **settings,
                                                  key=jax.random.fold_in(keys[2], 7))

    def encoder(use_cls):
        if config.architecture == "perceiver":
            return PerceiverEncoder(
                embedding(keys[0], False), _blocks(config, config.num_layers, causal=False, cross=False, key=keys[1]),
                make_norm(config.norm, config.d_model), num_latents=config.memory_size,
                cross_attends=config.cross_attends, d_ff=config.d_ff or 4 * config.d_model, ffn=config.ffn,
                norm_kind=config.norm, pre_norm=config.norm_placement == "pre", dropout=config.dropout,
                max_len=config.max_len, key=keys[2],
            )
        return Encoder(
            embedding(keys[0], False), _stack(config, causal=False, key=keys[1], pooled=funnel_layers),
            make_norm(config.norm, config.d_model, config.norm_eps) if config.final_norm else None,
            max_len=config.max_len, use_cls=use_cls, filters=config.filters,
            downsample=config.downsample, reversible=config.reversible, token_learner=token_learner(), key=keys[2],
        )

    def decoder(layers, cross):
        head = None
        if config.output_head == "mixture_of_logistics" and not cross:
            head = MixtureOfLogistics(config.d_model, config.vocab_size, config.mixture_components,
                                      key=jax.random.fold_in(keys[5], 1))
        blocks = _blocks(config, layers, causal=True, cross=True, key=keys[4]) if cross else \
            _stack(config, causal=True, key=keys[4])
        return LanguageModel(
            embedding(keys[3], True), blocks,
            make_norm(config.norm, config.d_model, config.norm_eps), max_len=config.max_len, tie=config.tie_embeddings,
            reversible=config.reversible, head=head, key=keys[5],
        )

    if config.architecture in RECURRENT_ARCHITECTURES:
        compressive = config.architecture == "compressive"
        return RecurrentLM(
            config.vocab_size, config.d_model, config.num_heads, config.num_layers, d_ff=config.d_ff or 4 * config.d_model,
            ffn=config.ffn, norm=config.norm, pre_norm=config.norm_placement == "pre", dropout=config.dropout,
            mem_len=config.mem_len, eval_mem_len=config.eval_mem_len, cmem_len=config.cmem_len if compressive else 0,
            compression=config.compression, rate=config.compression_rate if compressive else 1,
            max_len=config.max_len, tie=config.tie_embeddings, dtype=config.dtype, key=keys[4],
        )
    if config.task == "lm":
        return decoder(config.num_layers, cross=False)
    if config.task == "seq2seq":
        return EncoderDecoder(encoder(False), decoder(config.decoder_layers or config.num_layers, cross=True))
    tower = Classifier(encoder(config.pooling == "cls"), config.num_classes, pooling=config.pooling,
                       pma=_pma(config, jax.random.fold_in(keys[6], 1)), key=keys[6])
    if config.task == "classify":
        return tower
    return DualClassifier(tower, config.num_classes, key=keys[7])
