"""What the whole-model designs of Lin et al. 2021 ("A Survey of Transformers", arXiv
2106.04554, sections 6.1 and 6.5) share: `Cell`, the abstract block whose call and
decoding step the models (`jxformers.nn.models`) make as they make a transformer
`Block`'s, a residual sublayer with its norm before (pre) or after (post) the sum, and
convolutions over the positions whose decoding state is the last k - 1 inputs.

The cells themselves live beside their papers: `jxformers.nn.lite` (Lite Transformer's
LSRA block), `jxformers.nn.delight` (DeLighT's block) and `jxformers.nn.evolved` (the
Evolved Transformer's encoder and decoder cells).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import FeedForward, Norm, normalise, split_key
from jxformers.nn.local import _window_step, _windows_of
from jxformers.nn.produced import Produced


def sublayer(
    x: Float[Array, "*n d"],
    f: Callable[[Array], tuple[Array, Produced]],
    norm: Norm,
    *,
    pre_norm: bool,
    dropout: eqx.nn.Dropout,
    key: PRNGKeyArray | None,
    inference: bool,
    mask: Bool[Array, "*n"] | None = None,
) -> tuple[Float[Array, "*n d"], Produced]:
    """One residual sublayer: x + dropout(f(N(x))) (pre) or N(x + dropout(f(x))) (post),
    and what f produced."""
    y, produced = f(normalise(norm, x, mask) if pre_norm else x)
    y = dropout(y, key=key, inference=inference)
    return (x + y if pre_norm else normalise(norm, x + y, mask)), produced


def padding_of(kernel: int, causal: bool) -> tuple[int, int]:
    """(zeros before, zeros after) a convolution over the positions: k - 1 before when
    causal; centred otherwise, the extra zero of an even k after (fairseq's padding_l,
    (k - 1) // 2 before)."""
    return (kernel - 1, 0) if causal else ((kernel - 1) // 2, kernel // 2)


def convolve(
    f: Callable[[Array], Array], x: Float[Array, "n c"], mask: Bool[Array, " n"] | None, kernel: int, causal: bool
) -> Float[Array, "n c2"]:
    """f over x zero padded for a convolution of `kernel` taps (padded rows, mask False,
    read as zeros); f maps `[n + kernel - 1, c]` to `[n, c2]`."""
    before, after = padding_of(kernel, causal)
    return _windows_of(f, x, mask, before, after)


def convolve_step(f: Callable[[Array], Array], x: Float[Array, " c"], state: Array) -> tuple[Array, Array]:
    """One decoding step of a causal convolution: (f's row for x, the state of the last
    kernel - 1 inputs)."""
    return _window_step(f, x, state)


def depthwise(padded: Float[Array, "m c"], weight: Float[Array, "k c"]) -> Float[Array, "n c"]:
    """y_i = sum_t w_t * x_{i + t} (per channel) over a padded input: n = m - k + 1."""
    k = weight.shape[0]
    n = padded.shape[0] - k + 1
    w = weight.astype(padded.dtype)
    return sum(padded[t : t + n] * w[t][None] for t in range(k))  # type: ignore[return-value]


class Cell(eqx.Module):
    """A block of a whole-model design, called as the models call a transformer `Block`
    (`apply_maps`, `init_decode_state`, `decode_step_maps`) and carrying no attention
    maps; subclasses give `_forward` (the parallel pass over `[n, d_model]`), and, when
    causal, `init_decode_state` and `_step` (one token). A cell that reads an encoder's
    output (a seq2seq decoder's: `cross_attention` not None) gives `_forward_with_context`,
    `_step_with_context` and `project_context` instead; the others raise when given a
    context. Funnel's pooled keys are no cell's: given a source, they raise."""

    @property
    def cross_attention(self) -> Any:
        """The cell's attention to an encoder's output, or None: a cell reads no context
        unless it overrides this (the Evolved Transformer's decoder cell)."""
        return None

    def project_context(self, context: Float[Array, "ctx d_model"]) -> Any:
        """What a decoding step reads of an encoder's output (its keys and values, computed once)."""
        raise ValueError(f"{type(self).__name__} reads no context: it has no keys and values to project")

    def _forward_with_context(
        self, x: Array, mask: Array | None, context: Array | None, context_mask: Array | None, *,
        key: PRNGKeyArray | None, inference: bool,
    ) -> tuple[Array, Produced]:  # fmt: skip
        """`_forward` reading the encoder's output `context` `[ctx, d_model]` (`context_mask` its padding)."""
        raise ValueError(f"{type(self).__name__} reads no context")

    def _step_with_context(
        self, x: Array, state: Any, context_kv: Any, context_mask: Array | None
    ) -> tuple[Array, Any]:
        """`_step` reading `project_context`'s keys and values."""
        raise ValueError(f"{type(self).__name__} reads no context")

    @abc.abstractmethod
    def _forward(
        self, x: Array, mask: Array | None, *, key: PRNGKeyArray | None, inference: bool
    ) -> tuple[Array, Produced]:
        """(output `[n, d_model]`, what its attentions produced)."""

    def _step(self, x: Array, state: Any) -> tuple[Array, Any]:
        raise ValueError(f"{type(self).__name__} is not causal: it has no decoding step")

    def init_decode_state(self, max_len: int, dtype) -> Any:
        raise ValueError(f"{type(self).__name__} is not causal: it has no decoding state")

    def _check_context(self, given: bool, what: str) -> None:
        """ValueError unless an encoder's output (`what`) is given exactly to a cell that reads one."""
        name = type(self).__name__
        if given and self.cross_attention is None:
            raise ValueError(f"{name} takes no context (seq2seq): it has no attention to an encoder; got {what}")
        if not given and self.cross_attention is not None:
            raise ValueError(f"{name} attends to an encoder: pass {what}")

    def __call__(self, x: Float[Array, "seq d_model"], **kwargs) -> Float[Array, "seq d_model"]:
        """`apply(...)`'s output alone."""
        return self.apply(x, **kwargs)[0]

    def apply(self, x: Float[Array, "seq d_model"], **kwargs) -> tuple[Float[Array, "seq d_model"], Produced]:
        """(`apply_maps(x, None, ...)`'s output, what it produced)."""
        y, produced, _ = self.apply_maps(x, None, **kwargs)
        return y, produced

    def apply_maps(
        self,
        x: Float[Array, "seq d_model"],
        maps: Any,
        *,
        kv_mask: Bool[Array, " seq"] | None = None,
        bias: Any = None,
        positions: Any = None,
        context: Array | None = None,
        context_mask: Array | None = None,
        source: Array | None = None,
        source_positions: Array | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], Produced, Any]:
        """`Block.apply_maps`'s arguments: x `[seq, d_model]`, kv_mask `[seq]` True for
        real rows (padded rows are read as zeros by the convolutions); context `[ctx,
        d_model]` and context_mask `[ctx]`, the encoder's output, exactly for a cell that
        reads one; `bias`, `positions` and `token_ids` are not read (ModelConfig allows
        positions added to the embeddings only). Returns (`[seq, d_model]`, Produced,
        `maps` unchanged)."""
        name = type(self).__name__
        if source is not None:
            raise ValueError(f"{name} takes no source (Funnel pooling)")
        self._check_context(context is not None, "a context")
        if bias is not None:
            raise ValueError(f"{name} takes no logit bias: positions added to the embeddings only")
        if context is None:
            y, produced = self._forward(x, kv_mask, key=key, inference=inference)
        else:
            y, produced = self._forward_with_context(x, kv_mask, context, context_mask, key=key, inference=inference)
        return y, produced, maps

    def decode_step(self, x: Float[Array, " d_model"], state: Any, **kwargs) -> tuple[Float[Array, " d_model"], Any]:
        x, state, _ = self.decode_step_maps(x, state, None, **kwargs)
        return x, state

    def decode_step_maps(
        self,
        x: Float[Array, " d_model"],
        state: Any,
        maps: Any,
        *,
        bias_fn: Any = None,
        context_kv: Any = None,
        context_mask: Any = None,
        token_id: Any = None,
    ) -> tuple[Float[Array, " d_model"], Any, Any]:
        """One token (inference): (output `[d_model]`, the new state, `maps` unchanged);
        `context_kv`: `project_context`'s keys and values, exactly for a cell that reads
        an encoder's output."""
        if bias_fn is not None:
            raise ValueError(f"{type(self).__name__} decodes without a position bias")
        self._check_context(context_kv is not None, "its projected keys and values (context_kv)")
        if context_kv is None:
            y, state = self._step(x, state)
        else:
            y, state = self._step_with_context(x, state, context_kv, context_mask)
        return y, state, maps


class MixerCell(Cell):
    """A cell of two residual sublayers, a token mixer then an FFN, each with its norm
    before (pre) or after (post) the sum:

        pre:   h = x + dropout(mix(N_1(x))),   y = h + dropout(FFN(N_2(h)))
        post:  h = N_1(x + dropout(mix(x))),   y = N_2(h + dropout(FFN(h)))

    Subclasses give `mix` (the parallel mixer and what it produced) and `mix_step` (one
    token against its decoding state)."""

    ffn: FeedForward
    norms: tuple[Norm, Norm]
    dropout: eqx.nn.Dropout
    pre_norm: bool = eqx.field(static=True)

    @abc.abstractmethod
    def mix(self, x: Array, mask: Array | None, *, key: PRNGKeyArray | None, inference: bool) -> tuple[Array, Produced]:
        """The token mixer over `[n, d_model]` (and what its attention produced)."""

    @abc.abstractmethod
    def mix_step(self, x: Array, state: Any) -> tuple[Array, Any]:
        """The mixer for one token `[d_model]`: (its output, the new state)."""

    def _forward(self, x, mask, *, key, inference):
        k1, k2, k3, k4 = split_key(key, 4)
        common = functools.partial(
            sublayer, pre_norm=self.pre_norm, dropout=self.dropout, inference=inference, mask=mask
        )
        x, produced = common(x, lambda h: self.mix(h, mask, key=k1, inference=inference), self.norms[0], key=k2)
        feed = lambda h: (self.ffn(h, key=k3, inference=inference), Produced())  # noqa: E731
        return common(x, feed, self.norms[1], key=k4)[0], produced

    def _step(self, x, state):
        made = {}

        def mix(h):
            y, made["state"] = self.mix_step(h[0], state)
            return y[None], Produced()

        common = functools.partial(sublayer, pre_norm=self.pre_norm, dropout=self.dropout, key=None, inference=True)
        h, _ = common(x[None], mix, self.norms[0])
        h, _ = common(h, lambda v: (self.ffn(v, inference=True), Produced()), self.norms[1])
        return h[0], made["state"]


def check_own_ffn(config: Any, what: str) -> None:
    """ValueError unless the model's ffn is at its default: a stack that builds `what`
    (its own FFNs) would silently ignore it."""
    ffn = config.ffn
    if ffn.kind != "gelu" or any(getattr(ffn, n, None) is not None for n in ("d_ff", "chunk_size")):
        raise ValueError(f"stack {config.stack.kind!r} builds {what}: leave model.ffn at its default; got {ffn}")
