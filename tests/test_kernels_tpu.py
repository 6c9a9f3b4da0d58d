"""The block-sparse flash-attention kernel's TPU variant (`flash_tpu`, Mosaic TPU), run
in TPU interpret mode on CPU, against the dense reference: outputs, lse and gradients
for dense, causal, windowed, Longformer-like, dilated, grouped-query, padded,
odd-length, packed (segment ids), bf16, ALiBi, soft-capped, sink (zero and learned, with
the sink logits' gradient) and BigBird (run-time extra blocks, under vmap) patterns; that the
kernels pass Pallas's TPU lowering (block shapes, primitives); and that
`impl="pallas"` picks it on TPUs.

Every case is one compilation of the forward and backward kernels (a few seconds in
interpret mode), so the cases are few and small (one head where heads do not matter);
tiles are 64 or 128 wide. A single head, or a head size of 128, takes the kernels'
untransposed head layout, other cases the transposed one (`flash_tpu._Heads`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import qkv

from jxformers.kernels import (
    Alibi,
    Band,
    BlockSizes,
    KernelChoice,
    KeyRange,
    QueryRange,
    block_sparse_attention,
    block_sparse_reference,
    causal,
    impl,
    union,
)

B128 = BlockSizes(128, 128, 128, 128)
MIXED = BlockSizes(128, 64, 64, 128)  # the dq/dk-dv tiles differ from the forward's, and bq != bk
B64 = BlockSizes(64, 64, 64, 64)


def _loss_weights(seed, out_shape):
    kw, kl = jax.random.split(jax.random.key(seed + 100))
    return jax.random.normal(kw, out_shape), jax.random.normal(kl, out_shape[:-1])


def _run(fn, q, k, v, w_out, w_lse):
    """(out, lse) and the gradients w.r.t. q, k, v of a random projection of both (the
    lse term exercises the kernels' d_lse path; rows that see no key have lse = +inf and
    are left out of it)."""

    def loss(q, k, v):
        out, lse = fn(q, k, v)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse)
        return jnp.sum(out.astype(jnp.float32) * w_out) + lse_term, (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, grads


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got)), f"{what}: +inf rows differ"
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    err = float(np.abs(got[finite] - want[finite]).max(initial=0.0))
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} x {scale:.3g}"


def _check(
    pattern,
    *,
    q_len=256,
    kv_len=None,
    heads=2,
    kv_heads=2,
    d=32,
    dv=32,
    sizes=B128,
    kv_mask=None,
    extra_blocks=None,
    block_size=None,
    dtype=jnp.float32,
    tol=2e-5,
    seed=0,
    batch=None,
    alibi=None,
    segment_ids=None,
    softcap=None,
    sinks="none",
):
    """The kernel against the reference on one example, or on `batch` examples under
    `jax.vmap` (as the models run it; kv_mask and extra_blocks then per example)."""
    kv_len = q_len if kv_len is None else kv_len
    examples = [
        qkv(seed + n, q_len, heads=heads, kv_heads=kv_heads, d=d, dv=dv, kv_len=kv_len) for n in range(batch or 1)
    ]
    q, k, v = (jnp.stack(xs) for xs in zip(*examples, strict=True)) if batch else examples[0]

    def kernel(q, k, v, kv_mask, extra_blocks):
        return block_sparse_attention(
            q,
            k,
            v,
            pattern,
            kv_mask=kv_mask,
            extra_blocks=extra_blocks,
            block_sizes=sizes,
            backend="tpu",
            interpret=True,
            return_lse=True,
            alibi=alibi,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks=sinks,
            sink_logits=_sink_logits(heads, sinks),
        )

    def reference(q, k, v, kv_mask, extra_blocks):
        return block_sparse_reference(
            q,
            k,
            v,
            pattern,
            kv_mask=kv_mask,
            extra_blocks=extra_blocks,
            block_size=block_size,
            alibi=alibi,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks=sinks,
            sink_logits=_sink_logits(heads, sinks),
        )

    if batch:
        kernel, reference = jax.vmap(kernel), jax.vmap(reference)
    w_out, w_lse = _loss_weights(seed, (*q.shape[:-1], dv))
    got = _run(lambda *qkv_: kernel(*qkv_, kv_mask, extra_blocks), *(x.astype(dtype) for x in (q, k, v)), w_out, w_lse)
    # The reference runs in float32 whatever the kernel's dtype.
    want = _run(lambda *qkv_: reference(*qkv_, kv_mask, extra_blocks), q, k, v, w_out, w_lse)
    assert got[0].dtype == dtype and got[0].shape == (*q.shape[:-1], dv)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (*got[:2], *got[2]), (*want[:2], *want[2]), strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        _close(a, b, tol, name)


def _sink_logits(heads, sinks):
    return jnp.linspace(-1.0, 1.5, heads) if sinks == "learned" else None


W = 40  # window half-width: several partial blocks per row at 64-wide tiles

CASES = {
    # Head size 128: q and k enter as [seq, heads * d] (no transpose), v as [heads, seq, d].
    "dense": dict(pattern=Band(), d=128),
    # Under vmap with static visit lists: Pallas adds a grid axis (tpu_interpret.py).
    "causal": dict(pattern=causal(256, 256), heads=1, kv_heads=1, sizes=MIXED, batch=2),
    "window": dict(pattern=Band(-W, W), heads=1, kv_heads=1, sizes=B64),
    # Cross attention of unequal, odd lengths too (a tail tile on both sides).
    "longformer": dict(pattern=union(Band(-W, W), KeyRange(0, 8), QueryRange(0, 8)), q_len=200, kv_len=136, sizes=B64),
    "dilated": dict(pattern=Band(-2 * W, 2 * W, step=2), heads=1, kv_heads=1, sizes=MIXED),
    "grouped_heads": dict(pattern=causal(256, 256), heads=4, kv_heads=2, d=32, dv=64, sizes=MIXED),
    # Padded keys (kv_mask), and rows that see no key at all: zeros, lse = +inf.
    "kv_mask": dict(pattern=Band(-W, W), kv_mask=jnp.arange(256) >= 100, sizes=MIXED),
    # 200 = one full tile and a tail: the kernels mask padded keys and drop padded queries.
    "odd_length": dict(pattern=causal(200, 200), q_len=200, heads=1, kv_heads=1),
    "bf16": dict(pattern=causal(256, 256), heads=1, kv_heads=1, dtype=jnp.bfloat16, tol=3e-2, sizes=MIXED),
    # ALiBi computed on each tile, with the queries the last 200 of 256 positions.
    # Packed sequences (segments of 70, cutting through tiles) in cross attention of odd
    # lengths, with padding: both tag layouts of the dk/dv kernel.
    "segment_ids": dict(
        pattern=Band(-W, W),
        q_len=200,
        kv_len=210,
        heads=2,
        kv_heads=1,
        sizes=MIXED,
        kv_mask=jnp.arange(210) < 205,
        segment_ids=(jnp.arange(200) // 70, jnp.arange(210) // 70),
    ),
    "alibi": dict(
        pattern=causal(200, 256),
        q_len=200,
        kv_len=256,
        heads=4,
        kv_heads=2,
        sizes=MIXED,
        kv_mask=jnp.arange(256) < 250,
        alibi=Alibi(jnp.array([0.5, 0.25, 0.1, 0.02]), 56),
    ),
    # Soft-capped logits with a zero sink, causal, two query heads on one kv head.
    "softcap_zero_sink": dict(pattern=causal(256, 256), heads=2, kv_heads=1, sizes=MIXED, softcap=1.0, sinks="zero"),
}


@pytest.mark.parametrize("name", CASES)
def test_tpu_kernel_matches_reference(name):
    _check(**CASES[name])


def test_tpu_kernel_alibi_slope_gradient():
    q, k, v = qkv(3, 200, heads=2, kv_heads=1, d=32, dv=32)
    w = jax.random.normal(jax.random.key(4), (200, 2, 32))

    def slope_grad(fn):
        return jax.jit(jax.grad(lambda s: jnp.sum(fn(s) * w)))(jnp.array([0.3, 0.05]))

    got = slope_grad(
        lambda s: block_sparse_attention(
            q, k, v, Band(-W, W), alibi=Alibi(s), block_sizes=B64, backend="tpu", interpret=True
        )
    )
    want = slope_grad(lambda s: block_sparse_reference(q, k, v, Band(-W, W), alibi=Alibi(s))[0])
    _close(got, want, 2e-5, "d_slopes")


def test_tpu_kernel_softcap_and_learned_sinks_with_their_gradient():
    """A window with padding (rows 0..59 see no key: zeros and lse = the sink's logit),
    an odd length, GQA, ALiBi under the cap, learned sinks: out, lse and the gradients of
    q, k, v against the reference, then those of the sink logits and the slopes."""
    kv_mask = jnp.arange(200) >= 100
    alibi = Alibi(jnp.array([0.5, 0.25, 0.1, 0.02]))
    kw = dict(kv_mask=kv_mask, alibi=alibi, softcap=1.0, sinks="learned")
    _check(Band(-W, W), q_len=200, heads=4, kv_heads=2, sizes=MIXED, **kw)
    q, k, v = qkv(5, 200, heads=4, kv_heads=2, d=32, dv=32)
    w = jax.random.normal(jax.random.key(6), (200, 4, 32))

    def grads(fn):
        loss = lambda slopes, sinks: jnp.sum(fn(slopes, sinks) * w)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(alibi.slopes, _sink_logits(4, "learned"))

    kw = dict(kv_mask=kv_mask, softcap=1.0, sinks="learned")
    got = grads(
        lambda a, s: block_sparse_attention(
            q, k, v, Band(-W, W), alibi=Alibi(a), sink_logits=s, block_sizes=MIXED, backend="tpu", interpret=True, **kw
        )
    )
    want = grads(lambda a, s: block_sparse_reference(q, k, v, Band(-W, W), alibi=Alibi(a), sink_logits=s, **kw)[0])
    _close(got[0], want[0], 2e-5, "d_slopes")
    _close(got[1], want[1], 2e-5, "d_sink_logits")
    assert float(jnp.abs(want[1]).min()) > 1e-3  # not trivially zero


def test_tpu_kernel_bigbird_extra_blocks_under_vmap():
    # Run-time FULL blocks (the visit lists are jax arrays, batched scalar-prefetch
    # arguments under vmap), one block size throughout; -1 is "none", and a repeat of a
    # static block must not be counted twice. The key masks differ per example too.
    extra = jnp.asarray([[[3, -1], [0, 1], [2, 2], [-1, -1]], [[1, 2], [3, -1], [0, 0], [1, 3]]], jnp.int32)
    kv_mask = jnp.stack([jnp.arange(256) < 200, jnp.arange(256) >= 30])
    _check(
        union(Band(-W, W), KeyRange(0, 8)),
        extra_blocks=extra,
        kv_mask=kv_mask,
        block_size=64,
        sizes=B64,
        heads=1,
        kv_heads=1,
        batch=2,
    )


def test_tpu_kernels_lower_to_mosaic(monkeypatch):
    """Pallas's TPU lowering (jaxpr -> Mosaic MLIR, the step before libtpu compiles),
    run on CPU: every block shape obeys the (8, 128) tiling rule and every primitive the
    kernels use has a Mosaic lowering rule. Lowering asks for the chip's parameters,
    which a CPU lacks: register a v5e's for the "cpu" device kind (private API)."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry") or not hasattr(tpu_info, "get_tpu_info_for_chip"):
        pytest.skip("this JAX has no TPU-info registry to stand in for a chip")
    v5e = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: v5e)
    q, k, v = qkv(0, 200, heads=4, kv_heads=2, d=128, dv=64, dtype=jnp.bfloat16)  # both head layouts
    pattern = union(Band(-W, W, step=2), KeyRange(0, 8), QueryRange(0, 8))

    def loss(q, k, v, kv_mask, extra_blocks, sizes, alibi=None, segment_ids=None, softcap=None, sinks=None):
        out = block_sparse_attention(
            q,
            k,
            v,
            pattern,
            kv_mask=kv_mask,
            extra_blocks=extra_blocks,
            block_sizes=sizes,
            backend="tpu",
            alibi=alibi,
            segment_ids=segment_ids,
            softcap=softcap,
            sinks="none" if sinks is None else "learned",
            sink_logits=sinks,
        )
        return jnp.sum(out.astype(jnp.float32))

    def lower(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    try:
        texts = [
            lower(
                lambda q, k, v: grad(q, k, v, jnp.arange(200) < 190, None, MIXED, Alibi(jnp.linspace(0.5, 0.1, 4))),
                q,
                k,
                v,
            ),
            lower(lambda q, k, v: grad(q, k, v, None, None, MIXED, segment_ids=(jnp.arange(200) // 70,) * 2), q, k, v),
            # Soft-cap and learned sinks (a third scalar-prefetch argument) with ALiBi.
            lower(
                lambda q, k, v: grad(
                    q, k, v, None, None, B64, Alibi(jnp.linspace(0.5, 0.1, 4)), softcap=30.0, sinks=jnp.zeros(4)
                ),
                q,
                k,
                v,
            ),
            # Batched, with per-example run-time blocks: vmap adds a grid axis and
            # batches the scalar-prefetch visit lists.
            lower(
                jax.vmap(lambda q, k, v, e: grad(q, k, v, None, e, B64)),
                *(jnp.stack([x, x]) for x in (q, k, v)),
                jnp.zeros((2, 4, 2), jnp.int32),
            ),
        ]
    finally:  # the stand-in chip must not outlive the test (get_tpu_info caches)
        getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)()
    for text in texts:
        for name in ("forward", "dq", "dkv"):
            assert f"block_sparse_flash_{name}_tpu" in text


def test_pallas_impl_picks_the_tpu_kernel_on_tpus(monkeypatch):
    monkeypatch.setattr(impl, "device_backend", lambda: "tpu")
    assert impl.choose_kernel("pallas") == KernelChoice("tpu")
    assert impl.choose_kernel("auto") is None  # untested on real TPUs: explicit only
