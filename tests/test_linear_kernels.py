"""The chunked linear-attention kernels (jxformers/kernels/linear*.py) in Pallas
interpret mode against the XLA forms of `kernel_attention` (quadratic, scan, chunked):
outputs and gradients, causal and not, every feature map, gate on and off (per token, and
per feature against a dense reference), padding, odd lengths, grouped-query heads, bf16,
the state walks split over d_v blocks (`block_v`, against the reference and unsplit); the
recurrent decoder's state; bf16 stability at
64K tokens against float64. Shapes are small and shared so that few kernels compile."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, cuda_target, qkv

import jxformers.ops
from jxformers import registry
from jxformers.decoding import RecurrentState
from jxformers.kernels import impl as kernel_impl
from jxformers.kernels import linear as linear_kernels
from jxformers.kernels.linear import chunked_linear_attention
from jxformers.ops import kernelized
from jxformers.ops.kernelized import FEATURE_MAPS, kernel_attention, performer_projection

eager_ops = jxformers.ops  # where a test watches what happens at call time
ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

N, CHUNK = 37, 16  # odd: the kernels pad to 48 (three chunks)


def _features(seed, n=N, heads=4, kv_heads=2, m=12, dv=10):
    q, k, v = qkv(seed, n, heads=heads, kv_heads=kv_heads, d=m, dv=dv)
    fq, fk = FEATURE_MAPS["elu"](q), FEATURE_MAPS["elu"](k)
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(seed + 1), (n, kv_heads)) + 1.0)
    return fq, fk, v, gate


@pytest.mark.parametrize(
    "causal,gated,block_v",
    [(True, False, None), (True, True, None), (False, False, None), (True, True, 16), (False, False, 16)],
)
def test_kernel_equals_the_quadratic_form_with_gradients_and_final_state(causal, gated, block_v):
    # Odd length, feature and value sizes not powers of two (padded), grouped heads;
    # the final state (the decoder's) and its gradient, the log-gate's gradient. With
    # block_v, d_v = 40 (padded to 64) walks in four blocks of 16 columns (the last all
    # padding): against the reference and the unsplit kernel.
    dv = 10 if block_v is None else 40
    fq, fk, v, gate = _features(0, dv=dv)
    log_gate = jnp.log(gate) if gated else None
    cot = jax.random.normal(jax.random.key(9), (N, 4, dv))
    cot_s = jax.random.normal(jax.random.key(10), (2, 12, dv))

    def ref(fq, fk, v, lg):
        out = kernel_attention(fq, fk, v, causal=causal, form="quadratic", gate=None if lg is None else jnp.exp(lg))
        decay = jnp.ones((N, 2)) if lg is None else jnp.exp(jnp.cumsum(lg[::-1], axis=0)[::-1] - lg)  # to the end
        s = jnp.einsum("nhm,nhd,nh->hmd", fk, v, decay)
        return out, s, jnp.einsum("nhm,nh->hm", fk, decay)

    def ker(fq, fk, v, lg, block_v=block_v):
        out, (s, z) = chunked_linear_attention(
            fq, fk, v, causal=causal, log_gate=lg, chunk_size=CHUNK, interpret=True, return_state=True, block_v=block_v
        )
        return out, s, z

    def loss(fn):
        def value(fq, fk, v, lg):
            out, s, z = fn(fq, fk, v, lg)
            return jnp.sum(out * cot) + jnp.sum(s * cot_s) + jnp.sum(z), (out, s, z)

        return jax.jit(jax.grad(value, argnums=(0, 1, 2, 3) if gated else (0, 1, 2), has_aux=True))

    (g_ref, o_ref), (g_ker, o_ker) = loss(ref)(fq, fk, v, log_gate), loss(ker)(fq, fk, v, log_gate)
    for a, b in zip(o_ker, o_ref, strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_ker, g_ref, strict=True):
        assert_close(a, b, atol=2e-5, rtol=1e-4)
    if block_v is not None:  # the same float32 sums per column as the unsplit walk
        g_one, o_one = loss(functools.partial(ker, block_v=None))(fq, fk, v, log_gate)
        for a, b in zip((*o_ker, *g_ker), (*o_one, *g_one), strict=True):
            assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_the_forward_saves_no_chunk_states(capsys):
    # The backward recomputes the per-chunk states ([kv_heads, chunks * m, d_v], here
    # twice the size of q): the forward saves q, k, v, the gates, the output, the
    # denominators and the final state only.
    import jax.ad_checkpoint

    n, m = 512, 32
    fq, fk, v = (jnp.ones((n, 2, m)) for _ in range(3))
    jax.ad_checkpoint.print_saved_residuals(
        lambda fq, fk, v, lg: chunked_linear_attention(fq, fk, v, log_gate=lg, chunk_size=16, interpret=True),
        fq,
        fk,
        v,
        jnp.zeros((n, 2)),
    )
    shapes = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    sizes = [int(np.prod([int(x) for x in shape[shape.index("[") + 1 : -1].split(",")])) for shape in shapes]
    assert len(sizes) == 8 and max(sizes) == n * 2 * m, shapes


@pytest.mark.parametrize("block_v", [None, 16])
def test_per_feature_gates_equal_a_dense_reference_without_overflow(block_v):
    # Gated linear attention's decay per feature, S_i = diag(g_i) S_{i-1} + phi(k_i) v_i^T:
    # against the N x N x m reference, with gates down to exp(-30) per token (a chunk's
    # decay far beyond float32's range when split into query and key factors); with
    # block_v, d_v = 40 walks in blocks of 16 columns.
    dv = 10 if block_v is None else 40
    fq, fk, v, _ = _features(20, dv=dv)
    log_gate = jax.nn.log_sigmoid(8.0 * jax.random.normal(jax.random.key(21), fk.shape))
    assert float(log_gate.min()) < -20
    cot = jax.random.normal(jax.random.key(22), (N, 4, dv))
    cot_s = jax.random.normal(jax.random.key(23), (2, 12, dv))

    # Log-decays summed over (j, i] directly: differences of global cumulative sums
    # (down to -170 here) would cost the reference float32's precision, not the kernel.
    i, j, t = (
        jnp.arange(N)[idx] for idx in ((slice(None), None, None), (None, slice(None), None), (None, None, slice(None)))
    )
    between = ((j < t) & (t <= i)).astype(jnp.float32)  # [i, j, t]

    def ref(fq, fk, v, lg):
        log_decay = jnp.einsum("ijt,thm->ijhm", between, lg)
        decay = jnp.where((j[..., 0] <= i[..., 0])[:, :, None, None], jnp.exp(log_decay), 0.0)
        w = jnp.einsum("ihgm,jhm,ijhm->ihgj", fq.reshape(N, 2, 2, 12), fk, decay)
        out = (jnp.einsum("ihgj,jhd->ihgd", w, v) / w.sum(-1)[..., None]).reshape(N, 4, dv)
        tail = fk * jnp.exp(log_decay[-1])
        return out, jnp.einsum("jhm,jhd->hmd", tail, v), tail.sum(0)

    def ker(fq, fk, v, lg):
        out, (s, z) = chunked_linear_attention(
            fq, fk, v, log_gate=lg, chunk_size=CHUNK, interpret=True, return_state=True, block_v=block_v
        )
        return out, s, z

    def grads(fn):
        def value(*args):
            out, s, z = fn(*args)
            return jnp.sum(out * cot) + jnp.sum(s * cot_s) + jnp.sum(z), (out, s, z)

        return jax.jit(jax.grad(value, argnums=(0, 1, 2, 3), has_aux=True))

    (g_ref, o_ref), (g_ker, o_ker) = grads(ref)(fq, fk, v, log_gate), grads(ker)(fq, fk, v, log_gate)
    for a, b in zip(o_ker, o_ref, strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_ker, g_ref, strict=True):
        assert bool(jnp.all(jnp.isfinite(a)))
        assert_close(a, b, atol=2e-5, rtol=1e-4)


@functools.partial(jax.jit, static_argnames=("name", "causal", "impl", "form"))  # interpret mode runs fast compiled
def _op(name, q, k, v, *, causal, impl, form="chunked", kv_mask=None, gate=None):
    proj = performer_projection(jax.random.key(5), 16, q.shape[2])
    if name in ("elu", "relu", "identity"):
        return ops.linear_attention(
            q, k, v, feature_map=name, causal=causal, kv_mask=kv_mask, form=form, chunk_size=CHUNK, impl=impl
        )
    if name.startswith("performer"):
        return ops.performer_attention(
            q,
            k,
            v,
            proj,
            kernel=name.split()[1],
            causal=causal,
            kv_mask=kv_mask,
            form=form,
            chunk_size=CHUNK,
            impl=impl,
        )
    return ops.rfa_attention(
        q, k, v, proj[:8], gate=gate, causal=causal, kv_mask=kv_mask, form=form, chunk_size=CHUNK, impl=impl
    )


MAPS = ("elu", "relu", "identity", "performer softmax", "performer relu", "rfa gated")


@pytest.mark.parametrize("name", MAPS)
def test_ops_through_the_kernel_equal_their_xla_forms(name):
    # Every feature map (Performer's stabiliser becomes a log-gate at chunk starts,
    # RFA's gate a log-gate), padded keys, causal (against the three XLA forms for two
    # maps: test_ops shows the forms agree; gradients for three), and non-causal.
    q, k, v = qkv(3, N, heads=4, kv_heads=2, d=16, dv=16)
    if name == "identity":  # keep the signed features' denominators away from zero
        q, k = jnp.abs(q) + 0.1, jnp.abs(k) + 0.1
    kv_mask = jnp.arange(N) < N - 5
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(4), (N, 2)) + 1.0) if name == "rfa gated" else None
    cot = jax.random.normal(jax.random.key(6), v.shape[:1] + (4, 16))

    def loss(impl, form):
        return lambda q, k, v: jnp.sum(
            _op(name, q, k, v, causal=True, impl=impl, form=form, kv_mask=kv_mask, gate=gate) * cot
        )

    tol = dict(atol=1e-4, rtol=1e-4) if name == "rfa gated" else dict(atol=2e-5, rtol=2e-5)  # RFA's small normalisers
    forms = ("quadratic", "scan", "chunked") if name in ("elu", "rfa gated") else ("chunked",)  # the forms agree
    with_grads = name in (
        "elu",
        "performer softmax",
        "rfa gated",
    )  # the other maps differ only in XLA-differentiated features

    @jax.jit  # every value the test compares, in one compiled program
    def run(q, k, v):
        got = _op(name, q, k, v, causal=True, impl="interpret", kv_mask=kv_mask, gate=gate)
        want = [_op(name, q, k, v, causal=True, impl="xla", form=form, kv_mask=kv_mask, gate=gate) for form in forms]
        impls = ("interpret", "xla")
        grads = [jax.grad(loss(impl, "chunked"), argnums=(0, 1, 2))(q, k, v) for impl in impls] if with_grads else None
        noncausal = [_op(name, q, k, v, causal=False, impl=impl, kv_mask=kv_mask) for impl in impls]
        return got, want, grads, noncausal

    got, want, grads, noncausal = run(q, k, v)
    for w in want:
        assert_close(got, w, **tol)
    if grads is not None:
        for a, b in zip(*grads, strict=True):
            assert_close(a, b, **tol)
    assert_close(*noncausal, **tol)


def test_bf16_and_fp16_inputs_through_the_kernel():
    name = "rfa gated"  # features, a gate and bf16 products at once
    q, k, v = qkv(7, 64, heads=2, kv_heads=2, d=16, dv=16, dtype=jnp.bfloat16)
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(8), (64, 2)) + 2.0) if name == "rfa gated" else None
    got = _op(name, q, k, v, causal=True, impl="interpret", gate=gate)
    assert got.dtype == jnp.bfloat16
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    want = _op(name, q32, k32, v32, causal=True, impl="xla", form="quadratic", gate=gate)
    assert_close(got, want, atol=3e-2, rtol=3e-2)

    def loss(impl):
        return lambda q, k, v: jnp.sum(_op(name, q, k, v, causal=True, impl=impl, gate=gate).astype(jnp.float32))

    g_ker = jax.jit(jax.grad(loss("interpret"), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(loss("xla"), argnums=(0, 1, 2))(q32, k32, v32)
    for a, b in zip(g_ker, g_ref, strict=True):
        assert a.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(a)))
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) <= 5e-2 * float(jnp.max(jnp.abs(b))) + 1e-2
    half = _op(name, *(x.astype(jnp.float16) for x in (q, k, v)), causal=True, impl="interpret", gate=gate)
    assert half.dtype == jnp.float16
    assert_close(half, want, atol=3e-2, rtol=3e-2)


def _decode(name, q, k, v, arrays, state=None):
    spec = registry.get(name)
    hp = spec.bind().hyper_parameters
    decoder = spec.decoder
    if state is None:
        state = decoder.init(
            hyper_parameters=hp,
            arrays=arrays,
            max_len=q.shape[0],
            kv_heads=k.shape[1],
            d_k=k.shape[2],
            d_v=v.shape[2],
            dtype=None,
        )

    def step(state, xs):
        out, state = decoder.step(*xs, state, hyper_parameters=hp, arrays=arrays, bias_fn=None)
        return state, out

    state, out = jax.lax.scan(step, state, (q, k, v))
    return out, state


def test_a_kernel_forward_decodes_with_the_recurrent_decoder():
    # Parity: the kernel's causal forward equals decoding token by token (linear and
    # Performer), and the kernel's final state is the decoder's state (prefill with the
    # kernel, then decode the rest).
    q, k, v = qkv(11, N, heads=4, kv_heads=2, d=16, dv=16)
    proj = performer_projection(jax.random.key(5), 16, 16)
    got = ops.performer_attention(q, k, v, proj, causal=True, chunk_size=CHUNK, impl="interpret")
    assert_close(got, _decode("performer", q, k, v, {"projection": proj})[0], atol=2e-5, rtol=1e-4)
    parallel = ops.linear_attention(q, k, v, causal=True, chunk_size=CHUNK, impl="interpret")
    decoded, state = _decode("linear", q, k, v, {})
    assert_close(parallel, decoded, atol=2e-5, rtol=1e-4)
    split = 21
    phi = FEATURE_MAPS["elu"]
    _, (s, z) = chunked_linear_attention(
        phi(q[:split]), phi(k[:split]), v[:split], causal=True, chunk_size=CHUNK, interpret=True, return_state=True
    )
    prefilled = RecurrentState(s, z, jnp.full((2,), -1e30), jnp.asarray(split, jnp.int32))
    rest, end = _decode("linear", q[split:], k[split:], v[split:], {}, state=prefilled)
    assert_close(rest, parallel[split:], atol=2e-5, rtol=1e-4)
    assert_close(end.s, state.s, atol=1e-4, rtol=1e-5)
    assert_close(end.z, state.z, atol=1e-4, rtol=1e-5)


def _float64_reference(fq, fk, v, gate, chunk=128):
    """Causal (gated) linear attention in float64, chunk by chunk (numpy)."""
    fq, fk, v = (np.asarray(x, np.float64)[:, 0] for x in (fq, fk, v))
    log_g = np.zeros(len(fq)) if gate is None else np.log(np.asarray(gate, np.float64)[:, 0])
    s, z, out = np.zeros((fq.shape[1], v.shape[1])), np.zeros(fq.shape[1]), []
    for start in range(0, len(fq), chunk):
        q_c, k_c, v_c, lg = (x[start : start + chunk] for x in (fq, fk, v, log_g))
        c = np.cumsum(lg)
        decay = np.tril(
            np.exp(np.minimum(c[:, None] - c[None, :], 0.0)) if gate is not None else np.ones((len(c),) * 2)
        )
        a = (q_c @ k_c.T) * decay
        qd = q_c * np.exp(c)[:, None]
        out.append((a @ v_c + qd @ s) / (a.sum(1) + qd @ z)[:, None])
        kd = k_c * np.exp(c[-1] - c)[:, None]
        s, z = s * np.exp(c[-1]) + kd.T @ v_c, z * np.exp(c[-1]) + kd.sum(0)
    return np.concatenate(out)


@pytest.mark.parametrize("gated", [False, True])
def test_bf16_stability_at_64k_tokens_against_float64(gated):
    # The XLA chunked form at 64K bf16 tokens (the kernel keeps the same float32 states:
    # checked at 4K): no NaN/Inf, and the error against float64 of the same bf16 inputs
    # is bf16's rounding of the output (half an ulp, 2^-8 relative) and little more.
    n = 65536
    q, k, v = qkv(13, n, heads=1, kv_heads=1, d=16, dv=16, dtype=jnp.bfloat16)
    v = v + 1.0  # a mean the prefix averages converge to
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(14), (n, 1)) + 4.0) if gated else None
    phi = FEATURE_MAPS["elu"]
    fq, fk = phi(q), phi(k)
    lengths = [(n, "xla", 256), (4096, "interpret", 64)]
    for length, impl, chunk in lengths:
        g = None if gate is None else gate[:length]
        out = jax.jit(
            lambda fq, fk, v, g: kernel_attention(
                fq,
                fk,
                v,
                causal=True,
                gate=g,
                chunk_size=chunk,  # noqa: B023 - called within this iteration
                impl=impl,  # noqa: B023
            )
        )(fq[:length], fk[:length], v[:length], g)
        assert out.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(out))), impl
        want = _float64_reference(fq[:length], fk[:length], v[:length], g)
        err = np.abs(np.asarray(out[:, 0], np.float64) - want)
        excess = err - (2.0**-8 * np.abs(want) + 1e-3 * np.abs(want).max())
        assert excess.max() <= 0, (impl, err.max())


def test_kernel_choices_and_errors(monkeypatch):
    q, k, v = qkv(1, 20, d=16, dv=16)
    with pytest.raises(ValueError, match="impl='pallas' has no kernel for the 'cpu' backend"):
        eager_ops.linear_attention(q, k, v, causal=True, impl="pallas")
    with pytest.raises(ValueError, match="form='scan'"):
        eager_ops.linear_attention(q, k, v, causal=True, form="scan", impl="interpret")
    with pytest.raises(ValueError, match="chunk_size=8"):
        eager_ops.rfa_attention(q, k, v, jnp.ones((4, 16)), causal=True, chunk_size=8, impl="interpret")
    with pytest.raises(ValueError, match="impl must be one of"):
        eager_ops.performer_attention(q, k, v, jnp.ones((4, 16)), impl="triton")
    # On an H100, "auto" picks the kernel when it is enabled there (AUTO_ON_GPU), else XLA.
    monkeypatch.setattr(kernel_impl, "device_backend", lambda: "gpu")
    monkeypatch.setattr(kernel_impl, "_gpu_capability", lambda: 9.0)
    calls = []
    monkeypatch.setattr(kernelized, "chunked_linear_attention", lambda *a, **kw: calls.append(kw) or a[0])  # d_k == d_v
    long_q, long_k, long_v = qkv(2, 128, d=16, dv=16)
    monkeypatch.setattr(linear_kernels, "AUTO_ON_GPU", False)
    eager_ops.linear_attention(long_q, long_k, long_v, causal=True, impl="auto")
    assert not calls
    monkeypatch.setattr(linear_kernels, "AUTO_ON_GPU", True)
    eager_ops.linear_attention(long_q, long_k, long_v, causal=True, impl="auto")
    assert calls and calls[0]["interpret"] is False
    monkeypatch.undo()  # impl="pallas" on a TPU: tests/test_linear_kernels_tpu.py
    with pytest.raises(ValueError, match="chunk_size must be a power of two >= 16 for the kernel; got 24"):
        chunked_linear_attention(q, k, v, chunk_size=24, interpret=True)
    for bad in (8, 24, 32):  # below 16, not a power of two, beyond d_v = 16 (padded: 16)
        with pytest.raises(ValueError, match=rf"block_v must be None, d_v or a power of two .*block_v={bad}, d_v=16"):
            chunked_linear_attention(q, k, v, block_v=bad, interpret=True)
    with pytest.raises(ValueError, match=r"block_v splits the Triton kernels' .* block_v=16, backend='tpu'"):
        chunked_linear_attention(q, k, jnp.concatenate([v, v], -1), block_v=16, backend="tpu", interpret=True)
    with pytest.raises(ValueError, match=r"log_gate must have shape \(20, 2\) .* or \(20, 2, 16\) .*; got \(20, 4\)"):
        chunked_linear_attention(q, k, v, log_gate=jnp.zeros((20, 4)), interpret=True)
    assert registry.get("rfa").bind(impl="xla").hyper_parameters["impl"] == "xla"


def test_the_kernels_lower_for_cuda_through_triton():
    # Lowered from this CPU for a CUDA device (the Triton lowering runs here; only the
    # Triton compiler itself needs the GPU): an unsupported primitive or block shape in
    # the forward or backward kernels fails here, not first on the GPU.
    n, m = 128, 64
    fq, fk, v = (jnp.ones((n, h, m), jnp.bfloat16) for h in (4, 2, 2))
    cases = (
        (True, jnp.zeros((n, 2)), None),
        (True, jnp.zeros((n, 2, m)), None),
        (True, None, None),
        (False, None, None),
        (True, jnp.zeros((n, 2)), 16),  # the state walks split over d_v blocks
        (False, None, 32),
    )
    for causal, log_gate, block_v in cases:

        def loss(fq, fk, v, log_gate):
            out = chunked_linear_attention(fq, fk, v, causal=causal, log_gate=log_gate, block_v=block_v)  # noqa: B023 - called within this iteration
            return jnp.sum(out.astype(jnp.float32))

        try:
            with cuda_target():
                text = (
                    jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                    .trace(fq, fk, v, log_gate)
                    .lower(lowering_platforms=("cuda",))
                    .as_text()
                )
        except RuntimeError as e:  # a jaxlib built without the GPU lowering's dialects
            if "triton" in str(e).lower() and "dialect" in str(e).lower():
                pytest.skip(f"no Triton lowering in this jaxlib: {e}")
            raise
        assert text.count("triton") >= 4, causal  # states, output, dstates, grads
