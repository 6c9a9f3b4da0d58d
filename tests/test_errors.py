"""Invalid arguments raise ValueError naming the argument, before any tracing.

(Wrong Python types and array ranks/dtypes are caught by the jaxtyping annotations when
runtime checking is on, as in this suite; the values and cross-argument shapes below
are checked by the ops themselves, with or without it.)"""

import jax
import jax.numpy as jnp
import pytest
from conftest import qkv

from jxformers import ops, registry

q, k, v = qkv(0, 12)

# Hyper-parameter errors, wrong kv_mask shapes and mismatched feature sizes of every
# registered attention are in the generic suite (the `errors` column of
# tests/attention_facts.py); these are the ops' own array arguments.
CASES = [
    (lambda: ops.bigbird_attention(q, k, v, block_size=4), "key"),
    (lambda: ops.bigbird_attention(q, k, v, block_size=4, random_blocks=jnp.zeros((2, 2), jnp.int32)), "random_blocks"),
    (lambda: ops.softmax_attention(q, k, v, mask=jnp.ones((12, 11), bool)), "mask"),
    (lambda: ops.softmax_attention(q, k, v, kv_mask=jnp.ones((11,), bool)), "kv_mask"),
    (lambda: ops.softmax_attention(q, k, v, bias=jnp.ones((3, 12, 12))), "bias"),
    (lambda: ops.softmax_attention(q, k[:, :, :4], v), "d_k"),
    (lambda: ops.softmax_attention(q, k, v[:10]), "kv_len"),
    (lambda: ops.softmax_attention(q, *qkv(0, 12, kv_heads=3)[1:]), "heads"),
    (
        lambda: ops.memory_compressed_attention(
            q, k, v, k_kernel=jnp.ones((3, 16, 16)), v_kernel=jnp.ones((2, 12, 12))
        ),
        "stride",
    ),
    (
        lambda: ops.memory_compressed_attention(
            q, k, v, k_kernel=jnp.ones((3, 15, 16)), v_kernel=jnp.ones((3, 12, 12))
        ),
        "kernel",
    ),
]


@pytest.mark.parametrize("call,argument", CASES, ids=[f"{i}-{a}" for i, (_, a) in enumerate(CASES)])
def test_invalid_arguments_raise_value_error_naming_them(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_registry_refuses_unknown_names_and_hyper_parameters():
    with pytest.raises(ValueError, match="registered: softmax"):
        registry.get("perfomer")
    spec = registry.get("local")
    with pytest.raises(ValueError, match="unknown hyper-parameter.*windw.*known: \\['impl', 'window'\\]"):
        spec(q, k, v, windw=3)
    with pytest.raises(ValueError, match="local: hyper-parameter window must be int; got '3'"):
        spec(q, k, v, window="3")
    with pytest.raises(ValueError, match="pattern must be one of"):
        registry.get("sparse_transformer")(q, k, v, pattern="random")
    with pytest.raises(ValueError, match="bigbird attention does not support causal"):
        registry.get("bigbird")(q, k, v, causal=True, arrays={"key": jax.random.key(0)})
