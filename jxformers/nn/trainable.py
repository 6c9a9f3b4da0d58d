"""Which leaves of a model an optimizer should update, and resampling or updating the
ones it should not (the drawn arrays of attention modules; norms' running statistics
are updated by `jxformers.nn.power_norm.update_statistics`)."""

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from jxformers.nn.attention import Attention, attention_modules
from jxformers.nn.power_norm import STATISTICS
from jxformers.nn.produced import AttentionInputs, follow


def trainable(model) -> object:
    """A pytree of bools like `model`: True for floating-point arrays that are learned,
    False for everything else, including the drawn arrays of attention modules
    (Performer's projection, BigBird's key), which `redraw` resamples instead, and the
    running statistics of norms (PowerNorm's), which the train step updates
    (`jxformers.nn.power_norm`). Use it as the filter of `eqx.partition` or the mask of
    `optax.masked`."""

    def leaf(path, x):
        held = any(isinstance(p, jax.tree_util.GetAttrKey) and p.name in ("drawn", STATISTICS) for p in path)
        return eqx.is_inexact_array(x) and not held

    return jax.tree_util.tree_map_with_path(leaf, model)


_attentions = attention_modules


def _redrawn(model) -> list[Attention]:
    return [a for a in _attentions(model) if a.drawn and a.core.spec.redrawn]


def redraw(model, key: PRNGKeyArray):
    """`model` with the drawn arrays of every attention module whose paper redraws them
    (`spec.redrawn`: Performer's and RFA's features) resampled, each from its own key; a
    pure function, as Performer's periodic feature redrawing needs. Arrays drawn once
    for the run (BigBird's random pattern) stay; `Attention.redraw` resamples any one."""
    attentions = _redrawn(model)
    if not attentions:
        return model
    keys = jax.random.split(key, len(attentions))
    return eqx.tree_at(_redrawn, model, [a.redraw(k) for a, k in zip(attentions, keys, strict=True)])


def updates_arrays(model) -> bool:
    """True when some attention module of `model` updates drawn arrays in training
    (Routing's and Cluster-Former's k-means centroids)."""
    return any(a.core.spec.updates_arrays for a in _attentions(model))


def update_arrays(model, inputs: Sequence[AttentionInputs]):
    """`model` with the drawn arrays of its updating attention modules replaced by their
    update (`BoundAttention.update_arrays`) from the batch's inputs.

    Arguments:
        inputs: `Produced.attention_inputs` of a batch (vmapped: q `[batch, q_len, heads,
            d]`, k `[batch, kv_len, kv_heads, d]`, kv_mask `[batch, kv_len]` or None),
            each naming its module by path; a module called several times (a dual-tower
            model, a Perceiver's repeated tower) is updated once from all its calls'
            inputs together.
    """
    grouped: dict[tuple, list[AttentionInputs]] = {}
    for record in inputs:
        grouped.setdefault(record.path, []).append(record)
    if not grouped:
        return model
    new = []
    for path, records in grouped.items():
        a = follow(model, path)
        if not isinstance(a, Attention):
            raise ValueError(f"attention inputs name {path}, which holds a {type(a).__name__}, not an Attention")
        if len({r.q.shape[1:] for r in records}) > 1:
            raise ValueError(f"the attention module at {path} was called on different lengths; update it per length")
        q = jnp.concatenate([r.q for r in records])
        k = jnp.concatenate([r.k for r in records])
        masks = [jnp.ones(r.k.shape[:2], bool) if r.kv_mask is None else r.kv_mask for r in records]
        made = a.core.update_arrays(a.drawn, q, k, kv_mask=jnp.concatenate(masks))
        new.append(eqx.tree_at(lambda m: m.drawn, a, a.drawn | made))
    paths = list(grouped)
    return eqx.tree_at(lambda m: [follow(m, p) for p in paths], model, new)
