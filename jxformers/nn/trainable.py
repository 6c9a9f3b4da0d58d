"""Which leaves of a model an optimizer should update, and resampling the ones it should
not (the drawn arrays of attention modules)."""

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from jxformers.nn.attention import Attention


def trainable(model) -> object:
    """A pytree of bools like `model`: True for floating-point arrays that are learned,
    False for everything else, including the drawn arrays of attention modules
    (Performer's projection, BigBird's key), which `redraw` resamples instead. Use it as
    the filter of `eqx.partition` or the mask of `optax.masked`."""

    def leaf(path, x):
        drawn = any(isinstance(p, jax.tree_util.GetAttrKey) and p.name == "drawn" for p in path)
        return eqx.is_inexact_array(x) and not drawn

    return jax.tree_util.tree_map_with_path(leaf, model)


def _attentions(model) -> list[Attention]:
    is_attention = lambda x: isinstance(x, Attention)  # noqa: E731
    return [x for x in jax.tree.leaves(model, is_leaf=is_attention) if is_attention(x)]


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
    return eqx.tree_at(_redrawn, model, [a.redraw(k) for a, k in zip(attentions, keys)])
