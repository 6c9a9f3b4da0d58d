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


# How far one query reaches, in keys (or, for the low-rank and kernelized ones, the rows
# or features it summarises the keys into), from the pattern each op's docstring defines.
# Defaults were chosen for sequences in the thousands; at a max_len this width reaches
# the op is dense (BigBird's default blocks at N = 256 take 2.5x softmax's memory).
_WIDTH = {
    "local": ("its window (2 window + 1 keys)", lambda hp, n: 2 * hp["window"] + 1),
    "longformer": ("its window and globals (2 window + 1 + globals keys)",
                   lambda hp, n: 2 * hp["window"] + 1 + len(hp["global_indices"])),
    "block_local": ("its block (block_size keys)", lambda hp, n: hp["block_size"]),
    "bigbird": ("its blocks (block_size x (window + global + random blocks) keys)",
                lambda hp, n: hp["block_size"] * (hp["num_window_blocks"] + hp["num_global_blocks"]
                                                  + hp["num_random_blocks"])),
    "sparse_transformer": ("its pattern (stride + max_len / stride keys)",
                           lambda hp, n: hp["stride"] + -(-n // hp["stride"]) * (
                               hp["num_summary"] if hp["pattern"] == "fixed" else 1)),
    "axial": ("its row and column (width + max_len / width keys)", lambda hp, n: hp["width"] + -(-n // hp["width"])),
    "linformer": ("its projected length (proj_len)", lambda hp, n: hp["proj_len"]),
    "nystrom": ("its landmarks (num_landmarks)", lambda hp, n: hp["num_landmarks"]),
    "induced": ("its inducing points (num_inducing)", lambda hp, n: hp["num_inducing"]),
    "performer": ("its random features (num_features)", lambda hp, n: hp["num_features"]),
    "rfa": ("its random features (num_features)", lambda hp, n: hp["num_features"]),
    "lsh": ("its chunks (2 chunk_size keys per hash round)", lambda hp, n: 2 * hp["chunk_size"]),
    "routing": ("its clusters (max_len / n_clusters keys)", lambda hp, n: -(-n // hp["n_clusters"])),
    "sinkhorn": ("its own and sorted blocks (2 block_size keys)", lambda hp, n: 2 * hp["block_size"]),
    "clusterformer": ("its chunks (chunk_size keys)", lambda hp, n: hp["chunk_size"]),
    "etc": ("its local radius and global tokens (2 local_radius + 1 + num_global keys per long token)",
            lambda hp, n: 2 * hp["local_radius"] + 1 + hp["num_global"]),
    "image_local_2d": ("its memory block ((memory_height + query_height) x (query_width + 2 memory_width) pixels)",
                       lambda hp, n: (hp["memory_height"] + hp["query_height"])
                       * (hp["query_width"] + 2 * hp["memory_width"])),
}


def warn_if_dense(bound: registry.BoundAttention, max_len: int) -> None:
    """ShortSequenceWarning when `bound` is no sparser (or lower-rank) than softmax at max_len."""
    name = bound.spec.name
    if name not in _WIDTH:
        return
    what, width_of = _WIDTH[name]
    width = width_of(bound.hyper_parameters, max_len)
    if width >= max_len:
        warnings.warn(
            f"{name} attention at max_len {max_len}: {what} spans {width} >= {max_len}, so it is dense at this "
            f"length and costs at least softmax's time and memory; use softmax, or smaller hyper-parameters "
            f"(now {dict(bound.hyper_parameters)})",
            ShortSequenceWarning, stacklevel=3,
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
        raise ValueError(f"impl {impl!r}: {name} attention has no Pallas kernel; attentions with one: {with_kernels} "
                         "(set impl per layer with stack.layer_overrides)")
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
