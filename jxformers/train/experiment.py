"""Experiment configs: one YAML file per experiment (in `experiments/`), with sections

    name:        the experiment's name
    data:        task (listops, copy, recall), train_size, eval_size, seed, and the task's
                 own settings under `settings` (max_len, ...)
    model:       ModelConfig fields (task, vocab_size and num_classes come from the data)
    train:       steps, batch_size, optimizer, learning_rate, schedule, ...  (TRAIN)
    checkpoint:  every, keep, best_metric, best_mode, async_save           (CHECKPOINT)
    presets:     named overrides, e.g. `tiny` (a CPU in minutes) and `paper` (a GPU)
    preset:      the preset to apply (or `--set preset=tiny`)

`load_experiment(path_or_name, overrides)` applies the preset, then `key=value`
overrides with dotted keys (`train.steps=100`), and validates everything before any
work starts: unknown keys and ill-typed values are ValueErrors that list what exists.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jxformers.data import make_source
from jxformers.nn import ModelConfig

EXPERIMENTS_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments"

DATA = {"task": "listops", "train_size": 96_000, "eval_size": 2_000, "seed": 0, "settings": {}}
TRAIN = {
    "steps": 1000, "batch_size": 32, "optimizer": "adamw", "learning_rate": 1e-3, "warmup_steps": 100,
    "schedule": "cosine", "weight_decay": 0.01, "clip_norm": 1.0, "grad_accum": 1, "eval_every": 500,
    "eval_batches": 8, "log_every": 10, "seed": 0, "on_nonfinite": "stop", "redraw_every": 0,
}
CHECKPOINT = {"every": 500, "keep": 3, "best_metric": "eval_accuracy", "best_mode": "max", "async_save": True}
SECTIONS = {"data": DATA, "train": TRAIN, "checkpoint": CHECKPOINT}
TOP = ("name", "preset", "presets", "data", "model", "train", "checkpoint")
CHOICES = {
    ("train", "optimizer"): ("adamw", "radam"), ("train", "schedule"): ("cosine", "inverse_sqrt", "constant"),
    ("train", "on_nonfinite"): ("stop", "skip"), ("checkpoint", "best_mode"): ("max", "min"),
}


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A validated experiment: plain dicts for data/train/checkpoint and a ModelConfig."""

    name: str
    data: dict[str, Any]
    model: ModelConfig
    train: dict[str, Any]
    checkpoint: dict[str, Any]
    raw: dict[str, Any]  # the merged config as loaded (saved in the work directory)

    def sources(self):
        """(train source, eval source): the eval split is the stream with seed + 1."""
        d = self.data
        return (make_source(d["task"], seed=d["seed"], size=d["train_size"], **d["settings"]),
                make_source(d["task"], seed=d["seed"] + 1, size=d["eval_size"], split="valid", **d["settings"]))


def _deep_merge(base: dict, extra: Mapping) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value parsed as YAML: 10 -> int, true -> bool...)."""
    if "=" not in text:
        raise ValueError(f"an override is key=value (e.g. train.steps=100); got {text!r}")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ValueError(f"bad override key {key!r}")
    parsed = yaml.safe_load(value) if value.strip() else ""
    if isinstance(parsed, str):  # YAML 1.1 reads 1e-3 as a string; a number is meant
        try:
            parsed = float(parsed)
        except ValueError:
            pass
    return path, parsed


def _set(config: dict, path: list[str], value: Any):
    node = config
    for i, part in enumerate(path[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
    node[path[-1]] = value


def _read(source: str | os.PathLike | Mapping) -> dict:
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = pathlib.Path(source)
    if not path.exists() and not path.suffix:
        candidate = EXPERIMENTS_DIR / f"{source}.yaml"
        if candidate.exists():
            path = candidate
    if not path.exists():
        names = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")) if EXPERIMENTS_DIR.exists() else []
        raise ValueError(f"no experiment config {str(source)!r}: give a YAML path or one of {names}")
    values = yaml.safe_load(path.read_text())
    if not isinstance(values, dict):
        raise ValueError(f"{path}: an experiment config must be a YAML mapping")
    values.setdefault("name", path.stem)
    return values


def _check_section(name: str, values: Mapping, defaults: Mapping) -> dict:
    unknown = sorted(set(values) - set(defaults))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; known: {sorted(defaults)}")
    merged = _deep_merge(dict(defaults), values)
    for key, default in defaults.items():
        value = merged[key]
        if isinstance(default, float) and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                value = merged[key] = float(value)
            except ValueError:
                pass
        ok = (
            value is None and key in ("clip_norm",)
            or isinstance(default, bool) and isinstance(value, bool)
            or isinstance(default, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
            or isinstance(default, int) and not isinstance(default, bool) and isinstance(value, int)
            and not isinstance(value, bool)
            or isinstance(default, (str, dict)) and isinstance(value, type(default))
        )
        if not ok:
            raise ValueError(f"{name}.{key} must be {type(default).__name__}; got {value!r}")
        if (name, key) in CHOICES and value not in CHOICES[(name, key)]:
            raise ValueError(f"{name}.{key} must be one of {list(CHOICES[(name, key)])}; got {value!r}")
    return merged


def load_experiment(source: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> Experiment:
    """Read, apply the preset and the overrides, validate."""
    config = _read(source)
    parsed = [parse_override(o) for o in overrides]
    for path, value in parsed:
        if path == ["preset"]:
            config["preset"] = value
    unknown = sorted(set(config) - set(TOP))
    if unknown:
        raise ValueError(f"unknown experiment key(s) {unknown}; known: {list(TOP)}")
    presets = config.pop("presets", {}) or {}
    preset = config.get("preset")
    if preset is not None:
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; this experiment has {sorted(presets)}")
        config = _deep_merge(config, presets[preset])
    for path, value in parsed:
        if path[0] not in TOP or path[0] == "presets":
            raise ValueError(f"override {'.'.join(path)}: unknown section {path[0]!r}; known: {list(TOP)}")
        if path != ["preset"]:
            _set(config, path, value)
    sections = {name: _check_section(name, config.get(name, {}) or {}, defaults) for name, defaults in SECTIONS.items()}
    train, ckpt, data = sections["train"], sections["checkpoint"], sections["data"]
    for key in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "log_every"):
        if train[key] < 1:
            raise ValueError(f"train.{key} must be >= 1; got {train[key]}")
    if train["batch_size"] % train["grad_accum"]:
        raise ValueError(f"train.batch_size ({train['batch_size']}) must be divisible by train.grad_accum "
                         f"({train['grad_accum']})")
    if ckpt["every"] < 1 or ckpt["keep"] < 1:
        raise ValueError("checkpoint.every and checkpoint.keep must be >= 1")
    if ckpt["best_metric"] not in ("eval_accuracy", "eval_loss"):
        raise ValueError(f"checkpoint.best_metric must be eval_accuracy or eval_loss; got {ckpt['best_metric']!r}")
    train_source = make_source(data["task"], seed=data["seed"], size=data["train_size"], **data["settings"])
    model_values = dict(config.get("model", {}) or {})
    for fixed in ("task", "vocab_size", "num_classes"):
        if fixed in model_values:
            raise ValueError(f"model.{fixed} comes from the data task; do not set it")
    model_values |= {"task": train_source.model_task, "vocab_size": train_source.vocab_size}
    if train_source.model_task == "classify":
        model_values["num_classes"] = train_source.num_classes
    model_values.setdefault("max_len", train_source.max_len + (1 if model_values.get("pooling", "cls") == "cls"
                                                               and train_source.model_task == "classify" else 0))
    model = ModelConfig.from_dict(model_values)
    raw = {"name": config.get("name", "experiment"), "preset": preset, "data": data, "model": model.to_dict(),
           "train": train, "checkpoint": ckpt}
    return Experiment(raw["name"], data, model, train, ckpt, raw)
