"""Fidelity rows made whole (issue 33): Nystromformer's convolution skip on V, FNet's
parameter-free Fourier sublayer, axial attention's causal form reaching the whole past,
the Sparse Transformer's distinct summary cells per head, Qiu et al.'s per-head block
permutations and Poolingformer's dynamic-convolution pooling. Each against a numpy
reference written from the paper (or the authors' code), on tiny inputs."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from jxformers import ModelConfig, build_model, ops, registry
from jxformers.nn.attention import Attention


def _qkv(seed, n, heads=2, kv_heads=2, d=4):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=(n, h, d)).astype(np.float32) for h in (heads, kv_heads, kv_heads))


def _params(module) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(module, eqx.is_array)))


# ----------------------------------------------------------------------------- Nystromformer


def test_nystrom_adds_a_depthwise_convolution_of_the_values():
    """The authors' skip: X += Conv2d(V) per head, kernel (K, 1), padding K // 2, no bias."""
    q, k, v = _qkv(0, 11, heads=4, kv_heads=2)
    taps = 5
    w = np.random.default_rng(1).normal(size=(taps, 2)).astype(np.float32)
    nystrom = jax.jit(lambda w: ops.nystrom_attention(q, k, v, num_landmarks=3, conv_weight=w))
    plain, skip = nystrom(None), nystrom(jnp.asarray(w))
    conv = np.zeros_like(v)
    for i in range(11):
        for t in range(taps):
            j = i + t - taps // 2
            if 0 <= j < 11:
                conv[i] += w[t][:, None] * v[j]
    assert_close(skip - plain, np.repeat(conv, 2, axis=1), atol=1e-5)
    with pytest.raises(ValueError, match="self-attention only"):
        ops.nystrom_attention(q[:7], k, v, num_landmarks=3, conv_weight=jnp.asarray(w))


def test_nystrom_module_owns_the_convolution_as_the_authors_default():
    bound = registry.bind("nystrom", num_landmarks=4)
    assert bound.hyper_parameters["conv_kernel_size"] == 35
    assert Attention(bound, 8, 2, key=jax.random.key(0)).arrays["conv_weight"].shape == (35, 2)
    layer = Attention(registry.bind("nystrom", num_landmarks=4, conv_kernel_size=3), 8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (9, 8))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: m(x).sum()))(layer)
    assert float(jnp.abs(grads.arrays["conv_weight"]).sum()) > 0
    assert not Attention(registry.bind("nystrom", conv_kernel_size=0), 8, 2, key=jax.random.key(0)).arrays
    with pytest.raises(ValueError, match="conv_kernel_size must be odd"):
        Attention(registry.bind("nystrom", conv_kernel_size=4), 8, 2, key=jax.random.key(0))


# ----------------------------------------------------------------------------- FNet


def test_fnet_layer_is_the_parameter_free_fourier_sublayer():
    """Lee-Thorp et al. 2021: y = Re(FFT_seq(FFT_hidden(x))), no W_Q, W_K, W_V, W_O."""
    layer = Attention("fnet", 8, 2, key=jax.random.key(0))
    assert _params(layer) == 0
    assert (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj) == (None,) * 4
    x = np.random.default_rng(2).normal(size=(6, 8)).astype(np.float32)
    expected = np.real(np.fft.fft(np.fft.fft(x, axis=1), axis=0))
    assert_close(eqx.filter_jit(lambda m, x: m(x))(layer, jnp.asarray(x)), expected, atol=1e-4)
    # a classifier's parameters: embeddings, norms, FFNs and the head; no attention weights
    config = dict(task="classify", vocab_size=11, num_classes=2, max_len=8, d_model=8, num_heads=2, num_layers=1,
                  head={"kind": "mean"})  # fmt: skip
    fnet = build_model(config | {"attention": "fnet"}, key=jax.random.key(0))
    softmax = build_model(config | {"attention": "softmax"}, key=jax.random.key(0))
    assert _params(fnet) == _params(softmax) - 4 * (8 * 8 + 8)  # W_Q, W_K, W_V, W_O and their biases


@pytest.mark.parametrize(
    "settings, word",
    [
        ({"kv_heads": 1}, "kv_heads=1"),
        ({"embedding": {"position": "rope"}}, "rotary"),
        ({"attention": {"name": "fnet", "d_head": 2}}, "d_head=2"),
    ],
)
def test_fnet_refuses_what_a_parameter_free_sublayer_lacks(settings, word):
    base = dict(task="classify", vocab_size=11, max_len=8, attention={"name": "fnet"})
    with pytest.raises(ValueError, match=f"'fnet' transforms the layer input itself.*{word}"):
        ModelConfig(**(base | settings))


# ----------------------------------------------------------------------------- axial, causal


def test_causal_axial_reaches_the_whole_past_and_nothing_after():
    """Ho et al. 2019's autoregressive construction: query i depends on every j <= i
    (the gradient of its output is nonzero there) and on no j > i."""
    n, width = 11, 4  # three rows, the last one short
    x = jax.random.normal(jax.random.key(3), (n, 1, 4))

    def out(x):  # q, k and v all from x: every path counts
        return ops.axial_attention(x, x, x, width=width, causal=True).sum(axis=(1, 2))

    reach = np.abs(np.asarray(jax.jit(jax.jacobian(out))(x))).sum(axis=(2, 3))  # [i, j]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    assert (reach[j > i] == 0).all()
    assert (reach[j <= i] > 0).all()
    # the passes alone reach only up and to the left: (1, 0) never sees (0, 1)
    column = jax.jit(jax.jacobian(lambda x: ops.axial_attention(x, x, x, width=width, order="column", causal=True)[width]))(x)
    assert float(jnp.abs(column[..., 1, :, :]).sum()) == 0
