"""Binding a config's attention: its registered op with the hyper-parameters, checked
against the model's max_len (`bind_attention`), and the warning when the result is no
sparser than softmax at that length (`ShortSequenceWarning`)."""

import warnings

from jxformers import registry
from jxformers.nn.config.components import AttentionConfig


class ShortSequenceWarning(UserWarning):
    """An attention's hyper-parameters make it dense at the model's max_len (a window or
    blocks spanning the whole sequence, a low-rank summary no shorter than it): it then
    costs at least softmax's time and memory and saves nothing. Silence it with
    `warnings.simplefilter("ignore", ShortSequenceWarning)`."""


def warn_if_dense(bound: registry.BoundAttention, max_len: int) -> None:
    """ShortSequenceWarning when `bound` is no sparser (or lower-rank) than softmax at max_len:
    when how far one query reaches (its registration's `dense_width`) reaches max_len.
    Defaults were chosen for sequences in the thousands (BigBird's default blocks at
    N = 256 take 2.5x softmax's memory)."""
    name, width = bound.spec.name, bound.width(max_len)
    if width is None or bound.spec.dense_width is None:
        return
    what = bound.spec.dense_width[0]
    if width >= max_len:
        warnings.warn(
            f"{name} attention at max_len {max_len}: {what} spans {width} >= {max_len}, so it is dense at this "
            f"length and costs at least softmax's time and memory; use softmax, or smaller hyper-parameters "
            f"(now {dict(bound.hyper_parameters)})",
            ShortSequenceWarning,
            stacklevel=3,
        )


def bind_attention(attention: AttentionConfig | str, max_len: int) -> registry.BoundAttention:
    """The attention bound with its hyper-parameters. The one that bounds the sequence
    length (the spec's `covers_length`, e.g. Linformer's `max_len`) defaults to the
    model's max_len and may not be smaller. The component's `impl` fills the op's `impl`;
        an attention without a kernel takes only the values of `IMPLS` that need none (auto, xla)."""
    attention = AttentionConfig.from_value(attention)
    name, impl = attention.name, attention.impl
    spec = registry.get(name)
    hyper_parameters = dict(attention.hyper_parameters)
    if any(p.name == "impl" for p in spec.hyper_parameters):
        hyper_parameters["impl"] = impl
    elif impl not in ("auto", "xla"):
        with_kernels = [n for n in registry.names() if any(p.name == "impl" for p in registry.get(n).hyper_parameters)]
        raise ValueError(
            f"impl {impl!r}: {name} attention has no Pallas kernel; attentions with one: {with_kernels} "
            "(set impl per layer with stack.layer_overrides)"
        )
    role = spec.covers_length
    if role is not None:
        hyper_parameters.setdefault(role, max_len)
    bound = spec.bind(**hyper_parameters)
    if role is not None and bound.hyper_parameters[role] < max_len:
        raise ValueError(
            f"{name}: attention {role} ({bound.hyper_parameters[role]}) must cover the model's max_len ({max_len})"
        )
    warn_if_dense(bound, max_len)
    return bound
