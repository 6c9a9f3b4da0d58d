"""Experiment configs: one YAML file per experiment (in `experiments/`), with sections

    name:        the experiment's name
    data:        task (listops, copy, recall), train_size, eval_size, seed, the task's
                 own settings under `settings` (max_len, ...), workers, path  (DataConfig)
    model:       a ModelConfig: sizes and components (attention, embedding, norm, ffn,
                 stack, decoder, head); task, vocab_size and num_classes come from the data
    train:       steps, batch_size, optimizer, learning_rate, schedule, ...  (TrainConfig)
    checkpoint:  every, keep, best_metric, best_mode, async_save           (CheckpointConfig)
    mesh:        the device mesh's axis sizes data, fsdp, tensor, expert        (MeshConfig;
                 -1: the devices the others leave; see jxformers.train.sharding)
    presets:     named overrides, e.g. `tiny` (a CPU in minutes) and `paper` (a GPU)
    preset:      the preset to apply (or `--set preset=tiny`)

`load_experiment(path_or_name, overrides)` applies the preset, then `key=value`
overrides with dotted keys (`train.steps=100`, `model.ffn.d_ff=256`; a component named
anew keeps the settings its new kind has too), and validates everything before any
work starts: unknown keys and ill-typed values are ValueErrors that list what exists.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import pathlib
import typing
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jxformers.data import make_source
from jxformers.nn import ModelConfig
from jxformers.nn.config import legacy
from jxformers.nn.config.components import CompressiveStack
from jxformers.nn.config.model import ENCODER_TASKS
from jxformers.nn.transformer_xl import MEMORY_ARCHITECTURES
from jxformers.train.optim import OPTIMIZERS, SCHEDULES, default_warmup_steps
from jxformers.validate import check_at_least, check_fields, from_mapping, setting

# Shipped with the package (package data), so an installed wheel has them too.
EXPERIMENTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "experiments"
TOP = ("name", "preset", "presets", "data", "model", "train", "checkpoint", "mesh")


class _Section:
    """What the config sections share."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Not runtime type-checked by jaxtyping: values come from users' YAML, and check_fields
# gives errors that name the key and the allowed values.
@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class DataConfig(_Section):
    """The `data` section: a task's name, split sizes, the seed, the task's own
    `settings` (max_len, ...; checked by the task's source), the grain worker processes
    that make records (`workers`; 0: the training process), and `path`, a directory of
    splits built by `jxformers data build` to read instead of generating (the same
    records either way)."""

    task: str = setting("listops", "the data task (`jxformers data list`)")
    train_size: int = setting(96_000, "examples in the training split")
    eval_size: int = setting(2_000, "examples in the evaluation split")
    seed: int = setting(0, "the training split's seed (evaluation: seed + 1)")
    settings: dict = setting(factory=dict, doc="the task's own settings (max_len, ...), checked by its source")
    workers: int = setting(0, "grain worker processes making records (0: the training process)")
    batch_timeout: float = setting(
        300.0, "seconds training waits for a batch from the workers before it stops with an error naming them"
    )
    path: str | None = setting(None, "a directory of splits built by `jxformers data build`, read instead")

    def __post_init__(self):
        check_fields(self, "data.")
        check_at_least(self, "data.", 1, "train_size", "eval_size")
        check_at_least(self, "data.", 0, "workers")
        check_at_least(self, "data.", 1, "batch_timeout")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class TrainConfig(_Section):
    """The `train` section: optimizer and schedule (see `make_optimizer`), batch and
    gradient accumulation, evaluation / logging cadence, the seed, what a non-finite
    step does (`stop` or `skip`), and how often drawn arrays are redrawn.

    `redraw_every`: every this many steps (from step 0) `nn.redraw` resamples the drawn
    features of the attentions whose paper redraws them (Performer, RFA), from the run's
    key and the step alone, so a resumed run redraws exactly as an uninterrupted one;
    0 never redraws. The default, 1000, is performer-pytorch's `feature_redraw_interval`
    (the Performer paper redraws but fixes no interval; its JAX code redraws at every
    call). BigBird's random pattern is drawn once and never redrawn (its paper's code
    seeds it per layer).

    `warmup_steps`: a warm-up longer than the run (`warmup_steps > steps`) is refused when
    it is set (in the experiment file, its preset or `--set`): the learning rate would
    never reach its peak. Unset (null, the default) it is derived from the run: 100
    steps, or all of `steps` when the run is shorter (`optim.default_warmup_steps`), so a
    short run needs no warm-up setting; the saved config keeps it null."""

    steps: int = setting(1000, "optimizer steps")
    batch_size: int = setting(32, "examples per step (all devices)")
    optimizer: str = setting("adamw", "the optimizer", choices=OPTIMIZERS)
    learning_rate: float = setting(1e-3, "peak learning rate, > 0")
    warmup_steps: int | None = setting(
        None, "linear warm-up steps from 0, at most train.steps; null: 100, or train.steps when the run is shorter"
    )
    schedule: str = setting("cosine", "the decay after warm-up", choices=SCHEDULES)
    weight_decay: float = setting(0.01, "decoupled weight decay (not on norms, biases, embeddings)")
    adam_b1: float = setting(0.9, "Adam's (and RAdam's) decay of the gradient's running mean, in [0, 1)")
    adam_b2: float = setting(
        0.999, "Adam's (and RAdam's) decay of the squared gradient's running mean, in [0, 1) (LRA's code: 0.98)"
    )
    adam_eps: float = setting(
        1e-8, "Adam's (and RAdam's) epsilon added to the update's denominator, > 0 (LRA's code: 1e-9)"
    )
    clip_norm: float | None = setting(1.0, "global gradient norm clipping (0 or null: none)")
    grad_accum: int = setting(1, "micro-batches per step (divides batch_size)")
    eval_every: int = setting(500, "evaluate every this many steps")
    eval_batches: int = setting(8, "batches per evaluation")
    log_every: int = setting(10, "log metrics every this many steps")
    seed: int = setting(0, "parameters, dropout and drawn arrays")
    on_nonfinite: str = setting("stop", "a NaN or inf loss: stop (raise) or skip the update", choices=("stop", "skip"))
    max_consecutive_skips: int = setting(
        10, "with on_nonfinite=skip: stop (raise) after this many non-finite steps in a row, a model not recovering"
    )
    redraw_every: int = setting(1000, "redraw Performer's and RFA's features every this many steps (0: never)")

    def __post_init__(self):
        check_fields(self, "train.")
        check_at_least(
            self,
            "train.",
            1,
            "steps",
            "batch_size",
            "grad_accum",
            "eval_every",
            "eval_batches",
            "log_every",
            "max_consecutive_skips",
        )
        check_at_least(self, "train.", 0, "warmup_steps", "redraw_every", "weight_decay")
        if self.warmup_steps is not None and self.warmup_steps > self.steps:  # the peak rate would never be reached
            warmup_steps, steps = self.warmup_steps, self.steps
            raise ValueError(
                f"train.{warmup_steps=} exceeds train.{steps=}: the learning rate would never reach its peak; "
                f"set train.warmup_steps to at most {steps}, or to null for the default (100 steps, cut to "
                f"{default_warmup_steps(steps)} for this run)"
            )
        if not self.learning_rate > 0:  # a negative rate would ascend the loss; `not >` catches NaN
            raise ValueError(f"train.learning_rate must be > 0; got {self.learning_rate}")
        for name in ("adam_b1", "adam_b2"):  # 1 would never forget; `not <` catches NaN
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1); got {getattr(self, name)}")
        if not self.adam_eps > 0:
            raise ValueError(f"train.adam_eps must be > 0; got {self.adam_eps}")
        if self.clip_norm is not None and not self.clip_norm >= 0:
            raise ValueError(f"train.clip_norm must be > 0, or 0 or null for no clipping; got {self.clip_norm}")
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.grad_accum ({self.grad_accum})"
            )


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class CheckpointConfig(_Section):
    """The `checkpoint` section: save every `every` steps, keep the latest `keep` plus
    the best by `best_metric` (`best_mode` max or min), saving asynchronously or not."""

    every: int = setting(500, "save every this many steps")
    keep: int = setting(3, "the latest checkpoints kept (the best is kept too)")
    best_metric: str = setting(
        "eval_accuracy",
        "the metric that picks the best checkpoint (eval_sequence_accuracy: task seq2seq)",
        choices=("eval_accuracy", "eval_loss", "eval_sequence_accuracy"),
    )
    best_mode: str = setting("max", "whether the best is the highest or the lowest", choices=("max", "min"))
    async_save: bool = setting(True, "save in the background while training goes on")
    max_steps_in_flight: int | None = setting(
        None,
        "steps an async save may stay unfinished before training waits for it (a SIGKILL then loses at most "
        "every + this - 1 steps); null: every // 4, at least 1",
    )

    def __post_init__(self):
        check_fields(self, "checkpoint.")
        check_at_least(self, "checkpoint.", 1, "every", "keep", "max_steps_in_flight")

    @property
    def save_lag(self) -> int:
        """`max_steps_in_flight`, its default filled in."""
        return self.max_steps_in_flight if self.max_steps_in_flight is not None else max(1, self.every // 4)


MESH_AXES = ("data", "fsdp", "tensor", "expert")


@typing.no_type_check
@dataclasses.dataclass(frozen=True)
class MeshConfig(_Section):
    """The `mesh` section: the size of each axis of the device mesh the run is sharded
    over (`jxformers.train.sharding`): `data` (the batch), `fsdp` (the batch, and each
    parameter and optimizer state split on one dimension), `tensor` (attention heads and
    feed-forward hidden units), `expert` (MoE experts). One axis may be -1: the devices
    the others leave. The default puts every device on `data` (on one device: today's
    unsharded run). The product must equal the device count, checked when the run
    starts (the count is not known before)."""

    data: int = setting(-1, "devices the batch is split over (-1: the devices the other axes leave)")
    fsdp: int = setting(1, "devices the batch and each parameter are split over (fully sharded)")
    tensor: int = setting(1, "devices attention heads and feed-forward units are split over")
    expert: int = setting(1, "devices MoE experts are split over")

    def __post_init__(self):
        check_fields(self, "mesh.")
        for name in MESH_AXES:
            value = getattr(self, name)
            if value < 1 and value != -1:
                raise ValueError(f"mesh.{name} must be >= 1 or -1 (the devices the other axes leave); got {value}")
        rest = [name for name in MESH_AXES if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ValueError(f"at most one mesh axis may be -1; got {rest} in {self.to_dict()}")


# The splits of an experiment, in the order `Experiment.sources` returns them.
SPLITS = ("train", "eval")
SECTIONS = {"data": DataConfig, "train": TrainConfig, "checkpoint": CheckpointConfig, "mesh": MeshConfig}


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A validated experiment: typed sections and a ModelConfig."""

    name: str
    data: DataConfig
    model: ModelConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    raw: dict[str, Any]  # the merged config as loaded (saved in the work directory)
    mesh: MeshConfig = MeshConfig()

    def sources(self, *, generated: bool = False):
        """(train source, eval source): the eval split is the stream with seed + 1. With
        `data.path`, the built splits there (checked to hold these records), unless
        `generated`."""
        d = self.data
        specs = (
            make_source(d.task, seed=d.seed, size=d.train_size, **d.settings),
            make_source(d.task, seed=d.seed + 1, size=d.eval_size, split="valid", **d.settings),
        )
        if d.path is None or generated:
            return specs
        from jxformers.data.cache import read_split

        return tuple(read_split(d.path, split, spec) for split, spec in zip(SPLITS, specs, strict=True))


def deep_merge(base: dict, extra: Mapping) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), str):  # a component's shorthand, as a mapping
            out[key] = legacy.expand(out[key], key)
        if isinstance(value, Mapping) and isinstance(out.get(key), dict) and not _other_kind(out[key], value):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _other_kind(base: Mapping, extra: Mapping) -> bool:
    """Whether `extra` names another component than `base` (another attention, FFN kind...):
    it then replaces `base` instead of merging into it."""
    return any(k in base and k in extra and base[k] != extra[k] for k in ("name", "kind"))


def _head_kind(model: Mapping) -> str | None:
    """The head a model section names (component or flat form; None: the task's)."""
    head = model.get("head")
    if isinstance(head, Mapping):
        return head.get("kind")
    if isinstance(head, str):
        return head
    return model.get("output_head") if model.get("output_head", "softmax") != "softmax" else model.get("pooling")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value parsed as YAML: 10 -> int, true -> bool...)."""
    if "=" not in text:
        raise ValueError(f"an override is key=value (e.g. train.steps=100); got {text!r}")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ValueError(f"bad override key {key!r}")
    parsed = read_yaml(value, f"--set {text}") if value.strip() else ""
    _check_flow_mapping(parsed, text)
    if isinstance(parsed, str):  # YAML 1.1 reads 1e-3 as a string; a number is meant
        with contextlib.suppress(ValueError):
            parsed = float(parsed)
    return path, parsed


def _check_flow_mapping(value: Any, text: str) -> None:
    """YAML reads `{window:16}` as {'window:16': None} (a flow mapping needs a space after
    the colon); no config key holds a colon, so this is always that mistake."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and ":" in key and item is None:
                fixed = key.replace(":", ": ", 1)
                raise ValueError(
                    f"--set {text}: YAML reads {{{key}}} as a key {key!r} without a value; "
                    f"put a space after the colon: {{{fixed}}}"
                )
            _check_flow_mapping(item, text)


def read_yaml(text: str, where: str) -> Any:
    """`text` parsed as YAML; a syntax error names `where` (a file or an override) and the
    line and column, not PyYAML's `<unicode string>`."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
        problem = " ".join(str(x) for x in (getattr(error, "context", None), getattr(error, "problem", None)) if x)
        raise ValueError(f"{at}: YAML syntax error: {problem or error}") from None


def _set(config: dict, path: list[str], value: Any):
    node = config
    for i, part in enumerate(path[:-1]):
        if path[0] == "model" and isinstance(node.get(part), str):  # a component's shorthand, as a mapping
            node[part] = legacy.expand(node[part], part)
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
    if path[0] == "model":  # a component named anew keeps what still applies (an attention: its impl)
        value = legacy.replace_kind(node.get(path[-1]), value, path[-1])
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
    if not path.is_file():
        raise ValueError(f"experiment config {str(path)!r} is a directory, not a YAML file")
    values = read_yaml(path.read_text(), str(path))
    if not isinstance(values, dict):
        raise ValueError(f"{path}: an experiment config must be a YAML mapping")
    values.setdefault("name", path.stem)
    return values


def _check_stream_source(model_config: ModelConfig, source, *, batch_size: int) -> None:
    """An architecture carrying a memory between segments (Transformer-XL, compressive,
    ERNIE-Doc, Memformer) needs a stream source with one row per batch row, (compressive)
    segments of a multiple of the rate and (segment_len) records of whole segments.
    (`grad_accum` is checked by TrainConfig: it divides the batch, and each micro-batch
    takes its rows' memories.)"""
    arch = model_config.stack.kind
    if arch not in MEMORY_ARCHITECTURES:
        return
    if not getattr(source, "stream", False):
        raise ValueError(
            f"stack {arch!r} carries a memory from batch to batch and needs a stream of consecutive "
            f"segments (data task 'shakespeare_stream'); got data task {type(source).__name__}"
        )
    if source.rows != batch_size:
        raise ValueError(
            f"stack {arch!r}: each batch row is one stream, so data.settings.rows ({source.rows}) "
            f"must equal train.batch_size ({batch_size})"
        )
    segment, stack = source.max_len - 1, model_config.stack
    if isinstance(stack, CompressiveStack) and segment % stack.compression_rate:
        raise ValueError(
            f"stack 'compressive': segments of data max_len - 1 = {segment} tokens must be a multiple "
            f"of compression_rate ({stack.compression_rate})"
        )
    size = getattr(stack, "segment_len", None)  # Memformer's, ERNIE-Doc's segments within a record
    if size is not None and segment % size:
        raise ValueError(
            f"stack {arch!r} reads each record as segments of segment_len ({size}): data max_len - 1 = "
            f"{segment} tokens must be a multiple of it"
        )


def _warn_if_grid_is_not_the_image(model: ModelConfig, source) -> None:
    """A 2-D attention (one whose registration names its `grid_width`) whose rows are not
    the image's rows runs, but sees a wrong grid."""
    image_size = getattr(source, "image_size", None)
    bound = model.bound_attention(0)
    role = bound.spec.grid_width
    if role is None or image_size is None:
        return
    width = bound.hyper_parameters[role]  # defaults filled in
    if width != image_size:
        warnings.warn(
            f"{bound.name} attention's {role} {width} is not the images' width {image_size}: its rows "
            f"are not the image's rows (set model.attention.{role}={image_size})",
            stacklevel=3,
        )


def _drop_other_attention_kwargs(config: dict, parsed: list[tuple[list[str], Any]]) -> None:
    """An override naming another attention drops the file's attention_kwargs (they are
    the other attention's hyper-parameters) unless the overrides set attention_kwargs too."""
    paths = [path for path, _ in parsed]
    model = config.get("model") or {}
    for path, value in parsed:
        if (
            path == ["model", "attention"]
            and value != model.get("attention")
            and ["model", "attention_kwargs"] not in paths
        ):
            model.pop("attention_kwargs", None)


def _merged(
    source: str | os.PathLike | Mapping, overrides: Sequence[str], *, fixed_model: bool
) -> tuple[dict[str, Any], str | None]:
    """The experiment's config with its preset and the overrides applied, and the preset's
    name. `fixed_model`: the model is given otherwise (a converted checkpoint's): the
    file's model section and its presets' are dropped, and a `model.` override refused."""
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
    if fixed_model:
        config.pop("model", None)
        presets = {name: {k: v for k, v in (p or {}).items() if k != "model"} for name, p in presets.items()}
        for path, _ in parsed:
            if path[0] == "model":
                raise ValueError(
                    f"override {'.'.join(path)}: the model is given (a converted checkpoint's), not the "
                    f"experiment's; jxformers convert sets its attention (--attention, --attention-kwargs) and "
                    f"its length (--max-len)"
                )
    if preset is not None:
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; this experiment has {sorted(presets)}")
        config = deep_merge(config, presets[preset])
    _drop_other_attention_kwargs(config, parsed)
    for path, value in parsed:
        if path[0] not in TOP or path[0] == "presets":
            raise ValueError(f"override {'.'.join(path)}: unknown section {path[0]!r}; known: {list(TOP)}")
        if path != ["preset"]:
            _set(config, path, value)
    return config, preset


def training_source(source: str | os.PathLike | Mapping, overrides: Sequence[str] = ()):
    """The training split's source of experiment `source` (preset and overrides applied;
    its model section is not read): what the data gives a model before one is built
    (`model_task`, `vocab_size`, `num_classes` for classification, `max_len`)."""
    config, _ = _merged(source, overrides, fixed_model=True)
    data = from_mapping(DataConfig, config.get("data"), "data")
    return make_source(data.task, seed=data.seed, size=data.train_size, **data.settings)


def _data_gives(train_source) -> dict[str, Any]:
    """What the data decides of a model: its task, vocab_size and, for an encoder task
    (classify; retrieval, the dual tower over pair records), num_classes."""
    given = {"task": train_source.model_task, "vocab_size": train_source.vocab_size}
    if train_source.model_task in ENCODER_TASKS:
        given["num_classes"] = train_source.num_classes
    return given


def _model_values(model_values: dict[str, Any], train_source, data: DataConfig) -> dict[str, Any]:
    """The model section with what the data gives it (task, vocab_size, num_classes, and
    max_len unless set)."""
    for fixed in ("task", "vocab_size", "num_classes"):
        if fixed in model_values:
            raise ValueError(f"model.{fixed} comes from the data task; do not set it")
    model_values |= _data_gives(train_source)
    head = _head_kind(model_values)
    embedding = model_values.get("embedding")
    extra = embedding.get("extra_tokens", 0) if isinstance(embedding, Mapping) else 0  # memory, registers
    model_values.setdefault(
        "max_len",
        train_source.max_len
        + (1 if head in (None, "cls") and train_source.model_task in ENCODER_TASKS else 0)
        + (extra if isinstance(extra, int) else 0),
    )
    if head == "mixture_of_logistics" and not getattr(train_source, "pixel_values", False):
        raise ValueError(
            f"model.head 'mixture_of_logistics' models pixel intensities; the tokens of data task "
            f"{data.task!r} ({data.settings}) are not pixels (fashion_mnist with mode: generate is)"
        )
    return model_values


def _check_given_model(model: ModelConfig, train_source, task: str) -> None:
    """A model given to `load_experiment` must be the one the data needs: its task,
    vocabulary and classes, and a max_len that holds the data's records."""
    for name, value in _data_gives(train_source).items():
        if getattr(model, name) != value:
            hint = " (a tokenized task: is data.settings.tokenizer the checkpoint's?)" if name == "vocab_size" else ""
            raise ValueError(
                f"the model's {name} is {getattr(model, name)!r}, but data task {task!r} gives {value!r}{hint}"
            )
    if train_source.max_len > model.max_len:
        raise ValueError(
            f"data task {task!r} makes records of {train_source.max_len} tokens (data.settings.max_len), more "
            f"than the model's max_len {model.max_len}"
        )


def load_experiment(
    source: str | os.PathLike | Mapping, overrides: Sequence[str] = (), *, model: ModelConfig | None = None
) -> Experiment:
    """Read, apply the preset and the overrides, validate.

    `model`: a model fixed beforehand (a converted checkpoint's: `jxformers convert
    --experiment`) instead of the file's model section, which is not read (nor its
    presets'; a `model.` override is refused); the data must give its task, vocab_size
    and num_classes, and its max_len must hold the data's records."""
    config, preset = _merged(source, overrides, fixed_model=model is not None)
    sections = {name: from_mapping(cls, config.get(name), name) for name, cls in SECTIONS.items()}
    data, train, ckpt = sections["data"], sections["train"], sections["checkpoint"]
    train_source = make_source(data.task, seed=data.seed, size=data.train_size, **data.settings)
    if model is None:  # flat keys are converted by ModelConfig
        model = ModelConfig.from_dict(_model_values(dict(config.get("model", {}) or {}), train_source, data))
    else:
        _check_given_model(model, train_source, data.task)
    _warn_if_grid_is_not_the_image(model, train_source)
    _check_stream_source(model, train_source, batch_size=train.batch_size)
    if ckpt.best_metric == "eval_sequence_accuracy" and model.task != "seq2seq":
        raise ValueError(
            f"checkpoint.best_metric 'eval_sequence_accuracy' is measured for task seq2seq; data task {data.task!r} "
            f"trains task {model.task!r}: use eval_accuracy or eval_loss"
        )
    raw = {
        "name": config.get("name", "experiment"),
        "preset": preset,
        "data": data.to_dict(),
        "model": model.to_dict(),
        "train": train.to_dict(),
        "checkpoint": ckpt.to_dict(),
        "mesh": sections["mesh"].to_dict(),
    }
    return Experiment(raw["name"], data, model, train, ckpt, raw, sections["mesh"])
