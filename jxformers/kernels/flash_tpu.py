"""Block-sparse flash attention for TPUs: Pallas kernels through the Mosaic TPU lowering.

The same two functions as `flash_gpu` (`forward`, `backward`), with the same padded
inputs and outputs, written the TPU way (as JAX's splash attention is): a grid
(head, block, visit slot) whose last axis walks a block's visit list. The lists are
scalar-prefetch arguments (in SMEM), and the BlockSpec index maps read the visited
block number from them, so Pallas double-buffers the DMA of the next visited tile
while the current one computes; the online-softmax state (m, l, acc) and the
gradient accumulators live in VMEM scratch across the slot axis. Slots past a
block's `count` are padding: their index repeats the last visited block (no new
DMA) and `pl.when` skips their compute. The pattern's rule and the key bound are
evaluated only on slots past `full` (the PARTIAL blocks).

A kernel reads one head's `[block, d]` tiles of a `[seq, heads, d]` array: as
`[seq, heads * d]` (a free reshape) when d is a multiple of 128, else transposed to
`[heads, seq, d]` (see `_Heads`: Mosaic's tiling rules). Per-row vectors (lse, delta)
and the key mask are laid out so that any block size is a legal tile.

`interpret=True` runs the kernels in TPU interpret mode (`pltpu.InterpretParams`),
which executes on CPU and checks TPU semantics; the CPU tests run them that way and
also run Pallas's TPU lowering (block shapes, lowering rules) on CPU. Mosaic's own
compilation (libtpu) and real TPUs have not run them yet.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jxformers.kernels.alibi import tile_distances
from jxformers.kernels.block_mask import VisitLists
from jxformers.kernels.scores import cap_slope, capped
from jxformers.kernels.tpu_interpret import with_semantics

# Lanes of a TPU vreg: per-row statistics are kept broadcast across a full lane row
# ([rows, 128]) so that their scratch buffers and the forward's lse output are
# natively tiled arrays, as splash attention keeps them.
LANES = 128

_NT = (((1,), (1,)), ((), ()))  # a @ b.T: the transposed operand on the right, which the MXU takes natively
_NN = (((1,), (0,)), ((), ()))


def _dot(a, b, dims):
    """float32-accumulated product; float32 inputs at HIGHEST precision, asked for
    explicitly (a TPU's default for float32 products may be a single bf16 pass)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _slots(lists: VisitLists):
    """`[rows, width]` block numbers per visit slot: the list, with the padding slots
    (t >= count) repeating the last visited block. Pallas skips the copy of a block
    whose index did not change, so padding slots cost no DMA; rows visiting nothing
    keep entry 0 (always a valid block number)."""
    xp = np if isinstance(lists.index, np.ndarray) and isinstance(lists.count, np.ndarray) else jnp
    index = xp.asarray(lists.index).astype(xp.int32)
    count = xp.asarray(lists.count).astype(xp.int32)
    last = xp.clip(xp.minimum(xp.arange(index.shape[1])[None, :], count[:, None] - 1), 0, None)
    return xp.take_along_axis(index, last, axis=1)


def _prefetch(lists: VisitLists):
    """The scalar-prefetch arguments: slots, full, count. The slots go flat: SMEM pads a
    2-D array's rows to whole tiles, a 1-D one far less, and SMEM is small.
    (`full_contiguous` is for the GPU kernels: here the index maps read every slot from
    SMEM and Pallas pipelines the copies whatever the block numbers.)"""
    return [
        jnp.asarray(_slots(lists)).reshape(-1),
        jnp.asarray(lists.full, jnp.int32),
        jnp.asarray(lists.count, jnp.int32),
    ]


def _visited(index, row, t):
    """The block number at visit slot `t` of `row` (grid axis 2 walks the slots)."""
    return index[row * pl.num_programs(2) + t]


def _call(kernel, *, name, grid, in_specs, out_specs, out_shape, scratch, static, sinks=False):
    """The pallas_call of a kernel whose scalar-prefetch arguments are the visit lists
    (`_prefetch`), with ALiBi the head slopes, and with `sinks` the sink logits."""

    def build(semantics):
        return pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=3 + _alibi(static) + sinks,
                grid=grid,
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=scratch,
            ),
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            interpret=pltpu.InterpretParams() if static.interpret else False,
            name=name,
        )

    # Heads and blocks are independent (megacore may split them); the slot axis
    # carries the accumulators, so it runs in order.
    return with_semantics(build, ("parallel", "parallel", "arbitrary"), interpret=static.interpret)


@dataclasses.dataclass(frozen=True)
class _Heads:
    """How a `[seq, heads, d]` array meets the kernels, which read one head's `[block, d]`
    tiles. Mosaic takes a tile whose last two dims are multiples of (8, 128) or the
    array's own: so with d a multiple of 128 (or one head) the array goes in as
    `[seq, heads * d]` (a free reshape) and a head is a column of tiles; otherwise it is
    transposed to `[heads, seq, d]` (an HBM copy), where a tile spans the whole d."""

    heads: int
    d: int

    @property
    def flat(self) -> bool:
        return self.d % LANES == 0 or self.heads == 1

    def put(self, x):
        return x.reshape(x.shape[0], self.heads * self.d) if self.flat else jnp.swapaxes(x, 0, 1)

    def take(self, y):
        """The kernel's output back as `[seq, heads, d]`."""
        return y.reshape(y.shape[0], self.heads, self.d) if self.flat else jnp.swapaxes(y, 0, 1)

    def shape(self, length: int, dtype):
        return jax.ShapeDtypeStruct((length, self.heads * self.d) if self.flat else (self.heads, length, self.d), dtype)

    def spec(self, block: int, where):
        """The BlockSpec of a head's `[block, d]` tiles; `where(h, b, t, *prefetch)` gives
        (head, block number)."""
        if self.flat:
            return pl.BlockSpec((block, self.d), lambda *grid: where(*grid)[::-1])
        return pl.BlockSpec((None, block, self.d), lambda *grid: (*where(*grid), 0))


def _alibi(static) -> bool:
    return static.alibi_offset is not None


def _split_slope(refs, static):
    """(the current head's ALiBi slope or None, the remaining refs): with ALiBi the
    slopes are the last scalar-prefetch argument, in SMEM, before the tensor refs."""
    if not _alibi(static):
        return None, refs
    return refs[0][pl.program_id(0)], refs[1:]


def _logits(s, static, slope, q_start, k_start, q_axis):
    """Scaled logits plus ALiBi's -slope * |i + offset - j| (queries along `q_axis`),
    soft-capped when asked (the cap acts on the biased logits, before any mask)."""
    if slope is not None:
        s = s - slope * tile_distances(static.alibi_offset, q_start, k_start, s.shape, q_axis)
    return capped(s, static.softcap)


def _capped_grad(ds, s, static):
    """dL/d(logit before the cap) from dL/d(capped logit) `ds` and the tile's capped,
    masked logits `s` (unchanged without a cap)."""
    return ds if static.softcap is None else ds * cap_slope(s, static.softcap)


def _tile_mask(static, q_start, k_start, shape, q_axis):
    """The pattern's rule and the key bound on one tile (partial slots only); the query
    positions run along `q_axis` of `shape`, the keys along the other."""
    i = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    j = k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return static.pattern.allowed(i, j) & (j < static.kv_len)


def _run_slot(step, full_ref, count_ref, row, t):
    """`step(partial)` on visit slot `t` of `row`: FULL slots without the pattern's rule,
    PARTIAL ones with it; padding slots (t >= count) compute nothing."""
    full, count = full_ref[row], count_ref[row]
    pl.when(t < full)(lambda: step(False))
    pl.when((t >= full) & (t < count))(lambda: step(True))


def _row_vectors(x, heads: int, length: int, block: int):
    """A `[heads, length]` per-query vector as `[heads, length // block, 1, block]`: its
    tiles `(1, block)` are then the array's last two dims whatever the block (a
    `(None, block)` tile of `[heads, length]` would need block % 128 == 0)."""
    return x.reshape(heads, length // block, 1, block)


def _kv_mask_tiles(kv_mask, block: int):
    """`[kv_len]` int32 as `[kv_len // block, 1, block]`: key tiles along lanes, legal for any block."""
    return kv_mask.reshape(-1, 1, block)


def _tag_inputs(tags, static, bq: int, bk: int, *, keys_visited: bool):
    """(inputs, BlockSpecs) of the tags: key tags (0: padding; with segments, segment + 1)
    and, with segments, query tags (segment + 1). A tile's queries run down its rows
    and its keys along its lanes when the keys are visited (forward, dq); the other way
    round in the dk/dv kernel, which visits queries. The tags along a tile's lanes come
    as `[n // b, 1, b]` row tiles, those down its rows as an `[n, 1]` column."""
    if not static.has_kv_mask:
        return [], []
    key_tags, q_tags = tags if static.has_segments else (tags, None)

    def row(x, b, index_map):
        return _kv_mask_tiles(x, b), pl.BlockSpec((None, 1, b), index_map)

    def column(x, b, index_map):
        return x.reshape(-1, 1), pl.BlockSpec((b, 1), index_map)

    def visited(h, b, t, index, *_):
        return _visited(index, b, t), 0, 0

    def own(h, b, t, *_):
        return b, 0, 0

    if keys_visited:
        pairs = [row(key_tags, bk, visited)]
        if q_tags is not None:
            pairs.append(column(q_tags, bq, lambda h, b, t, *_: (b, 0)))
    elif q_tags is None:
        pairs = [row(key_tags, bk, own)]
    else:
        pairs = [column(key_tags, bk, lambda h, b, t, *_: (b, 0)), row(q_tags, bq, visited)]
    return [x for x, _ in pairs], [spec for _, spec in pairs]


def _mask_tags(s, kvm_ref, qt_ref):
    """-inf where a key is padding or, with segments, in another segment than the query
    (tiles [queries, keys]: key tags a row, query tags a column)."""
    if kvm_ref is None:
        return s
    keep = kvm_ref[...] != 0 if qt_ref is None else qt_ref[...] == kvm_ref[...]
    return jnp.where(keep, s, -jnp.inf)


def _forward_kernel(index_ref, full_ref, count_ref, *refs, static, bq, bk):
    slope, refs = _split_slope(refs, static)
    # The sink logits: the scalar-prefetch argument after the slopes.
    sink, (q_ref, k_ref, v_ref, *rest) = (refs[0][pl.program_id(0)], refs[1:]) if static.sinks else (None, refs)
    kvm_ref = rest[0] if static.has_kv_mask else None
    qt_ref = rest[1] if static.has_segments else None
    o_ref, lse_ref, m_ref, l_ref, acc_ref = rest[-5:]
    qb, t = pl.program_id(1), pl.program_id(2)

    @pl.when(t == 0)
    def _init():
        # A sink starts every row: running max its logit, running sum exp(0) = 1.
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf if sink is None else sink, jnp.float32)
        l_ref[...] = jnp.full(l_ref.shape, 0.0 if sink is None else 1.0, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(partial):
        k_start = _visited(index_ref, qb, t) * bk
        s = _mask_tags(
            _logits(_dot(q_ref[...], k_ref[...], _NT) * static.scale, static, slope, qb * bq, k_start, 0),
            kvm_ref,
            qt_ref,
        )
        if partial:
            s = jnp.where(_tile_mask(static, qb * bq, k_start, (bq, bk), 0), s, -jnp.inf)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # A row with no visible key so far keeps m = -inf; shift it by 0 instead so
        # that exp(-inf - -inf) never makes a NaN.
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe[:, :1])
        l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        v = v_ref[...]
        acc_ref[...] = acc_ref[...] * alpha[:, :1] + _dot(p.astype(v.dtype), v, _NN)

    _run_slot(step, full_ref, count_ref, qb, t)

    @pl.when(t == pl.num_programs(2) - 1)
    def _finish():
        l, m = l_ref[...], m_ref[...]
        seen = jnp.logical_not(l <= 0)  # a NaN sum (a non-finite key the row reads) stays NaN, not a silent 0
        l_safe = jnp.where(seen, l, 1.0)
        o_ref[...] = jnp.where(seen[:, :1], acc_ref[...] / l_safe[:, :1], 0.0).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)


def _scalars(lists: VisitLists, slopes, static, sinks=None):
    return [*_prefetch(lists), *([slopes] if _alibi(static) else []), *([sinks] if sinks is not None else [])]


def forward(q, k, v, kv_mask, slopes, sinks, rows: VisitLists, static):
    """out `[Lq, H, dv]`, lse `[H, Lq]` (natural log; +inf for rows that see no key, the
    sink's logit with a sink); `sinks` the sink logits `[heads]` or None."""
    lq, heads, dk = q.shape
    lk, kv_heads, dv = v.shape
    group = heads // kv_heads
    bq, bk = static.sizes.block_q, static.sizes.block_k
    qh, kh, vh, oh = _Heads(heads, dk), _Heads(kv_heads, dk), _Heads(kv_heads, dv), _Heads(heads, dv)

    def own_q(h, b, t, *_):
        return h, b

    def visited_kv(h, b, t, index, *_):
        return h // group, _visited(index, b, t)

    in_specs = [qh.spec(bq, own_q), kh.spec(bk, visited_kv), vh.spec(bk, visited_kv)]
    inputs = [qh.put(q), kh.put(k), vh.put(v)]
    tag_inputs, tag_specs = _tag_inputs(kv_mask, static, bq, bk, keys_visited=True)
    in_specs += tag_specs
    inputs += tag_inputs
    out, lse = _call(
        functools.partial(_forward_kernel, static=static, bq=bq, bk=bk),
        name="block_sparse_flash_forward_tpu",
        grid=(heads, lq // bq, rows.width),
        in_specs=in_specs,
        # The lse leaves as [heads, Lq, 128], every lane the same (splash's layout):
        # the kernel holds it as a column broadcast over lanes, and writing it as a row
        # would need an in-kernel transpose.
        out_specs=[oh.spec(bq, own_q), pl.BlockSpec((None, bq, LANES), lambda h, b, t, *_: (h, b, 0))],
        out_shape=[oh.shape(lq, q.dtype), jax.ShapeDtypeStruct((heads, lq, LANES), jnp.float32)],
        scratch=[
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, dv), jnp.float32),
        ],
        static=static,
        sinks=sinks is not None,
    )(*_scalars(rows, slopes, static, sinks), *inputs)
    return oh.take(out), lse[:, :, 0]


def _dq_kernel(index_ref, full_ref, count_ref, *refs, static, bq, bk):
    slope, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest) = _split_slope(refs, static)
    kvm_ref = rest[0] if static.has_kv_mask else None
    qt_ref = rest[1] if static.has_segments else None
    # With ALiBi: outputs dq, d_slope rows; scratch dq, d_slope accumulators.
    dq_ref, acc_ref = (rest[-4], rest[-2]) if slope is not None else rest[-2:]
    qb, t = pl.program_id(1), pl.program_id(2)

    @pl.when(t == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if slope is not None:
            rest[-1][...] = jnp.zeros(rest[-1].shape, jnp.float32)

    def step(partial):
        k, v = k_ref[...], v_ref[...]
        k_start = _visited(index_ref, qb, t) * bk
        s = _mask_tags(
            _logits(_dot(q_ref[...], k, _NT) * static.scale, static, slope, qb * bq, k_start, 0), kvm_ref, qt_ref
        )
        if partial:
            s = jnp.where(_tile_mask(static, qb * bq, k_start, (bq, bk), 0), s, -jnp.inf)
        # Row vectors (1, bq) to columns (bq, 1), as splash's dq kernel reads them.
        p = jnp.exp(s - lse_ref[0][:, None])  # lse = +inf (no visible key) gives p = 0
        dp = _dot(do_ref[...], v, _NT)
        ds = _capped_grad(p * (dp - delta_ref[0][:, None]), s, static)  # dL/d(scaled logit + bias)
        acc_ref[...] += _dot(ds.astype(k.dtype), k, _NN)
        if slope is not None:  # the bias is -slope * distance; masked entries have ds = 0
            dist = tile_distances(static.alibi_offset, qb * bq, k_start, (bq, bk))
            rest[-1][...] -= jnp.sum(ds * dist, axis=1, keepdims=True)

    _run_slot(step, full_ref, count_ref, qb, t)

    @pl.when(t == pl.num_programs(2) - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * static.scale).astype(dq_ref.dtype)
        if slope is not None:
            rest[-3][...] = rest[-1][...]


def _dkv_kernel(index_ref, full_ref, count_ref, *refs, static, bq, bk):
    slope, (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest) = _split_slope(refs, static)
    kvm_ref = rest[0] if static.has_kv_mask else None  # with segments a column of key tags
    qt_ref = rest[1] if static.has_segments else None  # a row of query tags
    dk_ref, dv_ref, dk_acc, dv_acc = rest[-4:]
    kb, t = pl.program_id(1), pl.program_id(2)

    @pl.when(t == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    # Tiles are transposed, [keys, queries] (splash's dk/dv layout): every product is
    # then a plain or right-transposed one, and lse/delta are rows of queries.
    def step(partial):
        q, do = q_ref[...], do_ref[...]
        q_start = _visited(index_ref, kb, t) * bq
        s = _logits(_dot(k_ref[...], q, _NT) * static.scale, static, slope, q_start, kb * bk, 1)
        if qt_ref is not None:  # segments must be masked per tile; padding alone is zeroed at the end
            s = jnp.where(kvm_ref[...] == qt_ref[...], s, -jnp.inf)
        if partial:
            s = jnp.where(_tile_mask(static, q_start, kb * bk, (bk, bq), 1), s, -jnp.inf)
        p = jnp.exp(s - lse_ref[...])  # lse = +inf (no visible key) gives p = 0
        dv_acc[...] += _dot(p.astype(do.dtype), do, _NN)
        dp = _dot(v_ref[...], do, _NT)
        ds = _capped_grad(p * (dp - delta_ref[...]), s, static)
        dk_acc[...] += _dot(ds.astype(q.dtype), q, _NN)

    _run_slot(step, full_ref, count_ref, kb, t)

    @pl.when(t == pl.num_programs(2) - 1)
    def _finish():
        dk, dv = dk_acc[...] * static.scale, dv_acc[...]
        if kvm_ref is not None:
            # A masked key's row of p touches only its own rows of dk and dv, so
            # zeroing those rows once equals masking every tile. (Its p may overflow,
            # never anyone else's; `where` drops the inf/NaN.)
            real = (kvm_ref[...] if qt_ref is not None else kvm_ref[0][:, None]) != 0
            dk, dv = jnp.where(real, dk, 0.0), jnp.where(real, dv, 0.0)
        dk_ref[...] = dk
        dv_ref[...] = dv


def backward(q, k, v, kv_mask, slopes, do, lse, delta, rows: VisitLists, cols: VisitLists, static):
    """dq `[Lq, H, dk]` (q's dtype), float32 per-query-head dk `[Lk, H, dk]`, dv
    `[Lk, H, dv]` (the caller sums each kv head's group), and with ALiBi each row's
    share of its head's slope gradient `[H, Lq]` (else None)."""
    lq, heads, dk_ = q.shape
    lk, kv_heads, dv_ = v.shape
    group = heads // kv_heads
    bq, bk = static.sizes.backward
    qh, kh, vh, oh = _Heads(heads, dk_), _Heads(kv_heads, dk_), _Heads(kv_heads, dv_), _Heads(heads, dv_)
    inputs = [qh.put(q), kh.put(k), vh.put(v), oh.put(do)]
    lse_rows, delta_rows = (_row_vectors(x.astype(jnp.float32), heads, lq, bq) for x in (lse, delta))
    row_tags, row_tag_specs = _tag_inputs(kv_mask, static, bq, bk, keys_visited=True)
    col_tags, col_tag_specs = _tag_inputs(kv_mask, static, bq, bk, keys_visited=False)

    # dq: one program per (head, query block), walking the block's row.
    def own_q(h, b, t, *_):
        return h, b

    def visited_kv(h, b, t, index, *_):
        return h // group, _visited(index, b, t)

    row_spec = pl.BlockSpec((None, None, 1, bq), lambda h, b, t, *_: (h, b, 0, 0))
    alibi = _alibi(static)
    # The slope gradient leaves per row, broadcast over lanes as the forward's lse does.
    lane_rows = pl.BlockSpec((None, bq, LANES), lambda h, b, t, *_: (h, b, 0))
    dq, *d_slope = _call(
        functools.partial(_dq_kernel, static=static, bq=bq, bk=bk),
        name="block_sparse_flash_dq_tpu",
        grid=(heads, lq // bq, rows.width),
        in_specs=[
            qh.spec(bq, own_q),
            kh.spec(bk, visited_kv),
            vh.spec(bk, visited_kv),
            oh.spec(bq, own_q),
            row_spec,
            row_spec,
            *row_tag_specs,
        ],
        out_specs=[qh.spec(bq, own_q)] + [lane_rows] * alibi,
        out_shape=[qh.shape(lq, q.dtype)] + [jax.ShapeDtypeStruct((heads, lq, LANES), jnp.float32)] * alibi,
        scratch=[pltpu.VMEM((bq, dk_), jnp.float32)] + [pltpu.VMEM((bq, LANES), jnp.float32)] * alibi,
        static=static,
    )(*_scalars(rows, slopes, static), *inputs, lse_rows, delta_rows, *row_tags)

    # dk/dv: one program per (query head, key block), walking the block's column; the
    # accumulators are per query head (the caller folds grouped heads).
    def visited_q(h, b, t, index, *_):
        return h, _visited(index, b, t)

    def own_kv(h, b, t, *_):
        return h // group, b

    def own_out(h, b, t, *_):
        return h, b

    dkh, dvh = _Heads(heads, dk_), _Heads(heads, dv_)
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda h, b, t, index, *_: (h, _visited(index, b, t), 0, 0))
    dk, dv = _call(
        functools.partial(_dkv_kernel, static=static, bq=bq, bk=bk),
        name="block_sparse_flash_dkv_tpu",
        grid=(heads, lk // bk, cols.width),
        in_specs=[
            qh.spec(bq, visited_q),
            kh.spec(bk, own_kv),
            vh.spec(bk, own_kv),
            oh.spec(bq, visited_q),
            row_spec,
            row_spec,
            *col_tag_specs,
        ],
        out_specs=[dkh.spec(bk, own_out), dvh.spec(bk, own_out)],
        out_shape=[dkh.shape(lk, jnp.float32), dvh.shape(lk, jnp.float32)],
        scratch=[pltpu.VMEM((bk, dk_), jnp.float32), pltpu.VMEM((bk, dv_), jnp.float32)],
        static=static,
    )(*_scalars(cols, slopes, static), *inputs, lse_rows, delta_rows, *col_tags)
    return qh.take(dq), dkh.take(dk), dvh.take(dv), (d_slope[0][:, :, 0] if alibi else None)
