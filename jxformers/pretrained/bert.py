"""BERT checkpoints (Hugging Face layout: config.json + model.safetensors) as jxformers
models: `load_bert` builds a `Classifier` whose encoder computes BertModel's
`last_hidden_state` from the same weights and tokens, and `save_converted` /
`load_converted` store a converted model as config.yaml + model.eqx;
`save_converted_run` writes it as a work directory of an experiment at step 0 instead
(config.yaml is then the experiment), which the command line evaluates and fine-tunes.

How BERT maps onto ModelConfig (`bert_config`): post-norm blocks (norm placement
"post", no final norm: norm.final False), learned absolute positions from 0 (the
tokenizer's [CLS] is token 0, so the encoder adds no CLS token of its own: head
"mean", which is also how sentence-transformers' MiniLM was trained), token-type
embeddings (embedding.type_vocab_size), an embedding LayerNorm (embedding.norm), no
sqrt(d) scaling of the token embeddings (embedding.scale False), LayerNorm epsilon from
the checkpoint (norm.eps, 1e-12), the erf GELU ("gelu" in BERT's config; ffn kind
"gelu_exact"). Dropout
defaults to 0 here (BERT trains with 0.1; pass dropout= to fine-tune with it).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import numpy as np

from jxformers.nn.config import ModelConfig, build_model, legacy

if TYPE_CHECKING:
    from jxformers.train import Experiment

# BERT's hidden_act -> our FFN kind (jax.nn.gelu(approximate=True) is gelu_new's tanh form)
ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu"}
# What may differ from the checkpoint: the rest is fixed by its weights
OVERRIDES = (
    "num_classes",
    "max_len",
    "attention",
    "attention_kwargs",
    "filters",
    "downsample",
    "impl",
    "dropout",
    "dtype",
    "layer_overrides",
    "pooling",
)
CONFIG, WEIGHTS = "config.json", "model.safetensors"
CONVERTED_CONFIG, CONVERTED_WEIGHTS = "config.yaml", "model.eqx"


def bert_config(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The ModelConfig of a BERT described by its Hugging Face `config.json` (a dict),
    task "classify" with mean pooling; `overrides` may set any of OVERRIDES (max_len at
    most the checkpoint's max_position_embeddings; the position table is cut to it)."""
    if hf.get("model_type", "bert") != "bert":
        raise ValueError(f"model_type {hf.get('model_type')!r}: only BERT checkpoints (model_type 'bert') convert")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {hf['position_embedding_type']!r}: only 'absolute' converts")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} has no jxformers FFN; convertible: {sorted(ACTIVATIONS)}")
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ValueError(f"{unknown} are fixed by the checkpoint's weights; what may be set: {list(OVERRIDES)}")
    positions = hf["max_position_embeddings"]
    if overrides.get("max_len", positions) > positions:
        raise ValueError(f"max_len {overrides['max_len']} exceeds the checkpoint's {positions} position embeddings")
    if overrides.get("pooling") == "cls":
        raise ValueError(
            "pooling 'cls' would prepend a new CLS token and shift BERT's positions; the tokenizer's "
            "[CLS] is token 0 already: use pooling 'mean' (MiniLM's sentence embedding) or 'pma'"
        )
    values: dict[str, Any] = dict(
        task="classify",
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        d_model=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"],
        max_len=positions,
        ffn=ACTIVATIONS[act],
        position="learned",
        norm="layernorm",
        norm_placement="post",
        pooling="mean",
        dropout=0.0,
        embed_scale=False,
        embed_norm=True,
        type_vocab_size=hf.get("type_vocab_size", 2),
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        final_norm=False,
    )
    # The overrides are the flat names of this function's API; the config takes components.
    return ModelConfig(**legacy.convert(values | overrides))


def _names(config: ModelConfig) -> list[tuple[Any, str]]:
    """(getter on a Classifier, BERT tensor name) for every converted array."""
    pairs = [
        (lambda m: m.encoder.embedding.table, "embeddings.word_embeddings.weight"),
        (lambda m: m.encoder.embedding.positions.table, "embeddings.position_embeddings.weight"),
        (lambda m: m.encoder.embedding.types, "embeddings.token_type_embeddings.weight"),
        (lambda m: m.encoder.embedding.norm.weight, "embeddings.LayerNorm.weight"),
        (lambda m: m.encoder.embedding.norm.bias, "embeddings.LayerNorm.bias"),
    ]
    ours = {
        "attention.q_proj": "attention.self.query",
        "attention.k_proj": "attention.self.key",
        "attention.v_proj": "attention.self.value",
        "attention.o_proj": "attention.output.dense",
        "norms.0": "attention.output.LayerNorm",
        "ffn.w_in": "intermediate.dense",
        "ffn.w_out": "output.dense",
        "norms.1": "output.LayerNorm",
    }
    for i in range(config.num_layers):
        for path, theirs in ours.items():
            for leaf in ("weight", "bias"):
                pairs.append((_getter(i, path, leaf), f"encoder.layer.{i}.{theirs}.{leaf}"))
    return pairs


def _getter(i: int, path: str, leaf: str):
    def get(model):
        node = model.encoder.blocks[i]
        for part in path.split("."):
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        return getattr(node, leaf)

    return get


def _canonical(name: str) -> str:
    """Tensor names without a "bert." prefix and with old TF-era LayerNorm names."""
    name = name.removeprefix("bert.")
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def load_weights(model, tensors: Mapping[str, np.ndarray], config: ModelConfig):
    """`model` (built from `config`, a `bert_config`) with BERT's arrays in place of its
    own; the head and any new attention's own arrays stay as built."""
    tensors = {_canonical(k): v for k, v in tensors.items()}
    pairs = _names(config)
    missing = [name for _, name in pairs if name not in tensors]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} BERT tensors, e.g. {missing[:3]}; it holds e.g. {sorted(tensors)[:5]}"
        )
    arrays = []
    for get, name in pairs:
        value = np.asarray(tensors[name], np.float32)
        if name == "embeddings.position_embeddings.weight":
            value = value[: config.max_len]
        want = get(model).shape
        if value.shape != want:
            raise ValueError(f"tensor {name} has shape {value.shape}; the model built from config.json needs {want}")
        arrays.append(jax.numpy.asarray(value))
    return eqx.tree_at(lambda m: [get(m) for get, _ in pairs], model, arrays)


def _paths(path: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    path = pathlib.Path(path)
    weights = path if path.suffix == ".safetensors" else path / WEIGHTS
    config = weights.parent / CONFIG
    for file in (weights, config):
        if not file.is_file():
            raise ValueError(
                f"{file} not found: load_bert takes a directory with {CONFIG} and {WEIGHTS} "
                "(scripts/fetch_minilm.sh fetches MiniLM-L6-H384's)"
            )
    return weights, config


def load_bert(path: str | pathlib.Path, *, num_classes: int = 2, key: jax.Array | None = None, **overrides: Any):
    """A BERT checkpoint as a jxformers `Classifier` (mean pooling, a new linear head of
    `num_classes`) and its `ModelConfig`.

    Arguments:
        path: a directory holding config.json and model.safetensors (or the
            .safetensors file, config.json beside it).
        num_classes: classes of the new head.
        key: PRNG key of the new head and of any arrays a swapped attention brings
            (default key 0).
        overrides: the names in `OVERRIDES` (this function's own keywords, in the flat
            form: `attention_kwargs` sets the attention's hyper-parameters, `filters`,
            `downsample` and `layer_overrides` the stack's, `pooling` the head's kind,
            `impl` the attention's), e.g. attention="performer", attention_kwargs={...},
            filters={2: 0.5}, max_len=128, dropout=0.1.

    Returns:
        `(model, config)`; `model.encoder(ids, mask, token_types=...)` gives `(hidden
        [seq, d_model], mask)`, BertModel's last_hidden_state for the same tokens.
    """
    from safetensors.numpy import load_file

    weights, config_file = _paths(path)
    config = bert_config(json.loads(config_file.read_text()), num_classes=num_classes, **overrides)
    model = build_model(config, key=jax.random.key(0) if key is None else key)
    return load_weights(model, load_file(str(weights)), config), config


def save_converted(model, config: ModelConfig, out: str | pathlib.Path) -> pathlib.Path:
    """Write `config` (config.yaml) and `model`'s arrays (model.eqx) into directory `out`;
    neither through a symbolic link (a ValueError naming it, before anything is written),
    as a run's own files (`train.workdir.open_own`)."""
    import yaml

    from jxformers.train.workdir import check_not_a_link, open_own

    out = pathlib.Path(out)
    for name in (CONVERTED_CONFIG, CONVERTED_WEIGHTS):
        check_not_a_link(out / name)
    out.mkdir(parents=True, exist_ok=True)
    create = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    with os.fdopen(open_own(out / CONVERTED_CONFIG, create), "w") as f:
        f.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    with os.fdopen(open_own(out / CONVERTED_WEIGHTS, create), "wb") as f:
        eqx.tree_serialise_leaves(f, model)
    return out


def save_converted_run(model, experiment: Experiment, out: str | pathlib.Path) -> pathlib.Path:
    """Write directory `out` as a work directory of `experiment` at step 0 whose model
    is `model` (a converted checkpoint; `experiment` from `load_experiment(...,
    model=config)`): config.yaml (the experiment) and checkpoints/ (`train.loop.start_run`),
    so that `jxformers eval --workdir OUT` evaluates it and `jxformers train --workdir
    OUT` fine-tunes it; and model.eqx, which `load_converted`
    reads (the converted weights, not a fine-tuned state)."""
    from jxformers.train.loop import start_run  # the training machinery (orbax, grain) only when asked

    out = start_run(experiment, out, model)
    eqx.tree_serialise_leaves(out / CONVERTED_WEIGHTS, model)
    return out


def load_converted(path: str | pathlib.Path):
    """`(model, config)` from a directory `save_converted`, `save_converted_run` (or
    `jxformers convert`, with or without `--experiment`) wrote: the converted weights."""
    import yaml

    path = pathlib.Path(path)
    if not (path / CONVERTED_CONFIG).is_file() or not (path / CONVERTED_WEIGHTS).is_file():
        raise ValueError(
            f"{path} holds no {CONVERTED_CONFIG} and {CONVERTED_WEIGHTS}; write them with "
            "`jxformers convert BERT_DIR --out DIR`"
        )
    values = yaml.safe_load((path / CONVERTED_CONFIG).read_text())
    if isinstance(values, dict) and isinstance(values.get("model"), dict) and "data" in values:
        values = values["model"]  # a run's config (convert --experiment): the model is its model section
    config = ModelConfig.from_dict(values)
    like = build_model(config, key=jax.random.key(0))
    return eqx.tree_deserialise_leaves(path / CONVERTED_WEIGHTS, like), config
