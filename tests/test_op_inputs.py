"""What every registered op does with inputs users really pass: integer arrays, empty
sequences, numpy arrays. Each op is called through the registry with its first test
variant (tests/attention_facts.py), eagerly, so the runtime type checks see the inputs."""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from attention_facts import FACTS
from conftest import JittedOps, assert_close, qkv

from jxformers import registry

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

# Every attention the package registers (a test may register a toy of its own).
NAMES = [n for n in registry.names() if registry.get(n).op.__module__.startswith("jxformers.")]


def call(name, q, k, v, **kwargs):
    bound = registry.bind(name, **FACTS[name].variants[0])
    if bound.spec.causal_only:  # the delta rules exist only as causal self-attention
        kwargs.setdefault("causal", True)
    arrays = bound.init_arrays(jax.random.key(0), heads=q.shape[1], kv_heads=k.shape[1], d_k=q.shape[2], d_v=v.shape[2])
    return bound(q, k, v, arrays=arrays, **kwargs)


@pytest.fixture(params=["checks on", "checks off"])
def runtime_checks(request):
    """Run with the jaxtyping checks of the suite, and as a user without them."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", request.param == "checks off")
    yield request.param
    jaxtyping.config.update("jaxtyping_disable", before)


@pytest.mark.parametrize("name", NAMES)
def test_integer_inputs_are_refused_not_rounded_to_zero(name, runtime_checks):
    q = jnp.ones((8, 2, 4), jnp.int32)
    if runtime_checks == "checks on":  # the annotation (Float) refuses them first
        with pytest.raises((ValueError, TypeError)):
            call(name, q, q, q)
        return
    with pytest.raises(ValueError, match="int32"):
        call(name, q, q, q)
    with pytest.raises(ValueError, match="int32"):
        call(name, q.astype(jnp.float32), q.astype(jnp.float32), q)


@pytest.mark.parametrize("name", NAMES)
def test_empty_sequence_is_a_clear_error(name, runtime_checks):
    empty = jnp.zeros((0, 2, 4))
    with pytest.raises(ValueError, match=r"shape \(0, 2, 4\)"):
        call(name, empty, empty, empty)


@pytest.mark.parametrize("name", NAMES)
def test_numpy_inputs_and_masks_are_accepted(name):
    """Users pass numpy arrays (a mask from np.arange); the annotations must accept them
    (the suite runs with runtime checks on) and give what jax arrays give. The arrays are
    closed over, so under jit the op still sees numpy (one compilation, not op-by-op)."""
    q, k, v = (np.asarray(x) for x in qkv(0, 12))
    kwargs = {"kv_mask": np.arange(12) < 9} if registry.get(name).supports_kv_mask else {}
    as_jax = {n: jnp.asarray(x) for n, x in kwargs.items()}
    out, expected = jax.jit(
        lambda: (call(name, q, k, v, **kwargs), call(name, *map(jnp.asarray, (q, k, v)), **as_jax))
    )()
    assert_close(out, expected, atol=1e-6)


def test_softmax_takes_numpy_mask_and_bias():
    q, k, v = qkv(1, 6)
    mask, bias = np.tril(np.ones((6, 6), bool)), np.linspace(-1, 1, 36, dtype=np.float32).reshape(6, 6)
    out = ops.softmax_attention(np.asarray(q), np.asarray(k), np.asarray(v), mask=mask, bias=bias)
    assert_close(out, ops.softmax_attention(q, k, v, mask=jnp.asarray(mask), bias=jnp.asarray(bias)), atol=1e-6)
