"""The score options of the logit-forming ops (`jxformers.ops._scores`) against their
papers' formulas, written in numpy: logit soft-capping (Gemma 2), Explicit Sparse
Transformer's top-k, and attention sinks (the zero key, a learned logit per head); in
the dense and the chunked op, causal and padded, decoding token by token, and reached
from a model config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, jitted
from suites import decode_all, decode_op, forward

from jxformers import registry
from jxformers.nn import ModelConfig, build_model

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D = 4, 2, 8


def qkv(seed, n, m=None):
    keys = jax.random.split(jax.random.key(seed), 3)
    m = n if m is None else m
    q = jax.random.normal(keys[0], (n, HEADS, D)) * 2.0  # spread logits: the options matter
    k = jax.random.normal(keys[1], (m, KV_HEADS, D)) * 2.0
    v = jax.random.normal(keys[2], (m, KV_HEADS, D))
    return q, k, v


def reference(q, k, v, *, causal=False, kv_mask=None, softcap=None, top_k=None, sink=None):
    """The formulas, one query row at a time, in float64 numpy. `sink`: None, or per
    query head the sink's logit (0 for the zero sink)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, m = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    out = np.zeros((n, HEADS, v.shape[2]))
    for h in range(HEADS):
        kh, vh = k[:, h // group], v[:, h // group]
        for i in range(n):
            s = kh @ q[i, h] / np.sqrt(D)
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)  # Gemma 2: cap the logits
            allowed = np.ones(m, bool)
            if causal:
                allowed &= np.arange(m) <= i + m - n
            if kv_mask is not None:
                allowed &= np.asarray(kv_mask)
            if top_k is not None and allowed.sum() > top_k:  # Zhao et al. eq. 4: keep s >= t_i, the k-th largest
                t = np.sort(s[allowed])[-top_k]
                allowed &= s >= t
            e = np.where(allowed, np.exp(s - s[allowed].max(initial=0.0)), 0.0)
            denom = e.sum()
            if sink is not None:  # one more key: logit sink[h], value 0
                denom += np.exp(sink[h] - s[allowed].max(initial=0.0))
            out[i, h] = e @ vh / denom if denom > 0 else 0.0
    return out


def close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_softcap_is_c_tanh_of_the_logits(causal, padded):
    q, k, v = qkv(0, 13)
    kv_mask = jnp.arange(13) < 10 if padded else None
    expected = reference(q, k, v, causal=causal, kv_mask=kv_mask, softcap=1.5)
    close(ops.softmax_attention(q, k, v, causal=causal, kv_mask=kv_mask, softcap=1.5), expected)
    close(ops.chunked_attention(q, k, v, causal=causal, kv_mask=kv_mask, softcap=1.5, chunk_size=4), expected)
    # and the cap changes the answer at these logits (the test could fail)
    assert not np.allclose(reference(q, k, v, causal=causal, kv_mask=kv_mask), expected, atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_top_k_keeps_each_rows_k_largest_allowed_logits(causal, padded):
    q, k, v = qkv(1, 11)
    kv_mask = jnp.arange(11) < 8 if padded else None
    expected = reference(q, k, v, causal=causal, kv_mask=kv_mask, top_k=3)
    close(ops.softmax_attention(q, k, v, causal=causal, kv_mask=kv_mask, top_k=3), expected)
    assert not np.allclose(reference(q, k, v, causal=causal, kv_mask=kv_mask), expected, atol=1e-3)
    # k at least the row length is plain softmax
    close(
        ops.softmax_attention(q, k, v, causal=causal, kv_mask=kv_mask, top_k=11),
        reference(q, k, v, causal=causal, kv_mask=kv_mask),
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_sinks_add_one_key_of_zero_value_to_every_softmax(causal, padded):
    q, k, v = qkv(2, 12)
    kv_mask = jnp.arange(12) < 9 if padded else None
    logits = jnp.array([-1.0, 0.5, 2.0, 0.0])
    for sinks, sink_logits, sink in (("zero", None, np.zeros(HEADS)), ("learned", logits, np.asarray(logits))):
        expected = reference(q, k, v, causal=causal, kv_mask=kv_mask, sink=sink)
        got = ops.softmax_attention(q, k, v, causal=causal, kv_mask=kv_mask, sinks=sinks, sink_logits=sink_logits)
        close(got, expected)
        chunked = ops.chunked_attention(
            q, k, v, causal=causal, kv_mask=kv_mask, sinks=sinks, sink_logits=sink_logits, chunk_size=5
        )
        close(chunked, expected)
    # the sink takes weight: outputs shrink towards 0 where its logit is large
    plain = np.abs(reference(q, k, v, causal=causal, kv_mask=kv_mask)[:, 2]).mean()
    assert np.abs(expected[:, 2]).mean() < plain


def test_options_compose_and_rows_with_no_key_are_zero():
    q, k, v = qkv(3, 10)
    kv_mask = jnp.zeros((10,), bool)
    out = ops.softmax_attention(q, k, v, kv_mask=kv_mask, softcap=2.0, top_k=2, sinks="zero")
    assert np.all(np.asarray(out) == 0)
    kv_mask = jnp.arange(10) < 7
    got = ops.softmax_attention(q, k, v, causal=True, kv_mask=kv_mask, softcap=2.0, top_k=2, sinks="zero")
    close(got, reference(q, k, v, causal=True, kv_mask=kv_mask, softcap=2.0, top_k=2, sink=np.zeros(HEADS)))


def test_cross_lengths_bf16_and_gradients():
    q, k, v = qkv(4, 5, 9)
    close(ops.softmax_attention(q, k, v, softcap=3.0, sinks="zero"), reference(q, k, v, softcap=3.0, sink=np.zeros(4)))
    half = ops.softmax_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), softcap=3.0, sinks="zero")
    assert half.dtype == jnp.bfloat16
    close(half, reference(q, k, v, softcap=3.0, sink=np.zeros(4)), atol=6e-2)
    logits = jnp.zeros((HEADS,))
    grads = jax.jit(
        jax.grad(
            lambda s, q: ops.softmax_attention(q, k, v, top_k=3, sinks="learned", sink_logits=s).sum(), argnums=(0, 1)
        )
    )(logits, q)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert float(jnp.abs(grads[0]).sum()) > 0  # the sink logits learn


@pytest.mark.parametrize(
    "name, hp",
    [
        ("softmax", {"softcap": 2.0, "top_k": 3, "sinks": "learned"}),
        ("chunked", {"chunk_size": 4, "softcap": 2.0, "sinks": "learned"}),
    ],
)
def test_decoding_with_options_equals_the_causal_forward(name, hp):
    n = 12
    q, k, v = qkv(5, n)
    bound = registry.bind(name, **hp)
    arrays = bound.init_arrays(jax.random.key(0), heads=HEADS, kv_heads=KV_HEADS, d_k=D, d_v=D)
    arrays = {"sink_logits": jnp.array([-1.0, 0.5, 2.0, 0.0])} if "sink_logits" in arrays else arrays
    parallel = jitted(bound)(q, k, v, arrays=arrays, causal=True)
    close(decode_op(bound, q, k, v, arrays), np.asarray(parallel), atol=2e-5)
    top_k = hp.get("top_k")
    sink = np.asarray(arrays["sink_logits"])
    close(parallel, reference(q, k, v, causal=True, softcap=2.0, top_k=top_k, sink=sink))


def test_bad_options_are_refused_with_their_values():
    q, k, v = qkv(6, 4)
    with pytest.raises(ValueError, match="softcap must be a number > 0"):
        ops.softmax_attention(q, k, v, softcap=0.0)
    with pytest.raises(ValueError, match="top_k must be an int >= 1"):
        ops.softmax_attention(q, k, v, top_k=0)
    with pytest.raises(ValueError, match=r"sinks must be one of \('none', 'zero', 'learned'\)"):
        ops.softmax_attention(q, k, v, sinks="one")
    with pytest.raises(ValueError, match=r"needs sink_logits of shape \(4,\)"):
        ops.softmax_attention(q, k, v, sinks="learned")
    with pytest.raises(ValueError, match="read only with sinks='learned'"):
        ops.softmax_attention(q, k, v, sink_logits=jnp.zeros(4))
    with pytest.raises(ValueError, match="softcap"):
        registry.bind("softmax", softcap=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        registry.bind("chunked", top_k=2)  # needs whole rows: the dense op's alone
    with pytest.raises(ValueError, match=r"score options \['top_k'\]"):
        ops.softmax_attention(q, k, v, softcap=2.0, top_k=2, impl="interpret")  # the kernel has softcap, not top_k


def test_a_model_config_names_the_options_and_learns_the_sinks():
    config = ModelConfig(
        task="lm",
        vocab_size=17,
        num_layers=2,
        d_model=16,
        num_heads=4,
        max_len=16,
        attention={"name": "softmax", "softcap": 30.0, "sinks": "learned"},
    )
    model = build_model(config, key=jax.random.key(0))
    attention = model.blocks[0].attention
    assert attention.core.hyper_parameters["softcap"] == 30.0
    assert attention.arrays["sink_logits"].shape == (4,)  # a parameter: the optimizer sees it
    from jxformers.nn import trainable

    assert trainable(model).blocks[0].attention.arrays["sink_logits"] is True
    tokens = jnp.arange(12) % 17
    logits = forward(model, tokens)
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(logits), atol=2e-4)


def talking_reference(q, k, v, p_l, p_w, *, causal=False, kv_mask=None):
    """Shazeer et al. 2020, section 4: J = Q K^T / sqrt(d) per head, L = J P_l across the
    heads, W = softmax(L) over the keys (masked), U = W P_w, O = U V per head."""
    q, k, v, p_l, p_w = (np.asarray(x, np.float64) for x in (q, k, v, p_l, p_w))
    n, m = q.shape[0], k.shape[0]
    group = HEADS // KV_HEADS
    kh = np.stack([k[:, h // group] for h in range(HEADS)])  # [heads, m, d]
    vh = np.stack([v[:, h // group] for h in range(HEADS)])
    j = np.einsum("nhd,hmd->hnm", q, kh) / np.sqrt(D)
    logits = np.einsum("hnm,hH->Hnm", j, p_l)
    allowed = np.ones((n, m), bool)
    if causal:
        allowed &= np.tril(np.ones((n, m), bool), m - n)
    if kv_mask is not None:
        allowed &= np.asarray(kv_mask)[None, :]
    e = np.where(allowed, np.exp(logits - np.where(allowed, logits, -np.inf).max(-1, keepdims=True)), 0.0)
    w = e / e.sum(-1, keepdims=True)
    u = np.einsum("hnm,hH->Hnm", w, p_w)
    return np.einsum("hnm,hmd->nhd", u, vh)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_talking_heads_mix_the_logits_and_the_weights_across_heads(causal, padded):
    q, k, v = qkv(7, 10)
    kv_mask = jnp.arange(10) < 8 if padded else None
    p_l = jax.random.normal(jax.random.key(8), (HEADS, HEADS))
    p_w = jax.random.normal(jax.random.key(9), (HEADS, HEADS))
    got = ops.softmax_attention(
        q, k, v, causal=causal, kv_mask=kv_mask, talking_heads=True, talking_logits=p_l, talking_weights=p_w
    )
    close(got, talking_reference(q, k, v, p_l, p_w, causal=causal, kv_mask=kv_mask), atol=5e-5)
    # identity matrices (the initialisation) are plain multi-head attention
    eye = jnp.eye(HEADS)
    plain = ops.softmax_attention(
        q, k, v, causal=causal, kv_mask=kv_mask, talking_heads=True, talking_logits=eye, talking_weights=eye
    )
    close(plain, reference(q, k, v, causal=causal, kv_mask=kv_mask))
    assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3)


def test_talking_heads_decode_learn_and_are_refused_where_they_cannot_apply():
    bound = registry.bind("softmax", talking_heads=True)
    arrays = bound.init_arrays(jax.random.key(0), heads=HEADS, kv_heads=KV_HEADS, d_k=D, d_v=D)
    assert set(arrays) == {"talking_logits", "talking_weights"}
    np.testing.assert_array_equal(np.asarray(arrays["talking_logits"]), np.eye(HEADS))
    arrays = {n: jax.random.normal(jax.random.key(i), (HEADS, HEADS)) for i, n in enumerate(arrays)}
    n = 9
    q, k, v = qkv(10, n)
    parallel = jitted(bound)(q, k, v, arrays=arrays, causal=True)
    close(decode_op(bound, q, k, v, arrays), np.asarray(parallel), atol=5e-5)
    grads = jax.jit(jax.grad(lambda a: bound(q, k, v, arrays=a, causal=True).sum()))(arrays)
    assert all(float(jnp.abs(g).sum()) > 0 for g in grads.values())
    with pytest.raises(ValueError, match="talking_heads is taken by softmax"):
        registry.bind("chunked", talking_heads=True)  # online softmax never holds every head's weights
    with pytest.raises(ValueError, match=r"talking_heads needs talking_logits of shape \(4, 4\)"):
        ops.softmax_attention(q, k, v, talking_heads=True)
    model = build_model(
        ModelConfig(
            task="classify",
            vocab_size=11,
            max_len=8,
            num_heads=4,
            d_model=16,
            attention={"name": "softmax", "talking_heads": True},
        ),
        key=jax.random.key(0),
    )
    assert model.encoder.blocks[0].attention.arrays["talking_weights"].shape == (4, 4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_persistent_vectors_join_every_softmax_at_no_position(causal, padded):
    """Sukhbaatar et al. 2019: each head attends over [M_k; K] with values [M_v; V]; the
    persistent vectors are visible to every query (causal or not) and never padding.
    Parametrised as the authors' code: M_k = sqrt(d) persistent_k, M_v = sqrt(m) persistent_v."""
    n, m = 9, 3
    q, k, v = qkv(11, n)
    kv_mask = jnp.arange(n) < 7 if padded else None
    mk = jax.random.normal(jax.random.key(12), (m, KV_HEADS, D)) * 2.0
    mv = jax.random.normal(jax.random.key(13), (m, KV_HEADS, D))
    # the formula: keys [M_k; K], query i sees all of M_k and, causal, the keys j <= i
    keys, values = jnp.concatenate([mk * np.sqrt(D), k]), jnp.concatenate([mv * np.sqrt(m), v])
    allowed = np.ones((n, m + n), bool)
    if causal:
        allowed[:, m:] &= np.tril(np.ones((n, n), bool))
    if padded:
        allowed[:, m:] &= np.asarray(kv_mask)[None, :]
    expected = np.zeros((n, HEADS, D))
    group = HEADS // KV_HEADS
    for h in range(HEADS):
        s = np.asarray(q[:, h], np.float64) @ np.asarray(keys[:, h // group], np.float64).T / np.sqrt(D)
        e = np.where(allowed, np.exp(s - np.where(allowed, s, -np.inf).max(-1, keepdims=True)), 0.0)
        expected[:, h] = e / e.sum(-1, keepdims=True) @ np.asarray(values[:, h // group], np.float64)
    options = {"persistent_kv": m, "persistent_k": mk, "persistent_v": mv}
    close(ops.softmax_attention(q, k, v, causal=causal, kv_mask=kv_mask, **options), expected)
    close(ops.chunked_attention(q, k, v, causal=causal, kv_mask=kv_mask, chunk_size=4, **options), expected)
    # with every real key padded, a query still reads the persistent memory
    empty = ops.softmax_attention(q, k, v, kv_mask=jnp.zeros((n,), bool), **options)
    assert float(jnp.abs(empty).min()) > 0


def test_persistent_memory_decodes_learns_and_reaches_a_model():
    bound = registry.bind("softmax", persistent_kv=4)
    arrays = bound.init_arrays(jax.random.key(0), heads=HEADS, kv_heads=KV_HEADS, d_k=D, d_v=D)
    assert arrays["persistent_k"].shape == (4, KV_HEADS, D) and arrays["persistent_v"].shape == (4, KV_HEADS, D)
    n = 8
    q, k, v = qkv(14, n)
    parallel = jitted(bound)(q, k, v, arrays=arrays, causal=True)
    close(decode_op(bound, q, k, v, arrays), np.asarray(parallel), atol=5e-5)
    grads = jax.jit(jax.grad(lambda a: bound(q, k, v, arrays=a, causal=True).sum()))(arrays)
    assert all(float(jnp.abs(g).sum()) > 0 for g in grads.values())
    with pytest.raises(ValueError, match=r"persistent_kv=2 needs persistent_k of shape \(2, 2, d\)"):
        ops.softmax_attention(q, k, v, persistent_kv=2)
    with pytest.raises(ValueError, match="persistent_kv is taken by softmax, chunked"):
        registry.bind("performer", persistent_kv=2)
    model = build_model(
        ModelConfig(
            task="lm",
            vocab_size=11,
            max_len=8,
            num_heads=4,
            d_model=16,
            embedding={"position": "alibi"},
            attention={"name": "softmax", "persistent_kv": 2},
        ),
        key=jax.random.key(1),
    )
    tokens = jnp.arange(8) % 11
    logits = forward(model, tokens)
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(logits), atol=2e-4)
