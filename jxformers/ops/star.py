"""Star-Transformer attention (Guo, Qiu, Liu, Shao, Xue & Zhang 2019, "Star-Transformer"):
every token (a satellite node) attends its ring neighbours i - 1, i, i + 1 and one shared
relay node, in one softmax; the relay is the mean of the inputs (the paper's initial
relay) or that mean after one attention step over every token (the paper's relay update).

The relay is not a token: its key and value are pooled from the tokens' keys and values
(exactly the projections of the pooled hidden state, since the projections are affine),
so the op is not a softmax under a mask over the tokens. O(N d).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from jxformers._typing import ArrayLike
from jxformers.decoding import kv_cache
from jxformers.ops._common import (
    Part,
    attend_parts,
    block_part,
    causal_never_reads_non_finite_future,
    causal_row_attend,
    check_self,
    default_scale,
    einsum_f32,
    group_heads,
    out_dtype,
    positions,
    rows_to_output,
    softmax_parts,
    valid_keys,
    zero_padded,
)
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "star_attention",
]

RELAYS = ("attended", "mean")


def _relay(qg, k, v, real, *, relay: str, causal: bool, scale: float):
    """The relay's key and value seen by each row, `[n, h, g, d_k]` and `[n, h, g, d_v]`,
    and whether it exists `[n]` (a row with no real token before it has none).

    "mean": s0 = the mean of the real tokens (the paper's initialisation), its key and
    value the means of theirs; causal: the mean of the real tokens up to the row.
    "attended": s1 = Att(s0, [s0; H]) (the paper's relay update): s0's query attends
    s0's key and every real token's, and s1's key and value are the same weighted sums
    of theirs (the projections of the attention-pooled hidden state)."""
    n, h, g, _ = qg.shape
    weight = real.astype(jnp.float32)
    if causal:  # cumulative means: row i pools the real tokens j <= i
        count = jnp.cumsum(weight)
        inv = jnp.where(count > 0, 1.0 / jnp.maximum(count, 1.0), 0.0)
        mean_k = jnp.cumsum(weight[:, None, None] * k.astype(jnp.float32), axis=0) * inv[:, None, None]
        mean_v = jnp.cumsum(weight[:, None, None] * v.astype(jnp.float32), axis=0) * inv[:, None, None]
        shape = (n, h, g)
        return (
            jnp.broadcast_to(mean_k[:, :, None], (*shape, k.shape[-1])),
            jnp.broadcast_to(mean_v[:, :, None], (*shape, v.shape[-1])),
            count > 0,
        )
    count = weight.sum()
    w = weight / jnp.maximum(count, 1.0)
    mean_k = einsum_f32("n,nhd->hd", w, k)
    mean_v = einsum_f32("n,nhd->hd", w, v)
    exists = jnp.broadcast_to(count > 0, (n,))
    if relay == "mean":
        rk, rv = (jnp.broadcast_to(x[:, None], (h, g, x.shape[-1])) for x in (mean_k, mean_v))
    else:
        # s0's query, the mean of the real queries (a padded query may hold anything: 0 * NaN is NaN)
        relay_q = einsum_f32("n,nhgd->hgd", w, jnp.where(real[:, None, None, None], qg, 0))
        to_self = (einsum_f32("hgd,hd->hg", relay_q, mean_k) * scale)[:, :, None, None]
        to_tokens = (einsum_f32("hgd,nhd->hgn", relay_q, k) * scale)[:, :, None, :]
        p_self, p_tokens = softmax_parts(
            [(to_self, jnp.reshape(count > 0, (1, 1, 1, 1))), (to_tokens, real[None, None, None])]
        )
        p_self, p_tokens = p_self[:, :, 0, 0], p_tokens[:, :, 0, :]
        rk = p_self[..., None] * mean_k[:, None] + einsum_f32("hgn,nhd->hgd", p_tokens, k)
        rv = p_self[..., None] * mean_v[:, None] + einsum_f32("hgn,nhd->hgd", p_tokens, v)
    return jnp.broadcast_to(rk, (n, *rk.shape)), jnp.broadcast_to(rv, (n, *rv.shape)), exists


@causal_never_reads_non_finite_future()
def star_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    relay: str = "attended",
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """Star-Transformer attention (Guo et al., 2019, section 2, Algorithm 1), one cycle.

    Satellite i attends, in one softmax, its ring neighbours i - 1, i, i + 1 (the first
    and the last token have one neighbour: the ring does not wrap) and the relay node s.
    The relay (`relay`):
      * "attended" (default): s0 = the mean of the real tokens, then s1 = Att(s0, [s0; H])
        with s0's query, key and value the means of the tokens' (the paper's relay
        update, here before the satellites read it); s1's key and value are its
        attention weights applied to [s0; H]'s keys and values;
      * "mean": s0 itself, the relay the paper's first cycle reads.
    `causal=True` (an extension: the paper's model is an encoder) drops i + 1 and makes
    the relay cumulative: row i reads the mean of the real tokens j <= i. Only "mean" can
    be causal: the attended relay pools every token with one query; a cumulative form
    would be a softmax per row over its past, O(N^2).

    Arguments:
        q, k, v: self-attention inputs of one length `seq`.
        relay: "attended" or "mean".
        causal: restrict to the past ("mean" relay only).
        kv_mask: optional `[seq]`, True for real tokens (padding is never a ring
            neighbour and never pooled into the relay).
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * d).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_self(q, k, v, kv_mask)
    if relay not in RELAYS:
        raise ValueError(f"relay must be one of {RELAYS}; got {relay!r}")
    if causal and (why := _causal_refusal({"relay": relay})):
        raise ValueError(why)
    n = q.shape[0]
    scale = default_scale(q.shape[2], scale)
    qg = group_heads(q, k.shape[1])  # [n, h, g, d]
    real = valid_keys(kv_mask, n, n)

    offsets = jnp.asarray((-1, 0) if causal else (-1, 0, 1), jnp.int32)
    idx = positions(n)[:, None] + offsets[None, :]  # [n, 2 or 3]: the ring neighbours
    safe = jnp.clip(idx, 0, n - 1)
    ring_mask = (idx >= 0) & (idx < n) & real[safe]
    k_arr, v_arr = jnp.asarray(k), jnp.asarray(v)
    ring = block_part(qg[:, None], k_arr[safe], v_arr[safe], ring_mask[:, None, :], scale)  # blocks of one query

    rk, rv, exists = _relay(qg, k_arr, v_arr, real, relay=relay, causal=causal, scale=scale)
    relay_logits = (einsum_f32("nhgd,nhgd->hgn", qg, rk) * scale)[..., None]  # [h, g, n, 1]

    def relay_values(p):  # p [h, g, n, 1] -> [n, h, g, d_v]
        return jnp.einsum("hgn,nhgd->nhgd", p[..., 0], rv.astype(jnp.float32))

    out = attend_parts([ring, Part(relay_logits, exists[None, None, :, None], relay_values)])
    return rows_to_output(out, n, out_dtype(q, k, v))


def _causal_refusal(hp) -> str | None:
    """Why a relay cannot be causal (the registration's `causal_refusal`), or None."""
    if hp["relay"] == "mean":
        return None
    return (
        f"relay={hp['relay']!r} cannot be causal: it pools every token with one query (the future "
        "included); use relay='mean' (the cumulative mean of the past)"
    )


register(
    "star",
    star_attention,
    family="fixed pattern",
    paper="Guo et al. 2019",
    complexity="O(N)",
    decoder=kv_cache(causal_row_attend(star_attention), forward=("relay",)),
    exact=False,
    choices={"relay": RELAYS},
    docs={
        "relay": "attended (s0 = the mean, then one attention step over the tokens; not causal) "
        "or mean (s0; causal: the cumulative mean)"
    },
    causal_refusal=_causal_refusal,
    summary="ring neighbours i-1, i, i+1 and a relay node pooled from every token, one softmax",
)
