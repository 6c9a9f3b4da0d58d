"""ALiBi as a logit bias that is never an N x N array: head slopes and where the queries sit.

    bias = Alibi(slopes, q_offset)    # stands for -slopes[h] * |i + q_offset - j|

for query i and key j (Press et al. 2022 in its symmetric form; for causal attention it
is the paper's -m (i - j)). `q_offset` is `kv_len - q_len` for the usual bottom-right
alignment (the queries are the last positions), 0 for self-attention. Ops that take a
`bias` accept an `Alibi` in its place: the flash kernels compute it on each tile (O(N)
memory), the XLA ops materialise it with `dense`.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float


def tile_distances(q_offset: int, q_start, k_start, shape: tuple[int, int], q_axis: int = 0):
    """|i + q_offset - j| as float32 on a tile of `shape` whose queries (from `q_start`)
    run along `q_axis` and keys (from `k_start`) along the other: the one formula the
    kernels (per tile) and `Alibi.dense` (whole) share."""
    i = q_start + q_offset + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    j = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return jnp.abs(i - j).astype(jnp.float32)


class Alibi(eqx.Module):
    """ALiBi's bias on the integer position grid.

    Fields:
        slopes: `[heads]` per query head (differentiable, through the kernels too).
        q_offset: query i sits at position i + q_offset; key j at j.
    """

    slopes: Float[Array, " heads"]
    q_offset: int = eqx.field(static=True, default=0)

    @property
    def heads(self) -> int:
        return self.slopes.shape[0]

    def dense(self, q_len: int, kv_len: int) -> Float[Array, "heads q_len kv_len"]:
        """The bias as an array, float32."""
        distances = tile_distances(self.q_offset, 0, 0, (q_len, kv_len))
        return -self.slopes.astype(jnp.float32)[:, None, None] * distances[None]


def check_alibi(bias: Alibi, heads: int) -> None:
    """ValueError unless `bias` has one slope per query head."""
    if jnp.ndim(bias.slopes) != 1 or bias.heads != heads:
        raise ValueError(f"Alibi.slopes must be [heads={heads}]; got shape {tuple(jnp.shape(bias.slopes))}")
