"""One validator for typed, frozen config dataclasses (experiment sections, `ModelConfig`).

    @typing.no_type_check
    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        steps: int = 1000
        learning_rate: float = 1e-3
        clip_norm: float | None = 1.0

        def __post_init__(self):
            check_fields(self, "train.", {"optimizer": ("adamw", "radam")})
            ...range checks...

    TrainConfig(**values)                       # typed errors from check_fields
    from_mapping(TrainConfig, values, "train")  # + unknown keys, listing the known ones

Fields may be declared with `setting(default, doc, choices=...)`: the one-line doc and the
allowed values live at the field (`check_fields` reads the choices, `describe` prints them).

`check_fields` checks each field's value against its annotation: `int` (not a bool),
`float` (an int is accepted and converted; so is a numeric string, because YAML 1.1
reads `1e-3` as a string), `bool`, `str`, `dict`, `list`, and unions such as
`int | None`. `choices` maps a field name to its allowed values. Errors are
ValueErrors whose names start with `prefix` ("train." gives "train.steps must be int;
got 'ten'"; "config " gives "config num_layers must be int; got '2'").

Decorate the dataclass with `@typing.no_type_check`: values come from users' YAML, and
the runtime type checker (jaxtyping + beartype in tests) would otherwise reject them
before these checks can name the key and the allowed values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_SIMPLE = (int, float, bool, str, dict, list)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # typing.get_type_hints returns {} for @typing.no_type_check classes; inspect does not.
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        hints |= inspect.get_annotations(klass, eval_str=True)
    return hints


def _options(annotation: Any) -> tuple[Any, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _base(option: Any) -> Any:
    """`dict[str, int]` -> dict; other annotations unchanged."""
    return typing.get_origin(option) or option


def _name(option: Any) -> str:
    option = _base(option)
    return "None" if option is type(None) else getattr(option, "__name__", str(option))


@typing.no_type_check
def check_value(name: str, value: Any, annotation: Any) -> Any:
    """`value` if it fits `annotation`, converted where that is lossless and meant (an int
    or a numeric string for a float); otherwise a ValueError naming `name`."""
    options = _options(annotation)
    for option in options:
        base = _base(option)
        if option is Any:
            return value
        if base is type(None) and value is None:
            return value
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (bool, str, dict, list) and isinstance(value, base):
            return value
        if base not in _SIMPLE and base is not type(None) and isinstance(base, type) and isinstance(value, base):
            return value
    if float in [_base(o) for o in options] and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    allowed = " or ".join(_name(o) for o in options)
    raise ValueError(f"{name} must be {allowed}; got {value!r}")


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, choices: tuple | None = None,
            factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its one-line `doc` and allowed values (`choices`) beside its
    default (`factory` for a mutable default); `check_fields` enforces the choices."""
    metadata = {"doc": doc, "choices": choices}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def defaults(cls: type) -> dict[str, Any]:
    """{field: default} of a dataclass (fields without a default are left out)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


@typing.no_type_check
def check_fields(instance: Any, prefix: str, choices: Mapping[str, tuple] | None = None) -> None:
    """Check (and where meant, convert in place) every field of a dataclass `instance`
    against its annotation, then against its allowed values (`choices`, field name ->
    allowed values, or the field's `setting(choices=...)`).
    Call it first in `__post_init__`; frozen instances are supported."""
    hints = _hints(type(instance))
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        checked = check_value(f"{prefix}{field.name}", value, hints[field.name])
        if checked is not value:
            object.__setattr__(instance, field.name, checked)
        allowed = (choices or {}).get(field.name, field.metadata.get("choices"))
        if allowed is not None and checked not in allowed:
            raise ValueError(f"{prefix}{field.name} must be one of {list(allowed)}; got {checked!r}")


@typing.no_type_check
def check_at_least(instance: Any, prefix: str, minimum: int | float, *names: str) -> None:
    """ValueError "{prefix}{name} must be >= {minimum}; got {value}" for the first field
    of `names` below `minimum`."""
    for name in names:
        value = getattr(instance, name)
        if value < minimum:
            raise ValueError(f"{prefix}{name} must be >= {minimum}; got {value}")


@typing.no_type_check
def from_mapping(cls: type[T], values: Mapping[str, Any] | None, section: str, *,
                 unknown_message: str = "{section}: unknown key(s) {unknown}; known: {known}") -> T:
    """`cls(**values)` after refusing keys that are not fields of `cls` (the error lists
    the known ones, sorted); missing keys take the dataclass defaults."""
    values = {} if values is None else values
    if not isinstance(values, Mapping):
        raise ValueError(f"{section} must be a mapping of keys to values; got {values!r}")
    known = sorted(f.name for f in dataclasses.fields(cls))
    unknown = sorted(set(values) - set(known), key=str)
    if unknown:
        raise ValueError(unknown_message.format(section=section, unknown=unknown, known=known))
    return cls(**values)
