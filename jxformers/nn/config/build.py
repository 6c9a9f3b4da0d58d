"""`build_model`: the model a `ModelConfig` describes, each module built from its
component's settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from jxformers.nn import adaptive, residual
from jxformers.nn.attention import Attention
from jxformers.nn.blocks import Block
from jxformers.nn.config.binding import bind_attention
from jxformers.nn.config.components import (
    CELL_STACK_TYPES,
    HEAD_OPTIONS,
    HIERARCHICAL_STACK_TYPES,
    SPARSE_QKV_OPTIONS,
    AttentionConfig,
    CompressiveStack,
    ErnieDocStack,
    FeedbackStack,
    FeedForwardConfig,
    FFNConfig,
    ISABStack,
    LunaStack,
    MemformerStack,
    MixtureHead,
    NoFeedForward,
    PerceiverStack,
    PooledHead,
    TransformerStack,
    TransformerXLStack,
    UniversalStack,
    d_ff,
)
from jxformers.nn.config.model import ModelConfig
from jxformers.nn.cross_layer import Evolve, map_role
from jxformers.nn.evolved import EvolvedStack
from jxformers.nn.feedback import FeedbackLayer, FeedbackLM
from jxformers.nn.hierarchical import HierarchicalEncoder
from jxformers.nn.layers import FeedForward, Linear, make_norm
from jxformers.nn.layouts import FeedForwardSublayer, StackPlan, every_other, group_order, sandwich_order
from jxformers.nn.local import LocalRNN
from jxformers.nn.luna import LunaStack as LunaModule
from jxformers.nn.mask_attention import DynamicMaskAttention
from jxformers.nn.memformer import MemformerLM, MemoryWriter
from jxformers.nn.mixture import MixtureOfLogistics
from jxformers.nn.models import Classifier, DualClassifier, Embedding, Encoder, EncoderDecoder, LanguageModel
from jxformers.nn.moe import MoE, MoEConfig
from jxformers.nn.perceiver import PerceiverEncoder
from jxformers.nn.pkm import PKMConfig, ProductKeyMemory
from jxformers.nn.positions import ADDED_KINDS, Positions
from jxformers.nn.relative import INPUT_KINDS, SCORE_KINDS, RelativeTerms
from jxformers.nn.scaling import SparseFeedForward, SparseFFNConfig
from jxformers.nn.set_transformer import ISAB, PMA
from jxformers.nn.tokenlearner import TokenLearnerStage
from jxformers.nn.transformer_xl import RecurrentLM


def as_config(config: ModelConfig | Mapping[str, Any] | str | os.PathLike) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, Mapping):
        return ModelConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return ModelConfig.from_yaml(config)
    raise ValueError(f"config must be a ModelConfig, a dict or YAML; got {type(config).__name__}")


def _ffn(config: ModelConfig, ffn: FFNConfig, *, key):
    """A block's FFN: a FeedForward, a sparse FFN, an MoE, a product-key memory, or None (ffn none)."""
    if isinstance(ffn, NoFeedForward):
        return None
    if isinstance(ffn, MoEConfig):
        return MoE(
            config.d_model,
            d_ff(ffn, config.d_model),
            **ffn.settings(),
            causal=bool(config.causal),  # resolved from the task when None
            vocab_size=config.vocab_size,  # router "hash": its table over the token ids
            dropout=config.dropout,
            key=key,
        )
    if isinstance(ffn, PKMConfig):
        return ProductKeyMemory(config.d_model, **ffn.settings(), dropout=config.dropout, key=key)
    if isinstance(ffn, SparseFFNConfig):
        return SparseFeedForward(
            config.d_model, d_ff(ffn, config.d_model), **ffn.settings(), dropout=config.dropout, key=key
        )
    return FeedForward(
        config.d_model,
        d_ff(ffn, config.d_model),
        ffn.kind,
        dropout=config.dropout,
        chunk_size=ffn.chunk_size,
        mid_norm=config.norm.kind if config.norm.placement == "normformer" else None,
        norm_eps=config.norm.eps,
        shifts=config.norm.placement == "fixup",
        key=key,
    )


def _aan_d_ff(attention: AttentionConfig, ffn: FFNConfig, d_model: int) -> int | None:
    """The average attention network's FFN width (`Attention`'s aan_d_ff): the block's
    d_ff, 0 without its FFN (`aan_ffn: false`), None when the attention is no AAN."""
    if not attention.aan:
        return None
    return d_ff(ffn, d_model) if attention.aan_ffn else 0


def _dense(config: ModelConfig) -> dict[str, Any]:
    """The FeedForward settings of the stacks that build their own blocks (and PMA)."""
    ffn = config.ffn
    assert isinstance(ffn, FeedForwardConfig), ffn  # ModelConfig refuses moe / pkm there
    return dict(
        d_ff=d_ff(ffn, config.d_model),
        ffn=ffn.kind,
        norm=config.norm.kind,
        pre_norm=config.norm.placement == "pre",
        dropout=config.dropout,
    )


def _blocks(
    config: ModelConfig, count: int, *, causal: bool, cross: bool, key, pooled: frozenset[int] = frozenset()
) -> list[Block]:
    """`count` transformer blocks; those in `pooled` (Funnel's pooling layers) get a
    self-attention that takes its keys and values from a separate sequence."""
    blocks = []
    stack = config.stack
    alpha, beta = 1.0, 1.0
    if config.norm.placement == "deepnorm":  # DeepNet's constants for this side of the model
        encoder = 0 if config.task == "lm" else config.num_layers
        decoder = {"lm": config.num_layers, "seq2seq": config.decoder_layers}.get(config.task, 0)
        part = "decoder" if causal and not config.causal_encoder else "encoder"  # a causal encoder: the encoder's
        alpha, beta = residual.deepnorm_constants(encoder, decoder, part)
    maps_kind, lazy_block = "none", 2
    if isinstance(stack, TransformerStack):
        maps_kind, lazy_block = stack.attention_maps, stack.lazy_block
    position = config.embedding.position
    for i, k in enumerate(jax.random.split(key, count)):
        ka, kc, kf = jax.random.split(k, 3)
        relative = None
        if position in SCORE_KINDS or position in INPUT_KINDS:  # this layer's part (the shared part is the Positions')
            relative = RelativeTerms(
                position,
                d_model=config.d_model,
                heads=config.num_heads,
                d_head=config.head_size(config.layer(i).attention),
                max_distance=config.embedding.max_distance(config.max_len),
                position_buckets=config.embedding.deberta_buckets or 0,
                layer=i,  # FLOATER: this block's row of the model's solution
                key=jax.random.fold_in(k, 5),
            )
        attention = Attention(
            config.bound_attention(i),
            config.d_model,
            config.num_heads,
            kv_heads=config.kv_heads,
            causal=causal,
            cross=i in pooled,
            rope=config.embedding.rotary() or False,
            d_head=config.layer(i).attention.d_head,
            qk_norm=config.layer(i).attention.qk_norm,
            qk_norm_length=config.max_len,
            **{n: getattr(config.layer(i).attention, n) for n in HEAD_OPTIONS},
            aan_d_ff=_aan_d_ff(config.layer(i).attention, config.layer(i).ffn, config.d_model),
            head_scale=config.norm.placement == "normformer",
            relative=relative,
            **{n: getattr(config.layer(i).attention, n) for n in SPARSE_QKV_OPTIONS},
            key=ka,
        )
        role = map_role(maps_kind, i, lazy_block)
        if role == "reuse":  # LazyFormer's upper layers have no queries or keys of their own
            attention = eqx.tree_at(
                lambda a: (a.q_proj, a.k_proj, a.q_norm, a.k_norm, a.qk_scale),
                attention,
                (None,) * 5,
                is_leaf=lambda x: x is None,
            )
        cross_attention = None
        if cross:
            # a seq2seq decoder's cross-attention, or Memformer's memory reader (softmax, eq. 1-3)
            reader = config.decoder.cross_attention if config.decoder is not None else AttentionConfig()
            assert config.decoder is not None or isinstance(stack, MemformerStack)
            cross_attention = Attention(
                config.bound_cross_attention()
                if config.decoder is not None
                else bind_attention(reader, config.max_len),
                config.d_model,
                config.num_heads,
                kv_heads=config.kv_heads,
                cross=True,
                d_head=reader.d_head,
                qk_norm=reader.qk_norm,
                qk_norm_length=config.max_len,
                **{n: getattr(reader, n) for n in HEAD_OPTIONS},
                key=kc,
            )
        # a seq2seq decoder's blocks without FFNs (decoder.ffn false: Yang et al. 2020)
        without_ffn = cross and config.decoder is not None and not config.decoder.ffn
        pre_ffns, own_ffn, post_ffns = _sublayers(config, i, count, key=jax.random.fold_in(k, 8))
        block = Block(
            attention,
            None if without_ffn or not own_ffn else _ffn(config, config.layer(i).ffn, key=kf),
            d_model=config.d_model,
            norm=config.norm.kind,
            placement=config.norm.placement,
            alpha=alpha,
            cross_attention=cross_attention,
            dropout=config.dropout,
            norm_eps=config.norm.eps,
            maps=role,
            evolve=_evolve(config, i, key=jax.random.fold_in(k, 3)),
            local=_local(config, causal=causal, key=jax.random.fold_in(k, 6)),
            pre_ffns=pre_ffns,
            post_ffns=post_ffns,
        )
        if config.norm.placement == "deepnorm":
            block = residual.deepnorm_init(block, beta, key=jax.random.fold_in(k, 4))
        elif config.norm.placement == "tfixup":
            block = residual.tfixup_init(block, residual.tfixup_scale(count, cross=cross), key=jax.random.fold_in(k, 4))
        elif config.norm.placement == "fixup":
            block = residual.fixup_init(block, _branches(config), key=jax.random.fold_in(k, 4))
        blocks.append(block)
    return blocks


def _branches(config: ModelConfig) -> int:
    """The model's residual branches, Fixup's L: two per block of an encoder or a
    decoder-only model, three per cross-attending decoder block (two without its FFN)."""
    if config.task == "lm":
        return 2 * config.num_layers
    decoder = 0
    if config.task == "seq2seq":
        assert config.decoder is not None
        decoder = (3 if config.decoder.ffn else 2) * config.decoder_layers
    return 2 * config.num_layers + decoder


def _zero_readout(model):
    """`model` with its untied output layer zero (Fixup's rule 1: the classification layer
    starts at 0): a classifier's head, an untied language model's unembedding (an
    encoder-decoder's too); a tied readout is the embedding table and keeps its draw, as
    in the authors' code."""

    def readouts(m):
        found = (
            getattr(m, "head", None),
            getattr(m, "unembed", None),
            getattr(getattr(m, "decoder", None), "unembed", None),
        )
        return [x for x in found if isinstance(x, Linear)]

    return eqx.tree_at(readouts, model, [jax.tree.map(jnp.zeros_like, x) for x in readouts(model)])


def _evolve(config: ModelConfig, index: int, *, key) -> Evolve | None:
    """Block `index`'s convolution of the predictive maps (none in the first block)."""
    stack = config.stack
    if not isinstance(stack, TransformerStack) or stack.attention_maps != "predictive" or index == 0:
        return None
    return Evolve(config.num_heads, alpha=stack.map_alpha, beta=stack.map_beta, key=key)


def _local(config: ModelConfig, *, causal: bool, key) -> LocalRNN | DynamicMaskAttention | None:
    """A block's sublayers before its attention: LocalRNN's (R-Transformer), DMAN
    (Mask Attention Networks), or None."""
    stack = config.stack
    if not isinstance(stack, TransformerStack):
        return None
    if stack.dman:
        return DynamicMaskAttention(
            config.d_model, config.num_heads, max_len=config.max_len, causal=causal, norm=config.norm.kind,
            norm_eps=config.norm.eps, pre_norm=config.norm.placement == "pre", dropout=config.dropout, key=key,
        )  # fmt: skip
    if stack.local_rnn is None:
        return None
    local = stack.local_rnn
    return LocalRNN(
        config.d_model, window=local.window, cell=local.cell, layers=local.layers, norm=config.norm.kind,
        norm_eps=config.norm.eps, pre_norm=config.norm.placement == "pre", dropout=config.dropout, key=key,
    )  # fmt: skip


def _stack(config: ModelConfig, *, causal: bool, key, pooled: frozenset[int] = frozenset()) -> list:
    """The blocks of an Encoder (or LanguageModel) for the config's stack; `pooled`:
    Funnel's pooling layers (transformer blocks only)."""
    stack = config.stack
    if isinstance(stack, CELL_STACK_TYPES):  # Lite Transformer, DeLighT, the Evolved Transformer: their own blocks
        return stack.blocks(config, causal=causal, key=key)
    if isinstance(stack, ISABStack):
        return [
            ISAB(config.d_model, config.num_heads, num_inducing=stack.num_inducing, **_dense(config), key=k)
            for k in jax.random.split(key, config.num_layers)
        ]
    if isinstance(stack, LunaStack):
        return [_luna(config, config.num_layers, causal=causal, key=key)]
    blocks = _blocks(config, config.num_layers, causal=causal, cross=False, key=key, pooled=pooled)
    return _adaptive(config, blocks, causal=causal, key=jax.random.fold_in(key, 11))


def _luna(config: ModelConfig, layers: int, *, causal: bool, cross: bool = False, key) -> LunaModule:
    """The config's Luna layers as one stack (`cross`: a seq2seq decoder's)."""
    assert isinstance(config.stack, LunaStack)
    return LunaModule(
        config.d_model, config.num_heads, num_layers=layers, packed_len=config.stack.packed_len, causal=causal,
        cross=cross, **_dense(config), key=key,
    )  # fmt: skip


def _adaptive(config: ModelConfig, blocks: list[Block], *, causal: bool, key) -> list:
    """`blocks` as the config's adaptive stack (`jxformers.nn.adaptive`), or as they are."""
    stack = config.stack
    if isinstance(stack, UniversalStack):
        return [
            adaptive.UniversalStack(
                blocks, d_model=config.d_model, max_steps=stack.max_steps, act=stack.act,
                threshold=stack.act_threshold, ponder_weight=stack.ponder_weight, halting_bias=stack.halting_bias,
                act_state=stack.act_state, step_embedding=stack.step_embedding,
                position_signal=stack.position_signal, key=key,
            )
        ]  # fmt: skip
    if not isinstance(stack, TransformerStack):
        return blocks
    if stack.cct is not None:
        cct = stack.cct
        return [
            adaptive.GatedStack(
                blocks, d_model=config.d_model, budgets=cct.budgets, budget=cct.budget,
                budget_weight=cct.budget_weight, noise=cct.noise, d_control=cct.d_control, key=key,
            )
        ]  # fmt: skip
    exits = stack.early_exit
    if exits is None:
        return blocks
    return [
        adaptive.ExitStack(
            blocks, rule=exits.rule or ("confidence" if causal else "patience"),
            training=exits.training or ("aligned" if causal else "weighted"), per_token=causal,
            threshold=exits.threshold, patience=exits.patience, samples=exits.samples,
        )
    ]  # fmt: skip


def _pma(config: ModelConfig, key) -> PMA | None:
    if not isinstance(config.head, PooledHead) or config.head.kind != "pma":
        return None
    dense = _dense(config)
    return PMA(
        config.d_model,
        config.num_heads,
        num_seeds=config.head.pma_seeds,
        d_ff=dense["d_ff"],
        ffn=dense["ffn"],
        norm=dense["norm"],
        pre_norm=dense["pre_norm"],
        dropout=config.dropout,
        key=key,
    )


def build_model(config: ModelConfig | Mapping[str, Any] | str, *, key: jax.Array):
    """The model a config describes: `Classifier` (classify), `DualClassifier`
    (retrieval), `LanguageModel` (lm; `RecurrentLM` for the recurrent stacks) or
    `EncoderDecoder` (seq2seq).

    Arguments:
        config: a `ModelConfig`, a dict of its fields, or YAML (text or a file path).
        key: PRNG key for every parameter and drawn array.
    """
    config = as_config(config)
    model = _assemble(config, key)
    return _zero_readout(model) if config.norm.placement == "fixup" else model


def _assemble(config: ModelConfig, key: jax.Array):
    """`build_model`'s model before what acts on the whole model (Fixup's zero readout)."""
    keys = jax.random.split(key, 8)
    stack, norm, embed = config.stack, config.norm, config.embedding

    def embedding(k, causal, extra=True, cls=False, layers=config.num_layers):
        assert embed.position is not None  # ModelConfig resolves it from the stack
        # TUPE resets the CLS token's correlations: it sits after the memory tokens (if any)
        memory = embed.extra_tokens if extra and embed.extra_kind == "memory" else 0
        positions = Positions(
            embed.position,
            # a factorised embedding adds its positions in E, before the projection (ALBERT's)
            dim=embed.factorized if embed.factorized and embed.position in ADDED_KINDS else config.d_model,
            heads=config.num_heads,
            max_len=config.max_len,
            causal=causal,
            key=k,
            d_head=config.head_size(config.attention),
            max_distance=embed.max_distance(config.max_len),
            cls_position=memory if cls and embed.position == "tupe" else None,
            tupe_relative=embed.tupe_relative,
            position_buckets=embed.deberta_buckets or 0,
            layers=layers,
            floater_delta=embed.floater_delta,
            floater_steps=embed.floater_steps,
            vocab_size=config.vocab_size,
            cpe_kernel=None if embed.cpe is None else embed.cpe.kernel_size,
            cpe_after=() if embed.cpe is None else embed.cpe.after,
        )
        kt, _ = jax.random.split(k)
        embed_norm = make_norm(norm.kind, embed.factorized or config.d_model, norm.eps) if embed.norm else None
        made = Embedding(
            config.vocab_size,
            config.d_model,
            positions,
            dtype=config.dtype,
            scale=embed.scale,
            type_vocab_size=embed.type_vocab_size,
            norm=embed_norm,
            extra_tokens=embed.extra_tokens if extra else 0,
            extra_kind=embed.extra_kind,
            factorized=embed.factorized,
            key=kt,
        )
        if norm.placement != "tfixup":
            return made
        # T-Fixup's step 2: the token table (std d^-1/2, as drawn) times (9 L)^(-1/4), L the
        # decoder's blocks in an encoder-decoder (the paper's), the model's otherwise
        layers = config.decoder_layers if config.task == "seq2seq" else config.num_layers
        return eqx.tree_at(lambda e: e.table, made, made.table * (9 * layers) ** -0.25)

    def token_learner():
        tl = getattr(stack, "token_learner", None)
        if tl is None:
            return None
        return TokenLearnerStage(
            config.d_model,
            num_layers=config.num_layers,
            after_layer=tl.after_layer,
            num_tokens=tl.num_tokens,
            fuse=tl.fuse,
            maps=tl.maps,
            bottleneck=tl.bottleneck,
            key=jax.random.fold_in(keys[2], 7),
        )

    def encoder(use_cls):
        causal = config.causal_encoder  # model.causal true on classify / retrieval (ModelConfig: stack transformer)
        if isinstance(stack, HIERARCHICAL_STACK_TYPES):
            return _hierarchical(config, embedding(keys[0], False), keys[1])
        if isinstance(stack, PerceiverStack):
            dense = _dense(config)
            return PerceiverEncoder(
                embedding(keys[0], False),
                _blocks(config, config.num_layers, causal=False, cross=False, key=keys[1]),
                make_norm(norm.kind, config.d_model),
                num_latents=stack.num_latents,
                cross_attends=stack.cross_attends,
                d_ff=dense["d_ff"],
                ffn=dense["ffn"],
                norm_kind=norm.kind,
                pre_norm=dense["pre_norm"],
                dropout=config.dropout,
                max_len=config.max_len,
                fourier_bands=stack.fourier_bands,
                fourier_grid=stack.fourier_grid,
                fourier_max_freq=stack.fourier_max_freq,
                key=keys[2],
            )
        transformer = stack if isinstance(stack, TransformerStack) else TransformerStack()  # isab, luna: none
        pooled = frozenset(transformer.filters) if transformer.downsample == "funnel" else frozenset()
        return Encoder(
            embedding(keys[0], causal, cls=use_cls),
            _stack(config, causal=causal, key=keys[1], pooled=pooled),
            make_norm(norm.kind, config.d_model, norm.eps) if norm.final else None,
            max_len=config.max_len,
            use_cls=use_cls,
            filters=transformer.filters,
            downsample=transformer.downsample,
            reversible=transformer.reversible,
            token_learner=token_learner(),
            plan=_plan(config, config.num_layers),
            key=keys[2],
        )

    def decoder(layers, cross):
        head = None
        if isinstance(config.head, MixtureHead) and not cross:
            head = MixtureOfLogistics(
                config.d_model, config.vocab_size, config.head.components, key=jax.random.fold_in(keys[5], 1)
            )
        blocks: list[Any]
        if cross and isinstance(stack, EvolvedStack):  # decoder cells with their attend-to-encoder branches
            blocks = stack.blocks(config, causal=True, key=keys[4], count=layers, cross=True)
        elif cross and isinstance(stack, LunaStack):  # Luna's decoder: causal Luna, then Luna over the encoder
            blocks = [_luna(config, layers, causal=True, cross=True, key=keys[4])]
        elif cross:
            blocks = _blocks(config, layers, causal=True, cross=True, key=keys[4])
        else:
            blocks = _stack(config, causal=True, key=keys[4])
        return LanguageModel(
            # seq2seq: the encoder holds the extra tokens (the paper's MemTransformer)
            embedding(keys[3], True, extra=not cross, layers=layers),
            blocks,
            make_norm(norm.kind, config.d_model, norm.eps),
            max_len=config.max_len,
            tie=getattr(config.head, "tie_embeddings", True),
            reversible=getattr(stack, "reversible", False),
            head=head,
            plan=_plan(config, layers),
            key=keys[5],
        )

    if isinstance(stack, MemformerStack):
        writer = MemoryWriter(
            stack.num_slots, config.d_model, config.num_heads, temperature=stack.write_temperature,
            key=jax.random.fold_in(keys[4], 1),
        )  # fmt: skip
        lm = decoder(config.num_layers, cross=True)
        return MemformerLM(lm, writer, segment_len=stack.segment_len, replay=stack.replay)
    if isinstance(stack, (TransformerXLStack, CompressiveStack, ErnieDocStack)):
        compressive = stack if isinstance(stack, CompressiveStack) else None
        ernie = stack if isinstance(stack, ErnieDocStack) else None
        return RecurrentLM(
            config.vocab_size,
            config.d_model,
            config.num_heads,
            config.num_layers,
            **_dense(config),
            mem_len=stack.mem_len,
            eval_mem_len=stack.eval_mem_len,
            cmem_len=compressive.cmem_len if compressive else 0,
            compression=compressive.compression if compressive else "conv",
            compression_loss=compressive.compression_loss if compressive else "attention",
            rate=compressive.compression_rate if compressive else 1,
            same_layer=ernie is not None,
            retrospective=ernie.retrospective if ernie else False,
            segment_len=ernie.segment_len if ernie else None,
            max_len=config.max_len,
            tie=getattr(config.head, "tie_embeddings", True),
            dtype=config.dtype,
            key=keys[4],
        )
    if isinstance(stack, FeedbackStack):
        return _feedback(config, embedding(keys[3], True), key=keys[4])
    if config.task == "lm":
        return decoder(config.num_layers, cross=False)
    if config.task == "seq2seq":
        source = encoder(False)
        assert isinstance(source, Encoder) and config.decoder is not None  # seq2seq: transformer, evolved or luna
        return EncoderDecoder(
            source, decoder(config.decoder_layers, cross=True), transparent=config.decoder.transparent
        )
    assert isinstance(config.head, PooledHead)  # ModelConfig gives encoder tasks a pooled head
    tower = Classifier(
        encoder(config.head.kind == "cls"),
        config.num_classes,
        pooling=config.head.kind,
        pma=_pma(config, jax.random.fold_in(keys[6], 1)),
        exits=config.num_layers - 1 if getattr(stack, "early_exit", None) is not None else 0,
        key=keys[6],
    )
    if config.task == "classify":
        return tower
    return DualClassifier(tower, config.num_classes, key=keys[7])


def _hierarchical(config: ModelConfig, embedding: Embedding, key) -> HierarchicalEncoder:
    """The encoder of a config's `stack: {kind: hibert}` or `{kind: hi_transformer}`:
    transformer blocks of the model's attention over the sentences and over the document."""
    stack = config.stack
    assert isinstance(stack, HIERARCHICAL_STACK_TYPES)
    sentences, documents = stack.layers(config)
    ks, kd, ke = jax.random.split(key, 3)
    final = make_norm(config.norm.kind, config.d_model, config.norm.eps) if config.norm.final else None
    hibert = stack.kind == "hibert"
    return HierarchicalEncoder(
        embedding,
        _blocks(config, sentences, causal=False, cross=False, key=ks),
        _blocks(config, documents, causal=False, cross=False, key=kd),
        final,
        kind=stack.kind,
        pooling=stack.pooling,
        sentence_position=stack.sentence_position,
        max_sentences=stack.max_sentences,
        max_len=config.max_len,
        sentence_norm=make_norm(config.norm.kind, config.d_model, config.norm.eps) if hibert and final else None,
        key=ke,
    )


def _feedback(config: ModelConfig, embedding: Embedding, *, key) -> FeedbackLM:
    """The Feedback Transformer of a config's `stack: {kind: feedback}` (Fan et al. 2020)."""
    stack = config.stack
    assert isinstance(stack, FeedbackStack)
    dense = _dense(config)
    kl, ko = jax.random.split(key)
    layers = [
        FeedbackLayer(config.d_model, config.num_heads, d_ff=dense["d_ff"], ffn=dense["ffn"], norm=dense["norm"],
                      pre_norm=dense["pre_norm"], dropout=config.dropout, key=k)
        for k in jax.random.split(kl, config.num_layers)
    ]  # fmt: skip
    final = make_norm(config.norm.kind, config.d_model) if dense["pre_norm"] else None  # the authors' out_norm
    return FeedbackLM(
        embedding, layers, final, max_len=config.max_len, span=stack.span,
        tie=getattr(config.head, "tie_embeddings", True), dropout=config.dropout, key=ko,
    )  # fmt: skip


def _sublayers(config: ModelConfig, index: int, count: int, *, key) -> tuple[tuple, bool, tuple]:
    """Block `index`'s FFN sublayers by the stack's layout (`jxformers.nn.layouts`): (those
    before its attention, whether it has its own FFN, those after it). Macaron: a half
    step before and one after, no FFN of its own; an order (stack.order, stack.sandwich):
    the f's around the block's s, the first after it the block's own FFN."""
    stack = config.stack
    if not isinstance(stack, TransformerStack) or not (stack.macaron or stack.order or stack.sandwich):
        return (), True, ()
    made = iter(jax.random.split(key, 64))

    def sublayer(scale):
        ffn = _ffn(config, config.layer(index).ffn, key=next(made))
        assert isinstance(ffn, FeedForward)  # ModelConfig: dense FFNs with an order or Macaron
        return FeedForwardSublayer(
            ffn, d_model=config.d_model, norm=config.norm.kind,
            pre_norm=config.norm.placement == "pre", dropout=config.dropout, norm_eps=config.norm.eps, scale=scale,
        )  # fmt: skip

    if stack.macaron:  # Lu et al. 2019, eq. 14: x + FFN(x)/2, then the attention, then + FFN(.)/2
        return (sublayer(0.5),), False, (sublayer(0.5),)
    order = stack.order or sandwich_order(count, stack.sandwich)
    before, after = group_order(order)[index]
    return tuple(sublayer(1.0) for _ in range(before)), after > 0, tuple(sublayer(1.0) for _ in range(after - 1))


def _plan(config: ModelConfig, layers: int) -> StackPlan:
    """How a model of `layers` blocks shares them, drops them in training and prunes them at inference."""
    stack = config.stack
    if not isinstance(stack, TransformerStack):
        return StackPlan()
    keep = stack.keep_layers if stack.prune is None else every_other(layers, stack.prune)
    return StackPlan(sharing=stack.sharing, layerdrop=stack.layerdrop, drop_unit=stack.layerdrop_unit, keep_layers=keep)
