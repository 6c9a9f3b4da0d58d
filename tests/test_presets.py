"""Tiny presets and short sequences: hyper-parameters that make an attention dense at
the model's max_len warn (a filterable ShortSequenceWarning); the demo reports each
model's spread over seeds and says when the gaps are noise."""

import warnings

import pytest

from jxformers.nn.config import ModelConfig, ShortSequenceWarning


@pytest.mark.parametrize(
    "attention,kwargs,max_len,match",
    [
        ("local", {"window": 64}, 128, r"local attention at max_len 128: its window .* spans 129 >= 128"),
        ("longformer", {"window": 64}, 64, r"longformer attention at max_len 64"),
        ("bigbird", {}, 256, r"bigbird attention at max_len 256: its blocks .* spans 512 >= 256"),
        ("block_local", {"block_size": 32}, 32, r"block_local"),
        ("linformer", {"proj_len": 256}, 128, r"linformer attention at max_len 128: its projected length"),
        ("nystrom", {"num_landmarks": 64}, 64, r"nystrom"),
    ],
)
def test_an_attention_dense_at_max_len_warns(attention, kwargs, max_len, match):
    with pytest.warns(ShortSequenceWarning, match=match):
        ModelConfig(attention=attention, attention_kwargs=kwargs, max_len=max_len, num_layers=1)


@pytest.mark.parametrize(
    "attention,kwargs,max_len",
    [("local", {"window": 63}, 128), ("bigbird", {}, 1024), ("linformer", {"proj_len": 64}, 128),
     ("softmax", {}, 8), ("dilated", {"window": 64}, 64)],
)
def test_an_attention_sparser_than_its_sequence_does_not_warn(attention, kwargs, max_len):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortSequenceWarning)
        ModelConfig(attention=attention, attention_kwargs=kwargs, max_len=max_len, num_layers=1)


def test_short_sequence_warning_is_a_user_warning_that_can_be_filtered():
    assert issubclass(ShortSequenceWarning, UserWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ShortSequenceWarning)
        ModelConfig(attention="bigbird", max_len=256, num_layers=1)
    assert not [w for w in caught if issubclass(w.category, ShortSequenceWarning)]


def test_a_layer_override_that_is_dense_warns_too():
    with pytest.warns(ShortSequenceWarning, match="local attention at max_len 64"):
        ModelConfig(attention="softmax", max_len=64, num_layers=2, layer_overrides={1: {"attention": "local"}})
