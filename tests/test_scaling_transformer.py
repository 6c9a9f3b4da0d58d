"""The Scaling Transformer and Terraformer (Jaszczur et al. 2021, "Sparse is Enough in
Scaling Transformers"; issue 32): `ffn: {kind: sparse}` and `attention: {projection:
sparse}` (jxformers.nn.scaling), and their combination with LSH attention and reversible
wiring (experiments/terraformer.yaml).

Each layer against a numpy reference written from the paper's equations in float64: the
controller x C1 C2 + c cut into blocks of N, relu(x W1 + b1) * one-hot, W2 + b2; the
multiplicative layer y_{s,m} = sum_d x_d D_{d,s} E_{d,m} and a causal convolution over
(positions, modules) written as loops. Then: the straight-through gradient reaches the
controller, the gather path that decodes equals the masked dense product, padding and the
future never reach a real row, decoding parity of both layers in a causal model (LSH and
reversible wiring too), a training step through the config, the refusals, a
command-line run resumed exactly, and a 2x2x2 mesh.

Mutations the references catch: the mask taken from the softmax of all d_ff logits
instead of per block; b1 dropped; the relu after the mask of a soft choice (same for
one-hot); the modules' kernel not centred (padding on one side); the convolution
reading the next position instead of the previous; the decode window not shifted.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import command_line_round_trip, decode_all, finite_grads, mesh_trains_like_one_device

from jxformers import ModelConfig, build_model
from jxformers.nn.scaling import SparseFeedForward, SparseQKV, sparse_ffn_flops

TINY = dict(task="lm", vocab_size=13, num_layers=1, d_model=16, num_heads=2, max_len=12)
SPARSE_FFN = {"kind": "sparse", "d_ff": 32, "block_size": 4, "controller_rank": 3}
SPARSE_QKV = {"projection": "sparse", "modules": 4}
# the Scaling Transformer (softmax attention, no W_O) and the Terraformer (LSH, reversible)
SCALING = TINY | dict(ffn=SPARSE_FFN, attention={"name": "softmax", **SPARSE_QKV, "output_projection": "none"})
TERRAFORMER = TINY | dict(
    ffn=SPARSE_FFN,
    attention={"name": "lsh", "n_buckets": 2, "chunk_size": 3, **SPARSE_QKV},
    stack={"kind": "transformer", "reversible": True},
)


def _np(x):
    return np.asarray(x, np.float64)


def _x(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape)


def _reference_ffn(ffn: SparseFeedForward, x):
    """Section 3.1 at inference, from the parameters as matrices: W1 [d_model, d_ff] with
    unit j = b N + i in column j, C1 [d_model, r], C2 [r, d_ff]."""
    x = _np(x)
    blocks, n, d = ffn.w_in.shape
    w1, b1 = _np(ffn.w_in).reshape(blocks * n, d).T, _np(ffn.b_in).reshape(-1)
    w2, b2 = _np(ffn.w_out).reshape(blocks * n, d), _np(ffn.b_out)
    c1, c2, c = _np(ffn.controller_in.weight).T, _np(ffn.controller_out.weight).T, _np(ffn.controller_out.bias)
    logits = (x @ c1 @ c2 + c).reshape(len(x), blocks, n)
    onehot = np.eye(n)[logits.argmax(-1)].reshape(len(x), blocks * n)
    return np.maximum(x @ w1 + b1, 0) * onehot @ w2 + b2, onehot


def _ffn(**options):
    return SparseFeedForward(8, 24, block_size=4, controller_rank=3, **options, key=jax.random.key(0))


@pytest.fixture(scope="module")
def ffn():
    return _ffn()


def test_the_sparse_ffn_at_inference_is_the_papers_one_unit_per_block(ffn):
    x = _x(1, 6, 8)  # 6 rows >= N = 4: the masked dense product
    want, onehot = _reference_ffn(ffn, x)
    assert (onehot.reshape(6, 6, 4).sum(-1) == 1).all()
    assert_close(ffn(x, inference=True), want, atol=1e-5)
    # rows < N: only the chosen units (a gather of W1's columns and W2's rows), the same numbers
    for row in range(3):
        assert_close(ffn(x[row : row + 1], inference=True), want[row : row + 1], atol=1e-5)
    assert_close(eqx.filter_jit(lambda f, x: f.chosen(x))(ffn, x), want, atol=1e-5)
    mask = jax.nn.one_hot(ffn.choice(x), 4)
    assert_close(ffn.masked(x, mask), ffn.chosen(x), atol=1e-6)
    flops = sparse_ffn_flops(512, 2048, 32)
    assert flops["dense"] == 4 * 512 * 2048 and flops["sparse"] == 2 * 64 * (512 + 2048) + 4 * 512 * 64


def test_the_training_choice_is_one_hot_forward_and_the_softmax_backward(ffn):
    x = _x(2, 5, 8)
    logits = ffn.logits(x)
    mask = ffn.mask(x)  # no key: the argmax, straight-through
    assert_close(mask, jax.nn.one_hot(jnp.argmax(logits, -1), 4))
    noisy = _ffn(temperature=10.0)
    draws = [noisy.mask(x, key=jax.random.key(k)) for k in range(3)]
    for d in draws:  # still one unit per block (to rounding: one-hot + p - p)
        assert_close(d, jax.nn.one_hot(jnp.argmax(d, -1), 4), atol=1e-6)
    choices = [np.asarray(jnp.argmax(d, -1)) for d in draws]
    assert any((c != choices[0]).any() for c in choices[1:])  # the Gumbel noise moves choices

    def loss(model):
        return jnp.sum(jnp.square(model(x, key=jax.random.key(3))))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(ffn)
    assert finite_grads(grads)
    for leaf in (grads.controller_in.weight, grads.controller_out.weight, grads.controller_out.bias):
        assert float(jnp.abs(leaf).sum()) > 0  # the straight-through estimator reaches the controller
    # d mask / d logits is the softmax's Jacobian: the gradient of sum(mask * g) is p (g - <p, g>)
    g = _x(4, 5, 6, 4)
    got = jax.grad(lambda lg: jnp.sum(_st(lg) * g))(logits)
    p = _np(jax.nn.softmax(logits))
    assert_close(got, p * (_np(g) - (p * _np(g)).sum(-1, keepdims=True)), atol=1e-5)
    soft = _ffn(hard_fraction=1e-6)  # the soft mask on (nearly) every call
    assert_close(soft.mask(x, key=jax.random.key(5)), jax.nn.softmax(logits), atol=1e-6)


def _st(logits):
    """The mask's straight-through form (SparseFeedForward.mask, without noise)."""
    p = jax.nn.softmax(logits)
    return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1]) + p - jax.lax.stop_gradient(p)


def _reference_qkv(layer: SparseQKV, x, mask=None):
    """Section 3.2: y_{s,m} = sum_d x_d D_{d,s} E_{d,m} + b, then for each conv
    out[t, s, o] = sum_{i, j, c} y[t - (F - 1) + i, s - (G // 2) + j, c] K[i, j, c, o] + k_o,
    positions before 0 and modules outside [0, S) zero."""
    x = _np(x)
    d, e, b = _np(layer.multiplicative.gates), _np(layer.multiplicative.kernel), _np(layer.multiplicative.bias)
    y = np.einsum("nd,ds,dm->nsm", x, d, e) + b
    if mask is not None:
        y = np.where(np.asarray(mask)[:, None, None], y, 0.0)
    n, s, _ = y.shape

    def conv(c):
        w, bias = _np(c.weight), _np(c.bias)
        f, g = w.shape[:2]
        out = np.tile(bias, (n, s, 1))
        for t in range(n):
            for m in range(s):
                for i in range(f):
                    for j in range(g):
                        tt, mm = t - (f - 1) + i, m - g // 2 + j
                        if tt >= 0 and 0 <= mm < s:
                            out[t, m] += y[tt, mm] @ w[i, j]
        return out.reshape(n, -1)

    return [None if c is None else conv(c) for c in (layer.q_conv, layer.k_conv, layer.v_conv)]


def test_the_sparse_qkv_layer_is_the_multiplicative_layer_and_a_causal_convolution():
    layer = SparseQKV(8, modules=4, conv_length=3, conv_modules=3, key=jax.random.key(0))
    assert layer.multiplicative.gates.shape == (8, 4) and layer.multiplicative.kernel.shape == (8, 2)
    x = _x(1, 6, 8)
    for got, want in zip(layer(x), _reference_qkv(layer, x), strict=True):
        assert_close(got, want, atol=1e-5)
    # padding: zeros before the convolutions, so a NaN there reaches no real row
    mask = jnp.array([True, True, False, True, True, False])
    bad = x.at[2].set(jnp.nan).at[5].set(jnp.inf)
    for got, want in zip(layer(bad, mask), _reference_qkv(layer, x, mask), strict=True):
        assert_close(got[np.asarray(mask)], want[np.asarray(mask)], atol=1e-5)
    # causal: a later position never changes an earlier one's q, k, v
    later = x.at[4:].set(jnp.nan)
    for got, want in zip(layer(later), layer(x), strict=True):
        assert_close(got[:4], want[:4])
    # the decoding window, one position at a time
    window, rows = layer.init_window(), []
    for t in range(6):
        made, window = layer.step(x[t], window)
        rows.append(made)
    for i, want in enumerate(layer(x)):
        assert_close(jnp.concatenate([r[i] for r in rows]), want, atol=1e-5)
    assert SparseQKV(8, modules=2, shared_qk=True, key=jax.random.key(0)).k_conv is None


@pytest.fixture(scope="module")
def models():
    return {name: build_model(c, key=jax.random.key(0)) for name, c in (("scaling", SCALING), ("terra", TERRAFORMER))}


@pytest.mark.parametrize("name", ["scaling", "terra"])
def test_a_causal_model_of_both_layers_decodes_as_its_parallel_forward(models, name):
    model = models[name]
    x = jax.random.randint(jax.random.key(5), (9,), 0, 13)
    parallel = eqx.filter_jit(lambda m, t: m(t, inference=True))(model, x)
    assert_close(decode_all(model, x), parallel, atol=2e-5)
    # a changed last token changes no earlier logits
    later = eqx.filter_jit(lambda m, t: m(t, inference=True))(model, x.at[-1].set((x[-1] + 1) % 13))
    assert_close(later[:-1], parallel[:-1])


def test_the_layers_are_reached_from_yaml():
    config = ModelConfig.from_yaml(
        "task: lm\nvocab_size: 13\nd_model: 16\nnum_heads: 2\nffn: {kind: sparse, d_ff: 32, block_size: 4}\n"
        "attention: {name: lsh, projection: sparse, modules: 4}\nstack: {reversible: true}\n"
    )
    assert config.ffn.controller_rank is None and config.attention.modules == 4
    assert ModelConfig(**config.to_dict()) == config


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"ffn": {"kind": "sparse", "d_ff": 30, "block_size": 4}}, "multiple of block_size"),
        ({"attention": {"name": "softmax", "modules": 4}}, "set projection 'sparse'"),
        ({"attention": {"name": "softmax", "projection": "sparse", "modules": 3}}, "must divide d_model"),
        ({"attention": {"name": "softmax", "projection": "sparse", "conv_modules": 2}}, "odd"),
        ({"attention": {"name": "softmax", "projection": "sparse"}, "kv_heads": 1}, "grouped-query"),
        ({"attention": {"name": "softmax", "projection": "sparse", "d_head": 4}}, "d_head must be unset"),
        ({"attention": {"name": "softmax", "projection": "sparse", "collaborative": 4}}, "collaborative"),
        ({"attention": {"name": "softmax", "projection": "sparse"}, "stack": {"attention_maps": "residual"}},
         "attention_maps"),
        ({"attention": {"name": "softmax", "projection": "sparse"}, "stack": {"kind": "universal"}}, "universal"),
        ({"task": "seq2seq", "decoder": {"cross_attention": {"name": "softmax", "projection": "sparse"}}},
         "decoder.cross_attention"),
        ({"ffn": {"kind": "sparse"}, "stack": {"kind": "luna"}, "embedding": {"position": "sinusoidal"}},
         "dense ffn"),
        ({"ffn": {"kind": "sparse"}, "stack": {"macaron": True}}, "macaron"),
    ],
)  # fmt: skip
def test_what_the_layers_cannot_serve_is_refused(changes, words):
    with pytest.raises(ValueError, match=words):
        ModelConfig(**TINY | changes)


@pytest.mark.heavy
def test_the_terraformer_trains_evaluates_generates_and_resumes_exactly_from_the_command_line(tmp_path, capsys):
    model = {k: v for k, v in TERRAFORMER.items() if k not in ("task", "vocab_size", "max_len")}
    losses = command_line_round_trip(tmp_path, capsys, model)  # exact: the Gumbel draws come from each step's key
    assert np.isfinite(list(losses.values())).all()


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_both_models_with_the_losses_of_one_device():
    mesh_trains_like_one_device(SCALING, TERRAFORMER, vocab=13, length=12)
