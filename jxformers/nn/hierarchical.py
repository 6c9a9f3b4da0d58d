"""Hierarchical document encoders, whose input is a document of sentences (`tokens [S, W]`,
S sentences of W tokens): `HierarchicalEncoder` runs transformer `Block`s (of any
registered attention) over the tokens of each sentence, summarises each sentence in one
vector and runs transformer blocks over the sentence vectors.

* HIBERT (Zhang, Wei & Zhou 2019, "HIBERT: Document Level Pre-training of Hierarchical
  Bidirectional Transformers for Document Summarization", ACL, section 3.1): a sentence
  encoder (its blocks over each sentence's words, word positions added), each sentence
  represented by its EOS token's state (the last real token), the sentence positions
  added, then a document encoder (its blocks over the sentence vectors).
* Hi-Transformer (Wu, Wu, Qi & Huang 2021, "Hi-Transformer: Hierarchical Interactive
  Transformer for Efficient and Effective Long Document Modeling", ACL, section 3): a
  sentence Transformer, a pooling of each sentence, a document Transformer over the
  pooled vectors (sentence positions added), whose output r_i (the sentence in its
  document's context) is put in front of sentence i's token states for the next sentence
  Transformer, [r_i; h_i1 .. h_iW] (the "hierarchical interaction"; the output at r_i's
  row is dropped); after the last sentence Transformer, hierarchical pooling: each
  sentence pooled to one vector here, the sentences pooled by the classifier's head.

`HibertStack` and `HiTransformerStack` are their configs (`stack: {kind: hibert}`,
`stack: {kind: hi_transformer}`; `jxformers.nn.config` builds them).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.blocks import Block
from jxformers.nn.layers import Linear, Norm, normalise, split_key
from jxformers.nn.models import Embedding
from jxformers.nn.positions import ADDED_KINDS, sinusoidal
from jxformers.nn.produced import Produced
from jxformers.validate import check_fields, setting

if TYPE_CHECKING:
    from jxformers.nn.config.model import ModelConfig

HIERARCHICAL_KINDS = ("hibert", "hi_transformer")
# How a sentence's token states become one vector: its last real token (HIBERT's EOS),
# its first, their masked mean, or additive attention pooling (`AttentionPool`).
SENTENCE_POOLINGS = ("last", "first", "mean", "attention")
SENTENCE_POSITIONS = ("sinusoidal", "learned", "none")


class AttentionPool(eqx.Module):
    """Additive attention pooling (Yang et al. 2016, "Hierarchical Attention Networks for
    Document Classification"; the attention pooling of Wu et al.'s models):

        a_j = q^T tanh(W h_j + b),   α = softmax over the real rows (mask True),   y = sum_j α_j h_j

    Shapes: `h [n, d]`, `mask [n]` -> `[d]`; the scores in float32."""

    proj: Linear
    query: Float[Array, " d_model"]

    def __init__(self, d_model: int, *, key: PRNGKeyArray):
        kp, kq = jax.random.split(key)
        self.proj = Linear(d_model, d_model, key=kp)
        self.query = jax.random.normal(kq, (d_model,)) / d_model**0.5

    def __call__(self, h: Float[Array, "n d_model"], mask: Bool[Array, " n"]) -> Float[Array, " d_model"]:
        scores = jnp.tanh(self.proj(h).astype(jnp.float32)) @ self.query
        weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf))
        return (weights[:, None] * h.astype(jnp.float32)).sum(0).astype(h.dtype)


def pool_sentence(
    h: Float[Array, "n d_model"], mask: Bool[Array, " n"], how: str, attention: AttentionPool | None = None
) -> Float[Array, " d_model"]:
    """One sentence's vector from its token states `h [n, d]` (`mask [n]` True for real
    tokens, which come first): `how` is one of SENTENCE_POOLINGS."""
    if how == "last":  # the last real token (HIBERT's EOS); row 0 when none is real
        return h[jnp.max(jnp.where(mask, jnp.arange(h.shape[0]), 0))]
    if how == "first":
        return h[0]
    if how == "mean":
        w = mask.astype(jnp.float32)[:, None]
        return (jnp.sum(h.astype(jnp.float32) * w, 0) / jnp.maximum(w.sum(), 1.0)).astype(h.dtype)
    if how == "attention" and attention is not None:
        return attention(h, mask)
    raise ValueError(f"sentence pooling must be one of {SENTENCE_POOLINGS} (attention with its module); got {how!r}")


def _per_sentence(made: Produced) -> Produced:
    """What a block run under `jax.vmap` over the sentences produced, its named losses
    averaged over them (ModelConfig admits no MoE or k-means attention here)."""
    return dataclasses.replace(
        made,
        losses={n: v.mean(0) for n, v in made.losses.items()},
        layer_losses={n: v.mean(0) for n, v in made.layer_losses.items()},
    )


class HierarchicalEncoder(eqx.Module):
    """A hierarchical document encoder, HIBERT's or Hi-Transformer's (`kind`, see the
    module docstring), whose output is one vector per sentence.

    Arguments (constructor): `embedding` (the tokens' embedding, word positions 0..W-1
    within each sentence), `sentence_blocks` and `document_blocks` (transformer `Block`s;
    Hi-Transformer: one document block fewer than sentence blocks, each between two
    sentence blocks), `norm` (the final norm, None: none), `sentence_norm` (HIBERT: the
    sentence encoder's final norm before the pooling), `pools` (the `AttentionPool`s of
    pooling "attention": one per pooling step, else empty), `pooling` (one of
    SENTENCE_POOLINGS), `sentence_position` (one of SENTENCE_POSITIONS), `max_sentences`,
    `max_len` (tokens of a sentence a block reads, Hi-Transformer's context row included).

    Shapes: `apply(tokens [S, W], mask [S, W])` -> `((sentences [S, d_model], real [S]),
    Produced)`; a sentence is real when one of its tokens is. Padding: padded tokens are
    masked keys and out of every pooling; a padded sentence's tokens attend among
    themselves (so no softmax is empty), and its vector is a masked key of the document
    blocks and out of the head's pooling, so neither changes a real sentence.
    Cost: O(S W^2 d) for the sentence blocks (O(S (W + 1)^2 d) with Hi-Transformer's
    context row) plus O(S^2 d) for the document blocks, per layer. Not causal.
    """

    embedding: Embedding
    sentence_blocks: tuple[Block, ...]
    document_blocks: tuple[Block, ...]
    norm: Norm | None
    sentence_norm: Norm | None
    pools: tuple[AttentionPool, ...]
    sentence_table: Float[Array, "sentences d_model"] | None  # learned sentence positions
    kind: str = eqx.field(static=True)
    pooling: str = eqx.field(static=True)
    sentence_position: str = eqx.field(static=True)
    max_sentences: int = eqx.field(static=True)
    max_len: int = eqx.field(static=True)

    def __init__(
        self,
        embedding: Embedding,
        sentence_blocks: list[Block],
        document_blocks: list[Block],
        norm: Norm | None,
        *,
        kind: str,
        pooling: str,
        sentence_position: str,
        max_sentences: int,
        max_len: int,
        sentence_norm: Norm | None = None,
        key: PRNGKeyArray,
    ):
        if kind not in HIERARCHICAL_KINDS or pooling not in SENTENCE_POOLINGS:
            raise ValueError(
                f"kind in {HIERARCHICAL_KINDS} and pooling in {SENTENCE_POOLINGS}; got {kind=}, {pooling=}"
            )
        if sentence_position not in SENTENCE_POSITIONS:
            raise ValueError(f"sentence_position must be one of {SENTENCE_POSITIONS}; got {sentence_position!r}")
        wanted = len(sentence_blocks) - 1 if kind == "hi_transformer" else None
        if not sentence_blocks or not document_blocks or (wanted is not None and len(document_blocks) != wanted):
            raise ValueError(
                f"{kind}: sentence and document blocks are needed (hi_transformer: one document block between each "
                f"two sentence blocks); got {len(sentence_blocks)} and {len(document_blocks)}"
            )
        d = embedding.d_model
        steps = len(sentence_blocks) if kind == "hi_transformer" else 1  # each summarisation has its own pool
        kp, kt = jax.random.split(key)
        attentive = pooling == "attention"
        self.pools = tuple(AttentionPool(d, key=k) for k in jax.random.split(kp, steps)) if attentive else ()
        learned = sentence_position == "learned"
        self.sentence_table = 0.02 * jax.random.normal(kt, (max_sentences, d)) if learned else None
        self.embedding = embedding
        self.sentence_blocks, self.document_blocks = tuple(sentence_blocks), tuple(document_blocks)
        self.norm, self.sentence_norm = norm, sentence_norm
        self.kind, self.pooling, self.sentence_position = kind, pooling, sentence_position
        self.max_sentences, self.max_len = max_sentences, max_len

    @property
    def cls(self) -> None:
        """None: the sentences are pooled by the head (mean or PMA), no CLS token."""
        return None

    def _pool(self, step: int, h: Array, mask: Array) -> Float[Array, "sentences d_model"]:
        """Every sentence's vector after summarisation `step` (its own attention pool)."""
        pool = self.pools[step] if self.pools else None
        return jax.vmap(lambda x, m: pool_sentence(x, m, self.pooling, pool))(h, mask)

    def _with_positions(self, s: Float[Array, "sentences d_model"]) -> Float[Array, "sentences d_model"]:
        """The sentence vectors plus their positions 0..S-1 in the document."""
        if self.sentence_position == "sinusoidal":
            return s + sinusoidal(jnp.arange(s.shape[0]), s.shape[1]).astype(s.dtype)
        if self.sentence_table is not None:
            return s + self.sentence_table[: s.shape[0]].astype(s.dtype)
        return s

    def _sentences(self, block: Block, x, mask, key, inference) -> tuple[Array, Produced]:
        """`block` over each sentence's rows `x [S, n, d]` (mask `[S, n]`)."""
        keys = None if key is None else jax.random.split(key, x.shape[0])
        run = lambda h, m, k: block.apply(h, kv_mask=m, key=k, inference=inference)  # noqa: E731
        y, made = jax.vmap(run)(x, mask, keys)
        return y, _per_sentence(made)

    def __call__(
        self, tokens: Int[Array, "sentences words"], mask: Bool[Array, "sentences words"] | None = None, **kwargs
    ) -> tuple[Float[Array, "sentences d_model"], Bool[Array, " sentences"]]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, "sentences words"],
        mask: Bool[Array, "sentences words"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[tuple[Float[Array, "sentences d_model"], Bool[Array, " sentences"]], Produced]:
        """Arguments: `tokens [S, W]` ids, `mask [S, W]` True for real tokens (a
        sentence's real tokens first); `key` for dropout.

        Returns: `((sentences [S, d_model], real [S]), Produced)`."""
        if jnp.ndim(tokens) != 2 or (mask is not None and jnp.shape(mask) != jnp.shape(tokens)):
            raise ValueError(
                f"a hierarchical encoder reads one document, tokens [sentences, words] and a mask of that shape; got "
                f"tokens {jnp.shape(tokens)}, mask {None if mask is None else jnp.shape(mask)} (batch with jax.vmap)"
            )
        n_sent, n_words = tokens.shape
        context = int(self.kind == "hi_transformer")
        if n_sent > self.max_sentences or n_words + context > self.max_len:
            raise ValueError(
                f"{self.kind}: a document of {n_sent} sentences of {n_words} tokens (+{context} context row) exceeds "
                f"max_sentences {self.max_sentences} or max_len {self.max_len}"
            )
        mask = jnp.ones(tokens.shape, bool) if mask is None else mask
        real = mask.any(-1)
        words = jnp.where(real[:, None], mask, True)  # a padded sentence reads its own rows: no empty softmax
        x = jax.vmap(lambda t: self.embedding(t, jnp.arange(n_words)))(tokens)
        keys = split_key(key, len(self.sentence_blocks) + len(self.document_blocks))
        produced = Produced()
        if self.kind == "hibert":
            for i, block in enumerate(self.sentence_blocks):
                x, made = self._sentences(block, x, words, keys[i], inference)
                produced = produced + made.under("sentence_blocks", i)
            if self.sentence_norm is not None:
                x = normalise(self.sentence_norm, x, words)
            s = self._with_positions(self._pool(0, x, words))
            for j, block in enumerate(self.document_blocks):
                s, made = block.apply(s, kv_mask=real, key=keys[len(self.sentence_blocks) + j], inference=inference)
                produced = produced + made.under("document_blocks", j)
            return (s if self.norm is None else normalise(self.norm, s, real), real), produced
        r = None  # each sentence in its document's context, from the last document block
        with_context = jnp.concatenate([jnp.ones((n_sent, 1), bool), words], 1)
        for i, block in enumerate(self.sentence_blocks):
            if r is None:
                x, made = self._sentences(block, x, words, keys[i], inference)
            else:  # [r_i; h_i1 .. h_iW]: the context row's output is dropped
                rows = jnp.concatenate([r[:, None].astype(x.dtype), x], 1)
                y, made = self._sentences(block, rows, with_context, keys[i], inference)
                x = y[:, 1:]
            produced = produced + made.under("sentence_blocks", i)
            if i < len(self.document_blocks):
                s = self._with_positions(self._pool(i, x, words))
                k = keys[len(self.sentence_blocks) + i]
                r, made = self.document_blocks[i].apply(s, kv_mask=real, key=k, inference=inference)
                produced = produced + made.under("document_blocks", i)
        x = x if self.norm is None else normalise(self.norm, x, words)
        return (self._pool(len(self.sentence_blocks) - 1, x, words), real), produced


def _check_model(stack: Any, config: ModelConfig) -> None:
    """The contracts of a hierarchical stack with the rest of the model (ModelConfig calls it)."""
    kind = stack.kind
    if config.task != "classify":
        raise ValueError(
            f"stack {kind!r} reads a document of sentences (records tokens [sentences, words]) and pools it to one "
            f"vector: task classify; a causal lm or seq2seq would need the sentence and document encoders to be "
            f"causal and decode sentence by sentence, and retrieval's records are flat pairs; got task {config.task!r}"
        )
    position = config.embedding.position
    if position not in (*ADDED_KINDS, "none"):
        raise ValueError(
            f"stack {kind!r} runs its blocks over sentences and over sentence vectors with positions added to the "
            f"embeddings ({', '.join(ADDED_KINDS)}) or none; got {position!r} (computed inside each attention, it "
            "would need the two grids' positions passed to every block)"
        )
    if getattr(config.head, "kind", None) == "cls":
        raise ValueError(
            f"stack {kind!r} has no CLS token: its sentence vectors are pooled by head 'mean' (its default) or 'pma'"
        )
    if config.norm.kind == "powernorm":
        raise ValueError(
            f"stack {kind!r}: norm 'powernorm' keeps running statistics over the rows of each call, which here are "
            "one sentence's at a time under vmap; use layernorm, rmsnorm, scalenorm or adanorm"
        )
    bound = [config.bound_attention(i).spec for i in range(max(stack.layers(config)))]
    updating = sorted({spec.name for spec in bound if spec.updates_arrays})
    if updating:
        raise ValueError(
            f"stack {kind!r}: attentions that move arrays outside the gradient from their inputs (k-means "
            f"centroids) are refused: their inputs would be gathered per sentence; got {updating}"
        )
    if stack.max_sentences > config.max_len:
        raise ValueError(
            f"stack {kind!r}: the document blocks bind the model's attention at max_len ({config.max_len}), so "
            f"stack.max_sentences must be <= max_len; got {stack.max_sentences}"
        )


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class HibertStack:
    """HIBERT (Zhang et al. 2019): `num_layers` sentence-encoder blocks over each
    sentence's tokens, each sentence its last real token's state (the EOS the data puts
    there), sentence positions added, `document_layers` document-encoder blocks over the
    sentence vectors (`HierarchicalEncoder`). Post-norm (the paper's Transformer)."""

    kind: str = setting("hibert", "HIBERT's sentence then document encoder", choices=("hibert",))
    document_layers: int | None = setting(None, "the document encoder's blocks (None: num_layers)", limits=1)
    max_sentences: int = setting(64, "S, the most sentences of a document", limits=1)
    pooling: str = setting(
        "last", "a sentence's vector: last (its last real token, HIBERT's EOS), first, mean or attention",
        choices=SENTENCE_POOLINGS,
    )  # fmt: skip
    sentence_position: str = setting(
        "sinusoidal", "positions of the sentences in the document, added to their vectors", choices=SENTENCE_POSITIONS
    )

    def __post_init__(self):
        check_fields(self, "stack.")

    def check_model(self, config: ModelConfig) -> None:
        _check_model(self, config)

    def layers(self, config: ModelConfig) -> tuple[int, int]:
        """(sentence blocks, document blocks)."""
        return config.num_layers, self.document_layers or config.num_layers


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class HiTransformerStack:
    """Hi-Transformer (Wu et al. 2021): `num_layers` sentence Transformer blocks with a
    document Transformer block between each two (num_layers - 1 of them): each sentence
    pooled, sentence positions added, the document block's output r_i put before sentence
    i's token states for the next sentence block; after the last, each sentence pooled
    (`HierarchicalEncoder`) and the head pools the sentences. Post-norm."""

    kind: str = setting("hi_transformer", "Hi-Transformer's interacting layers", choices=("hi_transformer",))
    max_sentences: int = setting(64, "S, the most sentences of a document", limits=1)
    pooling: str = setting(
        "attention", "each sentence's summary: attention (additive attention pooling), mean, first or last",
        choices=SENTENCE_POOLINGS,
    )  # fmt: skip
    sentence_position: str = setting(
        "learned", "positions of the sentences in the document, added before each document block",
        choices=SENTENCE_POSITIONS,
    )  # fmt: skip

    def __post_init__(self):
        check_fields(self, "stack.")

    def check_model(self, config: ModelConfig) -> None:
        if config.num_layers < 2:
            raise ValueError(
                "stack 'hi_transformer' puts a document block between each two sentence blocks: num_layers >= 2 "
                f"sentence blocks (with 1 there is no interaction: use stack 'hibert'); got {config.num_layers}"
            )
        _check_model(self, config)

    def layers(self, config: ModelConfig) -> tuple[int, int]:
        """(sentence blocks, document blocks)."""
        return config.num_layers, config.num_layers - 1
