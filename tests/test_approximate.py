"""Family properties of the approximate attentions: kernelized, low rank, memory, Fourier."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, jitted_call, qkv
from hypothesis import given
from hypothesis import strategies as st

from jxformers.ops import fourier
from jxformers.xla_cost import compile_with_cost

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

# ----------------------------------------------------------------------------- linear attention


def linear_reference(q, k, v, phi, causal, kv_mask=None):
    """Eq. 4 of Katharopoulos et al. written out in numpy float64."""
    fq, fk = (np.asarray(phi(x), np.float64) for x in (q, k))
    v = np.asarray(v, np.float64)
    rep = q.shape[1] // k.shape[1]
    fk, v = np.repeat(fk, rep, axis=1), np.repeat(v, rep, axis=1)
    a = np.einsum("qhm,khm->hqk", fq, fk)
    if causal:
        a = a * np.tril(np.ones(a.shape[1:]))
    if kv_mask is not None:
        a = a * np.asarray(kv_mask)[None, None, :]
    return np.einsum("hqk,khd->qhd", a, v) / a.sum(-1).T[:, :, None]


@pytest.fixture(scope="module")
def jitted_linear():
    return jax.jit(ops.linear_attention, static_argnames=("feature_map", "causal", "chunk_size", "form"))


@given(n=st.sampled_from([1, 23, 64]), chunk=st.sampled_from([4, 16]), seed=st.integers(0, 99), padded=st.booleans())
def test_linear_causal_forms_agree_with_the_formula(jitted_linear, n, chunk, seed, padded):
    q, k, v = qkv(seed, n)
    kv_mask = (jnp.arange(n) < max(1, n - 3)) if padded else None
    ref = linear_reference(q, k, v, lambda x: jax.nn.elu(x) + 1, True, kv_mask)
    for form in ("quadratic", "scan", "chunked"):
        out = jitted_linear(q, k, v, causal=True, kv_mask=kv_mask, form=form, chunk_size=chunk)
        assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("feature_map", ["elu", "relu"])
def test_linear_noncausal_equals_the_formula(feature_map):
    q, k, v = qkv(1, 30, kv_len=17)
    phi = ops.kernelized.FEATURE_MAPS[feature_map]
    ref = linear_reference(q, k, v, phi, False)
    assert_close(ops.linear_attention(q, k, v, feature_map=feature_map), ref, atol=2e-5, rtol=2e-5)


def test_linear_accepts_a_callable_feature_map():
    q, k, v = qkv(2, 12)
    phi = lambda x: jnp.exp(x)  # noqa: E731
    assert_close(
        ops.linear_attention(q, k, v, feature_map=phi, causal=True),
        linear_reference(q, k, v, phi, True),
        atol=1e-5,
        rtol=1e-5,
    )


def test_linear_gradients_agree_across_causal_forms():
    q, k, v = qkv(3, 40)

    @jax.jit  # the three forms' gradients in one compiled program
    def all_grads(q, k, v):
        return [
            jax.grad(
                lambda q, k, v: jnp.sum(jnp.sin(ops.linear_attention(q, k, v, causal=True, form=f, chunk_size=8))),  # noqa: B023
                (0, 1, 2),
            )(q, k, v)
            for f in ("quadratic", "scan", "chunked")
        ]

    grads = all_grads(q, k, v)
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert_close(a, b, atol=1e-5)


def test_linear_bf16_states_accumulate_in_float32():
    q, k, v = qkv(4, 2048, heads=2, kv_heads=2)
    full = ops.linear_attention(q, k, v, causal=True)
    half = ops.linear_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=True)
    assert bool(jnp.all(jnp.isfinite(half)))
    assert_close(half, full, atol=3e-2, rtol=3e-2)


def test_gated_forms_agree():
    q, k, v = qkv(5, 37)
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(9), (37, 2)))
    fq, fk = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1

    @jax.jit  # every output the test compares, in one compiled program
    def outputs(fq, fk, v, gate):
        forms = [
            ops.kernel_attention(fq, fk, v, causal=True, gate=gate, form=f, chunk_size=8)
            for f in ("quadratic", "scan", "chunked")
        ]
        ones = ops.kernel_attention(fq, fk, v, causal=True, gate=jnp.ones((37, 2)))
        return forms, ones, ops.kernel_attention(fq, fk, v, causal=True)

    outs, ones, plain = outputs(fq, fk, v, gate)
    assert_close(outs[1], outs[0], atol=1e-5)
    assert_close(outs[2], outs[0], atol=1e-5)
    assert_close(ones, plain, atol=1e-5)  # an all-ones gate is plain causal linear attention


# ----------------------------------------------------------------------------- Performer


def test_performer_projection_rows_are_orthogonal_within_blocks():
    w = np.asarray(ops.performer_projection(jax.random.key(0), 20, 8))
    assert w.shape == (20, 8)
    block = w[:8] / np.linalg.norm(w[:8], axis=1, keepdims=True)
    assert_close(block @ block.T, np.eye(8), atol=1e-5)


@pytest.mark.parametrize("orthogonal", [False, True])
def test_performer_features_estimate_the_softmax_kernel_without_bias(orthogonal):
    d, m, draws = 8, 64, 400
    x = jax.random.normal(jax.random.key(1), (2, 1, d)) * 0.7
    target = math.exp(float(x[0, 0] @ x[1, 0]) / math.sqrt(d))

    def estimate(key):
        w = ops.performer_projection(key, m, d, orthogonal=orthogonal)
        f = ops.performer_features(x, w)
        return jnp.sum(f[0, 0] * f[1, 0])

    est = jax.vmap(estimate)(jax.random.split(jax.random.key(2), draws))
    mean, sem = float(est.mean()), float(est.std()) / math.sqrt(draws)
    assert abs(mean - target) < 4 * sem + 1e-3 * target, (mean, target, sem)


def test_performer_error_falls_as_features_grow():
    q, k, v = qkv(6, 64, heads=2, kv_heads=2, d=16)
    q, k = q * 0.5, k * 0.5
    exact = jitted_call(ops.softmax_attention, q, k, v)
    errors = []
    for m in (8, 64, 512):  # one compilation per feature count
        errs = [
            float(
                jnp.mean(
                    jnp.abs(
                        jitted_call(
                            ops.performer_attention, q, k, v, ops.performer_projection(jax.random.key(s), m, 16)
                        )
                        - exact
                    )
                )
            )
            for s in range(4)
        ]
        errors.append(np.mean(errs))
    assert errors[0] > errors[1] > errors[2], errors
    assert errors[2] < 0.5 * errors[0]


def test_performer_causal_chunked_equals_quadratic_and_survives_large_logits():
    q, k, v = qkv(7, 50, d=16)
    w = ops.performer_projection(jax.random.key(3), 32, 16)
    big_q, big_k = q * 4, k * 4  # unstabilised features would overflow float32
    a = jitted_call(ops.performer_attention, big_q, big_k, v, w, causal=True, form="quadratic")
    b = jitted_call(ops.performer_attention, big_q, big_k, v, w, causal=True, chunk_size=8)
    assert bool(jnp.all(jnp.isfinite(b)))
    assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_performer_padding_is_masked_in_the_normaliser():
    q, k, v = qkv(8, 20)
    w = ops.performer_projection(jax.random.key(4), 64, 8)
    real = jnp.arange(20) < 12
    padded = ops.performer_attention(q, k, v, w, kv_mask=real)
    short = ops.performer_attention(q, k[:12], v[:12], w)
    assert_close(padded, short, atol=1e-5)


def test_rfa_gate_forms_agree_and_projection_shape_is_checked():
    q, k, v = qkv(9, 30)
    w = ops.performer_projection(jax.random.key(5), 16, 8)
    gate = jax.nn.sigmoid(jax.random.normal(jax.random.key(6), (30, 2)))
    a = jitted_call(ops.rfa_attention, q, k, v, w, gate=gate, causal=True, form="scan")
    b = jitted_call(ops.rfa_attention, q, k, v, w, gate=gate, causal=True, chunk_size=7)
    assert_close(a, b, atol=1e-4)
    with pytest.raises(ValueError, match="projection"):
        ops.rfa_attention(q, k, v, w[:, :4])
    with pytest.raises(ValueError, match="gate"):
        ops.rfa_attention(q, k, v, w, gate=gate)


# ----------------------------------------------------------------------------- low rank


def test_linformer_refuses_causal_and_supports_short_and_padded_sequences():
    q, k, v = qkv(10, 12)
    e, f = jax.random.normal(jax.random.key(0), (2, 16, 40)) * 0.2
    with pytest.raises(ValueError, match="cannot be causal"):
        ops.linformer_attention(q, k, v, e_proj=e, f_proj=f, causal=True)
    out = ops.linformer_attention(q, k, v, e_proj=e, f_proj=f)  # proj_len 16 > kv_len 12
    pk = jnp.einsum("pn,nhd->phd", e[:, :12], k)
    pv = jnp.einsum("pn,nhd->phd", f[:, :12], v)
    assert_close(out, ops.softmax_attention(q, pk, pv), atol=1e-5)
    real = jnp.arange(12) < 9
    assert_close(
        ops.linformer_attention(q, k, v, e_proj=e, f_proj=f, kv_mask=real),
        ops.linformer_attention(q, k[:9], v[:9], e_proj=e, f_proj=f),
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="max_len"):
        ops.linformer_attention(*qkv(0, 50), e_proj=e, f_proj=f)


def test_synthesizer_kinds_match_their_formulas():
    q, k, v = qkv(11, 10)
    r = jax.random.normal(jax.random.key(1), (4, 16, 16))
    assert_close(
        ops.synthesizer_attention(q, k, v, kind="random", random=r),
        ops.softmax_attention(q, k, v, bias=r[:, :10, :10], scale=0.0),
        atol=1e-6,
    )
    assert_close(
        ops.synthesizer_attention(q, k, v, kind="random", fixed_random=r),
        ops.softmax_attention(q, k, v, bias=r[:, :10, :10], scale=0.0),
        atol=1e-6,
    )
    # The paper's mixture: softmax(a1 B + a2 q k^T / sqrt(d)), (a1, a2) = softmax(learned logits).
    a, b = jax.random.normal(jax.random.key(2), (2, 4, 16, 3))
    mix = jnp.array([0.3, -0.4])
    a1, a2 = np.exp([0.3, -0.4]) / np.exp([0.3, -0.4]).sum()
    assert_close(
        ops.synthesizer_attention(q, k, v, kind="factorized_random", factor_a=a, factor_b=b, mixture_logits=mix),
        ops.softmax_attention(
            q, k, v, bias=a1 * jnp.einsum("hqr,hkr->hqk", a[:, :10], b[:, :10]), scale=a2 / math.sqrt(8)
        ),
        atol=1e-5,
    )
    dense = jax.random.normal(jax.random.key(3), (4, 10, 16))  # rows made from the tokens by the module
    assert_close(
        ops.synthesizer_attention(q, k, v, kind="dense", dense_logits=dense, causal=True),
        ops.softmax_attention(q, k, v, bias=dense[:, :, :10], scale=0.0, causal=True),
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="needs `random`"):
        ops.synthesizer_attention(q, k, v, kind="random")
    with pytest.raises(ValueError, match="dense_logits"):
        ops.synthesizer_attention(q, k, v, kind="dense")


def test_nystrom_with_a_landmark_per_token_is_softmax():
    q, _, v = qkv(12, 16, heads=2, kv_heads=2)
    q = k = 1.5 * q  # keys = queries: a diagonally dominant, well-conditioned softmax matrix
    out = ops.nystrom_attention(q, k, v, num_landmarks=16, pinv_iterations=30)
    assert_close(out, ops.softmax_attention(q, k, v), atol=1e-3)


def test_nystrom_landmarks_average_real_tokens_of_uneven_segments():
    x = jnp.arange(10.0).reshape(10, 1, 1)
    means, ok = ops.segment_means(x, 3, jnp.arange(10) < 8)
    # segments [0, 3), [3, 6), [6, 10) with positions 8, 9 padded
    assert_close(means[:, 0, 0], [1.0, 4.0, 6.5], atol=1e-6)
    assert ok.tolist() == [True, True, True]


def test_iterative_pinv_converges_to_the_pseudo_inverse():
    a = jax.nn.softmax(jax.random.normal(jax.random.key(0), (6, 6)), axis=-1)
    assert_close(ops.iterative_pinv(a, 20), np.linalg.pinv(np.asarray(a)), atol=1e-3)


# ----------------------------------------------------------------------------- memory


def test_induced_attention_is_pack_then_unpack():
    q, k, v = qkv(13, 20, heads=2, kv_heads=2, dv=8)
    inducing = jax.random.normal(jax.random.key(1), (3, 2, 8))
    packed = ops.softmax_attention(inducing, k, v)
    assert_close(ops.induced_attention(q, k, v, inducing=inducing), ops.softmax_attention(q, packed, packed), atol=1e-6)
    assert ops.latent_attention(inducing, k, v).shape == (3, 2, 8)


def test_funnel_pool_averages_real_positions_and_funnel_attention_shortens_queries():
    x = jnp.arange(7.0)[:, None]
    pooled, ok = ops.funnel_pool(x, 2, jnp.arange(7) < 6)
    assert_close(pooled[:, 0], [0.5, 2.5, 4.5, 0.0], atol=1e-6)
    assert ok.tolist() == [True, True, True, False]
    q, k, v = qkv(14, 7)
    assert ops.funnel_attention(q, k, v, stride=2).shape == (4, 4, 6)


# ----------------------------------------------------------------------------- Fourier


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
def test_dct_equals_the_textbook_definition_and_idct_inverts_it(n):
    x = np.asarray(jax.random.normal(jax.random.key(n), (n, 3)))
    i = np.arange(n)
    alpha = np.where(i == 0, math.sqrt(1 / n), math.sqrt(2 / n))
    basis = alpha[:, None] * np.cos(np.pi * i[:, None] * (2 * i[None, :] + 1) / (2 * n))  # eq. 1-2
    assert_close(ops.dct(jnp.asarray(x)), basis @ x, atol=1e-5)
    assert_close(ops.idct(ops.dct(jnp.asarray(x))), x, atol=1e-5)
    assert_close(ops.dct(jnp.asarray(x.T), axis=1), (basis @ x).T, atol=1e-5)


def test_fourier_downsample_is_the_orthonormal_inverse_at_the_new_length_or_rescaled():
    # Eq. 7-8: orthonormal DCT, keep M coefficients, orthonormal inverse DCT at length M.
    # That scales the band-limited resampling by sqrt(N / M); rescale=True removes it.
    n, ratio = 24, 0.4
    m = math.ceil(ratio * n)
    i, j = np.arange(n), np.arange(m)
    wave = lambda length, idx, kk: np.cos(np.pi * kk * (2 * idx + 1) / (2 * length))  # noqa: E731
    x = 1.0 + 2 * wave(n, i, 3) - wave(n, i, 7)
    resampled = 1.0 + 2 * wave(m, j, 3) - wave(m, j, 7)
    x32 = jnp.asarray(x, jnp.float32)
    assert_close(ops.fourier_downsample(x32, ratio), resampled * math.sqrt(n / m), atol=1e-5)
    assert_close(ops.fourier_downsample(x32, ratio, rescale=True), resampled, atol=1e-5)
    assert_close(ops.fourier_downsample(jnp.full((n, 2), 3.0), ratio, rescale=True), np.full((m, 2), 3.0), atol=1e-5)
    # The padded (dense-matrix) form agrees with both on the real prefix.
    padded = jnp.concatenate([x32, jnp.ones(5)])[:, None]
    for rescale in (False, True):
        y, mask = jax.jit(lambda a: ops.fourier_downsample_padded(a, n, ratio, rescale=rescale))(padded)  # noqa: B023 - called within this iteration
        assert int(mask.sum()) == m
        assert_close(y[:m, 0], ops.fourier_downsample(x32, ratio, rescale=rescale), atol=1e-5)
    with pytest.raises(ValueError, match="keep_ratio"):
        ops.fourier_downsample(jnp.ones(4), 0.0)


@pytest.mark.parametrize("chirp", [True, False])
def test_padded_filter_equals_the_filter_of_each_real_prefix(chirp, monkeypatch):
    # Bluestein's chirp transform (lengths up to 32767), or the dense DCT matrices beyond.
    if not chirp:
        monkeypatch.setattr(fourier, "_CHIRP_MAX_LEN", 8)
    x = jax.random.normal(jax.random.key(0), (40, 3))
    filtered = jax.jit(jax.vmap(lambda length: ops.fourier_downsample_padded(x, length, 0.2)))
    ys, masks = filtered(jnp.array([40, 33, 1, 0]))
    for y, mask, length in zip(ys, masks, [40, 33, 1, 0], strict=True):
        kept = math.ceil(0.2 * length)
        assert mask.tolist() == [True] * kept + [False] * (8 - kept)
        assert_close(y[kept:], np.zeros((8 - kept, 3)))
        if length:
            assert_close(y[:kept], ops.fourier_downsample(x[:length], 0.2), atol=2e-6)


def test_padded_filter_costs_n_log_n():
    # XLA-counted FLOPs grow about 4.7x from n = 1024 to 4096 (dense DCT matrices: 16x).
    def flops(n):
        fn = lambda x, length: ops.fourier_downsample_padded(x, length, 0.2)[0]  # noqa: E731
        args = jax.ShapeDtypeStruct((n, 8), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
        return compile_with_cost(fn, *args)[1].flops

    assert flops(4096) < 6 * flops(1024)


def test_nearest_upsample_repeats_samples():
    assert ops.nearest_upsample(jnp.arange(3.0), 7).tolist() == [0, 0, 0, 1, 1, 2, 2]


def test_fnet_mixing_is_the_real_part_of_a_2d_fft():
    x = np.asarray(jax.random.normal(jax.random.key(0), (12, 6)))
    assert_close(ops.fnet_mixing(jnp.asarray(x)), np.real(np.fft.fft2(x)), atol=1e-4)


def test_performer_relu_kernel_is_the_papers_relu_of_wx_plus_epsilon():
    # The official JAX code (generalized_kernel_feature_creator, normalize_data=False):
    # phi(x) = relu(W x) + 1e-3, the epsilon added to the unscaled features.
    q, k, v = (np.asarray(x, np.float64) for x in qkv(11, 40, heads=2, kv_heads=2, d=16))
    for m in (64, 256):
        w = np.asarray(ops.performer_projection(jax.random.key(m), m, 16), np.float64)
        fq, fk = (np.maximum(np.einsum("nhd,md->nhm", x, w), 0) + 1e-3 for x in (q, k))
        num = np.einsum("qhm,khm,khd->qhd", fq, fk, v)
        den = np.einsum("qhm,khm->qh", fq, fk)
        got = ops.performer_attention(
            *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(w, jnp.float32), kernel="relu"
        )
        assert_close(got, num / den[..., None], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("causal,form", [(False, "chunked"), (True, "chunked"), (True, "scan"), (True, "quadratic")])
def test_performer_stabiliser_is_per_head_so_heads_never_couple(causal, form):
    # A head whose q/k norms are 7x the other's must not shift the other's features: with
    # one maximum shared by all heads the small head's causal rows underflow to zero.
    q, k, v = qkv(3, 64, heads=2, kv_heads=2, d=16)
    q, k = (x.at[:, 1].multiply(7.0) for x in (q, k))
    w = ops.performer_projection(jax.random.key(103), 64, 16)
    together = ops.performer_attention(q, k, v, w, causal=causal, form=form)
    for h in range(2):
        alone = ops.performer_attention(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], w, causal=causal, form=form)
        assert_close(together[:, h : h + 1], alone, atol=1e-5, rtol=1e-4)
