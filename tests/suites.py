"""The generic suites: properties every registered attention must have, written once and
instantiated for any list of names (tests/test_generic.py for the package's own
attentions, tests/test_toy_attention.py for one registered by a test).

A suite is a class whose test methods take `name` (and `hp`, one variant's hyper-
parameters); its `pytest_generate_tests` fills them from the class's `attention_names`
and the row of tests/attention_facts.py, keeping only the attentions with the
capabilities a test declares through `@needs(...)`. Subclass with `attention_names`
set; the `jit_variants` case is a `chex.TestCase` (chex's variants need one).
"""

from __future__ import annotations

import functools

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from attention_facts import FACTS, GROWTH_CHECKS
from conftest import JittedOps, assert_close, qkv
from hypothesis import given
from hypothesis import strategies as st

import jxformers
from jxformers import ModelConfig, build_model, registry
from jxformers.ops._priors import PRIOR_OPTIONS
from jxformers.ops._scores import SCORE_OPTIONS
from jxformers.xla_cost import compile_with_cost

# One odd length (tails of blocks and chunks) for most properties; the dense-mask
# equivalence also runs a length that divides evenly. Each length is a compilation.
LENGTH = st.just(37)
LENGTHS = st.sampled_from([24, 37])
SEEDS = st.integers(0, 2**16)
HEADS, KV_HEADS, D_K, D_V = 4, 2, 8, 6  # conftest.qkv's defaults
ops = JittedOps()  # the references, compiled whole (eagerly every primitive compiles alone)


def needs(**capabilities):
    """Run the decorated test only for attentions whose spec has these flags
    (`supports_causal=True`, `decodes=True`, `exact=True`, ...)."""

    def mark(fn):
        fn.capabilities = capabilities
        return fn

    return mark


def facts(name):
    if name not in FACTS:
        raise KeyError(f"{name!r} has no row in tests/attention_facts.py FACTS; add one (its small test variants)")
    return FACTS[name]


def selected(names, **capabilities):
    return [n for n in names if all(getattr(registry.get(n), c) == want for c, want in capabilities.items())]


def case_id(name, hp):
    return "-".join([name, *(f"{k}={v}" for k, v in hp.items())])


def cases(names, **capabilities):
    """(name, hyper-parameters) for every variant of every named attention with these capabilities."""
    return [(name, dict(hp)) for name in selected(names, **capabilities) for hp in facts(name).variants]


def causal_modes(name):
    spec = registry.get(name)
    return [True] if spec.causal_only else [False, True] if spec.supports_causal else [False]


def score_options(hyper_parameters, arrays) -> dict:
    """The score options and priors (`jxformers.ops._scores`, `_priors`) an exact
    attention's variant uses, for its softmax reference."""
    return {n: x for n, x in (*hyper_parameters.items(), *arrays.items()) if n in SCORE_OPTIONS + PRIOR_OPTIONS}


def first_variant(name):
    return dict(facts(name).variants[0])


@functools.cache
def _compiled(name, hp_items, causal):
    bound = registry.bind(name, **dict(hp_items))

    def f(q, k, v, kv_mask, key):
        arrays = bound.init_arrays(key, heads=q.shape[1], kv_heads=k.shape[1], d_k=k.shape[2], d_v=v.shape[2])
        return bound(q, k, v, arrays=arrays, causal=causal, kv_mask=kv_mask)

    return jax.jit(f)


def run(name, hp, q, k, v, *, causal=None, kv_mask=None, seed=0):
    """The registered op under jit (one compilation per shape keeps the suites fast);
    `causal` None: non-causal, unless the attention is causal only."""
    causal = registry.get(name).causal_only if causal is None else causal
    return _compiled(name, tuple(sorted(hp.items())), causal)(q, k, v, kv_mask, jax.random.key(seed + 1))


class _Parametrized:
    """Fills `name` / `name, hp` from `attention_names` (see the module docstring)."""

    attention_names: tuple[str, ...] = ()

    def pytest_generate_tests(self, metafunc):
        capabilities = getattr(metafunc.function, "capabilities", {})
        if "hp" in metafunc.fixturenames:
            found = cases(self.attention_names, **capabilities)
            metafunc.parametrize("name,hp", found, ids=[case_id(n, hp) for n, hp in found])
        elif "name" in metafunc.fixturenames:
            metafunc.parametrize("name", selected(self.attention_names, **capabilities))


class AttentionSuite(_Parametrized):
    """The op-level properties, for every variant of every attention named."""

    def test_has_test_facts(self, name):
        assert name in FACTS, f"add a row for {name!r} to tests/attention_facts.py FACTS"
        assert FACTS[name].variants, f"{name}: give at least one variant (maybe {{}})"

    @needs(exact=True)
    def test_exact_attention_has_an_independent_mask(self, name):
        assert facts(name).mask is not None, f"{name} is exact: give its dense mask builder (tests/masks.py) in FACTS"

    @given(n=LENGTH, seed=SEEDS)
    def test_shape_dtype_finite(self, name, hp, n, seed):
        q, k, v = qkv(seed, n)
        for causal in causal_modes(name):
            out = run(name, hp, q, k, v, causal=causal)
            chex.assert_shape(out, (n, HEADS, D_V))
            chex.assert_type(out, jnp.float32)
            chex.assert_tree_all_finite(out)

    @needs(supports_causal=True)
    @given(n=LENGTH, seed=SEEDS, data=st.data())
    def test_causal_never_reads_the_future(self, name, hp, n, seed, data):
        i = data.draw(st.integers(0, n - 2), label="position")
        q, k, v = qkv(seed, n)
        k2 = k.at[i + 1 :].set(jax.random.normal(jax.random.key(seed + 7), k[i + 1 :].shape))
        v2 = v.at[i + 1 :].set(100.0)
        a = run(name, hp, q, k, v, causal=True)
        b = run(name, hp, q, k2, v2, causal=True)
        assert_close(a[: i + 1], b[: i + 1], atol=1e-5)
        assert not np.allclose(a[i + 1 :], b[i + 1 :]), "the perturbation should change later outputs"
        # Non-finite future too (a future NaN times a zero weight must not be 0 * NaN),
        # in the queries as well (shared-QK attentions take their keys from them).
        q3, k3, v3 = q.at[i + 1 :].set(jnp.nan), k.at[i + 1 :].set(jnp.inf), v.at[i + 1 :].set(jnp.nan)
        c = run(name, hp, q3, k3, v3, causal=True)
        chex.assert_tree_all_finite(c[: i + 1])
        assert_close(a[: i + 1], c[: i + 1], atol=1e-5)

    @given(seed=SEEDS, data=st.data())
    def test_a_non_finite_key_or_value_reaches_exactly_the_rows_that_read_it(self, name, hp, seed, data):
        # n = 37: test_shape_dtype_finite's compiled forward (no new compilation).
        n = 37
        j = data.draw(st.integers(0, n - 1), label="position")
        q, k, v = qkv(seed, n)
        a = run(name, hp, q, k, v)
        # The rows that read v_j: those a huge change of it moves (a weight down to ~1e-37 shows).
        reads_v = ~np.all(np.asarray(run(name, hp, q, k, v.at[j].add(1e30)) == a), axis=(1, 2))
        nan_v = ~np.all(np.isfinite(np.asarray(run(name, hp, q, k, v.at[j].set(jnp.nan)))), axis=(1, 2))
        # NaN rows beyond those: a pattern's masked slot met NaN (0 * NaN); fewer: a silent answer.
        np.testing.assert_array_equal(nan_v, reads_v, err_msg=f"NaN rows vs rows reading v[{j}]")
        reads_k = ~np.all(np.asarray(run(name, hp, q, k.at[j].add(3.0), v)) == np.asarray(a), axis=(1, 2))
        nan_k = ~np.all(np.isfinite(np.asarray(run(name, hp, q, k.at[j].set(jnp.nan), v))), axis=(1, 2))
        # Every row a change of k_j moves must be NaN (an empty-row guard read NaN as 0 before).
        assert not np.any(reads_k & ~nan_k), f"rows {np.flatnonzero(reads_k & ~nan_k)} read k[{j}] = NaN silently"

    @needs(supports_kv_mask=True)
    @given(n=LENGTH, seed=SEEDS, data=st.data())
    def test_padded_keys_never_change_real_outputs(self, name, hp, n, seed, data):
        real_len = data.draw(st.integers(n // 2, n - 1), label="real length")
        q, k, v = qkv(seed, n)
        kv_mask = jnp.arange(n) < real_len
        k2 = k.at[real_len:].set(jax.random.normal(jax.random.key(seed + 3), k[real_len:].shape) * 10)
        v2 = v.at[real_len:].set(1e4)
        # Non-finite padding too: a masked key times a zero weight must not be 0 * NaN.
        k3, v3 = k.at[real_len:].set(jnp.inf), v.at[real_len:].set(jnp.nan)
        for causal in causal_modes(name):
            a = run(name, hp, q, k, v, causal=causal, kv_mask=kv_mask)
            b = run(name, hp, q, k2, v2, causal=causal, kv_mask=kv_mask)
            c = run(name, hp, q, k3, v3, causal=causal, kv_mask=kv_mask)
            chex.assert_tree_all_finite(a)
            assert_close(a[:real_len], b[:real_len], atol=1e-5)
            chex.assert_tree_all_finite(c[:real_len])
            assert_close(a[:real_len], c[:real_len], atol=1e-5)

    @needs(supports_kv_mask=True)
    def test_all_keys_padded_gives_zeros_not_nan(self, name, hp):
        n = 37  # test_padded_keys_never_change_real_outputs's length: the same compiled forward
        q, k, v = qkv(1, n)
        out = run(name, hp, q, k, v, kv_mask=jnp.zeros((n,), bool))
        assert_close(out, jnp.zeros_like(out), atol=0)
        g = jax.jit(jax.grad(lambda q: run(name, hp, q, k, v, kv_mask=jnp.zeros((n,), bool)).sum()))(q)
        chex.assert_tree_all_finite(g)

    @needs(exact=True)
    @given(n=LENGTHS, seed=SEEDS, padded=st.booleans())
    def test_exact_equals_softmax_with_the_dense_mask(self, name, hp, n, seed, padded):
        bound = registry.bind(name, **hp)
        q, k, v = qkv(seed, n)
        kv_mask = (jnp.arange(n) < n - 5) if padded else None
        arrays = bound.init_arrays(jax.random.key(seed + 1), heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)
        options = score_options(bound.hyper_parameters, arrays)  # the same options on the reference

        def attend(m, values):
            keys = jnp.repeat(k, values.shape[1] // k.shape[1], axis=1)  # values may be per query head
            return ops.softmax_attention(q, keys, values, mask=jnp.asarray(m), kv_mask=kv_mask, **options)

        for causal in causal_modes(name):
            out = run(name, hp, q, k, v, causal=causal, kv_mask=kv_mask, seed=seed)
            expected = v
            for m in facts(name).mask(n, bound.hyper_parameters, arrays, causal):
                expected = m(attend, expected) if callable(m) else attend(m, expected)
            assert_close(out, expected, atol=2e-5)

    def test_bf16_close_to_float32(self, name, hp):
        q, k, v = qkv(2, 37)
        for causal in causal_modes(name):
            full = run(name, hp, q, k, v, causal=causal)
            half = run(name, hp, *(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=causal)
            chex.assert_type(half, jnp.bfloat16)
            assert_close(half, full, atol=6e-2, rtol=6e-2)

    @needs(decodes=True)
    def test_decoding_token_by_token_equals_the_causal_forward(self, name, hp):
        n = 24
        q, k, v = qkv(3, n)
        bound = registry.bind(name, **hp)
        arrays = bound.init_arrays(jax.random.key(5), heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)
        parallel = run(name, hp, q, k, v, causal=True, seed=4)  # under jit (eagerly: seconds a case), same arrays
        state = bound.init_state(max_len=n, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V, arrays=arrays)

        @jax.jit
        def step(q_t, k_t, v_t, state):
            return bound.decode_step(q_t, k_t, v_t, state, arrays=arrays)

        for t in range(n):
            out, state = step(q[t], k[t], v[t], state)
            assert_close(out, parallel[t], atol=2e-5, rtol=2e-4)
        assert int(state.length) == n

    @needs(supports_cross=True)
    def test_cross_attention_lengths(self, name):
        q, k, v = qkv(4, 10, kv_len=27)
        out = run(name, first_variant(name), q, k, v)
        chex.assert_shape(out, (10, HEADS, D_V))
        chex.assert_tree_all_finite(out)

    @needs(supports_cross=False)
    def test_self_attention_only_rejects_cross_lengths(self, name):
        q, k, v = qkv(4, 10, kv_len=27)
        with pytest.raises(ValueError, match="q_len"):
            run(name, first_variant(name), q, k, v)

    @needs(supports_kv_mask=True)
    def test_kv_mask_of_the_wrong_shape_is_refused(self, name):
        q, k, v = qkv(0, 12)
        with pytest.raises(ValueError, match="kv_mask"):
            run(name, first_variant(name), q, k, v, kv_mask=jnp.ones((5,), bool))

    def test_mismatched_feature_sizes_are_refused(self, name):
        q, k, v = qkv(0, 12)
        with pytest.raises(ValueError, match="d_k"):
            run(name, first_variant(name), q, k[:, :, :4], v)

    def test_error_cases_name_the_argument(self, name):
        q, k, v = qkv(0, 37)
        for bad, word in facts(name).errors:
            with pytest.raises(ValueError, match=word):
                run(name, first_variant(name) | dict(bad), q, k, v)

    def test_flops_grow_as_its_cost_class_says(self, name):
        growth = facts(name).growth
        if growth is None:
            pytest.skip(f"{name}: no cost class in FACTS")
        short, long, low, high = GROWTH_CHECKS[growth.kind]
        for causal in [c for c in causal_modes(name) if c in growth.causal]:
            ratio = flops(name, growth, long, causal) / flops(name, growth, short, causal)
            assert low < ratio < high, f"{name} (causal={causal}): FLOPs grew x{ratio:.2f} for x{long // short} length"


def flops(name, growth, n, causal, heads=2, d=16):
    """XLA-counted FLOPs of the op alone at length n (its arrays are made outside)."""
    bound = registry.bind(name, **dict(growth.at_length(n)))
    x = jax.ShapeDtypeStruct((n, heads, d), jnp.float32)
    arrays = jax.eval_shape(
        lambda key: bound.init_arrays(key, heads=heads, kv_heads=heads, d_k=d, d_v=d), jax.random.key(0)
    )
    _, cost = compile_with_cost(lambda q, k, v, arrays: bound(q, k, v, arrays=arrays, causal=causal), x, x, x, arrays)
    return cost.flops


def _one_key_per_query(name, bound, arrays, causal) -> bool:
    """Whether the attention's dense reference mask (if FACTS has one) lets each query see one key."""
    mask = facts(name).mask
    if mask is None:
        return False
    built = mask(24, bound.hyper_parameters, arrays, causal)
    if any(callable(m) for m in built):  # a composed step (axial's causal form) reaches several keys
        return False
    return all(int(np.asarray(m).sum(-1).max()) <= 1 for m in built)


def _op_of(name, hp):
    """(q, k, v -> output, spec, bound op, arrays): the op with the arrays `run` draws
    for seed 0, causal when it can be."""
    spec = registry.get(name)
    bound = spec.bind(**hp)
    arrays = bound.init_arrays(jax.random.key(1), heads=HEADS, kv_heads=KV_HEADS, d_k=D_K, d_v=D_V)

    def f(q, k, v):
        return bound(q, k, v, arrays=arrays, causal=spec.supports_causal)

    return f, spec, bound, arrays


def jit_variants(names) -> type[chex.TestCase]:
    """A chex.TestCase checking each variant under jit: vmap over a batch, finite
    gradients that are non-zero where the op reads its input; and, for each attention's
    first variant, that the op run eagerly (op by op, as in a notebook) equals its jit."""
    found = cases(names)
    firsts = [(n, first_variant(n)) for n in dict.fromkeys(n for n, _ in found)]

    class JitVmapGrad(chex.TestCase):
        @chex.variants(without_jit=True)
        @parameterized.named_parameters(*[(case_id(n, hp), n, hp) for n, hp in firsts])
        def test_eager_equals_jit(self, name, hp):
            # One variant per attention: eager execution compiles every primitive
            # separately (seconds per op), and what it could break (Python control flow
            # on values) does not depend on the hyper-parameters' values.
            q, k, v = qkv(0, 24)
            reference = run(name, hp, q, k, v, causal=registry.get(name).supports_causal)
            chex.assert_trees_all_close(self.variant(_op_of(name, hp)[0])(q, k, v), reference, atol=1e-5, rtol=1e-5)

        @parameterized.named_parameters(*[(case_id(n, hp), n, hp) for n, hp in found])
        def test_jit_vmap_grad(self, name, hp):
            q, k, v = qkv(0, 24)
            f, spec, bound, arrays = _op_of(name, hp)

            out = run(name, hp, q, k, v, causal=spec.supports_causal)
            qb, kb, vb = (jnp.stack([x, 0.5 * x[::-1]]) for x in (q, k, v))

            # vmap and grad in one compiled program: the gradient of a sum over the batch
            # is, at example 0, the gradient of f(q, k, v) alone.
            def loss(qb, kb, vb):
                batched = jax.vmap(f)(qb, kb, vb)
                return jnp.sum(batched**2), batched

            batch_grads, batched = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(qb, kb, vb)
            chex.assert_shape(batched, (2, *out.shape))
            chex.assert_trees_all_close(batched[0], out, atol=1e-5, rtol=1e-5)
            other = run(name, hp, qb[1], kb[1], vb[1], causal=spec.supports_causal)
            chex.assert_trees_all_close(batched[1], other, atol=1e-5, rtol=1e-5)
            grads = tuple(g[0] for g in batch_grads)
            chex.assert_trees_all_equal_shapes(grads, (q, k, v))
            chex.assert_tree_all_finite(grads)
            used = (0, 1, 2) if spec.content_based else (2,)  # FNet / Synthesizer ignore q, k
            if spec.shared_qk:  # Reformer's shared QK takes its keys from q: k must not be read at all
                assert float(jnp.abs(grads[1]).max()) == 0, f"{name}: shared-QK attention read k"
                used = tuple(i for i in used if i != 1)
            if _one_key_per_query(name, bound, arrays, spec.supports_causal):
                # Every softmax row holds one key, so its weight is 1 whatever q and k are:
                # their gradients are exactly zero (e.g. a band of width 0).
                for i in (0, 1):
                    assert float(jnp.abs(grads[i]).max()) == 0, f"{name}: one key per query, yet argument {i} moved"
                used = (2,)
            for i in used:
                assert float(jnp.abs(grads[i]).max()) > 0, f"{name}: zero gradient for argument {i}"

    return JitVmapGrad


# ----------------------------------------------------------------------------- tiny models

SEQ = 21
TINY = dict(vocab_size=31, num_layers=2, d_model=16, num_heads=4, kv_heads=2, d_ff=24, max_len=40)


def model_config(name, task, **extra):
    """A tiny ModelConfig for `name` with its first test variant."""
    return ModelConfig(task=task, attention=name, attention_kwargs=first_variant(name), **TINY | extra)


def suite_config(name, task, **extra):
    """`model_config` with one layer, for the per-attention model suite: what it checks
    (forward, gradients, padding, causality, decoding) lives in the attention, and the
    stacking of layers is tested once, attention-agnostically, with two layers
    (tests/test_models.py, tests/test_nn.py). Each layer is compiled separately, so one
    layer halves the suite's compile time."""
    return model_config(name, task, **{"num_layers": 1} | extra)


def tokens(seed, n=SEQ):
    return jax.random.randint(jax.random.key(seed), (n,), 0, TINY["vocab_size"])


@eqx.filter_jit
def forward(model, x, mask=None):
    return model(x, mask)


@eqx.filter_jit
def forward_and_grad(model, x, mask=None):
    """(model(x, mask), gradient of a loss on it): one compilation where a test needs
    both (the forward is part of the gradient's program anyway)."""

    def loss(params, rest):
        out = eqx.combine(params, rest)(x, mask)
        return jnp.mean(jnp.square(out)), out

    params, rest = eqx.partition(model, jxformers.nn.trainable(model))
    grads, out = jax.grad(loss, has_aux=True)(params, rest)
    return out, grads


def loss_grad(model, x, mask=None):
    return forward_and_grad(model, x, mask)[1]


def finite_grads(grads):
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    return leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)


def decode_all(model, x):
    @eqx.filter_jit
    def run_all(model, x):
        def step(state, token):
            logits, state = model.decode_step(token, state)
            return state, logits

        return jax.lax.scan(step, model.init_decode_state(x.shape[0]), x)[1]

    return run_all(model, x)


def decode_op(bound, q, k, v, arrays):
    """A bound attention's causal decoding, token by token (jitted scan): `[n, heads, d_v]`."""

    @jax.jit
    def run_all(q, k, v, arrays):
        def step(state, qkv):
            out, state = bound.decode_step(*qkv, state, arrays=arrays)
            return state, out

        state = bound.init_state(max_len=q.shape[0], kv_heads=k.shape[1], d_k=k.shape[2], d_v=v.shape[2], arrays=arrays)
        return jax.lax.scan(step, state, (q, k, v))[1]

    return run_all(q, k, v, arrays)


class ModelSuite(_Parametrized):
    """Each attention inside tiny models: an encoder classifier (forward, grad, padding)
    and, when causal, a language model (causality, training gradients, decoding)."""

    @needs(causal_only=False)
    def test_classifier_forward_grad_and_padding(self, name):
        model = build_model(suite_config(name, "classify", **facts(name).model), key=jax.random.key(0))
        x = tokens(1)
        # One compiled program (a mask is always given) for the three calls: an all-real
        # mask, a padded one, and the padded one with other tokens in the padding.
        logits, grads = forward_and_grad(model, x, jnp.ones((SEQ,), bool))
        chex.assert_shape(logits, (2,))
        chex.assert_type(logits, jnp.float32)
        chex.assert_tree_all_finite(logits)
        assert finite_grads(grads)
        # Padding never leaks: whatever sits in padded positions, the logits are the same.
        mask = jnp.arange(SEQ) < 15
        other = jnp.where(mask, x, tokens(2))
        padded, grads = forward_and_grad(model, x, mask)
        assert_close(padded, forward_and_grad(model, other, mask)[0], atol=1e-5)
        assert finite_grads(grads)

    @needs(supports_causal=True)
    def test_language_model_is_causal_and_trains(self, name):
        model = build_model(suite_config(name, "lm"), key=jax.random.key(0))
        x = tokens(3)
        logits, grads = forward_and_grad(model, x)
        chex.assert_shape(logits, (SEQ, TINY["vocab_size"]))
        changed = forward_and_grad(model, x.at[12:].set(tokens(4)[12:]))[0]
        assert_close(changed[:12], logits[:12], atol=1e-5)
        assert not bool(jnp.allclose(changed[12:], logits[12:]))
        assert finite_grads(grads)

    @needs(supports_causal=False)
    def test_language_model_needs_causal_attention(self, name):
        with pytest.raises(ValueError, match="causal"):
            model_config(name, "lm")

    @needs(causal_only=True)
    def test_a_causal_only_attention_refuses_an_encoder(self, name):
        with pytest.raises(ValueError, match="causal only.*set model.causal: true"):
            model_config(name, "classify")

    @needs(decodes=True)
    def test_decoding_parity_with_the_parallel_forward(self, name):
        model = build_model(suite_config(name, "lm", position="rope"), key=jax.random.key(0))
        x = tokens(5)
        assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)


def train_steps(model, tokens, mask, steps=3, lr=3e-3):
    """(the train state, the losses) after `steps` AdamW steps (lr `lr`) of `model` on one
    batch `tokens [batch, seq]` (a language model's next-token loss, or a classifier's on
    alternating labels)."""
    import optax

    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    params, drawn, static = split_model(model)
    optimizer = optax.adamw(lr)
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    batch = {"tokens": tokens, "mask": mask, "loss_mask": mask}
    if getattr(model, "encoder", None) is not None:  # a classifier
        batch = {"tokens": tokens, "mask": mask, "label": jnp.arange(tokens.shape[0]) % 2}
    step = jax.jit(make_train_step(static, optimizer, grad_accum=1))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def train_losses(model, *, steps: int = 4, vocab: int = 11, lr: float = 3e-3):
    """A language model's losses over `steps` AdamW steps on one batch of 4 x 8 tokens
    below `vocab` (the one-training-step smoke tests), and the trained parameters."""
    tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, vocab)
    state, losses = train_steps(model, tokens, jnp.ones((4, 8), bool), steps=steps, lr=lr)
    return losses, state.params


def command_line_round_trip(tmp_path, capsys, model: dict, *, steps: int = 8) -> dict[int, float]:
    """A whole model through the command line (tests/test_train.py's tiny copy task with
    `model` as its model section): trains `steps` steps, loses its last checkpoint (as if
    killed after step steps / 2's) and resumes to the same losses, evaluates, and
    generates 3 tokens after a 2-token prompt. Returns the losses by step."""
    import json
    import shutil

    from test_train import losses, write_config

    from jxformers.tools import cli

    config = write_config(tmp_path, model=model, train={"steps": steps, "eval_every": steps})
    run = str(tmp_path / "run")
    train = ["train", str(config), "--workdir", run, "--no-progress", "--set", "checkpoint.async_save=false"]
    assert cli.main(train) == 0
    straight = losses(run)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(steps))
    assert cli.main(train) == 0
    assert losses(run) == straight
    capsys.readouterr()
    assert cli.main(["eval", str(config), "--workdir", run]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == steps
    assert cli.main(["generate", str(config), "--workdir", run, "--prompt", "1 3", "--steps", "3"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()[-1].split()) == 5
    return straight


def mesh_trains_like_one_device(*configs: dict, vocab: int, length: int) -> None:
    """Each language model config trains 3 AdamW steps on a 2x2x2 mesh of simulated
    devices (its own process) with the losses of one device, on one batch of 8 padded
    rows of `length` tokens below `vocab` (`mesh_runs.train_both`)."""
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + f"""
    from mesh_runs import lm_batch, same_losses, train_both

    batch = lm_batch(length={length}, vocab={vocab}, shortest={length} // 2)
    for config in {list(configs)!r}:
        same_losses(train_both(config, batch), learns=False)
    """
    )
