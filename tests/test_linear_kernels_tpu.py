"""The chunked linear-attention kernels' TPU variant (`linear_tpu`, Mosaic TPU), run in
TPU interpret mode on CPU, against a dense XLA reference: outputs, the final state and
the gradients of q, k, v and the log-gate, causal and not, without a gate, with a gate
per token and one per feature, grouped-query heads, an odd length (padded), bf16 and
fp16 against float32; that the kernels pass Pallas's TPU lowering; and that
`impl="pallas"` picks them on TPUs through the op.

Every case is one jit of the forward and backward kernels in interpret mode, so the
cases are few and small: N = 37 tokens in chunks of 16 (padded to 48, three chunks),
m = 12 and d_v = 10 (padded to 128 lanes).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import qkv

from jxformers import ops
from jxformers.kernels import impl as kernel_impl
from jxformers.kernels.linear import chunked_linear_attention
from jxformers.ops import kernelized
from jxformers.ops.kernelized import FEATURE_MAPS, performer_projection

N, CHUNK, M, DV = 37, 16, 12, 10


def _inputs(seed, heads, kv_heads, gate):
    """Features, values and log-gates (None, "scalar" [N, kv_heads] or "feature" [N, kv_heads, m])."""
    q, k, v = qkv(seed, N, heads=heads, kv_heads=kv_heads, d=M, dv=DV)
    phi = FEATURE_MAPS["elu"]
    key = jax.random.key(seed + 1)
    log_gate = {
        None: None,
        "scalar": jax.nn.log_sigmoid(jax.random.normal(key, (N, kv_heads)) + 1.0),
        # down to exp(-20) per token: split into query and key factors, a chunk's
        # decay would overflow float32
        "feature": jax.nn.log_sigmoid(6.0 * jax.random.normal(key, (N, kv_heads, M))),
    }[gate]
    return phi(q), phi(k), v, log_gate


def _reference(fq, fk, v, log_gate, causal):
    """Dense, in float32: w_ij = sum_f q_if k_jf exp(sum_{j<t<=i} log_gate_tf) over j <= i
    (causal) or all j; out = w v / sum_j w; the state after the last token. The log-decays
    are summed over (j, i] directly (differences of global cumulative sums would cost
    the reference float32's precision, not the kernel)."""
    fq, fk, v = (x.astype(jnp.float32) for x in (fq, fk, v))
    n, kv_heads, m = fk.shape
    group = fq.shape[1] // kv_heads
    lg = (
        jnp.zeros(fk.shape)
        if log_gate is None
        else jnp.broadcast_to(log_gate if log_gate.ndim == 3 else log_gate[:, :, None], fk.shape)
    )
    t = jnp.arange(n)
    between = ((t[None, :, None] < t[None, None, :]) & (t[None, None, :] <= t[:, None, None])).astype(jnp.float32)
    decay = jnp.exp(jnp.einsum("ijt,thm->ijhm", between, lg))
    if causal:
        decay = jnp.where((t[:, None] >= t[None, :])[:, :, None, None], decay, 0.0)
    w = jnp.einsum("ihgm,jhm,ijhm->ihgj", fq.reshape(n, kv_heads, group, m), fk, decay)
    out = (jnp.einsum("ihgj,jhd->ihgd", w, v) / w.sum(-1)[..., None]).reshape(n, -1, v.shape[-1])
    tail = fk * decay[-1] if causal else fk  # each key's weight in the final state
    return out, jnp.einsum("jhm,jhd->hmd", tail, v), tail.sum(0)


def _close(got, want, what, atol=1e-5, rtol=1e-5):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert bool(jnp.all(jnp.isfinite(got))), f"{what}: not finite"
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol, rtol=rtol, err_msg=what
    )


def _kernel(fq, fk, v, log_gate, causal):
    out, (s, z) = chunked_linear_attention(
        fq, fk, v, causal=causal, log_gate=log_gate, chunk_size=CHUNK, return_state=True, backend="tpu", interpret=True
    )
    return out, s, z


def _with_grads(fn, args, causal, seed, batch=False):
    """(out, S, z) and the gradients w.r.t. q, k, v (and the log-gate) of a random
    projection of all three, in one jit; `batch`: the inputs carry a leading batch
    axis and `fn` runs under `jax.vmap` (as the models run the ops)."""
    lead = args[0].shape[:1] if batch else ()
    heads, kv_heads = args[0].shape[-2], args[1].shape[-2]
    kc, ks, kz = jax.random.split(jax.random.key(seed + 7), 3)
    cot, cot_s, cot_z = (
        jax.random.normal(kc, (*lead, N, heads, DV)),
        jax.random.normal(ks, (*lead, kv_heads, M, DV)),
        jax.random.normal(kz, (*lead, kv_heads, M)),
    )
    call = functools.partial(fn, causal=causal)
    if batch:
        call = jax.vmap(call)

    def loss(*args):
        out, s, z = call(*args)
        return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(s * cot_s) + jnp.sum(z * cot_z), (out, s, z)

    argnums = (0, 1, 2) if args[3] is None else (0, 1, 2, 3)
    grads, results = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(*args)
    return results, grads


CASES = {
    # heads 4 over 2 kv heads (grouped-query): every kernel's h // group index maps.
    "causal": dict(causal=True, gate=None, heads=4, kv_heads=2),
    "noncausal": dict(causal=False, gate=None, heads=4, kv_heads=2),
    # Under vmap (a batch of 2): Pallas adds a grid axis (see linear_tpu._call).
    "scalar_gate_vmap": dict(causal=True, gate="scalar", heads=2, kv_heads=1, batch=True),
    "feature_gate": dict(causal=True, gate="feature", heads=2, kv_heads=1),
}


@pytest.mark.parametrize("name", CASES)
def test_tpu_kernel_matches_the_dense_reference(name):
    case = CASES[name]
    batch = case.get("batch", False)
    args = _inputs(0, case["heads"], case["kv_heads"], case["gate"])
    if batch:
        args = tuple(
            jnp.stack(xs) for xs in zip(args, _inputs(1, case["heads"], case["kv_heads"], case["gate"]), strict=True)
        )
    (got, g_got), (want, g_want) = (_with_grads(fn, args, case["causal"], 0, batch) for fn in (_kernel, _reference))
    for what, a, b in zip(("out", "S", "z"), got, want, strict=True):
        _close(a, b, what)
    for what, a, b in zip(("dq", "dk", "dv", "dlog_gate"), g_got, g_want, strict=False):
        _close(a, b, what, atol=2e-5, rtol=1e-4)


def test_tpu_kernel_bf16_and_fp16_against_float32():
    # bf16: bf16 tiles and products of float32 intermediates in bf16, float32 states;
    # fp16 is computed in float32 on TPUs (the result cast back). Gated, grouped heads.
    fq, fk, v, log_gate = _inputs(3, 2, 1, "scalar")
    want, g_want = _with_grads(_reference, (fq, fk, v, log_gate), True, 3)
    low = tuple(x.astype(jnp.bfloat16) for x in (fq, fk, v))
    got, g_got = _with_grads(_kernel, (*low, log_gate), True, 3)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    for what, a, b in zip(
        ("out", "S", "z", "dq", "dk", "dv", "dlog_gate"), (*got, *g_got), (*want, *g_want), strict=True
    ):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a)), what
        err, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
        assert err <= 3e-2 * scale + 1e-2, f"{what}: max error {err:.3g} against max |want| {scale:.3g}"
    half = jax.jit(lambda *x: _kernel(*x, True)[0])(*(x.astype(jnp.float16) for x in (fq, fk, v)), log_gate)
    assert half.dtype == jnp.float16
    _close(half, want[0], "fp16 out", atol=3e-3, rtol=3e-3)


def test_tpu_kernels_lower_to_mosaic(monkeypatch):
    """Pallas's TPU lowering (jaxpr -> Mosaic MLIR, the step before libtpu compiles),
    run on CPU for the forward and backward kernels: every block shape obeys the
    (8, 128) tiling rule and every primitive has a Mosaic lowering rule. Lowering asks
    for the chip's parameters, which a CPU lacks: register a v5e's for the "cpu" device
    kind (private API; as tests/test_kernels_tpu.py)."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not hasattr(tpu_info, "registry") or not hasattr(tpu_info, "get_tpu_info_for_chip"):
        pytest.skip("this JAX has no TPU-info registry to stand in for a chip")
    v5e = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    monkeypatch.setitem(tpu_info.registry, "cpu", lambda: v5e)
    n, m = 256, 64  # m padded to 128; chunks of 128 (the MXU's) and 64
    fq, fk, v = (jnp.ones((n, h, m), jnp.bfloat16) for h in (4, 2, 2))
    # The last call runs under vmap: Pallas adds a grid axis for the batch.
    calls = (
        (True, jnp.zeros((n, 2)), 128, False),
        (True, jnp.zeros((n, 2, m)), 64, False),
        (True, None, 64, False),
        (False, None, 128, False),
        (True, jnp.zeros((n, 2)), 64, True),
    )

    def lowered(causal, log_gate, chunk, batch):
        def loss(fq, fk, v, log_gate):
            out = chunked_linear_attention(fq, fk, v, causal=causal, log_gate=log_gate, chunk_size=chunk, backend="tpu")
            return jnp.sum(out.astype(jnp.float32))

        args = (fq, fk, v, log_gate)
        if batch:
            loss, args = jax.vmap(loss), tuple(jnp.stack([x, x]) for x in args)
        grad = jax.grad(lambda *a: jnp.sum(loss(*a)), argnums=(0, 1, 2))
        return jax.jit(grad).trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    try:
        texts = [lowered(*call) for call in calls]
    finally:  # the stand-in chip must not outlive the test (get_tpu_info caches)
        getattr(tpu_info.get_tpu_info, "cache_clear", lambda: None)()
    for (causal, log_gate, _, _), text in zip(calls, texts, strict=True):
        for name in ("states", "output", "dstates", "grads"):
            assert f"linear_attention_{name}_tpu" in text, (name, causal, None if log_gate is None else log_gate.shape)


def test_pallas_impl_picks_the_tpu_kernel_on_tpus(monkeypatch):
    # On a (monkeypatched) TPU, impl="pallas" sends the op to the TPU kernel (run here in
    # interpret mode, through the op's own padding mask and gate), "auto" keeps XLA.
    monkeypatch.setattr(kernel_impl, "device_backend", lambda: "tpu")
    calls = []
    real = kernelized.chunked_linear_attention

    def spy(*args, **kwargs):
        calls.append(dict(kwargs))
        return real(*args, **{**kwargs, "interpret": True})

    monkeypatch.setattr(kernelized, "chunked_linear_attention", spy)
    q, k, v = qkv(5, N, heads=2, kv_heads=1, d=16, dv=16)
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(6), (N, 1)) + 1.0)
    kv_mask = jnp.arange(N) < N - 4

    def op(impl):
        return ops.rfa_attention(
            q,
            k,
            v,
            performer_projection(jax.random.key(7), 8, 16),
            gate=gate,
            causal=True,
            kv_mask=kv_mask,
            chunk_size=CHUNK,
            impl=impl,
        )

    got = op("pallas")
    assert [(c["backend"], c["interpret"]) for c in calls] == [("tpu", False)]
    op("auto")
    assert len(calls) == 1  # untested on real TPUs: explicit only
    _close(got, op("xla"), "out", atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"backend must be one of \['gpu', 'tpu'\] .*; got backend='mosaic'"):
        chunked_linear_attention(q, k, v, backend="mosaic")
