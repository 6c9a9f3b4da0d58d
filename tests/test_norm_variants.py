"""Issue 31's norms and residual schemes (Lin et al. 2021 section 5.2) and FFN kinds
(section 5.3), each against its paper's formula: AdaNorm (its detached gradient by
finite differences), the placements of `jxformers.nn.residual` (sandwich, ReZero,
DeepNorm) composed from the block's own sublayers, DeepNet's constants and
initialisation, the config's refusals, and one training step for every norm, placement
and FFN kind."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import train_losses

from jxformers import ModelConfig, build_model
from jxformers.nn import residual
from jxformers.nn.attention import Attention
from jxformers.nn.blocks import Block
from jxformers.nn.layers import FFN_KINDS, NORM_KINDS, AdaNorm, FeedForward

D = 8


# ------------------------------------------------------------------ AdaNorm


def np_adanorm(x, eps=1e-5, k=0.1, c=1.0, frozen=None):
    """Xu et al. 2019: C (1 - k y) y, y = (x - mean) / (std + eps) (unbiased std); with
    `frozen`, the (1 - k y) factor is that array's (held constant, as in their backward)."""
    centred = x - x.mean(-1, keepdims=True)
    y = centred / (centred.std(-1, ddof=1, keepdims=True) + eps)
    factor = (1 - k * y) if frozen is None else frozen
    return c * factor * y


def test_adanorm_follows_its_formula_and_detaches_the_adaptive_factor():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, D)) * 3 + 1
    norm = AdaNorm(D)
    assert_close(norm(jnp.asarray(x, jnp.float32)), np_adanorm(x), atol=1e-5)
    assert jax.tree.leaves(eqx.filter(norm, eqx.is_array)) == []  # no gain, no bias
    # the gradient holds (1 - k y) fixed: finite differences of the frozen function
    x0 = x[0]
    centred = x0 - x0.mean()
    frozen = 1 - 0.1 * centred / (centred.std(ddof=1) + 1e-5)
    w = rng.normal(size=D)
    grad = jax.grad(lambda v: jnp.sum(AdaNorm(D)(v) * w))(jnp.asarray(x0, jnp.float32))
    h, numeric = 1e-5, np.zeros(D)
    for i in range(D):
        up, down = x0.copy(), x0.copy()
        up[i] += h
        down[i] -= h
        numeric[i] = (np_adanorm(up, frozen=frozen) @ w - np_adanorm(down, frozen=frozen) @ w) / (2 * h)
    assert_close(grad, numeric, atol=1e-3)
    # and differs from the gradient through the factor (the detach matters)
    full = jax.grad(lambda v: jnp.sum(np_adanorm_jnp(v) * w))(jnp.asarray(x0, jnp.float32))
    assert float(jnp.abs(full - grad).max()) > 1e-3


def np_adanorm_jnp(x):
    centred = x - x.mean(-1, keepdims=True)
    y = centred / (jnp.std(centred, -1, ddof=1, keepdims=True) + 1e-5)
    return (1 - 0.1 * y) * y


# ------------------------------------------------------------------ placements


def block(placement, *, cross=False, alpha=1.0, seed=0):
    ka, kc, kf = jax.random.split(jax.random.key(seed), 3)
    normformer = placement == "normformer"
    attention = Attention("softmax", D, 2, head_scale=normformer, key=ka)
    cross_attention = Attention("softmax", D, 2, cross=True, key=kc) if cross else None
    ffn = FeedForward(D, 16, "gelu", mid_norm="layernorm" if normformer else None, key=kf)
    return Block(attention, ffn, d_model=D, placement=placement, cross_attention=cross_attention, alpha=alpha)


def perturbed(b):
    """The block with its norms' gains and biases moved off 1 and 0, so a swapped norm shows."""
    leaves, tree = jax.tree.flatten(b)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    moved = [
        leaf + 0.3 * jax.random.normal(k, leaf.shape) if eqx.is_inexact_array(leaf) else leaf
        for leaf, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, moved)


@pytest.mark.parametrize("placement", residual.PLACEMENTS)
def test_each_placement_composes_the_sublayers_as_its_paper(placement):
    """pre: x + A(N(x)); post: N(x + A(x)); sandwich (CogView): x + N'(A(N(x)));
    normformer: x + N'(A(N(x))) around the attention, pre around the FFN (whose own
    hidden norm and the attention's head scales are tested below); rezero: x + a A(x);
    deepnorm: N(alpha x + A(x)); then the same around the FFN."""
    alpha = 1.7 if placement == "deepnorm" else 1.0
    b = perturbed(block(placement, alpha=alpha))
    if placement == "rezero":
        b = eqx.tree_at(lambda m: m.resweight, b, jnp.asarray(0.6))
    x = jax.random.normal(jax.random.key(3), (5, D))
    attend = lambda h: b.attention(h)  # noqa: E731
    feed = lambda h: b.ffn(h, inference=True)  # noqa: E731
    h = x
    for i, f in enumerate((attend, feed)):
        if placement == "pre":
            h = h + f(b.norms[i](h))
        elif placement == "post":
            h = b.norms[i](h + f(h))
        elif placement == "sandwich" or (placement == "normformer" and i == 0):
            h = h + b.out_norms[i](f(b.norms[i](h)))
        elif placement == "normformer":
            h = h + f(b.norms[i](h))
        elif placement == "rezero":
            h = h + 0.6 * f(h)  # one scalar for both sublayers (the authors' code)
        elif placement == "tfixup":
            h = h + f(h)  # no norm: the initialisation alone (tested below)
        else:
            h = b.norms[i](alpha * h + f(h))
    assert_close(b(x, inference=True), h, atol=1e-5)
    if placement in ("rezero", "tfixup"):
        assert b.norms == () and b.out_norms == (None, None)
    if placement == "sandwich":
        assert len(b.norms) == 2 and None not in b.out_norms
    if placement == "normformer":
        assert b.out_norms[1] is None and b.attention.head_scale is not None and b.ffn.mid_norm is not None


def test_a_rezero_block_starts_as_the_identity_and_learns_its_scalar():
    b = block("rezero")
    x = jax.random.normal(jax.random.key(4), (5, D))
    assert bool(jnp.all(b(x, inference=True) == x))
    grad = eqx.filter_grad(lambda m: jnp.sum(m(x, inference=True) ** 2))(b)
    assert float(jnp.abs(grad.resweight)) > 0  # the only way out of the identity


def test_a_sandwich_block_with_cross_attention_normalises_three_branches_twice():
    b = block("sandwich", cross=True)
    assert len(b.norms) == len(b.out_norms) == 3 and None not in b.out_norms


def test_normformers_head_scales_multiply_each_heads_output_before_the_projection():
    """HeadScaleMHA = Concat(g_1 h_1, ..., g_n h_n) W^O (Shleifer et al. 2021, section 2):
    the same as the plain attention with W^O's input columns of head h times g_h."""
    scaled = Attention("softmax", D, 2, head_scale=True, key=jax.random.key(5))
    gains = jnp.asarray([0.3, 1.7])
    scaled = eqx.tree_at(lambda a: a.head_scale, scaled, gains)
    plain = Attention("softmax", D, 2, key=jax.random.key(5))
    columns = jnp.repeat(gains, D // 2)  # head h's d_head columns of W^O
    plain = eqx.tree_at(lambda a: a.o_proj.weight, plain, plain.o_proj.weight * columns[None, :])
    x = jax.random.normal(jax.random.key(6), (5, D))
    assert_close(scaled(x), plain(x), atol=1e-5)
    assert_close(Attention("softmax", D, 2, head_scale=True, key=jax.random.key(5))(x), Attention(
        "softmax", D, 2, key=jax.random.key(5))(x), atol=1e-6)  # fmt: skip  # g starts at 1


def test_normformers_ffn_normalises_its_hidden_layer():
    """W2 LN(act(x W1)), LN over the d_ff hidden units with its own gain and bias."""
    ffn = perturbed(FeedForward(D, 16, "gelu", mid_norm="layernorm", key=jax.random.key(8)))
    x = jax.random.normal(jax.random.key(9), (3, D))
    xn = np.asarray(x, np.float64)

    def affine(lin, v):
        return v @ np.asarray(lin.weight, np.float64).T + np.asarray(lin.bias, np.float64)

    h = affine(ffn.w_in, xn)
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    h = h * np.asarray(ffn.mid_norm.weight) + np.asarray(ffn.mid_norm.bias)
    assert_close(ffn(x, inference=True), affine(ffn.w_out, h), atol=1e-4)


def decoded(model, tokens, max_len):
    """The logits of `tokens` fed one decoding step at a time, `[len, vocab]`."""
    state = model.init_decode_state(max_len)
    steps = []
    for token in tokens:
        logits, state = model.decode_step(token, state)
        steps.append(logits)
    return jnp.stack(steps)


def test_decoding_steps_match_the_full_forward_for_every_placement():
    for placement in residual.PLACEMENTS:
        config = dict(
            task="lm", vocab_size=11, num_layers=2, d_model=D, num_heads=2, max_len=8,
            ffn={"kind": "gelu", "d_ff": 16}, norm={"placement": placement},
        )  # fmt: skip
        model = build_model(config, key=jax.random.key(1))
        if placement == "rezero":  # away from the identity
            model = eqx.tree_at(lambda m: [b.resweight for b in m.blocks], model, [jnp.asarray(0.5)] * 2)
        tokens = jnp.array([1, 4, 2, 7, 3])
        assert_close(decoded(model, tokens, 8), model(tokens), atol=1e-4)


# ------------------------------------------------------------------ DeepNet


def test_deepnorm_constants_are_deepnets_table_1():
    a, b = residual.deepnorm_constants(6, 0, "encoder")  # encoder-only, N = 6
    assert a == pytest.approx(12**0.25) and b == pytest.approx(48**-0.25)
    assert residual.deepnorm_constants(0, 6, "decoder") == (a, b)  # decoder-only, M = 6
    a, b = residual.deepnorm_constants(18, 18, "encoder")
    assert a == pytest.approx(0.81 * (18**5) ** (1 / 16)) and b == pytest.approx(0.87 * (18**5) ** (-1 / 16))
    a, b = residual.deepnorm_constants(18, 18, "decoder")
    assert a == pytest.approx(54**0.25) and b == pytest.approx(216**-0.25)
    with pytest.raises(ValueError, match="has no layers"):
        residual.deepnorm_constants(6, 0, "decoder")


def test_deepnorm_models_draw_deepnets_initialisation_and_scale_the_residual():
    config = dict(
        task="classify", vocab_size=11, num_classes=2, num_layers=6, d_model=64, num_heads=4, max_len=8,
        ffn={"kind": "gelu", "d_ff": 256}, norm={"placement": "deepnorm"},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(2))
    alpha, beta = residual.deepnorm_constants(6, 0, "encoder")
    first = model.encoder.blocks[0] if hasattr(model, "encoder") else model.blocks[0]
    assert first.alpha == pytest.approx(alpha)

    def std(w):
        return float(jnp.std(w))

    xavier = np.sqrt(2 / (64 + 64))
    assert std(first.attention.q_proj.weight) == pytest.approx(xavier, rel=0.1)
    assert std(first.attention.k_proj.weight) == pytest.approx(xavier, rel=0.1)
    assert std(first.attention.v_proj.weight) == pytest.approx(beta * xavier, rel=0.1)
    assert std(first.attention.o_proj.weight) == pytest.approx(beta * xavier, rel=0.1)
    assert std(first.ffn.w_in.weight) == pytest.approx(beta * np.sqrt(2 / (64 + 256)), rel=0.1)
    assert std(first.ffn.w_out.weight) == pytest.approx(beta * np.sqrt(2 / (256 + 64)), rel=0.1)
    lm = dict(config, task="lm", num_classes=None, num_layers=3)
    lm.pop("num_classes")
    assert build_model(lm, key=jax.random.key(2)).blocks[0].alpha == pytest.approx(6**0.25)


# ------------------------------------------------------------------ T-Fixup


def test_tfixup_draws_the_papers_initialisation():
    """Huang et al. 2020, section 3.3: Xavier matrices; v, o and the FFN's times 0.67 N^-1/4
    in blocks of two sublayers, (9 M)^-1/4 in decoder blocks of three; the token table
    (std d^-1/2) times (9 L)^-1/4; no norm in the blocks."""
    assert residual.tfixup_scale(6, cross=False) == pytest.approx(0.67 * 6**-0.25)
    assert residual.tfixup_scale(6, cross=True) == pytest.approx(54**-0.25)
    config = dict(
        task="seq2seq", vocab_size=200, num_layers=6, d_model=64, num_heads=4, max_len=8,
        ffn={"kind": "gelu", "d_ff": 256}, norm={"placement": "tfixup", "final": False}, decoder={"num_layers": 3},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(2))

    def std(w):
        return float(jnp.std(w))

    xavier, xavier_ffn = np.sqrt(2 / 128), np.sqrt(2 / (64 + 256))
    for blocks, scale in ((model.encoder.blocks, 0.67 * 6**-0.25), (model.decoder.blocks, 27**-0.25)):
        b = blocks[0]
        assert b.norms == ()
        assert std(b.attention.q_proj.weight) == pytest.approx(xavier, rel=0.1)
        assert std(b.attention.v_proj.weight) == pytest.approx(scale * xavier, rel=0.1)
        assert std(b.attention.o_proj.weight) == pytest.approx(scale * xavier, rel=0.1)
        assert std(b.ffn.w_in.weight) == pytest.approx(scale * xavier_ffn, rel=0.1)
        assert float(jnp.abs(b.attention.v_proj.weight).max()) <= scale * np.sqrt(6 / 128) + 1e-6  # uniform
    cross = model.decoder.blocks[0].cross_attention
    assert std(cross.v_proj.weight) == pytest.approx(27**-0.25 * xavier, rel=0.1)
    # the token table: std d^-1/2 times (9 L)^-1/4, L = the decoder's 3 blocks
    assert std(model.encoder.embedding.table) == pytest.approx(64**-0.5 * 27**-0.25, rel=0.1)


# ------------------------------------------------------------------ config


def small(**overrides):
    return dict(task="lm", vocab_size=11, num_layers=1, d_model=D, num_heads=2, max_len=8, ffn={"d_ff": 16}) | overrides


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(task="classify", num_classes=2, stack="luna", norm={"placement": "sandwich"}), "built into the"),
        (dict(task="classify", num_classes=2, head="pma", norm={"placement": "rezero"}), "the pma head"),
        (dict(ffn={"kind": "moe", "num_experts": 2}, norm={"placement": "deepnorm"}), "dense ffn in every block"),
        (dict(norm={"placement": "pre", "final": False}), "norm.final False needs"),
        (dict(ffn={"kind": "pkm", "num_keys": 4, "top_k": 2}, norm={"placement": "normformer"}), "hidden layer"),
        (dict(attention={"name": "average", "aan": True}, norm={"placement": "normformer"}), "has no heads"),
        (dict(norm={"placement": "fixup"}), "placement"),
        (dict(norm={"kind": "powernorm"}), "kind"),
        (dict(ffn={"kind": "swish"}), "swish"),
    ],
)
def test_the_config_refuses_what_the_math_does_not_allow(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**small(**overrides))


def test_the_settings_are_reached_from_yaml():
    rest = "\n".join(f"{k}: {v}" for k, v in small().items() if k != "ffn")
    config = ModelConfig.from_yaml("norm: {kind: adanorm, placement: sandwich}\nffn: {kind: relu2, d_ff: 16}\n" + rest)
    assert (config.norm.kind, config.norm.placement, config.ffn.kind) == ("adanorm", "sandwich", "relu2")
    assert ModelConfig(**small(norm={"placement": "rezero", "final": False})).norm.final is False


# ------------------------------------------------------------------ the decoder without FFNs


def test_a_decoder_without_ffns_decodes_as_its_forward():
    """decoder.ffn false (Yang et al. 2020, "On the Sub-Layer Functionalities of Transformer
    Decoder"): each decoder block is self-attention then cross-attention, no FFN sublayer
    (and no third norm); the encoder keeps its FFNs; decoding steps equal the forward."""
    config = dict(
        task="seq2seq", vocab_size=11, num_layers=1, d_model=D, num_heads=2, max_len=12,
        ffn={"d_ff": 16}, decoder={"num_layers": 2, "ffn": False},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(3))
    decoder_blocks = model.decoder.blocks
    assert all(b.ffn is None and len(b.norms) == 2 for b in decoder_blocks)
    assert all(b.ffn is not None for b in model.encoder.blocks)
    with_ffn = build_model(config | {"decoder": {"num_layers": 2}}, key=jax.random.key(3))
    assert all(b.ffn is not None for b in with_ffn.decoder.blocks)
    src, tgt = jnp.array([3, 1, 4, 1, 5, 9]), jnp.array([2, 6, 5, 3])
    assert_close(decoded(model.conditioned(src), tgt, 4), model(src, tgt), atol=1e-4)
    # the block's formula without its FFN: x + A(N(x)) -> + C(N(.), context)
    b = decoder_blocks[0]
    x, context = jax.random.normal(jax.random.key(4), (4, D)), jax.random.normal(jax.random.key(5), (6, D))
    h = x + b.attention(b.norms[0](x))
    h = h + b.cross_attention(b.norms[1](h), context)
    assert_close(b(x, context=context, inference=True), h, atol=1e-5)


# ------------------------------------------------------------------ one training step each

VARIANTS = (
    [{"norm": {"kind": kind}} for kind in NORM_KINDS]
    + [{"norm": {"placement": placement}} for placement in residual.PLACEMENTS]
    + [{"ffn": {"kind": kind, "d_ff": 16}} for kind in FFN_KINDS]
)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}.{next(iter(v[k].values()))}" for k in v))
def test_one_training_step_of_every_norm_placement_and_ffn(variant):
    """A tiny language model of each variant takes an AdamW step: finite loss, every
    parameter's gradient finite, and the loss lower after a few steps on one batch."""
    losses, params = train_losses(build_model(small(num_layers=2, dropout=0.0, **variant), key=jax.random.key(0)))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
