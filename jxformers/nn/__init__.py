"""Equinox modules: layers (linear, norms, FFNs), positions, the attention module around
any registered attention, the transformer block, models, and `ModelConfig`/`build_model`.

    attention.py  Attention (projections + a registered core; redraw, decoding)
    heads.py      improved multi-heads: collaborative heads, disagreement losses, routing-by-agreement
    average.py    AverageNetwork: the FFN and gating layer of the average attention network
                  (Zhang et al. 2018; the Attention setting aan around the attention `average`)
    layers.py     Linear, LayerNorm, RMSNorm, ScaleNorm, AdaNorm, FeedForward (its activations)
    power_norm.py  PowerNorm (Shen et al. 2020): running statistics as model state, its
                  approximate backward, and their update from a batch (update_statistics)
    moe.py        MoE (token-choice, expert-choice, hash, BASE and prototype routers, capacity
                  and dropless dispatch)
    pkm.py        ProductKeyMemory (product-key lookup over a large value table)
    scaling.py    the Scaling Transformer's sparse layers (Jaszczur et al. 2021): SparseFeedForward
                  (ModelConfig ffn kind sparse) and SparseQKV (attention projection sparse)
    positions.py  sinusoidal (and FLASH's scaled), learned, rotary (Rotary: RoPE, its context
                  scaling, xPos), ALiBi, T5 relative buckets, TUPE's untied positional correlation,
                  complex word embeddings (Wang et al. 2020)
    floater.py    FLOATER's positions from a neural ODE (Liu et al. 2020), its fixed-step RK4 solver
    relative.py   relative score terms inside each attention: Shaw et al. 2018, Transformer-XL's,
                  DeBERTa's disentangled attention (RelativeTerms per layer, SharedTerms per model)
    local.py      positions from a token's neighbours: CPE's PEG (a depthwise convolution,
                  ModelConfig embedding.cpe) and R-Transformer's LocalRNN (stack.local_rnn)
    mask_attention.py  Mask Attention Networks' DMAN, a dynamic mask attention sublayer before a
                  block's attention (Fan et al. 2021; ModelConfig stack.dman)
    blocks.py     Block (its residual branches and their norms)
    layouts.py    sublayer orders (Sandwich), Macaron's half-step FFNs, ALBERT's cross-layer sharing,
                  LayerDrop and its pruning (StackPlan; ModelConfig stack.order, macaron, sharing, layerdrop)
    residual.py   the norm placements beyond pre/post: sandwich, NormFormer, ReZero,
                  T-Fixup, DeepNorm (their constants and initialisations)
    cross_layer.py  attention maps carried between blocks (RealFormer's residual scores,
                  LazyFormer's shared probabilities, Evolving Attention's convolved logits;
                  ModelConfig stack.attention_maps)
    set_transformer.py  MAB, ISAB, PMA (Set Transformer)
    luna.py       LunaBlock, LunaStack (Luna, with its causal form)
    perceiver.py  PerceiverEncoder (Perceiver)
    cells.py      Cell: the blocks of the whole-model designs, called as a Block is; residual
                  sublayers, convolutions over the positions with their decoding windows
    lite.py       LiteBlock, SequenceConv (Lite Transformer's LSRA; ModelConfig stack lite)
    delight.py    DelightBlock, DExTra, GroupLinear, block-wise scaling (DeLighT; stack delight)
    evolved.py    EvolvedEncoderCell, EvolvedDecoderCell, SeparableConv (the Evolved Transformer;
                  stack evolved)
    hierarchical.py  HierarchicalEncoder: HIBERT and Hi-Transformer over documents of sentences
                  (tokens [sentences, words]; stacks hibert, hi_transformer)
    tokenlearner.py  TokenLearner, TokenFuser, TokenLearnerStage (Ryoo et al. 2021; ModelConfig stack.token_learner)
    transformer_xl.py  RecurrentLM (Transformer-XL, Compressive Transformer, ERNIE-Doc: memories carried between
                  segments)
    memformer.py  MemformerLM, MemoryWriter (Memformer: a memory of slots read by every layer, written
                  per segment; memory replay back-propagation)
    feedback.py   FeedbackLM (the Feedback Transformer: one memory of all layers' states, trained position by position)
    transparent.py  transparent attention: each decoder block of an EncoderDecoder reads its own mix of
                  every encoder layer
    recurrent.py  deprecated name of transformer_xl.py
    reversible.py  reversible residual blocks (Reformer's wiring)
    adaptive.py   adaptive computation: the Universal Transformer's ACT stack, CCT's gated
                  sub-layers, early exit (depth-adaptive decoding, PABEE); ModelConfig stack
                  universal, stack.cct, stack.early_exit
    models.py     Encoder, Classifier, DualClassifier, LanguageModel, EncoderDecoder
    mixture.py    the discretized mixture of logistics output head (PixelCNN++)
    moe_sharded.py  expert parallelism for MoE with `jax.shard_map`
    generation.py  generate: sampling a continuation with `lax.scan`; transduce: an EncoderDecoder's target
    trainable.py  which leaves an optimizer updates; redrawing or updating the drawn arrays
    produced.py   Produced: what a forward makes beside its output (MoE aux, k-means inputs,
                  a recurrent memory), returned by every module's `apply`
    config/       ModelConfig and its components (attention, embedding, norm, ffn, stack,
                  decoder, head), build_model; the flat keys of earlier versions converted
"""

from jxformers.nn.attention import Attention, attention_modules
from jxformers.nn.blocks import Block
from jxformers.nn.config import ModelConfig, build_model
from jxformers.nn.layers import FeedForward, LayerNorm, Linear, RMSNorm, ScaleNorm
from jxformers.nn.luna import LunaBlock, LunaStack
from jxformers.nn.memformer import MemformerLM, MemoryWriter
from jxformers.nn.models import (
    Classifier,
    ConditionedDecoder,
    DualClassifier,
    Embedding,
    Encoder,
    EncoderDecoder,
    LanguageModel,
)
from jxformers.nn.moe import MoE
from jxformers.nn.perceiver import PerceiverEncoder
from jxformers.nn.pkm import ProductKeyMemory
from jxformers.nn.positions import (
    Positions,
    Rotary,
    alibi_slopes,
    rotary,
    sinusoidal,
    t5_buckets,
    xpos,
)
from jxformers.nn.power_norm import PowerNorm, has_statistics, statistics, update_statistics
from jxformers.nn.produced import AttentionInputs, Produced
from jxformers.nn.set_transformer import ISAB, MAB, PMA
from jxformers.nn.tokenlearner import TokenFuser, TokenLearner, TokenLearnerStage
from jxformers.nn.trainable import redraw, trainable, update_arrays, updates_arrays
from jxformers.nn.transformer_xl import RecurrentLM

__all__ = [
    "Attention",
    "AttentionInputs",
    "Block",
    "Classifier",
    "ConditionedDecoder",
    "DualClassifier",
    "Embedding",
    "Encoder",
    "EncoderDecoder",
    "FeedForward",
    "ISAB",
    "LanguageModel",
    "LayerNorm",
    "Linear",
    "LunaBlock",
    "LunaStack",
    "MAB",
    "MemformerLM",
    "MemoryWriter",
    "MoE",
    "ModelConfig",
    "PMA",
    "PerceiverEncoder",
    "PowerNorm",
    "Produced",
    "Positions",
    "ProductKeyMemory",
    "RMSNorm",
    "ScaleNorm",
    "RecurrentLM",
    "Rotary",
    "TokenFuser",
    "TokenLearner",
    "TokenLearnerStage",
    "alibi_slopes",
    "attention_modules",
    "build_model",
    "has_statistics",
    "redraw",
    "rotary",
    "sinusoidal",
    "statistics",
    "t5_buckets",
    "trainable",
    "update_arrays",
    "update_statistics",
    "updates_arrays",
    "xpos",
]
