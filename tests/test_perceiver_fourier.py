"""Perceiver's Fourier position features (Jaegle, Gimeno, Brock, Zisserman, Vinyals &
Carreira 2021, "Perceiver: General Perception with Iterative Attention", section 2,
"Position encodings"; `jxformers.nn.perceiver.fourier_features`): [x_d, sin(f_k π x_d),
cos(f_k π x_d)] with f_k linearly spaced from 1 to μ/2 and x_d in [-1, 1], against numpy
for a sequence and an image grid; in the model, concatenated to each input row before
the cross-attend (its norm and K/V projections read the wider rows), padding still
unread, a training step through the config (finite), and the refusals.

Mutations the tests were seen to fail (by hand, once): positions scaled to [0, 1]; the
bands spaced up to μ instead of μ/2; the raw position left out; the image grid read
column-major.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import finite_grads, train_steps

from jxformers import ModelConfig, build_model
from jxformers.nn.perceiver import fourier_features

CONFIG = dict(
    task="classify", vocab_size=13, num_classes=2, num_layers=1, d_model=8, num_heads=2, max_len=16,
    embedding={"position": "none"}, head="mean",
)  # fmt: skip


def _features(coords, sizes, bands, max_freq):
    """numpy: coords [n, D] integer grid coordinates -> the paper's features."""
    x = np.stack([-1 + 2 * coords[:, d] / (sizes[d] - 1) for d in range(len(sizes))], -1)
    raw, sines, cosines = [x], [], []
    for d in range(len(sizes)):
        for f in np.linspace(1, max_freq[d] / 2, bands):
            sines.append(np.sin(f * math.pi * x[:, d]))
            cosines.append(np.cos(f * math.pi * x[:, d]))
    return np.concatenate([*raw, np.stack(sines, -1), np.stack(cosines, -1)], -1)


def test_fourier_features_of_a_sequence_are_the_papers():
    got = fourier_features(jnp.arange(16), grid=(16,), bands=4, max_freq=(16.0,))
    want = _features(np.arange(16)[:, None], (16,), 4, (16,))
    assert got.shape == (16, 1 * (2 * 4 + 1))
    assert_close(got, want, atol=1e-5)
    assert float(got[0, 0]) == -1.0 and float(got[-1, 0]) == 1.0  # x in [-1, 1], ends included


def test_fourier_features_of_an_image_grid_read_row_by_row():
    h, w = 3, 5
    got = fourier_features(jnp.arange(h * w), grid=(h, w), bands=3, max_freq=(6.0, 10.0))
    rows, cols = np.divmod(np.arange(h * w), w)
    want = _features(np.stack([rows, cols], -1), (h, w), 3, (6.0, 10.0))
    assert got.shape == (h * w, 2 * (2 * 3 + 1))
    assert_close(got, want, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return build_model(
        CONFIG | {"stack": {"kind": "perceiver", "num_latents": 4, "fourier_bands": 3}}, key=jax.random.key(0)
    )


def test_the_model_concatenates_the_features_to_its_input(model):
    encoder = model.encoder
    assert encoder.input_norms[0].weight.shape == (8 + 7,)  # d_model + 1 * (2K + 1)
    assert encoder.cross[0].attention.k_proj.weight.shape == (8, 15)
    tokens = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    n = tokens.shape[0]
    features = jnp.asarray(_features(np.arange(n)[:, None], (16,), 3, (16,)), jnp.float32)

    @eqx.filter_jit
    def run(model):
        encoder = model.encoder
        x = encoder.embedding(tokens, jnp.arange(n))
        z = encoder.cross[0](encoder.latents, encoder.input_norms[0](jnp.concatenate([x, features], -1)))
        for block in encoder.tower:
            z = block(z)
        padded, mask = jnp.concatenate([tokens, jnp.full((3,), 7)]), jnp.arange(n + 3) < n
        return encoder.norm(z), encoder(tokens)[0], model(tokens), model(tokens[::-1]), model(padded, mask)

    by_hand, got, out, reversed_out, padded_out = run(model)
    assert_close(got, by_hand, atol=1e-5)
    assert float(jnp.abs(out - reversed_out).max()) > 1e-6  # positions count: another order reads differently
    assert_close(padded_out, out, atol=1e-5)  # padding stays unread


def test_a_fourier_perceiver_trains_through_the_config(model):
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, 13)
    state, losses = train_steps(model, tokens, jnp.ones((2, 8), bool), steps=1)
    assert np.isfinite(losses[0]) and finite_grads(state.params)


@pytest.mark.parametrize(
    ("stack", "embedding", "match"),
    [
        ({"fourier_bands": 2}, {"position": "sinusoidal"}, "embedding.position 'none'.*'sinusoidal'"),
        ({"fourier_bands": 2, "fourier_grid": [3, 4]}, {"position": "none"}, r"multiply to max_len \(16\).*\(3, 4\)"),
        ({"fourier_bands": 2, "fourier_max_freq": [1.0]}, {"position": "none"}, r"μ >= 2.*\(1.0,\)"),
        ({"fourier_grid": [4, 4]}, {"position": "none"}, "need fourier_bands > 0"),
    ],
)
def test_refusals_name_the_setting_and_the_values(stack, embedding, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(CONFIG | {"embedding": embedding, "stack": {"kind": "perceiver", **stack}})
