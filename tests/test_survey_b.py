"""Survey models of issue 18 beyond the generic suite: ETC's global-local attention
(jxformers/ops/global_local.py) against a dense softmax built from the paper's four
masks and relative position labels; Image Transformer's 2-D local attention
(jxformers/ops/local.py) against the image geometry; TokenLearner and TokenFuser
(jxformers/nn/tokenlearner.py). Small shapes, one or two compilations per test."""


import jax
import jax.numpy as jnp
import masks
import numpy as np
import pytest
from conftest import assert_close, jitted_call, qkv

from jxformers import ops, registry
from jxformers.ops import softmax_attention

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6


call = jitted_call  # the op under jit, compiled once per static keywords


# ----------------------------------------------------------------------------- ETC


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
    assert_close(plain, softmax_attention(q, jnp.repeat(k, 2, 1), jnp.repeat(v, 2, 1), mask=jnp.asarray(mask)), atol=2e-5)
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


# ----------------------------------------------------------------------------- Image Transformer 2-D


def raster_reference(height, width, qh, qw, mh, mw):
    """Query block and memory block of every pixel in raster order, from the image:
    `allowed [pixels, pixels]` and the generation order (block raster) rank of each."""
    r, c = np.divmod(np.arange(height * width), width)
    top, left = (r // qh) * qh, (c // qw) * qw
    allowed = ((r[None, :] >= top[:, None] - mh) & (r[None, :] < top[:, None] + qh)
               & (c[None, :] >= left[:, None] - mw) & (c[None, :] < left[:, None] + qw + mw))
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
    out = call(ops.image_local_2d_attention, q[order], k[order], v[order], width=width, query_height=qh, query_width=qw,
               memory_height=mh, memory_width=mw, causal=causal)
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
    for (r, c), reads in {(0, 4): True, (1, 3): True, (3, 3): True, (0, 2): False, (4, 5): False, (2, 0): False}.items():
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


# ----------------------------------------------------------------------------- TokenLearner

import equinox as eqx  # noqa: E402
import optax  # noqa: E402

from jxformers import ModelConfig, build_model  # noqa: E402
from jxformers.nn.tokenlearner import TokenFuser, TokenLearner  # noqa: E402

TL_SMALL = dict(task="classify", vocab_size=7, num_layers=3, d_model=16, num_heads=4, d_ff=24, max_len=24)


@pytest.mark.parametrize("maps", ["sigmoid", "softmax"])
def test_token_learner_shapes_maps_and_padding(maps):
    learner = TokenLearner(16, 5, bottleneck=8, maps=maps, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (13, 16))
    mask = jnp.arange(13) < 9
    weights = learner.maps(x, mask)
    assert weights.shape == (5, 13)
    assert float(jnp.abs(weights[:, 9:]).max()) == 0.0  # padded tokens get zero weight
    if maps == "softmax":  # the authors' v1.1: each map is a distribution over the real tokens
        assert_close(weights.sum(-1), jnp.ones(5))
    else:  # eq. 1: gamma = sigmoid, rho = the average over the (real) tokens
        assert bool(jnp.all((weights[:, :9] > 0) & (weights[:, :9] < 1)))
    tokens = learner(x, mask)
    assert tokens.shape == (5, 16)
    pooled = weights @ x / (9 if maps == "sigmoid" else 1)
    assert_close(tokens, pooled, atol=1e-5)
    # Whatever sits in the padded tokens, the learned tokens are the same.
    assert_close(learner(x.at[9:].set(100.0), mask), tokens, atol=1e-5)
    assert float(jnp.abs(learner(x, jnp.zeros(13, bool))).max()) == 0.0  # all padding: zeros, not NaN


def test_token_fuser_maps_tokens_back_by_sigmoid_weights_of_the_original():
    fuser = TokenFuser(16, 4, key=jax.random.key(2))
    tokens = jax.random.normal(jax.random.key(3), (4, 16))
    original = jax.random.normal(jax.random.key(4), (11, 16))
    out = fuser(tokens, original)
    assert out.shape == (11, 16)
    mixed = fuser.mix.weight @ tokens  # a k x k mixing over the tokens
    spread = jax.nn.sigmoid(fuser.remap(fuser.norm(original)))
    assert_close(out, spread @ mixed, atol=1e-5)
    # Position j of the output reads only original[j] (and the tokens).
    assert_close(fuser(tokens, original.at[3].add(1.0))[4:], out[4:])


@pytest.mark.parametrize("fuse, pooling", [(False, "cls"), (True, "mean")])
def test_classifier_with_token_learner_is_padding_safe_and_trains(fuse, pooling):
    small = TL_SMALL | dict(num_layers=2, d_model=8, num_heads=2, d_ff=16)
    config = ModelConfig(**small, pooling=pooling, token_learner={"after_layer": 0, "num_tokens": 3, "fuse": fuse,
                                                                  "bottleneck": 8})
    model = build_model(config, key=jax.random.key(0))
    stage = model.encoder.token_learner
    assert len(stage.learners) == 1 and len(stage.fusers) == (1 if fuse else 0)
    tokens = jax.random.randint(jax.random.key(4), (8, 12), 1, 7)
    labels = jnp.any(tokens == 1, axis=1).astype(jnp.int32)
    mask = jnp.arange(12) < 9
    forward = eqx.filter_jit(lambda m, t, k: m(t, k))
    a = forward(model, tokens[0], mask)
    assert_close(forward(model, tokens[0].at[9:].set(2), mask), a, atol=1e-5)
    optimizer = optax.adam(3e-3)

    def loss_fn(model):
        logits = jax.vmap(lambda t: model(t, mask))(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    model2, opt_state, loss, grads = step(model, opt_state)
    assert np.isfinite(float(loss))
    learner_grads = jax.tree.leaves(grads.encoder.token_learner)
    assert learner_grads and all(bool(jnp.all(jnp.isfinite(g))) for g in learner_grads)
    assert max(float(jnp.abs(g).max()) for g in learner_grads) > 0  # the maps are trained
    assert float(step(model2, opt_state)[2]) < float(loss)


@pytest.mark.parametrize("extra, word", [
    (dict(task="lm"), "causal"),
    (dict(token_learner={"after_layer": 2, "num_tokens": 3}), "after_layer"),
    (dict(token_learner={"num_tokens": 3}), "after_layer"),
    (dict(token_learner={"after_layer": 0, "num_tokens": 0}), "num_tokens"),
    (dict(token_learner={"after_layer": 0, "num_tokens": 3, "maps": "relu"}), "maps"),
    (dict(token_learner={"after_layer": 0, "num_tokens": 3, "where": 1}), "where"),
    (dict(position="rope"), "position"),
    (dict(filters={1: 0.5}), "filters"),
])
def test_token_learner_config_errors(extra, word):
    values = TL_SMALL | {"token_learner": {"after_layer": 0, "num_tokens": 3}} | extra
    with pytest.raises(ValueError, match=word):
        ModelConfig(**values)
