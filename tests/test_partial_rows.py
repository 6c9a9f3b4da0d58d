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
    """The number of parameters of a module or of its `eqx.filter_eval_shape` skeleton."""
    return sum(x.size for x in jax.tree.leaves(module) if isinstance(x, jax.Array | jax.ShapeDtypeStruct))


# ----------------------------------------------------------------------------- Nystromformer


def test_nystrom_adds_a_depthwise_convolution_of_the_values():
    """The authors' skip: X += Conv2d(V) per head, kernel (K, 1), padding K // 2, no bias."""
    q, k, v = _qkv(0, 11, heads=4, kv_heads=2)
    taps = 5
    w = np.random.default_rng(1).normal(size=(taps, 2)).astype(np.float32)
    nystrom = jax.jit(lambda w: ops.nystrom_attention(q, k, v, num_landmarks=3, pinv_iterations=1, conv_weight=w))
    plain, skip = nystrom(jnp.zeros_like(w)), nystrom(jnp.asarray(w))  # zero filters: one compiled program
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

    def shapes(bound):  # the module's arrays, traced, not drawn
        return {
            k: x.shape for k, x in eqx.filter_eval_shape(Attention, bound, 8, 2, key=jax.random.key(0)).arrays.items()
        }

    assert shapes(bound) == {"conv_weight": (35, 2)}
    assert shapes(registry.bind("nystrom", conv_kernel_size=0)) == {}
    small = registry.bind("nystrom", num_landmarks=4, pinv_iterations=1, conv_kernel_size=3)  # a small program

    @eqx.filter_jit
    def module_grads(x):  # the module built and differentiated in one compiled program (eager init is slow)
        layer = Attention(small, 8, 2, key=jax.random.key(0))
        return eqx.filter_grad(lambda m: m(x).sum())(layer)

    grads = module_grads(jax.random.normal(jax.random.key(1), (9, 8)))
    assert float(jnp.abs(grads.arrays["conv_weight"]).sum()) > 0
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
    fnet, softmax = (eqx.filter_eval_shape(build_model, config | {"attention": a}, key=jax.random.key(0))
                     for a in ("fnet", "softmax"))  # fmt: skip
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
    (moving x_j moves its output) and on no j > i (its output stays exactly the same)."""
    n, width = 11, 4  # three rows, the last one short
    x = jax.random.normal(jax.random.key(3), (n, 1, 4))

    def outputs(x):  # q, k and v all from x: every path counts
        full = ops.axial_attention(x, x, x, width=width, causal=True)
        column = ops.axial_attention(x, x, x, width=width, order="column", causal=True)
        return full, column

    moved = x[None] + 0.5 * jnp.eye(n)[:, :, None, None]  # [j, n, 1, 4]: row j moved
    full, column = jax.jit(jax.vmap(outputs))(jnp.concatenate([x[None], moved]))  # one compiled program

    def reach(out):  # [i, j]: whether moving x_j moved output i
        return np.abs(np.asarray(out[1:] - out[:1])).sum(axis=(2, 3)).T > 0

    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    np.testing.assert_array_equal(reach(full), j <= i)
    # the column pass alone reaches only up its own column: (1, 0) never sees (0, 1)
    np.testing.assert_array_equal(reach(column), (j <= i) & (i % width == j % width))


# ----------------------------------------------------------------------------- Sparse Transformer, fixed


def _masked_softmax(q, k, v, mask):
    s = q @ k.T / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v


def test_sparse_transformer_fixed_heads_take_distinct_summary_cells():
    """Child et al. 2019, section 4.3: head h reads its own block and, in every block, its
    own length-c sub-block (head 0 the last c cells, head 1 the c before, ...)."""
    n, s, c, heads = 13, 4, 2, 3  # s // c = 2 sub-blocks: head 2 reuses head 0's
    q, k, v = _qkv(4, n, heads=heads, kv_heads=1)
    kv_mask = np.arange(n) < n - 2

    def both(q, k, v, m):  # bidirectional and causal in one compiled program
        return [
            ops.sparse_transformer_attention(
                q, k, v, stride=s, pattern="fixed", num_summary=c, distinct_summaries=True, causal=causal, kv_mask=m
            )
            for causal in (False, True)
        ]

    outs = jax.jit(both)(q, k, np.where(kv_mask[:, None, None], v, np.nan), kv_mask)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for causal, out in zip((False, True), outs, strict=True):
        for h in range(heads):
            u = h % (s // c)
            mask = ((i // s == j // s) | ((j % s >= s - (u + 1) * c) & (j % s < s - u * c))) & kv_mask[None, :]
            if causal:
                mask &= j <= i
            expected = _masked_softmax(q[:, h], k[:, 0], v[:, 0], mask)
            assert_close(out[:, h], expected, atol=1e-5)
    with pytest.raises(ValueError, match="distinct_summaries"):
        ops.sparse_transformer_attention(q, k, v, stride=s, distinct_summaries=True)


# ----------------------------------------------------------------------------- blockwise permutations


def test_blockwise_heads_attend_their_permuted_block():
    """Qiu et al. 2020: head h's query block a attends key block pi_h(a) = (a + shift_h) mod n_b."""
    n, b, shifts = 14, 4, (0, 1, 3)  # 4 blocks, the last one short (padded)
    q, k, v = _qkv(5, n, heads=3, kv_heads=1)
    kv_mask = np.arange(n) < n - 1
    out = jax.jit(lambda q, k, v, m: ops.block_local_attention(q, k, v, block_size=b, head_shifts=shifts, kv_mask=m))(
        q, k, np.where(kv_mask[:, None, None], v, np.nan), kv_mask
    )
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for h, shift in enumerate(shifts):
        mask = ((i // b + shift) % 4 == j // b) & kv_mask[None, :]
        assert_close(out[:, h], _masked_softmax(q[:, h], k[:, 0], v[:, 0], mask), atol=1e-5)
    with pytest.raises(ValueError, match="cannot be causal"):
        ops.block_local_attention(q, k, v, block_size=b, head_shifts=shifts, causal=True)
    with pytest.raises(ValueError, match="one shift >= 0 per query head"):
        ops.block_local_attention(q, k, v, block_size=b, head_shifts=(0, 1))
