"""Models, one example at a time (batch with `jax.vmap`): an `Encoder` with a
classification head (`Classifier`) or a dual-tower retrieval head (`DualClassifier`), a
decoder-only `LanguageModel` with incremental decoding, and `EncoderDecoder`. Encoders
and language models stack transformer `Block`s, Set Transformer `ISAB`s or a `LunaStack`;
a `Classifier` also takes a `PerceiverEncoder` and pools by CLS, mean or PMA.

The encoder can shorten its sequence: `filters={i: r}` puts a downsampling right before
block i, ahead of its attention (i = 0: on the embeddings), so block i and every later
block run at the shorter length; the CLS token is never downsampled. The Fourier
Transformer's spectral filter (He et al. 2023, "Fourier Transformer: Fast Long Range
Modeling by Removing Sequence Redundancy with FFT Operator", arXiv 2305.15099, section
4.1, eq. 7-8; `fourier_downsample` with
the paper's amplitude, or "fourier_rescaled") keeps ceil(r L) of L real tokens, and
{0: 0.2} is the paper's LRA setting; Funnel (Dai et al. 2020) mean-pools with stride
1/r, and block i attends from the pooled queries to the unpooled keys and values. After
a filter, relative positions (RoPE, ALiBi, T5, Shaw's, DeBERTa's) are those of the
shortened grid (token j at j L / M). For encoder-decoder use (`upsample_sum`), the output of every block (the
run of layers between two filters) is upsampled back to the input length (nearest
neighbour), summed and renormalised, as the paper does.

Parameters are float32; activations run in the model's `dtype` (e.g. bfloat16); norms,
softmax and attention normalisers work in float32; logits come back in float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.decoding import BiasFn
from jxformers.nn.adaptive import ADAPTIVE_STACKS, ExitStack, GatedStack, UniversalStack
from jxformers.nn.blocks import Block
from jxformers.nn.delight import DelightBlock
from jxformers.nn.evolved import EvolvedDecoderCell, EvolvedEncoderCell
from jxformers.nn.layers import AdaNorm, Linear, Norm, check_tokens, lookup, normalise
from jxformers.nn.layouts import StackPlan
from jxformers.nn.lite import LiteBlock
from jxformers.nn.luna import LunaStack
from jxformers.nn.mixture import MixtureOfLogistics
from jxformers.nn.moe import NO_TOKEN
from jxformers.nn.positions import BIAS_KINDS, Positions
from jxformers.nn.produced import Produced
from jxformers.nn.relative import SharedTerms
from jxformers.nn.reversible import reversible_apply, reversible_decode_step
from jxformers.nn.set_transformer import ISAB, PMA
from jxformers.nn.tokenlearner import TokenLearnerStage
from jxformers.nn.transparent import combine_layers, transparent_weights
from jxformers.ops import fourier_downsample, fourier_downsample_padded, funnel_pool

DOWNSAMPLE_KINDS = ("fourier", "fourier_rescaled", "funnel")
# The pooled heads' readouts: the CLS token, the masked mean, PMA, or the last real token
# (a unidirectional encoder's natural readout: the only state that has seen every token).
POOLING_KINDS = ("cls", "mean", "pma", "last")
# Learned tokens beside the input (`Embedding.extra`): memory (Burtsev et al. 2020) is
# prepended and kept at the output; registers (Darcet et al. 2023) follow the CLS token
# (if any) and are dropped at the output.
EXTRA_TOKEN_KINDS = ("memory", "registers")
# What an Encoder or a LanguageModel stacks: transformer blocks, Set Transformer's ISABs,
# or one LunaStack (which carries its packed sequence between its own layers), or one
# adaptive-computation stack (`jxformers.nn.adaptive`: Universal Transformer, CCT, early exit).
AnyBlock = (
    Block | ISAB | LunaStack | LiteBlock | DelightBlock | EvolvedEncoderCell | EvolvedDecoderCell
    | UniversalStack | GatedStack | ExitStack
)  # fmt: skip
# The blocks called as a transformer Block is (apply_maps, decode_step_maps): the Block and
# the whole-model designs' cells (jxformers.nn.cells).
BLOCK_LIKE = (Block, LiteBlock, DelightBlock, EvolvedEncoderCell, EvolvedDecoderCell)


def _split(key, n):
    return [None] * n if key is None else list(jax.random.split(key, n))


def _check_length(n: int, max_len: int, what: str = "sequence", extra: int = 0):
    if n > max_len:
        held = f" ({extra} extra tokens included: embedding.extra_tokens)" if extra else ""
        raise ValueError(f"{what} length {n}{held} exceeds the model's max_len {max_len}")


def _check_reversible(blocks, reversible, positions: Positions):
    if reversible and not all(isinstance(b, Block) for b in blocks):
        raise ValueError(
            f"reversible wiring needs transformer Blocks; got {sorted({type(b).__name__ for b in blocks})}"
        )
    if reversible and _carries_maps(blocks):
        raise ValueError("reversible wiring runs each block's branches alone: it cannot carry attention maps")
    if reversible and any(isinstance(b, Block) and b.ffn is None for b in blocks):
        raise ValueError("reversible wiring pairs each attention with an FFN (G); got blocks without one (ffn none)")
    if reversible and any(isinstance(b, Block) and b.local is not None for b in blocks):
        raise ValueError("reversible wiring pairs each attention with an FFN (G); got blocks with LocalRNN sublayers")
    if reversible and any(after >= 0 for after in positions.peg_after):
        raise ValueError(
            f"reversible wiring recomputes the blocks from their outputs, which a PEG between them would break: "
            f"conditional positions on the embeddings only (after -1); got after {positions.peg_after}"
        )


def _carries_maps(blocks) -> bool:
    """Whether the blocks pass attention maps from one to the next (`jxformers.nn.cross_layer`)."""
    return any(isinstance(b, Block) and b.maps != "none" for b in blocks)


class Embedding(eqx.Module):
    """Token embedding (scaled by sqrt(d_model) unless `scale` is False) plus absolute
    positions (if any) plus token-type embeddings (if `type_vocab_size` > 0; type 0
    when none are given), then an optional norm (BERT's embedding LayerNorm), cast to
    the compute dtype; its table doubles as the tied output projection.

    `extra_tokens` = m > 0 adds m learned vectors (`extra`, ~ N(0, 0.02^2)) that the
    models put in the input stream (`with_extra`) and every layer processes: as
    `extra_kind` "memory" (Burtsev et al. 2020, "Memory Transformer", arXiv 2006.11527:
    [mem; CLS; x], kept in an encoder's output) or "registers" (Darcet et al. 2023,
    "Vision Transformers Need Registers", arXiv 2309.16588: [CLS; reg; x], as the
    authors' DINOv2 code inserts them, dropped at the output). Both sit in front of the
    tokens, so padding at the end never moves them. They enter as they are (no scale,
    no absolute position: a learned vector absorbs one) and occupy positions 0.. of the
    sequence's grid (relative positions see them); the tokens follow them.

    `factorized` = E (None: none): ALBERT's factorised embedding (Lan et al. 2020, section
    3.1): a `[vocab, E]` table, then `project`, a linear map E -> d_model (with a bias, as
    the authors' embedding_hidden_mapping_in); the token types, added positions and the
    norm act in E, before it, as in the authors' code (`positions` built with dim E).
    The tied readout is the product of both, logits = (x P^T) table^T."""

    table: Float[Array, "vocab width"]
    positions: Positions
    types: Float[Array, "types width"] | None
    norm: Norm | None
    extra: Float[Array, "extra d_model"] | None
    project: Linear | None  # ALBERT's E -> d_model map of a factorised embedding
    dtype: str = eqx.field(static=True)
    scale: bool = eqx.field(static=True)
    extra_kind: str = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        positions: Positions,
        *,
        dtype: str,
        scale: bool = True,
        type_vocab_size: int = 0,
        norm: Norm | None = None,
        extra_tokens: int = 0,
        extra_kind: str = "memory",
        factorized: int | None = None,
        key: PRNGKeyArray,
    ):
        if extra_kind not in EXTRA_TOKEN_KINDS or isinstance(extra_tokens, bool) or extra_tokens < 0:
            raise ValueError(f"extra_tokens >= 0 of a kind in {EXTRA_TOKEN_KINDS}; got {extra_tokens=}, {extra_kind=}")
        kt, ky = jax.random.split(key)
        width = factorized or d_model
        self.table = jax.random.normal(kt if type_vocab_size else key, (vocab_size, width)) / math.sqrt(width)
        self.types = 0.02 * jax.random.normal(ky, (type_vocab_size, width)) if type_vocab_size else None
        self.project = None if factorized is None else Linear(width, d_model, key=jax.random.fold_in(key, 3))
        self.positions, self.dtype, self.scale, self.norm = positions, dtype, scale, norm
        extra_key = jax.random.fold_in(key, 2)
        self.extra = 0.02 * jax.random.normal(extra_key, (extra_tokens, d_model)) if extra_tokens else None
        self.extra_kind = extra_kind

    @property
    def d_model(self) -> int:
        """The width of the vectors the embedding gives (the table's, or its projection's)."""
        return self.table.shape[1] if self.project is None else self.project.weight.shape[0]

    @property
    def num_extra(self) -> int:
        """m, the learned tokens beside the input (0: none)."""
        return 0 if self.extra is None else self.extra.shape[0]

    @property
    def num_memory(self) -> int:
        """How many rows the extra tokens take in front of the input (memory) or 0."""
        return self.num_extra if self.extra_kind == "memory" else 0

    def with_extra(self, x: Float[Array, "n d_model"], mask: Bool[Array, " n"] | None, *, cls: int = 0):
        """(x, mask) with the extra tokens, real (mask True): memory in front of everything,
        registers after the first `cls` rows (the CLS token)."""
        if self.extra is None:
            return x, mask
        at = 0 if self.extra_kind == "memory" else cls
        x = jnp.concatenate([x[:at], self.extra.astype(x.dtype), x[at:]])
        if mask is not None:
            mask = jnp.concatenate([mask[:at], jnp.ones((self.num_extra,), bool), mask[at:]])
        return x, mask

    def with_extra_ids(self, ids: Int[Array, " n"], *, cls: int = 0) -> Int[Array, " n_out"]:
        """The token ids of `with_extra`'s rows: `NO_TOKEN` where it puts the extra
        tokens (for MoE layers that route by token id)."""
        if self.extra is None:
            return ids
        at = 0 if self.extra_kind == "memory" else cls
        return jnp.concatenate([ids[:at], jnp.full((self.num_extra,), NO_TOKEN, ids.dtype), ids[at:]])

    def __call__(
        self, tokens: Int[Array, " n"], positions: Int[Array, " n"], token_types: Int[Array, " n"] | None = None
    ) -> Float[Array, "n d_model"]:
        x = lookup(self.table, tokens)
        if self.scale:
            x = x * math.sqrt(self.table.shape[1])
        x = self.positions.modulate(x, tokens, positions)  # "complex": turned by position
        extra = self.positions.embed(positions)
        x = x if extra is None else x + extra
        if self.types is not None:
            x = x + lookup(self.types, jnp.zeros_like(tokens) if token_types is None else token_types, "token_types")
        elif token_types is not None:
            raise ValueError("token_types given, but this embedding has no token-type table (type_vocab_size 0)")
        if self.norm is not None:
            x = self.norm(x)
        if self.project is not None:
            x = self.project(x)
        return x.astype(self.dtype)

    def logits(self, x: Float[Array, "*n d_model"]) -> Float[Array, "*n vocab"]:
        if self.project is not None:  # the factorised table W = table P read out: x P^T, then the table
            x = x @ self.project.weight.astype(x.dtype)
        return (x @ self.table.T.astype(x.dtype)).astype(jnp.float32)


def _bias_fn(positions: Positions) -> BiasFn | SharedTerms | None:
    """What a decoding step's attentions get for their position bias: a function of the
    positions (a bias kind's `bias` returns an array), or the relative kinds' shared
    terms, which each attention completes (None for Shaw's, which share nothing)."""
    if positions.kind in BIAS_KINDS:
        return cast(BiasFn, positions.bias)
    return positions.shared


class Encoder(eqx.Module):
    """Embedding, blocks (non-causal), optional downsampling before chosen blocks, final norm.

    `filters` maps a block index i to a keep ratio r: the sequence is shortened right
    before block i, ahead of its attention (before block 0 the filter acts on the
    embeddings), so block i and every later block run at the shorter length. Only the
    tokens are shortened; the CLS token, if any, is kept as it is. By `downsample`:

    * "fourier" (He et al. 2023, eq. 7-8): the L real tokens become ceil(r L) by
      `fourier_downsample` (orthonormal inverse DCT at the new length, the paper's
      amplitude); "fourier_rescaled" multiplies that by sqrt(ceil(r L) / L) (see
      `fourier_downsample`'s `rescale`). `{0: 0.2}` is the paper's LRA setting (80% of
      the sequence removed at the first layer, as the official code does inside layer
      0). One difference from that code: it filters the normed stream norm1(x) and
      carries the filtered normed stream on as the residual; here the residual stream x
      itself is filtered, and block i normalises the result as every pre-norm block does.
    * "funnel" (Dai et al. 2020, pool-query-only): mean pooling with stride 1/r; block
      i's self-attention takes the pooled stream as queries and the unpooled stream of
      block i - 1 (the embeddings for i = 0) as keys and values, and the residual stream
      continues pooled. Block i's attention module must therefore take separate keys and
      values (built with `cross=True`; `build_model` does this).

    Relative positions (RoPE, ALiBi, T5, Shaw's, DeBERTa's) follow the shortened grid:
    after a filter that turns L real tokens into M, token j sits at position j L / M of
    the sequence before it (stride s for Funnel), so the distances between tokens keep
    their meaning (the bucketed ones round them); absolute positions are added once to
    the embeddings and need nothing.

    `token_learner` (a `TokenLearnerStage`, Ryoo et al. 2021): after block `after_layer`
    the tokens (not the CLS token) become k learned tokens and later blocks run on
    them; with `fuse`, every later block runs on the tokens its own TokenLearner learns
    and a TokenFuser maps its output back onto the sequence (residual added). Learned
    tokens have no positions: absolute positions only (ModelConfig checks), no filters.

    Arguments (constructor): `embedding`, `blocks`, `norm` (the final norm; None: none, as
    in BERT, whose post-norm blocks end normalised), `max_len`,
    `use_cls` (prepend a learned CLS token), `filters` ({block index: keep ratio}),
    `downsample` (one of DOWNSAMPLE_KINDS), `reversible` (Reformer's wiring; no
    filters), `token_learner` (or None), `key` (for the CLS token).
    """

    embedding: Embedding
    cls: Float[Array, " d_model"] | None
    blocks: tuple[AnyBlock, ...]
    norm: Norm | None
    token_learner: TokenLearnerStage | None
    filters: tuple[tuple[int, float], ...] = eqx.field(static=True)
    downsample: str = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    reversible: bool = eqx.field(static=True)
    plan: StackPlan = eqx.field(static=True)  # sharing, LayerDrop, pruning (jxformers.nn.layouts)

    def __init__(
        self,
        embedding: Embedding,
        blocks: list[AnyBlock],
        norm: Norm | None,
        *,
        max_len: int,
        use_cls: bool,
        filters: dict[int, float] | None = None,
        downsample: str = "fourier",
        reversible: bool = False,
        token_learner: TokenLearnerStage | None = None,
        plan: StackPlan | None = None,
        key: PRNGKeyArray,
    ):
        if downsample not in DOWNSAMPLE_KINDS:
            raise ValueError(f"downsample must be one of {DOWNSAMPLE_KINDS}; got {downsample!r}")
        filters = dict(filters or {})
        for layer, ratio in filters.items():
            if not (isinstance(layer, int) and 0 <= layer < len(blocks)):
                raise ValueError(f"filter layer must be a block index in [0, {len(blocks)}); got {layer!r}")
            if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
                raise ValueError(f"filter keep ratio must be in (0, 1]; got {ratio!r} at layer {layer}")
            if downsample == "funnel" and abs(1 / ratio - round(1 / ratio)) > 1e-6:
                raise ValueError(
                    f"funnel pooling needs keep ratios 1/stride (1/2, 1/3...); got {ratio} at layer {layer}"
                )
        for i, block in enumerate(blocks):
            pooling = downsample == "funnel" and i in filters
            if isinstance(block, Block) and block.attention.cross != pooling:
                raise ValueError(
                    f"block {i}'s attention must take separate keys and values (cross=True) exactly when funnel "
                    f"pooling sits before it; got cross={block.attention.cross} with {downsample=}, {filters=}"
                )
        if reversible and filters:
            raise ValueError("a reversible encoder cannot shorten its sequence (filters)")
        _check_reversible(blocks, reversible, embedding.positions)
        if token_learner is not None and (
            reversible
            or filters
            or not all(isinstance(b, Block) for b in blocks)
            or token_learner.after_layer >= len(blocks) - 1
        ):
            raise ValueError(
                f"a token learner needs transformer Blocks after its after_layer "
                f"({token_learner.after_layer}, {len(blocks)} blocks), no filters and no reversible wiring"
            )
        if embedding.extra is not None and (filters or token_learner is not None):
            raise ValueError(
                f"{embedding.extra_kind} tokens sit at fixed rows of one sequence length: no filters and no token "
                f"learner; got {filters=}, token_learner={token_learner is not None}"
            )
        if _carries_maps(blocks) and (filters or token_learner is not None):
            raise ValueError(
                f"blocks that carry attention maps need one sequence length throughout: no filters and no "
                f"token learner; got {filters=}, token_learner={token_learner is not None}"
            )
        self.reversible, self.token_learner = reversible, token_learner
        self.plan = plan or StackPlan()
        self.embedding, self.blocks, self.norm = embedding, self.plan.hollow(blocks), norm
        self.cls = 0.02 * jax.random.normal(key, (embedding.d_model,)) if use_cls else None
        self.filters, self.downsample, self.max_len = tuple(sorted(filters.items())), downsample, max_len

    def _shorten(self, x, mask, spacing, ratio, padded):
        """Downsample the tokens after the CLS token; returns the shorter x, its mask and
        the new spacing of the tokens' positions (in positions of the input)."""
        start = 0 if self.cls is None else 1
        head, body, body_mask = x[:start], x[start:], mask[start:]
        length = body_mask.sum()
        if self.downsample == "funnel":
            stride = round(1 / ratio)
            body, body_mask = funnel_pool(body, stride, body_mask)
            spacing = spacing * stride
        else:
            rescale = self.downsample == "fourier_rescaled"
            if padded:
                body, body_mask = fourier_downsample_padded(body, length, ratio, rescale=rescale)
            else:  # no padding: one plain FFT each way, cheaper than the chirp transforms of twice the length
                body = fourier_downsample(body, ratio, rescale=rescale)
                body_mask = jnp.ones(body.shape[:1], bool)
            spacing = spacing * length / jnp.maximum(body_mask.sum(), 1)
        return jnp.concatenate([head, body]), jnp.concatenate([mask[:start], body_mask]), spacing

    def _learn_tokens(self, learner, x, mask):
        return _learned(self, learner, x, mask)

    def _fused_block(self, block, i, x, mask, *, key, inference):
        """TokenLearner -> block -> TokenFuser, plus the residual (Ryoo et al. 2021, section
        3.2); the CLS token (if any) passes through the block beside the learned tokens."""
        start = 0 if self.cls is None else 1
        small, small_mask = _learned(self, self.token_learner.learner(i), x, mask)
        y, produced = block.apply(
            small,
            kv_mask=small_mask,
            bias=None,
            positions=self._positions(small.shape[0], 1.0),
            key=key,
            inference=inference,
        )
        body = x[start:]
        return jnp.concatenate([y[:start], body + self.token_learner.fuser(i)(y[start:], body)]), produced

    def _positions(self, n: int, spacing) -> Float[Array, " n"]:
        """Positions of a sequence of n (CLS at 0, token j at 1 + j * spacing with CLS)."""
        start = 0 if self.cls is None else 1
        body = start + jnp.arange(n - start, dtype=jnp.float32) * spacing
        return jnp.concatenate([jnp.zeros((start,), jnp.float32), body])

    def __call__(
        self, tokens: Int[Array, " seq"], mask: Bool[Array, " seq"] | None = None, **kwargs
    ) -> tuple[Float[Array, "out d_model"], Bool[Array, " out"]]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, " seq"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
        upsample_sum: bool = False,
        token_types: Int[Array, " seq"] | None = None,
        readout: Any = None,
        layers: bool = False,
    ) -> tuple[tuple[Float[Array, "*sources out d_model"], Bool[Array, " out"]], Produced]:
        """Arguments:
            tokens: `[seq]` ids; mask: `[seq]` True for real tokens (padding at the end
                when downsampling, which keeps the real prefix). Without a mask the
                spectral filter is one FFT each way; with one, a chirp transform sized
                to each example's real length (FFTs of twice the length; both
                O(n log n)).
            upsample_sum: return, instead of the last block's output, the sum of every
                block's output upsampled (nearest neighbour) to the input length and
                then normalised: the Fourier Transformer's encoder-decoder output. A
                block is a run of layers between two filters (a filter before layer 0
                leaves no run before it), so filters {2: r} on 12 layers sum two terms:
                the output of layers 0-1 at full length and that of layers 2-11.
            token_types: `[seq]` segment ids (BERT's token types; default 0), for an
                embedding with a token-type table.
            readout: an early-exit stack's exits, `(block, hidden, mask) -> logits`
                (`jxformers.nn.adaptive.ExitStack`; the `Classifier` passes its heads).
            layers: return every layer's output instead of the last, stacked
                `[num_layers + 1, out, d_model]`: the embeddings (block 0's input) first,
                each through the final norm (transparent attention, `jxformers.nn.transparent`;
                one length throughout: no filters, token learner or reversible wiring).

        Returns:
            `((hidden [out, d_model], mask [out]), Produced)`; `out` = seq (+1 for the CLS
            token) unless filters shorten it (upsample_sum: always seq, with the input's
            mask); the `Produced` holds what the blocks made (MoE aux, k-means inputs).
        """
        n = check_tokens(tokens, mask)
        start = 0 if self.cls is None else 1
        _check_length(n + start + self.embedding.num_extra, self.max_len, extra=self.embedding.num_extra)
        padded = mask is not None
        mask = jnp.ones((n,), bool) if mask is None else mask
        first = start + self.embedding.num_extra  # the tokens' first position: after the extra tokens and CLS
        x = self.embedding(tokens, jnp.arange(first, n + first), token_types)
        ids = tokens  # each row's token id while the rows are tokens (hash-routed MoE layers read them)
        if self.cls is not None:
            x = jnp.concatenate([self.cls.astype(x.dtype)[None], x])
            mask = jnp.concatenate([jnp.ones((1,), bool), mask])
            ids = jnp.concatenate([jnp.full((1,), NO_TOKEN, ids.dtype), ids])
        x, mask = self.embedding.with_extra(x, mask, cls=start)
        ids = self.embedding.with_extra_ids(ids, cls=start)
        assert mask is not None
        condition = self.embedding.positions.condition  # CPE's PEGs: the rows before the first token pass by
        x = condition(-1, x, mask, skip=first)
        if layers and (self.reversible or self.filters or self.token_learner is not None or upsample_sum):
            raise ValueError("Encoder.apply(layers=True) needs one length and plain wiring throughout")
        states = [x]  # every layer's output (layers=True)
        if self.reversible:
            bias = self.embedding.positions.grid_bias(x.shape[0])
            blocks = cast(tuple[Block, ...], self.plan.filled(self.blocks))  # _check_reversible: all Blocks
            x, produced = reversible_apply(blocks, x, kv_mask=mask, bias=bias, key=key, inference=inference)
            return self._drop_registers(self._final(x, mask), mask), produced.under("blocks")
        input_mask, filters, outputs, produced = mask, dict(self.filters), [], Produced()
        spacing = jnp.ones((), jnp.float32)
        pos = self._positions(x.shape[0], spacing)
        on_grid = True  # positions 0..n-1 until a filter resamples them
        maps = None  # the attention maps one block hands the next (jxformers.nn.cross_layer)
        blocks, plan = self.plan.filled(self.blocks), self.plan
        gates = plan.gates(len(blocks), key, inference)  # LayerDrop's, in training
        for i, (block, k) in enumerate(zip(blocks, _split(key, len(blocks)), strict=True)):
            source = {}
            if i in filters:
                if upsample_sum and i > 0:
                    outputs.append(_upsample(x, mask, input_mask))
                if self.downsample == "funnel":
                    source = {"source": x, "source_positions": pos}
                full_mask, full_pos = mask, pos
                x, mask, spacing = self._shorten(x, mask, spacing, filters[i], padded)
                ids = None  # rows are no longer tokens (ModelConfig keeps hash routing before filters)
                pos = self._positions(x.shape[0], spacing)
                on_grid = False
            kv_mask, kv_pos = (full_mask, full_pos) if source else (mask, pos)
            if on_grid:
                bias = self.embedding.positions.grid_bias(x.shape[0])
            else:
                bias = self.embedding.positions.bias(pos, kv_pos)
            learn = self.token_learner
            made = Produced()
            if learn is not None and learn.fuse and i > learn.after_layer:
                x, made = self._fused_block(block, i, x, mask, key=k, inference=inference)
            elif isinstance(block, BLOCK_LIKE) and plan.runs(i, inference):
                apply = functools.partial(
                    block.apply_maps, kv_mask=kv_mask, bias=bias, positions=pos, token_ids=ids, key=k,
                    inference=inference, **source,
                )  # fmt: skip
                x, made, maps = plan.run(gates, i, apply, x, maps)
            elif isinstance(block, BLOCK_LIKE):  # pruned at inference (keep_layers)
                pass
            elif isinstance(block, ADAPTIVE_STACKS):  # one adaptive stack (ModelConfig: no filters)
                x, made = block.apply(
                    x, kv_mask=kv_mask, bias=bias, positions=pos, token_ids=ids, readout=readout, key=k,
                    inference=inference,
                )  # fmt: skip
            else:  # ISAB, LunaStack: no filters and no bias positions (ModelConfig refuses them)
                x = block(x, kv_mask=kv_mask, key=k, inference=inference)
            produced = produced + made.under("blocks", i)
            x = condition(i, x, mask, skip=first)  # ModelConfig: no PEG after the tokens are learned
            if learn is not None and not learn.fuse and i == learn.after_layer:
                x, mask = self._learn_tokens(learn.learner(i), x, mask)
                pos = self._positions(x.shape[0], spacing)
                ids = None  # learned tokens: no token ids from here on
            states.append(x)
        if layers:
            outputs = [self._drop_registers(self._final(h, mask), mask)[0] for h in states]
            return (jnp.stack(outputs), self._drop_registers(x, mask)[1]), produced
        if upsample_sum:
            outputs.append(_upsample(x, mask, input_mask))
            return self._drop_registers(self._final(sum(outputs[1:], outputs[0]), input_mask), input_mask), produced
        return self._drop_registers(self._final(x, mask), mask), produced

    def _final(self, x, mask=None):
        return x if self.norm is None else normalise(self.norm, x, mask)

    def _drop_registers(self, x, mask):
        """(x, mask) without the registers, which are discarded at the output (Darcet et
        al. 2023); memory tokens stay, as in the Memory Transformer's encoder output."""
        if self.embedding.extra_kind != "registers" or self.embedding.extra is None:
            return x, mask
        start, m = 0 if self.cls is None else 1, self.embedding.num_extra
        return jnp.concatenate([x[:start], x[start + m :]]), jnp.concatenate([mask[:start], mask[start + m :]])


def _encode(encoder, tokens, mask, *, key, inference):
    """((hidden, mask), Produced) of an `Encoder` or a `PerceiverEncoder`."""
    return encoder.apply(tokens, mask, key=key, inference=inference)


def _learned(encoder, learner, x, mask):
    """The CLS token (if any) followed by the k tokens `learner` learns from the others."""
    start = 0 if encoder.cls is None else 1
    tokens = learner(x[start:], mask[start:])
    any_real = jnp.any(mask[start:])
    return (
        jnp.concatenate([x[:start], tokens]),
        jnp.concatenate([mask[:start], jnp.broadcast_to(any_real, tokens.shape[:1])]),
    )


def last_real(mask: Bool[Array, " n"]) -> Int[Array, ""]:
    """The index of the last True of `mask` (the last real token, wherever the padding
    sits); 0 when there is none."""
    n = mask.shape[0]
    return jnp.where(mask.any(), n - 1 - jnp.argmax(mask[::-1]), 0)


def _upsample(x, mask, target_mask):
    """Nearest-neighbour upsampling of the real prefix of x (mask.sum() rows) onto the
    real prefix of the target (target_mask.sum() rows): row j takes floor(j * m / L)."""
    m, length = mask.sum(), jnp.maximum(target_mask.sum(), 1)
    idx = jnp.minimum((jnp.arange(target_mask.shape[0]) * m) // length, jnp.maximum(m - 1, 0))
    return jnp.where(target_mask[:, None], x[idx], 0)


class Classifier(eqx.Module):
    """Sequence classification: encoder (an `Encoder`, a `PerceiverEncoder`, or a
    `jxformers.nn.hierarchical.HierarchicalEncoder` of documents `[sentences, words]`), CLS,
    masked-mean, PMA pooling (Set Transformer's PMA_k; its k pooled vectors are
    concatenated) or the last real token's state (a causal encoder's), linear head."""

    encoder: eqx.Module
    pma: PMA | None
    head: Linear
    exit_heads: tuple[Linear, ...] | None  # early exit: the internal classifiers of blocks 0..L-2
    pooling: str = eqx.field(static=True)

    def __init__(
        self,
        encoder: eqx.Module,
        num_classes: int,
        *,
        pooling: str,
        pma: PMA | None = None,
        exits: int = 0,
        key: PRNGKeyArray,
    ):
        """`exits` > 0: an internal classifier (its own linear head on the pooled, finally
        normalised state) after each of the first `exits` blocks of an encoder whose stack
        is an `ExitStack` (PABEE, Zhou et al. 2020); the last block's is `head`."""
        if pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {POOLING_KINDS}; got {pooling!r}")
        if (pooling == "cls") != (encoder.cls is not None):
            raise ValueError("pooling='cls' needs an encoder with a CLS token (and mean or PMA pooling one without)")
        if (pooling == "pma") != (pma is not None):
            raise ValueError(f"pooling='pma' needs a PMA module (and no other pooling takes one); got {pooling=}")
        self.encoder, self.pooling, self.pma = encoder, pooling, pma
        width = encoder.embedding.d_model * (1 if pma is None else pma.seeds.shape[0])
        self.head = Linear(width, num_classes, key=key)
        if exits and pma is not None:
            raise ValueError("internal classifiers pool each block's output by cls or mean; got pooling 'pma'")
        keys = jax.random.split(jax.random.fold_in(key, 1), max(exits, 1))
        self.exit_heads = tuple(Linear(width, num_classes, key=k) for k in keys[:exits]) if exits else None

    def _exit_readout(self, block: int, h, mask):
        """An internal classifier's logits after `block` (PABEE): the encoder's final norm,
        the pooling, then that block's head (the last block's: `head`)."""
        assert self.exit_heads is not None
        norm = cast(Any, self.encoder).norm
        pooled = self._pooled(h if norm is None else normalise(norm, h, mask), mask)
        head = self.exit_heads[block] if block < len(self.exit_heads) else self.head
        return head(pooled).astype(jnp.float32)

    def pool(self, tokens, mask=None, *, key=None, inference=False) -> tuple[Float[Array, " width"], Produced]:
        """(The pooled vector the head reads, what the encoder produced.)"""
        if self.exit_heads is not None:
            padded = jnp.ones(tokens.shape, bool) if mask is None else mask
            readout = {"readout": self._exit_readout}
            encoder = cast(Any, self.encoder)  # an Encoder: ModelConfig builds exits on the transformer stack
            (h, m), produced = encoder.apply(tokens, padded, key=key, inference=inference, **readout)
        else:
            (h, m), produced = _encode(self.encoder, tokens, mask, key=key, inference=inference)
        return self._pooled(h, m, key=key, inference=inference), produced.under("encoder")

    def _pooled(self, h, m, *, key=None, inference=False) -> Float[Array, " width"]:
        """The pooled vector of an encoder's output (h, its mask)."""
        skip = cast(Any, self.encoder).embedding.num_memory  # the head reads the real tokens only
        h, m = h[skip:], m[skip:]
        if self.pooling == "cls":
            return h[0]
        if self.pooling == "last":
            return h[last_real(m)]
        if self.pma is not None:
            k_pool = None if key is None else jax.random.fold_in(key, 1)
            return self.pma(h, m, key=k_pool, inference=inference).reshape(-1)
        w = m.astype(jnp.float32)[:, None]
        return (jnp.sum(h.astype(jnp.float32) * w, 0) / jnp.maximum(w.sum(), 1.0)).astype(h.dtype)

    def __call__(
        self, tokens: Int[Array, "*seq"], mask: Bool[Array, "*seq"] | None = None, **kwargs
    ) -> Float[Array, " num_classes"]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, "*seq"],
        mask: Bool[Array, "*seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, " num_classes"], Produced]:
        """`tokens [seq]` (a hierarchical encoder's: `[sentences, words]`) and a padding
        mask of their shape -> (class logits `[num_classes]` (float32), what the encoder
        produced: MoE aux, k-means inputs)."""
        pooled, produced = self.pool(tokens, mask, key=key, inference=inference)
        if produced.exits is not None:  # early exit: the exit's logits (the last block's in training)
            return produced.exits.output, produced
        return self.head(pooled).astype(jnp.float32), produced


class DualClassifier(eqx.Module):
    """Two-tower matching (LRA Retrieval): one shared encoder pools each input to x1, x2;
    an MLP classifies [x1, x2, x1 * x2, x1 - x2]."""

    tower: Classifier
    hidden: Linear
    out: Linear

    def __init__(self, tower: Classifier, num_classes: int, *, key: PRNGKeyArray):
        d = tower.head.weight.shape[1]
        k1, k2 = jax.random.split(key)
        self.tower, self.hidden, self.out = tower, Linear(4 * d, d, key=k1), Linear(d, num_classes, key=k2)

    def __call__(self, tokens: Int[Array, " seq"], other: Int[Array, " seq2"], *args, **kwargs):
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, other, *args, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, " seq"],
        other: Int[Array, " seq2"],
        mask: Bool[Array, " seq"] | None = None,
        other_mask: Bool[Array, " seq2"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, " num_classes"], Produced]:
        """(Match logits `[num_classes]`, what the tower produced on both inputs: a
        module's k-means inputs from the two calls share its path.)"""
        k1, k2 = _split(key, 2)
        x1, made1 = self.tower.pool(tokens, mask, key=k1, inference=inference)
        x2, made2 = self.tower.pool(other, other_mask, key=k2, inference=inference)
        h = jax.nn.gelu(self.hidden(jnp.concatenate([x1, x2, x1 * x2, x1 - x2])))
        return self.out(h).astype(jnp.float32), (made1 + made2).under("tower")


def _quiet_readout(norm: Norm, d_model: int) -> Norm:
    """The final norm with its gain initialised to 1/d_model, so that the tied readout
    starts near the uniform prediction (loss ln(vocab)).

    Tied to this table (std 1/sqrt(d), read in times sqrt(d): Vaswani et al.'s scheme),
    a normalised final state that still holds its token's embedding, as it does after a
    few blocks, scores that token about sqrt(d) above the others: an untrained model
    echoes its input and starts far above chance (5.8 against ln 11 = 2.4 on copy).
    T5 and PaLM multiply the tied readout by 1/sqrt(d), but of std-1 tables read in
    unscaled: the same logits as ours, echo included, which depth dilutes in big models.
    GPT-2 draws a small table (std 0.02) read in unscaled, a weak token signal beside the
    positions; muP zero-initialises the readout. We pick a near-zero gain: only the
    initialisation changes (trained checkpoints keep their meaning), the scale is learned
    (a norm gain, not weight-decayed), and untrained logits still depend on the input
    (a zero gain would make them constant, blinding causality and decoding tests). On
    the tiny copy preset (600 steps, 2 seeds) it ends as the unscaled start does; a fixed
    1/sqrt(d) on the readout ended behind (eval accuracy 0.87-0.89 against 0.92)."""
    if isinstance(norm, AdaNorm):  # no gain to start small: left as it is
        return norm
    return eqx.tree_at(lambda n: n.weight, norm, norm.weight / d_model)


class LanguageModel(eqx.Module):
    """Decoder-only causal language model (or, with cross-attention blocks, the decoder
    of an encoder-decoder model).

    `model(tokens)` gives next-token logits `[seq, vocab]` in parallel;
    `init_decode_state(max_len)` and `decode_step(token, state)` run it one token at a
    time with a fixed-shape state per layer (see `jxformers.decoding`).

    Memory tokens (`embedding.extra`, kind "memory"; Burtsev et al. 2020) come first:
    the model runs on [mem; x] under the causal mask, so memory token i attends memory
    tokens <= i and every real token attends all of them; real token j sits at position
    m + j, and the logits are the real tokens' only. Decoding prefills them: the memory's
    hidden states depend on the layers below, not on the input, so `init_decode_state`
    feeds the m vectors through `decode_step`'s layers once (m steps), which gives every
    later step exactly the parallel forward's keys and values.
    """

    embedding: Embedding
    blocks: tuple[AnyBlock, ...]
    norm: Norm
    unembed: Linear | None  # None: tied to the embedding table (or a `head` reads out)
    head: MixtureOfLogistics | None  # an output distribution of its own instead of the vocab softmax
    max_len: int = eqx.field(static=True)
    reversible: bool = eqx.field(static=True)
    plan: StackPlan = eqx.field(static=True)  # sharing, LayerDrop, pruning (jxformers.nn.layouts)

    def __init__(
        self,
        embedding: Embedding,
        blocks: list[AnyBlock],
        norm,
        *,
        max_len: int,
        tie: bool,
        reversible: bool = False,
        head: MixtureOfLogistics | None = None,
        plan: StackPlan | None = None,
        key: PRNGKeyArray,
    ):
        """`head`: an output head whose "logits" are normalised log-probabilities (the
        pixel mixture of `jxformers.nn.mixture`); it replaces the (tied) readout."""
        _check_reversible(blocks, reversible, embedding.positions)
        if embedding.extra is not None and embedding.extra_kind != "memory":
            raise ValueError(
                f"a causal language model takes memory tokens (prepended); got {embedding.extra_kind=}: registers "
                "follow the real tokens, which the causal mask keeps from ever attending them"
            )
        vocab, d = embedding.table.shape[0], embedding.d_model
        self.plan = plan or StackPlan()
        self.embedding, self.blocks, self.max_len = embedding, self.plan.hollow(blocks), max_len
        tie = tie and head is None
        self.norm = _quiet_readout(norm, d) if tie else norm
        self.reversible = reversible
        self.head = head
        self.unembed = None if tie or head is not None else Linear(d, vocab, use_bias=False, key=key)

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads: [0, vocab_size)."""
        return self.embedding.table.shape[0]

    def _logits(self, x, mask=None):
        x = normalise(self.norm, x, mask)
        if self.head is not None:
            return self.head(x)
        return self.embedding.logits(x) if self.unembed is None else self.unembed(x).astype(jnp.float32)

    def _readout(self, block: int, x, mask=None):
        """An early-exit stack's exit after `block`: the model's own readout (the classifier
        shared by every exit)."""
        del block
        return self._logits(x, mask)

    def __call__(
        self, tokens: Int[Array, " seq"], mask: Bool[Array, " seq"] | None = None, **kwargs
    ) -> Float[Array, "seq vocab"]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, " seq"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        context: Float[Array, "*blocks ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq vocab"], Produced]:
        """Arguments:
            tokens: `[seq]` ids; mask: `[seq]` True for real tokens.
            context, context_mask: encoder output for cross-attention blocks (or, stacked
                `[blocks, ctx, d_model]`, one per block: transparent attention).

        Returns:
            `([seq, vocab] float32 logits, Produced)`; row i predicts token i + 1; the
            `Produced` holds what the blocks made (MoE aux, k-means inputs).
        """
        x, mask, produced = self.features(
            tokens, mask, context=context, context_mask=context_mask, key=key, inference=inference
        )
        return self._logits(x, mask), produced

    def features(
        self,
        tokens: Int[Array, " seq"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        context: Float[Array, "*blocks ctx d_model"] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Bool[Array, " seq"] | None, Produced]:
        """`apply` up to the last block: (its output for the real tokens `[seq, d_model]`,
        before the final norm and the readout; their mask; Produced). Memformer's memory
        writer reads these states (`jxformers.nn.memformer`)."""
        n, m = check_tokens(tokens, mask), self.embedding.num_extra
        _check_length(n + m, self.max_len, extra=m)
        x = self.embedding(tokens, jnp.arange(m, m + n))
        x, mask = self.embedding.with_extra(x, mask)  # [mem; x]: the memory first
        ids = self.embedding.with_extra_ids(tokens)  # each row's token id (hash-routed MoE layers)
        positions = jnp.arange(n + m)
        bias = self.embedding.positions.grid_bias(n + m)
        condition = self.embedding.positions.condition  # CPE's PEGs: the memory tokens pass by
        x = condition(-1, x, mask, skip=m)
        if self.reversible:
            x, produced = reversible_apply(
                cast(tuple[Block, ...], self.plan.filled(self.blocks)),  # _check_reversible: all Blocks
                x,
                kv_mask=mask,
                bias=bias,
                positions=positions,
                key=key,
                inference=inference,
            )
            return x[m:], None if mask is None else mask[m:], produced.under("blocks")
        produced, maps = Produced(), None  # maps: what one block hands the next (nn.cross_layer)
        blocks, plan = self.plan.filled(self.blocks), self.plan
        gates = plan.gates(len(blocks), key, inference)  # LayerDrop's, in training
        for i, (block, k) in enumerate(zip(blocks, _split(key, len(blocks)), strict=True)):
            if isinstance(block, BLOCK_LIKE) and not plan.runs(i, inference):
                pass  # pruned at inference (keep_layers)
            elif isinstance(block, BLOCK_LIKE):
                apply = functools.partial(
                    block.apply_maps, kv_mask=mask, bias=bias, positions=positions,
                    context=context if context is None or context.ndim == 2 else context[i],
                    context_mask=context_mask, token_ids=ids, key=k, inference=inference,
                )  # fmt: skip
                x, made, maps = plan.run(gates, i, apply, x, maps)
                produced = produced + made.under("blocks", i)
            elif isinstance(block, ADAPTIVE_STACKS):  # one adaptive stack (ModelConfig: no memory tokens)
                x, made = block.apply(
                    x, kv_mask=mask, bias=bias, positions=positions, token_ids=ids, readout=self._readout, key=k,
                    inference=inference,
                )  # fmt: skip
                produced = produced + made.under("blocks", i)
            else:  # a LunaStack (causal Luna; a seq2seq decoder's reads the encoder output): no bias or positions
                x = block(x, kv_mask=mask, context=context, context_mask=context_mask, key=k, inference=inference)
            x = condition(i, x, mask, skip=m)
        return x[m:], None if mask is None else mask[m:], produced

    def init_decode_state(self, max_len: int) -> dict[str, Any]:
        """Per-layer decoding states for up to `max_len` tokens (fixed shapes): empty, or
        holding the m memory tokens (prefilled; `length` starts at m); with conditional
        positions, each PEG's last k - 1 inputs ("pegs"), which the memory never enters."""
        m = self.embedding.num_extra
        _check_length(max_len + m, self.max_len, "decoding", extra=m)
        dtype = jnp.dtype(self.embedding.dtype)
        state = {
            "layers": tuple(b.init_decode_state(max_len + m, dtype) for b in self.plan.filled(self.blocks)),
            "length": jnp.zeros((), jnp.int32),
        }
        floater = self.embedding.positions.floater
        if floater is not None:  # FLOATER: every block's p(t_length), advanced one Δ per token
            state["floater"] = floater.start
        if self.embedding.positions.pegs:
            state["pegs"] = self.embedding.positions.init_peg_states(dtype)
        if self.embedding.extra is not None:
            feed = lambda s, v: (self._step(v, s, token_id=jnp.array(NO_TOKEN), memory=True)[1], None)  # noqa: E731
            state = jax.lax.scan(feed, state, self.embedding.extra.astype(dtype))[0]
        return state

    def decode_step(
        self,
        token: Int[Array, ""],
        state: dict[str, Any],
        *,
        context_kv: tuple[Any, ...] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
    ) -> tuple[Float[Array, " vocab"], dict[str, Any]]:
        """Feed one token at position `state["length"]`; returns the next-token logits
        `[vocab]` and the new state."""
        x = self.embedding(token[None], state["length"][None])[0]
        return self._step(x, state, token_id=token, context_kv=context_kv, context_mask=context_mask)

    def decode_features(
        self,
        token: Int[Array, ""],
        state: dict[str, Any],
        *,
        context_kv: tuple[Any, ...] | None = None,
        context_mask: Bool[Array, " ctx"] | None = None,
    ) -> tuple[Float[Array, " d_model"], dict[str, Any]]:
        """`decode_step` up to the last block: (its output `[d_model]`, before the final
        norm and the readout, which `logits` applies; the new state)."""
        x = self.embedding(token[None], state["length"][None])[0]
        return self._step_features(x, state, token_id=token, context_kv=context_kv, context_mask=context_mask)

    def logits(self, x: Float[Array, "*n d_model"]) -> Float[Array, "*n vocab"]:
        """The readout (final norm, then the tied table, the unembedding or the head) of
        the last block's output (`features`, `decode_features`)."""
        return self._logits(x)

    def _step(self, x, state, *, token_id, context_kv=None, context_mask=None, memory=False):
        """`decode_step` from the input vector x `[d_model]` on (a token's embedding or a
        memory token, `memory`: which the PEGs pass by); `token_id` is its token's id
        (`NO_TOKEN` for a memory token)."""
        x, state = self._step_features(
            x, state, token_id=token_id, context_kv=context_kv, context_mask=context_mask, memory=memory
        )
        return self._logits(x), state

    def _step_features(self, x, state, *, token_id, context_kv=None, context_mask=None, memory=False):
        bias_fn, layers, positions = _bias_fn(self.embedding.positions), [], self.embedding.positions
        floater, advanced = positions.floater, {}
        if floater is not None:  # this position's p^(n): the rows the parallel forward's grid has here
            bias_fn = SharedTerms(flow=state["floater"][:, None])
            advanced = {"floater": floater.advance(state["floater"], state["length"])}
        pegs = state.get("pegs", ())

        def condition(after, x):
            nonlocal pegs
            if memory:
                return x
            x, pegs = positions.condition_step(after, x, pegs)
            return x

        x = condition(-1, x)
        kept = {"pegs": pegs} if "pegs" in state else {}
        if self.reversible:
            x, states = reversible_decode_step(self.plan.filled(self.blocks), x, state["layers"], bias_fn=bias_fn)
            return x, {"layers": states, "length": state["length"] + 1} | kept | advanced
        maps = None  # this token's row of the maps one block hands the next (nn.cross_layer)
        for i, (block, layer_state) in enumerate(zip(self.plan.filled(self.blocks), state["layers"], strict=True)):
            kv = None if context_kv is None else context_kv[i]
            if isinstance(block, BLOCK_LIKE) and not self.plan.runs(i, True):
                pass  # pruned at inference (keep_layers): its state stays as it is
            elif isinstance(block, BLOCK_LIKE):
                x, layer_state, maps = block.decode_step_maps(
                    x, layer_state, maps, bias_fn=bias_fn, context_kv=kv, context_mask=context_mask, token_id=token_id
                )
            elif isinstance(block, ADAPTIVE_STACKS):
                x, layer_state = block.decode_step(
                    x, layer_state, bias_fn=bias_fn, token_id=token_id, readout=self._readout
                )
            else:  # a LunaStack (ISABs serve encoders): no bias; a decoder's reads its projected context
                assert isinstance(block, LunaStack), type(block)
                x, layer_state = block.decode_step(x, layer_state, context_kv=kv, context_mask=context_mask)
            layers.append(layer_state)
            x = condition(i, x)
        kept = {"pegs": pegs} if "pegs" in state else {}
        return x, {"layers": tuple(layers), "length": state["length"] + 1} | kept | advanced


class EncoderDecoder(eqx.Module):
    """Encoder-decoder (seq2seq): `model(source, target)` -> `[target_len, vocab]`; the
    decoder's blocks cross-attend to the encoder output. `model.conditioned(source)` is a
    decoder bound to one source, which `jxformers.generate` can decode.

    `transparent=True`: transparent attention (Bapna et al. 2018, `jxformers.nn.transparent`),
    decoder block j cross-attends its own learned mix of every encoder layer's output
    (`layer_weights`, W `[encoder layers + 1, decoder blocks]`; None without)."""

    encoder: Encoder
    decoder: LanguageModel
    layer_weights: Float[Array, "sources targets"] | None
    upsample_sum: bool = eqx.field(static=True)

    def __init__(self, encoder: Encoder, decoder: LanguageModel, *, transparent: bool = False):
        self.encoder, self.decoder = encoder, decoder
        self.upsample_sum = bool(encoder.filters)
        self.layer_weights = transparent_weights(encoder, decoder) if transparent else None

    @property
    def max_len(self) -> int:
        return self.decoder.max_len

    def encode(self, source, source_mask=None, *, key=None, inference=False):
        """The encoder's (output, mask) that the decoder reads (transparent: one output per decoder block)."""
        return self._encode(source, source_mask, key=key, inference=inference)[0]

    def _encode(self, source, source_mask=None, *, key=None, inference=False):
        if self.layer_weights is not None:  # transparent: every block's own mix of the layers
            (states, mask), made = self.encoder.apply(source, source_mask, key=key, inference=inference, layers=True)
            return (combine_layers(self.layer_weights, states), mask), made
        return self.encoder.apply(source, source_mask, key=key, inference=inference, upsample_sum=self.upsample_sum)

    def __call__(self, source: Int[Array, " src"], target: Int[Array, " tgt"], *args, **kwargs):
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(source, target, *args, **kwargs)[0]

    def apply(
        self,
        source: Int[Array, " src"],
        target: Int[Array, " tgt"],
        source_mask: Bool[Array, " src"] | None = None,
        target_mask: Bool[Array, " tgt"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "tgt vocab"], Produced]:
        """(`[tgt, vocab]` logits of the target given the source, what both made.)"""
        k1, k2 = _split(key, 2)
        (memory, memory_mask), made_enc = self._encode(source, source_mask, key=k1, inference=inference)
        logits, made_dec = self.decoder.apply(
            target, target_mask, context=memory, context_mask=memory_mask, key=k2, inference=inference
        )
        return logits, made_enc.under("encoder") + made_dec.under("decoder")

    def conditioned(
        self, source: Int[Array, " src"], source_mask: Bool[Array, " src"] | None = None
    ) -> ConditionedDecoder:
        memory, memory_mask = self.encode(source, source_mask, inference=True)
        return ConditionedDecoder(self.decoder, memory, memory_mask)


class ConditionedDecoder(eqx.Module):
    """The decoder of an encoder-decoder model bound to one encoded source: a language
    model over the target (parallel `__call__`, `init_decode_state`, `decode_step`). Its
    decoding state holds what each block reads of the memory, projected once
    (`project_context`: a transformer block's cross-attention keys and values, or both
    attend-to-encoder branches' of an Evolved Transformer cell)."""

    decoder: LanguageModel
    memory: Float[Array, "*blocks ctx d_model"]  # [blocks, ctx, d_model]: one per block (transparent attention)
    memory_mask: Bool[Array, " ctx"]

    @property
    def max_len(self) -> int:
        return self.decoder.max_len

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def __call__(
        self, target: Int[Array, " tgt"], mask: Bool[Array, " tgt"] | None = None
    ) -> Float[Array, "tgt vocab"]:
        return self.decoder(target, mask, context=self.memory, context_mask=self.memory_mask, inference=True)

    def init_decode_state(self, max_len: int) -> dict[str, Any]:
        state = self.decoder.init_decode_state(max_len)
        context_kv = []
        for i, block in enumerate(self.decoder.plan.filled(self.decoder.blocks)):
            # a seq2seq decoder's: transformer blocks, Evolved Transformer cells with attend-to-encoder branches,
            # or one Luna decoder stack (every layer's P and packed encoder output)
            memory = self.memory if self.memory.ndim == 2 else self.memory[i]  # one per block: transparent
            if isinstance(block, LunaStack):
                context_kv.append(block.project_context(memory, self.memory_mask))
                continue
            assert isinstance(block, (Block, EvolvedDecoderCell)) and block.cross_attention is not None
            context_kv.append(block.project_context(memory))  # what its decoding step reads
        state["context_kv"] = tuple(context_kv)
        return state

    def decode_step(
        self, token: Int[Array, ""], state: dict[str, Any]
    ) -> tuple[Float[Array, " vocab"], dict[str, Any]]:
        inner = {k: v for k, v in state.items() if k != "context_kv"}
        logits, inner = self.decoder.decode_step(
            token, inner, context_kv=state["context_kv"], context_mask=self.memory_mask
        )
        return logits, inner | {"context_kv": state["context_kv"]}
