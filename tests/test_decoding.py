"""The decoder factories on their own: built from an op's pieces, they decode like the
op's causal parallel form (the registry-wide parity test covers every registered one)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import JittedOps, assert_close, qkv

from jxformers import decoding, registry
from jxformers.ops.kernelized import FEATURE_MAPS

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)


def _decode_all(decoder, q, k, v, hyper_parameters=None, arrays=None):
    hp, arrays = hyper_parameters or {}, arrays or {}
    state = decoder.init(
        hyper_parameters=hp,
        arrays=arrays,
        max_len=q.shape[0],
        kv_heads=k.shape[1],
        d_k=k.shape[2],
        d_v=v.shape[2],
        dtype=None,
    )

    def step(state, xs):
        out, state = decoder.step(*xs, state, hyper_parameters=hp, arrays=arrays, bias_fn=None)
        return state, out

    return jax.lax.scan(step, state, (q, k, v))[1]


def test_recurrent_decoder_with_a_gate_equals_gated_kernel_attention():
    q, k, v = qkv(0, 17)
    phi = FEATURE_MAPS["elu"]

    def features(x, arrays, hp):
        return phi(x.astype(jnp.float32)), None

    w = jax.random.normal(jax.random.key(2), (k.shape[2],))

    def gate_fn(k_t, arrays, hp):  # a function of the token's key here, as a layer's would be of x
        return jax.nn.sigmoid(k_t @ w)

    expected = ops.kernel_attention(phi(q), phi(k), v, causal=True, form="scan", gate=jax.nn.sigmoid(k @ w))
    got = _decode_all(decoding.recurrent(features, gate=gate_fn), q, k, v)
    assert_close(got, expected, atol=2e-5, rtol=2e-4)


def test_ring_buffer_holds_the_window_and_the_cache_holds_everything():
    q, k, v = qkv(3, 20)
    window = 4
    ring = decoding.ring_buffer(ops.softmax_attention, slots=lambda hp: hp["window"] + 1)
    got = _decode_all(ring, q, k, v, {"window": window})
    assert_close(got, ops.local_attention(q, k, v, window=window, causal=True), atol=2e-5)
    cached = _decode_all(decoding.kv_cache(ops.softmax_attention), q, k, v)
    assert_close(cached, ops.softmax_attention(q, k, v, causal=True), atol=2e-5)


def test_log_features_need_query_features():
    decoder = decoding.recurrent(lambda x, arrays, hp: (x, jnp.max(x)))
    q, k, v = qkv(4, 3)
    with pytest.raises(ValueError, match="query_features"):
        _decode_all(decoder, q, k, v)


def test_decoders_belong_to_their_specs():
    kinds = {n: registry.get(n).decoder.kind for n in registry.names(decodes=True)}
    assert kinds["softmax"] == "cache" and kinds["local"] == "ring buffer" and kinds["performer"] == "recurrent"
    with pytest.raises(ValueError, match="cannot decode incrementally"):
        registry.get("block_local").bind().init_state(max_len=4, kv_heads=1, d_k=2, d_v=2)


def test_gated_rfa_language_model_decodes_like_its_parallel_forward():
    # The gate is made from each token's layer input by the module (RFA's
    # g_t = sigmoid(w_g . x_t + b_g) per head), so only a model can test its decoding.
    from suites import TINY, decode_all, forward, tokens

    from jxformers import ModelConfig, build_model

    config = ModelConfig(
        task="lm",
        attention="rfa",
        position="rope",
        **TINY,
        attention_kwargs={"num_features": 16, "chunk_size": 5, "gated": True},
    )
    model = build_model(config, key=jax.random.key(0))
    x = tokens(5)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)
