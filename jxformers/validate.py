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
allowed values live at the field (`check_fields` reads the choices and limits, `describe` prints them).

`check_value` is the one validator of single values: config fields go through it, and so
do attentions' hyper-parameters (`jxformers.registry`: `spec.bind(...)`).

`check_fields` checks each field's value against its annotation: `int` (not a bool),
`float` (an int is accepted and converted; so is a numeric string, because YAML 1.1
reads `1e-3` as a string), `bool`, `str`, `dict`, `list`, a tuple of ints (a list is
accepted and converted), a callable, and unions such as `int | None`. `choices` maps a
field name to its allowed values; `Limits` says which numbers a field allows. Errors are
ValueErrors whose names start with `prefix` ("train." gives "train.steps must be int;
got 'ten'"; "config " gives "config num_layers must be int; got '2'").

Decorate the dataclass with `@typing.no_type_check`: values come from users' YAML, and
the runtime type checker (jaxtyping + beartype in tests) would otherwise reject them
before these checks can name the key and the allowed values.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import numbers
import types
import typing
from collections.abc import Callable, Mapping
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


def _is_sequence(base: Any) -> bool:
    return base in (tuple, collections.abc.Sequence)


def type_name(option: Any) -> str:
    base = _base(option)
    if _is_sequence(base):
        element = (typing.get_args(option) or (Any,))[0]
        return "tuple" if element is Any else f"tuple of {type_name(element)}s"
    if base is collections.abc.Callable:
        return "callable"
    return "None" if base is type(None) else getattr(base, "__name__", str(base))


@dataclasses.dataclass(frozen=True)
class Limits:
    """The numbers a value allows beyond its type (an int or float, or each int of a
    tuple): `minimum` and `maximum` are inclusive bounds, `above` and `below` exclusive
    ones, `odd` asks for an odd int, and `rule = (predicate, words)` says anything else
    (`(lambda n: n == 1 or n % 2 == 0, "1 or even")`). `str(limits)` is what the
    errors and `jxformers list NAME` show: ">= 1", "> 0 and < 1", ">= 1 and 1 or even"."""

    minimum: int | float | None = None
    above: int | float | None = None
    maximum: int | float | None = None
    below: int | float | None = None
    odd: bool = False
    rule: tuple[Callable[[Any], bool], str] | None = None

    def __str__(self) -> str:
        parts = [
            f"{sign} {bound}"
            for sign, bound in ((">=", self.minimum), (">", self.above), ("<=", self.maximum), ("<", self.below))
            if bound is not None
        ]
        parts += ["odd"] * self.odd + ([self.rule[1]] if self.rule else [])
        return " and ".join(parts) or "any number"

    def allows(self, value: int | float) -> bool:
        return (
            (self.minimum is None or value >= self.minimum)
            and (self.above is None or value > self.above)
            and (self.maximum is None or value <= self.maximum)
            and (self.below is None or value < self.below)
            and (not self.odd or value % 2 == 1)
            and (self.rule is None or bool(self.rule[0](value)))
        )

    @classmethod
    def of(cls, given: Limits | int | float) -> Limits:
        """`Limits` as given, or a bare number as the minimum (`0` -> `Limits(minimum=0)`)."""
        if isinstance(given, Limits):
            return given
        if isinstance(given, bool) or not isinstance(given, (int, float)):
            raise ValueError(f"limits must be a Limits or a minimum number; got {given!r}")
        return cls(minimum=given)


@typing.no_type_check
def check_value(
    name: str, value: Any, annotation: Any, *, choices: tuple | None = None, limits: Limits | None = None
) -> Any:
    """`value` if it fits `annotation`, then `choices` (its allowed values; a callable,
    where the annotation takes one, is the alternative to named choices and is not
    checked against them) and `limits` (numbers: `Limits`), converted where that is
    lossless and meant (an int or a numeric string for a float, a list of ints for a
    tuple); otherwise a ValueError naming `name`, the value and what is allowed."""
    value = _check_type(name, _python_scalar(value), annotation)
    if choices is not None and (isinstance(value, str) or not callable(value)) and value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}; got {value!r}")
    if limits is not None:
        numbers = value if isinstance(value, tuple) else (value,)
        for number in numbers:
            if isinstance(number, (int, float)) and not isinstance(number, bool) and not limits.allows(number):
                each = " (each)" if isinstance(value, tuple) else ""
                raise ValueError(f"{name} must be {limits}{each}; got {value!r}")
    return value


def _python_scalar(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (np.int64(8) -> 8, np.float32 -> float,
    np.bool_ -> bool), so that a value a user computed with NumPy is taken where the Python
    one is; anything else unchanged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__name__ == "bool_":
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


@typing.no_type_check
def _check_type(name: str, value: Any, annotation: Any) -> Any:
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
        if _is_sequence(base) and isinstance(value, (tuple, list)):
            element = (typing.get_args(option) or (Any,))[0]
            try:
                return tuple(_check_type(name, x, element) for x in value)
            except ValueError:
                continue
        if base is collections.abc.Callable and callable(value) and not isinstance(value, str):
            return value
        if (
            base not in _SIMPLE
            and base is not type(None)
            and not _is_sequence(base)
            and isinstance(base, type)
            and isinstance(value, base)
        ):
            return value
    if float in [_base(o) for o in options] and isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            return float(value)
        except ValueError:
            pass
    allowed = " or ".join(type_name(o) for o in options)
    raise ValueError(f"{name} must be {allowed}; got {value!r}")


def setting(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    choices: tuple | None = None,
    limits: Limits | int | float | None = None,
    factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its one-line `doc` and allowed values (`choices`; `limits`
    for a number: a `Limits`, or a bare minimum) beside its default (`factory` for a
    mutable default); `check_fields` enforces them."""
    metadata = {"doc": doc, "choices": choices, "limits": None if limits is None else Limits.of(limits)}
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
        allowed = (choices or {}).get(field.name, field.metadata.get("choices"))
        checked = check_value(
            f"{prefix}{field.name}", value, hints[field.name], choices=allowed, limits=field.metadata.get("limits")
        )
        if checked is not value:
            object.__setattr__(instance, field.name, checked)


@typing.no_type_check
def check_at_least(instance: Any, prefix: str, minimum: int | float, *names: str) -> None:
    """ValueError "{prefix}{name} must be >= {minimum}; got {value}" for the first field
    of `names` below `minimum` (a None field, an unset optional one, passes)."""
    for name in names:
        value = getattr(instance, name)
        if value is not None and value < minimum:
            raise ValueError(f"{prefix}{name} must be >= {minimum}; got {value}")


@typing.no_type_check
def from_mapping(
    cls: type[T],
    values: Mapping[str, Any] | None,
    section: str,
    *,
    unknown_message: str = "{section}: unknown key(s) {unknown}; known: {known}",
) -> T:
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
