"""`Produced`: what a forward pass makes beside its output, returned as a value.

Every module that makes something besides its output has an `apply` method returning
`(output, Produced)`; its `__call__` is `apply(...)[0]`. The containers add their
children's `Produced` together (in call order) and the train step reads the total
(`jxformers.train.step`): nothing travels through a mutable argument or a global.

    logits, produced = model.apply(tokens, mask, key=key)
    produced.moe                # per MoE layer call: its aux dict (`jxformers.nn.moe`)
    produced.attention_inputs   # per call of an attention whose core updates arrays
    produced.losses             # named auxiliary losses (the Compressive Transformer's)
    produced.layer_losses       # a layer's auxiliary losses, named by loss and the layer's path
    produced.memory             # a recurrent model's memory after the segment
    produced.residual_moments   # per residual branch of an Admin block: its moments (`ResidualMoments`)
    produced.tallies            # named (sum, count) statistics the step logs as sum / count (depth used)
    produced.exits              # an early-exit model's logits at every exit and their loss weights (`Exits`)

The attention inputs carry the path of the module that made them (attribute names and
tuple indices from the model's root), so the step updates that very module's arrays
(`jxformers.nn.update_arrays`), once from all its calls when a module is called more
than once (a dual-tower model). A layer's own auxiliary losses (adaptive span's, the
heads' disagreement) are named the same way: a module makes `{"span_loss": x}` and each
caller's `under` adds where it sits, so a model's forward returns
`{"span_loss/blocks.0.attention": x0, "span_loss/blocks.1.attention": x1, ...}` and the
train step adds them all to the objective and logs each (`loss_name`, `layer_path`).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float

Path = tuple[str | int, ...]


class AttentionInputs(eqx.Module):
    """One call's inputs of an attention module whose core's drawn arrays are state
    moved in training (`spec.updates_arrays`: Routing's and Cluster-Former's k-means
    centroids): its core's q and k (out of the gradient) and kv_mask (None when unpadded).
    `path` locates the module from the model's root."""

    q: Float[Array, "q_len heads d_k"]
    k: Float[Array, "kv_len kv_heads d_k"]
    kv_mask: Bool[Array, " kv_len"] | None
    path: Path = eqx.field(static=True, default=())

    def __init__(self, q, k, kv_mask, path: Path = ()):
        self.q, self.k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
        self.kv_mask, self.path = kv_mask, path


class ResidualMoments(eqx.Module):
    """The moments of one residual branch's two terms in a block with Admin's placement
    (x_i = LN(x_{i-1} w_i + f_i(x_{i-1})); `jxformers.nn.residual.admin_profile` reads
    them): rows (the skip term x w, the branch output f(x)), columns (count, sum, sum of
    squares) over the elements of the real rows, so that calls and examples add up.
    `path` locates the block from the model's root, then the branch's index in it."""

    moments: Float[Array, "2 3"]
    path: Path = eqx.field(static=True, default=())


class Exits(eqx.Module):
    """An early-exit model's outputs (`jxformers.nn.adaptive.ExitStack`): `logits`
    `[exits, *out]` whose cross-entropies the train step weights by `weights` `[exits]`
    (summing to 1) in place of the output's own, and `output` `[*out]`, the model's
    prediction (the last exit's in training, the exit taken at inference)."""

    logits: Float[Array, " exits *out"]
    weights: Float[Array, " exits"]
    output: Float[Array, " *out"]


class Produced(eqx.Module):
    """What a forward pass makes besides its output (see the module docstring).

    Fields:
        moe: per MoE layer call, in call order, its aux dict (losses, load, drops).
        attention_inputs: per call of an attention that updates arrays (`AttentionInputs`).
        losses: named auxiliary losses the objective adds (already weighted).
        layer_losses: a layer's auxiliary losses the objective adds (already weighted),
            keyed "<loss>/<path of the layer>" ("span_loss/blocks.0.attention"); a module
            makes them under the loss name alone and its callers' `under` add the path.
        memory: the memory a recurrent model carries to its next segment (None without).
        residual_moments: per residual branch call of a block with Admin's placement, in
            call order, its `ResidualMoments` (read by Admin's profile, nothing else).
        tallies: named statistics `[2]` (sum, count), summed by `+` and over a batch; the
            train step logs sum / count and evaluation averages them over its batches
            ("act_steps": the Universal Transformer's steps per token).
        exits: an early-exit model's `Exits` (None without); the later one is kept.
    """

    moe: tuple[dict[str, Array], ...] = ()
    attention_inputs: tuple[AttentionInputs, ...] = ()
    losses: dict[str, Array] = eqx.field(default_factory=dict)
    layer_losses: dict[str, Array] = eqx.field(default_factory=dict)
    memory: Any = None
    residual_moments: tuple[ResidualMoments, ...] = ()
    tallies: dict[str, Array] = eqx.field(default_factory=dict)
    exits: Exits | None = None

    def __add__(self, other: Produced) -> Produced:
        """Both, in call order (self's first); a loss made by both is summed, and the
        later memory is kept."""
        return Produced(
            moe=self.moe + other.moe,
            attention_inputs=self.attention_inputs + other.attention_inputs,
            losses=_summed(self.losses, other.losses),
            layer_losses=_summed(self.layer_losses, other.layer_losses),
            memory=self.memory if other.memory is None else other.memory,
            residual_moments=self.residual_moments + other.residual_moments,
            tallies=_summed(self.tallies, other.tallies),
            exits=self.exits if other.exits is None else other.exits,
        )

    def under(self, *path: str | int) -> Produced:
        """The same, made by a child that sits at `path` in its caller."""
        if not self.attention_inputs and not self.layer_losses and not self.residual_moments:
            return self
        moved = tuple(AttentionInputs(a.q, a.k, a.kv_mask, (*path, *a.path)) for a in self.attention_inputs)
        layer_losses = {_moved(name, path): v for name, v in self.layer_losses.items()}
        moments = tuple(ResidualMoments(r.moments, (*path, *r.path)) for r in self.residual_moments)
        return Produced(
            moe=self.moe,
            attention_inputs=moved,
            losses=self.losses,
            layer_losses=layer_losses,
            memory=self.memory,
            residual_moments=moments,
            tallies=self.tallies,
            exits=self.exits,
        )


def loss_name(key: str) -> str:
    """The loss of a `layer_losses` key ("span_loss/blocks.0.attention" -> "span_loss")."""
    return key.split("/", 1)[0]


def layer_path(key: str) -> str:
    """The layer's path of a `layer_losses` key ("blocks.0.attention"; "" at the module)."""
    return key.split("/", 1)[1] if "/" in key else ""


def _moved(key: str, path: Path) -> str:
    inner = layer_path(key)
    return f"{loss_name(key)}/{'.'.join(map(str, (*path, *([inner] if inner else []))))}"


def _summed(a: dict[str, Array], b: dict[str, Array]) -> dict[str, Array]:
    """Both dicts' entries, a name in both summed."""
    out = dict(a)
    for name, value in b.items():
        out[name] = out[name] + value if name in out else value
    return out


def total(parts) -> Produced:
    """The sum of an iterable of `Produced`, in order."""
    out = Produced()
    for part in parts:
        out = out + part
    return out


def follow(tree, path: Path):
    """The node at `path` in a module tree (attributes by name, tuple items by index)."""
    for step in path:
        tree = tree[step] if isinstance(step, int) else getattr(tree, step)
    return tree
