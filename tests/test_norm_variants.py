"""Issue 31's norms and residual schemes (Lin et al. 2021 section 5.2) and FFN kinds
(section 5.3), each against its paper's formula: AdaNorm (its detached gradient by
finite differences), the placements of `jxformers.nn.residual` (sandwich, ReZero,
DeepNorm, Admin, Fixup) composed from the block's own sublayers, DeepNet's, T-Fixup's
and Fixup's initialisations, Admin's profile against a walk by hand and through
`jxformers train`, the config's refusals, and one training step for every norm,
placement and FFN kind."""

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
    deepnorm: N(alpha x + A(x)); admin: N(x w + A(x)), w a vector; fixup: x + s A(x - b),
    s and b scalars; then the same around the FFN."""
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
        elif placement == "admin":
            h = b.norms[i](h * b.omegas[i][None] + f(h))
        elif placement == "fixup":
            h = h + b.scales[i] * f(h - b.shifts[i])
        else:
            h = b.norms[i](alpha * h + f(h))
    assert_close(b(x, inference=True), h, atol=1e-5)
    if placement in residual.NORM_FREE:
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
        logits, state = _decode_step(model, token, state)
        steps.append(logits)
    return jnp.stack(steps)


# One compilation per model structure (eagerly, every primitive of a step compiles on its own).
_decode_step = eqx.filter_jit(lambda model, token, state: model.decode_step(token, state))


def test_decoding_steps_match_the_full_forward_for_every_placement():
    for placement in residual.PLACEMENTS:
        config = dict(
            task="lm", vocab_size=11, num_layers=2, d_model=D, num_heads=2, max_len=8,
            ffn={"kind": "gelu", "d_ff": 16}, norm={"placement": placement},
        )  # fmt: skip
        model = build_model(config, key=jax.random.key(1))
        if placement in ("rezero", "fixup", "admin"):  # away from the identity (zero branches) and from w = 1
            model = perturbed(model)
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


# ------------------------------------------------------------------ Admin


def np_layernorm(v, eps=1e-5):
    """LayerNorm over the last axis with gain 1 and bias 0 (biased variance, as torch's)."""
    centred = v - v.mean(-1, keepdims=True)
    return centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps)


def test_an_admin_block_weights_its_skip_terms_before_the_norm():
    """Liu et al. 2020, section 5: x_i = LN(x_{i-1} w_i + f_i(x_{i-1})), w_i a vector; a
    numpy LayerNorm around the block's own sublayers, the weights moved off 1."""
    b = block("admin")
    w = [np.linspace(0.5, 2.0, D), np.linspace(3.0, 1.0, D)]
    b = eqx.tree_at(lambda m: m.omegas, b, tuple(jnp.asarray(v, jnp.float32) for v in w))
    x = jax.random.normal(jax.random.key(11), (5, D))
    h = np.asarray(x, np.float64)
    h = np_layernorm(h * w[0] + np.asarray(b.attention(jnp.asarray(h, jnp.float32)), np.float64))
    h = np_layernorm(h * w[1] + np.asarray(b.ffn(jnp.asarray(h, jnp.float32), inference=True), np.float64))
    assert_close(b(x, inference=True), h, atol=1e-4)
    assert len(b.norms) == 2 and b.out_norms == (None, None)
    # w starts at 1: an unprofiled Admin block is a post-norm block
    post = block("post")
    assert_close(block("admin")(x, inference=True), post(x, inference=True), atol=1e-6)


def admin_lm(layers=3, **overrides):
    config = dict(
        task="lm", vocab_size=13, num_layers=layers, d_model=16, num_heads=2, max_len=12,
        ffn={"kind": "gelu", "d_ff": 32}, norm={"placement": "admin"},
    ) | overrides  # fmt: skip
    return build_model(config, key=jax.random.key(5))


@eqx.filter_jit
def _branch(module, x, rows):
    """A block's attention (reading the real rows) or FFN on x, compiled once per structure."""
    return module(x, kv_mask=rows) if isinstance(module, Attention) else module(x, inference=True)


def reference_omegas(model, tokens, mask):
    """The authors' profile, walked by hand: w_1 = 1, then per branch in order
    w_{i+1} = sqrt(Var[x_{i-1} w_i] + Var[f_i(x_{i-1})]), numpy variances over every
    element of the real rows, x_i = LN(x_{i-1} w_i + f_i(x_{i-1}))."""
    n = tokens.shape[1]
    xs = [np.asarray(model.embedding(t, jnp.arange(n)), np.float64) for t in tokens]
    rows = np.asarray(mask)
    omegas, w = [], 1.0
    for b in model.blocks:
        for i in range(2):
            omegas.append(w)
            branch = b.attention if i == 0 else b.ffn
            outs = [
                np.asarray(_branch(branch, jnp.asarray(x, jnp.float32), jnp.asarray(r)), np.float64)
                for x, r in zip(xs, rows, strict=True)
            ]
            skips = [x * w for x in xs]
            var_skip = np.concatenate([s[r] for s, r in zip(skips, rows, strict=True)]).var()
            var_f = np.concatenate([o[r] for o, r in zip(outs, rows, strict=True)]).var()
            w = float(np.sqrt(var_skip + var_f))
            xs = [np_layernorm(s + o) for s, o in zip(skips, outs, strict=True)]
    return omegas


def test_admins_profile_sets_each_weight_from_the_variances_before_it():
    """The initial w of every branch equals the reference walk's (padding rows left out
    of the variances), each weight vector is one number, and the recurrence is the
    paper's w_i^2 = Var[x_0] + sum_{j<i} Var[f_j] up to the norms' eps (the norm's output
    has variance 1)."""
    model = admin_lm()
    tokens = jax.random.randint(jax.random.key(6), (3, 10), 0, 13)
    mask = jnp.arange(10)[None, :] < jnp.array([[10], [7], [4]])
    profiled = residual.admin_profile(model, tokens, mask)
    got = [np.asarray(w) for b in profiled.blocks for w in b.omegas]
    want = reference_omegas(model, tokens, mask)
    assert all(np.all(g == g[0]) for g in got)  # a vector filled with its branch's number
    assert_close(np.array([g[0] for g in got]), np.array(want), rtol=1e-4)
    assert want[1] > 1.0 and np.all(np.diff(want) > 0)  # the weights grow with depth
    # the padding's rows are not counted: unmasked, the numbers move
    full = [float(w[0]) for b in residual.admin_profile(model, tokens, None).blocks for w in b.omegas]
    assert abs(full[-1] - got[-1][0]) > 1e-3
    # w_{i+1}^2 - w_i^2 = Var[f_i] (the norm's output has variance ~1): the paper's running sum
    assert all(want[i + 1] ** 2 > want[i] ** 2 for i in range(len(want) - 1))
    # the weights then train: gradients reach them, finite
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(tokens, mask) ** 2)))(profiled)
    leaves = [g for b in grads.blocks for g in b.omegas]
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert all(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_admins_profile_of_an_encoder_decoder_runs_each_stack_from_one():
    """The authors keep one running number for the encoder and one for the decoder
    (three branches a decoder block), each starting at 1."""
    config = dict(
        task="seq2seq", vocab_size=13, num_layers=2, d_model=16, num_heads=2, max_len=12,
        ffn={"d_ff": 32}, norm={"placement": "admin"}, decoder={"num_layers": 2},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(7))
    src = jax.random.randint(jax.random.key(8), (2, 9), 0, 13)
    tgt = jax.random.randint(jax.random.key(9), (2, 6), 0, 13)
    profiled = residual.admin_profile(model, src, tgt)
    enc = [float(w[0]) for b in profiled.encoder.blocks for w in b.omegas]
    dec = [float(w[0]) for b in profiled.decoder.blocks for w in b.omegas]
    assert len(enc) == 4 and len(dec) == 6 and enc[0] == dec[0] == 1.0
    assert all(v > 1.0 for v in enc[1:] + dec[1:])
    src_, tgt_ = jnp.array([3, 1, 4, 1, 5]), jnp.array([2, 6, 5])
    assert_close(decoded(profiled.conditioned(src_), tgt_, 3), profiled(src_, tgt_), atol=1e-4)
    with pytest.raises(ValueError, match="no block with norm placement 'admin'"):
        residual.admin_profile(build_model(config | {"norm": {"placement": "post"}}, key=jax.random.key(7)), src, tgt)


def test_a_profiled_admin_lm_decodes_as_its_forward():
    model = admin_lm(dropout=0.1)
    tokens = jax.random.randint(jax.random.key(6), (2, 8), 0, 13)
    profiled = residual.admin_profile(model, tokens, None, key=jax.random.key(3))  # training mode, as the authors
    assert float(profiled.blocks[-1].omegas[1][0]) > 1.0
    seq = jnp.array([1, 4, 2, 7, 3])
    assert_close(decoded(profiled, seq, 8), profiled(seq, inference=True), atol=1e-4)


def test_jxformers_train_profiles_admin_on_its_first_batch(tmp_path):
    """A fresh run sets the weights before step 0 (a learning rate too small to move them
    much leaves them near the profile: not 1, one number per vector), then trains."""
    from test_train import write_config

    from jxformers.train import load_experiment, restore_model, train

    config = write_config(tmp_path)
    overrides = ["model.norm.placement=admin", "model.num_layers=2", "train.steps=2", "train.learning_rate=1e-7"]
    experiment = load_experiment(config, overrides)
    summary = train(experiment, tmp_path / "run", progress=False)
    assert np.isfinite(summary["loss"])
    model, step = restore_model(experiment, tmp_path / "run")
    assert step == 2
    weights = [np.asarray(w) for b in model.blocks for w in b.omegas]
    assert weights[0] == pytest.approx(1.0, abs=1e-4)
    assert all(float(w.mean()) > 1.05 for w in weights[1:])
    assert all(float(np.ptp(w)) < 1e-4 for w in weights)


# ------------------------------------------------------------------ Fixup


def test_fixup_draws_the_authors_transformer_initialisation():
    """Zhang, Dauphin & Ma 2019, section 3 as their fairseq Transformer applies it, L the
    model's residual branches (2 N + 3 M): q, k, v Xavier-uniform times L^(-1/6); the
    output projection 0; the FFN's W1 times L^(-1/2) and W2 0; no vector biases; scalar
    biases 0 and multipliers 1; no norm in the blocks; an untied readout 0."""
    config = dict(
        task="seq2seq", vocab_size=200, num_layers=6, d_model=64, num_heads=4, max_len=8,
        ffn={"kind": "gelu", "d_ff": 256}, norm={"placement": "fixup", "final": False}, decoder={"num_layers": 3},
        head={"kind": "softmax", "tie_embeddings": False},
    )  # fmt: skip
    model = build_model(config, key=jax.random.key(2))
    big_l = 2 * 6 + 3 * 3
    assert residual.fixup_scales(big_l)["q_proj"] == pytest.approx(21 ** (-1 / 6))
    xavier, xavier_ffn = np.sqrt(2 / 128), np.sqrt(2 / (64 + 256))
    for b in (*model.encoder.blocks, *model.decoder.blocks):
        assert b.norms == () and b.omegas is None
        assert_close(b.shifts, np.zeros(len(b.out_norms)), atol=0) and assert_close(
            b.scales, np.ones(len(b.out_norms)), atol=0
        )
        assert_close(b.ffn.shifts, np.zeros(2), atol=0)
        for attention in (b.attention, b.cross_attention):
            if attention is None:
                continue
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(attention, name).weight
                assert float(jnp.std(w)) == pytest.approx(big_l ** (-1 / 6) * xavier, rel=0.12)
                assert float(jnp.abs(w).max()) <= big_l ** (-1 / 6) * np.sqrt(6 / 128) + 1e-6  # uniform
            assert not bool(jnp.any(attention.o_proj.weight))
            assert all(getattr(attention, n).bias is None for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        assert float(jnp.std(b.ffn.w_in.weight)) == pytest.approx(big_l**-0.5 * xavier_ffn, rel=0.12)
        assert not bool(jnp.any(b.ffn.w_out.weight)) and b.ffn.w_in.bias is None and b.ffn.w_out.bias is None
    assert len(model.decoder.blocks[0].out_norms) == 3
    assert not bool(jnp.any(model.decoder.unembed.weight))
    lm = build_model(small(num_layers=3, norm={"placement": "fixup"}), key=jax.random.key(2))
    assert float(jnp.std(lm.blocks[0].ffn.w_in.weight)) == pytest.approx(6**-0.5 * np.sqrt(2 / (D + 16)), rel=0.35)
    classifier = build_model(small(task="classify", num_classes=3, norm={"placement": "fixup"}), key=jax.random.key(2))
    assert not bool(jnp.any(classifier.head.weight)) and not bool(jnp.any(classifier.head.bias))


def test_a_fixup_block_is_the_identity_at_init_and_follows_its_formula_when_moved():
    """x + s A(x - b), then x + s' W2(act(W1 (x - b') - c1) - c2): every scalar moved off its
    start and the zero matrices redrawn; a numpy FFN (tanh GELU) checks the inner biases."""
    config = small(num_layers=1, norm={"placement": "fixup"})
    b = build_model(config, key=jax.random.key(3)).blocks[0]
    x = jax.random.normal(jax.random.key(4), (5, D))
    assert bool(jnp.all(b(x, inference=True) == x))  # zero last layers: the identity
    b = perturbed(b)
    redrawn = (jax.random.normal(jax.random.key(5), (D, D)) / 3, jax.random.normal(jax.random.key(6), (D, 16)) / 4)
    b = eqx.tree_at(lambda m: (m.attention.o_proj.weight, m.ffn.w_out.weight), b, redrawn)
    s, sh = np.asarray(b.scales, np.float64), np.asarray(b.shifts, np.float64)
    c = np.asarray(b.ffn.shifts, np.float64)
    w1, w2 = np.asarray(b.ffn.w_in.weight, np.float64), np.asarray(b.ffn.w_out.weight, np.float64)
    h = np.asarray(x, np.float64)
    h = h + s[0] * np.asarray(b.attention(jnp.asarray(h - sh[0], jnp.float32)), np.float64)
    u = (h - sh[1]) @ w1.T - c[0]
    u = 0.5 * u * (1 + np.tanh(np.sqrt(2 / np.pi) * (u + 0.044715 * u**3)))
    h = h + s[1] * ((u - c[1]) @ w2.T)
    assert_close(b(x, inference=True), h, atol=1e-4)
    grads = eqx.filter_grad(lambda m: jnp.sum(m(x, inference=True) ** 2))(b)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads.shifts).min()) > 0 and float(jnp.abs(grads.ffn.shifts).min()) > 0


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
        (dict(norm={"placement": "skipinit"}), "placement"),
        (dict(task="classify", num_classes=2, stack="luna", norm={"placement": "admin"}), "built into the"),
        (dict(stack={"kind": "transformer", "reversible": True}, norm={"placement": "admin"}), "reversible"),
        (dict(ffn={"kind": "moe", "num_experts": 2}, norm={"placement": "fixup"}), "Fixup's scales"),
        (dict(norm={"placement": "admin", "final": False}), "norm.final False needs"),
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
    for placement in ("admin", "fixup"):
        assert (
            ModelConfig.from_yaml(f"norm: {{placement: {placement}}}\nffn: {{d_ff: 16}}\n" + rest).norm.placement
            == placement
        )
    assert (
        ModelConfig(**small(task="classify", num_classes=2, norm={"placement": "admin", "final": False})).norm.final
        is False
    )
    assert ModelConfig(**small(norm={"placement": "fixup", "final": False})).norm.final is False


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
