"""Modules and configs: positions, norms, FFNs, the attention module's arrays, the
Fourier Transformer encoder, encoder-decoder and dual-tower models, mixed precision,
and the config's errors."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, plain_reversible

import jxformers
from jxformers import ModelConfig, build_model, ops
from jxformers.nn import (
    Attention,
    FeedForward,
    LayerNorm,
    RMSNorm,
    alibi_slopes,
    rotary,
    sinusoidal,
    t5_buckets,
    trainable,
)
from jxformers.nn.config import FlatConfigWarning
from jxformers.ops import fourier_downsample

TINY = dict(vocab_size=29, num_layers=2, d_model=16, num_heads=4, d_ff=24, max_len=48)


def tokens(seed, n=20):
    return jax.random.randint(jax.random.key(seed), (n,), 0, TINY["vocab_size"])


# ----------------------------------------------------------------------------- positions


def test_rotary_scores_depend_only_on_the_offset():
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 8))

    def score(m, n):
        return float(jnp.sum(rotary(q, jnp.array([m])) * rotary(k, jnp.array([n]))))

    assert score(7, 3) == pytest.approx(score(14, 10), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)
    assert score(0, 0) == pytest.approx(float(jnp.sum(q * k)), abs=1e-5)  # position 0 is the identity
    with pytest.raises(ValueError, match="even"):
        rotary(jnp.ones((2, 1, 5)), jnp.arange(2))


def test_sinusoidal_table():
    pe = sinusoidal(jnp.arange(4), 6)
    assert_close(pe[0], jnp.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]))
    assert_close(pe[3, 0:2], jnp.array([math.sin(3.0), math.cos(3.0)]))


def test_alibi_slopes_follow_the_paper():
    assert_close(alibi_slopes(8), 2.0 ** -jnp.arange(1, 9))
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence
    # (the reference code's interpolation), 2^-0.5, 2^-1.5, ...
    assert_close(alibi_slopes(12), jnp.concatenate([2.0 ** -jnp.arange(1, 9), 2.0 ** -(jnp.arange(4) + 0.5)]))


def test_t5_buckets():
    rel = jnp.arange(-200, 201)
    causal = t5_buckets(rel, bidirectional=False)
    both = t5_buckets(rel, bidirectional=True)
    assert int(causal.max()) == 31 and int(causal.min()) == 0
    assert bool(jnp.all(causal[rel >= 0] == 0))  # the future shares one bucket (it is masked)
    assert_close(causal[200 - 15 : 201][::-1], jnp.arange(16))  # exact buckets for small distances
    assert bool(jnp.all(jnp.diff(causal[:201]) <= 0))  # monotone in distance
    assert set(np.asarray(both[rel > 0])).isdisjoint(set(np.asarray(both[rel < 0])))


# ----------------------------------------------------------------------------- layers


def test_norms_compute_in_float32_and_return_the_input_dtype():
    x = 3.0 + 2.0 * jax.random.normal(jax.random.key(0), (5, 16))
    y = LayerNorm(16)(x)
    assert_close(y.mean(-1), jnp.zeros(5), atol=1e-5)
    assert_close(y.std(-1), jnp.ones(5), atol=1e-3)
    r = RMSNorm(16)(x)
    assert_close(jnp.sqrt(jnp.mean(r * r, -1)), jnp.ones(5), atol=1e-3)
    half = LayerNorm(16)(x.astype(jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    assert_close(half, y, atol=3e-2)


def _np_erf(x):
    return np.vectorize(math.erf)(x)


# Each kind's hidden layer in numpy, from its paper: act(x W1 + b1), times (x W3 + b3) when gated.
NP_ACTIVATIONS = {
    "relu": lambda h: np.maximum(h, 0),
    "gelu": lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))),
    "gelu_exact": lambda h: 0.5 * h * (1 + _np_erf(h / np.sqrt(2))),
    "silu": lambda h: h / (1 + np.exp(-h)),  # Swish, beta = 1
    "relu2": lambda h: np.maximum(h, 0) ** 2,  # Primer
    "geglu": lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))),
    "swiglu": lambda h: h / (1 + np.exp(-h)),
    "reglu": lambda h: np.maximum(h, 0),
    "bilinear": lambda h: h,
}
NP_GATED = {"geglu", "swiglu", "reglu", "bilinear"}  # Shazeer 2020, eqs. 5-6


@pytest.mark.parametrize("kind", sorted(NP_ACTIVATIONS))
def test_feed_forward_kinds_follow_their_formulas(kind):
    """W2 act(x W1) or W2 (act(x W1) * x W3), biases included, against numpy."""
    from jxformers.nn.layers import FFN_KINDS

    assert set(FFN_KINDS) == set(NP_ACTIVATIONS)
    ffn = FeedForward(8, 12, kind, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    y = ffn(x)
    assert (ffn.w_gate is not None) == (kind in NP_GATED)
    xn = np.asarray(x, np.float64)

    def affine(lin, v):
        return v @ np.asarray(lin.weight, np.float64).T + np.asarray(lin.bias, np.float64)

    h = NP_ACTIVATIONS[kind](affine(ffn.w_in, xn))
    if kind in NP_GATED:
        h = h * affine(ffn.w_gate, xn)
    assert_close(y, affine(ffn.w_out, h), atol=1e-5)
    with pytest.raises(ValueError, match="ffn"):
        FeedForward(8, 12, "tanh", key=jax.random.key(0))


@pytest.mark.parametrize("kind", ["silu", "relu2", "reglu", "bilinear"])
def test_moe_experts_take_the_new_activations(kind):
    """An expert of an MoE layer computes what a FeedForward of its kind does."""
    from jxformers.nn.moe import Experts

    experts = Experts(2, 8, 12, kind, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (2, 5, 8))
    y = experts.dense(x)
    xn = np.asarray(x[1], np.float64)
    w = lambda a: np.asarray(a[1], np.float64)  # noqa: E731 - expert 1's
    h = NP_ACTIVATIONS[kind](xn @ w(experts.w_in) + w(experts.b_in))
    if kind in NP_GATED:
        h = h * (xn @ w(experts.w_gate) + w(experts.b_gate))
    assert_close(y[1], h @ w(experts.w_out) + w(experts.b_out), atol=1e-5)


# ----------------------------------------------------------------------------- attention module


def test_drawn_arrays_are_not_trained_and_redraw_resamples_them():
    attn = Attention("performer", 16, 4, attention_kwargs={"num_features": 8}, key=jax.random.key(0))
    assert set(attn.drawn) == {"projection"} and attn.arrays == {}
    mask = trainable(attn)
    assert mask.drawn["projection"] is False and mask.q_proj.weight is True
    x = jax.random.normal(jax.random.key(1), (6, 16))
    grads = eqx.filter_jit(eqx.filter_grad(lambda a: jnp.sum(a(x) ** 2)))(attn)
    assert float(jnp.abs(grads.drawn["projection"]).max()) == 0.0
    new = attn.redraw(jax.random.key(9))
    assert not bool(jnp.allclose(new.drawn["projection"], attn.drawn["projection"]))
    assert bool(jnp.all(new.q_proj.weight == attn.q_proj.weight))
    # A whole model: every attention's drawn arrays change, nothing else does.
    model = build_model(
        dict(TINY, task="lm", attention="performer", attention_kwargs={"num_features": 8}), key=jax.random.key(0)
    )
    fresh = jxformers.nn.redraw(model, jax.random.key(1))
    p0, p1 = (b.attention.drawn["projection"] for b in fresh.blocks)
    assert not bool(jnp.allclose(p0, p1))
    for old, new in zip(model.blocks, fresh.blocks, strict=True):
        assert not bool(jnp.allclose(old.attention.drawn["projection"], new.attention.drawn["projection"]))
        assert bool(jnp.all(old.ffn.w_in.weight == new.ffn.w_in.weight))
    # BigBird's random pattern is drawn once for the run (its paper's code seeds it per
    # layer): the periodic redraw leaves it, an explicit Attention.redraw does not.
    bird = build_model(dict(TINY, attention="bigbird", attention_kwargs={"block_size": 4}), key=jax.random.key(0))
    kept = jxformers.nn.redraw(bird, jax.random.key(1))
    data = lambda m: jax.random.key_data(m.drawn["key"])  # noqa: E731
    attentions = lambda m: [x for x in jax.tree.leaves(m, is_leaf=is_attention) if is_attention(x)]  # noqa: E731
    is_attention = lambda x: isinstance(x, Attention)  # noqa: E731
    for old, new in zip(attentions(bird), attentions(kept), strict=True):
        assert bool(jnp.all(data(old) == data(new)))
    assert not bool(jnp.all(data(attentions(bird)[0].redraw(jax.random.key(1))) == data(attentions(bird)[0])))
    # Learned core arrays (Linformer's E and F) are parameters.
    lin = Attention("linformer", 16, 4, attention_kwargs={"proj_len": 4, "max_len": 8}, key=jax.random.key(0))
    assert set(lin.arrays) == {"e_proj", "f_proj"} and trainable(lin).arrays["e_proj"] is True


def test_attention_module_errors():
    with pytest.raises(ValueError, match="unknown attention"):
        Attention("nope", 16, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="cannot be causal"):
        Attention("nystrom", 16, 4, causal=True, key=jax.random.key(0))
    with pytest.raises(ValueError, match="kv_heads"):
        Attention("softmax", 16, 4, kv_heads=3, key=jax.random.key(0))
    attn = Attention("linear", 16, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="bias"):
        attn(jnp.ones((3, 16)), bias=jnp.zeros((4, 3, 3)))


# ----------------------------------------------------------------------------- models


@pytest.mark.heavy
def test_fourier_encoder_shortens_the_sequence_and_keeps_the_cls_token():
    cfg = dict(TINY, task="classify", num_layers=3, filters={0: 0.5, 1: 0.5})
    model = build_model(cfg, key=jax.random.key(0))
    encode = eqx.filter_jit(lambda m, *a: m.encoder(*a))  # one compilation per length, not per operation
    x = tokens(1)
    hidden, mask = encode(model, x)
    assert hidden.shape == (1 + 5, 16) and bool(mask.all())  # 20 -> 10 -> 5, plus CLS
    # With padding, only the real prefix is filtered: the result equals the unpadded run.
    padded = jnp.concatenate([x[:13], tokens(2, 7)])
    mask = jnp.arange(20) < 13
    h_pad, m_pad = encode(model, padded, mask)
    h_ref, m_ref = encode(model, x[:13])
    assert int(m_pad.sum()) == h_ref.shape[0] == 1 + 4  # 13 -> 7 -> 4
    assert_close(h_pad[: h_ref.shape[0]], h_ref, atol=2e-5)
    assert_close(eqx.filter_jit(model)(padded, mask), eqx.filter_jit(model)(x[:13]), atol=2e-5)
    funnel = build_model(dict(cfg, downsample="funnel"), key=jax.random.key(0))
    assert encode(funnel, x)[0].shape == (1 + 5, 16)
    with pytest.raises(ValueError, match="funnel"):
        build_model(dict(cfg, downsample="funnel", filters={0: 0.4}), key=jax.random.key(0))


def test_the_spectral_filter_is_the_papers_on_a_smooth_sequence():
    # The encoder's filter is fourier_downsample of the non-CLS tokens: check the op on a
    # band-limited input (kept cosines are resampled exactly, times sqrt(n / m): eq. 8's
    # orthonormal inverse DCT at the new length).
    n, m = 20, 10
    t = jnp.arange(n)
    x = jnp.cos(jnp.pi * 3 * (2 * t + 1) / (2 * n))[:, None]
    y = fourier_downsample(x, m / n)
    s = jnp.arange(m)
    assert_close(y[:, 0], jnp.cos(jnp.pi * 3 * (2 * s + 1) / (2 * m)) * math.sqrt(n / m), atol=1e-5)


def test_encoder_decoder_forward_decoding_and_upsample_sum():
    cfg = dict(TINY, task="seq2seq", decoder_layers=1, attention="linear", cross_attention="softmax")
    model = build_model(cfg, key=jax.random.key(0))
    src, tgt = tokens(1, 12), tokens(2, 9)
    # Compiled calls (a model run op by op costs a compilation per operation and shape).
    logits = eqx.filter_jit(model)(src, tgt)
    assert logits.shape == (9, TINY["vocab_size"])
    bound = eqx.filter_jit(model.conditioned)(src)
    state = bound.init_decode_state(9)
    steps = []
    decode_step = eqx.filter_jit(lambda m, token, state: m.decode_step(token, state))  # compiled once
    for t in range(9):
        out, state = decode_step(bound, tgt[t], state)
        steps.append(out)
    assert_close(jnp.stack(steps), logits, atol=3e-5, rtol=1e-4)
    assert jxformers.generate(bound, tgt[:2], 4, key=jax.random.key(0)).shape == (6,)
    # The Fourier encoder-decoder: block outputs upsampled to the source length and summed.
    fourier = build_model(dict(cfg, attention="softmax", filters={0: 0.5}), key=jax.random.key(0))
    assert fourier.upsample_sum
    memory, mask = eqx.filter_jit(fourier.encode)(src)
    assert memory.shape == (12, 16) and bool(mask.all())
    assert eqx.filter_jit(fourier)(src, tgt).shape == (9, TINY["vocab_size"])


def test_dual_classifier_reads_both_inputs():
    model = build_model(dict(TINY, task="retrieval", num_classes=3), key=jax.random.key(0))
    a, b = tokens(1), tokens(2, 15)
    forward = eqx.filter_jit(model)  # one compilation for both pairs
    out = forward(a, b)
    assert out.shape == (3,)
    assert not bool(jnp.allclose(out, forward(a, tokens(3, 15))))


def test_scalenorm_is_a_learned_scalar_times_x_over_its_norm():
    """Nguyen & Salazar 2019, section 2.3: ScaleNorm(x; g) = g x / ||x||, one scalar g per
    norm, started at sqrt(d); the norm clamped below by eps (a zero vector gives zeros)."""
    from jxformers.nn.layers import ScaleNorm, make_norm

    norm = make_norm("scalenorm", 16)
    assert isinstance(norm, ScaleNorm) and norm.weight.shape == () and float(norm.weight) == pytest.approx(4.0)
    norm = eqx.tree_at(lambda n: n.weight, norm, jnp.asarray(2.5))
    x = np.asarray(jax.random.normal(jax.random.key(0), (3, 5, 16)), np.float64)
    expected = 2.5 * x / np.linalg.norm(x, axis=-1, keepdims=True)
    assert_close(norm(jnp.asarray(x, jnp.float32)), expected, atol=1e-5)
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16
    zero = jnp.zeros((2, 16))
    assert_close(norm(zero), zero, atol=0)
    assert bool(jnp.all(jnp.isfinite(jax.grad(lambda z: norm(z).sum())(zero))))


@pytest.mark.parametrize("placement,norm", [("post", "layernorm"), ("pre", "rmsnorm"), ("pre", "scalenorm")])
def test_norm_placements(placement, norm):
    model = build_model(dict(TINY, task="classify", norm_placement=placement, norm=norm), key=jax.random.key(0))
    assert bool(jnp.all(jnp.isfinite(eqx.filter_jit(model)(tokens(0)))))


def test_mixed_precision_keeps_float32_parameters():
    full = build_model(dict(TINY, task="lm"), key=jax.random.key(0))
    half = build_model(dict(TINY, task="lm", dtype="bfloat16"), key=jax.random.key(0))
    params = jax.tree.leaves(eqx.filter(half, eqx.is_inexact_array))
    assert all(p.dtype == jnp.float32 for p in params)
    x = tokens(4)
    out = eqx.filter_jit(half)(x)
    assert out.dtype == jnp.float32
    assert_close(out, eqx.filter_jit(full)(x), atol=0.15, rtol=0.1)
    state = half.init_decode_state(4)
    assert state["layers"][0].k.dtype == jnp.bfloat16


def test_dropout_needs_a_key_in_training_and_is_off_in_inference():
    model = build_model(dict(TINY, task="classify", dropout=0.5), key=jax.random.key(0))
    x = tokens(0)
    run = eqx.filter_jit(model)  # compiled, not op by op
    a = run(x, key=jax.random.key(1))
    b = run(x, key=jax.random.key(2))
    assert not bool(jnp.allclose(a, b))
    assert_close(run(x, inference=True), run(x, inference=True))


def test_per_layer_overrides():
    model = build_model(
        dict(
            TINY,
            task="lm",
            layer_overrides={1: {"attention": "local", "attention_kwargs": {"window": 2}, "ffn": "swiglu"}},
        ),
        key=jax.random.key(0),
    )
    assert model.blocks[0].attention.name == "softmax" and model.blocks[1].attention.name == "local"
    assert model.blocks[1].ffn.kind == "swiglu"


# ----------------------------------------------------------------------------- configs


def test_config_from_dict_and_yaml(tmp_path):
    text = "task: lm\nvocab_size: 29\nattention: {name: performer, num_features: 8}\nstack: {filters: {}}\n"
    path = tmp_path / "model.yaml"
    path.write_text(text)
    for source in (text, str(path), path):
        cfg = ModelConfig.from_yaml(source)
        assert cfg.task == "lm" and cfg.attention.hyper_parameters == {"num_features": 8}
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    model = build_model(text, key=jax.random.key(0))
    assert isinstance(model, jxformers.nn.LanguageModel)
    cfg = ModelConfig.from_yaml("task: classify\nstack:\n  filters:\n    '0': 0.5\n")
    assert cfg.stack.filters == {0: 0.5}
    # The flat form of earlier versions: the same config, with a FlatConfigWarning.
    with pytest.warns(FlatConfigWarning, match="attention_kwargs -> attention"):
        flat = ModelConfig.from_yaml(
            "task: lm\nvocab_size: 29\nattention: performer\nattention_kwargs:\n  num_features: 8\nfilters: {}\n"
        )
    assert flat == ModelConfig.from_yaml(text)


@pytest.mark.parametrize(
    "values,match",
    [
        ({"colour": "red"}, "unknown model config key"),
        ({"task": "translate"}, "task must be one of"),
        ({"num_layers": "2"}, "num_layers must be int"),
        ({"num_layers": 0}, "num_layers must be >= 1"),
        ({"dropout": 1.0}, "dropout"),
        ({"attention": "flashy"}, "unknown attention 'flashy'; registered: softmax"),
        ({"attention": "local", "attention_kwargs": {"widow": 3}}, "unknown hyper-parameter"),
        ({"attention": "local", "attention_kwargs": {"window": "3"}}, "hyper-parameter window must be int"),
        ({"task": "lm", "attention": "nystrom"}, "needs causal attention.*Causal attentions"),
        ({"attention": "linear", "position": "alibi"}, "logit bias"),
        ({"d_model": 12, "num_heads": 4, "position": "rope"}, "even head size"),
        ({"d_model": 18, "num_heads": 4}, "divisible"),
        ({"task": "lm", "filters": {0: 0.5}}, "filters"),
        ({"filters": {5: 0.5}}, "block index"),
        ({"task": "seq2seq", "cross_attention": "local"}, "cannot cross-attend"),
        ({"layer_overrides": {0: {"heads": 2}}}, "may set only"),
        ({"attention": "linformer", "attention_kwargs": {"max_len": 8}, "max_len": 64}, "must cover"),
    ],
)
def test_config_errors(values, match):
    with pytest.raises(ValueError, match=match):
        build_model(values, key=jax.random.key(0))


def test_sequences_longer_than_max_len_are_errors():
    model = build_model(dict(TINY, task="classify", max_len=10), key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_len"):
        model(tokens(0, 10))  # 10 tokens + CLS


# ----------------------------------------------------------------------------- reversible


def test_reversible_backward_reconstructs_and_matches_autodiff():
    from jxformers.nn.reversible import reversible_stack

    # Two layers: the backward pass reconstructs the second block's input from its output,
    # then the first's from that reconstruction (a chain, as in a deeper stack).
    model = build_model(dict(TINY, task="lm", reversible=True, position="t5"), key=jax.random.key(0))
    blocks = model.blocks
    x = jax.random.normal(jax.random.key(1), (12, 16))
    bias = model.embedding.positions.bias(jnp.arange(12), jnp.arange(12))

    def loss(fn, blocks, x, bias):
        return jnp.sum(jnp.sin(fn(blocks, x, bias)))

    @eqx.filter_jit  # both gradients in one compiled program, not op by op
    def both_grads(args):
        ours = eqx.filter_grad(lambda a: loss(lambda b, x, c: reversible_stack(b, x, bias=c), *a))(args)
        return ours, eqx.filter_grad(lambda a: loss(plain_reversible, *a))(args)

    ours, ref = both_grads((blocks, x, bias))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        assert_close(a, b, atol=2e-5)
    assert float(jnp.abs(ours[2]).max()) > 0  # the T5 bias gets its gradient
    # The model's decoding parity holds for the reversible wiring too.
    tok = tokens(3, 10)
    state, steps = model.init_decode_state(10), []
    decode_step = eqx.filter_jit(lambda m, token, state: m.decode_step(token, state))  # compiled once
    for t in range(10):
        out, state = decode_step(model, tok[t], state)
        steps.append(out)
    assert_close(jnp.stack(steps), eqx.filter_jit(model)(tok), atol=3e-5, rtol=1e-4)


def test_reversible_activation_memory_does_not_grow_with_depth():
    def temp(layers, reversible):
        model = build_model(
            dict(TINY, task="lm", num_layers=layers, reversible=reversible, max_len=256), key=jax.random.key(0)
        )
        x = tokens(0, 256)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        grad = jax.jit(jax.grad(lambda p: jnp.mean(eqx.combine(p, static)(x) ** 2)))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    # From 1 to 4 layers (4 compilations, the largest of 4 layers): the reversible stack's
    # temporaries grow by about 0.14 of the plain stack's (0.06 from 2 to 8 layers); one
    # that kept each layer's activations would grow like the plain one.
    plain_growth = temp(4, False) - temp(1, False)
    reversible_growth = temp(4, True) - temp(1, True)
    assert reversible_growth < 0.25 * plain_growth


def test_reversible_config_errors():
    with pytest.raises(ValueError, match="reversible"):
        build_model(dict(TINY, task="classify", reversible=True, norm_placement="post"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="reversible"):
        build_model(dict(TINY, task="seq2seq", reversible=True), key=jax.random.key(0))


# ----------------------------------------------------------------------------- dropout


def test_each_residual_branch_drops_once():
    # A branch zeroed twice (the attention module and the block both dropping) would
    # zero 1 - (1 - p)^2 = 0.75 of its output at p = 0.5.
    model = build_model(dict(TINY, task="classify", d_model=64, dropout=0.5, max_len=160), key=jax.random.key(0))
    block = model.encoder.blocks[0]
    x = jax.random.normal(jax.random.key(1), (128, 64))
    for branch in (block.attention_branch, block.ffn_branch):
        out, _ = branch(x, key=jax.random.key(2))
        zeroed = float(jnp.mean(out == 0))
        assert abs(zeroed - 0.5) < 0.02, zeroed
        assert float(jnp.mean(branch(x, inference=True)[0] == 0)) < 0.01
    assert not any(
        isinstance(leaf, eqx.nn.Dropout)
        for leaf in jax.tree.leaves(block.attention, is_leaf=lambda m: isinstance(m, eqx.nn.Dropout))
    )


def test_reversible_stack_uses_the_blocks_branches_with_dropout():
    from jxformers.nn.reversible import reversible_stack

    model = build_model(dict(TINY, task="lm", reversible=True, dropout=0.3), key=jax.random.key(0))  # 2 layers
    x = jax.random.normal(jax.random.key(1), (12, 16))
    key = jax.random.key(7)

    def plain(blocks, x):  # the same wiring, plain autodiff, the blocks' own branches and keys
        x1 = x2 = x
        for b, k in zip(blocks, jax.random.split(key, len(blocks)), strict=True):
            kf, kg = jax.random.split(k)
            x1 = x1 + b.attention_branch(x2, key=kf)[0]
            x2 = x2 + b.ffn_branch(x1, key=kg)[0]
        return (x1 + x2) / 2

    ours = lambda blocks, x: reversible_stack(blocks, x, key=key)  # noqa: E731

    @eqx.filter_jit  # every value the test compares, in one compiled program
    def run(args):
        g_ours = eqx.filter_grad(lambda a: jnp.sum(jnp.sin(ours(*a))))(args)
        g_plain = eqx.filter_grad(lambda a: jnp.sum(jnp.sin(plain(*a))))(args)
        return ours(*args), plain(*args), reversible_stack(*args, inference=True), g_ours, g_plain

    out, want, inference, g_ours, g_plain = run((model.blocks, x))
    assert_close(out, want, atol=2e-5)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_plain), strict=True):
        assert_close(a, b, atol=2e-5)
    assert not bool(jnp.allclose(out, inference))


def test_attention_module_holds_its_bound_core_and_names_its_scope():
    attn = Attention(jxformers.registry.get("local").bind(window=3), 16, 4, causal=True, key=jax.random.key(0))
    assert attn.core.hyper_parameters["window"] == 3 and hash(attn.core) == hash(attn.core)
    assert attn.name == "local"
    compiled = jax.jit(lambda x: attn(x)).lower(jnp.ones((6, 16))).compile().as_text()
    assert "/local/" in compiled  # the named scope is in the ops' metadata (and so in profiles)
    with pytest.raises(ValueError, match="attention_kwargs go with an attention name"):
        Attention(attn.core, 16, 4, attention_kwargs={"window": 2}, key=jax.random.key(0))


# ----------------------------------------------------------------------------- initialisation


@pytest.mark.parametrize("d_model", [16, 128])
def test_untrained_language_model_starts_near_chance(d_model):
    """Before training, the tied readout must not echo the input token: the loss on random
    tokens is close to ln(V) (copy's vocabulary: 11) and the input token gets little mass."""
    vocab = 11
    config = ModelConfig(task="lm", vocab_size=vocab, num_layers=2, d_model=d_model, num_heads=4, max_len=64)
    model = build_model(config, key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (4, 64), 0, vocab)
    log_p = jax.nn.log_softmax(eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, x), axis=-1)
    loss = -jnp.take_along_axis(log_p[:, :-1], x[:, 1:, None], axis=-1).mean()
    assert abs(float(loss) - math.log(vocab)) < 0.5, float(loss)
    p_input = jnp.exp(jnp.take_along_axis(log_p, x[..., None], axis=-1))
    assert float(p_input.mean()) < 0.5, float(p_input.mean())


_call = eqx.filter_jit(lambda attention, x: attention(x))
_grad = eqx.filter_jit(eqx.filter_grad(lambda attention, x: jnp.sum(attention(x) ** 2)))


def test_rfa_gate_and_sigma_are_parameters_of_the_module():
    attn = Attention(
        "rfa",
        16,
        4,
        kv_heads=2,
        causal=True,
        key=jax.random.key(0),
        attention_kwargs={"num_features": 8, "gated": True, "sigma": 0.5},
    )
    assert set(attn.token_params) == {"gate_w", "gate_b"} and set(attn.arrays) == {"log_sigma"}
    mask = trainable(attn)
    assert mask.token_params["gate_w"] is True and mask.arrays["log_sigma"] is True
    assert_close(jnp.exp(attn.arrays["log_sigma"]), jnp.full((2, 4), 0.5))  # positive by parametrisation
    x = jax.random.normal(jax.random.key(1), (9, 16))
    q, k, v = (attn._heads(x, p, h) for p, h in ((attn.q_proj, 4), (attn.k_proj, 2), (attn.v_proj, 2)))
    gate = jax.nn.sigmoid(x @ attn.token_params["gate_w"] + attn.token_params["gate_b"][None])  # [tokens, heads]
    expected = ops.rfa_attention(
        q, k, v, attn.drawn["projection"], log_sigma=attn.arrays["log_sigma"], gate=gate, causal=True
    )
    assert_close(_call(attn, x), attn._out(expected, x), atol=1e-5)
    grads = _grad(attn, x)
    assert (
        float(jnp.abs(grads.token_params["gate_w"]).max()) > 0 and float(jnp.abs(grads.arrays["log_sigma"]).max()) > 0
    )
    # Ungated RFA has no gate; the gate needs a causal state.
    assert Attention("rfa", 16, 4, key=jax.random.key(0)).token_params == {}
    with pytest.raises(ValueError, match="gated=True needs causal"):
        Attention("rfa", 16, 4, key=jax.random.key(0), attention_kwargs={"gated": True})


def test_rfa_learned_sigma_scales_the_random_features():
    q, k, v = (jax.random.normal(jax.random.key(i), (7, 2, 4)) for i in range(3))
    w = ops.performer_projection(jax.random.key(3), 8, 4)
    scaled = ops.rfa_attention(q, k, v, w * 0.7)
    assert_close(ops.rfa_attention(q, k, v, w, log_sigma=jnp.full((2, 4), math.log(0.7))), scaled, atol=1e-5)
    with pytest.raises(ValueError, match="log_sigma"):
        ops.rfa_attention(q, k, v, w, log_sigma=jnp.zeros((3, 4)))


def test_longformer_global_projections_change_only_the_global_rows():
    attn = Attention(
        "longformer",
        16,
        4,
        key=jax.random.key(0),
        attention_kwargs={"window": 2, "dilation": 2, "global_indices": (0, 5)},
    )
    assert sorted(attn.token_params) == sorted(f"global_{p}_{w}" for p in "qkv" for w in "wb")
    assert all(trainable(attn).token_params.values())
    x = jax.random.normal(jax.random.key(1), (12, 16))
    call = eqx.filter_jit(lambda a, x: a(x))
    moved = eqx.tree_at(lambda a: a.token_params, attn, {n: p + 0.5 for n, p in attn.token_params.items()})
    change = jnp.abs(call(moved, x) - call(attn, x)).max(-1)
    is_global = jnp.isin(jnp.arange(12), jnp.array([0, 5]))
    assert bool(jnp.all(change[is_global] > 1e-3)) and float(change[~is_global].max()) == 0.0
    plain = Attention("longformer", 16, 4, key=jax.random.key(0), attention_kwargs={"global_projections": False})
    assert plain.token_params == {}


def _synthesizer(kind, **kwargs):
    return Attention(
        "synthesizer", 16, 2, key=jax.random.key(0), attention_kwargs={"kind": kind, "max_len": 12, **kwargs}
    )


def test_dense_synthesizer_reads_the_layer_input_not_the_queries():
    # B_i = W2 relu(W1 X_i + b1) + b2 per head, from the token X_i (Tay et al. 2021, eq. 1).
    attn = _synthesizer("dense", hidden=8)
    p = attn.token_params
    assert {n: a.shape for n, a in p.items()} == {"w1": (2, 16, 8), "b1": (2, 8), "w2": (2, 8, 12), "b2": (2, 12)}
    assert _synthesizer("dense").token_params["w1"].shape == (2, 16, 16)  # hidden = d_model, the paper's d x d
    p = {n: a + 0.1 * jax.random.normal(jax.random.key(i), a.shape) for i, (n, a) in enumerate(p.items())}
    attn = eqx.tree_at(lambda a: a.token_params, attn, p)
    x = jax.random.normal(jax.random.key(1), (9, 16))
    xn, pn = np.asarray(x), {n: np.asarray(a) for n, a in p.items()}
    logits = np.stack([np.maximum(xn @ pn["w1"][h] + pn["b1"][h], 0) @ pn["w2"][h] + pn["b2"][h] for h in range(2)])
    v = attn._heads(x, attn.v_proj, 2)
    expected = ops.softmax_attention(v, v, v, bias=jnp.asarray(logits[:, :, :9], jnp.float32), scale=0.0)
    assert_close(_call(attn, x), attn._out(expected, x), atol=1e-5)
    other_q = eqx.tree_at(lambda a: a.q_proj.weight, attn, attn.q_proj.weight * 3)
    assert_close(_call(other_q, x), _call(attn, x), atol=1e-6)  # the query projection plays no part
    grads = _grad(attn, x)
    assert float(jnp.abs(grads.token_params["w1"]).max()) > 0


def test_factorized_dense_synthesizer_tiles_a_and_repeats_b():
    attn = _synthesizer("factorized_dense", factor=4)  # a = 4, b = 3: a * b = max_len
    p = attn.token_params
    x = jax.random.normal(jax.random.key(1), (12, 16))
    xn, pn = np.asarray(x), {n: np.asarray(a) for n, a in p.items()}
    a = np.stack([xn @ pn["wa"][h] + pn["ba"][h] for h in range(2)])  # [heads, n, 4]
    b = np.stack([xn @ pn["wb"][h] + pn["bb"][h] for h in range(2)])  # [heads, n, 3]
    c = np.stack(
        [[np.array([a[h, i, t % 4] * b[h, i, t // 4] for t in range(12)]) for i in range(12)] for h in range(2)]
    )
    assert_close(attn.core.token_arrays(p, x, x)["dense_logits"], c, atol=1e-5)


def test_synthesizer_random_logits_fixed_or_trained_and_the_mixture_is_learned():
    trained, fixed = _synthesizer("random"), _synthesizer("random", trainable_random=False)
    assert trainable(trained).arrays["random"] is True
    assert set(fixed.drawn) == {"fixed_random"} and trainable(fixed).drawn["fixed_random"] is False
    assert jxformers.nn.redraw(fixed, jax.random.key(3)) is fixed  # drawn once, never redrawn
    mixed = _synthesizer("random", mixture=True)
    assert_close(mixed.arrays["mixture_logits"], jnp.zeros(2))  # equal weights to start
    x = jax.random.normal(jax.random.key(1), (9, 16))
    grads = _grad(mixed, x)
    assert float(jnp.abs(grads.arrays["mixture_logits"]).max()) > 0
    assert float(jnp.abs(grads.q_proj.weight).max()) > 0  # the dot-product half reads q and k


def test_dense_synthesizer_language_model_is_causal_and_trains():
    from suites import TINY as SMALL
    from suites import finite_grads, forward, loss_grad, tokens

    model = build_model(
        ModelConfig(task="lm", attention="synthesizer", **SMALL, attention_kwargs={"kind": "dense", "hidden": 8}),
        key=jax.random.key(0),
    )
    x = tokens(3)
    logits = forward(model, x)
    changed = forward(model, x.at[12:].set(tokens(4)[12:]))
    assert_close(changed[:12], logits[:12], atol=1e-5)
    assert not bool(jnp.allclose(changed[12:], logits[12:]))
    assert finite_grads(loss_grad(model, x))
