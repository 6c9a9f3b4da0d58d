"""Which leaves of a model an optimizer should update."""

import equinox as eqx
import jax


def trainable(model) -> object:
    """A pytree of bools like `model`: True for floating-point arrays that are learned,
    False for everything else, including the drawn arrays of attention modules
    (Performer's projection, BigBird's key), which `redraw` resamples instead. Use it as
    the filter of `eqx.partition` or the mask of `optax.masked`."""

    def leaf(path, x):
        drawn = any(isinstance(p, jax.tree_util.GetAttrKey) and p.name == "drawn" for p in path)
        return eqx.is_inexact_array(x) and not drawn

    return jax.tree_util.tree_map_with_path(leaf, model)
