"""Set Transformer (ISAB, PMA), Luna and Perceiver as their papers define them, built
from ModelConfig (architecture, pooling) and checked against hand-written references and
their symmetries: equivariance / invariance to the input's order, padding, causality."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import JittedOps, assert_close
from hypothesis import given
from hypothesis import strategies as st
from suites import decode_all, finite_grads, forward, loss_grad

from jxformers import ModelConfig, build_model, registry
from jxformers.nn import Encoder, LayerNorm
from jxformers.nn.luna import LunaStack
from jxformers.nn.set_transformer import ISAB, PMA
from jxformers.tools import cli

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

D, HEADS, D_FF = 8, 2, 12
N = 8  # set size in the property tests (one shape, one compilation)
PERMUTATIONS = st.permutations(range(N)).map(jnp.array)
TOKENS = st.lists(st.integers(1, 12), min_size=N, max_size=N).map(jnp.array)
MASKS = st.lists(st.booleans(), min_size=N, max_size=N).filter(any).map(lambda m: jnp.array(m, bool))
SMALL = dict(vocab_size=13, num_layers=2, d_model=D, num_heads=HEADS, d_ff=D_FF, max_len=16, memory_size=3)


def jiggle(module, seed=0):
    """Every float array moved off its initial value (LayerNorm gains of 1 and biases of 0
    would hide a misplaced norm)."""
    leaves, tree = jax.tree.flatten(module)
    keys = iter(jax.random.split(jax.random.key(seed), len(leaves)))
    moved = [x + 0.2 * jax.random.normal(next(keys), x.shape) if eqx.is_inexact_array(x) else x for x in leaves]
    return jax.tree.unflatten(tree, moved)


@eqx.filter_jit
def call(f, *args, **kwargs):
    """f(*args, **kwargs) compiled: eager op-by-op dispatch with runtime type checks is slow."""
    return f(*args, **kwargs)


def normal(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


# ----------------------------------------------------------------------------- references


def ref_linear(layer, x):
    return x @ layer.weight.T + layer.bias[None]


def ref_layernorm(norm, x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * norm.weight[None] + norm.bias[None]


def ref_multihead(att, x, y, y_mask=None):
    """Multihead(X, Y, Y) = concat_h softmax(X Wq_h (Y Wk_h)^T / sqrt(d_h)) Y Wv_h, then W_o."""
    heads, dh = att.num_heads, att.d_head
    q = ref_linear(att.q_proj, x).reshape(len(x), heads, dh)
    k = ref_linear(att.k_proj, y).reshape(len(y), heads, dh)
    v = ref_linear(att.v_proj, y).reshape(len(y), heads, dh)
    logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
    if y_mask is not None:
        logits = jnp.where(y_mask[None, None, :], logits, -jnp.inf)
    out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, -1), v)
    return ref_linear(att.o_proj, out.reshape(len(x), heads * dh))


def ref_pack(pack, p, x, x_mask):
    """Luna's pack: Multihead(P, X, X) without an output projection."""
    heads = pack.num_heads
    q, k, v = (
        ref_linear(proj, z).reshape(len(z), heads, -1)
        for proj, z in ((pack.q_proj, p), (pack.k_proj, x), (pack.v_proj, x))
    )
    logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    logits = jnp.where(x_mask[None, None, :], logits, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, -1), v).reshape(p.shape)


def ref_rff(ffn, x):
    return ref_linear(ffn.w_out, jax.nn.gelu(ref_linear(ffn.w_in, x)))


def ref_mab(mab, x, y, y_mask=None):
    """MAB(X, Y) = LayerNorm(H + rFF(H)), H = LayerNorm(X + Multihead(X, Y, Y))."""
    h = ref_layernorm(mab.norms[0], x + ref_multihead(mab.attention, x, y, y_mask))
    return ref_layernorm(mab.norms[1], h + ref_rff(mab.ffn, h))


# ----------------------------------------------------------------------------- Set Transformer


def test_isab_is_two_full_mabs_through_the_inducing_points():
    isab = jiggle(ISAB(D, HEADS, num_inducing=3, d_ff=D_FF, key=jax.random.key(0)))
    x, mask = normal(1, 7, D), jnp.array([1, 1, 0, 1, 1, 1, 0], bool)
    h = call(ref_mab, isab.mab_in, isab.inducing, x, mask)  # H = MAB(I, X)
    assert_close(call(isab, x, kv_mask=mask), call(ref_mab, isab.mab_out, x, h), atol=2e-5)  # ISAB(X) = MAB(X, H)


def test_pma_is_a_mab_from_the_seeds_to_rff_of_the_set_and_ignores_padding():
    pma = jiggle(PMA(D, HEADS, num_seeds=2, d_ff=D_FF, key=jax.random.key(0)))
    z, mask = normal(2, 6, D), jnp.array([1, 0, 1, 1, 0, 1], bool)
    pooled = call(pma, z, mask)
    assert pooled.shape == (2, D)
    reference = call(lambda pma, z: ref_mab(pma.mab, pma.seeds, ref_rff(pma.rff, z), mask), pma, z)
    assert_close(pooled, reference, atol=2e-5)
    assert_close(pooled, call(pma, z[np.asarray(mask)]), atol=2e-5)  # as if the padded elements were not there
    assert_close(call(pma, z[::-1], mask[::-1]), pooled, atol=2e-5)  # order-invariant


@functools.cache
def set_classifier():
    config = ModelConfig(architecture="isab", position="none", pooling="pma", pma_seeds=2, **SMALL)
    return jiggle(build_model(config, key=jax.random.key(0)))


@given(tokens=TOKENS, perm=PERMUTATIONS, mask=MASKS)
def test_isab_encoder_is_permutation_equivariant_and_pma_invariant(tokens, perm, mask):
    model = set_classifier()
    h, _ = call(model.encoder, tokens)
    h_perm, _ = call(model.encoder, tokens[perm])
    assert_close(h_perm, h[perm], atol=2e-5)
    assert_close(forward(model, tokens[perm]), forward(model, tokens), atol=2e-5)
    # padding anywhere (not only a padded tail) is never read
    assert_close(forward(model, jnp.where(mask, tokens, 7), mask), forward(model, tokens, mask), atol=2e-5)
    assert_close(forward(model, tokens[perm], mask[perm]), forward(model, tokens, mask), atol=2e-5)


def test_set_classifier_has_finite_gradients():
    tokens = jnp.arange(N) + 1
    assert finite_grads(loss_grad(set_classifier(), tokens, tokens % 3 > 0))


# ----------------------------------------------------------------------------- Luna


def test_luna_carries_the_packed_sequence_from_layer_to_layer():
    stack = jiggle(LunaStack(D, HEADS, num_layers=2, packed_len=3, d_ff=D_FF, key=jax.random.key(0)))
    x, mask = normal(3, 6, D), jnp.array([1, 1, 1, 1, 0, 0], bool)
    out, seen = call(stack.layers, x, kv_mask=mask)
    first, second = stack.blocks
    assert_close(seen[0], stack.packed, atol=0)

    def reference(first, p0):
        y_p = ref_pack(first.pack, p0, x, mask)  # Pack(P, X): P's queries read X
        x_a = ref_layernorm(first.norms[0], x + ref_multihead(first.unpack, x, y_p))  # unpack: X reads Y_P
        x1 = ref_layernorm(first.norms[2], x_a + ref_rff(first.ffn, x_a))
        return x1, ref_layernorm(first.norms[1], p0 + y_p)  # P_1 = LayerNorm(P_0 + Y_P)

    x1, p1 = call(reference, first, stack.packed)
    assert_close(seen[1], p1, atol=2e-5)  # layer 1's packed output after its own norm is layer 2's P ...
    assert_close(out, call(second, x1, p1, kv_mask=mask)[0], atol=2e-5)
    assert not np.allclose(out, call(second, x1, stack.packed, kv_mask=mask)[0], atol=1e-3)  # ... and it matters


def test_luna_causal_pack_is_the_mean_over_each_prefix():
    pack_q, k, v = normal(4, 3, 2, 4), normal(5, 7, 2, 4), normal(6, 7, 2, 5)
    mask = jnp.array([1, 1, 0, 1, 1, 0, 1], bool)
    out = call(ops.luna_causal_pack, pack_q, k, v, kv_mask=mask)
    f = lambda s: jnp.log1p(jnp.exp(s * math.log(2.0))) / math.log(2.0)  # noqa: E731  f(0) = 1
    for t in range(7):
        real = [j for j in range(t + 1) if mask[j]]
        expected = sum(f(jnp.einsum("lhd,hd->lh", pack_q, k[j]) / 2.0)[..., None] * v[j][None] for j in real)
        assert_close(out[t], expected / max(len(real), 1) if real else jnp.zeros((3, 2, 5)), atol=1e-5)


def luna_lm(**extra):
    config = ModelConfig(architecture="luna", task="lm", **SMALL | extra)
    return jiggle(build_model(config, key=jax.random.key(1)))


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_causal_luna_never_reads_the_future_and_decodes_recurrently(placement):
    model = luna_lm(norm_placement=placement, num_layers=1)
    tokens = jnp.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    logits = forward(model, tokens)
    changed = forward(model, tokens.at[6:].set(jnp.array([7, 7, 8, 8])))
    assert_close(changed[:6], logits[:6], atol=1e-5)
    assert not np.allclose(changed[6:], logits[6:], atol=1e-3)
    assert_close(decode_all(model, tokens), logits, atol=3e-5, rtol=1e-4)
    if placement == "post":  # the paper's; the pre-norm variant runs the same ops
        assert finite_grads(loss_grad(model, tokens))
    assert sum(x.size for x in jax.tree.leaves(model.init_decode_state(4))) == sum(
        x.size for x in jax.tree.leaves(model.init_decode_state(16))
    )  # a fixed-size recurrent state


def test_luna_classifier_ignores_padding():
    model = jiggle(build_model(ModelConfig(architecture="luna", **SMALL), key=jax.random.key(2)))
    tokens, mask = jnp.array([3, 1, 4, 1, 5, 9, 2, 6]), jnp.arange(8) < 5
    assert_close(forward(model, jnp.where(mask, tokens, 0), mask), forward(model, tokens, mask), atol=2e-5)


# ----------------------------------------------------------------------------- Perceiver


def perceiver(**extra):
    config = ModelConfig(architecture="perceiver", position="none", pooling="mean", **SMALL | extra)
    return build_model(config, key=jax.random.key(3))


@functools.cache
def repeated_perceiver():
    return jiggle(perceiver(cross_attends=3))


def test_perceiver_repeats_share_weights_after_the_first_cross_attend():
    encoder = repeated_perceiver().encoder
    assert len(encoder.cross) == 2 and len(encoder.tower) == SMALL["num_layers"]
    assert encoder.cross[0].attention.num_heads == 1  # the paper's single-head cross-attention
    tokens = jnp.arange(6) + 1
    assert_close(
        call(repeated_perceiver(), tokens),
        call(repeated_perceiver(), jnp.concatenate([tokens, tokens[:2]]), jnp.arange(N) < 6),
        atol=2e-5,
    )


@given(tokens=TOKENS, perm=PERMUTATIONS, mask=MASKS)
def test_perceiver_reads_the_input_as_a_set_and_ignores_padding(tokens, perm, mask):
    model = repeated_perceiver()
    assert_close(forward(model, tokens[perm]), forward(model, tokens), atol=2e-5)
    assert_close(forward(model, jnp.where(mask, tokens, 0), mask), forward(model, tokens, mask), atol=2e-5)


def test_perceiver_trains_on_a_toy_set_task():
    """Is token 1 in the set? A few Adam steps lower the loss, with finite values."""
    model = perceiver(num_layers=1, vocab_size=6)
    tokens = jax.random.randint(jax.random.key(4), (32, 8), 1, 6)
    labels = jnp.any(tokens == 1, axis=1).astype(jnp.int32)
    optimizer = optax.adam(3e-3)

    def loss_fn(model):
        logits = jax.vmap(model)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for _ in range(25):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


# ----------------------------------------------------------------------------- reaching them


@pytest.mark.parametrize(
    "extra, word",
    [
        (dict(architecture="isab", task="lm"), "serves tasks"),
        (dict(architecture="perceiver", task="seq2seq"), "serves tasks"),
        (dict(architecture="perceiver"), "CLS"),
        (dict(pooling="pma", task="lm"), "pma"),
        (dict(pma_seeds=2), "pma_seeds"),
        (dict(cross_attends=2), "cross_attends"),
        (dict(memory_size=8), "memory_size"),
        (dict(architecture="isab", pooling="mean", attention="performer"), "own softmax"),
        (dict(architecture="luna", position="rope"), "positions"),
        (dict(architecture="luna", kv_heads=1), "kv_heads"),
        (dict(architecture="set_transformer"), "stack kind must be one of"),
        (dict(stack={"kind": "isab", "num_latents": 4}), r"unknown setting\(s\) \['num_latents'\]"),
        (dict(stack="transformer_xl", task="lm", embedding={"position": "learned"}), "position 'none'"),
    ],
)
def test_invalid_combinations_are_refused(extra, word):
    with pytest.raises(ValueError, match=word):
        ModelConfig(**extra)


def test_modules_refuse_what_they_cannot_wire():
    isab = ISAB(D, HEADS, num_inducing=2, d_ff=D_FF, key=jax.random.key(0))
    embedding = build_model(ModelConfig(architecture="isab", **SMALL), key=jax.random.key(0)).encoder.embedding
    with pytest.raises(ValueError, match="reversible"):
        Encoder(embedding, [isab], LayerNorm(D), max_len=16, use_cls=False, reversible=True, key=jax.random.key(0))
    with pytest.raises(ValueError, match="num_inducing"):
        ISAB(D, HEADS, num_inducing=0, d_ff=D_FF, key=jax.random.key(0))
    with pytest.raises(ValueError, match="packed_len"):
        LunaStack(D, HEADS, num_layers=1, packed_len=0, d_ff=D_FF, key=jax.random.key(0))
    with pytest.raises(ValueError, match="only causal"):
        LunaStack(D, HEADS, num_layers=1, packed_len=2, d_ff=D_FF, key=jax.random.key(0)).init_decode_state(4)


def test_norm_placement_defaults_to_the_papers():
    assert ModelConfig().norm.placement == "pre"
    assert ModelConfig(stack="isab").norm.placement == "post"
    assert ModelConfig(stack="luna", norm={"placement": "pre"}).norm.placement == "pre"
    assert ModelConfig.from_dict(ModelConfig(stack="luna").to_dict()).norm.placement == "post"


def test_retrieval_towers_and_the_list_command(capsys):
    for arch, pooling, seeds in [("isab", "pma", 2), ("perceiver", "mean", 1)]:
        model = build_model(
            ModelConfig(task="retrieval", architecture=arch, pooling=pooling, pma_seeds=seeds, **SMALL),
            key=jax.random.key(0),
        )
        assert call(model, jnp.arange(5), jnp.arange(7)).shape == (2,)
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(word in out for word in ("isab", "luna", "perceiver", "pma"))


def test_induced_attention_learns_its_unpack_keys():
    bound = registry.bind("induced", num_inducing=3)
    arrays = bound.init_arrays(jax.random.key(0), heads=2, kv_heads=2, d_k=4, d_v=4)
    assert arrays["unpack_keys"].shape == (2, 4, 4)
    q, k, v = normal(7, 5, 2, 4), normal(8, 5, 2, 4), normal(9, 5, 2, 4)
    moved = arrays | {"unpack_keys": arrays["unpack_keys"] * 3.0}
    assert not np.allclose(bound(q, k, v, arrays=arrays), bound(q, k, v, arrays=moved), atol=1e-4)
