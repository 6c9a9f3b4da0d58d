"""Whole-model designs of Lin et al. 2021's survey, sections 6.1 and 6.5 (issue 32): Lite
Transformer (Wu et al. 2020, `stack: lite`), DeLighT (Mehta et al. 2021, `stack: delight`)
and the Evolved Transformer's cells (So et al. 2019, `stack: evolved`).

Each part is checked against a numpy reference written from the paper (and its authors'
code) in float64: LSRA's channel split and its dynamic / lightweight convolution
(GLU, a per-position softmax kernel per head), DExTra's group linear transformations with
feature shuffling and its input mixer, the group and width schedules and block-wise
scaling (eq. 2 and 4), GLT parameter counts (N M / g), the ET cells branch by branch (the
decoder cell's attend-to-encoder branches too) and their parameter counts; then as
models: decoding parity (the convolutions' last k - 1 inputs in the state), padding that
cannot leak, gradients, another registered attention, YAML, training steps, a
command-line run resumed exactly, the refusals, and a 2x2x2 mesh. (The ET's
encoder-decoder as a model: tests/test_seq2seq.py.)

Mutations the references are written to catch (not each tried by hand yet): the LSRA halves swapped
(convolution on the first half); the dynamic kernel's softmax over the heads instead of
the taps; the causal padding put on the right; the GLT without its shuffle; the input
mixer concatenating [Y; X] instead of [X; Y] per group; g^l = 2^l (the authors' code)
instead of eq. 2's 2^(l-1); the ET decoder's 7x1 branch read from the 11-row window's
start; the decoder FFN without its hidden norm; a decoding step not shifting its window.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import (
    command_line_round_trip,
    decode_all,
    finite_grads,
    forward_and_grad,
    mesh_trains_like_one_device,
    train_steps,
)

from jxformers import ModelConfig, build_model, registry
from jxformers.nn.delight import DExTra, GroupLinear, block_scaling, dextra_sizes, glt_groups, mix
from jxformers.nn.evolved import Conv, EvolvedDecoderCell, EvolvedEncoderCell, SeparableConv
from jxformers.nn.lite import LiteBlock, SequenceConv

TINY = dict(vocab_size=23, num_layers=2, d_model=32, num_heads=2, max_len=24)
STACKS = {
    "lite": {"kind": "lite", "kernel_sizes": [3, 4]},
    "delight": {"kind": "delight", "min_depth": 2, "max_depth": 3},
    "evolved": {"kind": "evolved", "wide_heads": 4},
}


def _params(module) -> int:
    return sum(a.size for a in jax.tree.leaves(eqx.filter(module, eqx.is_inexact_array)))


def _np(x):
    return np.asarray(x, np.float64)


def _x(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def _linear(layer, x):
    return x @ _np(layer.weight).T + (0 if layer.bias is None else _np(layer.bias))


def _layernorm(x, norm=None, eps=1e-5):
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps)
    return y if norm is None else y * _np(norm.weight) + _np(norm.bias)


def _softmax(z, axis=-1):
    z = z - z.max(axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis, keepdims=True)


def _silu(z):
    return z / (1 + np.exp(-z))


def _attention(att, x, causal=False, mask=None, out=None, context=None):
    """Multi-head softmax attention with the module's projections (`out`: the output
    projection when it is not the module's; keys and values from `context` when given,
    `mask` then its padding), numpy."""
    n, h, dh = x.shape[0], att.num_heads, att.d_head
    kv = x if context is None else _np(context)
    m = kv.shape[0]
    q = _linear(att.q_proj, x).reshape(n, h, dh)
    k, v = (_linear(p, kv).reshape(m, h, dh) for p in (att.k_proj, att.v_proj))
    s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)
    allowed = np.ones((n, m), bool) if mask is None else np.broadcast_to(np.asarray(mask)[None], (n, m)).copy()
    if causal:
        allowed &= np.tril(np.ones((n, n), bool))
    s = np.where(allowed[None], s, -np.inf)
    heads = np.einsum("hqk,khd->qhd", _softmax(s), v).reshape(n, h * dh)
    return _linear(att.o_proj if out is None else out, heads)


def _conv_reference(conv, x, causal, mask=None):
    """LSRA's convolution branch: h = GLU(x W1 + b1) (padded rows zero), y_{i,j} = sum_t
    softmax_t(k_{i,h}) h_{i+t-p, j} for head h = j // (c / H), then y W2 + b2."""
    x = _np(x)
    n, c = x.shape
    a = _linear(conv.linear1, x)
    h = a[:, :c] / (1 + np.exp(-a[:, c:])) if conv.glu else a
    real = np.ones(n, bool) if mask is None else np.asarray(mask)
    h = np.where(real[:, None], h, 0.0)
    K, H = conv.taps, conv.heads
    if conv.kernel_proj is not None:
        logits = (h @ _np(conv.kernel_proj.weight).T).reshape(n, H, K)
    else:
        logits = np.broadcast_to(_np(conv.kernel), (n, H, K))
    w = _softmax(logits)
    p = K - 1 if causal else (K - 1) // 2
    y = np.zeros((n, c))
    for i in range(n):
        for t in range(K):
            j = i + t - p
            if 0 <= j < n:
                for ch in range(c):
                    y[i, ch] += w[i, ch // (c // H), t] * h[j, ch]
    return _linear(conv.linear2, y)


# ----------------------------------------------------------------------------- Lite Transformer


@pytest.mark.parametrize("kind", ["dynamic", "lightweight"])
@pytest.mark.parametrize("causal", [False, True])
def test_lsra_convolution_branch_against_numpy(kind, causal):
    conv = SequenceConv(8, 4, heads=2, kind=kind, causal=causal, key=jax.random.key(1))
    x = _x(2, 7, 8)
    mask = jnp.arange(7) < 5
    assert_close(conv(x), _conv_reference(conv, x, causal), atol=1e-5)
    got = conv(x.at[5:].set(jnp.nan), mask)[:5]  # padded rows (NaN) read as zeros
    assert_close(got, _conv_reference(conv, x, causal, mask)[:5], atol=1e-5)


def test_lsra_splits_the_channels_between_attention_and_convolution():
    block = LiteBlock(registry.get("softmax").bind(), 16, 2, kernel_size=3, d_ff=16, causal=True, key=jax.random.key(3))
    x = _x(4, 6, 16)
    mixed, _ = block.mix(x)
    assert_close(mixed[:, :8], _attention(block.attention, _np(x[:, :8]), causal=True), atol=1e-5)
    assert_close(mixed[:, 8:], _conv_reference(block.conv, x[:, 8:], True), atol=1e-5)
    # the block: post-norm, LN(h + FFN(h)) after LN(x + LSRA(x)); the flattened FFN (d_ff = d_model)
    h = _layernorm(_np(x) + _np(mixed), block.norms[0])
    ffn = block.ffn
    ref = _layernorm(h + _linear(ffn.w_out, np.maximum(_linear(ffn.w_in, h), 0)), block.norms[1])
    assert ffn.w_in.weight.shape == (16, 16)
    assert_close(block(x), ref, atol=1e-4)


def test_lite_kernel_sizes_follow_the_layers():
    config = ModelConfig(task="lm", **TINY | {"num_layers": 3}, stack={"kind": "lite"})
    model = build_model(config, key=jax.random.key(0))
    assert [b.conv.taps for b in model.blocks] == [3, 7, 15]  # the authors' list, cut to the layers
    assert config.norm.placement == "post" and model.blocks[0].ffn.w_in.weight.shape == (32, 32)


# ----------------------------------------------------------------------------- DeLighT


def test_group_linear_against_numpy_with_and_without_shuffling():
    for shuffle in (True, False):
        glt = GroupLinear(12, 8, 4, shuffle=shuffle, key=jax.random.key(5))
        x = _x(6, 3, 12)
        w, b = _np(glt.weight), _np(jax.random.normal(jax.random.key(7), (4, 2)))
        glt = eqx.tree_at(lambda g: g.bias, glt, jnp.asarray(b, jnp.float32))
        groups = np.stack([_np(x)[:, 3 * k : 3 * k + 3] @ w[k] + b[k] for k in range(4)], 1)  # [n, g, 2]
        if shuffle:  # ShuffleNet's channel shuffle: [g, M/g] -> [M/g, g] -> read as [g, M/g]
            groups = groups.transpose(0, 2, 1).reshape(3, 4, 2)
        assert_close(glt(x), _silu(_layernorm(groups)).reshape(3, 8), atol=1e-5)
        assert _params(glt) == 12 * 8 // 4 + 8 + 2 * 8 // 4  # N M / g + M + LN


def test_input_mixer_interleaves_input_and_output_groups():
    x, y = np.arange(4.0)[None], 10 + np.arange(6.0)[None]
    assert np.asarray(mix(jnp.asarray(x), jnp.asarray(y), 2)).tolist() == [[0, 1, 10, 11, 12, 2, 3, 13, 14, 15]]


def test_group_and_width_schedules_follow_the_paper():
    assert glt_groups(4, 8) == (1, 2, 2, 1)  # g^l = min(2^(l-1), g_max), mirrored
    assert glt_groups(5, 8) == (1, 2, 4, 2, 1)
    assert glt_groups(8, 4) == (1, 2, 4, 4, 4, 4, 2, 1)
    sizes = dextra_sizes(16, 16, 64, 4, 8)
    assert sizes["out"] == (16, 64, 64, 16) and sizes["in"] == (16, 32, 80, 80)  # expand to w_m d_m, reduce to d_o
    # eq. 4: N^b = N_min + (N_max - N_min) b / (B - 1), w^b = w_m + (N_max - N_min) b / (N_min (B - 1))
    depths, widths = block_scaling(5, 4, 8, 2.0)
    assert depths == (4, 5, 6, 7, 8) and widths == (2.0, 2.25, 2.5, 2.75, 3.0)
    assert block_scaling(3, 4, 4, 2.0) == ((4, 4, 4), (2.0, 2.0, 2.0))


def test_dextra_against_numpy_and_its_parameter_count():
    dextra = DExTra(32, 16, depth=4, width_mult=2.0, max_groups=2, key=jax.random.key(8))
    x = _x(9, 5, 32)

    def dense(layer, v):
        return _silu(_layernorm(_linear(layer.linear, v), layer.norm))

    def glt(layer, v):
        w, b, g = _np(layer.weight), _np(layer.bias), layer.groups
        i = v.shape[1] // g
        out = np.stack([v[:, i * k : i * (k + 1)] @ w[k] + b[k] for k in range(g)], 1)
        if layer.shuffle:
            out = out.transpose(0, 2, 1).reshape(v.shape[0], g, -1)
        return _silu(_layernorm(out, layer.norm)).reshape(v.shape[0], -1)

    def mixer(a, b, g):
        return np.concatenate([a.reshape(len(a), g, -1), b.reshape(len(b), g, -1)], -1).reshape(len(a), -1)

    xp = dense(dextra.input_layer, _np(x))
    y = glt(dextra.layers[0], xp)
    for layer in dextra.layers[1:]:
        y = glt(layer, mixer(xp, y, layer.groups))
    assert_close(dextra(x), dense(dextra.output_layer, np.concatenate([xp, y], -1)), atol=1e-4)
    sizes = dextra_sizes(16, 16, 64, 4, 2)
    glts = sum(i * o // g + o + 2 * o // g for i, o, g in zip(sizes["in"], sizes["out"], sizes["groups"], strict=True))
    dense_params = (32 * 16 + 16 + 32) + (32 * 16 + 16 + 32)  # input and output layers, with their norms
    assert _params(dextra) == glts + dense_params


def test_delight_blocks_scale_blockwise_with_single_head_attention():
    stack = {"kind": "delight", "min_depth": 2, "max_depth": 4}
    config = ModelConfig(task="lm", **TINY | {"num_layers": 3}, stack=stack)
    model = build_model(config, key=jax.random.key(0))
    assert [len(b.dextra.layers) for b in model.blocks] == [2, 3, 4]
    block = model.blocks[0]
    a = block.attention
    assert (a.num_heads, a.d_head, block.out.weight.shape) == (1, 16, (32, 16))  # d_o = d_m / 2, out to d_m
    assert block.ffn.w_in.weight.shape == (8, 32) and block.ffn.kind == "silu"  # light FFN: d_m / 4, swish
    x = _x(10, 6, 32)
    mixed, _ = block.mix(x, None, key=None, inference=True)
    assert_close(mixed, _attention(a, _np(block.dextra(x)), causal=True, out=block.out), atol=1e-4)


# ----------------------------------------------------------------------------- the Evolved Transformer


def _sep_reference(sep, x, causal, mask=None):
    x = _np(x)
    n = x.shape[0]
    real = np.ones(n, bool) if mask is None else np.asarray(mask)
    x = np.where(real[:, None], x, 0)
    w = _np(sep.depth)
    k = w.shape[0]
    p = k - 1 if causal else (k - 1) // 2
    z = np.zeros_like(x)
    for i in range(n):
        for t in range(k):
            if 0 <= i + t - p < n:
                z[i] += w[t] * x[i + t - p]
    return _linear(sep.pointwise, z)


def _conv3_reference(conv, x, mask=None):
    x = _np(x)
    n = x.shape[0]
    real = np.ones(n, bool) if mask is None else np.asarray(mask)
    x = np.where(real[:, None], x, 0)
    w = _np(conv.weight)
    y = np.tile(_np(conv.bias), (n, 1))
    for i in range(n):
        for t in range(3):
            if 0 <= i + t - 1 < n:
                y[i] += x[i + t - 1] @ w[t]
    return y


def test_separable_and_standard_convolutions_against_numpy():
    x, mask = _x(11, 9, 6), jnp.arange(9) < 7
    for causal in (False, True):
        sep = SeparableConv(6, 4, 5, causal=causal, key=jax.random.key(12))
        assert_close(sep(x), _sep_reference(sep, x, causal), atol=1e-5)
        assert_close(sep(x.at[7:].set(jnp.nan), mask)[:7], _sep_reference(sep, x, causal, mask)[:7], atol=1e-5)
    conv = Conv(6, 3, 3, key=jax.random.key(13))
    assert_close(conv(x, mask), _conv3_reference(conv, x, mask), atol=1e-5)


def _pad(v, width):
    return np.pad(v, ((0, 0), (0, width - v.shape[1])))


def test_evolved_encoder_cell_against_numpy_branch_by_branch():
    d = 16
    cell = EvolvedEncoderCell(registry.get("softmax").bind(), d, 2, key=jax.random.key(14))
    x0 = _x(15, 10, d)
    x = _np(x0)
    N = [lambda v, i=i: _layernorm(v, cell.norms[i]) for i in range(5)]
    h = N[0](x)
    x = x + _linear(cell.values, h) / (1 + np.exp(-_linear(cell.gates, h)))  # GLU
    h = N[1](x)
    s = np.maximum(_linear(cell.left, h), 0) + _pad(np.maximum(_conv3_reference(cell.right, h), 0), 4 * d)
    x = x + _pad(_sep_reference(cell.sep9, N[2](s), False), d)  # 9x1 separable, 4d -> d/2
    x = x + _attention(cell.attention, N[3](x))
    x = x + _linear(cell.ffn_out, np.maximum(_linear(cell.ffn_in, N[4](x)), 0))
    assert_close(cell(x0), x, atol=1e-4)
    counts = {
        "glu": 2 * (d * d + d), "branches": (4 * d * d + 4 * d) + (3 * d * d // 2 + d // 2),
        "sep9": 9 * 4 * d + 4 * d * d // 2 + d // 2, "attention": 4 * (d * d + d),
        "ffn": 2 * 4 * d * d + 4 * d + d, "norms": 2 * (4 * d + 4 * d),
    }  # fmt: skip
    assert _params(cell) == sum(counts.values())


@pytest.mark.parametrize("encoder", [False, True], ids=["lm", "seq2seq"])
def test_evolved_decoder_cell_against_numpy_and_decodes_its_convolutions(encoder):
    """The lm cell; with an encoder (seq2seq), its attend-to-encoder branches too: the
    first beside the wide self-attention on the same N_0(x), the second after the
    self-attention with its own norm, both reading the encoder's real rows only."""
    d = 16
    softmax = registry.get("softmax").bind()
    cell = EvolvedDecoderCell(
        softmax, d, 2, wide_heads=8, cross_attention=softmax if encoder else None, key=jax.random.key(16)
    )
    x0 = _x(17, 12, d)
    context, context_mask = _x(18, 7, d), jnp.arange(7) < 5
    kw = dict(context=context.at[5:].set(jnp.nan), context_mask=context_mask) if encoder else {}
    x = _np(x0)
    N = [lambda v, i=i: _layernorm(v, cell.norms[i]) for i in range(len(cell.norms))]
    assert cell.wide.num_heads == 8 and len(cell.norms) == 6 + encoder
    assert (cell.first_encoder is not None) == (cell.second_encoder is not None) == encoder
    h = N[0](x)
    x = x + _attention(cell.wide, h, causal=True)
    if encoder:  # beside the wide self-attention, on the same normalised input
        x = x + _attention(cell.first_encoder, h, mask=context_mask, context=context)
    h = N[1](x)
    s = np.maximum(_sep_reference(cell.sep11, h, True), 0) + _pad(_sep_reference(cell.sep7, h, True), 2 * d)
    x = x + _sep_reference(cell.sep7_out, N[2](s), True)
    x = x + _attention(cell.attention, N[3](x), causal=True)
    if encoder:  # after the self-attention, its own norm N_6
        x = x + _attention(cell.second_encoder, N[6](x), mask=context_mask, context=context)
    x = x + _linear(cell.ffn_out, N[5](_silu(_linear(cell.ffn_in, N[4](x)))))
    assert_close(cell(x0, **kw), x, atol=1e-4)

    @eqx.filter_jit
    def decoded(cell, rows):
        kv = None if not encoder else cell.project_context(kw["context"])
        step = lambda s, r: cell.decode_step(r, s, context_kv=kv, context_mask=kw.get("context_mask"))[::-1]  # noqa: E731
        return jax.lax.scan(step, cell.init_decode_state(12, jnp.float32), rows)[1]

    assert_close(decoded(cell, x0), x, atol=1e-4)
    with pytest.raises(ValueError, match="attends to an encoder: pass a context" if encoder else "takes no context"):
        cell(x0, **({} if encoder else {"context": context}))


# ----------------------------------------------------------------------------- models


def _model(kind, task="lm", **extra):
    return build_model(ModelConfig(task=task, **TINY | extra, stack=STACKS[kind]), key=jax.random.key(0))


@pytest.mark.parametrize("kind", list(STACKS))
def test_language_models_decode_as_they_run_in_parallel(kind):
    model = _model(kind)
    tokens = jax.random.randint(jax.random.key(1), (12,), 0, 23)
    assert_close(decode_all(model, tokens), model(tokens), atol=1e-4)


def test_another_registered_attention_composes_and_decodes():
    model = _model("lite", attention={"name": "linear"})
    assert model.blocks[0].attention.name == "linear"
    tokens = jax.random.randint(jax.random.key(2), (10,), 0, 23)
    assert_close(decode_all(model, tokens), model(tokens), atol=1e-4)


@pytest.mark.parametrize("kind", list(STACKS))
def test_encoders_keep_padding_out_and_have_finite_gradients(kind):
    model = _model(kind, task="classify")
    tokens = jax.random.randint(jax.random.key(3), (10,), 0, 23)
    mask = jnp.arange(10) < 7
    out, grads = forward_and_grad(model, tokens, mask)
    other = model(tokens.at[7:].set(5), mask)  # other tokens in the padded rows
    assert_close(other, out, atol=1e-5)
    assert finite_grads(grads)


@pytest.mark.parametrize("kind", list(STACKS))
def test_training_steps_lower_the_loss(kind):
    model = _model(kind)
    tokens = jax.random.randint(jax.random.key(4), (4, 10), 0, 23)
    _, losses = train_steps(model, tokens, jnp.ones((4, 10), bool), steps=4)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


YAML = """
task: lm
vocab_size: 23
num_layers: 2
d_model: 32
num_heads: 2
max_len: 24
stack: {kind: lite, conv: lightweight, kernel_sizes: 5, conv_heads: 2, glu: false}
"""


def test_settings_reach_the_modules_from_yaml():
    config = ModelConfig.from_yaml(YAML)
    model = build_model(config, key=jax.random.key(0))
    conv = model.blocks[1].conv
    assert conv.taps == 5 and conv.heads == 2 and conv.kernel is not None and not conv.glu
    assert ModelConfig.from_dict(config.to_dict()) == config
    evolved = ModelConfig(task="classify", **TINY, stack="evolved")
    assert evolved.norm.placement == "pre" and evolved.stack.wide_heads == 16


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"task": "seq2seq", "stack": "lite"}, "serves tasks"),
        ({"stack": "lite", "attention": {"name": "softmax", "qk_norm": "l2"}}, "module options"),
        ({"stack": {"kind": "lite", "kernel_sizes": [3, 5, 7]}, "num_layers": 4}, "one kernel size per layer"),
        ({"stack": "lite", "num_heads": 32}, "must divide d_model / 2"),
        ({"stack": "lite", "norm": {"kind": "powernorm"}}, "powernorm"),
        ({"stack": "lite", "embedding": {"position": "rope"}}, "positions added to the embeddings"),
        ({"stack": "delight", "ffn": {"d_ff": 64}}, "light-weight FFN"),
        ({"stack": {"kind": "delight", "min_depth": 6, "max_depth": 4}}, "exceeds max_depth"),
        ({"stack": "delight", "d_model": 24, "num_heads": 2}, "multiple of 2 g_max"),
        ({"stack": "evolved", "norm": {"placement": "post"}}, "pre-norm"),
        ({"stack": "evolved", "ffn": "relu"}, "own FFNs"),
        ({"stack": "evolved", "task": "lm", "d_model": 24, "num_heads": 2}, "wide_heads"),
        ({"stack": "evolved", "kv_heads": 1}, "grouped-query"),
        ({"stack": "evolved", "task": "seq2seq", "d_model": 24, "num_heads": 2}, "wide_heads"),
        ({"stack": "evolved", "task": "seq2seq", "decoder": {"ffn": False}}, "searched structure"),
        (
            {"stack": "evolved", "task": "seq2seq", "decoder": {"cross_attention": {"name": "softmax", "d_head": 8}}},
            "module options .* of decoder.cross_attention",
        ),
        (
            {
                "stack": "evolved",
                "task": "seq2seq",
                "decoder": {"cross_attention": {"name": "block_local", "block_size": 4}},
            },
            "cannot cross-attend",
        ),
    ],
)
def test_config_refusals_name_the_setting_and_the_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{"task": "lm", **TINY, **values})


@pytest.mark.heavy
def test_the_command_line_trains_evaluates_generates_and_resumes_exactly(tmp_path, capsys):
    command_line_round_trip(
        tmp_path, capsys, {"attention": "softmax", "d_model": 32, "stack": STACKS["lite"] | {"kernel_sizes": 3}}
    )


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_each_model_with_the_losses_of_one_device():
    stacks = [STACKS["lite"] | {"kernel_sizes": 3}, STACKS["delight"], STACKS["evolved"]]
    configs = [
        dict(task="lm", vocab_size=31, num_layers=2, d_model=32, num_heads=2, max_len=16, stack=s) for s in stacks
    ]
    mesh_trains_like_one_device(*configs, vocab=31, length=16)
