"""The attention registry: name -> op, typed hyper-parameters, capabilities.

    >>> from jxformers import registry
    >>> registry.names()
    ['softmax', 'chunked', 'local', ...]
    >>> spec = registry.get("local")
    >>> spec.causal, spec.kv_mask, spec.cross, spec.decode
    (True, True, False, False)
    >>> out = spec(q, k, v, causal=True, window=8)

Every registered attention is called the same way through its spec:
`spec(q, k, v, *, arrays=None, causal=False, kv_mask=None, **hyper_parameters)`, where
`arrays` holds what the op needs besides q/k/v (learned kernels, a PRNG key for a random
pattern) as made by `spec.init_arrays(key, ...)`. Unknown names, unknown or ill-typed
hyper-parameters and unsupported capabilities are ValueErrors listing what exists.
The generic test suite iterates over this registry, so a new attention is tested the
moment it is registered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jxformers import ops


@dataclasses.dataclass(frozen=True)
class Param:
    """One hyper-parameter: a static Python value (never traced)."""

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None
    init_only: bool = False  # shapes the arrays made by `init_arrays`; not passed to the op

    def check(self, attention: str, value: Any) -> Any:
        if self.type is tuple:
            ok = isinstance(value, (tuple, list)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
            value = tuple(value) if ok else value
        elif self.type is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.type) and not (self.type is int and isinstance(value, bool))
        if not ok:
            raise ValueError(
                f"{attention}: hyper-parameter {self.name!r} must be {self.type.__name__}; got {value!r}"
            )
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{attention}: {self.name} must be one of {list(self.choices)}; got {value!r}")
        return value


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """What the registry knows about one attention.

    Fields:
        name: registry name. op: the pure function in `jxformers.ops`.
        family: survey family (Tay et al.): "exact", "fixed pattern", "downsampling"...
        paper: citation. complexity: time complexity in N (sequence length).
        params: typed hyper-parameters with defaults.
        causal / kv_mask / cross / bias: what the op supports: a causal mask, padding
            masks, queries and keys of different lengths, an additive logit bias (ALiBi,
            T5 relative positions).
        decoder: how `jxformers.decoding` decodes it one token at a time: "cache" (a
            preallocated key/value cache), "window" (a ring buffer of the window),
            "recurrent" (the constant-size state (S, Z) of kernelized attention), or
            None (no incremental decoding). `decode` is True when it has one.
        drawn: names of arrays made by `init_arrays` that are drawn at random rather
            than learned (Performer's projection, BigBird's key): modules hold them
            out of the gradient and resample them with `redraw(key)`.
        exact: equals `softmax_attention` under some explicit mask (tested).
        content_based: the weights depend on q and k (False for FNet and Synthesizer,
            whose mixing ignores them).
        init_arrays: makes the op's array arguments (learned weights, drawn features or a
            PRNG key) from `(key, *, heads, kv_heads, d_k, d_v, **hyper_parameters)`;
            None if it needs none.
    """

    name: str
    op: Callable
    family: str
    paper: str
    complexity: str
    params: tuple[Param, ...] = ()
    causal: bool = False
    decoder: str | None = None
    kv_mask: bool = True
    cross: bool = False
    bias: bool = False
    drawn: tuple[str, ...] = ()
    exact: bool = True
    content_based: bool = True
    init: Callable[..., dict[str, Any]] | None = None

    def __post_init__(self):
        if self.decoder not in DECODERS:
            raise ValueError(f"{self.name}: decoder must be one of {DECODERS}; got {self.decoder!r}")

    @property
    def decode(self) -> bool:
        return self.decoder is not None

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def validate(self, hyper_parameters: Mapping[str, Any]) -> dict[str, Any]:
        """Hyper-parameters filled with defaults and type-checked; ValueError otherwise."""
        known = {p.name: p for p in self.params}
        unknown = sorted(set(hyper_parameters) - set(known))
        if unknown:
            raise ValueError(
                f"{self.name}: unknown hyper-parameter(s) {unknown}; known: {sorted(known) or 'none'}"
            )
        merged = self.defaults() | dict(hyper_parameters)
        return {name: known[name].check(self.name, value) for name, value in merged.items()}

    def init_arrays(
        self, key: jax.Array, *, heads: int, kv_heads: int, d_k: int, d_v: int, **hyper_parameters
    ) -> dict[str, Any]:
        """The op's array arguments (empty when it needs none)."""
        if self.init is None:
            return {}
        hp = self.validate(hyper_parameters)
        return self.init(key, heads=heads, kv_heads=kv_heads, d_k=d_k, d_v=d_v, **hp)

    def __call__(
        self, q, k, v, *, arrays: Mapping[str, Any] | None = None, causal: bool = False, kv_mask=None, bias=None,
        **hyper_parameters,
    ):
        hp = self.validate(hyper_parameters)
        if bias is not None and not self.bias:
            raise ValueError(
                f"{self.name} attention does not take an additive bias (ALiBi, T5 relative positions); "
                f"ones that do: {names(bias=True)}"
            )
        if causal and not self.causal:
            raise ValueError(f"{self.name} attention does not support causal=True; causal ones: {names(causal=True)}")
        if kv_mask is not None and not self.kv_mask:
            raise ValueError(f"{self.name} attention does not support kv_mask; ones that do: {names(kv_mask=True)}")
        passed = {p.name for p in self.params if not p.init_only}
        kwargs = {n: v for n, v in hp.items() if n in passed} | dict(arrays or {})
        if self.causal:
            kwargs["causal"] = causal
        if kv_mask is not None:
            kwargs["kv_mask"] = kv_mask
        if bias is not None:
            kwargs["bias"] = bias
        return self.op(q, k, v, **kwargs)


DECODERS = (None, "cache", "window", "recurrent")
_REGISTRY: dict[str, AttentionSpec] = {}


def register(spec: AttentionSpec) -> AttentionSpec:
    """Add an attention; its name must be new."""
    if spec.name in _REGISTRY:
        raise ValueError(f"attention {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def names(**capabilities: bool) -> list[str]:
    """Registered names in registration order, optionally filtered by capability flags,
    e.g. `names(causal=True, decode=True)`."""
    return [n for n, s in _REGISTRY.items() if all(getattr(s, c) == want for c, want in capabilities.items())]


def get(name: str) -> AttentionSpec:
    """The spec registered under `name`; ValueError listing the names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


# ----------------------------------------------------------------------------- entries


def _conv_kernels(key, *, kv_heads, d_k, d_v, stride, **_):
    kk, kv = jax.random.split(key)
    std_k = 1.0 / math.sqrt(stride * kv_heads * d_k)
    std_v = 1.0 / math.sqrt(stride * kv_heads * d_v)
    return {
        "k_kernel": std_k * jax.random.normal(kk, (stride, kv_heads * d_k, kv_heads * d_k)),
        "v_kernel": std_v * jax.random.normal(kv, (stride, kv_heads * d_v, kv_heads * d_v)),
    }


def _bigbird_key(key, **_):
    return {"key": key}


register(AttentionSpec(
    "softmax", ops.softmax_attention, "exact", "Vaswani et al. 2017", "O(N^2)",
    causal=True, decoder="cache", cross=True, bias=True,
))
register(AttentionSpec(
    "chunked", ops.chunked_attention, "exact", "Rabe & Staats 2021", "O(N^2) time, O(N*chunk) memory",
    (Param("chunk_size", int, 512, "queries and keys per chunk"),),
    causal=True, decoder="cache", cross=True,
))
register(AttentionSpec(
    "local", ops.local_attention, "fixed pattern", "Parmar et al. 2018; Beltagy et al. 2020", "O(N*w)",
    (Param("window", int, 128, "keys each side (behind when causal)"),),
    causal=True, decoder="window",
))
register(AttentionSpec(
    "block_local", ops.block_local_attention, "fixed pattern", "Parmar et al. 2018; Qiu et al. 2019", "O(N*b)",
    (Param("block_size", int, 128, "tokens per block"),),
    causal=True,
))
register(AttentionSpec(
    "dilated", ops.dilated_attention, "fixed pattern", "Beltagy et al. 2020", "O(N*w)",
    (Param("window", int, 64, "attended keys each side"), Param("dilation", int, 2, "stride between attended keys")),
    causal=True,
))
register(AttentionSpec(
    "sparse_transformer", ops.sparse_transformer_attention, "fixed pattern", "Child et al. 2019", "O(N*sqrt(N))",
    (
        Param("stride", int, 64, "s, about sqrt(N)"),
        Param("pattern", str, "strided", "strided or fixed", choices=("strided", "fixed")),
        Param("num_summary", int, 1, "c, summary positions per block (fixed)"),
    ),
    causal=True,
))
register(AttentionSpec(
    "longformer", ops.longformer_attention, "fixed pattern", "Beltagy et al. 2020", "O(N*(w+g))",
    (Param("window", int, 128, "keys each side"), Param("global_indices", tuple, (0,), "positions of global tokens")),
    causal=True,
))
register(AttentionSpec(
    "bigbird", ops.bigbird_attention, "fixed pattern", "Zaheer et al. 2020", "O(N*b*(w+g+r))",
    (
        Param("block_size", int, 64, "tokens per block"),
        Param("num_random_blocks", int, 3, "random key blocks per query block"),
        Param("num_window_blocks", int, 3, "sliding window in blocks (odd)"),
        Param("num_global_blocks", int, 2, "global blocks (first and last)"),
    ),
    init=_bigbird_key, drawn=("key",),
))
register(AttentionSpec(
    "axial", ops.axial_attention, "fixed pattern", "Ho et al. 2019", "O(N*(W+N/W))",
    (
        Param("width", int, 64, "grid columns"),
        Param("order", str, "row_then_column", "passes", choices=("row", "column", "row_then_column")),
    ),
    causal=True,
))
register(AttentionSpec(
    "memory_compressed", ops.memory_compressed_attention, "downsampling", "Liu et al. 2018", "O(N^2/s)",
    (Param("stride", int, 3, "convolution stride and kernel size", init_only=True),),
    causal=True, cross=True, exact=False, init=_conv_kernels,
))


def _performer_projection(key, *, d_k, num_features, orthogonal, **_):
    return {"projection": ops.performer_projection(key, num_features, d_k, orthogonal=orthogonal)}


def _rfa_projection(key, *, d_k, num_features, sigma, **_):
    return {"projection": ops.performer_projection(key, num_features, d_k) / sigma}


def _linformer_projections(key, *, proj_len, max_len, **_):
    ke, kf = jax.random.split(key)
    std = 1.0 / math.sqrt(max_len)  # nn.Linear(max_len, proj_len)'s scale, as the paper's code
    return {
        "e_proj": std * jax.random.normal(ke, (proj_len, max_len)),
        "f_proj": std * jax.random.normal(kf, (proj_len, max_len)),
    }


def _synthesizer_weights(key, *, heads, d_k, kind, hidden, max_len, rank, **_):
    k1, k2, k3 = jax.random.split(key, 3)
    if kind == "dense":
        return {
            "w1": jax.random.normal(k1, (heads, d_k, hidden)) / math.sqrt(d_k),
            "b1": jnp.zeros((heads, hidden)),
            "w2": jax.random.normal(k2, (heads, hidden, max_len)) / math.sqrt(hidden),
        }
    if kind == "random":
        return {"random": jax.random.normal(k3, (heads, max_len, max_len))}
    return {
        "factor_a": jax.random.normal(k1, (heads, max_len, rank)) / rank**0.25,
        "factor_b": jax.random.normal(k2, (heads, max_len, rank)) / rank**0.25,
    }


def _inducing_points(key, *, heads, d_k, d_v, num_inducing, **_):
    ki, ku = jax.random.split(key)
    arrays = {"inducing": jax.random.normal(ki, (num_inducing, heads, d_k))}
    if d_v != d_k:
        arrays["unpack_keys"] = jax.random.normal(ku, (heads, d_v, d_k)) / math.sqrt(d_v)
    return arrays


_CHUNK = Param("chunk_size", int, 64, "chunk of the causal chunked form")
_FORM = Param("form", str, "chunked", "causal form", choices=ops.kernelized.FORMS)

register(AttentionSpec(
    "linear", ops.linear_attention, "kernelized", "Katharopoulos et al. 2020", "O(N*d^2)",
    (Param("feature_map", str, "elu", "phi", choices=("elu", "relu", "identity")), _CHUNK, _FORM),
    causal=True, cross=True, exact=False, decoder="recurrent",
))
register(AttentionSpec(
    "performer", ops.performer_attention, "kernelized", "Choromanski et al. 2021", "O(N*m*d)",
    (
        Param("num_features", int, 256, "random features m", init_only=True),
        Param("orthogonal", bool, True, "orthogonal random features", init_only=True),
        Param("kernel", str, "softmax", "softmax (FAVOR+) or relu", choices=("softmax", "relu")),
        _CHUNK, _FORM,
    ),
    causal=True, cross=True, exact=False, init=_performer_projection, drawn=("projection",), decoder="recurrent",
))
register(AttentionSpec(
    "rfa", ops.rfa_attention, "kernelized", "Peng et al. 2021", "O(N*m*d)",
    (
        Param("num_features", int, 128, "random Fourier features m", init_only=True),
        Param("sigma", float, 1.0, "Gaussian kernel width", init_only=True),
        _CHUNK, _FORM,
    ),
    causal=True, cross=True, exact=False, init=_rfa_projection, drawn=("projection",), decoder="recurrent",
))
register(AttentionSpec(
    "linformer", ops.linformer_attention, "low rank", "Wang et al. 2020", "O(N*k)",
    (
        Param("proj_len", int, 256, "projected length k", init_only=True),
        Param("max_len", int, 4096, "longest sequence the projections cover", init_only=True),
    ),
    cross=True, exact=False, init=_linformer_projections,
))
register(AttentionSpec(
    "synthesizer", ops.synthesizer_attention, "learnable pattern", "Tay et al. 2021", "O(N^2)",
    (
        Param("kind", str, "random", "synthetic logits", choices=ops.lowrank.SYNTHESIZER_KINDS),
        Param("dot_weight", float, 0.0, "weight of dot-product logits mixed in"),
        Param("hidden", int, 64, "dense: hidden width", init_only=True),
        Param("max_len", int, 512, "longest sequence", init_only=True),
        Param("rank", int, 8, "factorized: rank", init_only=True),
    ),
    causal=True, cross=True, exact=False, content_based=False, init=_synthesizer_weights,
))
register(AttentionSpec(
    "nystrom", ops.nystrom_attention, "low rank", "Xiong et al. 2021", "O(N*m + m^3)",
    (Param("num_landmarks", int, 64, "landmarks m"), Param("pinv_iterations", int, 6, "pseudo-inverse iterations")),
    cross=True, exact=False,
))
register(AttentionSpec(
    "induced", ops.induced_attention, "memory", "Lee et al. 2019 (ISAB); Ma et al. 2021 (Luna)", "O(N*m)",
    (Param("num_inducing", int, 32, "inducing points m", init_only=True),),
    cross=True, exact=False, init=_inducing_points,
))
register(AttentionSpec(
    "fnet", ops.fnet_attention, "fourier", "Lee-Thorp et al. 2021", "O(N log N)",
    exact=False, content_based=False,
))


def models(spec: AttentionSpec) -> str:
    """The model types an attention can serve in (`jxformers.ModelConfig.task`):
    every attention fits an encoder (classify, retrieval); causal ones also a language
    model and an encoder-decoder; "+decode" when it decodes incrementally."""
    kinds = ["classify", "retrieval"] + (["lm", "seq2seq"] if spec.causal else [])
    return " ".join(kinds) + (" +decode" if spec.decode else "")


def table() -> str:
    """The registry as a plain-text table (what `jxformers list` prints)."""
    head = ("name", "family", "causal", "kv_mask", "cross", "bias", "decoder", "models", "complexity",
            "hyper-parameters (defaults)")
    rows = [head]
    for s in _REGISTRY.values():
        hp = ", ".join(f"{p.name}={p.default!r}" for p in s.params) or "-"
        flags = ("yes" if f else "-" for f in (s.causal, s.kv_mask, s.cross, s.bias))
        rows.append((s.name, s.family, *flags, s.decoder or "-", models(s), s.complexity, hp))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
