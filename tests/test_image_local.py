"""The Image Transformer's 2-D local attention (`image_local_2d`, jxformers/ops/local.py)
beyond the generic suite: against the image geometry (query and memory blocks in block
raster order), which pixels it reads, and decoding from a ring buffer. Small shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, jitted_call, qkv

from jxformers import registry
from jxformers.ops import softmax_attention

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


def raster_reference(height, width, qh, qw, mh, mw):
    """Query block and memory block of every pixel in raster order, from the image:
    `allowed [pixels, pixels]` and the generation order (block raster) rank of each."""
    r, c = np.divmod(np.arange(height * width), width)
    top, left = (r // qh) * qh, (c // qw) * qw
    allowed = (
        (r[None, :] >= top[:, None] - mh)
        & (r[None, :] < top[:, None] + qh)
        & (c[None, :] >= left[:, None] - mw)
        & (c[None, :] < left[:, None] + qw + mw)
    )
    blocks_per_row = width // qw
    rank = ((r // qh) * blocks_per_row + c // qw) * (qh * qw) + (r % qh) * qw + c % qw
    return allowed, rank


@pytest.mark.parametrize("causal", [False, True])
def test_image_local_2d_on_an_image_equals_the_papers_blocks(causal):
    height, width, qh, qw, mh, mw = 6, 8, 2, 4, 3, 2
    allowed, rank = raster_reference(height, width, qh, qw, mh, mw)
    if causal:  # masked attention: only pixels generated no later than the query
        allowed = allowed & (rank[None, :] <= rank[:, None])
    q, k, v = qkv(7, height * width)  # raster order
    order = ops.block_raster_order(height, width, query_height=qh, query_width=qw)
    np.testing.assert_array_equal(np.argsort(order), rank)
    out = call(
        ops.image_local_2d_attention,
        q[order],
        k[order],
        v[order],
        width=width,
        query_height=qh,
        query_width=qw,
        memory_height=mh,
        memory_width=mw,
        causal=causal,
    )
    back = jnp.zeros_like(out).at[order].set(out)
    expected = softmax_attention(q, k, v, mask=jnp.asarray(allowed))
    assert_close(back, expected, atol=2e-5)


def test_image_local_2d_memory_is_above_left_and_right_never_below():
    height, width = 6, 8
    hp = dict(width=width, query_height=2, query_width=4, memory_height=2, memory_width=1)
    order = ops.block_raster_order(height, width, query_height=2, query_width=4)
    q, k, v = qkv(8, height * width)
    q, k, v = q[order], k[order], v[order]
    out = call(ops.image_local_2d_attention, q, k, v, **hp)
    seq_of = {int(p): i for i, p in enumerate(order)}  # raster pixel -> sequence index
    query = seq_of[2 * width + 4]  # pixel (2, 4): query block rows 2-3, columns 4-7
    for (r, c), reads in {
        (0, 4): True,
        (1, 3): True,
        (3, 3): True,
        (0, 2): False,
        (4, 5): False,
        (2, 0): False,
    }.items():
        moved = call(ops.image_local_2d_attention, q, k, v.at[seq_of[r * width + c]].add(5.0), **hp)
        assert np.allclose(moved[query], out[query]) != reads, (r, c)


def test_image_local_2d_decodes_with_a_ring_buffer_shorter_than_the_sequence():
    hp = dict(width=4, query_height=1, query_width=2, memory_height=1, memory_width=1)
    bound = registry.bind("image_local_2d", **hp)
    n = 24
    q, k, v = qkv(9, n)
    state = bound.init_state(max_len=n, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)
    assert state.k.shape[0] == 8 < n  # one block row behind plus a block: (2 + 1 + 1) * 2 pixels

    def step(state, x):
        out, state = bound.decode_step(*x, state)
        return state, out

    _, decoded = jax.lax.scan(step, state, (q, k, v))
    assert_close(decoded, call(ops.image_local_2d_attention, q, k, v, causal=True, **hp), atol=2e-5)


def test_image_local_2d_refuses_bad_geometry():
    q, k, v = qkv(0, 16)
    with pytest.raises(ValueError, match=r"query_width \(3\).*width \(8\)"):
        ops.image_local_2d_attention(q, k, v, width=8, query_width=3)
    with pytest.raises(ValueError, match=r"query_height \(4\).*height \(6\)"):
        ops.block_raster_order(6, 8, query_height=4, query_width=4)
    with pytest.raises(ValueError, match="memory_width"):
        ops.image_local_2d_attention(q, k, v, width=8, query_width=4, memory_width=-1)
