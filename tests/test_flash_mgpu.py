"""The Mosaic GPU forward of the block-sparse flash kernel (`kernels/flash_mgpu.py`,
`backend="mosaic_gpu"`) in JAX's GPU interpret mode on CPU, against the dense reference:
out and log-sum-exp for dense, causal, a sliding window with a kv_mask, an odd length
and rows that see no key, a window united with global keys, soft-capping and learned
sinks (with their gradient), grouped-query heads, bf16
and fp16, one and two consumer warpgroups, visit lists longer than the K/V ring, vmap;
gradients through it (its out and lse feed the Triton backward); and the compiled
kernel lowered for CUDA (Mosaic GPU's layout checks) without a GPU.

Interpret mode simulates each warpgroup as a thread and compiles its program per grid
point (about a second each here), so each case uses the fewest grid points that cover
it. It checks the TMA copies, the barriers (a phase nobody waits for is an error) and
the math; not swizzles, register pressure or timing (see flash_mgpu's docstring).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, jitted, qkv

from jxformers.kernels import (
    Band,
    BlockSizes,
    KeyRange,
    block_sparse_attention,
    block_sparse_reference,
    causal,
    flash_mgpu,
    union,
)
from jxformers.ops.local import local_pattern

if flash_mgpu.interpret_params() is None:
    pytest.skip(
        f"jax {jax.__version__} has no Mosaic GPU interpret mode (jax._src.pallas.mosaic_gpu.interpret)",
        allow_module_level=True,
    )


@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    # A kernel that raised leaves the simulated GPU's state behind; the next one would fail.
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()


def _run(pattern, q, k, v, block_q, **kw):
    return block_sparse_attention(
        q,
        k,
        v,
        pattern,
        backend="mosaic_gpu",
        interpret=True,
        return_lse=True,
        block_sizes=BlockSizes(block_q, 64, num_stages=2),
        **kw,
    )


def _check(pattern, q, k, v, block_q, kv_mask=None):
    out, lse = jitted(_run)(pattern, q, k, v, block_q, kv_mask=kv_mask)
    want_out, want_lse = jitted(block_sparse_reference)(q, k, v, pattern, kv_mask=kv_mask)
    assert out.dtype == q.dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
    # 16-bit outputs: one rounding of values of size ~1 (the statistics are float32).
    assert_close(out, want_out, atol=2e-2, rtol=2e-2)
    assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    return lse


def test_dense_grouped_heads_two_consumers():
    # 2 query heads on 1 kv head; a 128-row block (two consumer warpgroups taking turns);
    # 120 keys: the second key block is cut at the length.
    q, k, v = qkv(0, 120, heads=2, kv_heads=1, d=64, dv=64, dtype=jnp.float16)
    _check(Band(), q, k, v, 128)


def test_causal_full_then_partial_with_gradients():
    # One consumer (64-row blocks); the second query block visits a FULL block, then its
    # diagonal (PARTIAL, the rule on the tile). Gradients: the Triton backward on this
    # forward's out and lse.
    n = 128
    q, k, v = qkv(1, n, heads=1, kv_heads=1, d=64, dv=64, dtype=jnp.bfloat16)
    pattern = causal(n, n)
    w = jax.random.normal(jax.random.key(9), (n, 1, 64), jnp.bfloat16)

    @jax.jit  # compiled whole: op by op, every primitive of the interpreted kernel compiles on its own
    def outputs_and_gradients(q, k, v, w):
        (out, lse), vjp = jax.vjp(lambda *x: _run(pattern, *x, 64), q, k, v)  # one forward for both checks
        got = vjp((w, jnp.zeros_like(lse)))
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        (want_out, want_lse), want_vjp = jax.vjp(lambda *x: block_sparse_reference(*x, pattern), *f32)
        want = want_vjp((w.astype(jnp.float32), jnp.zeros_like(want_lse)))
        return out, lse, got, want_out, want_lse, want

    out, lse, got, want_out, want_lse, want = outputs_and_gradients(q, k, v, w)
    assert_close(out, want_out, atol=2e-2, rtol=2e-2)
    assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    for g, h in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        assert_close(g, h, atol=5e-2, rtol=5e-2)


def test_window_with_kv_mask_odd_length_empty_rows():
    # A sliding window (the rule on every tile of the band), 199 positions, key tags with
    # holes and no key past 150: rows from 191 on see no key (zeros, lse = +inf). The
    # first query block visits 3 key blocks: the 2-slot ring wraps.
    n = 199
    q, k, v = qkv(2, n, heads=1, kv_heads=1, d=64, dv=64, dtype=jnp.bfloat16)
    kv_mask = (jnp.arange(n) % 7 != 3) & (jnp.arange(n) < 150)
    lse = np.asarray(_check(local_pattern(40, causal=False, q_len=n, kv_len=n), q, k, v, 128, kv_mask=kv_mask))
    assert np.isinf(lse[:, 0][191:]).all() and np.isfinite(lse[:, 0][:190]).all()


def test_window_and_global_keys_under_vmap():
    # Longformer's union: a window and global keys 0-7 (key block 0 visited by every
    # row, PARTIAL); d = 32, padded to 64 inside; a batch of 2 through jax.vmap (how the
    # ops batch), which adds a grid axis to the kernel.
    n = 128
    pattern = union(Band(-24, 24), KeyRange(0, 8))
    q, k, v = (
        jnp.stack(x)
        for x in zip(*(qkv(s, n, heads=1, kv_heads=1, d=32, dv=32, dtype=jnp.bfloat16) for s in (3, 4)), strict=True)
    )
    out, lse = jax.jit(jax.vmap(lambda *x: _run(pattern, *x, 128)))(q, k, v)
    want_out, want_lse = jax.jit(jax.vmap(lambda *x: block_sparse_reference(*x, pattern)))(q, k, v)
    assert_close(out, want_out, atol=2e-2, rtol=2e-2)
    assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_refuses_what_it_does_not_take():
    q, k, v = qkv(0, 64, heads=1, kv_heads=1, d=64, dv=64)
    with pytest.raises(ValueError, match="float32"):
        _run(Band(), q, k, v, 64)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with pytest.raises(ValueError, match="block_q 64 .* got 32"):
        block_sparse_attention(*bf, Band(), backend="mosaic_gpu", interpret=True, block_sizes=BlockSizes(32, 64))


@pytest.mark.parametrize("dtype,d,block_q,masked", [(jnp.bfloat16, 128, 128, False), (jnp.float16, 64, 64, True)])
def test_compiled_kernel_lowers_for_hopper(dtype, d, block_q, masked):  # the masked case with softcap and sinks
    # Interpret mode runs neither layouts nor P fed to wgmma from registers: lowering the
    # compiled kernel for CUDA on this CPU runs Mosaic GPU's layout inference and checks
    # on that path (a wrong broadcast layout fails here), short of ptxas and the GPU.
    n = 512
    q = jax.ShapeDtypeStruct((n, 2, d), dtype)
    k = jax.ShapeDtypeStruct((n, 1, d), dtype)
    pattern = union(Band(-100, 100), KeyRange(0, 8))  # FULL and PARTIAL blocks

    def attend(q, k, v, kv_mask):
        return block_sparse_attention(
            q,
            k,
            v,
            pattern,
            kv_mask=kv_mask,
            backend="mosaic_gpu",
            return_lse=True,
            block_sizes=BlockSizes(block_q, 64),
            softcap=30.0 if masked else None,
            sinks="learned" if masked else "none",
            sink_logits=jnp.zeros(2) if masked else None,
        )

    mask = jax.ShapeDtypeStruct((n,), jnp.bool_) if masked else None
    lowered = jax.jit(attend).trace(q, k, k, mask).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_softcap_and_learned_sinks_with_gradients():
    # Soft-capped logits and a learned sink per query head (GQA: 2 on 1 kv head), a
    # window with padding (rows from 110 on see no key: zeros, lse = the sink's logit);
    # the gradients of q, k, v and the sink logits through the Triton backward.
    n = 128
    q, k, v = qkv(5, n, heads=2, kv_heads=1, d=64, dv=64, dtype=jnp.bfloat16)
    pattern = Band(-20, 20)
    kw = dict(kv_mask=jnp.arange(n) < 90, softcap=2.0, sinks="learned")
    w = jax.random.normal(jax.random.key(9), (n, 2, 64), jnp.bfloat16)

    @jax.jit
    def outputs_and_gradients(q, k, v, sinks, w):
        (out, lse), vjp = jax.vjp(lambda *x: _run(pattern, *x[:3], 64, sink_logits=x[3], **kw), q, k, v, sinks)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref = lambda *x: block_sparse_reference(*x[:3], pattern, sink_logits=x[3], **kw)  # noqa: E731
        (want_out, want_lse), want_vjp = jax.vjp(ref, *f32, sinks)
        got = vjp((w, jnp.zeros_like(lse)))
        want = want_vjp((w.astype(jnp.float32), jnp.zeros_like(want_lse)))
        return out, lse, got, want_out, want_lse, want

    out, lse, got, want_out, want_lse, want = outputs_and_gradients(q, k, v, jnp.array([1.0, -0.5]), w)
    assert_close(out, want_out, atol=2e-2, rtol=2e-2)
    assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    assert not jnp.any(out[110:]) and np.isfinite(np.asarray(lse)).all()
    for g, h in zip(got, want, strict=True):
        assert_close(g, h, atol=5e-2, rtol=5e-2)
