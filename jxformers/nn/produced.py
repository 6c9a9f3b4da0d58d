"""`Produced`: what a forward pass makes beside its output, returned as a value.

Every module that makes something besides its output has an `apply` method returning
`(output, Produced)`; its `__call__` is `apply(...)[0]`. The containers add their
children's `Produced` together (in call order) and the train step reads the total
(`jxformers.train.step`): nothing travels through a mutable argument or a global.

    logits, produced = model.apply(tokens, mask, key=key)
    produced.moe                # per MoE layer call: its aux dict (`jxformers.nn.moe`)
    produced.attention_inputs   # per call of an attention whose core updates arrays
    produced.losses             # named auxiliary losses (the Compressive Transformer's)
    produced.memory             # a recurrent model's memory after the segment

The attention inputs carry the path of the module that made them (attribute names and
tuple indices from the model's root), so the step updates that very module's arrays
(`jxformers.nn.update_arrays`), once from all its calls when a module is called more
than once (a dual-tower model).
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


class Produced(eqx.Module):
    """What a forward pass makes besides its output (see the module docstring).

    Fields:
        moe: per MoE layer call, in call order, its aux dict (losses, load, drops).
        attention_inputs: per call of an attention that updates arrays (`AttentionInputs`).
        losses: named auxiliary losses the objective adds (already weighted).
        memory: the memory a recurrent model carries to its next segment (None without).
    """

    moe: tuple[dict[str, Array], ...] = ()
    attention_inputs: tuple[AttentionInputs, ...] = ()
    losses: dict[str, Array] = eqx.field(default_factory=dict)
    memory: Any = None

    def __add__(self, other: Produced) -> Produced:
        """Both, in call order (self's first); a loss made by both is summed, and the
        later memory is kept."""
        losses = dict(self.losses)
        for name, value in other.losses.items():
            losses[name] = losses[name] + value if name in losses else value
        return Produced(
            moe=self.moe + other.moe,
            attention_inputs=self.attention_inputs + other.attention_inputs,
            losses=losses,
            memory=self.memory if other.memory is None else other.memory,
        )

    def under(self, *path: str | int) -> Produced:
        """The same, made by a child that sits at `path` in its caller."""
        if not self.attention_inputs:
            return self
        moved = tuple(AttentionInputs(a.q, a.k, a.kv_mask, (*path, *a.path)) for a in self.attention_inputs)
        return Produced(moe=self.moe, attention_inputs=moved, losses=self.losses, memory=self.memory)


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
