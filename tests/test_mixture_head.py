"""The discretized mixture of logistics head (jxformers.nn.mixture): a distribution over
the 256 pixel values, its loss, sampling through generation, config errors, training."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jxformers.nn import ModelConfig, build_model
from jxformers.nn.generation import generate
from jxformers.nn.mixture import UNREACHABLE, discretized_logistic_log_probs
from jxformers.train.step import loss_and_metrics

TINY = dict(
    task="lm",
    vocab_size=257,
    num_layers=1,
    d_model=16,
    num_heads=2,
    max_len=12,
    output_head="mixture_of_logistics",
    mixture_components=3,
)


def _params(key, shape):
    k1, k2, k3 = jax.random.split(key, 3)
    return (
        jax.random.normal(k1, shape),
        jax.random.uniform(k2, shape, minval=-1.2, maxval=1.2),
        jax.random.uniform(k3, shape, minval=-8.0, maxval=1.0),
    )  # includes scales below the floor


def _logistic_cdf(x, mean, log_scale):
    return 0.5 * (1 + np.tanh((x - mean) / np.exp(max(log_scale, -7.0)) / 2))  # the sigmoid, without overflow


def test_probabilities_sum_to_one_and_match_the_cdf():
    w, mu, s = _params(jax.random.key(0), (5, 10))
    log_p = discretized_logistic_log_probs(w, mu, s)
    assert log_p.shape == (5, 256)
    np.testing.assert_allclose(jnp.exp(log_p).sum(-1), 1.0, atol=1e-5)
    # against the definition, in float64 numpy: sum_k pi_k (CDF(upper) - CDF(lower))
    w, mu, s = (np.asarray(x, np.float64)[0] for x in (w, mu, s))
    pi = np.exp(w - w.max()) / np.exp(w - w.max()).sum()
    for v in (0, 1, 77, 128, 254, 255):
        c = 2 * v / 255 - 1
        p = sum(
            pi[k]
            * (
                (1.0 if v == 255 else _logistic_cdf(c + 1 / 255, mu[k], s[k]))
                - (0.0 if v == 0 else _logistic_cdf(c - 1 / 255, mu[k], s[k]))
            )
            for k in range(10)
        )
        np.testing.assert_allclose(float(jnp.exp(log_p[0, v])), p, rtol=2e-4, atol=1e-7)


def test_a_peaked_component_puts_its_mass_in_its_bin():
    # mean at value 200's centre, the smallest scale: P(200) = sigma(h) - sigma(-h); finite gradients
    centre = 2 * 200 / 255 - 1

    def nll(mean):
        return -discretized_logistic_log_probs(jnp.zeros(1), mean[None], jnp.full(1, -7.0))[200]

    half_bin = (1 / 255) / math.exp(-7.0)  # the bin's half-width in units of the scale
    np.testing.assert_allclose(float(nll(jnp.float32(centre))), -math.log(math.tanh(half_bin / 2)), rtol=1e-3)
    assert np.isfinite(float(jax.grad(nll)(jnp.float32(centre + 0.5))))


def test_loss_is_minus_log_probability():
    model = build_model(TINY, key=jax.random.key(1))
    tokens = jnp.array([[256, 0, 3, 255, 128, 17, 200, 9]])
    batch = {"tokens": tokens, "mask": jnp.ones_like(tokens, bool), "loss_mask": jnp.ones_like(tokens, bool)}
    loss, logits = eqx.filter_jit(lambda m: (loss_and_metrics(m, batch, None, inference=True)[0], m(tokens[0])))(model)
    assert logits.shape == (8, 257) and float(logits[0, 256]) == np.float32(UNREACHABLE)
    np.testing.assert_allclose(jnp.exp(logits[:, :256]).sum(-1), 1.0, atol=1e-5)
    expected = -jnp.mean(logits[jnp.arange(7), tokens[0, 1:]])
    np.testing.assert_allclose(float(loss), float(expected), rtol=1e-5)


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampling_stays_among_pixel_values(use_cache):
    model = build_model(TINY | {"attention": "linear"}, key=jax.random.key(2))
    out = generate(model, jnp.array([256]), 11, key=jax.random.key(3), temperature=1.0, use_cache=use_cache)
    assert out.shape == (12,) and int(out[0]) == 256
    assert bool(jnp.all((out[1:] >= 0) & (out[1:] <= 255)))


def test_tiny_model_trains():
    model = build_model(TINY, key=jax.random.key(4))
    tokens = jnp.concatenate([jnp.full((4, 1), 256), jax.random.randint(jax.random.key(5), (4, 11), 100, 110)], 1)
    batch = {"tokens": tokens, "mask": jnp.ones_like(tokens, bool), "loss_mask": jnp.ones_like(tokens, bool)}
    optimizer = optax.adam(3e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state):
        loss, grads = eqx.filter_value_and_grad(lambda m: loss_and_metrics(m, batch, None)[0])(model)
        updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), state, loss

    losses = []
    for _ in range(30):
        model, state, loss = step(model, state)
        losses.append(float(loss))
    assert all(map(math.isfinite, losses))
    assert losses[-1] < losses[0] - 1.0  # values 100..109: ~log(10) nats reachable from ~log(256)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"vocab_size": 300}, "vocab_size must be 256"),
        ({"task": "classify", "num_classes": 2}, "serves tasks lm"),
        ({"mixture_components": 0}, "head.components must be >= 1"),
        (
            {"output_head": "softmax", "mixture_components": 5},
            r"head 'softmax': unknown setting\(s\) \['mixture_components'\]",
        ),
        ({"output_head": "gaussian"}, "head kind must be one of"),
    ],
)
def test_misuse_is_a_clear_error(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**(TINY | change))


def test_experiment_refuses_the_head_on_text():
    from jxformers.train import load_experiment

    with pytest.raises(ValueError, match="not pixels"):
        load_experiment("copy", ["preset=tiny", "model.output_head=mixture_of_logistics"])


def test_a_setting_lives_on_its_head_only():
    with pytest.raises(ValueError, match=r"head 'softmax': unknown setting\(s\) \['components'\]"):
        ModelConfig(task="lm", vocab_size=257, head={"kind": "softmax", "components": 5})
    config = ModelConfig(task="lm", vocab_size=257, head={"kind": "mixture_of_logistics", "components": 3})
    assert config.head.components == 3 and ModelConfig.from_dict(config.to_dict()) == config
