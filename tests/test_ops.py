"""Properties specific to one op (the generic, registry-driven ones are in test_generic.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, qkv
from hypothesis import given
from hypothesis import strategies as st

ops = JittedOps()  # each op compiled whole (eagerly: every primitive on its own)


def dense_reference(q, k, v, mask=None, bias=None):
    """Textbook attention in numpy float64 with heads repeated for grouped queries."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


# ----------------------------------------------------------------------------- softmax


def test_softmax_matches_the_textbook_formula_with_bias_and_mask():
    q, k, v = qkv(0, 9, kv_len=13)
    bias = jax.random.normal(jax.random.key(5), (4, 9, 13))
    mask = jax.random.bernoulli(jax.random.key(6), 0.7, (9, 13)).at[:, 0].set(True)
    out = ops.softmax_attention(q, k, v, bias=bias, mask=mask)
    assert_close(out, dense_reference(q, k, v, np.asarray(mask), bias), atol=1e-5)
    out2 = ops.softmax_attention(q, k, v, bias=bias[0])
    assert_close(out2, dense_reference(q, k, v, None, np.asarray(bias[0])[None]), atol=1e-5)


def test_softmax_grouped_query_heads_equal_repeated_heads():
    q, k, v = qkv(1, 11, heads=6, kv_heads=2)
    grouped = ops.softmax_attention(q, k, v, causal=True)
    repeated = ops.softmax_attention(q, jnp.repeat(k, 3, axis=1), jnp.repeat(v, 3, axis=1), causal=True)
    assert_close(grouped, repeated, atol=1e-6)


def test_softmax_fully_masked_rows_are_zero_and_have_finite_gradients():
    q, k, v = qkv(2, 6)
    mask = jnp.ones((6, 6), bool).at[2].set(False)
    out = ops.softmax_attention(q, k, v, mask=mask)
    assert_close(out[2], jnp.zeros_like(out[2]), atol=0)
    assert bool(jnp.all(jnp.isfinite(jax.grad(lambda q: ops.softmax_attention(q, k, v, mask=mask).sum())(q))))


def test_softmax_parts_derivatives_equal_autodiff_of_the_masked_softmax():
    # softmax_parts differentiates by softmax's own formula (custom_jvp); forward mode,
    # reverse mode and second order must equal plain autodiff of a masked softmax over
    # the joined parts, and masked entries get exactly zero gradient even under a NaN
    # upstream gradient there.
    from jxformers.ops._common import softmax_parts

    s1, s2 = jax.random.normal(jax.random.key(0), (3, 1, 5, 4)), jax.random.normal(jax.random.key(5), (3, 1, 5, 6))
    m1 = jax.random.bernoulli(jax.random.key(1), 0.6, (3, 1, 5, 4)).at[:, :, 1].set(False)
    m2 = jax.random.bernoulli(jax.random.key(2), 0.6, (3, 1, 5, 6)).at[:, :, 1].set(False)

    def ours(s1, s2):
        return jnp.concatenate(softmax_parts([(s1, m1), (s2, m2)]), -1)

    def plain(s1, s2):
        s, m = jnp.concatenate([s1, s2], -1), jnp.concatenate([m1, m2], -1)
        p = jax.nn.softmax(jnp.where(m, s, -1e30), axis=-1)
        return jnp.where(m.any(-1, keepdims=True) & m, p, 0.0)

    assert_close(ours(s1, s2), plain(s1, s2), atol=1e-6)
    t1, t2 = jax.random.normal(jax.random.key(3), (3, 1, 5, 4)), jax.random.normal(jax.random.key(6), (3, 1, 5, 6))
    assert_close(jax.jvp(ours, (s1, s2), (t1, t2))[1], jax.jvp(plain, (s1, s2), (t1, t2))[1], atol=1e-6)
    w = jax.random.normal(jax.random.key(4), (3, 1, 5, 10))
    for f in (jax.grad, jax.hessian):  # jitted: one compilation, not one per operation
        a = jax.jit(f(lambda s1: jnp.sum(w * ours(s1, s2))))(s1)
        b = jax.jit(f(lambda s1: jnp.sum(w * plain(s1, s2))))(s1)
        assert_close(a, b, atol=1e-5)
    nan_upstream = jnp.where(jnp.concatenate([m1, m2], -1), w, jnp.nan)
    g = jax.grad(lambda s1: jnp.sum(nan_upstream * ours(s1, s2)))(s1)
    assert bool(jnp.all(jnp.where(m1, jnp.isfinite(g), g == 0)))  # masked: exactly 0 (row 1 is empty)


def test_causal_mask_is_bottom_right_aligned():
    m = np.asarray(ops.causal_mask(2, 5))
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_softmax_bf16_softmax_runs_in_float32():
    # Large logits that overflow bf16's exp range if the softmax were taken in bf16.
    q, k, v = qkv(3, 16, d=64)
    q, k = q * 6, k * 6
    full = ops.softmax_attention(q, k, v)
    half = ops.softmax_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    assert bool(jnp.all(jnp.isfinite(half)))
    assert_close(half, full, atol=0.15, rtol=0.1)


# ----------------------------------------------------------------------------- chunked


@given(
    n=st.sampled_from([1, 19, 64]),
    kv_len=st.sampled_from([7, 33]),
    chunk=st.sampled_from([4, 16]),
    causal=st.booleans(),
    seed=st.integers(0, 100),
)
def test_chunked_equals_softmax_for_any_lengths_and_chunk(n, kv_len, chunk, causal, seed):
    q, k, v = qkv(seed, n, kv_len=kv_len)
    kv_mask = jnp.arange(kv_len) < kv_len - 2
    a = ops.chunked_attention(q, k, v, kv_mask=kv_mask, causal=causal, chunk_size=chunk)
    b = ops.softmax_attention(q, k, v, kv_mask=kv_mask, causal=causal)
    assert_close(a, b, atol=2e-6)


def test_chunked_gradients_equal_softmax_gradients():
    q, k, v = qkv(4, 30)
    f = lambda op, **kw: jax.grad(lambda q, k, v: jnp.sum(jnp.sin(op(q, k, v, causal=True, **kw))), (0, 1, 2))(q, k, v)  # noqa: E731
    for a, b in zip(f(ops.chunked_attention, chunk_size=8), f(ops.softmax_attention), strict=True):
        assert_close(a, b, atol=1e-5)


# ----------------------------------------------------------------------------- local family


def test_local_attention_window_zero_attends_only_itself():
    q, k, v = qkv(5, 20, heads=2, kv_heads=2)
    assert_close(ops.local_attention(q, k, v, window=0), v, atol=1e-6)


def test_local_attention_window_wider_than_sequence_is_full_attention():
    q, k, v = qkv(6, 20)
    assert_close(ops.local_attention(q, k, v, window=50), ops.softmax_attention(q, k, v), atol=1e-6)
    assert_close(
        ops.local_attention(q, k, v, window=50, causal=True), ops.softmax_attention(q, k, v, causal=True), atol=1e-6
    )


def test_local_attention_groups_contiguous_not_strided_positions():
    """The LRA code's 'local' attention groups strided positions; ours must see its
    immediate neighbours: output 0 with window 1 mixes values 0 and 1 only."""
    q, k, v = qkv(7, 40, heads=1, kv_heads=1)
    out = ops.local_attention(q, k, v, window=1)
    only = ops.softmax_attention(q[:1], k[:2], v[:2])
    assert_close(out[:1], only, atol=1e-6)


def test_dilated_with_dilation_one_is_local():
    q, k, v = qkv(8, 37)
    assert_close(
        ops.dilated_attention(q, k, v, window=4, dilation=1), ops.local_attention(q, k, v, window=4), atol=1e-6
    )


# ----------------------------------------------------------------------------- sparse family


def test_bigbird_random_blocks_avoid_window_and_global_blocks_and_repeat_nothing():
    rnd = np.asarray(ops.bigbird_random_blocks(jax.random.key(0), 200, block_size=8, num_random_blocks=3))
    nb = 25
    assert rnd.shape == (nb, 3)
    for a in range(nb):
        drawn = [b for b in rnd[a] if b >= 0]
        if a in (0, nb - 1):
            assert drawn == []  # global query blocks already attend everything
            continue
        assert len(drawn) == 3 and len(set(drawn)) == 3
        assert all(abs(b - a) > 1 and b not in (0, nb - 1) for b in drawn)


def test_bigbird_random_pattern_is_fixed_by_the_key():
    q, k, v = qkv(9, 64)
    f = lambda key: ops.bigbird_attention(q, k, v, block_size=4, num_random_blocks=2, key=key)  # noqa: E731
    assert_close(f(jax.random.key(1)), f(jax.random.key(1)), atol=0)
    assert not np.allclose(f(jax.random.key(1)), f(jax.random.key(2)), atol=1e-4)


def test_bigbird_short_sequences_leave_empty_random_slots():
    rnd = np.asarray(ops.bigbird_random_blocks(jax.random.key(0), 16, block_size=4, num_random_blocks=3))
    assert (rnd == -1).all()  # 4 blocks: every block is in a window or global
    rnd = np.asarray(ops.bigbird_random_blocks(jax.random.key(0), 20, block_size=4, num_random_blocks=3))
    assert rnd[1].tolist() == [3, -1, -1] and rnd[3].tolist() == [1, -1, -1]  # the one block left


def test_bigbird_ignores_user_random_blocks_that_repeat_other_parts():
    q, k, v = qkv(10, 40)
    clean = -jnp.ones((10, 2), jnp.int32)
    dup = clean.at[4].set(jnp.array([4, 0]))  # own block (window) and a global block
    a = ops.bigbird_attention(q, k, v, block_size=4, random_blocks=clean, num_random_blocks=2)
    b = ops.bigbird_attention(q, k, v, block_size=4, random_blocks=dup, num_random_blocks=2)
    assert_close(a, b, atol=1e-6)


def test_longformer_global_indices_may_differ_per_example_under_vmap():
    q, k, v = qkv(11, 30)
    idx = jnp.array([[0, 7], [3, 29]])
    batched = jax.vmap(lambda g: ops.longformer_attention(q, k, v, window=2, global_indices=g))(idx)
    for row, g in zip(batched, ([0, 7], [3, 29]), strict=True):
        assert_close(row, ops.longformer_attention(q, k, v, window=2, global_indices=tuple(g)), atol=1e-6)


def test_longformer_out_of_range_traced_indices_are_ignored_and_repeats_count_once():
    q, k, v = qkv(12, 30)
    ref = ops.longformer_attention(q, k, v, window=2, global_indices=(5,))
    traced = jax.jit(lambda g: ops.longformer_attention(q, k, v, window=2, global_indices=g))
    assert_close(traced(jnp.array([5, 5, 40, -1])), ref, atol=1e-6)


def test_longformer_without_global_tokens_is_local():
    q, k, v = qkv(13, 30)
    assert_close(
        ops.longformer_attention(q, k, v, window=3, global_indices=()),
        ops.local_attention(q, k, v, window=3),
        atol=1e-6,
    )


def test_sparse_transformer_strided_reaches_every_earlier_position_in_two_hops():
    """Child et al.'s claim: with stride s, the strided pattern composed with itself
    connects every query to every earlier key (full causal receptive field)."""
    n, s = 36, 6
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    a = (((abs(i - j) < s) | ((i - j) % s == 0)) & (j <= i)).astype(int)
    assert ((a @ a > 0) == (j <= i)).all()


# ----------------------------------------------------------------------------- axial, compressed


def test_axial_row_then_column_is_the_composition_of_its_passes():
    q, k, v = qkv(14, 30)
    rows = ops.axial_attention(q, k, v, width=6, order="row")
    both = ops.axial_attention(q, k, v, width=6)
    again = ops.axial_attention(q, jnp.repeat(k, 2, axis=1), rows, width=6, order="column")
    assert_close(both, again, atol=1e-6)


def _conv_numpy(x, kernel, real):
    """Strided convolution written as a loop: slot m = sum_t x[m*s + t] @ W[t]."""
    x = np.where(np.asarray(real)[:, None, None], np.asarray(x, np.float64), 0.0)
    s, _, d_out = kernel.shape
    n, h, _ = x.shape
    m = -(-n // s)
    out = np.zeros((m, d_out))
    for slot in range(m):
        for t in range(s):
            if slot * s + t < n:
                out[slot] += x[slot * s + t].reshape(-1) @ np.asarray(kernel[t], np.float64)
    return out.reshape(m, h, d_out // h)


@pytest.mark.parametrize("causal", [False, True])
def test_memory_compressed_equals_softmax_over_the_convolved_memory(causal):
    n, s = 23, 3
    q, k, v = qkv(15, n)
    kk, kv_ = jax.random.split(jax.random.key(16))
    k_kernel = jax.random.normal(kk, (s, 16, 16)) * 0.1
    v_kernel = jax.random.normal(kv_, (s, 12, 12)) * 0.1
    real = np.arange(n) < n - 4
    out = ops.memory_compressed_attention(
        q, k, v, k_kernel=k_kernel, v_kernel=v_kernel, causal=causal, kv_mask=jnp.asarray(real)
    )
    ck, cv = _conv_numpy(k, k_kernel, real), _conv_numpy(v, v_kernel, real)
    slots = ck.shape[0]
    slot_real = np.array([real[m * s : (m + 1) * s].any() for m in range(slots)])
    mask = np.broadcast_to(slot_real, (n, slots))
    if causal:
        mask = mask & ((np.arange(slots)[None, :] + 1) * s - 1 <= np.arange(n)[:, None])
    expected = np.zeros((n, 4, 6))
    rows = mask.any(1)
    expected[rows] = dense_reference(np.asarray(q)[rows], ck, cv, mask[rows][None])
    assert_close(out, expected, atol=1e-5)
    if causal:
        assert_close(out[: s - 1], np.zeros((s - 1, 4, 6)), atol=0)


def test_longformer_dilated_window_with_global_tokens_and_global_projections_equal_the_dense_reference():
    n, window, dilation, glob = 29, 2, 3, (0, 13)
    q, k, v = qkv(21, n)
    gq, gk, gv = (x * 1.5 + 0.3 for x in qkv(22, n))  # the paper's separate Q_g, K_g, V_g
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    is_global = np.isin(np.arange(n), glob)
    longformer = jax.jit(
        lambda *x, causal: ops.longformer_attention(
            *x[:3],
            window=window,
            dilation=dilation,
            global_indices=glob,
            causal=causal,
            global_q=x[3],
            global_k=x[4],
            global_v=x[5],
        ),
        static_argnames="causal",
    )
    dense = jax.jit(lambda q, k, v, mask: ops.softmax_attention(q, k, v, mask=mask))
    for causal in (False, True):
        got = longformer(q, k, v, gq, gk, gv, causal=causal)
        past = (j <= i) if causal else np.ones((n, n), bool)
        pattern = ((i - j) % dilation == 0) & (abs(i - j) <= window * dilation) | is_global[None, :]
        local_rows = dense(q, k, v, jnp.asarray(pattern & past))
        global_rows = dense(gq, gk, gv, jnp.asarray(past))
        assert_close(got, jnp.where(jnp.asarray(is_global)[:, None, None], global_rows, local_rows), atol=2e-5)
    with pytest.raises(ValueError, match="global_v"):
        ops.longformer_attention(q, k, v, window=2, global_q=gq, global_k=gk)
