"""The structured-pattern attentions of issue 33 against their papers, with numpy
references written from the papers (the generic suite checks the rest: padding,
causality, decoding, models): criss-cross attention (Huang et al. 2019, CCNet), the
Star-Transformer (Guo et al. 2019), the BP-Transformer (Ye et al. 2019) and BigBird's
random attention alone (Zaheer et al. 2020)."""

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, qkv

from jxformers import ModelConfig, build_model, ops

N, HEADS, KV_HEADS = 23, 4, 2  # GQA: two query heads per kv head


def softmax_rows(logits, allowed):
    """Row softmax of `logits` [..., q, k] over `allowed` (rows with no key: zeros)."""
    s = np.where(allowed, logits, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    e = np.where(allowed, np.exp(s - top), 0.0)
    total = e.sum(-1, keepdims=True)
    return e / np.where(total > 0, total, 1.0)


def dense(q, k, v, allowed):
    """Per query head h (kv head h // g) masked softmax attention; `allowed` is [n, m] or
    [heads, n, m]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    allowed = np.broadcast_to(allowed, (q.shape[1], q.shape[0], k.shape[0]))
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    for h in range(q.shape[1]):
        p = softmax_rows(q[:, h] @ k[:, h // g].T / np.sqrt(q.shape[2]), allowed[h])
        out[:, h] = p @ v[:, h // g]
    return out


def jit(op, **hyper_parameters):
    """The op under jit (eager calls run jaxtyping's checks on every inner call: slow)."""
    return jax.jit(functools.partial(op, **hyper_parameters))


@pytest.fixture(scope="module")
def inputs():
    q, k, v = qkv(0, N, heads=HEADS, kv_heads=KV_HEADS)
    return q, k, v, np.arange(N) < N - 4  # the last 4 tokens are padding


# ----------------------------------------------------------------------------- criss-cross


def criss_cross_mask(n, width, causal=False):
    r, c = np.arange(n) // width, np.arange(n) % width
    m = (r[:, None] == r[None, :]) | (c[:, None] == c[None, :])
    return m & (np.arange(n)[None, :] <= np.arange(n)[:, None]) if causal else m


def test_criss_cross_is_one_softmax_over_row_and_column(inputs):
    q, k, v, real = inputs
    for causal in (False, True):
        out = jit(ops.criss_cross_attention, width=5, causal=causal)(q, k, v, kv_mask=jnp.asarray(real))
        expected = dense(q, k, v, criss_cross_mask(N, 5, causal) & real[None, :])
        assert_close(out, expected, atol=2e-5)
    # W + H - 1 keys, itself once: (2, 3) reads its row's 5 and column 3's 4 (rows 0-3), 8 in all.
    assert criss_cross_mask(N, 5)[13].sum() == 5 + 4 - 1


def test_criss_cross_recurrence_applies_the_map_twice(inputs):
    q, k, v, real = inputs
    out = jit(ops.criss_cross_attention, width=5, recurrence=2)(q, k, v, kv_mask=jnp.asarray(real))
    allowed = criss_cross_mask(N, 5) & real[None, :]
    once = dense(q, k, v, allowed)  # per query head
    k_heads = np.repeat(np.asarray(k), HEADS // KV_HEADS, axis=1)
    twice = dense(q, k_heads, np.where(real[:, None, None], once, 0.0), allowed)
    assert_close(out, twice, atol=2e-5)
    # Every position reaches every other in two applications (the paper's R = 2).
    grad = jax.jit(jax.jacobian(lambda v: ops.criss_cross_attention(q, k, v, width=5, recurrence=2)[:, 0, 0]))(v)
    assert np.all(np.abs(np.asarray(grad)[:, :, 0, 0]) > 0)


def test_criss_cross_causal_recurrence_is_refused(inputs):
    q, k, v, _ = inputs
    with pytest.raises(ValueError, match="recurrence=1 .got 2"):
        ops.criss_cross_attention(q, k, v, width=5, recurrence=2, causal=True)


# ----------------------------------------------------------------------------- Star-Transformer


def star_reference(q, k, v, real, relay, causal=False):
    """One Star-Transformer cycle per head in float64 (Guo et al. 2019, Algorithm 1):
    the context of satellite i is [h_{i-1}; h_i; h_{i+1}; s], s the relay."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, heads, d = q.shape
    g = heads // k.shape[1]
    out = np.zeros((n, heads, v.shape[2]))
    for h in range(heads):
        qh, kh, vh = q[:, h], k[:, h // g], v[:, h // g]
        for i in range(n):
            pool = real & ((np.arange(n) <= i) if causal else True)
            s0_q, s0_k, s0_v = (x[pool].mean(0) for x in (qh, kh, vh))  # s0 = mean of the tokens
            if relay == "attended":  # s1 = Att(s0, [s0; H])
                keys = np.vstack([s0_k, kh[pool]])
                p = softmax_rows(keys @ s0_q / np.sqrt(d), np.ones(len(keys), bool))
                s_k, s_v = p @ keys, p @ np.vstack([s0_v, vh[pool]])
            else:
                s_k, s_v = s0_k, s0_v
            ring = [j for j in (i - 1, i, i + 1) if 0 <= j < n and real[j] and not (causal and j > i)]
            keys, values = np.vstack([kh[ring], s_k]), np.vstack([vh[ring], s_v])
            p = softmax_rows(keys @ qh[i] / np.sqrt(d), np.ones(len(keys), bool))
            out[i, h] = p @ values
    return out


@pytest.mark.parametrize("relay", ["attended", "mean"])
def test_star_equals_the_numpy_cycle(inputs, relay):
    q, k, v, real = inputs
    out = jit(ops.star_attention, relay=relay)(q, k, v, kv_mask=jnp.asarray(real))
    assert_close(out[real], star_reference(q, k, v, real, relay)[real], atol=2e-5)
    # Whatever the padding holds (the relay's query pools the queries too), real rows keep.
    nan_padding = [jnp.where(jnp.asarray(real)[:, None, None], x, jnp.nan) for x in (q, k, v)]
    assert_close(jit(ops.star_attention, relay=relay)(*nan_padding, kv_mask=jnp.asarray(real))[real], out[real])


def test_star_causal_relay_is_the_cumulative_mean(inputs):
    q, k, v, real = inputs
    out = jit(ops.star_attention, relay="mean", causal=True)(q, k, v, kv_mask=jnp.asarray(real))
    assert_close(out[real], star_reference(q, k, v, real, "mean", causal=True)[real], atol=2e-5)


def test_star_attended_relay_refuses_causal(inputs):
    q, k, v, _ = inputs
    with pytest.raises(ValueError, match="relay='attended' cannot be causal"):
        ops.star_attention(q, k, v, causal=True)


def test_star_attended_relay_trains_in_a_classifier():
    config = ModelConfig(
        task="classify",
        attention={"name": "star", "relay": "attended"},
        vocab_size=11,
        num_layers=1,
        d_model=8,
        num_heads=2,
        max_len=16,
    )
    model = build_model(config, key=jax.random.key(0))
    x = jnp.arange(12) % 11

    def loss(model):
        return jnp.sum(jnp.square(model(x, jnp.arange(12) < 10)))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves) and any(float(jnp.abs(g).max()) > 0 for g in leaves)


# ----------------------------------------------------------------------------- BP-Transformer


def spans(n, neighbours, causal):
    """bp_nodes as (level, first token, last token + 1) per token."""
    ids, levels = ops.bp_nodes(n, neighbours, causal)
    top = max(0, (n - 1).bit_length())
    offsets = np.concatenate([[0], np.cumsum([(1 << top) >> lv for lv in range(top + 1)])])
    return [
        [
            (int(lv), int((s - offsets[lv]) << lv), int((s - offsets[lv] + 1) << lv))
            for s, lv in zip(r, lr, strict=True)
            if s >= 0
        ]
        for r, lr in zip(ids, levels, strict=True)
    ]


@pytest.mark.parametrize("neighbours", [1, 2, 3])
def test_bp_nodes_partition_the_sequence(neighbours):
    n = 37
    for causal in (False, True):
        for i, nodes in enumerate(spans(n, neighbours, causal)):
            covered = np.zeros(64, int)
            for _, lo, hi in nodes:
                covered[lo:hi] += 1
            want = np.arange(n) <= i if causal else np.ones(n, bool)
            np.testing.assert_array_equal(covered[:n], want.astype(int))  # each token once, the future never
            assert not covered[n:].any() or not causal
            left = [(lv, lo) for lv, lo, hi in nodes[1:] if hi <= i]
            # fine near, coarse far: levels never shrink going out; k (or k + 1) a level
            assert [lv for lv, _ in left] == sorted(lv for lv, _ in left)
            assert all(sum(1 for lv, _ in left if lv == level) <= neighbours + 1 for level in range(7))
            assert len(nodes) <= 1 + 2 * (neighbours + 1) * 6
            near = [lo for lv, lo in left if lv == 0]
            assert sorted(near, reverse=True)[: min(i, neighbours)] == list(
                range(i - 1, i - 1 - min(i, neighbours), -1)
            )


def test_bp_nodes_follow_the_papers_rule_by_hand():
    # 16 tokens, token 5. k = 1, left: token 4; at level 1 span [2, 4); 0 is then a left
    # child (its parent [0, 4) would overlap), so level 2's slot takes span [0, 2).
    # Right: token 6; 7 is a right child, so level 1's slot takes token 7; level 2: [8, 12);
    # level 3's slot: [12, 16), the uncovered half of [8, 16).
    k1 = spans(16, 1, False)[5]
    assert k1 == [(0, 5, 6), (0, 4, 5), (1, 2, 4), (1, 0, 2), (0, 6, 7), (0, 7, 8), (2, 8, 12), (2, 12, 16)]
    # k = 2: tokens 4, 3; 2 is a left child: level 1 takes it, then [0, 2). Right: 6, 7;
    # level 1: [8, 10), [10, 12); level 2: [12, 16).
    k2 = spans(16, 2, False)[5]
    left = [(0, 5, 6), (0, 4, 5), (0, 3, 4), (0, 2, 3), (1, 0, 2)]  # itself first
    assert k2 == left + [(0, 6, 7), (0, 7, 8), (1, 8, 10), (1, 10, 12), (2, 12, 16)]
    assert spans(16, 2, True)[5] == left  # causal: the left side alone


@pytest.mark.parametrize("causal", [False, True])
def test_bp_equals_the_numpy_span_attention(inputs, causal):
    q, k, v, real = inputs
    out = jit(ops.bp_attention, neighbours=2, causal=causal)(q, k, v, kv_mask=jnp.asarray(real))
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    g = HEADS // KV_HEADS
    expected = np.zeros((N, HEADS, vn.shape[2]))
    for i, nodes in enumerate(spans(N, 2, causal)):
        members = [[j for j in range(lo, min(hi, N)) if real[j]] for _, lo, hi in nodes]
        members = [m for m in members if m]  # a span of padding alone is no node
        for h in range(HEADS):
            keys = np.stack([kn[m, h // g].mean(0) for m in members])  # span node: the mean of its tokens
            values = np.stack([vn[m, h // g].mean(0) for m in members])
            p = softmax_rows(keys @ qn[i, h] / np.sqrt(qn.shape[2]), np.ones(len(keys), bool))
            expected[i, h] = p @ values
    assert_close(out[real], expected[real], atol=2e-5)


# ----------------------------------------------------------------------------- random blocks


def test_random_per_head_equals_a_dense_mask_per_head(inputs):
    q, k, v, real = inputs
    b, nb = 4, -(-N // 4)
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, nb, (HEADS, nb, 3))
    blocks[0, 0] = (2, 2, -1)  # a block listed twice counts once; -1 is none
    blocks[1, 1] = (-1, -1, -1)  # no block: the row is zero
    out = jit(ops.random_attention, block_size=b)(
        q, k, v, random_blocks=jnp.asarray(blocks, jnp.int32), kv_mask=jnp.asarray(real)
    )
    allowed = np.zeros((HEADS, N, N), bool)
    for h in range(HEADS):
        for i in range(N):
            for c in blocks[h, i // b]:
                if c >= 0:
                    allowed[h, i, c * b : (c + 1) * b] = True
    allowed &= real[None, None, :]
    assert_close(out, dense(q, k, v, allowed), atol=2e-5)
    assert not np.any(np.asarray(out)[4:8, 1])
    # Drawn per head: the heads' patterns differ.
    drawn = np.asarray(jit(ops.random_attention_blocks, seq_len=64, heads=HEADS, block_size=4)(jax.random.key(1)))
    assert drawn.shape == (HEADS, 16, 3) and len({d.tobytes() for d in drawn}) == HEADS


def test_random_shared_draw_is_bigbirds_random_part():
    key = jax.random.key(7)
    settings = dict(block_size=4, num_random_blocks=2, num_window_blocks=3, num_global_blocks=2)
    shared = jit(ops.random_attention_blocks, seq_len=40, heads=2, per_head=False, **settings)(key)
    bigbird = jit(ops.bigbird_random_blocks, seq_len=40, **settings)(key)
    np.testing.assert_array_equal(np.asarray(shared), np.broadcast_to(np.asarray(bigbird), (2, 10, 2)))
    # Alone (no window or global blocks avoided), every block may be drawn, the own one too.
    alone = np.asarray(jit(ops.random_attention_blocks, seq_len=40, heads=8, block_size=4, num_random_blocks=2)(key))
    assert (alone >= 0).all() and any((alone[h, a] == a).any() for h in range(8) for a in range(10))


@pytest.mark.parametrize(
    "name, refused, allowed, words",
    [("star", {}, {"relay": "mean"}, "relay='attended'"), ("criss_cross", {"recurrence": 2}, {}, "recurrence=1")],
)
def test_causal_models_refuse_settings_that_cannot_be_causal_at_config_time(name, refused, allowed, words):
    """The registration's causal_refusal: a language model is refused when configured,
    before any model is built, and the same settings pass in an encoder."""
    tiny = dict(vocab_size=11, max_len=16, d_model=8, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match=f"cannot be causal.*{re.escape(words)}"):
        ModelConfig(task="lm", attention=name, attention_kwargs=refused, **tiny)
    ModelConfig(task="classify", num_classes=2, attention=name, attention_kwargs=refused, **tiny)
    ModelConfig(task="lm", attention=name, attention_kwargs=allowed, **tiny)
