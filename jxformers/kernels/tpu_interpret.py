"""Running the Mosaic TPU kernels in TPU interpret mode under `jax.vmap`.

Under vmap, Pallas adds a grid axis for the batch. Mosaic's lowering accounts for it,
but JAX 0.10's TPU interpreter zips the grid with the kernel's `dimension_semantics`
and fails on the extra axis. So in interpret mode a batched call runs without
semantics (every axis in order) and an unbatched one keeps them (the interpreter then
visits the parallel axes in a random order, which would expose a hidden dependency).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def with_semantics(build, semantics, *, interpret: bool):
    """`build(semantics)` (a `pallas_call` with those `dimension_semantics`) as a callable
    that also runs under vmap in interpret mode."""
    call = build(semantics)
    if not interpret:
        return call
    interpreted = jax.custom_batching.custom_vmap(call)

    @interpreted.def_vmap
    def _batched(axis_size, in_batched, *args):
        args = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched, strict=True)
        ]
        out = jax.vmap(build(None))(*args)
        return out, jax.tree.map(lambda _: True, out)

    return interpreted
