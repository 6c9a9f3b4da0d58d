"""Relative positions computed with each attention's scores (issue 31, Lin et al. 2021's
survey section 5.1): Shaw et al. 2018, Transformer-XL's scheme (Dai et al. 2019) outside
its stack, DeBERTa's disentangled attention (He et al. 2021) and TUPE (Ke et al. 2021).

Each is checked against a numpy reference written from its paper's formula (float64,
loops over heads and pairs), with grouped-query heads (4 query heads, 2 key/value heads)
and fractional positions (a shortened encoder's grid) where the scheme takes them; then
decoding parity in a language model, a shortened encoder, the config from YAML and the
refusals.

Mutations each reference test was seen to fail (by hand, once): Shaw's label j - i
written i - j, and its value term dropped (`relative_values` not passed); Transformer-XL
without u (q instead of q + u) and with the distance i - j reversed; DeBERTa's
position-to-content term read at δ(i, j) instead of δ(j, i), and scaled by 1/sqrt(d)
instead of 1/sqrt(3d); TUPE without the content scale 1/sqrt(2), and with the [CLS]
column reset after its row (θ2 on CLS-to-CLS); the decoding step reading the cache's keys
before this token's are written (DeBERTa's parity fails).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, plain_reversible
from suites import decode_all, forward

from jxformers import ModelConfig, build_model, ops, registry
from jxformers.nn import Attention, Positions
from jxformers.nn.relative import RelativeTerms, SharedTerms, relative_sinusoid
from jxformers.nn.transformer_xl import relative_attention

D_MODEL, HEADS, KV_HEADS, N = 16, 4, 2, 7
DH = D_MODEL // HEADS
K = 2  # clipped at 2: the 7 positions reach past it
VOCAB = 13


# ----------------------------------------------------------------------------- numpy helpers


def _np(x):
    return np.asarray(x, np.float64)


def _linear(layer, x):
    y = x @ _np(layer.weight).T
    return y if layer.bias is None else y + _np(layer.bias)


def _projected(attention, x):
    """q [n, heads, d], k and v [n, heads, d] (the kv heads repeated for their group)."""
    n, group = x.shape[0], HEADS // KV_HEADS
    q = _linear(attention.q_proj, x).reshape(n, HEADS, DH)
    k = np.repeat(_linear(attention.k_proj, x).reshape(n, KV_HEADS, DH), group, axis=1)
    v = np.repeat(_linear(attention.v_proj, x).reshape(n, KV_HEADS, DH), group, axis=1)
    return q, k, v


def _softmax(logits, causal):
    """Row softmax of [heads, n, m], keys after the query masked when causal."""
    n, m = logits.shape[1:]
    allowed = np.tril(np.ones((n, m), bool)) if causal else np.ones((n, m), bool)
    e = np.where(allowed, np.exp(logits - np.where(allowed, logits, -np.inf).max(-1, keepdims=True)), 0.0)
    return e / e.sum(-1, keepdims=True)


def _output(attention, heads_out):
    """The output projection of the heads' outputs [n, heads, d]."""
    return _linear(attention.o_proj, heads_out.reshape(heads_out.shape[0], HEADS * DH))


def _attention(kind, *, causal, key=0, max_distance=K):
    relative = RelativeTerms(
        kind, d_model=D_MODEL, heads=HEADS, d_head=DH, max_distance=max_distance, key=jax.random.key(key + 100)
    )
    return Attention(
        "softmax", D_MODEL, HEADS, kv_heads=KV_HEADS, causal=causal, relative=relative, key=jax.random.key(key)
    )


def _x(seed=0, n=N):
    return jax.random.normal(jax.random.key(seed), (n, D_MODEL))


# A shortened encoder's grid: CLS at 0, then tokens at 1 + 2j, one of them nudged off it.
FRACTIONAL = np.array([0.0, 1.0, 3.0, 5.2, 7.0, 9.0, 11.0])


# ----------------------------------------------------------------------------- Shaw et al. 2018


@pytest.mark.parametrize(("causal", "positions"), [(False, FRACTIONAL), (True, np.arange(N, dtype=float))])
def test_shaw_is_eq_3_and_4_with_clipped_key_and_value_vectors(causal, positions):
    # e_ij = x_i W^Q (x_j W^K + a^K_ij)^T / sqrt(d_z), z_i = sum_j α_ij (x_j W^V + a^V_ij),
    # a_ij = w_{clip(j - i, k)}: 2k + 1 vectors per layer, shared by the heads (section 3).
    attention, x = _attention("shaw", causal=causal), _x(1)
    a_k, a_v = _np(attention.relative.keys), _np(attention.relative.values)
    q, k, v = _projected(attention, _np(x))
    label = lambda i, j: int(np.clip(np.round(positions[j] - positions[i]), -K, K)) + K  # noqa: E731
    logits = np.zeros((HEADS, N, N))
    for h in range(HEADS):
        for i in range(N):
            for j in range(N):
                logits[h, i, j] = q[i, h] @ (k[j, h] + a_k[label(i, j)]) / math.sqrt(DH)
    p = _softmax(logits, causal)
    z = np.zeros((N, HEADS, DH))
    for h in range(HEADS):
        for i in range(N):
            z[i, h] = sum(p[h, i, j] * (v[j, h] + a_v[label(i, j)]) for j in range(N))
    got = attention(x, positions=jnp.asarray(positions, jnp.float32))
    assert_close(got, _output(attention, z), atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- Transformer-XL


def _txl_reference(attention, shared, x, positions, causal):
    """Dai et al. 2019 section 3.3: (a) + (b) + (c) + (d) over sqrt(d), R_t = [sin(t f), cos(t f)]."""
    q, k, v = _projected(attention, _np(x))
    u, vb = _np(shared.u), _np(shared.v)
    freq = 1.0 / 10000.0 ** (np.arange(0, D_MODEL, 2) / D_MODEL)
    w_r = _np(attention.relative.r_proj.weight)  # W_{k,R}: [heads * d, d_model]

    def r(t):  # W_{k,R} R_t, per head
        return (w_r @ np.concatenate([np.sin(t * freq), np.cos(t * freq)])).reshape(HEADS, DH)

    logits = np.zeros((HEADS, N, N))
    for h in range(HEADS):
        for i in range(N):
            for j in range(N):
                rel = r(positions[i] - positions[j])[h]
                a, b = q[i, h] @ k[j, h], q[i, h] @ rel
                c, d = u[h] @ k[j, h], vb[h] @ rel
                logits[h, i, j] = (a + b + c + d) / math.sqrt(DH)
    p = _softmax(logits, causal)
    return _output(attention, np.einsum("hij,jhd->ihd", p, v))


@pytest.mark.parametrize("causal", [False, True])
def test_transformer_xl_terms_a_to_d_outside_its_stack(causal):
    # Keys after the query (an encoder) give negative distances i - j: the sinusoid takes them.
    attention, x = _attention("transformer_xl", causal=causal, key=2), _x(2)
    shared = SharedTerms.make("transformer_xl", heads=HEADS, d_head=DH, d_model=D_MODEL, max_distance=0,
                              key=jax.random.key(7))  # fmt: skip
    positions = np.arange(N, dtype=float)
    got = attention(x, bias=shared, positions=jnp.asarray(positions))
    assert_close(got, _txl_reference(attention, shared, x, positions, causal), atol=2e-5, rtol=1e-4)


def test_the_option_and_the_transformer_xl_stack_share_one_computation():
    # Causal, no memory: the stack's relative_attention on the same q, k, v, W_{k,R} R, u, v.
    attention, x = _attention("transformer_xl", causal=True, key=3), _x(3)
    shared = SharedTerms.make("transformer_xl", heads=HEADS, d_head=DH, d_model=D_MODEL, max_distance=0,
                              key=jax.random.key(8))  # fmt: skip
    heads = lambda proj, kv: proj(x).reshape(N, kv, DH)  # noqa: E731
    q = heads(attention.q_proj, HEADS)
    k, v = (jnp.repeat(heads(p, KV_HEADS), 2, axis=1) for p in (attention.k_proj, attention.v_proj))
    r = attention.relative.r_proj(relative_sinusoid(jnp.arange(N), D_MODEL)).reshape(N, HEADS, DH)
    core = relative_attention(q, k, v, r, shared.u, shared.v, mask=jnp.tril(jnp.ones((N, N), bool)))
    assert_close(attention(x, bias=shared), attention.o_proj(core.reshape(N, -1)), atol=2e-6)


# ----------------------------------------------------------------------------- DeBERTa


def _delta(i, j, k):
    """He et al. 2021 eq. 3's δ(i, j), case by case."""
    if i - j <= -k:
        return 0
    if i - j >= k:
        return 2 * k - 1
    return i - j + k


@pytest.mark.parametrize(("causal", "positions"), [(False, FRACTIONAL), (True, np.arange(N, dtype=float))])
def test_deberta_is_eq_4_content_to_content_content_to_position_position_to_content(causal, positions):
    # Ã_ij = Q^c_i K^c_j^T + Q^c_i K^r_δ(i,j)^T + K^c_j Q^r_δ(j,i)^T, H = softmax(Ã / sqrt(3d)) V^c,
    # Q^r = P W_{q,r}, K^r = P W_{k,r}, P [2k, d_model] shared by the layers.
    attention, x = _attention("deberta", causal=causal, key=4), _x(4)
    shared = SharedTerms.make("deberta", heads=HEADS, d_head=DH, d_model=D_MODEL, max_distance=K,
                              key=jax.random.key(9))  # fmt: skip
    q, k, v = _projected(attention, _np(x))
    table = _np(shared.table)
    q_r = (table @ _np(attention.relative.pos_q.weight).T).reshape(2 * K, HEADS, DH)
    k_r = (table @ _np(attention.relative.pos_k.weight).T).reshape(2 * K, HEADS, DH)
    pos = np.round(positions).astype(int)  # the grid's distances, rounded
    logits = np.zeros((HEADS, N, N))
    for h in range(HEADS):
        for i in range(N):
            for j in range(N):
                c2c = q[i, h] @ k[j, h]
                c2p = q[i, h] @ k_r[_delta(pos[i], pos[j], K), h]
                p2c = k[j, h] @ q_r[_delta(pos[j], pos[i], K), h]
                logits[h, i, j] = (c2c + c2p + p2c) / math.sqrt(3 * DH)
    p = _softmax(logits, causal)
    want = _output(attention, np.einsum("hij,jhd->ihd", p, v))
    got = attention(x, bias=shared, positions=jnp.asarray(positions, jnp.float32))
    assert_close(got, want, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- TUPE


def _t5_bucket(relative, bidirectional, num_buckets=32, max_distance=128):
    """Raffel et al. 2020's bucket of key - query (T5's _relative_position_bucket)."""
    n, ret = -relative, 0
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return ret + n
    large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return ret + min(large, num_buckets - 1)


@pytest.mark.parametrize(("relative", "cls"), [(False, 0), (True, 0), (False, None)])
def test_tupe_unties_content_and_positions_and_resets_the_cls_token(relative, cls):
    # α_ij = (x_i W^Q)(x_j W^K)^T / sqrt(2d) + reset_θ((p_i U^Q)(p_j U^K)^T / sqrt(2d) [+ b_{j-i}], i, j)
    # (eq. 10-11); reset_θ: θ1 on the CLS row, θ2 on the CLS column (eq. 9).
    positions = Positions("tupe", dim=D_MODEL, heads=HEADS, max_len=16, causal=False, key=jax.random.key(5),
                          cls_position=cls, tupe_relative=relative)  # fmt: skip
    theta = jnp.array([[0.7, -0.3, 0.1, 1.2], [-0.9, 0.4, 0.8, -0.2]])  # distinct: a wrong order shows
    positions = eqx.tree_at(lambda m: m.untied.theta, positions, theta)
    attention, x = _attention("tupe", causal=False, key=5), _x(5)
    untied = positions.untied
    p = _np(untied.table)[:N]
    pq = (p @ _np(untied.u_q.weight).T).reshape(N, HEADS, DH)
    pk = (p @ _np(untied.u_k.weight).T).reshape(N, HEADS, DH)
    q, k, v = _projected(attention, _np(x))
    logits = np.zeros((HEADS, N, N))
    for h in range(HEADS):
        for i in range(N):
            for j in range(N):
                position = pq[i, h] @ pk[j, h] / math.sqrt(2 * DH)
                if relative:
                    position += _np(untied.relative)[_t5_bucket(j - i, bidirectional=True), h]
                if cls is not None and i == cls:
                    position = float(theta[0, h])
                elif cls is not None and j == cls:
                    position = float(theta[1, h])
                logits[h, i, j] = q[i, h] @ k[j, h] / math.sqrt(2 * DH) + position
    want = _output(attention, np.einsum("hij,jhd->ihd", _softmax(logits, False), v))
    got = attention(x, bias=positions.grid_bias(N))
    assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert positions.embed(jnp.arange(N)) is None  # untied: nothing added to the tokens


# ----------------------------------------------------------------------------- models


SIZES = dict(vocab_size=VOCAB, num_layers=1, d_model=D_MODEL, num_heads=HEADS, kv_heads=KV_HEADS, max_len=24)


@pytest.mark.parametrize(
    "embedding",
    [
        {"position": "shaw", "relative_max_distance": 2},
        {"position": "transformer_xl"},
        {"position": "deberta", "relative_max_distance": 3},
        {"position": "tupe", "tupe_relative": True},
    ],
)
def test_language_models_decode_like_their_parallel_forward(embedding):
    config = ModelConfig(task="lm", **SIZES, ffn={"d_ff": 24}, embedding=embedding)
    model = build_model(config, key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(1), (9,), 0, VOCAB)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)


def test_reversible_wiring_passes_the_shared_terms_gradient():
    # The reversible stack's own backward pass (which reconstructs activations) against
    # plain autodiff of the same wiring: DeBERTa's P, shared by the layers, comes in as the
    # bias and must get the same gradient.
    from jxformers.nn.reversible import reversible_stack

    cfg = ModelConfig(task="lm", **SIZES | {"num_layers": 2}, stack={"reversible": True},
                      embedding={"position": "deberta", "relative_max_distance": 3})  # fmt: skip
    model = build_model(cfg, key=jax.random.key(0))
    x, shared = jax.random.normal(jax.random.key(1), (9, D_MODEL)), model.embedding.positions.shared

    @eqx.filter_jit
    def both(args):
        loss = lambda fn: lambda a: jnp.sum(jnp.sin(fn(*a)))  # noqa: E731
        ours = eqx.filter_grad(loss(lambda b, x, c: reversible_stack(b, x, bias=c)))(args)
        return ours, eqx.filter_grad(loss(plain_reversible))(args)

    ours, ref = both((model.blocks, x, shared))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
        assert_close(a, b, atol=2e-5)
    assert float(jnp.abs(ours[2].table).max()) > 0


def test_funnel_pooled_queries_meet_unpooled_keys_at_their_own_positions():
    # DeBERTa in a Funnel layer: pooled token j at 1 + 2j (CLS at 0), keys at 0..n.
    cfg = dict(SIZES, num_layers=2, stack={"filters": {1: 0.5}, "downsample": "funnel"},
               embedding={"position": "deberta", "relative_max_distance": 3})  # fmt: skip
    encoder = build_model(ModelConfig(task="classify", **cfg), key=jax.random.key(0)).encoder
    x = jax.random.randint(jax.random.key(2), (10,), 0, VOCAB)

    @eqx.filter_jit
    def reference(e, x):
        h = jnp.concatenate([e.cls[None], e.embedding(x, jnp.arange(1, 11))])
        shared, full_pos = e.embedding.positions.shared, jnp.arange(11, dtype=jnp.float32)
        full = e.blocks[0](h, bias=shared, positions=full_pos)
        pooled = jnp.concatenate([full[:1], ops.funnel_pool(full[1:], 2)[0]])
        q_pos = jnp.concatenate([jnp.zeros(1), 1.0 + 2.0 * jnp.arange(5)])
        out = e.blocks[1](pooled, bias=shared, positions=q_pos, source=full, source_positions=full_pos)
        return e.norm(out)

    assert_close(eqx.filter_jit(encoder)(x)[0], reference(encoder, x), atol=2e-5)


def _from_yaml(text):
    common = "vocab_size: 13\nmax_len: 24\nd_model: 16\nnum_heads: 4\nnum_layers: 2\n"
    return ModelConfig.from_yaml(common + text)


def test_the_settings_reach_the_modules_from_yaml():
    shaw = build_model(
        _from_yaml("task: lm\nembedding: {position: shaw, relative_max_distance: 5}\n"), key=jax.random.key(0)
    )
    terms = shaw.blocks[1].attention.relative
    assert terms.kind == "shaw" and terms.max_distance == 5 and terms.keys.shape == (11, 4)
    assert shaw.embedding.positions.shared is None and shaw.embedding.positions.embed(jnp.arange(3)) is None
    config = _from_yaml("task: classify\nembedding: {position: deberta}\n")
    assert ModelConfig.from_dict(config.to_dict()) == config  # the YAML form keeps them
    deberta = build_model(config, key=jax.random.key(0))
    assert deberta.encoder.embedding.positions.shared.table.shape == (48, 16)  # k = max_len: 2k rows
    txl = build_model(_from_yaml("task: seq2seq\nembedding: {position: transformer_xl}\n"), key=jax.random.key(0))
    assert txl.decoder.blocks[0].attention.relative.r_proj is not None
    assert txl.decoder.blocks[0].cross_attention.relative is None  # no positions across sequences
    assert txl.encoder.embedding.positions.shared.u.shape == (4, 4)
    tupe = build_model(
        _from_yaml("task: classify\nembedding: {position: tupe, tupe_relative: true}\n"), key=jax.random.key(0)
    )
    untied = tupe.encoder.embedding.positions.untied
    assert untied.cls_position == 0 and untied.relative is not None
    assert tupe.encoder.blocks[0].attention.relative.kind == "tupe"

    def loss(model, x):
        return jnp.sum(jnp.square(model(x)))

    # θ is learned: its gradient reaches it through the CLS token's row and column.
    x = jax.random.randint(jax.random.key(3), (8,), 0, 13)
    untied = eqx.filter_jit(eqx.filter_grad(loss))(tupe, x).encoder.embedding.positions.untied
    assert float(jnp.abs(untied.theta).max()) > 0 and float(jnp.abs(untied.u_q.weight).max()) > 0


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"embedding": {"position": "shaw"}, "attention": "linear"},
         r"position 'shaw' adds score terms .*block 0's attention 'linear' takes no logit bias; .*\['softmax'\]"),
        ({"embedding": {"position": "deberta"}, "attention": "hard_gaussian"},
         r"position 'deberta' .* 'hard_gaussian' never compares queries with keys"),
        ({"embedding": {"position": "tupe"}, "attention": "linear"},
         r"position 'tupe' adds score terms .*'linear' takes no logit bias"),
        ({"embedding": {"position": "shaw"}, "attention": {"name": "softmax", "qk_norm": "layernorm"}},
         r"position 'shaw' reads each head's projected queries .*qk_norm='layernorm'"),
        ({"embedding": {"position": "transformer_xl"}, "attention": {"name": "softmax", "collaborative": 8}},
         r"position 'transformer_xl' works on each head's own queries .*collaborative"),
        ({"embedding": {"position": "deberta"}, "stack": {"attention_maps": "residual"}},
         r"position 'deberta' computes its terms inside each attention; the carried attention maps"),
        ({"embedding": {"position": "transformer_xl"}, "task": "classify", "stack": {"filters": {0: 0.5}}},
         r"position 'transformer_xl' with stack.filters \{0: 0.5\}: refused, its W_\{k,R\} R_\{i-j\}"),
        ({"embedding": {"position": "tupe"}, "task": "classify",
          "stack": {"filters": {1: 0.5}, "downsample": "funnel"}},
         r"position 'tupe' with stack.filters \{1: 0.5\}: refused, .*absolute embedding p_i"),
        ({"embedding": {"position": "shaw"}, "stack": "luna"}, r"stack 'luna' takes positions added .*got 'shaw'"),
        ({"embedding": {"position": "t5", "relative_max_distance": 4}},
         r"relative_max_distance is k of positions 'shaw' and 'deberta'; got position='t5'"),
        ({"embedding": {"position": "shaw", "relative_max_distance": 0}},
         r"embedding.relative_max_distance must be >= 1; got 0"),
        ({"embedding": {"position": "alibi", "tupe_relative": True}}, r"tupe_relative is TUPE-R: .*got 'alibi'"),
        ({"embedding": {"position": "transformer_xl"}, "stack": {"layer_overrides": {1: {"attention": {"d_head": 8}}}}},
         r"shares u and v .*one head size; got \[4, 8\]"),
    ],
)  # fmt: skip
def test_config_refusals_name_the_option_and_the_attention(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**({"task": "lm", "vocab_size": 11, "max_len": 16, "d_model": 16, "num_heads": 4} | values))


def test_module_refusals():
    relative = RelativeTerms("shaw", d_model=16, heads=4, d_head=4, max_distance=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"'chunked' takes no logit bias"):
        Attention("chunked", 16, 4, relative=relative, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"relative terms for 4 heads of 4; this attention has 2 heads of 8"):
        Attention("softmax", 16, 2, relative=relative, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"max_distance must be an int >= 1; got 0"):
        RelativeTerms("deberta", d_model=16, heads=4, d_head=4, key=jax.random.key(0))
    assert registry.get("softmax").takes_relative_values and not registry.get("hard_gaussian").takes_relative_values
    q = jnp.zeros((3, 2, 4))
    with pytest.raises(ValueError, match=r"relative_values is a\^V \[2k \+ 1, d_v\].*got shape \(4, 4\)"):
        ops.softmax_attention(q, q, q, relative_values=jnp.zeros((4, 4)))
