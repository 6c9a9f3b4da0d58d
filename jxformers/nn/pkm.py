"""Product-key memory (Lample et al. 2019, "Large Memory Layers with Product Keys"): an
FFN replacement that reads a large value table through a product-key top-k lookup.

    memory = ProductKeyMemory(d_model=64, num_keys=32, top_k=8, heads=4, key=key)  # N = 32^2 values
    y = memory(x)                                   # [seq, d_model]

For each head, the query q = [q1; q2] (two halves of width d_key / 2) is scored against
two sub-key sets of sqrt(N) keys each; the top-k of each half give k*k candidate keys
(i, j) with score s1_i + s2_j, exactly the top-k over all N = sqrt(N)^2 product keys
(the best k of the sums lie among the best k of each half), and the output is the
softmax of those k scores times the k selected value rows. Heads share the value table
and their outputs are summed. `brute_force_lookup` scores all N keys (the reference).

Time per token: O(heads (sqrt(N) d_key + k^2 + k d_model)) instead of O(N d_model).
The value table's gradient is sparse (k rows per token and head); optimisers see it
dense. Query normalisation (`query_norm=True`, the paper's query batch norm, which
spreads the queries so more keys get used): per-feature statistics over the example's
real tokens (with `mask`), a learned scale and shift; there are no running statistics,
so the same formula is used in training and inference (one example at a time, batched
with vmap, has no cross-example batch). Per-token (no leakage across positions) unless
`query_norm` is on, whose statistics read the whole sequence: not causal then.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import Linear, _lift

# ProductKeyMemory's settings (what ModelConfig's `pkm` mapping may set): the required
# ones, and the others with their defaults, which the constructor reads too (Lample et al.
# use 4 heads and k = 32 of 512^2 keys; 8 suits the small memories of this library's tests).
REQUIRED = ("num_keys",)
SETTINGS: dict[str, Any] = dict(top_k=8, heads=4, d_key=None, query_norm=False)


def check_settings(settings: dict, *, d_model: int, causal: bool, prefix: str = "") -> dict:
    """`settings` completed with the defaults, after ValueErrors for unknown names and
    out-of-range values; nothing is built."""
    known = sorted([*REQUIRED, *SETTINGS])
    unknown = sorted(set(settings) - set(known), key=str)
    if unknown:
        raise ValueError(f"{prefix}unknown product-key memory setting(s) {unknown}; known: {known}")
    missing = [name for name in REQUIRED if name not in settings]
    if missing:
        raise ValueError(f"{prefix}product-key memory setting(s) {missing} are required (num_keys: sub-keys per "
                         f"half, the memory holds num_keys^2 values); got {dict(settings)}")
    s = SETTINGS | dict(settings)
    d_key = d_model if s["d_key"] is None else s["d_key"]
    if not (isinstance(d_key, int) and d_key >= 2 and d_key % 2 == 0):
        raise ValueError(f"{prefix}d_key must be even and >= 2 (two halves); got {d_key!r}")
    for name in ("num_keys", "heads"):
        if not (isinstance(s[name], int) and s[name] >= 1):
            raise ValueError(f"{prefix}{name} must be an int >= 1; got {s[name]!r}")
    if not (isinstance(s["top_k"], int) and 1 <= s["top_k"] <= s["num_keys"]):
        raise ValueError(f"{prefix}top_k must be in [1, num_keys={s['num_keys']}]; got {s['top_k']!r}")
    if not isinstance(s["query_norm"], bool):
        raise ValueError(f"{prefix}query_norm must be a bool; got {s['query_norm']!r}")
    if causal and s["query_norm"]:
        raise ValueError(f"{prefix}query_norm reads the statistics of the whole sequence, which leaks future tokens "
                         "in a causal model; set query_norm False")
    return s


def product_key_lookup(
    query: Float[Array, "seq heads d_key"], sub_keys: Float[Array, "heads 2 n half"], k: int
) -> tuple[Float[Array, "seq heads k"], Int[Array, "seq heads k"]]:
    """(scores, indices) of the top-k product keys per token and head: index i * n + j
    for sub-keys i (first half) and j (second half), score q1.K1[i] + q2.K2[j], best
    first. float32 scores."""
    n, half = sub_keys.shape[2], sub_keys.shape[3]
    q = query.astype(jnp.float32).reshape(*query.shape[:2], 2, half)
    scores = jnp.einsum("shpd,hpnd->shpn", q, sub_keys.astype(jnp.float32))  # [seq, heads, 2, n]
    top, idx = jax.lax.top_k(scores, k)  # [seq, heads, 2, k]
    cand = top[..., 0, :, None] + top[..., 1, None, :]  # [seq, heads, k, k]
    cand_idx = idx[..., 0, :, None] * n + idx[..., 1, None, :]
    best, where = jax.lax.top_k(cand.reshape(*cand.shape[:2], k * k), k)
    return best, jnp.take_along_axis(cand_idx.reshape(*cand_idx.shape[:2], k * k), where, axis=-1)


def brute_force_lookup(
    query: Float[Array, "seq heads d_key"], sub_keys: Float[Array, "heads 2 n half"], k: int
) -> tuple[Float[Array, "seq heads k"], Int[Array, "seq heads k"]]:
    """The same top-k by scoring all N = n^2 product keys (O(N) per token: the reference)."""
    n, half = sub_keys.shape[2], sub_keys.shape[3]
    full = jnp.concatenate([jnp.repeat(sub_keys[:, 0], n, axis=1), jnp.tile(sub_keys[:, 1], (1, n, 1))], -1)
    scores = jnp.einsum("shd,hnd->shn", query.astype(jnp.float32), full.astype(jnp.float32))
    assert full.shape[-1] == 2 * half
    best, index = jax.lax.top_k(scores, k)
    return best, index


class ProductKeyMemory(eqx.Module):
    """Product-key memory layer, `[seq, d_model] -> [seq, d_model]`.

    Arguments (constructor): d_model; num_keys n (sub-keys per half; the memory holds
    N = n^2 values of width d_model); top_k k (<= n); heads; d_key (query width, even;
    default d_model); query_norm (see the module docstring); dropout on the output.
    """

    query: Linear
    sub_keys: Float[Array, "heads 2 n half"]
    values: Float[Array, "memory d_model"]
    norm_scale: Float[Array, " qdim"] | None
    norm_shift: Float[Array, " qdim"] | None
    dropout: eqx.nn.Dropout
    top_k: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    d_key: int = eqx.field(static=True)

    def __init__(self, d_model: int, num_keys: int, *, top_k: int = SETTINGS["top_k"], heads: int = SETTINGS["heads"],
                 d_key: int | None = SETTINGS["d_key"], query_norm: bool = SETTINGS["query_norm"],
                 dropout: float = 0.0, key: PRNGKeyArray):
        check_settings(dict(num_keys=num_keys, top_k=top_k, heads=heads, d_key=d_key, query_norm=query_norm),
                       d_model=d_model, causal=False)
        d_key = d_model if d_key is None else d_key
        kq, kk, kv = jax.random.split(key, 3)
        half = d_key // 2
        self.query = Linear(d_model, heads * d_key, use_bias=False, key=kq)
        bound = 1.0 / math.sqrt(half)
        self.sub_keys = jax.random.uniform(kk, (heads, 2, num_keys, half), minval=-bound, maxval=bound)
        self.values = jax.random.normal(kv, (num_keys * num_keys, d_model)) / math.sqrt(d_model)
        self.norm_scale = jnp.ones((heads * d_key,)) if query_norm else None
        self.norm_shift = jnp.zeros((heads * d_key,)) if query_norm else None
        self.dropout = eqx.nn.Dropout(dropout)
        self.top_k, self.heads, self.d_key = top_k, heads, d_key

    def queries(
        self, x: Float[Array, "seq d_model"], mask: Bool[Array, " seq"] | None = None
    ) -> Float[Array, "seq heads d_key"]:
        """The (optionally normalised) queries, float32."""
        q = self.query(x.astype(jnp.float32))
        if self.norm_scale is not None:
            assert self.norm_shift is not None
            w = jnp.ones(x.shape[:1], jnp.float32) if mask is None else mask.astype(jnp.float32)
            w = w[:, None] / jnp.maximum(w.sum(), 1.0)
            mean = (q * w).sum(0, keepdims=True)
            var = (jnp.square(q - mean) * w).sum(0, keepdims=True)
            q = (q - mean) * jax.lax.rsqrt(var + 1e-5) * _lift(self.norm_scale, 2) + _lift(self.norm_shift, 2)
        return q.reshape(x.shape[0], self.heads, self.d_key)

    def __call__(
        self, x: Float[Array, "seq d_model"], *, mask: Bool[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None, inference: bool = False,
    ) -> Float[Array, "seq d_model"]:
        scores, index = product_key_lookup(self.queries(x, mask), self.sub_keys, self.top_k)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # [seq, heads, k]
        rows = self.values.astype(x.dtype)[index]  # [seq, heads, k, d_model]
        out = jnp.einsum("shk,shkd->sd", weights, rows)
        return self.dropout(out, key=key, inference=inference)
