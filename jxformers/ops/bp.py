"""BP-Transformer attention (Ye, Guo, Gan, Qiu & Zhang 2019, "BP-Transformer: Modelling
Long-Range Context via Binary Partitioning"): a binary partition tree over the tokens,
whose span nodes (level l: 2^l consecutive tokens) carry keys and values pooled from
their tokens; each token attends itself and, at every level, k nodes next to what the
finer levels already cover: fine-grained near, coarse far, O(k N log N).

The nodes a token attends form a partition of the sequence (of the past when causal), so
every token is reached exactly once, through a span of size growing with its distance.
The partition is static (it depends on the length and k only) and built with numpy at
trace time; the span keys and values are means over the tokens (the real ones).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jxformers._typing import ArrayLike
from jxformers.decoding import kv_cache
from jxformers.ops._common import (
    attend_parts,
    block_part,
    causal_never_reads_non_finite_future,
    causal_row_attend,
    check_positive,
    check_self,
    default_scale,
    group_heads,
    out_dtype,
    pad_to,
    rows_to_output,
    valid_keys,
    zero_padded,
)
from jxformers.registry import register

# What jxformers.ops exports from this family (the package imports it with `*`).
__all__ = [
    "bp_attention",
    "bp_nodes",
]


def _levels(n: int) -> int:
    """Levels above the tokens: the tree has 2^levels leaves >= n."""
    return max(0, (n - 1).bit_length())


def _side(i: int, step: int, n: int, neighbours: int) -> list[tuple[int, int]]:
    """The nodes (level, index) on one side of token i (`step` -1: left, +1: right) in a
    tree of 2^levels leaves, by the paper's rule with k = `neighbours`: at each level, k
    slots going outwards from the next uncovered node; when that node's parent would
    overlap nodes already taken (left: it is a left child; right: a right child), the
    next level's first slot takes that node itself instead, at its own level. Nodes that
    start past the sequence's end (padding alone) are left out."""
    levels = _levels(n)
    nodes, ptr, overlap = [], i + step, False
    for level in range(levels + 1):
        for _ in range(neighbours):
            if 0 <= ptr < (1 << levels) >> level:
                # the alignment node: the uncovered child of this level's node
                node = (level - 1, 2 * ptr + (step > 0)) if overlap else (level, ptr)
                if node[1] << node[0] < n:
                    nodes.append(node)
                overlap = False
            ptr += step
        overlap = overlap or (ptr % 2 == (0 if step < 0 else 1))
        ptr >>= 1  # floor: a left pointer past the start stays negative
    return nodes


@functools.lru_cache(maxsize=64)
def bp_nodes(n: int, neighbours: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
    """The binary-partition nodes each token attends.

    Node (l, m) spans the tokens [m 2^l, (m + 1) 2^l); its id in the node table of
    `bp_attention` is `offset(l) + m` with levels stacked from the tokens up (level l
    holds 2^(levels - l) nodes). Token i attends itself, then on its left, from i - 1
    outwards, k = `neighbours` nodes a level, level 0 (tokens) first, then spans of 2,
    4, ...; where a level's next node would overlap the nodes taken, the next level's
    first slot takes its uncovered child instead (`_side`: the rule of the authors'
    graph builder), until the sequence's start; the same on its right (not when
    `causal`). Every other token lies in exactly one attended node.

    Returns `(ids [n, slots], levels [n, slots])` as numpy int32, -1 past a row's nodes.
    """
    levels = _levels(n)
    offsets = np.concatenate([[0], np.cumsum([(1 << levels) >> level for level in range(levels + 1)])])
    rows = []
    for i in range(n):
        nodes = [(0, i), *_side(i, -1, n, neighbours)]
        if not causal:
            nodes += _side(i, +1, n, neighbours)
        rows.append(nodes)
    slots = max(len(r) for r in rows)
    ids = np.full((n, slots), -1, np.int32)
    level_of = np.full((n, slots), -1, np.int32)
    for i, nodes in enumerate(rows):
        for s, (level, m) in enumerate(nodes):
            ids[i, s] = offsets[level] + m
            level_of[i, s] = level
    return ids, level_of


def _node_table(x: Float[ArrayLike, "L h d"], real: Bool[ArrayLike, " L"], levels: int):
    """Every node's mean over its real tokens, levels stacked from the tokens up:
    `[2L - 1, h, d]` and each node's count of real tokens `[2L - 1]` (L = 2^levels)."""
    w = real.astype(jnp.float32)
    sums, counts = [], []
    for level in range(levels + 1):
        span = 1 << level
        groups = x.shape[0] // span
        sums.append((x.astype(jnp.float32) * w[:, None, None]).reshape(groups, span, *x.shape[1:]).sum(axis=1))
        counts.append(w.reshape(groups, span).sum(axis=1))
    total, count = jnp.concatenate(sums), jnp.concatenate(counts)
    return total / jnp.maximum(count, 1.0)[:, None, None], count


@causal_never_reads_non_finite_future()
def bp_attention(
    q: Float[ArrayLike, "seq heads d_k"],
    k: Float[ArrayLike, "_seq kv_heads _d_k"],
    v: Float[ArrayLike, "_seq _kv_heads d_v"],
    *,
    neighbours: int = 4,
    causal: bool = False,
    kv_mask: Bool[ArrayLike, " _seq"] | None = None,
    scale: float | None = None,
) -> Float[Array, "seq heads d_v"]:
    """BP-Transformer attention (Ye et al., 2019, section 3): token i attends, in one
    softmax, itself and the binary-partition nodes of `bp_nodes` (k = `neighbours` a side
    a level, from tokens near to large spans far), each node's key and value the mean of
    the keys and values of the real tokens it spans (a node of padding alone is masked).

    `causal=True` keeps the left side alone: every node there spans tokens before i only,
    so the row reads nothing later (the paper's language-model setting).

    Arguments:
        q, k, v: self-attention inputs of one length `seq` (any length: the tree has
            2^ceil(log2 seq) leaves, nodes past the end are padding).
        neighbours: the paper's k >= 1, nodes a side a level.
        causal: the left side only.
        kv_mask: optional `[seq]`, True for real tokens.
        scale: default `1 / sqrt(d_k)`.

    Returns:
        `[seq, heads, d_v]`.

    Time and memory O(seq * k * log(seq) * d).
    """
    k, v = zero_padded(k, v, kv_mask)  # padding's values never reach real outputs
    check_self(q, k, v, kv_mask)
    check_positive("neighbours", neighbours)
    n = q.shape[0]
    levels = _levels(n)
    length = 1 << levels
    real = valid_keys(kv_mask, n, length)
    node_k, count = _node_table(pad_to(k, length), real, levels)
    node_v, _ = _node_table(pad_to(v, length), real, levels)
    ids_np, _ = bp_nodes(n, neighbours, causal)
    ids: Int[Array, "seq slots"] = jnp.asarray(ids_np)
    safe = jnp.maximum(ids, 0)
    mask = (ids >= 0) & (count[safe] > 0)
    scale = default_scale(q.shape[2], scale)
    qg = group_heads(q, k.shape[1])
    part = block_part(qg[:, None], node_k[safe], node_v[safe], mask[:, None, :], scale)  # blocks of one query
    return rows_to_output(attend_parts([part]), n, out_dtype(q, k, v))


register(
    "bp",
    bp_attention,
    family="fixed pattern",
    paper="Ye et al. 2019",
    complexity="O(k N log N)",
    decoder=kv_cache(causal_row_attend(bp_attention), forward=("neighbours",)),
    exact=False,
    docs={"neighbours": "the paper's k: binary-partition nodes a side a level"},
    summary="itself and k nodes a side a level of a binary partition tree (span keys/values: means)",
    limits={"neighbours": 1},
    dense_width=(
        "its partition nodes (1 + 2 k (log2 max_len + 1))",
        lambda hp, n: 1 + 2 * hp["neighbours"] * ((n - 1).bit_length() + 1),
    ),
    scaled=(
        "neighbours = min(default, the largest k whose nodes 1 + 2 k (log2 N + 1) are at most N / 2): Ye et al. "
        "2019's k = 4 once N reaches 128",
        lambda d, n: {"neighbours": min(d["neighbours"], max(1, (n // 2 - 1) // (2 * ((n - 1).bit_length() + 1))))},
    ),
)
