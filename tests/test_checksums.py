"""jxformers.train.checksums: the numbers a checkpoint stores to find damage (issue 37
item 5). The host (NumPy) and device (jitted) paths agree on every dtype a train state
holds; any single flipped bit changes an array's checksum; the data digest does not
depend on the form or key order grain gives the iterator state in."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jxformers.train.checksums import data_digest, state_checksums

STATE = {
    "f32": jax.random.normal(jax.random.key(0), (13, 7)),
    "bf16": jax.random.normal(jax.random.key(1), (5,), jnp.bfloat16),
    "f16": jnp.linspace(-2, 2, 9, dtype=jnp.float16),
    "i32": jnp.arange(-4, 5, dtype=jnp.int32),
    "i8": jnp.arange(-3, 3, dtype=jnp.int8),
    "u8": jnp.arange(250, 256, dtype=jnp.uint8),
    "bool": jnp.array([True, False, True]),
    "scalar": jnp.int32(12),
    "raw key": jax.random.PRNGKey(7),
    "typed key": jax.random.key(7),
}


def test_host_and_device_checksums_agree_on_every_dtype():
    assert state_checksums(STATE, on_host=True) == state_checksums(STATE, on_host=False)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["f32", "bf16", "f16", "i32", "i8", "u8"]), data=st.data())
def test_any_single_flipped_bit_changes_the_checksum(name, data):
    x = np.array(STATE[name])
    raw = x.view(np.uint8).ravel()
    byte = data.draw(st.integers(0, raw.size - 1), label="byte")
    bit = data.draw(st.integers(0, 7), label="bit")
    flipped = raw.copy()
    flipped[byte] ^= 1 << bit
    damaged = flipped.view(x.dtype).reshape(x.shape)
    assert state_checksums({name: damaged}, on_host=True) != state_checksums({name: x}, on_host=True)


def test_the_data_digest_reads_bytes_text_or_a_dict_in_any_key_order():
    state = {"version": 2, "last_seen_indices": {"0": 95}, "worker_count": 0}
    reordered = json.dumps(dict(reversed(list(state.items()))), indent=4)
    digests = {data_digest(state), data_digest(reordered), data_digest(reordered.encode())}
    assert len(digests) == 1
    assert data_digest({**state, "last_seen_indices": {"0": 87}}) not in digests
