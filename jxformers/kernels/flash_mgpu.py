"""Block-sparse flash attention forward for Hopper GPUs: Pallas on the Mosaic GPU backend.

The same visit-list loop as `flash_gpu.py`'s forward (per query block: its FULL key
blocks with no mask work, then its PARTIAL blocks with the pattern's rule evaluated on
the tile; online softmax with float32 statistics in base 2), written for Hopper's
asynchronous units the way FlashAttention-3 (and JAX's bundled `attention_mgpu`) is:

* one CTA per (head, query block of 64 or 128 rows) with `block_q // 64` consumer
  warpgroups (64 query rows each: wgmma's M) and one producer warpgroup;
* the producer walks the block's visit list and issues TMA copies of the visited K/V
  tiles (and the key tags when there is a `kv_mask`) into a ring of `num_stages` SMEM
  slots; per slot a "loaded" barrier (TMA completion) and a "free" barrier (every
  consumer has read it), so the next visited tiles load while the current ones are
  multiplied;
* consumers compute S = Q K^T and O += P V with `wgmma`; with two consumers a shared
  barrier orders them so one's softmax overlaps the other's matmuls (FA3's ping-pong).

Only the forward lives here: `jxformers.kernels.flash` dispatches to it for
`backend="mosaic_gpu"` and runs the Triton backward (`flash_gpu.backward`) on this
forward's out `[Lq, H, dv]` and natural-log lse `[H, Lq]` (+inf for rows that see no
key), the layout `flash_gpu.forward` returns. Soft-capping (`_capped2`) and sinks (each
row's running max and sum start from the sink's logit and 1) as in `flash_gpu`'s forward.

K enters transposed (`[kv_heads, d_k, Lk]`, one XLA transpose per call) so that both
matmuls read their B operand as a plain `[K, N]` tile: GPU interpret mode (how the CPU
tests run this kernel) cannot apply `plgpu.transpose_ref`, and a `[d, block_k]` tile is
the same kind of TMA box and wgmma operand as the V tile. Interpret mode also cannot
feed wgmma from registers or preinitialise an accumulator (`pl.run_state`); `_pv` is
the one place where the compiled and interpreted kernels differ (P from registers
into the running accumulator on hardware, P through SMEM into a fresh one in interpret
mode).

Takes the padded inputs of `flash.py` (sequences a multiple of the blocks); head sizes
are padded here to a multiple of 64 (the 128-byte swizzle of bf16 tiles). bf16 and
fp16 only: wgmma would run float32 inputs as TF32.

Checked on CPU (tests/test_flash_mgpu.py): the values and the barrier protocol in
interpret mode, and that the compiled path lowers for CUDA (Mosaic GPU's layout
inference). Not yet run on a GPU, so unverified: ptxas and the swizzled SMEM layouts
(the 2D TMA box of a `[d, block_k]` slice of K^T), P fed to wgmma from registers, the
register budget (232 per consumer thread; PARTIAL steps hold two int32 index tiles),
the ping-pong's ordering on hardware, and speed. `impl="auto"` never picks it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jxformers.kernels.block_mask import VisitLists

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
WG_ROWS = 64  # query rows per consumer warpgroup (wgmma's M)
DTYPES = (jnp.bfloat16, jnp.float16)
# The [64, d] float32 accumulator takes d / 2 of a consumer thread's 232 registers, and
# the logits tile another 32 (64 keys): 128 is the largest head size tried.
MAX_HEAD_DIM = 128
SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block


def interpret_params():
    """GPU interpret mode's parameters (jax's private module in 0.10 and 0.11; there is
    no public name yet), or None when this JAX has no Mosaic GPU interpret mode."""
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError:
        return None
    return InterpretGPUParams()


def smem_bytes(block_q: int, block_k: int, d_k: int, d_v: int, slots: int, *, masked: bool) -> int:
    """Shared memory of one block: Q and O tiles per consumer, the K/V (and tags) ring."""
    tiles = block_q * (d_k + d_v) + slots * block_k * (d_k + d_v)
    return 2 * tiles + 4 * block_q + (4 * slots * block_k if masked else 0) + 1024  # + barriers, lse


def check(q, v, block_q: int, block_k: int, num_stages: int, *, masked: bool = False) -> None:
    """ValueError for what this kernel does not take, naming the values."""
    if q.dtype not in DTYPES:
        raise ValueError(
            f"backend='mosaic_gpu' takes bfloat16 or float16 inputs (wgmma would run float32 as "
            f"TF32); got {q.dtype}; use backend='gpu' for float32"
        )
    if block_q not in (WG_ROWS, 2 * WG_ROWS):
        raise ValueError(
            f"backend='mosaic_gpu' needs block_q 64 (one consumer warpgroup) or 128 (two); got "
            f"{block_q} (sequences shorter than 64 are fitted below it: pass longer inputs or backend='gpu')"
        )
    if block_k not in (64, 128):
        raise ValueError(f"backend='mosaic_gpu' needs block_k 64 or 128; got {block_k}")
    if max(q.shape[2], v.shape[2]) > MAX_HEAD_DIM:
        raise ValueError(
            f"backend='mosaic_gpu' takes head sizes up to {MAX_HEAD_DIM}; got d_k={q.shape[2]}, d_v={v.shape[2]}"
        )
    if num_stages < 2:
        raise ValueError(f"backend='mosaic_gpu' needs num_stages >= 2 (K/V slots in flight); got {num_stages}")
    need = smem_bytes(block_q, block_k, _round64(q.shape[2]), _round64(v.shape[2]), num_stages, masked=masked)
    if need > SMEM_BYTES:
        raise ValueError(
            f"backend='mosaic_gpu': block_q={block_q}, block_k={block_k}, num_stages={num_stages} with "
            f"d_k={q.shape[2]}, d_v={v.shape[2]} need {need} bytes of shared memory (> {SMEM_BYTES}); "
            "use fewer stages or smaller blocks"
        )


def _round64(n: int) -> int:
    return -(-n // 64) * 64


def _tiles():
    """The SMEM layout TMA and wgmma agree on for 16-bit tiles whose minor dim is a
    multiple of 64 (128 bytes): every tile here (head sizes are padded to 64)."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _layout(x, layout, *, interpret: bool):
    """`plgpu.layout_cast`, which has no interpret-mode rule (layouts are a lowering
    matter; the values are the same)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _pv(acc, p, v_tile, p_smem, *, interpret: bool):
    """acc + p @ v_tile (float32), p `[64, block_k]` in the inputs' dtype."""
    if not interpret:
        # FA3's form: P stays in registers as wgmma's A operand and accumulates into the
        # running output in place (no second accumulator's registers).
        def body(acc_ref):
            plgpu.wgmma(acc_ref, p, v_tile)

        return pl.run_state(body)(plgpu.ACC.init(acc))
    # Interpret mode reads wgmma operands from SMEM only and has no run_state.
    p_smem[...] = p
    plgpu.commit_smem()

    def body(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    return acc + pl.run_scoped(body, plgpu.ACC(acc.shape, jnp.float32))


def _capped2(s, softcap: float):
    """c tanh(s / c) in base 2 (times log2 e), tanh(u) written as 1 - 2 / (1 + 2^(2 u log2 e)):
    `approx_math` makes `jnp.tanh` PTX's tanh.approx (relative error ~2^-11: 0.015 at c = 30,
    against which the Triton backward's exact tanh would recompute p 1.5% off), while ex2
    and the reciprocal stay near float32 rounding. +-inf in the exponent gives +-1 exactly.
    The same function as `scores.tanh_cap(s, softcap, LOG2E)`, which the backward uses."""
    e = jnp.exp2(s * jnp.float32(2.0 * LOG2E / softcap))
    return jnp.float32(softcap * LOG2E) * (1.0 - 2.0 / (1.0 + e))


def _kernel(index_ref, full_ref, count_ref, q_ref, kt_ref, v_ref, *rest, static, group, consumers, slots, interpret):
    tags_ref = rest[0] if static.has_kv_mask else None
    sinks_ref = rest[int(static.has_kv_mask)] if static.sinks else None
    out_ref, lse_ref = rest[-2:]
    dtype = q_ref.dtype
    dk = q_ref.shape[-1]
    dv = v_ref.shape[-1]
    bk = static.sizes.block_k
    scratch = [
        plgpu.SMEM((consumers, WG_ROWS, dk), dtype, transforms=_tiles()),  # Q per consumer
        plgpu.SMEM((slots, dk, bk), dtype, transforms=_tiles()),  # K^T ring
        plgpu.SMEM((slots, bk, dv), dtype, transforms=_tiles()),  # V ring
        plgpu.SMEM((consumers, WG_ROWS, dv), dtype, transforms=_tiles()),  # O per consumer
        plgpu.SMEM((consumers, WG_ROWS), jnp.float32),  # lse per consumer
        plgpu.SMEM((slots, bk), jnp.int32) if tags_ref is not None else None,  # key tags ring
        plgpu.SMEM((consumers, WG_ROWS, bk), dtype, transforms=_tiles()) if interpret else None,
    ]
    barriers = [
        plgpu.Barrier(num_barriers=consumers),  # Q loaded
        plgpu.Barrier(num_barriers=slots),  # K loaded
        plgpu.Barrier(num_barriers=slots),  # V loaded
        plgpu.Barrier(num_barriers=slots) if tags_ref is not None else None,  # tags loaded
        # K (and tags), V slots free again: every consumer arrives once per visit.
        plgpu.Barrier(num_arrivals=consumers, num_barriers=slots),
        plgpu.Barrier(num_arrivals=consumers, num_barriers=slots),
        plgpu.Barrier(num_arrivals=consumers) if consumers == 2 else None,  # the ping-pong
    ]
    refs = (index_ref, full_ref, count_ref, q_ref, kt_ref, v_ref, tags_ref, sinks_ref, out_ref, lse_ref)
    pl.run_scoped(
        lambda *scoped: _body(
            *refs, *scoped, static=static, group=group, consumers=consumers, slots=slots, interpret=interpret
        ),
        *scratch,
        *barriers,
        collective_axes="wg",
    )


def _body(
    index_ref,
    full_ref,
    count_ref,
    q_ref,
    kt_ref,
    v_ref,
    tags_ref,
    sinks_ref,
    out_ref,
    lse_ref,
    q_smem,
    k_smem,
    v_smem,
    o_smem,
    lse_smem,
    tag_smem,
    p_smem,
    q_bar,
    k_bar,
    v_bar,
    tag_bar,
    k_free,
    v_free,
    turn,
    *,
    static,
    group,
    consumers,
    slots,
    interpret,
):
    head = lax.axis_index("heads")
    row = lax.axis_index("qblocks")
    wg = lax.axis_index("wg")
    bk = static.sizes.block_k
    dtype = q_ref.dtype
    dv = v_ref.shape[-1]
    count = count_ref[row]

    def take_turn():  # both consumers arrive, then both go on: alternates their matmuls
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(232 if consumers == 2 else 240, action="increase")
        q_start = row * static.sizes.block_q + wg * WG_ROWS
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_start, WG_ROWS), head], q_smem.at[wg], q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        full = full_ref[row]
        cast = functools.partial(_layout, interpret=interpret)
        wgmma_layout = plgpu.Layout.WGMMA
        # A sink starts every row: running max its logit (base 2), running sum exp(0) = 1.
        sink = -jnp.inf if sinks_ref is None else sinks_ref[head] * LOG2E
        m = cast(jnp.full((WG_ROWS,), sink, jnp.float32), wgmma_layout.reduce(1))
        l = cast(jnp.full((WG_ROWS,), 0.0 if sinks_ref is None else 1.0, jnp.float32), wgmma_layout.reduce(1))
        acc = cast(jnp.full((WG_ROWS, dv), 0.0, jnp.float32), wgmma_layout)

        def rows_to(x, shape):
            return lax.broadcast_in_dim(x, shape, [0])

        if consumers == 2:
            # Consumer 1 starts one turn behind, so the two alternate from here on.
            pl.when(wg == 1)(take_turn)

        def step(t, carry, partial):
            acc, m, l = carry
            slot = lax.rem(t, jnp.int32(slots))
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot])
                if consumers == 2:
                    take_turn()
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((WG_ROWS, bk), jnp.float32))
            s = s * (static.scale * LOG2E) if static.softcap is None else _capped2(s * static.scale, static.softcap)
            if tags_ref is not None:  # kv_mask: tag 0 marks a padded key
                plgpu.barrier_wait(tag_bar.at[slot])
                tags = cast(tag_smem.at[slot][...], wgmma_layout.reduce(0))
                s = jnp.where(lax.broadcast_in_dim(tags, s.shape, [1]) != 0, s, -jnp.inf)
            plgpu.barrier_arrive(k_free.at[slot])
            if partial:  # the pattern's rule on this tile, and the key bound (padding)
                k_start = index_ref[row, t] * bk
                i = q_start + cast(lax.broadcasted_iota(jnp.int32, s.shape, 0), wgmma_layout)
                j = k_start + cast(lax.broadcasted_iota(jnp.int32, s.shape, 1), wgmma_layout)
                s = jnp.where(static.pattern.allowed(i, j) & (j < static.kv_len), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            # A row with no allowed key so far keeps m = -inf; subtracting 0 keeps p = 0.
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s - rows_to(m_safe, s.shape))
            l = l * alpha + p.sum(axis=1)
            acc = acc * rows_to(alpha, acc.shape)
            p = p.astype(dtype)
            if consumers == 2:
                plgpu.barrier_arrive(turn)  # softmax done: the other consumer may multiply
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(turn)  # wait until the tensor cores are ours again
            else:
                plgpu.barrier_wait(v_bar.at[slot])
            acc = _pv(acc, p, v_smem.at[slot], None if p_smem is None else p_smem.at[wg], interpret=interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l

        carry = lax.fori_loop(0, full, functools.partial(step, partial=False), (acc, m, l))
        acc, m, l = lax.fori_loop(full, count, functools.partial(step, partial=True), carry)
        if consumers == 2:
            pl.when(wg == 0)(take_turn)  # consumer 0's last turn, paired with 1's first
        # A NaN sum (a non-finite key the row reads) is not empty: it stays NaN, not a
        # silent 0. No logical_not: jax 0.12's Mosaic GPU cannot convert its i1 registers.
        empty = l <= 0
        l_safe = jnp.where(empty, 1.0, l)
        # A row that saw no key has acc = 0 (every p was 0), so it stays 0.
        o_smem.at[wg][...] = (acc * rows_to(1.0 / l_safe, acc.shape)).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(empty, jnp.inf, m * LN2 + jnp.log(l_safe))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[pl.ds(q_start, WG_ROWS), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[head, pl.ds(q_start, WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(group))

        def load(t, slot, wait_free):
            k_start = index_ref[row, t] * bk
            if wait_free:
                plgpu.barrier_wait(k_free.at[slot])
            plgpu.copy_gmem_to_smem(kt_ref.at[kv_head, :, pl.ds(k_start, bk)], k_smem.at[slot], k_bar.at[slot])
            if tags_ref is not None:
                plgpu.copy_gmem_to_smem(tags_ref.at[pl.ds(k_start, bk)], tag_smem.at[slot], tag_bar.at[slot])
            if wait_free:
                plgpu.barrier_wait(v_free.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(k_start, bk), kv_head], v_smem.at[slot], v_bar.at[slot])

        for t in range(slots):  # fill the ring
            pl.when(t < count)(functools.partial(load, t, t, False))

        @pl.loop(slots, count)
        def _(t):
            load(t, lax.rem(t, jnp.int32(slots)), True)

        # Observe the consumers' last releases, so every barrier phase is waited on
        # (interpret mode checks this; on hardware it only delays this warpgroup's exit).
        @pl.loop(jnp.maximum(count - slots, 0), count)
        def _(t):
            slot = lax.rem(t, jnp.int32(slots))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


def _pad_last(x, size: int):
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def forward(q, k, v, kv_mask, slopes, sinks, rows: VisitLists, static):
    """out `[Lq, H, dv]`, lse `[H, Lq]` (natural log; +inf for rows that see no key):
    `flash_gpu.forward`'s contract, so the Triton backward runs on them unchanged."""
    if static.has_segments or slopes is not None:
        raise ValueError("backend='mosaic_gpu' has no segment_ids or ALiBi yet; use backend='gpu'")
    lq, heads, d_k = q.shape
    lk, kv_heads, d_v = v.shape
    bq, bk = static.sizes.block_q, static.sizes.block_k
    slots = static.sizes.num_stages
    check(q, v, bq, bk, slots, masked=kv_mask is not None)
    dk_pad, dv_pad = _round64(d_k), _round64(d_v)
    q = _pad_last(q, dk_pad)
    kt = jnp.transpose(_pad_last(k, dk_pad), (1, 2, 0))  # [kv_heads, d_k, Lk]
    v = _pad_last(v, dv_pad)
    interpret = bool(static.interpret)
    params = None
    if interpret:
        params = interpret_params()
        if params is None:
            raise ValueError(
                f"this JAX ({jax.__version__}) has no Mosaic GPU interpret mode (jax._src.pallas.mosaic_gpu.interpret)"
            )
    meta = [jnp.asarray(rows.index, jnp.int32), jnp.asarray(rows.full, jnp.int32), jnp.asarray(rows.count, jnp.int32)]
    tags = [] if kv_mask is None else [jnp.asarray(kv_mask, jnp.int32)]
    sink_logits = [] if sinks is None else [jnp.asarray(sinks, jnp.float32)]
    consumers = bq // WG_ROWS
    kernel = plgpu.kernel(
        functools.partial(
            _kernel, static=static, group=heads // kv_heads, consumers=consumers, slots=slots, interpret=interpret
        ),
        out_type=[jax.ShapeDtypeStruct((lq, heads, dv_pad), q.dtype), jax.ShapeDtypeStruct((heads, lq), jnp.float32)],
        grid=(heads, lq // bq),
        grid_names=("heads", "qblocks"),
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=params,
    )
    out, lse = kernel(*meta, q, kt, v, *tags, *sink_logits)
    return out[..., :d_v], lse
