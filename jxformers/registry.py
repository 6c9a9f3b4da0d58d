"""The attention registry's machinery: specs, hyper-parameters read from signatures,
binding, lookup. It holds no entries: each attention registers itself beside its op
(`jxformers/ops/<family>.py`), so an attention is defined in one place.

    >>> from jxformers import registry
    >>> registry.names()
    ['softmax', 'chunked', 'local', ...]
    >>> spec = registry.get("local")
    >>> spec.supports_causal, spec.supports_kv_mask, spec.supports_cross, spec.takes_bias, spec.decodes
    (True, True, False, False, True)
    >>> local = spec.bind(window=8)  # validated once; frozen and hashable
    >>> out = local(q, k, v, causal=True)

Hyper-parameters are the op's keyword-only arguments that take static Python values
(names, types and defaults from its signature), plus those of its array initialiser
(`init_arrays`) that only shape the arrays it makes (Performer's `num_features`).
A registration writes by hand only what a signature cannot say, and everything other
modules need to know about the attention: a doc line, the allowed choices and numbers
(`limits`) of each hyper-parameter, the capabilities, the decoder, the hyper-parameter
that must cover a model's length (`covers_length`), its row of the op table of docs/guide/ops.md
(`summary`, `complexity`: `markdown_table()`), how far one query reaches (`dense_width`,
for the warning where it is dense), its hyper-parameters for a given length (`scaled`:
`scaled(name, max_len)`, which `jxformers compare` trains with) and the width of the grid
it reads (`grid_width`).
Unknown names, unknown, ill-typed or out-of-range hyper-parameters and unsupported
capabilities are ValueErrors listing what exists or is allowed.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import importlib
import inspect
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping

from jxformers.validate import Limits, check_value, type_name

# Arguments every attention is called with, never hyper-parameters (`scale` keeps the
# op's 1/sqrt(d_k): an attention's temperature belongs to its query projection;
# `warn_unused_k`: a shared-QK op's warning about its unused `k`, which the binding
# silences because the registration declares it, see `AttentionSpec.shared_qk`).
CALL_ARGUMENTS = ("causal", "kv_mask", "mask", "bias", "scale", "warn_unused_k")
# Arguments of an array initialiser that come from the module's shapes.
SHAPE_ARGUMENTS = ("heads", "kv_heads", "d_k", "d_v")
# ... and of a token-input initialiser, which also sees the model width and whether the
# module is causal (to refuse, before any call, what needs a causal state).
TOKEN_SHAPE_ARGUMENTS = (*SHAPE_ARGUMENTS, "d_model", "causal")
# ... and of a training-time array update, which sees a batch of the module's inputs.
UPDATE_ARGUMENTS = ("arrays", "q", "k", "kv_mask")
_REQUIRED = inspect.Parameter.empty

INT32_MAX = 2**31 - 1  # the largest hyper-parameter a size or offset may be


# ----------------------------------------------------------------------------- hyper-parameters


def _is_array_type(tp) -> bool:
    if tp is jax.Array:
        return True
    return isinstance(tp, type) and issubclass(tp, jaxtyping.AbstractArray)


def _members(tp) -> tuple:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _is_static(tp) -> bool:
    """True when an annotation admits a static Python value (a hyper-parameter), False
    when it admits only arrays (or None alongside arrays): those are array arguments."""
    return any(m is not type(None) and not _is_array_type(m) for m in _members(tp))


@dataclasses.dataclass(frozen=True)
class HyperParameter:
    """One hyper-parameter: a static Python value (never traced).

    Fields:
        name, annotation, default: from the signature (`default` is `inspect.Parameter.empty`
            when the op requires it). doc, choices, limits: written in the registration
            (`limits`: the numbers it allows, a `jxformers.validate.Limits`).
        arrays_only: taken by the array initialiser (or the training-time array update)
            only, not by the op: it shapes the arrays (the op reads the shapes, not the
            value) or tunes the update.
    """

    name: str
    annotation: Any
    default: Any
    doc: str = ""
    choices: tuple[Any, ...] | None = None
    arrays_only: bool = False
    limits: Limits | None = None

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED

    @property
    def static_annotation(self) -> Any:
        """The annotation less its array members (an op may also take an array there)."""
        members = tuple(m for m in _members(self.annotation) if not _is_array_type(m))
        return members[0] if len(members) == 1 else typing.Union[members]  # noqa: UP007 (a runtime tuple)

    @property
    def numeric(self) -> bool:
        """An int or float (or a tuple of ints): the kind of value whose range a
        registration must declare (`limits`)."""

        def number(m) -> bool:
            if typing.get_origin(m) in (tuple, collections.abc.Sequence):
                return any(number(a) for a in typing.get_args(m))
            return m in (int, float)

        return any(number(m) for m in _members(self.static_annotation))

    def allowed(self) -> str:
        """What it allows, in words: its type, then its choices or limits."""
        words = " or ".join(type_name(m) for m in _members(self.static_annotation))
        if self.choices is not None:
            words += f", one of {list(self.choices)}"
        if self.limits is not None:
            words += f", {self.limits}"
        return words

    def check(self, attention: str, value: Any) -> Any:
        """The value, normalised (lists become tuples, ints for a float become floats);
        ValueError naming the attention, the hyper-parameter, the value and what is
        allowed when it does not fit (`jxformers.validate.check_value`, the one validator)."""
        name = f"{attention}: hyper-parameter {self.name}"
        value = check_value(name, value, self.static_annotation, choices=self.choices, limits=self.limits)
        for number in value if isinstance(value, tuple) else (value,):
            # sizes and offsets become int32 index arithmetic inside JAX, which would overflow
            if isinstance(number, int) and not isinstance(number, bool) and abs(number) > INT32_MAX:
                raise ValueError(f"{name} must be at most {INT32_MAX} in size (JAX indexes with int32); got {value!r}")
        return value


@functools.cache
def _takes(fn: Callable, argument: str) -> bool:
    """Whether `fn` has a parameter named `argument`."""
    return argument in inspect.signature(fn).parameters


@functools.cache
def _drawn_names(bound: BoundAttention, heads: int, kv_heads: int, d_k: int, d_v: int) -> tuple[str, ...]:
    """The names of the arrays `bound.init_arrays` draws at these sizes (traced, not drawn)."""
    sizes = {"heads": heads, "kv_heads": kv_heads, "d_k": d_k, "d_v": d_v}
    return tuple(sorted(jax.eval_shape(lambda key: bound.init_arrays(key, **sizes), jax.random.key(0))))


def _signature_parameters(fn: Callable, skip: tuple[str, ...]) -> dict[str, HyperParameter]:
    """The static keyword-only parameters of `fn`, as hyper-parameters."""
    hints = typing.get_type_hints(fn)
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name in skip:
            continue
        annotation = hints.get(p.name, type(p.default) if p.default is not _REQUIRED else Any)
        if _is_static(annotation):
            out[p.name] = HyperParameter(p.name, annotation, p.default)
    return out


# ----------------------------------------------------------------------------- decoders


@dataclasses.dataclass(frozen=True)
class Decoder:
    """How an attention decodes one token at a time, optax-style: a pair of pure
    functions over a state of fixed shape (built by the factories in
    `jxformers.decoding`).

    `init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> state`;
    `step(q [heads, d_k], k [kv_heads, d_k], v [kv_heads, d_v], state, *,
    hyper_parameters, arrays, bias_fn) -> (out [heads, d_v], state)`.
    """

    kind: str  # shown by `jxformers list`: "cache", "ring buffer", "recurrent"
    init: Callable[..., Any]
    step: Callable[..., tuple[Any, Any]]


# ----------------------------------------------------------------------------- token inputs


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """Op arguments computed from the layer's input tokens rather than from q, k, v
    (RFA's gate sigmoid(w . x_t + b), the dense Synthesizer's B_i = F(X_i)): the
    attention module owns their learned parameters and calls `apply` on its input.

    `init(key, *, d_model, heads, kv_heads, d_k, d_v, causal, <hyper-parameters>) -> params`
    (hyper-parameters it alone takes shape the parameters, like `init_arrays`'s);
    `apply(params, queries [q_len, d_model], keys [kv_len, d_model] or None,
    hyper_parameters) -> {op argument: array}`. `keys` is None in cross-attention
    decoding, where only the query token is at hand.
    """

    init: Callable[..., dict[str, Any]]
    apply: Callable[..., dict[str, Any]]


# ----------------------------------------------------------------------------- specs


@dataclasses.dataclass(frozen=True, eq=False)  # one spec per name: identity is equality
class AttentionSpec:
    """What the registry knows about one attention. Made by `register`.

    Fields:
        name: registry name. op: the pure function in `jxformers.ops`.
        family: survey family (Tay et al.): "exact", "fixed pattern", "kernelized"...
        paper: citation. complexity: time complexity in N (sequence length).
        hyper_parameters: from the op's (and the array initialiser's) signature.
        supports_causal: the op can mask the future (`causal=True`).
        causal_refusal: `fn(hyper_parameters) -> reason or None`: settings under which an
            op that supports causal cannot be (Star-Transformer's attended relay pools
            every token), so models refuse them at config time, not at the first call.
        causal_only: it is defined only as causal self-attention (the delta rule's fast
            weights are written token by token): `causal=False` is refused, so it serves
            language models alone.
        supports_kv_mask: padded keys (`kv_mask`) never change real outputs.
        supports_cross: queries and keys may have different lengths (cross-attention).
        takes_bias: the op adds a logit bias (ALiBi, T5 relative positions).
        decoder: how it decodes incrementally (`Decoder`), or None.
        init_arrays: makes the op's array arguments (learned weights, drawn features, a
            PRNG key) from `(key, *, heads, kv_heads, d_k, d_v, **its hyper-parameters)`;
            None when it needs none.
        drawn: names of arrays from `init_arrays` drawn at random rather than learned
            (Performer's projection, BigBird's key): modules keep them out of the
            gradient and resample them with `redraw(key)`.
        token_inputs: op arguments computed from the layer's input tokens (`TokenInputs`),
            or None; `reads_tokens` says the module must pass them.
        redrawn: training redraws the drawn arrays periodically (`nn.redraw`, every
            `train.redraw_every` steps: Performer's feature redrawing); False when the
            paper draws them once and keeps them for the run (BigBird's random pattern).
        exact: equals `softmax_attention` under some explicit mask (tested).
        content_based: the weights depend on q and k (False for FNet, Synthesizer).
        mixes_input: the op transforms the layer's input itself, with no projections
            (FNet's parameter-free Fourier sublayer): `nn.Attention` makes no W_Q, W_K,
            W_V, W_O and calls the op with the input `[seq, d_model]` as one head of
            width d_model in q, k and v (it reads v).
        covers_length: the hyper-parameter that bounds the sequence length (position-
            indexed weights: Linformer's, Synthesizer's `max_len`); models fill it with
            their own max_len and refuse a smaller one.
        shared_qk: the op takes its keys from the queries (Reformer's shared-QK
            attention): its `k` argument is unused (only its shape is checked). An op
            that warns about a `k` that is not `q` when called by hand takes
            `warn_unused_k`, which the binding sets to False: the registration already
            says so, and a module passes its projected keys.
        noise_key: the op argument that takes a fresh PRNG key on every training call
            (Sinkhorn's Gumbel noise); modules pass one when called with a key and not
            in inference, and none at inference.
        update_arrays_fn: state updated in training outside the gradient (Routing's
            k-means centroids): `fn(arrays, q [batch, q_len, heads, d_k], k [batch,
            kv_len, kv_heads, d_k], *, kv_mask [batch, kv_len] or None, <hyper-parameters>)
            -> {name: new array}` gives new values of drawn arrays from a batch of the
            module's inputs; the train step calls it after each step (`nn.update_arrays`).
        summary: what it computes, in one line (the op table of docs/guide/ops.md: for a pattern,
            when query i attends key j).
        dense_width: `(words, fn)`: how far one query reaches, in keys (or, for the
            low-rank and kernelized ones, the rows or features it summarises the keys
            into), `fn(hyper_parameters, max_len) -> int`, and that reach in words; a model
            whose max_len it reaches warns that the attention is dense there
            (`nn.config.ShortSequenceWarning`). None: no such width (softmax).
        scaled: `(words, fn)`: its hyper-parameters for a model of max_len N, sparse (or
            low-rank) there and within its paper's usual ratios, `fn(defaults, max_len) ->
            {name: value}` (the settings that differ from the defaults with the length; the
            defaults are passed so that a rule reads them rather than copying them), and the
            rule in words. `scaled(name, max_len)` checks the result against `dense_width` and
            raises `DenseAtLength` where even these settings reach every key. None: its
            defaults hold at every length (softmax; an op with no width, or dense by design).
        grid_width: the hyper-parameter giving the row width of the 2-D grid the op reads
            the sequence as (axial's and Image Transformer's `width`); an experiment on
            images warns when it is not the images' width.
        layer_shared: `fn(hyper_parameters) -> names` of the arrays from `init_arrays`
            that one model holds once for all its layers (Linformer's layerwise E), or
            None: each module holds its own (`BoundAttention.layer_shared`).
    """

    name: str
    op: Callable
    family: str
    paper: str
    complexity: str
    hyper_parameters: tuple[HyperParameter, ...]
    supports_causal: bool
    supports_kv_mask: bool
    supports_cross: bool
    takes_bias: bool
    causal_only: bool = False
    decoder: Decoder | None = None
    init_arrays_fn: Callable[..., dict[str, Any]] | None = None
    drawn: tuple[str, ...] = ()
    token_inputs: TokenInputs | None = None
    redrawn: bool = True
    exact: bool = True
    content_based: bool = True
    mixes_input: bool = False
    covers_length: str | None = None
    shared_qk: bool = False
    noise_key: str | None = None
    update_arrays_fn: Callable[..., dict[str, Any]] | None = None
    summary: str = ""
    dense_width: tuple[str, Callable[[Mapping[str, Any], int], int]] | None = None
    scaled: tuple[str, Callable[[Mapping[str, Any], int], dict[str, Any]]] | None = None
    grid_width: str | None = None
    causal_refusal: Callable[[Mapping[str, Any]], str | None] | None = None
    layer_shared: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None

    @property
    def updates_arrays(self) -> bool:
        return self.update_arrays_fn is not None

    @property
    def decodes(self) -> bool:
        return self.decoder is not None

    @property
    def reads_tokens(self) -> bool:
        return self.token_inputs is not None

    @property
    def takes_relative_values(self) -> bool:
        """The op adds Shaw et al. 2018's relative value term: its `relative_values`
        argument (a^V per clipped distance), read from its signature."""
        return _takes(self.op, "relative_values")

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.hyper_parameters if not p.required}

    def bind(self, **hyper_parameters) -> BoundAttention:
        """Validate the hyper-parameters once (defaults filled in) and return the frozen,
        hashable attention that modules hold and call."""
        known = {p.name: p for p in self.hyper_parameters}
        unknown = sorted(set(hyper_parameters) - set(known))
        if unknown:
            elsewhere = {
                n: [s.name for s in _REGISTRY.values() if n in {p.name for p in s.hyper_parameters}] for n in unknown
            }
            hints = "".join(f"; {n} is taken by {', '.join(found)}" for n, found in elsewhere.items() if found)
            raise ValueError(
                f"{self.name}: unknown hyper-parameter(s) {unknown}; known: {sorted(known) or 'none'}{hints}"
            )
        missing = sorted(n for n, p in known.items() if p.required and n not in hyper_parameters)
        if missing:
            raise ValueError(f"{self.name}: hyper-parameter(s) {missing} have no default; give them")
        merged = self.defaults() | dict(hyper_parameters)
        checked = tuple((n, known[n].check(self.name, merged[n])) for n in known)
        return BoundAttention(self, checked)

    # Conveniences for one-off use; a module binds once instead.
    def __call__(self, q, k, v, *, arrays=None, causal=False, kv_mask=None, bias=None, **hyper_parameters):
        return self.bind(**hyper_parameters)(q, k, v, arrays=arrays, causal=causal, kv_mask=kv_mask, bias=bias)

    def init_arrays(self, key, *, heads: int, kv_heads: int, d_k: int, d_v: int, **hyper_parameters) -> dict[str, Any]:
        return self.bind(**hyper_parameters).init_arrays(key, heads=heads, kv_heads=kv_heads, d_k=d_k, d_v=d_v)


@dataclasses.dataclass(frozen=True)
class BoundAttention:
    """A registered attention with its hyper-parameters validated: frozen and hashable,
    so Equinox modules hold it as a static field and `jit` caches on it.

    `bound(q, k, v, *, arrays=None, causal=False, kv_mask=None, bias=None)` runs the op;
    `init_arrays(key, ...)` makes its arrays; `init_state` / `decode_step` decode.
    """

    spec: AttentionSpec
    hyper: tuple[tuple[str, Any], ...]

    def __repr__(self) -> str:
        return f"BoundAttention({self.name!r}, {', '.join(f'{n}={v!r}' for n, v in self.hyper)})"

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def hyper_parameters(self) -> dict[str, Any]:
        return dict(self.hyper)

    def width(self, max_len: int) -> int | None:
        """How far one query reaches at `max_len` (its spec's `dense_width`), or None."""
        if self.spec.dense_width is None:
            return None
        return self.spec.dense_width[1](self.hyper_parameters, max_len)

    @property
    def layer_shared(self) -> tuple[str, ...]:
        """The names of its arrays that a model holds once for all its layers (its
        spec's `layer_shared`; `jxformers.nn.layouts.StackPlan` ties them)."""
        fn = self.spec.layer_shared
        return () if fn is None else tuple(fn(self.hyper_parameters))

    def _op_kwargs(self) -> dict[str, Any]:
        only = {p.name for p in self.spec.hyper_parameters if p.arrays_only}
        return {n: v for n, v in self.hyper if n not in only}

    def causal_refused(self) -> str | None:
        """Why these hyper-parameters cannot be causal (the spec's `causal_refusal`), or None."""
        refusal = self.spec.causal_refusal
        return None if refusal is None else refusal(self.hyper_parameters)

    def check_call(self, *, causal: bool = False, kv_mask=None, bias=None, cross: bool = False) -> None:
        """ValueError (naming the ones that can) when asked for what this attention cannot do."""
        s = self.spec
        if causal and s.supports_causal and (why := self.causal_refused()):
            raise ValueError(f"{s.name} attention cannot be causal with these settings: {why}")
        if s.causal_only and not causal:
            raise ValueError(
                f"{s.name} attention is causal only (it has no non-causal form): call it with causal=True, "
                "in a language model; attentions that can be non-causal: "
                f"{names(causal_only=False)}"
            )
        for wanted, able, what, flag in (
            (causal, s.supports_causal, "causal=True: it cannot be causal", "supports_causal"),
            (kv_mask is not None, s.supports_kv_mask, "kv_mask (padding)", "supports_kv_mask"),
            (bias is not None, s.takes_bias, "an additive bias (ALiBi, T5 relative positions)", "takes_bias"),
            (cross, s.supports_cross, "cross-attention: it cannot cross-attend", "supports_cross"),
        ):
            if wanted and not able:
                raise ValueError(f"{s.name} attention does not support {what}; ones that do: {names(**{flag: True})}")

    def __call__(
        self, q, k, v, *, arrays: Mapping[str, Any] | None = None, causal: bool = False, kv_mask=None, bias=None
    ):
        self.check_call(causal=causal, kv_mask=kv_mask, bias=bias)
        kwargs = self._op_kwargs() | dict(arrays or {})
        if not arrays and self.spec.init_arrays_fn is not None:
            # Some ops fall back silently without them (adaptive_sparse to a fixed alpha).
            drawn = _drawn_names(self, jnp.shape(q)[1], jnp.shape(k)[1], jnp.shape(q)[2], jnp.shape(v)[2])
            if drawn:
                raise ValueError(
                    f"{self.name} was called without its drawn arrays {list(drawn)}: pass "
                    "arrays=bound.init_arrays(key, heads=..., kv_heads=..., d_k=..., d_v=...)"
                )
        if self.spec.supports_causal:
            kwargs["causal"] = causal
        if kv_mask is not None:
            kwargs["kv_mask"] = kv_mask
        if bias is not None:
            kwargs["bias"] = bias
        if self.spec.shared_qk and _takes(self.spec.op, "warn_unused_k"):
            kwargs["warn_unused_k"] = False  # declared by the registration (shared_qk): no warning per call
        return self.spec.op(q, k, v, **kwargs)

    def init_arrays(self, key, *, heads: int, kv_heads: int, d_k: int, d_v: int) -> dict[str, Any]:
        """The op's array arguments (empty when it needs none)."""
        fn = self.spec.init_arrays_fn
        if fn is None:
            return {}
        wanted = inspect.signature(fn).parameters
        given = {"heads": heads, "kv_heads": kv_heads, "d_k": d_k, "d_v": d_v} | self.hyper_parameters
        return fn(key, **{n: v for n, v in given.items() if n in wanted})

    def update_arrays(self, arrays: Mapping[str, Any], q, k, *, kv_mask=None) -> dict[str, Any]:
        """New values of the drawn arrays this attention updates in training (its spec's
        `update_arrays_fn`) from a batch `q [batch, q_len, heads, d_k]`, `k [batch, kv_len,
        kv_heads, d_k]` and `kv_mask [batch, kv_len]`; empty when it updates none."""
        fn = self.spec.update_arrays_fn
        if fn is None:
            return {}
        wanted = inspect.signature(fn).parameters
        return fn(
            dict(arrays), q, k, kv_mask=kv_mask, **{n: v for n, v in self.hyper_parameters.items() if n in wanted}
        )

    def init_token_params(
        self, key, *, d_model: int, heads: int, kv_heads: int, d_k: int, d_v: int, causal: bool = False
    ) -> dict[str, Any]:
        """The learned parameters of its token inputs (empty when it reads no tokens) for
        a module that is `causal` or not."""
        token_inputs = self.spec.token_inputs
        if token_inputs is None:
            return {}
        wanted = inspect.signature(token_inputs.init).parameters
        given = {"d_model": d_model, "heads": heads, "kv_heads": kv_heads, "d_k": d_k, "d_v": d_v, "causal": causal}
        given |= self.hyper_parameters
        return token_inputs.init(key, **{n: v for n, v in given.items() if n in wanted})

    def token_arrays(self, params: Mapping[str, Any], queries, keys) -> dict[str, Any]:
        """The op arguments its token inputs make from `queries [q_len, d_model]` and
        `keys [kv_len, d_model]` (None: cross-attention decoding); empty if none."""
        if self.spec.token_inputs is None:
            return {}
        return self.spec.token_inputs.apply(params, queries, keys, self.hyper_parameters)

    def _decoder(self) -> Decoder:
        if self.spec.decoder is None:
            raise ValueError(f"{self.name} attention cannot decode incrementally; ones that can: {names(decodes=True)}")
        return self.spec.decoder

    def init_state(
        self, *, max_len: int, kv_heads: int, d_k: int, d_v: int, arrays: Mapping[str, Any] | None = None, dtype=None
    ):
        """The empty decoding state for sequences up to `max_len` (fixed shape)."""
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int; got {max_len!r}")
        return self._decoder().init(
            hyper_parameters=self.hyper_parameters,
            arrays=dict(arrays or {}),
            max_len=max_len,
            kv_heads=kv_heads,
            d_k=d_k,
            d_v=d_v,
            dtype=dtype,
        )

    def decode_step(self, q, k, v, state, *, arrays: Mapping[str, Any] | None = None, bias_fn=None):
        """Attend the next token's query `[heads, d_k]` to every key so far (its own
        included); returns `(out [heads, d_v], state)`. `bias_fn(q_pos [1], kv_pos [slots])
        -> [heads, 1, slots]` adds a position bias (attentions that take one)."""
        decoder = self._decoder()
        self.check_call(causal=True, bias=None if bias_fn is None else True)
        return decoder.step(
            q, k, v, state, hyper_parameters=self.hyper_parameters, arrays=dict(arrays or {}), bias_fn=bias_fn
        )


# ----------------------------------------------------------------------------- the registry

_REGISTRY: dict[str, AttentionSpec] = {}


def register(
    name: str,
    op: Callable,
    *,
    family: str,
    paper: str,
    complexity: str,
    supports_causal: bool | None = None,
    supports_kv_mask: bool | None = None,
    supports_cross: bool = False,
    takes_bias: bool | None = None,
    causal_only: bool = False,
    decoder: Decoder | None = None,
    init_arrays: Callable[..., dict[str, Any]] | None = None,
    drawn: tuple[str, ...] = (),
    token_inputs: TokenInputs | None = None,
    redrawn: bool = True,
    exact: bool = True,
    content_based: bool = True,
    mixes_input: bool = False,
    covers_length: str | None = None,
    shared_qk: bool = False,
    noise_key: str | None = None,
    update_arrays: Callable[..., dict[str, Any]] | None = None,
    docs: Mapping[str, str] | None = None,
    choices: Mapping[str, tuple[Any, ...]] | None = None,
    limits: Mapping[str, Limits | int | float] | None = None,
    summary: str = "",
    dense_width: tuple[str, Callable[[Mapping[str, Any], int], int]] | None = None,
    scaled: tuple[str, Callable[[Mapping[str, Any], int], dict[str, Any]]] | None = None,
    grid_width: str | None = None,
    causal_refusal: Callable[[Mapping[str, Any]], str | None] | None = None,
    layer_shared: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None,
) -> AttentionSpec:
    """Register `op` under `name`; hyper-parameters come from its keyword-only signature
    (and `init_arrays`'s). Capabilities default to what the signature shows (`causal`,
    `kv_mask`, `bias` arguments); say False where the op takes the argument only to
    refuse it. `docs`, `choices` and `limits` describe hyper-parameters by name: a doc
    line, the allowed values of a string one, the allowed numbers of a numeric one (a
    `jxformers.validate.Limits`, or a bare number: the minimum). Every int or float
    hyper-parameter declares its limits, so that `bind` refuses what the op would refuse
    at its first call. `summary`, `dense_width`, `scaled`, `grid_width` and `layer_shared`:
    see `AttentionSpec`."""
    if name in _REGISTRY:
        raise ValueError(f"attention {name!r} is already registered")
    op_params = inspect.signature(op).parameters
    found = _signature_parameters(op, CALL_ARGUMENTS)
    initialisers = [
        (init_arrays, SHAPE_ARGUMENTS, "init_arrays"),
        (token_inputs and token_inputs.init, TOKEN_SHAPE_ARGUMENTS, "token_inputs.init"),
        (update_arrays, UPDATE_ARGUMENTS, "update_arrays"),
    ]
    for fn, shapes, what in initialisers:
        if fn is None:
            continue
        for n, p in _signature_parameters(fn, shapes).items():
            if n in found and found[n].default != p.default:
                raise ValueError(
                    f"{name}: {n} defaults to {found[n].default!r} in the op but {p.default!r} in "
                    f"{what}; give it one default"
                )
            found.setdefault(n, dataclasses.replace(p, arrays_only=True))
    if noise_key is not None and noise_key not in op_params:
        raise ValueError(f"{name}: {noise_key=} is not an argument of its op")
    docs, choices = dict(docs or {}), dict(choices or {})
    bounds = {n: Limits.of(given) for n, given in (limits or {}).items()}
    roles = {n for n in (covers_length, grid_width) if n is not None}
    for extra in sorted((set(docs) | set(choices) | set(bounds) | roles) - set(found)):
        raise ValueError(f"{name}: {extra!r} is not a hyper-parameter of its op; found {sorted(found)}")
    params = tuple(
        dataclasses.replace(p, doc=docs.get(n, ""), choices=choices.get(n), limits=bounds.get(n))
        for n, p in found.items()
    )
    if scaled is not None:  # its rule names hyper-parameters of this op (checked on a long sequence)
        made = scaled[1]({p.name: p.default for p in params if not p.required}, 4096)
        for extra in sorted(set(made) - set(found)):
            raise ValueError(f"{name}: scaled gives {extra!r}, not a hyper-parameter of its op; found {sorted(found)}")
    unlimited = [p.name for p in params if p.numeric and p.limits is None]
    if unlimited:
        raise ValueError(
            f"{name}: declare the numbers that hyper-parameter(s) {unlimited} allow: "
            "limits={name: minimum or jxformers.validate.Limits(...)}"
        )
    flags = {
        "supports_causal": ("causal", supports_causal),
        "supports_kv_mask": ("kv_mask", supports_kv_mask),
        "takes_bias": ("bias", takes_bias),
    }
    resolved = {}
    for flag, (argument, given) in flags.items():
        if given and argument not in op_params:
            raise ValueError(f"{name}: {flag}=True but its op takes no {argument!r} argument")
        resolved[flag] = argument in op_params if given is None else given
    if causal_only and not resolved["supports_causal"]:
        raise ValueError(f"{name}: causal_only=True but it cannot be causal (its op takes no 'causal' argument)")
    spec = AttentionSpec(
        name,
        op,
        family,
        paper,
        complexity,
        params,
        supports_cross=supports_cross,
        causal_only=causal_only,
        decoder=decoder,
        init_arrays_fn=init_arrays,
        drawn=tuple(drawn),
        token_inputs=token_inputs,
        redrawn=redrawn,
        exact=exact,
        content_based=content_based,
        mixes_input=mixes_input,
        covers_length=covers_length,
        shared_qk=shared_qk,
        noise_key=noise_key,
        update_arrays_fn=update_arrays,
        summary=summary,
        dense_width=dense_width,
        scaled=scaled,
        grid_width=grid_width,
        causal_refusal=causal_refusal,
        layer_shared=layer_shared,
        **resolved,
    )
    for p in params:  # the defaults themselves must pass the checks
        if not p.required:
            p.check(name, p.default)
    _REGISTRY[name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove an attention (tests that register a toy one clean up with this)."""
    get(name)
    del _REGISTRY[name]


def _shipped() -> dict[str, AttentionSpec]:
    """The registry with the shipped attentions in it. They register when `jxformers.ops`
    is imported; `import jxformers.registry` alone does not import it (this module holds no
    entries and imports no op), so the first lookup loads them, by name: the registry is
    the layer below the ops, which fill it like plugins."""
    if "jxformers.ops" not in sys.modules:
        importlib.import_module("jxformers.ops")
    return _REGISTRY


def names(**capabilities: bool) -> list[str]:
    """Registered names in registration order, optionally filtered by capability flags,
    e.g. `names(supports_causal=True, decodes=True)`."""
    return [n for n, s in _shipped().items() if all(getattr(s, c) == want for c, want in capabilities.items())]


def get(name: str) -> AttentionSpec:
    """The spec registered under `name`; ValueError listing the names otherwise."""
    if name not in _shipped():
        raise ValueError(f"unknown attention {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def bind(name: str, **hyper_parameters) -> BoundAttention:
    """`get(name).bind(**hyper_parameters)`."""
    return get(name).bind(**hyper_parameters)


# ----------------------------------------------------------------------------- settings for a length


class DenseAtLength(ValueError):
    """No settings of an attention are sparser than softmax at a length: even its scaled
    hyper-parameters (the spec's `scaled`) reach every key (`scaled`). `jxformers compare`
    lists such an attention as skipped with this reason instead of training a dense copy."""


def fraction(max_len: int, ratio: int, *, cap: int, minimum: int = 1) -> int:
    """`max_len // ratio`, at most `cap` (the default, kept once the length is long enough)
    and at least `minimum`: the usual rule of a `scaled` registration."""
    return min(cap, max(minimum, max_len // ratio))


def scaled(name: str, max_len: int) -> dict[str, Any]:
    """The hyper-parameters attention `name` runs with in a model of `max_len` positions
    (what `jxformers compare` and `jxformers lra` train): its registration's `scaled` rule,
    which keeps it sparse or low-rank there (`dense_width` below max_len) within its paper's
    usual ratios; {} for one whose defaults hold at every length (softmax, the exact and
    parameter-free ones). Validated (`bind`). DenseAtLength (a ValueError) when even these
    settings reach every key at max_len (local attention at max_len 2)."""
    spec = get(name)
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int; got {max_len!r}")
    settings = {} if spec.scaled is None else dict(spec.scaled[1](spec.defaults(), max_len))
    bound = spec.bind(**settings)
    width = bound.width(max_len)
    if width is not None and width >= max_len:
        assert spec.dense_width is not None  # width() is None without it
        raise DenseAtLength(
            f"{name} cannot be sparse at max_len {max_len}: {spec.dense_width[0]} spans {width} >= {max_len} even "
            f"with its settings for this length {settings or spec.defaults()} "
            f"({spec.scaled[0] if spec.scaled else 'its defaults'})"
        )
    return settings


# ----------------------------------------------------------------------------- listing


def _causal_word(spec: AttentionSpec, no: str = "-") -> str:
    """The causal column of the tables: "yes", "only" (causal-only) or `no`."""
    return "only" if spec.causal_only else "yes" if spec.supports_causal else no


def models(spec: AttentionSpec) -> str:
    """The model types an attention can serve in (`jxformers.ModelConfig.task`):
    every attention fits an encoder (classify, retrieval); causal ones also a language
    model and an encoder-decoder; a causal-only one a language model alone; "+decode"
    when it decodes incrementally."""
    kinds = ["classify", "retrieval"] + (["lm", "seq2seq"] if spec.supports_causal else [])
    if spec.causal_only:
        kinds = ["lm"]
    return " ".join(kinds) + (" +decode" if spec.decodes else "")


def table() -> str:
    """The registry as a plain-text table (what `jxformers list` prints)."""
    head = (
        "name",
        "family",
        "causal",
        "kv_mask",
        "cross",
        "bias",
        "decoder",
        "models",
        "complexity",
        "hyper-parameters (defaults)",
    )
    rows = [head]
    for s in _REGISTRY.values():
        hp = ", ".join(p.name if p.required else f"{p.name}={p.default!r}" for p in s.hyper_parameters) or "-"
        flags = (_causal_word(s), *("yes" if f else "-" for f in (s.supports_kv_mask, s.supports_cross, s.takes_bias)))
        rows.append((s.name, s.family, *flags, s.decoder.kind if s.decoder else "-", models(s), s.complexity, hp))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(name: str) -> str:
    """One attention in words (what `jxformers list NAME` prints): what it computes, its
    capabilities, and each hyper-parameter's type, default, allowed values and doc."""
    s = get(name)
    lines = [
        f"{s.name}: {s.summary or s.op.__name__}",
        f"  op: jxformers.ops.{s.op.__name__}   paper: {s.paper}",
        f"  family: {s.family}   cost: {s.complexity}   models: {models(s)}",
    ]
    if s.dense_width is not None:
        lines.append(f"  dense (a ShortSequenceWarning) at a max_len no longer than {s.dense_width[0]}")
    if s.scaled is not None:
        lines.append(f"  at a max_len N (jxformers compare): {s.scaled[0]}")
    lines.append("  hyper-parameters:" if s.hyper_parameters else "  hyper-parameters: none")
    for p in s.hyper_parameters:
        default = "required" if p.required else f"= {p.default!r}"
        lines.append(f"    {p.name}: {p.allowed()} {default}" + (f"  -- {p.doc}" if p.doc else ""))
    return "\n".join(lines)


def markdown_table(shipped_only: bool = True) -> str:
    """The op table of docs/guide/ops.md, rendered from the registrations (op, `summary`, causal,
    `complexity`), in registration order. tests/test_registration.py keeps the copy in docs/guide/ops.md
    current; regenerate it with `jxformers list --markdown` (or `python -c "from
    jxformers import registry; print(registry.markdown_table())"`) and paste it between
    the `attention-table` markers. `shipped_only`: leave out attentions registered outside
    the package (tests' toys)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = ["| op | pattern (query i attends key j iff ...) | causal | cost |", "|---|---|---|---|"]
    for s in _REGISTRY.values():
        if shipped_only and not s.op.__module__.startswith("jxformers."):
            continue
        lines.append(f"| `{s.op.__name__}` | {cell(s.summary)} | {_causal_word(s, 'no')} | {cell(s.complexity)} |")
    return "\n".join(lines)
