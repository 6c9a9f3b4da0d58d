"""Complexity without timing: XLA's compiled cost and memory analyses.

Doubling N at a fixed window roughly doubles (does not quadruple) the FLOPs of the
linear-cost patterns, and chunked attention's compiled temporary memory at N = 8192 is
under a quarter of dense softmax's. Dense softmax is the control: its FLOPs quadruple.
"""

import jax
import jax.numpy as jnp
import pytest

from jxformers import ops


def compiled(fn, n, heads=2, d=16):
    x = jax.ShapeDtypeStruct((n, heads, d), jnp.float32)
    return jax.jit(fn).lower(x, x, x).compile()


def flops(fn, n):
    cost = compiled(fn, n).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


LINEAR = {
    "local": lambda q, k, v: ops.local_attention(q, k, v, window=32),
    "local_causal": lambda q, k, v: ops.local_attention(q, k, v, window=32, causal=True),
    "block_local": lambda q, k, v: ops.block_local_attention(q, k, v, block_size=64),
    "dilated": lambda q, k, v: ops.dilated_attention(q, k, v, window=16, dilation=4),
    "longformer": lambda q, k, v: ops.longformer_attention(q, k, v, window=32, global_indices=(0, 5)),
    "bigbird": lambda q, k, v: ops.bigbird_attention(q, k, v, block_size=32, key=jax.random.key(0)),
}


@pytest.mark.parametrize("name", sorted(LINEAR))
def test_flops_double_when_length_doubles(name):
    ratio = flops(LINEAR[name], 4096) / flops(LINEAR[name], 2048)
    assert 1.7 < ratio < 2.3, f"{name}: FLOPs grew x{ratio:.2f} for 2x length"


def test_softmax_flops_quadruple_when_length_doubles():
    ratio = flops(ops.softmax_attention, 4096) / flops(ops.softmax_attention, 2048)
    assert ratio > 3.6


def test_sparse_transformer_flops_grow_like_n_sqrt_n():
    f = lambda n: flops(lambda q, k, v: ops.sparse_transformer_attention(q, k, v, stride=int(n**0.5)), n)  # noqa: E731
    ratio = f(4096) / f(1024)  # 4x length: n^1.5 gives 8x, n^2 would give 16x
    assert 6.5 < ratio < 10


def test_chunked_attention_temporary_memory_is_under_a_quarter_of_softmax():
    n = 8192
    dense = compiled(ops.softmax_attention, n).memory_analysis().temp_size_in_bytes
    chunked = compiled(lambda q, k, v: ops.chunked_attention(q, k, v, chunk_size=512), n).memory_analysis().temp_size_in_bytes
    assert chunked < dense / 4, (chunked, dense)


def test_chunked_attention_backward_memory_is_under_a_quarter_of_softmax():
    n = 8192

    def grad_of(op):
        return lambda q, k, v: jax.grad(lambda q, k, v: op(q, k, v).sum(), (0, 1, 2))(q, k, v)

    dense = compiled(grad_of(ops.softmax_attention), n).memory_analysis().temp_size_in_bytes
    op = lambda q, k, v: ops.chunked_attention(q, k, v, chunk_size=512)  # noqa: E731
    chunked = compiled(grad_of(op), n).memory_analysis().temp_size_in_bytes
    assert chunked < dense / 4, (chunked, dense)
