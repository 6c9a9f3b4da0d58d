"""The block-sparse kernel called directly (not through an op) with non-finite values at
padded keys: padding never changes a real output or its gradient (issue: a NaN in a
padded `v` made every row NaN, since a masked tile still meets a zero weight)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from jxformers.kernels import Band, block_sparse_attention, block_sparse_reference, causal


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
