"""Hyper-parameters that fit the length: no shipped experiment is dense at its own
max_len under any preset (no ShortSequenceWarning), every attention's settings for a
length (`registry.scaled`, what `jxformers compare` and `jxformers lra` train) are sparse
there and build each shipped encoder model, and the issue's case (local attention at
`lra_listops`' tiny preset, as wide as softmax) no longer happens. The experiments are
read from the folder, so a new one is checked as soon as it is added."""

import functools
import pathlib
import warnings

import numpy as np
import pytest
import yaml
from test_data import _write_idx

import jxformers
from jxformers import registry
from jxformers.nn.config import AttentionConfig, ModelConfig, ShortSequenceWarning, bind_attention
from jxformers.tools import compare
from jxformers.train import load_experiment

FOLDER = pathlib.Path(jxformers.__file__).parent / "experiments"
CASES = [
    (path.stem, preset)
    for path in sorted(FOLDER.glob("*.yaml"))
    for preset in [None, *(yaml.safe_load(path.read_text()).get("presets") or {})]
]


@pytest.fixture(scope="module")
def fashion_mnist(tmp_path_factory):
    """A few Fashion-MNIST idx files (the experiments read only their shapes here)."""
    folder = tmp_path_factory.mktemp("fashion_mnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("t10k", 4)):
        _write_idx(folder / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(folder / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return folder


@functools.cache
def _task(name: str) -> str:
    return (yaml.safe_load((FOLDER / f"{name}.yaml").read_text()).get("data") or {}).get("task", "")


_LOADED: dict[tuple, tuple] = {}  # (name, preset, overrides) -> (experiment, dense warnings) or a skip reason


def _load(name: str, preset: str | None, fashion_mnist: pathlib.Path, *extra: str):
    """The experiment with `preset` (and `extra` overrides) and the ShortSequenceWarnings
    it raised (loaded once for this module's tests); skipped where its data files are
    absent from this machine (the Shakespeare texts in a fresh clone)."""
    key = (name, preset, extra)
    if key not in _LOADED:
        overrides = [*([] if preset is None else [f"preset={preset}"]), *extra]
        if _task(name) == "fashion_mnist":
            overrides.append(f"data.settings.path={fashion_mnist}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                experiment = load_experiment(name, overrides)
            except (ValueError, FileNotFoundError) as e:
                if not ("not found" in str(e) or isinstance(e, FileNotFoundError)):
                    raise
                experiment = f"{name}: its data is not on this machine: {str(e).splitlines()[0]}"
        _LOADED[key] = (experiment, [w for w in caught if issubclass(w.category, ShortSequenceWarning)])
    experiment, dense = _LOADED[key]
    if isinstance(experiment, str):
        pytest.skip(experiment)
    return experiment, dense


@pytest.mark.parametrize("name,preset", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_no_shipped_experiment_is_dense_at_its_length(name, preset, fashion_mnist):
    _, dense = _load(name, preset, fashion_mnist)
    assert not dense, f"{name} preset {preset}: {[str(w.message) for w in dense]}"


def _lengths(fashion_mnist) -> dict[int, ModelConfig]:
    """One encoder model (classify, retrieval) of the shipped experiments x presets for
    each length they have."""
    models = {}
    for name, preset in CASES:
        try:
            experiment, _ = _load(name, preset, fashion_mnist)
        except pytest.skip.Exception:
            continue
        if experiment.model.task in ("classify", "retrieval"):
            models.setdefault(experiment.model.max_len, experiment.model)
    return models


ENCODER_ATTENTIONS = [n for n in registry.names() if not registry.get(n).causal_only]
SHORT = 256  # up to this length (the tiny presets') whole models are built (a build costs 0.1 s here)


def test_every_attention_scaled_to_every_shipped_encoder_length_is_sparse_and_binds(fashion_mnist):
    models = _lengths(fashion_mnist)
    assert len(models) >= 3  # ListOps and Pathfinder, tiny and paper, at least
    unable = {}
    for n, model in models.items():
        for name in ENCODER_ATTENTIONS:
            try:
                settings = registry.scaled(name, n)
            except registry.DenseAtLength as e:
                assert str(e).startswith(f"{name} cannot be sparse at max_len {n}") and "spans" in str(e)
                unable[name, n] = str(e)
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("error", ShortSequenceWarning)
                bound = bind_attention(AttentionConfig(name, settings), n)
                assert bound.hyper_parameters.items() >= settings.items(), (name, n)
                width = bound.width(n)
                assert width is None or width < n, (name, n, settings)
                if n <= SHORT and settings:  # the model itself accepts them
                    _build(model, name, settings)
    # Every shipped encoder is long enough for every attention (at 11 tokens some cannot be sparse).
    assert all(n < 12 for _, n in unable), unable


def _build(model: ModelConfig, name: str, settings: dict) -> None:
    """`model` with attention `name` at `settings`; where the model refuses the attention
    at any settings (routing's k-means inside a per-sentence stack), its defaults must be
    refused too."""
    try:
        ModelConfig.from_dict(model.to_dict() | {"attention": {"name": name, **settings}})
    except ShortSequenceWarning:
        raise
    except ValueError:
        with warnings.catch_warnings(), pytest.raises(ValueError):
            warnings.simplefilter("ignore", ShortSequenceWarning)
            ModelConfig.from_dict(model.to_dict() | {"attention": name})


def test_scaled_settings_follow_the_length_and_refuse_what_cannot_be_sparse():
    # The defaults hold where they are already sparse; shorter sequences shrink them.
    assert registry.scaled("local", 4096) == {"window": 128} and registry.scaled("local", 65) == {"window": 8}
    assert registry.scaled("bigbird", 65) == {"block_size": 4}  # 8 of 17 blocks: 32 of 65 keys
    assert registry.scaled("axial", 1024) == {"width": 32}  # the square grid
    assert registry.scaled("softmax", 16) == {} and registry.scaled("fnet", 16) == {}
    with pytest.raises(registry.DenseAtLength, match=r"local cannot be sparse at max_len 2: .* spans 3 >= 2"):
        registry.scaled("local", 2)
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        registry.scaled("local", 0)
    assert "at a max_len N (jxformers compare): window = min(default, N / 8)" in registry.describe("local")


def test_the_issues_case_compare_runs_local_attention_sparse_at_the_tiny_preset(fashion_mnist):
    experiment, _ = _load("lra_listops", "tiny", fashion_mnist)
    n = experiment.model.max_len
    runs = compare.candidates(["local", "softmax", "bigbird"], fourier=False, max_len=n)
    local, dense = _load("lra_listops", "tiny", fashion_mnist, *runs["local"])
    assert not dense
    bound = local.model.bound_attention(0)
    assert bound.name == "local" and bound.width(n) < n  # the issue: window 128 spanned all 65 positions
    assert runs.settings == {"local": {"window": n // 8}, "softmax": {}, "bigbird": {"block_size": n // 16}}
    header = runs.describe(n)
    assert f"at max_len {n}" in header and "local (window=8)" in header and "defaults: softmax" in header


def test_compare_keeps_the_users_attention_settings_and_skips_what_cannot_be_sparse():
    runs = compare.candidates(["local", "softmax"], fourier=False, max_len=65, overrides=["model.attention.window=20"])
    assert runs.settings == {"local": {"window": 20}, "softmax": {}}  # softmax takes no window
    assert runs["local"] == ['model.attention={"name": "local", "window": 20}']
    runs = compare.candidates(["local", "softmax"], fourier=False, max_len=2)
    assert list(runs) == ["softmax"] and "local cannot be sparse at max_len 2" in runs.skipped["local"]
