"""Position information (Lin et al. 2021, "A Survey of Transformers", arXiv 2106.04554,
section 5.1), one module per model:

* "sinusoidal" (Vaswani et al.) and "learned" absolute embeddings, added to the tokens;
* "rope" (rotary, Su et al.): q and k rotated by position inside every attention, before
  any feature map, so it composes with linear attention and Performer;
* "alibi" (Press et al.) and "t5" (Raffel et al. relative buckets): an additive bias on
  the attention logits, for attentions that take a bias (softmax);
* "none".
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray, Real

from jxformers.kernels.alibi import Alibi

POSITION_KINDS = ("sinusoidal", "learned", "rope", "alibi", "t5", "none")
BIAS_KINDS = ("alibi", "t5")


def sinusoidal(positions: Int[Array, " n"], dim: int) -> Float[Array, "n dim"]:
    """sin/cos embeddings: PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(...)."""
    half = dim // 2
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(half) / max(half, 1))
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]
    out = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(positions.shape[0], 2 * half)
    return jnp.pad(out, ((0, 0), (0, dim - 2 * half)))


def rotary(
    x: Float[Array, "n heads d"], positions: Real[Array, " n"], base: float = 10000.0
) -> Float[Array, "n heads d"]:
    """Rotate feature pairs (i, i + d/2) of each head by angle p * base^(-2i/d)
    (RoFormer, eq. 34, "rotate half" layout), so q_m . k_n depends on m - n only.
    Positions may be fractional (a shortened encoder's resampled grid)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rope needs an even head size; got d_head = {d}")
    freq = base ** (-jnp.arange(d // 2, dtype=jnp.float32) * 2 / d)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]  # [n, d/2]
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def alibi_slopes(heads: int) -> Float[Array, " heads"]:
    """ALiBi's head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for the
    nearest power of two n <= heads, interleaved with the 2n sequence for the rest."""

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: heads - n]
    return jnp.asarray(slopes, jnp.float32)


def t5_buckets(relative: Int[Array, " ..."], *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
    """T5's bucket of relative position (key - query): exact buckets for small
    distances, logarithmic ones up to `max_distance`; separate buckets for the future
    when bidirectional."""
    n = -relative
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = num_buckets // 2
    large = exact + (
        jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    ).astype(n.dtype)
    return bucket + jnp.where(n < exact, n, jnp.minimum(large, num_buckets - 1))


class Positions(eqx.Module):
    """The model's position scheme: absolute embeddings to add, and/or a logit bias.

    Fields: `kind` (one of POSITION_KINDS), `table` (learned embeddings `[max_len,
    d_model]` or T5's bucket table `[num_buckets, heads]`), `causal`.
    """

    kind: str = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    table: Float[Array, "rows cols"] | None

    def __init__(self, kind: str, *, dim: int, heads: int, max_len: int, causal: bool, key: PRNGKeyArray):
        if kind not in POSITION_KINDS:
            raise ValueError(f"position must be one of {POSITION_KINDS}; got {kind!r}")
        self.kind, self.causal, self.dim, self.heads = kind, causal, dim, heads
        if kind == "learned":
            self.table = 0.02 * jax.random.normal(key, (max_len, dim))
        elif kind == "t5":
            self.table = 0.02 * jax.random.normal(key, (32, heads))
        else:
            self.table = None

    @property
    def rope(self) -> bool:
        return self.kind == "rope"

    def embed(self, positions: Int[Array, " n"]) -> Float[Array, "n dim"] | None:
        """What to add to the token embeddings (None: nothing)."""
        if self.kind == "sinusoidal":
            return sinusoidal(positions, self.dim)
        if self.kind == "learned":
            assert self.table is not None
            return self.table[positions]
        return None

    def grid_bias(self, n: int) -> Float[Array, "heads n n"] | Alibi | None:
        """The bias of self-attention over positions 0..n-1: ALiBi as an `Alibi` (slopes
        only: the flash kernel computes it per tile, the XLA op materialises it), T5 as
        an array, else None."""
        if self.kind == "alibi":
            return Alibi(alibi_slopes(self.heads))
        if self.kind not in BIAS_KINDS:
            return None
        pos = jnp.arange(n)
        return self.bias(pos, pos)

    def bias(self, q_pos: Real[Array, " q"], kv_pos: Real[Array, " kv"]) -> Float[Array, "heads q kv"] | None:
        """The additive logit bias for these query and key positions (None: none).
        Positions may be fractional (a shortened encoder's resampled grid): ALiBi takes
        the distance as it is, T5 its nearest integer (its buckets are of integers)."""
        rel = kv_pos[None, :] - q_pos[:, None]
        if self.kind == "alibi":
            return -alibi_slopes(self.heads)[:, None, None] * jnp.abs(rel)[None].astype(jnp.float32)
        if self.kind == "t5":
            assert self.table is not None
            rel = jnp.round(rel).astype(jnp.int32)
            return jnp.moveaxis(self.table[t5_buckets(rel, bidirectional=not self.causal)], -1, 0)
        return None
