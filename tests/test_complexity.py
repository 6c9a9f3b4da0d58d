"""Memory without timing: XLA's compiled temporary memory (jxformers/xla_cost.py).

Chunked attention's compiled temporary memory at N = 8192 is under a quarter of dense
softmax's, forward and backward. (How each attention's FLOPs grow with N is the generic
suite's cost-class test, from the `growth` column of tests/attention_facts.py.)
"""

import jax
import jax.numpy as jnp

from jxformers import ops
from jxformers.xla_cost import compile_with_cost

N = 8192


def temp_bytes(fn, n=N, heads=2, d=16):
    x = jax.ShapeDtypeStruct((n, heads, d), jnp.float32)
    return compile_with_cost(fn, x, x, x)[1].temp_bytes


def chunked(q, k, v):
    return ops.chunked_attention(q, k, v, chunk_size=512)


def grad_of(op):
    return lambda q, k, v: jax.grad(lambda q, k, v: op(q, k, v).sum(), (0, 1, 2))(q, k, v)


def test_chunked_attention_temporary_memory_is_under_a_quarter_of_softmax():
    dense, small = temp_bytes(ops.softmax_attention), temp_bytes(chunked)
    assert small < dense / 4, (small, dense)


def test_chunked_attention_backward_memory_is_under_a_quarter_of_softmax():
    dense, small = temp_bytes(grad_of(ops.softmax_attention)), temp_bytes(grad_of(chunked))
    assert small < dense / 4, (small, dense)
