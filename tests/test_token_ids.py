"""Token ids outside a model's vocabulary are never answered silently (JAX's indexing
would clamp 20 to the last row of a 16-row table and wrap -1): a ValueError naming them
where the ids are concrete (eager calls, `generate`'s prompt), and NaN where they are
traced (jit, vmap), so the output cannot pass for another token's."""

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from jxformers import ModelConfig, build_model, generate
from jxformers.nn.layers import lookup

VOCAB = 16


@pytest.fixture(scope="module")
def lm():
    config = ModelConfig(task="lm", vocab_size=VOCAB, num_layers=1, d_model=16, num_heads=2, max_len=16)
    return build_model(config, key=jax.random.key(0))


@pytest.mark.parametrize("bad", [VOCAB, 20, -1])
def test_eager_calls_refuse_ids_outside_the_vocabulary(lm, bad):
    with pytest.raises(ValueError, match=rf"token ids must be in \[0, {VOCAB}\).*\[{bad}\] at 1 position"):
        lm(jnp.array([1, bad, 3]))


def test_traced_calls_turn_the_rows_of_such_ids_to_nan(lm):
    good = jnp.array([[1, 2, 3], [1, 2, 3]])
    for call in (jax.jit(jax.vmap(lm)), jax.vmap(lm)):
        assert bool(jnp.isfinite(call(good)).all())
        out = call(jnp.array([[1, 2, 3], [1, 20, 3]]))
        assert bool(jnp.isfinite(out[0]).all())  # the other example is untouched
        assert bool(jnp.isnan(out[1, 1]).all())  # the row reading id 20 is NaN, not id 15's answer


def test_lookup_is_the_table_inside_and_nan_outside():
    table = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(lookup(table, jnp.array([0, 3])), table[jnp.array([0, 3])])
    got = jax.jit(lookup)(table, jnp.array([1, 4, -1]))
    np.testing.assert_array_equal(got[0], table[1])
    assert bool(jnp.isnan(got[1:]).all())


def test_generate_refuses_prompt_ids_outside_the_vocabulary_and_top_k_beyond_it(lm):
    key = jax.random.key(1)
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 16\).*\[99\]"):
        generate(lm, jnp.array([1, 99]), 3, key=key)
    with pytest.raises(ValueError, match=r"top_k must be <= the vocabulary \(16 logits\); got 17"):
        generate(lm, jnp.array([1, 2]), 3, key=key, top_k=17)
    assert generate(lm, jnp.array([1, 2]), 3, key=key, top_k=16).shape == (5,)


@pytest.mark.parametrize(
    "tokens,match",
    [
        (jnp.ones((2, 5), jnp.int32), r"shape \[seq\]; got shape \(2, 5\).*jax.vmap"),
        (jnp.ones((5,), jnp.float32), "integer ids; got dtype float32"),
    ],
)
def test_a_batch_without_vmap_and_float_ids_are_refused_by_name(lm, tokens, match, monkeypatch):
    # As a user meets it: without this suite's jaxtyping runtime checks, which would
    # refuse the call first with a TypeCheckError.
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    classifier = build_model(
        ModelConfig(
            task="classify", vocab_size=VOCAB, num_classes=2, num_layers=1, d_model=16, num_heads=2, max_len=16
        ),
        key=jax.random.key(0),
    )
    for model in (lm, classifier):
        with pytest.raises(ValueError, match=match):
            model(tokens)
