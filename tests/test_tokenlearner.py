"""TokenLearner and TokenFuser (Ryoo et al. 2021; jxformers/nn/tokenlearner.py): shapes,
maps and padding, the fuser's weights, a classifier that trains with them, and config
errors. Small shapes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close

from jxformers import ModelConfig, build_model
from jxformers.nn.tokenlearner import TokenFuser, TokenLearner

TL_SMALL = dict(task="classify", vocab_size=7, num_layers=3, d_model=16, num_heads=4, d_ff=24, max_len=24)


@pytest.mark.parametrize("maps", ["sigmoid", "softmax"])
def test_token_learner_shapes_maps_and_padding(maps):
    learner = TokenLearner(16, 5, bottleneck=8, maps=maps, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (13, 16))
    mask = jnp.arange(13) < 9
    weights = learner.maps(x, mask)
    assert weights.shape == (5, 13)
    assert float(jnp.abs(weights[:, 9:]).max()) == 0.0  # padded tokens get zero weight
    if maps == "softmax":  # the authors' v1.1: each map is a distribution over the real tokens
        assert_close(weights.sum(-1), jnp.ones(5))
    else:  # eq. 1: gamma = sigmoid, rho = the average over the (real) tokens
        assert bool(jnp.all((weights[:, :9] > 0) & (weights[:, :9] < 1)))
    tokens = learner(x, mask)
    assert tokens.shape == (5, 16)
    pooled = weights @ x / (9 if maps == "sigmoid" else 1)
    assert_close(tokens, pooled, atol=1e-5)
    # Whatever sits in the padded tokens, the learned tokens are the same.
    assert_close(learner(x.at[9:].set(100.0), mask), tokens, atol=1e-5)
    assert float(jnp.abs(learner(x, jnp.zeros(13, bool))).max()) == 0.0  # all padding: zeros, not NaN


def test_token_fuser_maps_tokens_back_by_sigmoid_weights_of_the_original():
    fuser = TokenFuser(16, 4, key=jax.random.key(2))
    tokens = jax.random.normal(jax.random.key(3), (4, 16))
    original = jax.random.normal(jax.random.key(4), (11, 16))
    out = fuser(tokens, original)
    assert out.shape == (11, 16)
    mixed = fuser.mix.weight @ tokens  # a k x k mixing over the tokens
    spread = jax.nn.sigmoid(fuser.remap(fuser.norm(original)))
    assert_close(out, spread @ mixed, atol=1e-5)
    # Position j of the output reads only original[j] (and the tokens).
    assert_close(fuser(tokens, original.at[3].add(1.0))[4:], out[4:])


@pytest.mark.parametrize("fuse, pooling", [(False, "cls"), (True, "mean")])
def test_classifier_with_token_learner_is_padding_safe_and_trains(fuse, pooling):
    small = TL_SMALL | dict(num_layers=2, d_model=8, num_heads=2, d_ff=16)
    config = ModelConfig(
        **small, pooling=pooling, token_learner={"after_layer": 0, "num_tokens": 3, "fuse": fuse, "bottleneck": 8}
    )
    model = build_model(config, key=jax.random.key(0))
    stage = model.encoder.token_learner
    assert len(stage.learners) == 1 and len(stage.fusers) == (1 if fuse else 0)
    tokens = jax.random.randint(jax.random.key(4), (8, 12), 1, 7)
    labels = jnp.any(tokens == 1, axis=1).astype(jnp.int32)
    mask = jnp.arange(12) < 9
    forward = eqx.filter_jit(lambda m, t, k: m(t, k))
    a = forward(model, tokens[0], mask)
    assert_close(forward(model, tokens[0].at[9:].set(2), mask), a, atol=1e-5)
    optimizer = optax.adam(3e-3)

    def loss_fn(model):
        logits = jax.vmap(lambda t: model(t, mask))(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    model2, opt_state, loss, grads = step(model, opt_state)
    assert np.isfinite(float(loss))
    learner_grads = jax.tree.leaves(grads.encoder.token_learner)
    assert learner_grads and all(bool(jnp.all(jnp.isfinite(g))) for g in learner_grads)
    assert max(float(jnp.abs(g).max()) for g in learner_grads) > 0  # the maps are trained
    assert float(step(model2, opt_state)[2]) < float(loss)


@pytest.mark.parametrize(
    "extra, word",
    [
        (dict(task="lm"), "causal"),
        (dict(token_learner={"after_layer": 2, "num_tokens": 3}), "after_layer"),
        (dict(token_learner={"num_tokens": 3}), "after_layer"),
        (dict(token_learner={"after_layer": 0, "num_tokens": 0}), "num_tokens"),
        (dict(token_learner={"after_layer": 0, "num_tokens": 3, "maps": "relu"}), "maps"),
        (dict(token_learner={"after_layer": 0, "num_tokens": 3, "where": 1}), "where"),
        (dict(position="rope"), "position"),
        (dict(filters={1: 0.5}), "filters"),
    ],
)
def test_token_learner_config_errors(extra, word):
    values = TL_SMALL | {"token_learner": {"after_layer": 0, "num_tokens": 3}} | extra
    with pytest.raises(ValueError, match=word):
        ModelConfig(**values)
