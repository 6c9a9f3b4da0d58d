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

import dataclasses
import math
import typing

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import Linear, _lift
from jxformers.validate import check_fields, defaults, setting


@typing.no_type_check  # values come from users' YAML: check_fields names the key instead
@dataclasses.dataclass(frozen=True)
class PKMConfig:
    """A product-key memory in place of a block's FFN, as a model config's `ffn`
    component (`ffn: {kind: pkm, num_keys: 32}`): the `ProductKeyMemory` constructor's
    settings, declared once here (its keyword defaults read them). Lample et al. use 4
    heads and k = 32 of 512^2 keys; top_k 8 suits the small memories of this library's
    tests."""

    num_keys: int = setting(doc="sub-keys per half (required): the memory holds num_keys^2 values")
    kind: str = setting("pkm", "this FFN component: a product-key memory", choices=("pkm",))
    top_k: int = setting(8, "values read per token and head, at most num_keys")
    heads: int = setting(4, "memory heads (each its own query and sub-keys; values shared)")
    d_key: int | None = setting(None, "query and key width, even (None: d_model)")
    query_norm: bool = setting(False, "batch-normalise the queries (reads the whole sequence: not causal)")

    def __post_init__(self):
        check_fields(self, "pkm.")
        for name in ("num_keys", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"pkm.{name} must be >= 1; got {getattr(self, name)}")
        if self.d_key is not None and (self.d_key < 2 or self.d_key % 2):
            raise ValueError(f"pkm.d_key must be even and >= 2 (two halves); got {self.d_key}")
        if not 1 <= self.top_k <= self.num_keys:
            raise ValueError(f"pkm.top_k must be in [1, num_keys={self.num_keys}]; got {self.top_k}")

    def check_model(self, *, d_model: int, causal: bool) -> None:
        """What the memory needs of its model: an even d_key (d_model when unset), no
        query norm in a causal model."""
        d_key = d_model if self.d_key is None else self.d_key
        if d_key < 2 or d_key % 2:
            raise ValueError(
                f"pkm.d_key must be even and >= 2 (two halves); with d_key unset it is d_model = {d_model}"
            )
        if causal and self.query_norm:
            raise ValueError(
                "pkm.query_norm reads the statistics of the whole sequence, which leaks future tokens "
                "in a causal model; set query_norm False"
            )

    def settings(self) -> dict:
        """The `ProductKeyMemory` constructor's keywords (everything but kind)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "kind"}


# The required setting, and the ProductKeyMemory constructor's defaults (read from PKMConfig).
REQUIRED = ("num_keys",)
SETTINGS = {k: v for k, v in defaults(PKMConfig).items() if k not in ("kind", *REQUIRED)}


def check_settings(settings: dict, *, d_model: int, causal: bool, prefix: str = "") -> dict:
    """`settings` completed with the defaults, after ValueErrors for unknown names,
    missing required ones and out-of-range values (those of `PKMConfig`); nothing is built."""
    known = sorted([*REQUIRED, *SETTINGS])
    unknown = sorted(set(settings) - set(known), key=str)
    if unknown:
        raise ValueError(f"{prefix}unknown product-key memory setting(s) {unknown}; known: {known}")
    missing = [name for name in REQUIRED if name not in settings]
    if missing:
        raise ValueError(
            f"{prefix}product-key memory setting(s) {missing} are required (num_keys: sub-keys per "
            f"half, the memory holds num_keys^2 values); got {dict(settings)}"
        )
    config = PKMConfig(**settings)
    config.check_model(d_model=d_model, causal=causal)
    return config.settings()


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

    def __init__(
        self,
        d_model: int,
        num_keys: int,
        *,
        top_k: int = SETTINGS["top_k"],
        heads: int = SETTINGS["heads"],
        d_key: int | None = SETTINGS["d_key"],
        query_norm: bool = SETTINGS["query_norm"],
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        check_settings(
            dict(num_keys=num_keys, top_k=top_k, heads=heads, d_key=d_key, query_norm=query_norm),
            d_model=d_model,
            causal=False,
        )
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
        self,
        x: Float[Array, "seq d_model"],
        *,
        mask: Bool[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "seq d_model"]:
        scores, index = product_key_lookup(self.queries(x, mask), self.sub_keys, self.top_k)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # [seq, heads, k]
        rows = self.values.astype(x.dtype)[index]  # [seq, heads, k, d_model]
        out = jnp.einsum("shk,shkd->sd", weights, rows)
        return self.dropout(out, key=key, inference=inference)
