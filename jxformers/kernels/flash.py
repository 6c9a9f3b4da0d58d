"""Block-sparse flash attention: the public entry point, its custom VJP, and the plain
reference of the same function.

    out = block_sparse_attention(q, k, v, pattern, kv_mask=..., scale=...)

equals `block_sparse_reference(q, k, v, pattern, ...)` (dense masked softmax) for any
`Pattern`, length and grouped-query layout, with cost proportional to the pattern's
visited blocks. Forward saves only q, k, v, the output and one log-sum-exp per row
(O(N) per head); the backward recomputes each tile. Rows that see no key return zeros,
as every op of the library does. Logit soft-capping and attention sinks
(`jxformers.kernels.scores`) are computed in the kernels' tiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np

from jxformers._arrays import poison_keys, read_values, zero_padded
from jxformers.kernels import flash_gpu
from jxformers.kernels.alibi import Alibi, check_alibi
from jxformers.kernels.block_mask import add_full_blocks, block_kinds, ceil_div, visit_lists
from jxformers.kernels.impl import KernelChoice
from jxformers.kernels.pattern import Pattern, dense_mask
from jxformers.kernels.scores import capped, check_sinks, check_softcap, sink_logit_vector

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the kernels (tune per device): `block_q` queries by `block_k` keys in the
    forward, `block_q_bwd` by `block_k_bwd` in the dq and dk/dv kernels (None: the
    forward's); Triton's `num_warps` and `num_stages` (software pipelining depth; the
    Mosaic GPU forward's K/V ring), `num_stages_bwd` the backward kernels'.
    The defaults were the fastest of the few settings tried on an H100 (docs/kernels.md)."""

    block_q: int = 128
    block_k: int = 64
    block_q_bwd: int | None = 64
    block_k_bwd: int | None = 64
    num_warps: int | None = 8
    # 3 stages ran out of shared memory at head size 128 on an H100 (232 KB).
    num_stages: int = 2
    # The dq and dk/dv kernels' depth (None: num_stages). Their 64 x 64 tiles leave room:
    # at d = 128 on an H100, 3 stages took the dense 8K forward+backward from 43.1 to
    # 35.5 ms (docs/kernel_runs/h100_mosaic.md, the Mosaic rows' s2 against s3).
    num_stages_bwd: int | None = 3

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            value = getattr(self, name)
            if value is None and name.endswith("bwd"):
                continue
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name} must be a power of two >= 16; got {value!r}")

    @property
    def backward(self) -> tuple[int, int]:
        """(block_q, block_k) of the dq and dk/dv kernels (default: the forward's)."""
        return self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k

    def fitted(self, q_len: int, kv_len: int) -> BlockSizes:
        """Blocks no longer than the (power-of-two rounded) sequences."""
        bq, bk = self.backward
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, _pow2(q_len)),
            block_k=min(self.block_k, _pow2(kv_len)),
            block_q_bwd=min(bq, _pow2(q_len)),
            block_k_bwd=min(bk, _pow2(kv_len)),
        )


_default_sizes = [BlockSizes()]
# TPU tiles are 128 lanes wide: 64-key blocks would half-fill them (splash uses 512).
TPU_BLOCK_SIZES = BlockSizes(128, 128, block_q_bwd=128, block_k_bwd=128)


@contextlib.contextmanager
def default_block_sizes(sizes: BlockSizes):
    """Within the block, kernels called without `block_sizes` (as the ops call them)
    use `sizes` (tuning and benchmarks)."""
    _default_sizes.append(sizes)
    try:
        yield sizes
    finally:
        _default_sizes.pop()


def _pow2(n: int) -> int:
    return max(16, 1 << max(0, n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class _Static:
    pattern: Pattern
    q_len: int
    kv_len: int
    scale: float
    sizes: BlockSizes
    has_kv_mask: bool
    has_segments: bool
    backend: str
    interpret: bool
    alibi_offset: int | None = None  # ALiBi's q_offset; None: no ALiBi
    softcap: float | None = None  # c of c * tanh(s / c); None: uncapped
    sinks: bool = False  # the kernels get a sink logit per query head

    @property
    def padded(self) -> tuple[int, int]:
        """Sequence lengths padded to a multiple of every block (powers of two: the largest)."""
        bq = max(self.sizes.block_q, self.sizes.backward[0])
        bk = max(self.sizes.block_k, self.sizes.backward[1])
        return ceil_div(self.q_len, bq) * bq, ceil_div(self.kv_len, bk) * bk


def block_sparse_reference(
    q,
    k,
    v,
    pattern: Pattern,
    *,
    kv_mask=None,
    segment_ids=None,
    scale: float | None = None,
    extra_blocks=None,
    block_size: int | None = None,
    alibi: Alibi | None = None,
    softcap: float | None = None,
    sinks: str = "none",
    sink_logits=None,
):
    """Dense masked softmax attention under `pattern` (and `kv_mask`, `segment_ids`, the
    FULL `extra_blocks` of `block_size`, the `alibi` bias, the `softcap` and the sink),
    computed with an N x N mask: the reference the kernels are tested against. Returns
    `(out [q_len, heads, d_v], lse [q_len, heads])` (the lse with the sink in it)."""
    q_len, heads, d_k = q.shape
    kv_len, kv_heads, _ = k.shape
    k, v = zero_padded(k, v, kv_mask)  # padding's values (NaN, inf) never reach real outputs
    scale = 1.0 / math.sqrt(d_k) if scale is None else scale
    mask = jnp.asarray(dense_mask(pattern, q_len, kv_len))
    if extra_blocks is not None:
        rows = jnp.arange(q_len) // block_size
        cols = jnp.arange(kv_len) // block_size
        hit = (jnp.asarray(extra_blocks)[rows][:, :, None] == cols[None, None, :]).any(axis=1)
        mask = mask | hit
    if kv_mask is not None:
        mask = mask & jnp.asarray(kv_mask)[None, :]
    if segment_ids is not None:
        mask = mask & (jnp.asarray(segment_ids[0])[:, None] == jnp.asarray(segment_ids[1])[None, :])
    g = heads // kv_heads
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), jnp.repeat(k, g, axis=1).astype(jnp.float32)) * scale
    if alibi is not None:
        s = s + alibi.dense(q_len, kv_len)
    s = jnp.where(mask[None], capped(s, softcap), -jnp.inf)
    sink = sink_logit_vector(sinks, sink_logits, heads)
    if sink is None:
        lse = jax.nn.logsumexp(s, axis=-1)
    else:  # one more term, of logit sink[h] and value 0, in each row of head h
        sink = jnp.broadcast_to(sink[:, None], s.shape[:2])
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=-1), sink))  # finite: no 0 * inf in a gradient
        lse = top + jnp.log(jnp.sum(jnp.exp(s - top[..., None]), axis=-1) + jnp.exp(sink - top))
    seen = lse != -jnp.inf  # a NaN lse (a non-finite key the row reads) stays NaN
    p = jnp.where(seen[..., None], jnp.exp(s - jnp.where(seen, lse, 0.0)[..., None]), 0.0)
    out = read_values("hqk,khd->qhd", p, jnp.repeat(v, g, axis=1).astype(jnp.float32))
    return out.astype(q.dtype), jnp.where(seen, lse, jnp.inf).T


def _metadata(static: _Static, extra_blocks, block_q: int, block_k: int):
    """Visit lists of the query blocks (rows) and of the key blocks (columns)."""
    kinds = block_kinds(static.pattern, static.q_len, static.kv_len, block_q, block_k)
    lq, lk = static.padded
    kinds = np.pad(kinds, ((0, lq // block_q - kinds.shape[0]), (0, lk // block_k - kinds.shape[1])))  # EMPTY
    if extra_blocks is not None:
        kinds = add_full_blocks(kinds, extra_blocks)
    return visit_lists(kinds), visit_lists(kinds.T)


def _kernels(static):
    if static.backend in ("gpu", "mosaic_gpu"):  # mosaic_gpu: only its forward differs
        return flash_gpu
    if static.backend == "tpu":
        from jxformers.kernels import flash_tpu

        return flash_tpu
    raise ValueError(f"no block-sparse kernel for backend {static.backend!r}; kernels: 'gpu', 'mosaic_gpu', 'tpu'")


def _forward_kernels(static):
    # backend="mosaic_gpu" (explicit only; never chosen by impl="auto": not yet run on
    # hardware): the forward on Pallas Mosaic GPU, the backward the Triton kernels fed by
    # its out and lse (same layout).
    if static.backend == "mosaic_gpu":
        from jxformers.kernels import flash_mgpu

        return flash_mgpu
    return _kernels(static)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, kv_mask, extra_blocks, slopes, sinks, static):
    return _flash_fwd_rule(q, k, v, kv_mask, extra_blocks, slopes, sinks, static)[0]


def _flash_fwd_rule(q, k, v, kv_mask, extra_blocks, slopes, sinks, static):
    rows, _ = _metadata(static, extra_blocks, static.sizes.block_q, static.sizes.block_k)
    out, lse = _forward_kernels(static).forward(q, k, v, kv_mask, slopes, sinks, rows, static)
    return (out, lse), (q, k, v, kv_mask, extra_blocks, slopes, sinks, out, lse)


def _flash_bwd_rule(static, residuals, cotangents):
    q, k, v, kv_mask, extra_blocks, slopes, sinks, out, lse = residuals
    d_out, d_lse = cotangents
    rows, cols = _metadata(static, extra_blocks, *static.sizes.backward)
    # d lse_i / d s_ij = p_ij: a cotangent on the lse shifts delta (FlashAttention's D_i).
    delta = jnp.einsum("qhd,qhd->hq", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - jnp.where(jnp.isfinite(lse), d_lse, 0.0)
    dq, dk, dv, d_slope_rows = _kernels(static).backward(
        q, k, v, kv_mask, slopes, d_out.astype(q.dtype), lse, delta, rows, cols, static
    )
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads

    def fold(x, like):  # per-query-head gradients -> their kv head
        return x.reshape(x.shape[0], kv_heads, group, x.shape[2]).sum(axis=2).astype(like.dtype)

    d_slopes = None if slopes is None else d_slope_rows.sum(axis=1)
    # The sink is one more logit with value 0 in each row's softmax, so its gradient is
    # p_sink * (0 - delta) summed over the head's rows (p_sink = exp(sink - lse); the
    # saved lse has the sink in it). Padded query rows have delta = 0.
    d_sinks = None if sinks is None else -jnp.sum(jnp.exp(sinks[:, None] - lse) * delta, axis=1)
    return dq, fold(dk, k), fold(dv, v), None, None, d_slopes, d_sinks


_flash.defvjp(_flash_fwd_rule, _flash_bwd_rule)


def _pad_axis(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _check_segments(segment_ids, q_len: int, kv_len: int) -> None:
    try:
        q_seg, kv_seg = segment_ids
    except (TypeError, ValueError):
        raise ValueError("segment_ids must be a pair (query segments [q_len], key segments [kv_len])") from None
    for name, x, n in (("query", q_seg, q_len), ("key", kv_seg, kv_len)):
        if tuple(jnp.shape(x)) != (n,) or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(
                f"{name} segment ids must be an int array of shape {(n,)}; got {jnp.result_type(x)}{list(jnp.shape(x))}"
            )


def check_inputs(q, k, v, kv_mask=None) -> None:
    """ValueError for inputs the kernels do not take (the ops' own checks come first)."""
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v must be [seq, heads, d]; got {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"the kernels take q, k, v of one float dtype (float32, bfloat16, float16); "
            f"got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.shape[1] % k.shape[1] or k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"heads must be a multiple of kv_heads and k, v must agree; got {q.shape}, {k.shape}, {v.shape}"
        )
    if kv_mask is not None and tuple(kv_mask.shape) != (k.shape[0],):
        raise ValueError(f"kv_mask must have shape {(k.shape[0],)}; got {tuple(kv_mask.shape)}")


def block_sparse_attention(
    q,
    k,
    v,
    pattern: Pattern,
    *,
    kv_mask=None,
    segment_ids=None,
    scale: float | None = None,
    extra_blocks=None,
    alibi: Alibi | None = None,
    softcap: float | None = None,
    sinks: str = "none",
    sink_logits=None,
    block_sizes: BlockSizes | None = None,
    backend: str = "gpu",
    interpret: bool = False,
    return_lse: bool = False,
):
    """Flash attention restricted to `pattern`, visiting only its blocks.

    Arguments:
        q: `[q_len, heads, d_k]`; k: `[kv_len, kv_heads, d_k]`; v: `[kv_len, kv_heads, d_v]`,
            one float dtype; heads a multiple of kv_heads (K/V are never repeated).
        pattern: which key each query may attend (`jxformers.kernels.pattern`).
        kv_mask: optional `[kv_len]` bool, True for real keys.
        segment_ids: optional `(query segments [q_len], key segments [kv_len])` int
            arrays (ids >= 0): query i sees key j only within one segment (packed
            sequences).
        scale: logits multiplier; default `1 / sqrt(d_k)`.
        extra_blocks: optional `[num_q_blocks, r]` int array of key blocks each query
            block also sees in full (run-time values: BigBird's random blocks); needs
            `block_q == block_k`, the blocks they count in; -1 for none.
        alibi: optional `Alibi(slopes [heads], q_offset)`: adds -slopes[h] * |i +
            q_offset - j| to the scaled logits, computed on each visited tile (no
            N x N bias); differentiable in the slopes.
        softcap: c: the logits (scaled, ALiBi added) become c * tanh(s / c) before the
            mask (Gemma 2), in every tile; None: uncapped.
        sinks: "none"; "zero": a key of logit 0 and value 0 joins every row's softmax;
            "learned": its logit is `sink_logits [heads]` (one per query head, float;
            differentiable). `jxformers.kernels.scores` holds the vocabulary. A row that
            sees no key returns zeros either way.
        block_sizes: `BlockSizes` (clipped to short sequences).
        backend: "gpu" (Triton lowering) or "tpu" (Mosaic TPU) kernel variant;
            "mosaic_gpu": the forward on Pallas Mosaic GPU (`flash_mgpu`, Hopper; bf16/fp16,
            block_q 64 or 128; not yet run on hardware), the backward on "gpu"'s kernels.
        interpret: run the kernels in Pallas interpret mode (any device).
        return_lse: also return the natural-log log-sum-exp `[q_len, heads]` of each
            row's logits (+inf where a row sees no key); it is differentiable, so
            partial attentions over disjoint key sets can be merged exactly. With a
            sink it has the sink's term in it (finite in every row): merge parts that
            have no sink, or only one part with it.

    Returns:
        `[q_len, heads, d_v]` in q's dtype (and the lse when asked).
    """
    check_inputs(q, k, v, kv_mask)
    k, v = zero_padded(k, v, kv_mask)  # padding's values (NaN, inf) never reach real outputs
    k, v = poison_keys(k, v)  # a real non-finite value reaches only the rows that read it
    q_len, heads, d_k = q.shape
    kv_len, _, d_v = v.shape
    if block_sizes is None:
        block_sizes = TPU_BLOCK_SIZES if backend == "tpu" and len(_default_sizes) == 1 else _default_sizes[-1]
    sizes = block_sizes.fitted(q_len, kv_len)
    if extra_blocks is not None:
        if len({sizes.block_q, sizes.block_k, *sizes.backward}) != 1:
            raise ValueError(f"extra_blocks count blocks of one size; got {sizes}")
        want = (ceil_div(q_len, sizes.block_q),)
        if tuple(extra_blocks.shape[:1]) != want or extra_blocks.ndim != 2:
            raise ValueError(f"extra_blocks must be [num_q_blocks={want[0]}, r]; got {tuple(extra_blocks.shape)}")
    if segment_ids is not None:
        _check_segments(segment_ids, q_len, kv_len)
    check_softcap(softcap)
    check_sinks(heads, sinks, sink_logits)
    slopes = None
    if alibi is not None:
        check_alibi(alibi, heads)
        slopes = jnp.asarray(alibi.slopes, jnp.float32)
    has_tags = kv_mask is not None or segment_ids is not None
    static = _Static(
        pattern,
        q_len,
        kv_len,
        float(1.0 / math.sqrt(d_k) if scale is None else scale),
        sizes,
        has_tags,
        segment_ids is not None,
        backend,
        interpret,
        None if alibi is None else int(alibi.q_offset),
        None if softcap is None else float(softcap),
        sinks != "none",
    )
    lq, lk = static.padded
    dk_pad, dv_pad = _pow2(d_k), _pow2(d_v)
    qp = _pad_axis(_pad_axis(q, 0, lq), 2, dk_pad)
    kp = _pad_axis(_pad_axis(k, 0, lk), 2, dk_pad)
    vp = _pad_axis(_pad_axis(v, 0, lk), 2, dv_pad)
    # Key tags: 0 for padding, else 1 (or segment + 1); query tags segment + 1.
    tags = jnp.ones((kv_len,), jnp.int32) if kv_mask is None else jnp.asarray(kv_mask).astype(jnp.int32)
    if segment_ids is not None:
        tags = tags * (jnp.asarray(segment_ids[1], jnp.int32) + 1)
        q_tags = _pad_axis(jnp.asarray(segment_ids[0], jnp.int32) + 1, 0, lq)
        mask = (_pad_axis(tags, 0, lk), q_tags)
    else:
        mask = _pad_axis(tags, 0, lk) if kv_mask is not None else None
    extra = None if extra_blocks is None else jnp.asarray(extra_blocks, jnp.int32)
    sink = sink_logit_vector(sinks, sink_logits, heads)
    # custom_vjp hides the rule's return type from the type checker.
    out, lse = typing.cast("tuple[jax.Array, jax.Array]", _flash(qp, kp, vp, mask, extra, slopes, sink, static))
    out = out[:q_len, :, :d_v]
    if return_lse:
        return out, lse[:, :q_len].T
    return out


def pattern_attention(
    q,
    k,
    v,
    pattern: Pattern,
    choice: KernelChoice,
    *,
    kv_mask=None,
    scale: float | None = None,
    extra_blocks=None,
    alibi: Alibi | None = None,
    softcap: float | None = None,
    sinks: str = "none",
    sink_logits=None,
    block_sizes: BlockSizes | None = None,
    return_lse: bool = False,
):
    """`block_sparse_attention` as the ops call it: inputs of mixed float dtypes promoted
    to one, run where `choice` says."""
    dtype = jnp.result_type(q, k, v)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    return block_sparse_attention(
        q,
        k,
        v,
        pattern,
        kv_mask=kv_mask,
        scale=scale,
        extra_blocks=extra_blocks,
        alibi=alibi,
        softcap=softcap,
        sinks=sinks,
        sink_logits=sink_logits,
        block_sizes=block_sizes,
        backend=choice.backend,
        interpret=choice.interpret,
        return_lse=return_lse,
    )


def merge_attentions(parts):
    """Softmax attention over a union of disjoint key sets, from each set's `(out [q_len,
    heads, d_v], lse [q_len, heads])` as `block_sparse_attention(..., return_lse=True)`
    returns them (lse = +inf: the row saw no key there). Exact and differentiable (every
    exponent is finite, so no NaN reaches a gradient); rows with no key anywhere are zero.
    Returns `[q_len, heads, d_v]` float32."""
    seen = [jnp.isfinite(lse) for _, lse in parts]
    top = functools.reduce(jnp.maximum, [jnp.where(s, lse, -jnp.inf) for s, (_, lse) in zip(seen, parts, strict=True)])
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))  # cancels: any finite shift is exact
    weights = [
        jnp.where(s, jnp.exp(jnp.where(s, lse, top) - top), 0.0) for s, (_, lse) in zip(seen, parts, strict=True)
    ]
    total = sum(weights)
    empty = total <= 0  # a NaN total (a non-finite key this row reads) stays NaN, not a silent 0
    norm = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, total))
    return sum(out.astype(jnp.float32) * (w * norm)[..., None] for (out, _), w in zip(parts, weights, strict=True))


def visited_fraction(
    pattern: Pattern, q_len: int, kv_len: int, block_sizes: BlockSizes | None = None, extra_blocks=None
) -> float:
    """Fraction of the block grid the kernels visit for `pattern` (benchmarks' FLOP counts)."""
    sizes = (block_sizes or _default_sizes[-1]).fitted(q_len, kv_len)
    kinds = block_kinds(pattern, q_len, kv_len, sizes.block_q, sizes.block_k)
    if extra_blocks is not None:
        kinds = add_full_blocks(kinds, extra_blocks)
    return float(np.mean(np.asarray(kinds) != 0))
