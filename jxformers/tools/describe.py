"""What each key of an experiment file means, read off the config dataclasses (the one
place each setting is declared): `jxformers describe [KEY]` prints a key's type,
default, allowed values and doc (a section or component: every key in it; a component
with variants, each variant's), and `jxformers schema` prints the JSON Schema of an
experiment file, for editors (the YAML language server reads it from
`# yaml-language-server: $schema=PATH`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any, NamedTuple

from jxformers.nn.config import ModelConfig
from jxformers.nn.config.components import AttentionConfig, LayerConfig
from jxformers.train.experiment import SECTIONS, TOP
from jxformers.validate import _hints


def sections() -> dict[str, type]:
    """The experiment file's sections, in file order."""
    return {name: ModelConfig if name == "model" else SECTIONS[name] for name in TOP if name in (*SECTIONS, "model")}


class Key(NamedTuple):
    path: str  # e.g. "model.ffn.top_k"
    type: str
    default: Any
    choices: tuple | None
    doc: str
    variant: str  # "" or which kind of its component holds it, e.g. "ffn kind moe"


def _options(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _components(annotation: Any) -> list[type]:
    return [
        o for o in _options(annotation) if isinstance(o, type) and dataclasses.is_dataclass(o) and o is not LayerConfig
    ]


def _type_name(annotation: Any) -> str:
    names = []
    for option in _options(annotation):
        option = typing.get_origin(option) or option
        names.append("null" if option is type(None) else getattr(option, "__name__", str(option)))
    return " | ".join(names)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
        return value if not dataclasses.is_dataclass(value) else "(component)"
    return "(required)"


def _kinds(cls: type) -> tuple | None:
    field = {f.name: f for f in dataclasses.fields(cls)}.get("kind")
    return None if field is None else field.metadata.get("choices")


def keys(cls: type, prefix: str, variant: str = "") -> list[Key]:
    """Every key of dataclass `cls` under `prefix`, components expanded (each variant of
    a union once)."""
    hints, out = _hints(cls), []
    for field in dataclasses.fields(cls):
        if cls is AttentionConfig and field.name == "hyper_parameters":  # written beside name, listed below
            continue
        path = f"{prefix}.{field.name}"
        annotation = hints[field.name]
        out.append(
            Key(
                path,
                _type_name(annotation),
                _default(field),
                field.metadata.get("choices"),
                field.metadata.get("doc", ""),
                variant,
            )
        )
        for component in _components(annotation):
            kinds = _kinds(component)
            label = (
                f"{field.name} kind {'|'.join(map(str, kinds))}"
                if kinds and len(_components(annotation)) > 1
                else variant
            )
            out.extend(keys(component, path, label))
    if cls is AttentionConfig:
        out.append(
            Key(
                f"{prefix}.<hyper-parameter>",
                "per attention",
                "(component)",
                None,
                "the named attention's hyper-parameters, beside name (`jxformers list NAME` lists them)",
                variant,
            )
        )
    return out


def all_keys() -> list[Key]:
    return [k for name, cls in sections().items() for k in keys(cls, name)]


def describe(key: str | None = None) -> str:
    """The lines `jxformers describe KEY` prints; a ValueError for an unknown key."""
    found = [k for k in all_keys() if key is None or k.path == key or k.path.startswith(f"{key}.")]
    if not found:
        tops = sorted({k.path.split(".")[0] + "." + k.path.split(".")[1] for k in all_keys()})
        raise ValueError(f"no experiment key {key!r}; keys: {tops} (and those inside the model's components)")
    lines = []
    for k in found:
        where = f"  [{k.variant}]" if k.variant else ""
        choices = f", one of {list(k.choices)}" if k.choices else ""
        default = (
            {"(component)": "", "(required)": " (required)"}.get(k.default, f" = {k.default!r}")
            if isinstance(k.default, str)
            else f" = {k.default!r}"
        )
        lines.append(f"{k.path}: {k.type}{default}{choices}{where}")
        if k.doc:
            lines.append(f"    {k.doc}")
    return "\n".join(lines)


# ------------------------------------------------------------------ JSON Schema

_JSON = {
    int: "integer",
    float: "number",
    bool: "boolean",
    str: "string",
    dict: "object",
    list: "array",
    tuple: "array",
    type(None): "null",
}


def _field_schema(annotation: Any, field: dataclasses.Field | None) -> dict[str, Any]:
    components = _components(annotation)
    if components:
        variants = [schema_of(c) for c in components]
        kinds = [kind for c in components for kind in (_kinds(c) or ())]
        short = {"type": "string", **({"enum": kinds} if kinds else {})}
        if AttentionConfig in components:
            short = {"type": "string", "description": "an attention's name (`jxformers list`)"}
        options = [short, *variants] + ([{"type": "null"}] if type(None) in _options(annotation) else [])
        out: dict[str, Any] = {"anyOf": options}
    else:
        types_ = [_JSON.get(typing.get_origin(o) or o, "object") for o in _options(annotation)]
        out = {"type": types_[0] if len(types_) == 1 else types_}
    if field is not None:
        if field.metadata.get("doc"):
            out["description"] = field.metadata["doc"]
        choices = field.metadata.get("choices")
        if choices:
            out["enum"] = list(choices)
        default = _default(field)
        if default not in ("(component)", "(required)"):
            out["default"] = default
    return out


def schema_of(cls: type) -> dict[str, Any]:
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    out: dict[str, Any] = {
        "type": "object",
        "description": " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()),
        "properties": {f.name: _field_schema(hints[f.name], f) for f in fields},
        "additionalProperties": cls is AttentionConfig,  # an attention's hyper-parameters sit beside its name
    }
    required = [f.name for f in fields if _default(f) == "(required)"]
    if required:
        out["required"] = required
    if cls is AttentionConfig:
        out["properties"].pop("hyper_parameters")
    return out


def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of an experiment file."""
    properties: dict[str, Any] = {
        "name": {"type": "string", "description": "the run's name (logs, plots)"},
        "preset": {"type": ["string", "null"], "description": "one of this file's presets, merged over it"},
        "presets": {
            "type": "object",
            "description": "named partial configs (sections merged over the file)",
            "additionalProperties": {"type": "object"},
        },
    }
    properties |= {name: schema_of(cls) for name, cls in sections().items()}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "jxformers experiment",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }


def describe_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="jxformers describe",
        description="print what experiment keys mean: type, "
        "default, allowed values and doc (a section or component: all its keys)",
    )
    p.add_argument("key", nargs="?", default=None, help="e.g. train.learning_rate, model.ffn, model.stack.mem_len")
    args = p.parse_args(argv)
    try:
        print(describe(args.key))
    except ValueError as error:
        p.error(str(error))
    return 0


def schema_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jxformers schema", description="print the JSON Schema of an experiment file")
    p.parse_args(argv)
    print(json.dumps(schema(), indent=1, default=str))
    return 0
