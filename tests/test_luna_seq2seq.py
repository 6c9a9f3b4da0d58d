"""Luna's encoder-decoder (Ma, Kong, Wang, Zhou, May, Ma & Zettlemoyer 2021, "Luna: Linear
Unified Nested Attention", section 4.1's machine translation model; the decoder layer as
the authors' fairseq-apollo `LunaDecoderLayer`; `jxformers.nn.luna`): a decoder layer's
encoder attention against numpy (Y_PC = pack(P, C), X' = LN(X + unpack(X, Y_PC)), P' =
LN(P + Y_PC)), P carried from layer to layer by it, the source's padding unread, cached
decoding against the parallel decoder, a training step through the config, the refusals.

Mutations the tests were seen to fail (by hand, once): the encoder attention packing the
target instead of the encoder output; P not updated by it; decoding packing with the
learned P in every layer.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import decode_all, finite_grads

from jxformers import ModelConfig, build_model
from jxformers.nn.luna import LunaBlock

CONFIG = dict(
    task="seq2seq", vocab_size=11, num_layers=1, d_model=8, num_heads=2, max_len=12, ffn={"d_ff": 16},
    stack={"kind": "luna", "packed_len": 3}, decoder={"num_layers": 2},
)  # fmt: skip


def _np(x):
    return np.asarray(x, np.float64)


def _linear(x, lin):
    return x @ _np(lin.weight).T + (0 if lin.bias is None else _np(lin.bias))


def _ln(x, norm):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + norm.eps) * _np(norm.weight) + _np(norm.bias)


def _mha(q, k, v, heads, mask=None):
    """numpy: per head softmax(q k^T / sqrt(d)) v, heads concatenated."""
    n, d = q.shape
    dh = d // heads
    out = np.zeros((n, d))
    for h in range(heads):
        cols = slice(h * dh, (h + 1) * dh)
        s = q[:, cols] @ k[:, cols].T / np.sqrt(dh)
        if mask is not None:
            s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, cols] = (p / p.sum(-1, keepdims=True)) @ v[:, cols]
    return out


def test_a_decoder_layers_encoder_attention_is_lunas():
    block = LunaBlock(8, 2, d_ff=16, causal=True, cross=True, key=jax.random.key(0))
    ks = jax.random.split(jax.random.key(1), 3)
    x, p, c = (jax.random.normal(k, s) for k, s in zip(ks, [(5, 8), (3, 8), (6, 8)], strict=True))
    c_mask = jnp.arange(6) < 4
    # the causal self-attention alone: the same layer without its encoder attention
    plain = eqx.tree_at(lambda b: (b.cross_pack, b.cross_unpack, b.cross_norms), block, (None, None, None),
                        is_leaf=lambda v: v is None)  # fmt: skip

    @eqx.filter_jit
    def run(block, plain):
        grads = eqx.filter_grad(lambda b: jnp.mean(jnp.square(b(x, p, context=c, context_mask=c_mask)[0])))(block)
        return (
            *block(x, p, context=c, context_mask=c_mask),
            jax.vmap(plain.unpack_one)(x, plain.pack.prefixes(p, x)),
            grads,
        )

    got_x, got_p, self_only, grads = run(block, plain)
    assert finite_grads(grads)
    x1 = _ln(_np(x) + _np(self_only), block.norms[0])
    pk = block.cross_pack
    packed = _mha(
        _linear(_np(p), pk.q_proj), _linear(_np(c), pk.k_proj), _linear(_np(c), pk.v_proj), 2, np.asarray(c_mask)
    )
    un = block.cross_unpack
    y = _linear(_mha(_linear(x1, un.q_proj), _linear(packed, un.k_proj), _linear(packed, un.v_proj), 2), un.o_proj)
    x2 = _ln(x1 + y, block.cross_norms[0])
    assert_close(got_p, _ln(_np(p) + packed, block.cross_norms[1]), atol=1e-5)  # P' = LN(P + Y_PC)
    want_x = _ln(x2 + _np(block.ffn(jnp.asarray(x2, jnp.float32))), block.norms[2])
    assert_close(got_x, want_x, atol=1e-4)


@pytest.fixture(scope="module")
def model():
    made = build_model(CONFIG, key=jax.random.key(2))
    params, static = eqx.partition(made, eqx.is_inexact_array)  # off the initialisation: a stronger test
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return eqx.combine(jax.tree.unflatten(tree, leaves), static)


def test_the_decoder_reads_the_source_and_decodes_like_its_parallel_forward(model):
    source, target = jnp.asarray([3, 7, 4, 8, 5]), jnp.asarray([1, 6, 2, 9, 4, 3])
    padded, mask = jnp.concatenate([source, jnp.zeros((3,), source.dtype)]), jnp.arange(8) < 5

    @eqx.filter_jit
    def run(model):
        return model(source, target), model(padded, target, mask), model(source[::-1], target)

    out, out_padded, out_other = run(model)
    assert_close(out_padded, out, atol=1e-5)  # the source's padding is never read
    assert float(jnp.abs(out - out_other).max()) > 1e-4  # the decoder reads the source
    assert model.decoder.blocks[0].cross and len(model.decoder.blocks[0].blocks) == 2
    cached = decode_all(model.conditioned(source), target)
    assert_close(cached, out, atol=1e-4)


def test_refusals_name_the_settings():
    with pytest.raises(ValueError, match=r"luna.*\['cross_attention'\]"):
        ModelConfig.from_dict(CONFIG | {"decoder": {"cross_attention": "performer"}})
    with pytest.raises(ValueError, match=r"\['transparent'\]"):
        ModelConfig.from_dict(CONFIG | {"decoder": {"transparent": True}})
