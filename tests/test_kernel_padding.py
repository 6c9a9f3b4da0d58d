"""The block-sparse kernel called directly (not through an op) with non-finite values at
padded keys: padding never changes a real output or its gradient (issue: a NaN in a
padded `v` made every row NaN, since a masked tile still meets a zero weight); and a
non-finite key or value at a real position reaches exactly the rows that read it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from jxformers.kernels import Band, block_sparse_attention, block_sparse_reference, causal
from jxformers.kernels.cudnn import cudnn_attention
from jxformers.kernels.pattern import dense_mask


@pytest.mark.parametrize("kind", ["window", "causal"])
def test_non_finite_padding_never_reaches_real_outputs_or_gradients(kind):
    n, real = 40, 29
    q, k, v = (jax.random.normal(jax.random.key(i), (n, 2, 16)) for i in range(3))
    kv_mask = jnp.arange(n) < real
    pattern = Band(-5, 5) if kind == "window" else causal(n, n)
    dirty_k, dirty_v = k.at[real:].set(jnp.inf), v.at[real:].set(jnp.nan)

    def loss(k, v):
        out = block_sparse_attention(q, k, v, pattern, kv_mask=kv_mask, interpret=True)
        return jnp.sum(out**2), out

    (_, clean), clean_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(k, v)
    (_, dirty), dirty_grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(dirty_k, dirty_v)
    assert np.isfinite(np.asarray(dirty)).all()
    assert_close(dirty, clean, atol=1e-6)
    for dirty_g, clean_g in zip(dirty_grads, clean_grads, strict=True):
        assert np.isfinite(np.asarray(dirty_g)).all()
        assert_close(dirty_g[:real], clean_g[:real], atol=1e-6)
        assert float(jnp.abs(dirty_g[real:]).max()) == 0  # padding gets no gradient
    reference, _ = block_sparse_reference(q, dirty_k, dirty_v, pattern, kv_mask=kv_mask)
    assert_close(reference, clean, atol=1e-5)


def test_a_nan_key_reaches_the_rows_that_read_it_as_nan_never_as_zeros():
    # The kernels' empty-row guard read a NaN row sum as "no key seen" and wrote zeros.
    n, j = 40, 17
    q, k, v = (jax.random.normal(jax.random.key(i), (n, 2, 16)) for i in range(3))
    pattern = Band(-5, 5)
    reads = np.abs(np.arange(n) - j) <= 5
    for out in (
        block_sparse_attention(q, k.at[j].set(jnp.nan), v, pattern, interpret=True),
        block_sparse_reference(q, k.at[j].set(jnp.nan), v, pattern)[0],
    ):
        rows_nan = np.isnan(np.asarray(out)).any(axis=(1, 2))
        np.testing.assert_array_equal(rows_nan, reads)


def test_the_reference_keeps_a_nan_value_to_the_rows_that_read_it():
    # A NaN value meets the zero weight of each row outside the band in the dense
    # product; the reference (as every op) keeps it to the rows that weigh it.
    n, j = 40, 17
    q, k, v = (jax.random.normal(jax.random.key(i), (n, 2, 16)) for i in range(3))
    out, _ = block_sparse_reference(q, k, v.at[j].set(jnp.nan), Band(-5, 5))
    np.testing.assert_array_equal(np.isnan(np.asarray(out)).any(axis=(1, 2)), np.abs(np.arange(n) - j) <= 5)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
@pytest.mark.parametrize("kind", ["window", "causal"])
def test_a_non_finite_value_reaches_exactly_the_rows_that_read_it(kind, bad):
    # A tile the pattern cuts multiplies its masked slots' zero weights by the whole value
    # tile, and 0 * NaN is NaN: every row of the tile was NaN, read or not. The kernel now
    # gives such a key a NaN score (masked like any score) and a zero value.
    n, j = 40, 17
    q, k, v = (jax.random.normal(jax.random.key(i), (n, 2, 16)) for i in range(3))
    pattern = Band(-5, 5) if kind == "window" else causal(n, n)
    out = block_sparse_attention(q, k, v.at[j, 1, 3].set(bad), pattern, interpret=True)
    reads = dense_mask(pattern, n, n)[:, j]
    rows_nan = np.isnan(np.asarray(out)).any(axis=(1, 2))
    np.testing.assert_array_equal(rows_nan, reads)
    clean = block_sparse_attention(q, k, v, pattern, interpret=True)
    assert_close(out[~reads], clean[~reads], atol=1e-6)


def test_cudnn_route_keeps_a_nan_value_to_the_rows_of_its_window():
    # The ops' cuDNN route through jax.nn.dot_product_attention (its XLA implementation
    # here): a causal window of 4 reads position 10 from rows 10-14 only.
    n, j = 24, 10
    q, k, v = (jax.random.normal(jax.random.key(i), (n, 2, 16)) for i in range(3))
    out = cudnn_attention(q, k, v.at[j].set(jnp.nan), causal=True, window=4, implementation="xla")
    rows_nan = np.isnan(np.asarray(out)).any(axis=(1, 2))
    np.testing.assert_array_equal(rows_nan, (np.arange(n) >= j) & (np.arange(n) <= j + 4))
