"""The flat `ModelConfig` keys of jxformers before the component configs, converted to the components that now
hold them (with one `FlatConfigWarning` naming the new keys): configs written by hand,
shipped experiments of old versions and the `config.yaml` of old runs keep working."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# flat key -> where it lives now
MOVED = {
    "attention_kwargs": "attention.<hyper-parameter>",
    "impl": "attention.impl",
    "cross_attention": "decoder.cross_attention",
    "cross_attention_kwargs": "decoder.cross_attention.<hyper-parameter>",
    "decoder_layers": "decoder.num_layers",
    "d_ff": "ffn.d_ff",
    "ffn_chunk_size": "ffn.chunk_size",
    "moe": "ffn: {kind: moe, ...}",
    "pkm": "ffn: {kind: pkm, ...}",
    "position": "embedding.position",
    "embed_scale": "embedding.scale",
    "embed_norm": "embedding.norm",
    "type_vocab_size": "embedding.type_vocab_size",
    "norm_placement": "norm.placement",
    "norm_eps": "norm.eps",
    "final_norm": "norm.final",
    "pooling": "head.kind",
    "pma_seeds": "head.pma_seeds",
    "tie_embeddings": "head.tie_embeddings",
    "output_head": "head.kind",
    "mixture_components": "head.components",
    "architecture": "stack.kind",
    "memory_size": "stack.num_inducing / packed_len / num_latents",
    "cross_attends": "stack.cross_attends",
    "filters": "stack.filters",
    "downsample": "stack.downsample",
    "layer_overrides": "stack.layer_overrides",
    "reversible": "stack.reversible",
    "token_learner": "stack.token_learner",
    "mem_len": "stack.mem_len",
    "eval_mem_len": "stack.eval_mem_len",
    "cmem_len": "stack.cmem_len",
    "compression": "stack.compression",
    "compression_rate": "stack.compression_rate",
}
_MEMORY_SIZE = {"isab": "num_inducing", "luna": "packed_len", "perceiver": "num_latents"}
# The flat stack keys with their old defaults, and the stacks each applies to.
_STACK_DEFAULTS = {
    "memory_size": 16,
    "cross_attends": 1,
    "filters": {},
    "downsample": "fourier",
    "reversible": False,
    "token_learner": {},
    "mem_len": 0,
    "eval_mem_len": None,
    "cmem_len": 0,
    "compression": "conv",
    "compression_rate": 3,
}
_STACK_KEYS = {
    "memory_size": ("isab", "luna", "perceiver"),
    "cross_attends": ("perceiver",),
    "filters": ("transformer",),
    "downsample": ("transformer",),
    "reversible": ("transformer",),
    "token_learner": ("transformer",),
    "mem_len": ("transformer_xl", "compressive"),
    "eval_mem_len": ("transformer_xl", "compressive"),
    "cmem_len": ("compressive",),
    "compression": ("compressive",),
    "compression_rate": ("compressive",),
}


class FlatConfigWarning(FutureWarning):
    """A model config used the flat keys of jxformers before the component configs; they were converted."""


def flat_keys(values: Mapping[str, Any]) -> list[str]:
    """The flat (old) keys among `values`, in their order."""
    return [k for k in values if k in MOVED]


def message(keys: list[str]) -> str:
    moves = ", ".join(f"{k} -> {MOVED[k]}" for k in keys)
    return f"flat model config keys are deprecated and were converted: {moves}"


def convert(values: Mapping[str, Any]) -> dict[str, Any]:
    """The component form of a config written with flat keys: wholly flat (the old form,
    converted by meaning: `moe` settings go to the blocks whose ffn is moe, memory_size to
    the stack's own name), or flat keys mixed into components (each moved to its path)."""
    if any(not isinstance(values.get(k), (str, type(None))) for k in SHORTHAND):
        return _by_paths(values)
    v = dict(values)
    impl = v.pop("impl", "auto")

    def attention(name: str, kwargs: Mapping | None, given_impl: str) -> dict[str, Any]:
        kwargs = dict(kwargs or {})
        chosen = kwargs.pop("impl", given_impl)
        return {"name": name, **kwargs, **({"impl": chosen} if chosen != "auto" else {})}

    model_attention = v.pop("attention", "softmax")
    model_kwargs = v.pop("attention_kwargs", {}) or {}
    out: dict[str, Any] = {k: v.pop(k) for k in list(v) if k not in MOVED and k not in ("ffn", "norm")}
    out["attention"] = attention(model_attention, model_kwargs, impl)

    kind, moe, pkm = v.pop("ffn", "gelu"), v.pop("moe", {}) or {}, v.pop("pkm", {}) or {}
    model_d_ff, chunk = v.pop("d_ff", None), v.pop("ffn_chunk_size", None)

    def ffn(kind_: str, d_ff: int | None) -> dict[str, Any]:
        if kind_ == "moe":
            return {"kind": "moe", **moe, **({"d_ff": d_ff} if d_ff is not None else {})}
        if kind_ == "pkm":
            return {"kind": "pkm", **pkm}
        return {
            "kind": kind_,
            **({"d_ff": d_ff} if d_ff is not None else {}),
            **({"chunk_size": chunk} if chunk is not None else {}),
        }

    out["ffn"] = ffn(kind, model_d_ff)
    overrides, kinds = {}, {kind}
    for index, layer in (v.pop("layer_overrides", {}) or {}).items():
        layer = dict(layer) if isinstance(layer, Mapping) else layer
        if not isinstance(layer, dict) or set(layer) - {"attention", "attention_kwargs", "impl", "ffn", "d_ff"}:
            raise ValueError(
                f"layer_overrides[{index}] may set only ['attention', 'attention_kwargs', 'impl', "
                f"'ffn', 'd_ff']; got {layer!r}"
            )
        new = {}
        if {"attention", "attention_kwargs", "impl"} & set(layer):
            new["attention"] = attention(
                layer.get("attention", model_attention),
                layer.get("attention_kwargs", model_kwargs),
                layer.get("impl", impl),
            )
        if {"ffn", "d_ff"} & set(layer):
            kinds.add(layer.get("ffn", kind))
            new["ffn"] = ffn(layer.get("ffn", kind), layer.get("d_ff", model_d_ff))
        overrides[index] = new
    for name, settings in (("moe", moe), ("pkm", pkm)):
        if settings and name not in kinds:
            raise ValueError(f"config {name} settings are given but no block has ffn {name!r}")

    arch = v.pop("architecture", "transformer")
    stack: dict[str, Any] = {"kind": arch}
    if overrides:
        stack["layer_overrides"] = overrides
    for name, default in _STACK_DEFAULTS.items():
        if name not in v:
            continue
        value = v.pop(name)
        # At its old default a key did nothing where it does not apply (an old config.yaml
        # holds them all); set otherwise it is kept, and the stack refuses it by name.
        if (arch in _STACK_KEYS.get(name, ()) and value != {}) or value != default:
            stack[_MEMORY_SIZE.get(arch, name) if name == "memory_size" else name] = value
    out["stack"] = stack

    norm = {"kind": v.pop("norm", "layernorm")}
    for old, new in (("norm_placement", "placement"), ("norm_eps", "eps"), ("final_norm", "final")):
        if old in v:
            norm[new] = v.pop(old)
    out["norm"] = norm
    embedding = {
        new: v.pop(old)
        for old, new in (
            ("position", "position"),
            ("embed_scale", "scale"),
            ("embed_norm", "norm"),
            ("type_vocab_size", "type_vocab_size"),
        )
        if old in v
    }
    if embedding:
        out["embedding"] = embedding

    task = out.get("task", "classify")
    # A flat key that did nothing at its default is dropped; set otherwise, it is kept
    # under its old name so that the head refuses it by name.
    defaults = {"output_head": "softmax", "mixture_components": 10, "pma_seeds": 1, "pooling": "cls"}
    if task in ("classify", "retrieval"):
        head: dict[str, Any] = {"kind": v.pop("pooling", "cls")}
        if v.get("output_head", "softmax") != "softmax":  # a language model's head: refused for this task
            head = {"kind": v.pop("output_head")}
            if "mixture_components" in v:
                head["components"] = v.pop("mixture_components")
        if "pma_seeds" in v:
            head["pma_seeds"] = v.pop("pma_seeds")
        v.pop("tie_embeddings", None)  # a classifier has no output embedding: the flat default did nothing there
    else:
        head = {"kind": v.pop("output_head", "softmax")}
        if v.get("pooling", "cls") != "cls":  # an encoder's head: refused for this task
            head = {"kind": v.pop("pooling")}
        if head["kind"] == "mixture_of_logistics":
            if "mixture_components" in v:
                head["components"] = v.pop("mixture_components")
            if v.get("tie_embeddings", True):
                v.pop("tie_embeddings", None)
        elif "tie_embeddings" in v:
            head["tie_embeddings"] = v.pop("tie_embeddings")
    for name, default in defaults.items():
        if name in v:
            value = v.pop(name)
            if value != default:
                head[name] = value
    out["head"] = head

    decoder = {}
    if v.get("decoder_layers") is not None or task == "seq2seq":
        decoder["num_layers"] = v.pop("decoder_layers", None)
    if v.get("cross_attention", "softmax") != "softmax" or v.get("cross_attention_kwargs") or task == "seq2seq":
        decoder["cross_attention"] = attention(
            v.pop("cross_attention", "softmax"), v.pop("cross_attention_kwargs", {}), impl
        )
    for name in ("decoder_layers", "cross_attention", "cross_attention_kwargs"):  # at their defaults: nothing
        v.pop(name, None)
    if decoder:
        out["decoder"] = decoder
    assert not v, f"flat keys left unconverted: {sorted(v)}"
    return out


# flat key -> its path in the component form, for overrides and presets written flat
# (`--set model.d_ff=128` is `--set model.ffn.d_ff=128`). The hyper-parameter mappings
# (attention_kwargs, cross_attention_kwargs) merge into their attention.
PATHS = {
    "attention_kwargs": ("attention",),
    "impl": ("attention", "impl"),
    "cross_attention": ("decoder", "cross_attention", "name"),
    "cross_attention_kwargs": ("decoder", "cross_attention"),
    "decoder_layers": ("decoder", "num_layers"),
    "d_ff": ("ffn", "d_ff"),
    "ffn_chunk_size": ("ffn", "chunk_size"),
    "position": ("embedding", "position"),
    "embed_scale": ("embedding", "scale"),
    "embed_norm": ("embedding", "norm"),
    "type_vocab_size": ("embedding", "type_vocab_size"),
    "norm_placement": ("norm", "placement"),
    "norm_eps": ("norm", "eps"),
    "final_norm": ("norm", "final"),
    "pooling": ("head", "kind"),
    "pma_seeds": ("head", "pma_seeds"),
    "tie_embeddings": ("head", "tie_embeddings"),
    "output_head": ("head", "kind"),
    "mixture_components": ("head", "components"),
    "architecture": ("stack", "kind"),
    **{
        name: ("stack", name)
        for name in (
            "cross_attends",
            "filters",
            "downsample",
            "reversible",
            "token_learner",
            "mem_len",
            "eval_mem_len",
            "cmem_len",
            "compression",
            "compression_rate",
        )
    },
}
_MERGED = ("attention_kwargs", "cross_attention_kwargs")
# component keys whose string value is a shorthand for {NAME: value}
SHORTHAND = {
    "attention": "name",
    "cross_attention": "name",
    "embedding": None,
    "norm": "kind",
    "ffn": "kind",
    "stack": "kind",
    "head": "kind",
    "decoder": None,
}


def nested_paths(path: list[str], value: Any) -> list[tuple[list[str], Any]]:
    """The (path, value) settings in the component form of one model setting `path`
    (after "model"), written flat or not; a flat key without a path (moe, pkm,
    layer_overrides, memory_size) is a ValueError naming where it goes now."""
    if not path or path[0] not in MOVED:
        return [(path, value)]
    if path[0] not in PATHS:
        raise ValueError(f"model.{'.'.join(path)}: the flat key {path[0]!r} is now {MOVED[path[0]]}; set that instead")
    target = list(PATHS[path[0]])
    if path[0] in _MERGED and len(path) == 1:
        if not isinstance(value, Mapping):
            raise ValueError(f"model.{path[0]} must be a mapping of hyper-parameters; got {value!r}")
        return [(target + [k], v) for k, v in value.items()]
    return [(target + path[1:], value)]


def _by_paths(values: Mapping[str, Any]) -> dict[str, Any]:
    """Flat keys mixed into the component form, each set at its path."""
    out = {k: v for k, v in values.items() if k not in MOVED}
    for key in flat_keys(values):
        for path, value in nested_paths([key], values[key]):
            node: dict[str, Any] = out
            for part in path[:-1]:
                node[part] = node = _mapping(expand(node.get(part), part))
            node[path[-1]] = value
    return out


def _mapping(value: Any) -> dict[str, Any]:
    """A component's settings as a new mapping (the caller's is kept): from a mapping, from
    its dataclass (`dataclasses.replace(config, d_ff=...)` passes the components so), or
    empty."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    from jxformers.nn.config.components import to_value

    return to_value(value)


def expand(value: Any, key: str) -> Any:
    """A component given as its shorthand string, as a mapping ({"kind": "swiglu"})."""
    if isinstance(value, str) and SHORTHAND.get(key):
        return {SHORTHAND[key]: value}
    return value


def replace_kind(current: Any, value: Any, key: str) -> Any:
    """What setting component `key` (holding `current`) to the string `value` gives: the
    same kind or attention keeps its settings; another keeps those its own class has too
    (d_ff from one dense FFN to another), and an attention only its impl (hyper-parameters
    belong to their attention)."""
    from jxformers.nn.config.components import FFN_COMPONENTS, HEAD_COMPONENTS, STACK_COMPONENTS

    field = SHORTHAND.get(key)
    if not field or not isinstance(value, str) or not isinstance(current, Mapping):
        return value
    if current.get(field) == value:
        return dict(current)
    if field == "name":
        keep = {"impl"}
    else:
        table = {"ffn": FFN_COMPONENTS, "stack": STACK_COMPONENTS, "head": HEAD_COMPONENTS}.get(key, {})
        cls = table.get(value)
        keep = {f.name for f in dataclasses.fields(cls)} - {"kind"} if cls is not None else set()
    return {field: value, **{k: v for k, v in current.items() if k in keep}}
