"""Layouts of the transformer stack beyond one attention and one FFN per block, sharing
across its layers, and structured layer dropout (Lin et al. 2021, "A Survey of
Transformers", arXiv 2106.04554, section 6.5 and around it):

- the sublayer order of the Sandwich Transformer (Press, Smith & Levy 2020, "Improving
  Transformer Models by Reordering their Sublayers"): a string of s (self-attention) and
  f (feed-forward) sublayers, `sandwich_order` for s^k (sf)^(n-k) f^k, grouped into blocks
  by `group_order` (each block one s and the f's around it);
- Macaron Net's block (Lu et al. 2019, "Understanding and Improving Transformer From a
  Multi-Particle Dynamic System Point of View"): a half-step FFN, the attention, a
  half-step FFN, each FFN's output times 1/2 (`FeedForwardSublayer`'s `scale`);
- ALBERT's cross-layer parameter sharing (Lan et al. 2020, "ALBERT: A Lite BERT for
  Self-supervised Learning of Language Representations", section 3.1): the shared
  sublayers are held once, by block 0, and the other blocks hold None there
  (`StackPlan.hollow`); a model fills them in before running (`StackPlan.filled`), so a
  shared array is one leaf of the model, one array in a checkpoint, and its gradient is
  the sum over the layers that use it (ALBERT's factorised embedding is
  `jxformers.nn.models.Embedding`'s `project`); the same holding-once ties an attention
  core's arrays that its registration shares across layers (`BoundAttention.layer_shared`:
  Linformer's layerwise E, Wang et al. 2020, section 4): the first attention module
  holding one keeps it, the later ones with the same core hold None there;
- LayerDrop (Fan, Grave & Joulin 2020, "Reducing Transformer Depth on Demand with
  Structured Dropout"): in training each block is skipped whole with probability p, one
  draw per block for the batch (the authors' fairseq code) or per example
  (`StackPlan.gates`); at inference the blocks of `keep_layers` alone run, the paper's
  "every other" pruning given by `every_other`.

The models (`Encoder`, `LanguageModel`) hold a `StackPlan` (static) and call it around
their blocks; the blocks hold the extra FFN sublayers (`Block`'s `pre_ffns`,
`post_ffns`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers.nn.attention import attention_modules
from jxformers.nn.layers import FeedForward, Norm, make_norm, normalise

# Who shares what across the layers (ALBERT's Table 4): nothing, the whole block, the
# attention sublayer (its module and norms), the feed-forward sublayers (theirs).
SHARINGS = ("none", "all", "attention", "ffn")
# How LayerDrop draws: one decision per block for the whole batch, or one per example.
DROP_UNITS = ("batch", "example")
# The name of the batch axis the train step maps the model over (`jax.vmap(axis_name=...)`):
# LayerDrop's "batch" unit takes the first example's draws for every example through it.
BATCH_AXIS = "batch"
# Mixed into a model's key for LayerDrop's draws (independent of the blocks' dropout keys).
_DROP_SALT = 0x1A7E


# ----------------------------------------------------------------------------- sublayer orders


def sandwich_order(num_layers: int, k: int) -> str:
    """s^k (sf)^(n-k) f^k, the sandwich transformer with coefficient k of n = `num_layers`
    attention and n FFN sublayers (Press et al. 2020, section 4); k = 0 is the plain
    interleaving (sf)^n."""
    if not 0 <= k < num_layers:
        raise ValueError(f"the sandwich coefficient k must be in [0, num_layers) = [0, {num_layers}); got {k}")
    return "s" * k + "sf" * (num_layers - k) + "f" * k


def group_order(order: str) -> list[tuple[int, int]]:
    """The blocks of a sublayer order: per s, (f's before it, f's after it up to the next
    s). The leading f's go before the first block's attention, every other f after the
    attention it follows; so a block is f^a s f^b with a > 0 only in block 0.

        group_order("sfsfff") == [(0, 1), (0, 3)];  group_order("fsfs") == [(1, 1), (0, 0)]
    """
    if not order or set(order) - {"s", "f"} or "s" not in order:
        raise ValueError(
            f"a sublayer order is a string of s (attention) and f (FFN) with at least one s; got {order!r}"
        )
    lead = len(order) - len(order.lstrip("f"))
    runs = order[lead:].split("s")[1:]  # the f's after each s
    return [(lead if i == 0 else 0, len(run)) for i, run in enumerate(runs)]


class FeedForwardSublayer(eqx.Module):
    """One residual FFN sublayer on its own: x + c dropout(FFN(N(x))) with pre-norm,
    N(x + c dropout(FFN(x))) with post-norm; c = `scale` (1/2: Macaron's half step, Lu et
    al. 2019 eq. 14; 1: a sublayer of a reordered stack, Press et al. 2020).

    Arguments (constructor): `ffn` (a dense `FeedForward`; its own dropout acts on the
    hidden units), `d_model`, `norm` (kind), `pre_norm`, `dropout` (on the branch's
    output), `norm_eps`, `scale`."""

    ffn: FeedForward
    norm: Norm
    dropout: eqx.nn.Dropout
    scale: float = eqx.field(static=True)
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        ffn: FeedForward,
        *,
        d_model: int,
        norm: str = "layernorm",
        pre_norm: bool = True,
        dropout: float = 0.0,
        norm_eps: float | None = None,
        scale: float = 1.0,
    ):
        self.ffn, self.norm, self.dropout = ffn, make_norm(norm, d_model, norm_eps), eqx.nn.Dropout(dropout)
        self.scale, self.pre_norm = float(scale), bool(pre_norm)

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "seq d_model"]:
        """x `[seq, d_model]` -> the sublayer's output `[seq, d_model]`; `mask` (True for
        real rows) reaches norms that keep batch statistics."""
        k_hidden, k_out = (None, None) if key is None else jax.random.split(key)
        h = normalise(self.norm, x, mask) if self.pre_norm else x
        y = self.dropout(self.ffn(h, key=k_hidden, inference=inference), key=k_out, inference=inference)
        y = x + (y if self.scale == 1.0 else self.scale * y)
        return y if self.pre_norm else normalise(self.norm, y, mask)


def run_sublayers(
    sublayers: Sequence[FeedForwardSublayer], x, mask=None, *, key=None, inference=False, salt: int = 0
) -> Array:
    """x through `sublayers` in turn (`[seq, d_model]`, or one row `[d_model]` when
    decoding); each takes its dropout key from `key` folded with `salt` + its index."""
    for j, sub in enumerate(sublayers):
        k = None if key is None else jax.random.fold_in(key, salt + j)
        one = x.ndim == 1  # a decoding step's row
        x = sub(x[None] if one else x, None if one else mask, key=k, inference=inference)
        x = x[0] if one else x
    return x


# ----------------------------------------------------------------------------- LayerDrop's pruning


def every_other(num_layers: int, rate: float) -> tuple[int, ...]:
    """The blocks kept by Fan et al. 2020's "every other" pruning at rate p (section 5):
    the blocks at depth d (1 to L) with d ≡ 0 (mod floor(1/p)) go; p = 1/2 keeps 0, 2,
    4, ... (0-based), as the authors' `--encoder-layers-to-keep 0,2,4,...`."""
    if not 0 < rate < 1:
        raise ValueError(f"the pruning rate p must be in (0, 1); got {rate}")
    step = math.floor(1 / rate)
    return tuple(i for i in range(num_layers) if (i + 1) % step)


# ----------------------------------------------------------------------------- the plan


def _shared(sharing: str, owner) -> Callable[[Any], list]:
    """`eqx.tree_at`'s where-function of the nodes a sharing shares, decided on the
    owner's structure (block 0; the others are built alike): "attention", the attention
    module and its norms; "ffn", the FFN with its norms and the extra FFN sublayers."""
    if sharing == "attention":
        norm, out = bool(owner.norms), owner.out_norms[0] is not None
        return lambda b: [b.attention] + [b.norms[0]] * norm + [b.out_norms[0]] * out
    i, ffn = len(owner.out_norms) - 1, owner.ffn is not None  # the FFN's branch is the last
    norm, out = ffn and bool(owner.norms), ffn and owner.out_norms[i] is not None
    pre, post = bool(owner.pre_ffns), bool(owner.post_ffns)
    return lambda b: (
        [b.ffn] * ffn + [b.norms[i]] * norm + [b.out_norms[i]] * out + [b.pre_ffns] * pre + [b.post_ffns] * post
    )


def _is_none(x) -> bool:
    return x is None


def _tied_arrays(blocks: Sequence[Any]) -> list[tuple[tuple[int, int, str], tuple[int, int, str]]]:
    """(holder, user) pairs of the core arrays held once across the layers: each as (block
    index, the attention module's index within the block, array name). The holder is the
    first module (in block order) whose core shares that array across layers; a later
    module with the same bound attention uses it. Decided on the structure alone."""
    first, pairs = {}, []
    for b, block in enumerate(blocks):
        for a, module in enumerate(attention_modules(block) if block is not None else ()):
            for name in module.core.layer_shared:
                place = (b, a, name)
                holder = first.setdefault((module.core, name), place)
                if holder != place:
                    pairs.append((holder, place))
    return pairs


def _with_arrays(block, changes: dict[tuple[int, str], Any]):
    """`block` with the core arrays at (module index, name) replaced by `changes`' values."""
    if not changes:
        return block
    keys = sorted(changes)
    where = lambda b: [attention_modules(b)[a].arrays[n] for a, n in keys]  # noqa: E731
    return eqx.tree_at(where, block, [changes[k] for k in keys], is_leaf=_is_none)


@dataclasses.dataclass(frozen=True)
class StackPlan:
    """How a model runs its blocks beyond one after another (static, hashable): ALBERT's
    `sharing` (one of `SHARINGS`), LayerDrop's rate `layerdrop` and its `drop_unit` (one
    of `DROP_UNITS`), and the blocks that run at inference (`keep_layers`; None: all).
    The default plan runs every block as it is."""

    sharing: str = "none"
    layerdrop: float = 0.0
    drop_unit: str = "batch"
    keep_layers: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.sharing not in SHARINGS or self.drop_unit not in DROP_UNITS:
            raise ValueError(f"sharing in {SHARINGS} and drop_unit in {DROP_UNITS}; got {self.sharing!r}, "
                             f"{self.drop_unit!r}")  # fmt: skip
        if not 0 <= self.layerdrop < 1:
            raise ValueError(f"layerdrop p must be in [0, 1); got {self.layerdrop}")

    # -- sharing

    def hollow(self, blocks: Sequence[Any]) -> tuple:
        """`blocks` as a model holds them: the shared sublayers in block 0 only (None in
        the others; with "all", the other blocks are None). Refused where the blocks'
        shared parts differ in their static structure."""
        return self._hollow_arrays(self._hollow_sublayers(tuple(blocks)))

    def _hollow_sublayers(self, blocks: tuple) -> tuple:
        if self.sharing == "none" or len(blocks) < 2:
            return blocks
        if self.sharing == "all":
            return (blocks[0],) + (None,) * (len(blocks) - 1)
        where = _shared(self.sharing, blocks[0])
        shapes = {jax.tree.structure(where(b)) for b in blocks}
        if len(shapes) > 1:
            raise ValueError(f"sharing {self.sharing!r} needs blocks whose shared sublayers are built alike")
        return (blocks[0],) + tuple(eqx.tree_at(where, b, [None] * len(where(b))) for b in blocks[1:])

    @staticmethod
    def _hollow_arrays(blocks: tuple) -> tuple:
        """The layer-shared core arrays (`_tied_arrays`) left in their holder only."""
        users: dict[int, dict] = {}
        for _, (b, a, name) in _tied_arrays(blocks):
            users.setdefault(b, {})[(a, name)] = None
        return tuple(_with_arrays(block, users.get(b, {})) for b, block in enumerate(blocks))

    @staticmethod
    def _filled_arrays(blocks: tuple) -> tuple:
        """The layer-shared core arrays put back from their holder (the same array)."""
        filled: dict[int, dict] = {}
        for (hb, ha, name), (b, a, _) in _tied_arrays(blocks):
            filled.setdefault(b, {})[(a, name)] = attention_modules(blocks[hb])[ha].arrays[name]
        return tuple(_with_arrays(block, filled.get(b, {})) for b, block in enumerate(blocks))

    def filled(self, blocks: Sequence[Any]) -> tuple:
        """The blocks to run: `hollow`'s blocks with block 0's shared sublayers put back
        in (the same arrays, so their gradients add up in block 0's), and the layer-shared
        core arrays put back from their holder."""
        blocks = self._filled_arrays(tuple(blocks))
        if self.sharing == "none" or len(blocks) < 2:
            return blocks
        if self.sharing == "all":
            return (blocks[0],) * len(blocks)
        owner = blocks[0]
        where = _shared(self.sharing, owner)
        return (owner,) + tuple(eqx.tree_at(where, b, where(owner), is_leaf=_is_none) for b in blocks[1:])

    # -- LayerDrop

    def runs(self, index: int, inference: bool) -> bool:
        """Whether block `index` runs at all: at inference, only those of keep_layers."""
        return not inference or self.keep_layers is None or index in self.keep_layers

    def gates(self, layers: int, key: PRNGKeyArray | None, inference: bool) -> Bool[Array, " layers"] | None:
        """LayerDrop's decisions for a forward in training (True: the block runs), block i
        kept when u_i >= p for u_i ~ U(0, 1); None when nothing is dropped (inference, no
        key, p = 0). Unit "batch": under the train step's map over the batch (axis
        `BATCH_AXIS`) every example takes the first example's draws, so a skipped block
        is skipped for the whole batch (and not computed); outside it (one example called
        directly) the example's own draws. Unit "example": each example's own draws."""
        if inference or key is None or self.layerdrop == 0:
            return None
        u = jax.random.uniform(jax.random.fold_in(key, _DROP_SALT), (layers,))
        if self.drop_unit == "batch":
            with contextlib.suppress(NameError):  # not mapped over a batch: this example is the batch
                u = jax.lax.all_gather(u, BATCH_AXIS)[0]
        return u >= self.layerdrop

    def run(self, gates, index: int, fn: Callable, *args):
        """fn(*args) where block `index` runs, else its inputs passed through: `fn`
        returns (x, Produced, maps) from (x, maps) (what a skipped block produced reads
        as zeros). With gates None, fn(*args)."""
        if gates is None:
            return fn(*args)
        x, maps = args
        shape = jax.eval_shape(fn, *args)

        def skip(x, maps):
            return x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shape[1]), maps

        return jax.lax.cond(gates[index], fn, skip, x, maps)
