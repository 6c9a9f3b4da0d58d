"""Three MoE routers of Lin et al.'s survey (section 5.3, "larger capacity") in
jxformers/nn/moe.py, each against its paper's formula with numpy references written here:
hash layers (Roller et al. 2021, random hash), BASE layers (Lewis et al. 2021: balanced
assignment against scipy's linear_sum_assignment, greedy at inference) and expert
prototyping (Yang et al. 2021, M6-T: k top-1). Also: decoding parity of causal language
models with the causal variants, BASE refused in causal models, one training step of each,
config errors. Expert parallelism of the three on 8 simulated devices is in
tests/test_moe_sharded.py (multidevice), beside the other routers'."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment
from suites import decode_all, train_steps

from jxformers import ModelConfig, build_model
from jxformers.nn.moe import NO_TOKEN, MoE, balanced_assignment, hash_table

D, FF = 8, 16


def _np(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def _np_expert(moe: MoE, e: int, x: np.ndarray) -> np.ndarray:
    """Expert e (ffn "relu") on rows x [n, d], in float64 numpy."""
    ex = moe.experts
    h = np.maximum(x @ _np(ex.w_in[e]) + _np(ex.b_in[e]), 0.0)
    return h @ _np(ex.w_out[e]) + _np(ex.b_out[e])


def _np_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _scipy_balanced(scores: np.ndarray, real: np.ndarray, num_experts: int) -> tuple[np.ndarray, float]:
    """The balanced assignment by scipy: expert e offers floor(m/E) slots that must be
    filled (a large bonus) and, when E does not divide m, one more that may be; (the
    expert of each real row, -1 for padding; the optimal total score)."""
    rows = np.flatnonzero(real)
    m = len(rows)
    q, r = divmod(m, num_experts)
    cols = [e for e in range(num_experts) for _ in range(q + (r > 0))]
    bonus = np.array([1e6 if c < q else 0.0 for _ in range(num_experts) for c in range(q + (r > 0))])
    ri, ci = linear_sum_assignment(-(scores[rows][:, cols] + bonus[None]))
    out = np.full(len(real), -1)
    out[rows[ri]] = np.array(cols)[ci]
    return out, float(scores[rows, out[rows]].sum())


@eqx.filter_jit
def _run(moe, x, mask=None, token_ids=None, key=None, inference=False):
    return moe(x, mask=mask, token_ids=token_ids, key=key, inference=inference)


# ----------------------------------------------------------------------------- hash layers


def test_hash_layer_sends_each_token_to_its_fixed_random_expert():
    """Roller et al.: y_t = FFN_{hash(x_t)}(h_t) with a table drawn once (no gate, no
    loss, nothing dropped); ids NO_TOKEN read the table's extra entry; padding gets 0."""
    counts = np.bincount(np.asarray(hash_table(4000, 4, jax.random.key(0))), minlength=4)
    assert counts.sum() == 4001 and counts.min() > 850, counts  # uniform: 1000 each, sd ~27
    vocab, n = 11, 12
    moe = MoE(D, FF, 4, router="hash", vocab_size=vocab, ffn="relu", key=jax.random.key(1))
    assert moe.router is None and moe.table is not None and moe.table.shape == (vocab + 1,)
    # the NO_TOKEN entry made unlike entries 0 and vocab - 1, so that reading either instead shows
    table = np.asarray(moe.table).copy()
    table[vocab] = min({0, 1, 2} - {int(table[0]), int(table[vocab - 1])})
    moe = eqx.tree_at(lambda m: m.table, moe, jnp.asarray(table))
    x = jax.random.normal(jax.random.key(2), (n, D))
    ids = jnp.array([3, 3, 0, 10, NO_TOKEN, 7, 1, 3, 5, 9, 2, 4])
    mask = jnp.arange(n) < 10
    want = np.zeros((n, D))
    for t in range(10):
        want[t] = _np_expert(moe, int(table[vocab if int(ids[t]) < 0 else int(ids[t])]), _np(x[t : t + 1]))[0]
    for inference in (False, True):  # no randomness, no capacity: training is inference
        y, aux = _run(moe, x, mask, ids, inference=inference)
        np.testing.assert_allclose(y, want, atol=1e-5)
        assert float(aux["loss"]) == float(aux["dropped"]) == 0.0
        hashed = [table[vocab if int(i) < 0 else int(i)] for i in ids[:10]]
        np.testing.assert_array_equal(aux["expert_load"], np.bincount(hashed, minlength=4))
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x, mask=mask, token_ids=ids)[0] ** 2)))(moe)
    assert float(jnp.abs(grads.experts.w_in).sum()) > 0  # only the experts learn
    with pytest.raises(ValueError, match="pass token_ids"):
        moe(x, mask=mask)


# ----------------------------------------------------------------------------- BASE layers


def test_balanced_assignment_is_optimal_and_gives_every_expert_its_share():
    """Against scipy on random and tie-heavy integer scores, with padding (NaN rows
    included) and shares that E does not divide: each expert gets floor or ceil of m / E
    (exactly m / E when E divides m) and the total score is scipy's optimum."""
    rng = np.random.default_rng(0)
    solve = jax.jit(jax.vmap(balanced_assignment))
    for n, e in ((12, 4), (10, 3)):
        scores = rng.normal(size=(8, n, e)).astype(np.float32) * 3
        scores[::2] = rng.integers(-2, 3, size=(4, n, e))  # many equal totals: ties
        lengths = np.array([n, n - 1, n - 2, n, 5, n - 3, 1, n])
        real = np.arange(n)[None, :] < lengths[:, None]
        scores[~real] = np.nan  # padding rows may hold anything
        got = np.asarray(solve(jnp.asarray(scores), jnp.asarray(real)))
        for b in range(8):
            m = int(lengths[b])
            assert (got[b][~real[b]] == e).all()  # padding: no expert
            load = np.bincount(got[b][real[b]], minlength=e)
            assert load.min() == m // e and load.max() == -(-m // e), (m, e, load)
            _, best = _scipy_balanced(scores[b].astype(np.float64), real[b], e)
            total = float(scores[b][np.flatnonzero(real[b]), got[b][real[b]]].astype(np.float64).sum())
            assert total == pytest.approx(best, abs=1e-4), (b, m, e)


def test_base_layer_balanced_in_training_greedy_at_inference_sigmoid_gate():
    """Lewis et al.: a = the balanced assignment maximising sum_t h_t . w_{a_t} in
    training, argmax_e h_t . w_e at inference; output sigma(h_t . w_{a_t}) f_{a_t}(h_t)
    (the block adds h_t); no auxiliary loss, nothing dropped."""
    n, e = 12, 4
    moe = MoE(D, FF, e, router="base", ffn="relu", key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (n, D))
    mask = jnp.arange(n) < 10  # 10 real tokens over 4 experts: shares 3, 3, 2, 2
    s = _np(x) @ _np(moe.router.weight).T  # affinities h_t . w_e  [n, E]
    train, _ = _scipy_balanced(s, np.asarray(mask), e)
    greedy = s.argmax(-1)
    for inference, chosen in ((False, train), (True, greedy)):
        want = np.zeros((n, D))
        for t in range(10):
            a = int(chosen[t])
            want[t] = (1 / (1 + np.exp(-s[t, a]))) * _np_expert(moe, a, _np(x[t : t + 1]))[0]
        y, aux = _run(moe, x, mask, inference=inference)
        np.testing.assert_allclose(y, want, atol=1e-5)
        assert float(aux["loss"]) == float(aux["balance_loss"]) == float(aux["dropped"]) == 0.0
        np.testing.assert_array_equal(aux["expert_load"], np.bincount(chosen[:10], minlength=e))
    assert sorted(np.bincount(train[:10], minlength=e)) == [2, 2, 3, 3]
    assert moe.capacity(n, inference=False) == 3  # ceil(12 / 4): filled, never exceeded
    # the expert embeddings learn through the gate (no gradient through the assignment)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x, mask=mask)[0] ** 2)))(moe)
    assert bool(jnp.isfinite(grads.router.weight).all()) and float(jnp.abs(grads.router.weight).sum()) > 0


# ----------------------------------------------------------------------------- expert prototyping


def test_prototyping_sums_the_top1_expert_of_each_group():
    """M6-T's k top-1: E = 6 experts in k = 2 groups of 3, a softmax per group, top-1
    in each, y = sum_i p_i[j_i] E_{i j_i}(x); the balancing loss is Switch's within each
    group, averaged."""
    n, e, k = 12, 6, 2
    moe = MoE(D, FF, e, router="prototype", top_k=k, dropless=True, ffn="relu", key=jax.random.key(5))
    x = jax.random.normal(jax.random.key(6), (n, D))
    mask = jnp.arange(n) < 11
    logits = _np(x) @ _np(moe.router.weight).T
    want, switch = np.zeros((n, D)), []
    for i in range(k):
        p = _np_softmax(logits[:, 3 * i : 3 * i + 3])
        j = p.argmax(-1)
        for t in range(11):
            want[t] += p[t, j[t]] * _np_expert(moe, 3 * i + int(j[t]), _np(x[t : t + 1]))[0]
        f = np.bincount(j[:11], minlength=3) / 11
        switch.append(3 * np.sum(f * p[:11].mean(0)))
    y, aux = _run(moe, x, mask)
    np.testing.assert_allclose(y, want, atol=1e-5)
    assert float(aux["balance_loss"]) == pytest.approx(np.mean(switch), rel=1e-5)
    assert float(aux["expert_load"].sum()) == 11 * k and float(aux["dropped"]) == 0
    # with capacity: each expert takes ceil(cf * n * k / E) of its group's tokens, in order
    small = MoE(D, FF, e, router="prototype", top_k=k, capacity_factor=0.5, min_capacity=1, key=jax.random.key(5))
    assert small.capacity(n, inference=False) == 2  # ceil(0.5 * 12 * 2 / 6)
    _, aux = _run(small, x, mask)
    assert float(aux["expert_load"].max()) <= 2 and float(aux["dropped"]) == 11 * k - float(aux["expert_load"].sum())


# ----------------------------------------------------------------------------- in models

TINY = dict(vocab_size=13, num_layers=2, d_model=16, num_heads=2, max_len=16)


def _moe(router: str, **settings) -> dict:
    return {"ffn": {"kind": "moe", "router": router, "num_experts": 4, "d_ff": 24} | settings}


def test_hash_and_prototype_language_models_decode_like_their_parallel_forward():
    """Both route per token (prototype dropless here: with capacity, the parallel forward
    may drop what one token at a time never does), so decoding equals the parallel
    forward; the memory tokens (prefilled by decoding) hash as NO_TOKEN in both."""
    config = ModelConfig(
        task="lm",
        **TINY,
        embedding={"extra_tokens": 2},
        stack={"layer_overrides": {0: _moe("hash"), 1: _moe("prototype", top_k=2, dropless=True)}},
    )
    model = build_model(config, key=jax.random.key(7))
    tokens = jax.random.randint(jax.random.key(8), (8,), 0, 13)
    parallel = eqx.filter_jit(lambda m, t: m(t, inference=True))(model, tokens)
    np.testing.assert_allclose(decode_all(model, tokens), parallel, atol=1e-4)


def test_config_refusals():
    moe = {"kind": "moe", "num_experts": 4}
    errors = [
        (dict(task="lm", ffn=moe | {"router": "base"}), "'base' leaks future tokens in training"),
        (dict(ffn=moe | {"router": "hash", "top_k": 2}), "one expert: top_k must be 1; got 2"),
        (dict(ffn=moe | {"router": "hash", "jitter_eps": 0.1}), "no learned router to jitter"),
        (dict(ffn=moe | {"router": "prototype", "top_k": 3}), "num_experts=4, top_k=3"),
        (dict(ffn=moe | {"router": "prototype", "top_k": 2, "second_policy": "random"}), "are not ranked"),
        (
            dict(ffn=moe | {"router": "hash"}, stack={"filters": {1: 0.5}}),
            r"router 'hash' at block 1 .* stack.filters \{1: 0.5\} shortens the rows before block 1",
        ),
        (
            dict(
                num_layers=3,
                ffn=moe | {"router": "hash"},
                stack={"token_learner": {"after_layer": 0, "num_tokens": 2}},
            ),
            "at block 1 .* learns tokens after block 0, from block 1",
        ),
    ]
    for kwargs, match in errors:
        with pytest.raises(ValueError, match=match):
            ModelConfig(**(TINY | kwargs))
    with pytest.raises(ValueError, match="pass vocab_size"):
        MoE(D, FF, 4, router="hash", key=jax.random.key(0))
    # a hash layer before the filter is fine: its rows are still tokens
    ModelConfig(**TINY, stack={"filters": {1: 0.5}, "layer_overrides": {0: {"ffn": moe | {"router": "hash"}}}})


def test_one_training_step_of_each_variant():
    """A classifier whose three blocks route by hash (the CLS row as NO_TOKEN), BASE
    and prototyping takes AdamW steps: finite losses, falling on one batch; the hash
    table stays as drawn (it is not trained). The language model's hash and prototyping
    layers train through the same code (the decoding test runs its forward)."""
    tokens = jax.random.randint(jax.random.key(9), (4, 8), 0, 13)
    mask = jnp.arange(8)[None, :] < jnp.array([[8], [8], [6], [8]])
    config = ModelConfig(
        **(TINY | {"num_layers": 3}),
        num_classes=2,
        stack={"layer_overrides": {0: _moe("hash"), 1: _moe("base"), 2: _moe("prototype", top_k=2)}},
    )
    classifier = build_model(config, key=jax.random.key(10))
    assert classifier.encoder.cls is not None
    state, losses = train_steps(classifier, tokens, mask)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    np.testing.assert_array_equal(state.drawn.encoder.blocks[0].ffn.table, classifier.encoder.blocks[0].ffn.table)


# ----------------------------------------------------------------------------- placement: GShard, Switch, GLaM


def test_experts_every_other_block_are_the_layer_overrides_written_out():
    # `ffn.every: 2` is shorthand for experts in blocks 0, 2, ... and a dense FFN between:
    # the same model, block for block and output for output, as the overrides written out
    sizes = dict(task="lm", vocab_size=19, num_layers=4, d_model=D, num_heads=2, max_len=8)
    moe = {"kind": "moe", "d_ff": FF, "num_experts": 4, "top_k": 2, "ffn": "gelu"}
    short = ModelConfig(**sizes, ffn=moe | {"every": 2, "dense_ffn": "geglu"})
    written = ModelConfig(
        **sizes, ffn={"kind": "geglu", "d_ff": FF}, stack={"layer_overrides": {0: {"ffn": moe}, 2: {"ffn": moe}}}
    )
    assert [short.layer(i).ffn.kind for i in range(4)] == ["moe", "geglu", "moe", "geglu"]
    a, b = build_model(short, key=jax.random.key(0)), build_model(written, key=jax.random.key(0))
    assert [type(x.ffn).__name__ for x in a.blocks] == ["MoE", "FeedForward", "MoE", "FeedForward"]
    # one model: the same modules, settings and arrays (so the same outputs)
    assert bool(eqx.tree_equal(a, b))
    # without dense_ffn the blocks between take the experts' kind and width
    plain = ModelConfig(**sizes, ffn=moe | {"every": 3})
    assert [plain.layer(i).ffn.kind for i in range(4)] == ["moe", "gelu", "gelu", "moe"]
    assert plain.layer(1).ffn.d_ff == FF and ModelConfig.from_dict(short.to_dict()) == short


def test_experts_every_k_blocks_refusals():
    sizes = dict(task="lm", vocab_size=19, num_layers=2, d_model=D, num_heads=2, max_len=8)
    with pytest.raises(ValueError, match="moe.dense_ffn .* set every > 1"):
        ModelConfig(**sizes, ffn={"kind": "moe", "dense_ffn": "geglu"})
    with pytest.raises(ValueError, match="moe.every must be >= 1; got 0"):
        ModelConfig(**sizes, ffn={"kind": "moe", "every": 0})
    with pytest.raises(ValueError, match=r"drop every from stack.layer_overrides of blocks \[1\]"):
        ModelConfig(**sizes, stack={"layer_overrides": {1: {"ffn": {"kind": "moe", "every": 2}}}})


def test_the_glam_experiment_is_the_papers_design_at_its_sizes(tmp_path):
    from jxformers.train import load_experiment

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(8):
        (texts / f"play{i}_gut.txt").write_bytes(b"to be or not to be " * 1100)
    for preset in ("tiny", "paper"):
        m = load_experiment("glam", [f"preset={preset}", f"data.settings.path={texts}"]).model
        experts, dense = m.layer(0).ffn, m.layer(1).ffn
        assert (experts.kind, experts.top_k, experts.ffn, dense.kind) == ("moe", 2, "gelu", "geglu")
        assert [m.layer(i).ffn.kind for i in range(m.num_layers)] == ["moe", "geglu"] * (m.num_layers // 2)
        assert (m.embedding.position, m.norm.kind, m.norm.placement, m.head.tie_embeddings) == (
            "t5",
            "rmsnorm",
            "pre",
            True,
        )
    # GLaM 64B/64E: 64 blocks (32 with experts), d_model 8192, 64 heads of 128, d_ff 32768, 64 experts
    sizes = (m.num_layers, m.d_model, m.num_heads, m.head_size(m.attention), experts.d_ff, experts.num_experts)
    assert sizes == (64, 8192, 64, 128, 32768, 64) and experts.capacity_factor == 2.0 and dense.d_ff == 32768
