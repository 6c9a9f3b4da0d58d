"""ETC's global-local attention (jxformers/ops/global_local.py) beyond the generic suite:
against a dense softmax built from the paper's four masks and relative position labels,
its hard masks and its refusals. Small shapes, one or two compilations per test."""

import jax
import jax.numpy as jnp
import masks
import numpy as np
import pytest
from conftest import JittedOps, assert_close, jitted_call, qkv

from jxformers import registry
from jxformers.ops import softmax_attention

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


def etc_dense(q, k, v, hp, relative_keys, kv_mask=None):
    """The paper's attention written densely with numpy: the four masks (tests/masks.py)
    and, per pair, the relative label (clipped distance in g2g and l2l, own/other
    segment in g2l and l2g) whose vector a is added to the key (Shaw et al.)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, heads, d = q.shape
    k, v = (np.repeat(x, heads // x.shape[1], axis=1) for x in (k, v))
    g, kd = hp["num_global"], hp["max_distance"]
    mask = masks.etc(n, hp, {}, False)[0]
    if kv_mask is not None:
        mask = mask & np.asarray(kv_mask)[None, :]
    logits = np.einsum("ihd,jhd->hij", q, k)
    if kd > 0:
        label = np.zeros((n, n), int)
        pos = np.arange(n)
        label[:g, :g] = np.clip(pos[None, :g] - pos[:g, None], -kd, kd) + kd
        label[g:, g:] = np.clip(pos[None, g:] - pos[g:, None], -kd, kd) + kd
        own = ((pos[g:] - g) // hp["global_every"])[:, None] == pos[None, :g]
        label[g:, :g] = 2 * kd + 1 + own
        label[:g, g:] = 2 * kd + 1 + own.T
        a = np.asarray(relative_keys, np.float64)[label]  # [n, n, heads, d]
        logits = logits + np.einsum("ihd,ijhd->hij", q, a)
    logits = np.where(mask[None], logits / np.sqrt(d), -np.inf)
    peak = np.max(logits, axis=-1, keepdims=True)
    p = np.where(mask[None], np.exp(logits - np.where(np.isfinite(peak), peak, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("hij,jhd->ihd", p, v)


ETC_CASES = [
    {"num_global": 3, "local_radius": 2, "global_every": 5, "max_distance": 3},
    {"num_global": 4, "local_radius": 5, "global_every": 4, "max_distance": 2, "hard_g2l": True},
    {"num_global": 2, "local_radius": 1, "global_every": 7, "max_distance": 4, "hard_l2g": True, "hard_g2l": True},
    {"num_global": 1, "local_radius": 40, "global_every": 16, "max_distance": 0},
]


@pytest.mark.parametrize("hp", ETC_CASES, ids=lambda hp: "-".join(f"{k}={v}" for k, v in hp.items()))
@pytest.mark.parametrize("padded", [False, True])
def test_etc_equals_the_dense_softmax_with_relative_labels(hp, padded):
    hp = registry.bind("etc", **hp).hyper_parameters
    n = 29
    q, k, v = qkv(3, n)
    arrays = registry.bind("etc", **hp).init_arrays(jax.random.key(4), heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)
    if arrays:  # the initial vectors are small (std 0.02): make the labels count
        arrays = {"relative_keys": arrays["relative_keys"] * 50.0}
    kv_mask = (jnp.arange(n) < n - 6).at[1].set(False) if padded else None
    out = call(ops.etc_attention, q, k, v, kv_mask=kv_mask, **hp, **arrays)
    expected = etc_dense(q, k, v, hp, arrays.get("relative_keys"), None if kv_mask is None else np.asarray(kv_mask))
    assert_close(out, expected, atol=2e-5)


def test_etc_relative_labels_change_the_output_and_zero_vectors_give_the_masked_softmax():
    hp = dict(num_global=3, local_radius=3, global_every=6, max_distance=2)
    q, k, v = qkv(5, 24)
    zero = jnp.zeros((ops.etc_relative_labels(2), HEADS, D_K))
    plain = call(ops.etc_attention, q, k, v, relative_keys=zero, **hp)
    mask = masks.etc(24, hp | {"hard_g2l": False, "hard_l2g": False}, {}, False)[0]
    assert_close(
        plain, softmax_attention(q, jnp.repeat(k, 2, 1), jnp.repeat(v, 2, 1), mask=jnp.asarray(mask)), atol=2e-5
    )
    # One label's vector moved (distance +1 in l2l and g2g) changes the output, and only where it is used.
    moved = call(ops.etc_attention, q, k, v, relative_keys=zero.at[2 + 1].set(1.0), **hp)
    assert not np.allclose(moved, plain, atol=1e-3)


def test_etc_hard_masks_tie_tokens_to_their_segment():
    hp = dict(num_global=3, local_radius=1, global_every=5, max_distance=0, hard_g2l=True, hard_l2g=True)
    q, k, v = qkv(6, 20)
    out = call(ops.etc_attention, q, k, v, **hp)
    # Long token 7 (position 10) is in segment 1: changing global token 0's or 2's value,
    # or a long token of another segment outside its radius, leaves it unchanged.
    changed = v.at[0].set(9.0).at[2].set(9.0).at[3 + 14].set(9.0)
    other = call(ops.etc_attention, q, k, changed, **hp)
    assert_close(other[3 + 7], out[3 + 7])
    # Global token 1 reads long tokens 5..9 only: long token 12 is not among them, long token 6 is.
    assert_close(call(ops.etc_attention, q, k, v.at[3 + 12].set(9.0), **hp)[1], out[1])
    assert not np.allclose(call(ops.etc_attention, q, k, v.at[3 + 6].set(9.0), **hp)[1], out[1])


def test_etc_refuses_causal_and_bad_inputs():
    q, k, v = qkv(0, 16)
    with pytest.raises(ValueError, match="causal"):
        ops.etc_attention(q, k, v, causal=True, max_distance=0)
    with pytest.raises(ValueError, match="causal"):
        registry.bind("etc", max_distance=0)(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"relative_keys.*\(9, 4, 8\)"):
        ops.etc_attention(q, k, v, max_distance=3, relative_keys=jnp.zeros((7, HEADS, D_K)))
    with pytest.raises(ValueError, match="relative_keys"):
        ops.etc_attention(q, k, v, max_distance=3)
    with pytest.raises(ValueError, match=r"num_global \(16\).*seq \(16\)"):
        ops.etc_attention(q, k, v, num_global=16, max_distance=0)
    with pytest.raises(ValueError, match="hard_g2l"):
        registry.bind("etc", max_distance=0, hard_g2l=1)
