"""Informer's ProbSparse self-attention (Zhou et al. 2021, "Informer: Beyond Efficient
Transformer for Long Sequence Time-Series Forecasting", AAAI, §3.2 and Algorithm 1):
only the u = factor * ln(L_Q) queries of largest sparsity measurement attend the keys;
the others ("lazy" queries) take the mean of the values.

The selection compares every query with every other, so the op is not causal: its
masked form (`masked=True`, Informer's decoder self-attention) masks the future inside
each row but chooses the rows from all positions, and a later token can change whether
an earlier one is selected. It cannot decode incrementally either.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._arrays import guarded_divide, nan_where, read_values
from jxformers._typing import ArrayLike
from jxformers.ops._common import (
    check_positive,
    check_self,
    default_scale,
    einsum_f32,
    out_dtype,
    per_query_head,
    positions,
    softmax_parts,
    zero_padded,
)
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = ["probsparse_arrays", "probsparse_attention", "probsparse_counts", "probsparse_samples"]


def probsparse_counts(length: int, factor: int) -> int:
    """factor * ceil(ln length), at most `length`: U, the keys sampled per query (from the
    key length), and u, the queries selected (from the query length), as Informer's code
    rounds them."""
    return min(factor * math.ceil(math.log(length)), length) if length > 1 else 1


def probsparse_arrays(key: PRNGKeyArray) -> dict[str, PRNGKeyArray]:
    """ProbSparse's drawn array: the key its key samples are drawn from (redrawn with the
    module; Informer draws new samples at every call)."""
    return {"key": key}


def probsparse_samples(key: PRNGKeyArray, real: Bool[ArrayLike, " L"], *, samples: int) -> Array:
    """`[L, samples]` key positions for each query, drawn uniformly with replacement
    among the real keys (as Informer's `torch.randint`; the same draw for every head)."""
    real = jnp.asarray(real)
    n_real = jnp.sum(real.astype(jnp.int32))
    real_first = jnp.argsort(~real, stable=True)
    rank = jnp.floor(jax.random.uniform(key, (real.shape[0], samples)) * n_real).astype(jnp.int32)
    return real_first[jnp.clip(rank, 0, jnp.maximum(n_real - 1, 0))]


def probsparse_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    factor: int = 5,
    masked: bool = False,
    key: PRNGKeyArray | None = None,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """ProbSparse self-attention (Zhou et al. 2021, §3.2, eq. 4 and Algorithm 1).

    Each query i samples U = factor * ceil(ln L_K) keys (with replacement, from `key`)
    and gets the sparsity measurement M(q_i, K) = max_j s_ij - mean_j s_ij over them,
    s_ij = q_i k_j / sqrt(d_k). The u = factor * ceil(ln L_Q) queries of largest M
    (per head) attend every key with softmax; every other query takes mean(V).

    `masked=True` is Informer's masked (decoder) form: a selected query i attends keys
    j <= i and a lazy one takes the mean of v_1..v_i (the paper's cumulative mean;
    Informer's code takes the cumulative sum). It is not causal: the selection ranks
    every position, so a later token can change an earlier row.

    A non-finite measurement (a NaN or inf in a sampled key) poisons the ranking, so
    every row is NaN then: each row's output depends on which queries are selected.

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (grouped kv heads).
        factor: c of U = c ln L_K and u = c ln L_Q (Informer's 5).
        masked: Informer's masked form (see above).
        key: PRNG key of the key samples (`probsparse_arrays`).
        kv_mask: optional `[seq]`, True for real tokens: keys are sampled and attended
            among the real ones, padded queries are never selected, and the means are
            over real values.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * ln(seq) * d): the sampled logits and the u selected rows.
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_positive("factor", factor)
    check_self(q, k, v, kv_mask)
    if key is None:
        raise ValueError("probsparse_attention needs `key` to draw its key samples (probsparse_arrays(key))")
    n, _, d_k = q.shape
    sc = default_scale(d_k, scale)
    real = jnp.ones((n,), bool) if kv_mask is None else jnp.asarray(kv_mask)
    pos = positions(n)
    top = probsparse_counts(n, factor)  # U keys sampled per query and u queries selected: L_K = L_Q
    sampled = probsparse_samples(key, real, samples=top)  # [L, U]
    vh = jnp.moveaxis(jnp.asarray(v), 0, 1)  # [h, L, dv]

    # The lazy rows: mean(V) over the real keys (masked: over the real keys up to i).
    # Sums, not a weight matrix: O(L), and a non-finite value reaches the rows summing it.
    vr = jnp.where(real[None, :, None], vh.astype(jnp.float32), 0.0)
    if masked:
        lazy = guarded_divide(jnp.cumsum(vr, axis=1), jnp.cumsum(real.astype(jnp.float32))[None, :])
    else:
        lazy = jnp.broadcast_to(
            guarded_divide(vr.sum(1, keepdims=True), jnp.sum(real.astype(jnp.float32)).reshape(1, 1)), vr.shape
        )

    def head(q_h, k_h, v_h, lazy_h):
        qf = q_h.astype(jnp.float32)
        s_sampled = jnp.einsum("ld,lud->lu", qf, k_h[sampled].astype(jnp.float32)) * sc
        measure = jnp.max(s_sampled, axis=-1) - jnp.mean(s_sampled, axis=-1)
        broken = jnp.any(~jnp.isfinite(measure) & real)  # the ranking read a non-finite key
        chosen = jax.lax.top_k(jnp.where(real, jax.lax.stop_gradient(measure), -jnp.inf), top)[1]  # [u]
        reads = real[None, :] & ((pos[None, :] <= chosen[:, None]) if masked else True)  # [u, L]
        s = einsum_f32("ud,ld->ul", qf[chosen], k_h) * sc
        p = softmax_parts([(s[None, None], reads[None, None])])[0][0, 0]
        active = read_values("ul,ld->ud", p, v_h, reads=reads)
        out = lazy_h.at[chosen].set(jnp.where(real[chosen][:, None], active, lazy_h[chosen]))
        return nan_where(jnp.broadcast_to(broken, (n,)), out)

    return per_query_head(head, q, k, v, lazy).astype(out_dtype(q, k, v))


register(
    "probsparse",
    probsparse_attention,
    family="sparse",
    paper="Zhou et al. 2021 (Informer)",
    complexity="O(N log N)",
    exact=False,
    init_arrays=probsparse_arrays,
    drawn=("key",),
    docs={
        "factor": "c of U = c ln N sampled keys per query and u = c ln N selected queries",
        "masked": "Informer's masked decoder form (rows masked to j <= i, cumulative means; not causal)",
    },
    summary=(
        "Informer: the top u = c ln N queries by max - mean of sampled logits attend every key, the others "
        "take mean(V); not causal (the selection ranks every position)"
    ),
    limits={"factor": 1},
    dense_width=("its selected queries (u = factor ceil(ln N))", lambda hp, n: probsparse_counts(n, hp["factor"])),
    scaled=(
        "factor = min(default, the largest c whose u = c ceil(ln N) is at most N / 2) (Zhou et al. 2021: c = 5)",
        lambda d, n: {"factor": min(d["factor"], max(1, (n // 2) // max(1, math.ceil(math.log(n)))))},
    ),
)
