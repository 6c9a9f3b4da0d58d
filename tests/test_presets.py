"""Tiny presets and short sequences: hyper-parameters that make an attention dense at
the model's max_len warn (a filterable ShortSequenceWarning); the demo's verdict on noise
and its models (its run over seeds: tests/test_train.py)."""

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
        ("lsh", {}, 128, r"lsh attention at max_len 128: its chunks .* spans 128 >= 128"),
        ("sinkhorn", {"block_size": 32}, 64, r"sinkhorn attention at max_len 64: its own and sorted blocks"),
    ],
)
def test_an_attention_dense_at_max_len_warns(attention, kwargs, max_len, match):
    with pytest.warns(ShortSequenceWarning, match=match):
        ModelConfig(attention=attention, attention_kwargs=kwargs, max_len=max_len, num_layers=1)


@pytest.mark.parametrize(
    "attention,kwargs,max_len",
    [
        ("local", {"window": 63}, 128),
        ("bigbird", {}, 1024),
        ("linformer", {"proj_len": 64}, 128),
        ("softmax", {}, 8),
        ("dilated", {"window": 64}, 64),
        ("lsh", {"chunk_size": 32}, 128),
        ("routing", {"n_clusters": 4}, 128),
        ("clusterformer", {"chunk_size": 32}, 64),
    ],
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


def test_demo_calls_gaps_within_noise_noise():
    from jxformers.tools.demo import noise_verdict

    # The case: 256 eval examples, gaps of about one standard error.
    text = noise_verdict({"softmax": [0.41, 0.43, 0.40], "linear": [0.39, 0.42, 0.38]}, 256)
    assert text.startswith("Every gap is within noise, so this run does not rank the models")
    assert "softmax - linear = +0.017" in text and "3 seeds" in text and "256 eval examples" in text


def test_demo_names_a_clear_gap_and_the_noisy_ones():
    from jxformers.tools.demo import noise_verdict

    text = noise_verdict({"a": [0.70, 0.72], "b": [0.40, 0.41], "c": [0.41, 0.40]}, 1000)
    assert text.startswith("Clear: a - b = +0.305") and "a - c" in text.split("Within noise")[0]
    assert "Within noise: b - c = +0.000" in text


def test_demo_standard_error_never_drops_below_the_eval_sampling_error():
    from jxformers.tools.demo import standard_error

    assert standard_error([0.5, 0.5, 0.5], 100) == pytest.approx(0.05)  # identical seeds: binomial only
    assert standard_error([0.4, 0.6], 10**9) == pytest.approx(0.1)  # sd 0.141 over sqrt(2) seeds


def test_demo_noise_verdict_when_every_model_scores_zero():
    from jxformers.tools.demo import noise_verdict

    text = noise_verdict({"softmax": [0.0], "linear": [0.0]}, 8)
    assert "within noise" in text and "+0.000 (0.0 SE)" in text


def test_demo_adds_a_model_per_named_attention_and_refuses_unknown_ones(capsys):
    from jxformers.tools import demo

    models = demo._models(["lsh", "sinkhorn", "softmax"])
    assert list(models) == [*demo.MODELS, "lsh", "sinkhorn"]
    assert models["lsh"] == ["model.attention=lsh"]
    with pytest.raises(SystemExit):
        demo.main(["--attention", "no_such_attention"])
    assert "unknown attention 'no_such_attention'" in capsys.readouterr().err


def test_demo_adds_a_model_per_variant_and_refuses_a_malformed_or_bad_one(capsys):
    from jxformers.tools import demo

    models = demo._models([], ["span:model.attention.adaptive_span=8; model.attention.span_ramp=4"])
    assert models["span"] == ["model.attention.adaptive_span=8", "model.attention.span_ramp=4"]
    with pytest.raises(ValueError, match="LABEL:KEY=VALUE"):
        demo.parse_variant("no overrides")
    with pytest.raises(SystemExit):
        demo.main(["--variant", "bad:model.attention.adaptive_span=0"])  # refused before any training
    assert "adaptive_span" in capsys.readouterr().err
