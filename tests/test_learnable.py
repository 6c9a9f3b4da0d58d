"""The learnable patterns (jxformers/ops/learnable.py) beyond the generic suite: each
equals dense attention where its paper says it should, each fault of the Long Range
Arena reference code is absent (one test per fault), randomness comes only from explicit
keys, and the k-means centroids move towards the data in training, outside the gradient.
Small shapes throughout (one or two compilations per test)."""

import dataclasses
import functools
import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import JittedOps, assert_close, qkv

import jxformers.ops
from jxformers import ModelConfig, build_model, nn, registry
from jxformers.ops import _common, softmax_attention

eager_ops = jxformers.ops  # where a test watches what happens at call time
ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6

# The LSH tests below call the op by hand with a separate k on purpose (it must be unused):
# its SharedQKWarning is tested once, in test_lsh_warns_once_per_call_site_when_k_is_not_q.
pytestmark = pytest.mark.filterwarnings("ignore::jxformers.ops.SharedQKWarning")


@functools.cache
def _jitted(fn, static):
    return jax.jit(functools.partial(fn, **dict(static)))


def call(fn, *args, **kwargs):
    """fn(*args, **kwargs) under jit (arrays traced, everything else static): one
    compilation per shape, much faster than running the op eagerly."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    return _jitted(fn, static)(*args, **arrays)


def arrays_for(name, seed=1, **hp):
    return registry.bind(name, **hp).init_arrays(jax.random.key(seed), heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)


def shared_qk_reference(q, v, *, mask=None, kv_mask=None):
    """Dense softmax with Reformer's shared keys k_j = q_j / |q_j| and its self-mask
    (a token attends to itself only when nothing else is allowed), from the paper."""
    n = q.shape[0]
    keys = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    allowed = np.ones((n, n), bool) if mask is None else np.asarray(mask)
    if kv_mask is not None:
        allowed = allowed & np.asarray(kv_mask)[None, :]
    others = (allowed & ~np.eye(n, dtype=bool)).any(1, keepdims=True)
    allowed = allowed & (~np.eye(n, dtype=bool) | ~others)
    values = jnp.repeat(v, HEADS // v.shape[1], axis=1)
    return call(softmax_attention, q, keys, values, mask=jnp.asarray(allowed))


# ----------------------------------------------------------------------------- Reformer (LSH)


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_with_one_bucket_is_dense_shared_qk_softmax_with_the_self_mask(causal):
    n = 19
    q, k, v = qkv(0, n)
    kv_mask = jnp.arange(n) < n - 4
    hp = dict(n_buckets=1, n_hashes=2, chunk_size=n)
    out = call(ops.lsh_attention, q, k, v, **hp, **arrays_for("lsh", **hp), causal=causal, kv_mask=kv_mask)
    mask = np.tril(np.ones((n, n), bool)) if causal else None
    expected = shared_qk_reference(q, v, mask=mask, kv_mask=kv_mask)
    assert_close(out[: n - 4], expected[: n - 4], atol=2e-5)


def test_lsh_rotations_come_from_the_key_not_a_fixed_seed():
    # LRA hashes with a fixed PRNGKey(0): here two keys give two hashings, one key twice the same.
    q, _, _ = qkv(3, 32)
    hp = dict(n_buckets=8, n_hashes=2)
    a, b, again = (arrays_for("lsh", seed=s, **hp)["rotations"] for s in (1, 2, 1))
    buckets = [ops.lsh_buckets(q[:, 0], r[0], 8) for r in (a, b, again)]
    assert not bool(jnp.all(buckets[0] == buckets[1]))
    assert bool(jnp.all(buckets[0] == buckets[2]))
    assert registry.get("lsh").drawn == ("rotations",) and registry.get("lsh").redrawn  # nn.redraw draws new ones


def test_lsh_divides_logits_by_sqrt_d():
    # LRA multiplies by sqrt(d): with one bucket the output is softmax(q k^T / sqrt(d)) and not the other.
    n = 12
    q, k, v = qkv(1, n)
    hp = dict(n_buckets=1, n_hashes=1, chunk_size=n)
    out = call(ops.lsh_attention, q, k, v, **hp, **arrays_for("lsh", **hp))
    assert_close(out, shared_qk_reference(q, v), atol=2e-5)
    wrong = call(ops.lsh_attention, q, k, v, **hp, **arrays_for("lsh", **hp), scale=math.sqrt(D_K))
    assert not np.allclose(out, wrong, atol=1e-3)


def test_lsh_normalises_the_shared_keys():
    # LRA does not normalise: here scaling token j's vector leaves every other token's output as it was.
    n, j = 12, 5
    q, k, v = qkv(2, n)
    hp = dict(n_buckets=1, n_hashes=1, chunk_size=n)
    arrays = arrays_for("lsh", **hp)
    out = call(ops.lsh_attention, q, k, v, **hp, **arrays)
    scaled = call(ops.lsh_attention, q.at[j].multiply(7.0), k, v, **hp, **arrays)
    others = np.arange(n) != j
    assert_close(out[others], scaled[others], atol=2e-5)


def test_lsh_never_attends_to_itself_unless_alone():
    # LRA has no self-mask: here a token's own value never reaches its output while others are there.
    n, i = 12, 4
    q, k, v = qkv(4, n)
    hp = dict(n_buckets=2, n_hashes=2, chunk_size=4)
    arrays = arrays_for("lsh", **hp)
    out = call(ops.lsh_attention, q, k, v, **hp, **arrays)
    shared = q.shape[1] // v.shape[1]
    v_heads = jnp.repeat(v, shared, axis=1)
    # Change token i's value in a layout where only its own query could see it (values are per kv head).
    changed = call(ops.lsh_attention, q, k, v.at[i].add(100.0), **hp, **arrays)
    touched = np.abs(np.asarray(changed - out)).max(axis=(1, 2)) > 1e-4
    assert not touched[i], "a token attended to itself although it had other keys"
    assert v_heads.shape[1] == HEADS
    alone = jnp.arange(n) == i  # one real token: it has only itself
    single = call(ops.lsh_attention, q, k, v, **hp, **arrays, kv_mask=alone)
    assert_close(single[i], v_heads[i], atol=1e-5)


def test_lsh_has_a_causal_branch():
    # LRA's causal branch is `pass`: here the first token sees only itself and later keys never matter.
    n = 16
    q, k, v = qkv(5, n)
    hp = dict(n_buckets=4, n_hashes=2, chunk_size=4)
    arrays = arrays_for("lsh", **hp)
    out = call(ops.lsh_attention, q, k, v, **hp, **arrays, causal=True)
    assert_close(out[0], jnp.repeat(v, 2, axis=1)[0], atol=1e-5)
    later = call(ops.lsh_attention, q.at[9:].set(-q[9:]), k, v.at[9:].set(50.0), **hp, **arrays, causal=True)
    assert_close(out[:9], later[:9], atol=1e-5)
    assert not np.allclose(out, call(ops.lsh_attention, q, k, v, **hp, **arrays))


def test_lsh_any_length_padding_and_bf16():
    n = 29  # not a multiple of the chunk
    q, k, v = qkv(6, n)
    hp = dict(n_buckets=4, n_hashes=2, chunk_size=8)
    arrays = arrays_for("lsh", **hp)
    kv_mask = jnp.arange(n) < 21
    out = call(ops.lsh_attention, q, k, v, **hp, **arrays, kv_mask=kv_mask)
    junk = call(ops.lsh_attention, q.at[21:].set(9.0), k, v.at[21:].set(1e4), **hp, **arrays, kv_mask=kv_mask)
    assert_close(out[:21], junk[:21], atol=1e-5)  # padded tokens never attended, never moving a real one
    half = call(ops.lsh_attention, *(x.astype(jnp.bfloat16) for x in (q, k, v)), **hp, **arrays, kv_mask=kv_mask)
    assert half.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(half.astype(jnp.float32))))


def lsh_union_reference(q, v, rotations, *, chunk, causal):
    """Reformer's appendix, from the paper, one head in numpy: with duplicates counted,
    the hash rounds' log-sum-exp combination is one softmax over every key a query finds
    in any round. Not causal: each round's positions sorted by (bucket, position), the
    rounds concatenated (trax's layout), cut into chunks; a query finds its chunk and the
    one before in the concatenation (the first wrapping to the last). Causal: the chunk + 1
    most recent earlier keys of its bucket in each round. Shared keys q/|q|, logits over
    sqrt(d), no self unless alone. Returns (out, the union, the union without the wrap
    and cross-round look-back, how many times each pair was found)."""
    q, v, rotations = (np.asarray(x, np.float64) for x in (q, v, rotations))
    n, d = q.shape
    rotated = np.einsum("ld,rdh->rlh", q, rotations)
    buckets = np.argmax(np.concatenate([rotated, -rotated], -1), -1)
    found = np.zeros((n, n), int)
    within = np.zeros((n, n), bool)  # each round's chunks alone, the first chunk looking at nothing before
    if causal:
        for b in buckets:
            for i in range(n):
                mine = [j for j in range(i + 1) if b[j] == b[i]][-(chunk + 1) :]
                found[i, mine] += 1
    else:
        chunks = np.concatenate([np.argsort(b, kind="stable") for b in buckets]).reshape(-1, chunk)
        per_round = n // chunk
        for c, members in enumerate(chunks):
            window = np.concatenate([chunks[c - 1], members])  # chunks[-1]: the wrap
            for i in members:
                np.add.at(found[i], window, 1)
                within[i, members] = True
                if c % per_round:
                    within[i, chunks[c - 1]] = True
    allowed = found > 0
    others = (allowed & ~np.eye(n, dtype=bool)).any(1, keepdims=True)
    allowed &= ~np.eye(n, dtype=bool) | ~others
    keys = q / np.linalg.norm(q, axis=-1, keepdims=True)
    logits = np.where(allowed, q @ keys.T / np.sqrt(d), -np.inf)
    p = np.exp(logits - logits.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ v, allowed, within, found


@pytest.mark.parametrize("causal", [False, True])
def test_lsh_rounds_look_across_and_count_duplicate_keys_as_the_appendix(causal):
    # One softmax over the union of the rounds' windows: fails without the log N_ij
    # correction (some pair is found twice) and, not causal, without the look-back from
    # a round's first chunk to the previous round's last (the union differs without it).
    n, chunk = 16, 3 if causal else 4
    q, _, v = qkv(9, n)
    q, v = q[:, :1], v[:, :1]
    rotations = jax.random.normal(jax.random.key(5), (1, 2, D_K, 2))
    hp = dict(n_buckets=4, n_hashes=2, chunk_size=chunk, causal=causal)
    out = call(ops.lsh_attention, q, q, v, **hp, rotations=rotations)
    expected, allowed, within, found = lsh_union_reference(q[:, 0], v[:, 0], rotations[0], chunk=chunk, causal=causal)
    assert (found > 1).any()
    if not causal:
        assert (allowed & ~within).any()
    assert_close(out[:, 0], expected, atol=2e-5)


def test_lsh_errors_name_the_value():
    q, k, v = qkv(0, 8)
    with pytest.raises(ValueError, match="n_buckets=3"):
        ops.lsh_attention(q, k, v, n_buckets=3, rotations=jnp.zeros((HEADS, 2, D_K, 1)))
    with pytest.raises(ValueError, match="rotations"):
        ops.lsh_attention(q, k, v, n_buckets=4)


def test_lsh_warns_once_per_call_site_when_k_is_not_q(monkeypatch):
    # The op reads no k (shared QK); a hand-written model passing its own keys is told so,
    # once per line that calls it, and not when k is q or the caller says it knows.
    monkeypatch.setattr(_common, "_WARNED", set())  # the call sites already warned about, in this process
    q, k, v = qkv(0, 8, heads=2, kv_heads=2)
    hp = dict(n_buckets=2, n_hashes=1, chunk_size=4)
    arrays = registry.bind("lsh", **hp).init_arrays(jax.random.key(0), heads=2, kv_heads=2, d_k=D_K, d_v=D_V)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the op itself says it once per call site
        for _ in range(3):
            eager_ops.lsh_attention(q, k, v, **hp, **arrays)
        assert len(caught) == 1
        (first,) = caught
        assert first.category is eager_ops.SharedQKWarning and first.filename == __file__
        message = str(first.message)
        assert "SharedQKWarning" in message and "Kitaev et al. 2020" in message and "Reformer" in message
        assert "k=q" in message and "warn_unused_k=False" in message
        eager_ops.lsh_attention(q, q, v, **hp, **arrays)
        eager_ops.lsh_attention(q, k, v, **hp, **arrays, warn_unused_k=False)
        assert len(caught) == 1
        jax.jit(functools.partial(eager_ops.lsh_attention, **hp))(q, k, v, **arrays)  # named at this line, not jax's
        assert len(caught) == 2 and caught[1].filename == __file__ and caught[1].lineno != first.lineno


def test_models_and_the_registry_never_warn_about_lsh_keys(monkeypatch):
    # The Attention module passes its projected k to the bound op; the registration says
    # the op is shared-QK, so the binding silences the warning meant for hand-written calls.
    monkeypatch.setattr(_common, "_WARNED", set())  # an earlier test's warning must not hide one here
    attention = {"name": "lsh", "n_buckets": 2, "chunk_size": 4}
    config = ModelConfig(
        task="lm", vocab_size=11, num_layers=1, d_model=8, num_heads=2, max_len=16, attention=attention
    )
    model = build_model(config, key=jax.random.key(0))
    q, k, v = qkv(0, 8, heads=2, kv_heads=2)
    bound = registry.bind("lsh", n_buckets=2, chunk_size=4)
    arrays = bound.init_arrays(jax.random.key(0), heads=2, kv_heads=2, d_k=D_K, d_v=D_V)
    # Compiled: the warning is Python's, raised (here as an error) while the calls trace;
    # run op by op, the model and the two op calls would cost a compilation per operation.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ops.SharedQKWarning)
        eqx.filter_jit(lambda m, x: m(x))(model, jnp.arange(10) % 11)
        jax.jit(lambda q, k, v, a: bound(q, k, v, arrays=a))(q, k, v, arrays)
        jax.jit(lambda q, k, v, a: registry.get("lsh")(q, k, v, arrays=a, n_buckets=2, chunk_size=4))(q, k, v, arrays)
    assert "warn_unused_k" not in registry.get("lsh").defaults()  # a call argument, not a hyper-parameter


def test_reformer_model_lsh_in_a_reversible_stack_with_chunked_ffn():
    config = ModelConfig(
        task="lm",
        vocab_size=17,
        num_layers=2,
        d_model=16,
        num_heads=2,
        max_len=32,
        attention="lsh",
        attention_kwargs={"n_buckets": 4, "chunk_size": 4},
        reversible=True,
        ffn_chunk_size=5,
    )
    model = build_model(config, key=jax.random.key(0))
    forward = eqx.filter_jit(lambda m, x: m(x))
    x = jax.random.randint(jax.random.key(1), (23,), 0, 17)
    logits = forward(model, x)
    plain = build_model(dataclasses.replace(config, ffn={"kind": "gelu"}), key=jax.random.key(0))
    assert_close(logits, forward(plain, x), atol=1e-5)  # chunking the FFN changes the memory, not the function
    changed = forward(model, x.at[15:].set(3))
    assert_close(changed[:15], logits[:15], atol=1e-5)  # causal through hashing, sorting and chunks
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x, key=jax.random.key(2)) ** 2)))(model)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)))


# ----------------------------------------------------------------------------- Routing Transformer


@pytest.mark.parametrize("causal", [False, True])
def test_routing_with_one_cluster_is_dense_attention(causal):
    n = 17
    q, k, v = qkv(7, n)
    hp = dict(n_clusters=1, local_heads=0)
    out = call(ops.routing_attention, q, k, v, **hp, **arrays_for("routing", **hp), causal=causal)
    assert_close(out, softmax_attention(q, k, v, causal=causal), atol=2e-5)


def test_routing_local_heads_are_local_attention():
    n = 21
    q, k, v = qkv(8, n)
    hp = dict(n_clusters=3, local_heads=2, local_window=3)
    out = call(ops.routing_attention, q, k, v, **hp, **arrays_for("routing", **hp), causal=True)
    local = call(ops.local_attention, q[:, :2], k[:, :1], v[:, :1], window=3, causal=True)
    assert_close(out[:, :2], local, atol=1e-6)


def test_routing_queries_attend_only_within_their_cluster():
    # Two clusters of keys in opposite directions; centroids on them: a query near one never sees the other's values.
    n, d = 16, D_K
    base = jnp.zeros((d,)).at[0].set(1.0)
    side = jnp.where(jnp.arange(n) % 2 == 0, 1.0, -1.0)[:, None, None]
    noise = 0.1 * jax.random.normal(jax.random.key(0), (n, 1, d))
    qk = side * base[None, None, :] + noise
    v = jnp.broadcast_to(side, (n, 1, 1)) * jnp.ones((n, 1, 3))
    centroids = jnp.stack([base, -base])[None]
    out = call(ops.routing_attention, qk, qk, v, n_clusters=2, local_heads=0, centroids=centroids)
    assert_close(out, jnp.broadcast_to(side, out.shape), atol=1e-6)


def test_routing_a_query_no_centroid_picks_gets_zeros_from_its_routing_heads():
    # The authors' code scatters each cluster's outputs back and divides by the count of
    # centroids that picked the query (plus 1e-2): a query no centroid picks gets zeros.
    # Here 3 centroids take their top-3 of 9 queries; the query pointing away from all
    # three is last for every centroid, so no one picks it.
    d, eye = D_K, jnp.eye(D_K)
    near = [0, 0, 0, 0, 1, 1, 1, 2]  # the nearest centroid of the 8 others
    noise = 0.01 * jax.random.normal(jax.random.key(3), (8, d))
    vectors = jnp.concatenate([eye[jnp.array(near)] + noise, -(eye[0] + eye[1] + eye[2])[None]])[:, None]
    v = jax.random.normal(jax.random.key(4), (9, 1, 3))
    out = call(ops.routing_attention, vectors, vectors, v, n_clusters=3, local_heads=0, centroids=eye[None, :3])
    assert_close(out[8], jnp.zeros_like(out[8]), atol=0)
    assert bool(jnp.all(jnp.abs(out[4:8]).sum(-1) > 0))  # centroids 1 and 2 surely pick their own


ROUTING_LM = dict(vocab_size=31, num_layers=1, d_model=16, num_heads=4, kv_heads=2, d_ff=24, max_len=64)


@pytest.fixture(scope="module")
def routing_lm():
    attention = {"name": "routing", "n_clusters": 4, "local_heads": 2, "local_window": 3}
    return build_model(ModelConfig(task="lm", attention=attention, **ROUTING_LM), key=jax.random.key(0))


def test_routing_decodes_like_its_causal_forward_at_every_prefix_length(routing_lm):
    # The causal window w = ceil(max_len / n_clusters) is fixed by the model's max_len, so
    # the parallel forward of a prefix of any length is the decoder's (it was w =
    # ceil(n / n_clusters) of the call's length: 3.6e-2 apart at 24 of 64 tokens).
    from suites import forward, tokens

    x = tokens(11, ROUTING_LM["max_len"])

    @eqx.filter_jit
    def decoded(model, x):
        def step(state, token):
            logits, state = model.decode_step(token, state)
            return state, logits

        return jax.lax.scan(step, model.init_decode_state(ROUTING_LM["max_len"]), x)[1]

    cached = decoded(routing_lm, x)
    for n in (1, 7, 24, 64):
        assert_close(cached[:n], forward(routing_lm, x[:n]), atol=3e-5, rtol=1e-4)


def test_kmeans_centroids_move_towards_the_data():
    key = jax.random.key(0)
    targets = jnp.stack([jnp.eye(D_K)[0], jnp.eye(D_K)[3]])  # two directions
    data = targets[jnp.arange(64) % 2] + 0.05 * jax.random.normal(key, (64, D_K))
    centroids = ops.kmeans_centroids(jax.random.key(1), heads=1, d_k=D_K, n_clusters=2)["centroids"]

    def closeness(c, points):  # the mean cosine of each point to its nearest centroid (k-means' objective)
        cn = c[0] / jnp.linalg.norm(c[0], axis=-1, keepdims=True)
        return float(jnp.mean(jnp.max(points @ cn.T, axis=1)))

    @jax.jit
    def fit(c):
        return jax.lax.fori_loop(
            0, 30, lambda _, c: ops.kmeans_update(c, data[:, None], jnp.ones(64, bool), decay=0.8), c
        )

    start = closeness(centroids, data)
    assert closeness(fit(centroids), data) > start + 0.3
    one_each = (targets + 0.25 * jax.random.normal(jax.random.key(2), targets.shape))[None]  # one near each cluster
    assert closeness(one_each, targets) < 0.9
    assert closeness(fit(one_each), targets) > 0.99
    ignored = ops.kmeans_update(centroids, data[:, None] * 0 + 5.0, jnp.zeros(64, bool), decay=0.8)
    assert_close(ignored, centroids, atol=0)  # padding never moves a centroid


@pytest.mark.parametrize(
    "name, kwargs, reversible",
    [
        ("routing", {"n_clusters": 2, "local_heads": 0}, False),
        ("routing", {"n_clusters": 2, "local_heads": 0}, True),
        ("clusterformer", {"n_clusters": 2, "chunk_size": 4}, False),
    ],
)
def test_train_step_moves_the_centroids_outside_the_gradient(name, kwargs, reversible):
    import optax

    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    config = ModelConfig(
        task="classify",
        vocab_size=11,
        num_layers=1,
        d_model=16,
        num_heads=2,
        d_ff=16,
        max_len=16,
        attention=name,
        attention_kwargs=kwargs,
        reversible=reversible,
    )
    model = build_model(config, key=jax.random.key(0))
    assert nn.updates_arrays(model)
    params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))  # the step donates these

    def paths(tree):
        return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]

    assert not [p for p in paths(params) if "centroids" in p]  # never given to the optimizer
    assert [p for p in paths(drawn) if "centroids" in p]
    optimizer = optax.adam(1e-3)
    state = TrainState(
        params=params,
        drawn=drawn,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key(3),
    )
    tokens = jax.random.randint(jax.random.key(4), (4, 12), 0, 11)
    batch = {
        "tokens": tokens,
        "mask": jnp.arange(12)[None, :] < jnp.array([[12], [9], [12], [7]]),
        "label": jnp.array([0, 1, 1, 0]),
    }
    before = [np.asarray(a.drawn["centroids"]) for a in nn.attention_modules(model)]
    new_state, metrics = make_train_step(static, optimizer, grad_accum=2)(state, batch)  # donates state
    assert bool(metrics["finite"])
    after = [a.drawn["centroids"] for a in nn.attention_modules(new_state.model(static))]
    for a, b in zip(before, after, strict=True):
        assert not bool(jnp.allclose(a, b))  # moved by the k-means update, not by the optimizer

    # The update is a pure function of the batch's inputs the model returns, no gradient
    # involved. (Compiled, like the inference call below: run op by op, a model with
    # k-means routing costs hundreds of one-operation compilations.)
    produced = eqx.filter_jit(jax.vmap(lambda t, m: model.apply(t, m)[1]))(tokens, batch["mask"])
    assert [a.path for a in produced.attention_inputs] == [("encoder", "blocks", 0, "attention")]
    expected = eqx.filter_jit(nn.update_arrays)(model, produced.attention_inputs)
    for a, b in zip(nn.attention_modules(expected), after, strict=True):  # the step's update, from both micro-batches
        np.testing.assert_allclose(np.asarray(a.drawn["centroids"]), np.asarray(b), atol=1e-5)
    # in inference nothing is returned, so evaluation moves nothing
    inference = eqx.filter_jit(lambda m, t, mask: m.apply(t, mask, inference=True)[1].attention_inputs)
    assert not inference(model, tokens[0], batch["mask"][0])


# ----------------------------------------------------------------------------- Sinkhorn Transformer


def permutation_logits(blocks, shift):
    """Logits whose Sinkhorn balancing is the permutation sending block i to block i - shift."""
    return jnp.broadcast_to(1e4 * jnp.roll(jnp.eye(blocks), -shift, axis=1), (HEADS, blocks, blocks))


def block_mask(n, b, shift=None):
    i, j = np.arange(n)[:, None] // b, np.arange(n)[None, :] // b
    blocks = -(-n // b)
    m = i == j
    return m if shift is None else m | (j == (i - shift) % blocks)


def test_sinkhorn_with_the_identity_is_contiguous_block_local_attention():
    # LRA groups strided positions: here a block is contiguous, and the identity sort adds nothing to it.
    n, b = 23, 6
    q, k, v = qkv(9, n)
    out = call(ops.sinkhorn_attention, q, k, v, block_size=b, max_len=32, sort_logits=permutation_logits(4, 0))
    assert_close(out, call(ops.block_local_attention, q, k, v, block_size=b), atol=2e-5)
    strided = softmax_attention(q, k, v, mask=jnp.asarray(np.arange(n)[:, None] % 4 == np.arange(n)[None, :] % 4))
    assert not np.allclose(out, strided, atol=1e-3)


def test_sinkhorn_with_a_shift_adds_the_neighbour_block():
    n, b = 24, 6
    q, k, v = qkv(10, n)
    out = call(ops.sinkhorn_attention, q, k, v, block_size=b, max_len=32, sort_logits=permutation_logits(4, 1))
    assert_close(out, softmax_attention(q, k, v, mask=jnp.asarray(block_mask(n, b, shift=1))), atol=2e-5)


def test_sinkhorn_sorts_and_its_sorting_network_gets_a_gradient():
    # LRA's "sort" gives every block the sum of all key blocks: it sorts nothing and its network gets no gradient.
    n, b = 24, 6
    q, k, v = qkv(11, n)
    one, other = (
        call(ops.sinkhorn_attention, q, k, v, block_size=b, max_len=32, sort_logits=permutation_logits(4, s))
        for s in (1, 2)
    )
    assert not np.allclose(one, other, atol=1e-3)  # the sorted block is the one the permutation picks
    arrays = arrays_for("sinkhorn", block_size=b, max_len=32)
    for causal in (False, True):
        grads = jax.jit(
            jax.grad(
                lambda a: jnp.sum(ops.sinkhorn_attention(q, k, v, block_size=b, max_len=32, causal=causal, **a) ** 2)  # noqa: B023
            )
        )(arrays)
        for name in ("sort_w1", "sort_w2", "sort_b2"):
            assert float(jnp.abs(grads[name]).max()) > 0, f"{name} got no gradient (causal={causal})"


def test_sinkhorn_sorting_network_reads_the_key_block_sums():
    # The stated difference: R = relu(psi(K) W1 + b1) W2 + b2 from the keys' block sums
    # (psi(K) = psi(X) W_K: the paper's network on psi(X) with its first layer factored
    # through d_k), in numpy; the same network on the queries' sums fails.
    n, b = 24, 6
    q, k, v = qkv(12, n)
    a = {name: np.asarray(x, np.float64) for name, x in arrays_for("sinkhorn", block_size=b, max_len=32).items()}
    kh = np.repeat(np.asarray(k, np.float64), HEADS // KV_HEADS, axis=1)  # per query head

    def network(x):  # x [n, heads, d] -> logits [heads, blocks, blocks]
        sums = x.reshape(n // b, b, HEADS, D_K).sum(1).transpose(1, 0, 2)  # [heads, blocks, d]
        hidden = np.maximum(np.einsum("hnd,hde->hne", sums, a["sort_w1"]) + a["sort_b1"][:, None], 0)
        blocks = n // b
        logits = np.einsum("hne,hem->hnm", hidden, a["sort_w2"][:, :, :blocks]) + a["sort_b2"][:, None, :blocks]
        return jnp.asarray(logits)

    hp = dict(block_size=b, max_len=32, sinkhorn_iters=3)
    out = call(ops.sinkhorn_attention, q, k, v, **hp, **arrays_for("sinkhorn", block_size=b, max_len=32))
    assert_close(out, call(ops.sinkhorn_attention, q, k, v, **hp, sort_logits=network(kh)), atol=2e-5)
    other = call(ops.sinkhorn_attention, q, k, v, **hp, sort_logits=network(np.asarray(q, np.float64)))
    assert not np.allclose(out, other, atol=1e-4)


def test_sinkhorn_adds_gumbel_noise_in_training_only():
    # LRA never adds Gumbel noise: here a training key perturbs the sort, one key twice the same, inference none.
    n, b = 24, 6
    q, k, v = qkv(12, n)
    arrays = arrays_for("sinkhorn", block_size=b, max_len=32)
    run = lambda key: call(ops.sinkhorn_attention, q, k, v, block_size=b, max_len=32, gumbel_key=key, **arrays)  # noqa: E731
    clean, a, a2, other = run(None), run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    assert_close(a, a2, atol=0)
    assert not np.allclose(a, clean, atol=1e-4) and not np.allclose(a, other, atol=1e-4)
    module = nn.Attention("sinkhorn", 16, 2, attention_kwargs={"block_size": 4, "max_len": 32}, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(3), (13, 16))
    key = jax.random.key(4)
    apply = eqx.filter_jit(lambda m, x, key, inference: m(x, key=key, inference=inference))
    clean = apply(module, x, None, False)
    assert_close(apply(module, x, key, True), clean, atol=0)
    assert not np.allclose(apply(module, x, key, False), clean, atol=1e-5)


def test_sinkhorn_sortcut_attends_only_to_the_first_sorted_blocks():
    n, b = 24, 6
    q, k, v = qkv(13, n)
    out = call(
        ops.sinkhorn_attention,
        q,
        k,
        v,
        block_size=b,
        max_len=32,
        sortcut_blocks=1,
        sort_logits=permutation_logits(4, 1),
    )  # sorted block 0 is block 3
    mask = np.broadcast_to(np.arange(n)[None, :] // b == 3, (n, n))
    assert_close(out, softmax_attention(q, k, v, mask=jnp.asarray(mask)), atol=2e-5)
    with pytest.raises(ValueError, match="sortcut_blocks"):
        ops.sinkhorn_attention(
            q,
            k,
            v,
            block_size=b,
            max_len=32,
            sortcut_blocks=1,
            causal=True,
            **arrays_for("sinkhorn", block_size=b, max_len=32),
        )


# ----------------------------------------------------------------------------- Cluster-Former


def test_clusterformer_with_one_cluster_and_one_chunk_is_dense():
    n = 19
    q, k, v = qkv(14, n)
    kv_mask = jnp.arange(n) < 15
    out = call(
        ops.clusterformer_attention,
        q,
        k,
        v,
        n_clusters=1,
        chunk_size=32,
        kv_mask=kv_mask,
        **arrays_for("clusterformer", n_clusters=1),
    )
    assert_close(out, softmax_attention(q, k, v, kv_mask=kv_mask), atol=2e-5)


def test_clusterformer_attends_within_chunks_of_the_cluster_sorted_order():
    n, chunk, clusters = 22, 5, 3
    q, k, v = qkv(15, n, heads=1, kv_heads=1)
    centroids = jax.random.normal(jax.random.key(16), (1, clusters, q.shape[2]))
    out = call(ops.clusterformer_attention, q, k, v, n_clusters=clusters, chunk_size=chunk, centroids=centroids)
    # Reference from the paper's definition, in numpy: nearest centroid, sort by (cluster, position), chunk.
    # The stated difference: the per-head queries are clustered (not the hidden states, nor the keys).
    cn = np.asarray(centroids[0]) / np.linalg.norm(np.asarray(centroids[0]), axis=1, keepdims=True)

    def chunks_of(x):
        cluster = np.argmax((x / np.linalg.norm(x, axis=1, keepdims=True)) @ cn.T, axis=1)
        order = sorted(range(n), key=lambda i: (cluster[i], i))
        chunk_of = np.empty(n, int)
        chunk_of[order] = np.arange(n) // chunk
        return chunk_of[:, None] == chunk_of[None, :]

    mask = chunks_of(np.asarray(q[:, 0]))
    assert not np.array_equal(mask, chunks_of(np.asarray(k[:, 0])))  # clustering the keys would fail
    assert_close(out, softmax_attention(q, k, v, mask=jnp.asarray(mask)), atol=2e-5)
