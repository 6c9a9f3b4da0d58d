"""The Feedback Transformer (Fan, Lavril, Grave, Joulin & Sukhbaatar 2020, "Addressing
Some Limitations of Transformers with Feedback Memory", arXiv 2002.09402, section 4.1),
a causal language model (`ModelConfig` stack `{kind: feedback}`).

Every layer l at position t attends to one memory shared by all layers: the vectors

    m_τ = Σ_{l=0..L} softmax(w)_l x_τ^l          (x_τ^0: the token's embedding,
                                                  x_τ^l: layer l's output at τ)

of the earlier positions τ (the paper's z_t^l = Attn(x_t^l, [m_{t-span}, ..., m_{t-1}])):
the query is layer l's input x_t^{l-1}, the keys and values are layer l's own projections
W_k^l m_τ and W_v^l m_τ (with pre-norm, of its first norm of m_τ, as the authors' code).
m_t needs x_t^L, so position t's layers cannot start before position t - 1 has gone
through all of them: the model trains as it decodes, one position after the other
(`lax.scan` over the positions), and loses the transformer's parallelism over the
sequence (docs/feedback_cost.md measures it). The scan carries, per layer, the keys and
values of the memories written so far; step t reads slots t - span .. t - 1, writes slot
t. The first position reads no memory: its attention adds nothing (as the authors' code,
whose post-norm cache starts as zero vectors whose values are zero).

    model = build_model({"task": "lm", "stack": {"kind": "feedback"}}, key=key)
    logits = model(tokens)                             # [n, vocab], n sequential steps
    state = model.init_decode_state(64)
    logits, state = model.decode_step(token, state)    # the same step, one token

Training keeps the scan's carries for the backward pass: O(L n^2 d) memory per sequence
(each step's key/value buffers), against O(L n d) for a parallel transformer's
activations; the authors' PyTorch code avoids it with an in-place buffer and a custom
backward, which JAX's functional arrays do not offer.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import FeedForward, Linear, Norm, check_tokens, make_norm, split_key
from jxformers.nn.models import Embedding
from jxformers.nn.produced import Produced
from jxformers.ops import softmax_attention


class FeedbackLayer(eqx.Module):
    """One layer of the Feedback Transformer at one position: attention from its input
    x_t^{l-1} to the shared memory's keys and values (this layer's projections of it),
    then the position-wise FFN, each a residual branch with pre-norm (x + f(N(x)), the
    authors' `--pre-norm`) or post-norm (N(x + f(x)), the paper's Transformer).

    Arguments (constructor): d_model, heads, d_ff, ffn (the activation kind), norm (its
    kind), pre_norm, dropout (on both residual branches and the FFN's hidden units), key.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    ffn: FeedForward
    norms: tuple[Norm, Norm]
    dropout: eqx.nn.Dropout
    heads: int = eqx.field(static=True)
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = True,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        kq, kk, kv, ko, kf = jax.random.split(key, 5)
        # no biases, as the authors' projections (proj_query, proj_key, proj_val, proj_out)
        self.q_proj = Linear(d_model, d_model, use_bias=False, key=kq)
        self.k_proj = Linear(d_model, d_model, use_bias=False, key=kk)
        self.v_proj = Linear(d_model, d_model, use_bias=False, key=kv)
        self.o_proj = Linear(d_model, d_model, use_bias=False, key=ko)
        self.ffn = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kf)
        self.norms = (make_norm(norm, d_model), make_norm(norm, d_model))
        self.dropout = eqx.nn.Dropout(dropout)
        self.heads, self.pre_norm = heads, pre_norm

    def memory_kv(
        self, memory: Float[Array, "*n d_model"]
    ) -> tuple[Float[Array, "*n heads d_head"], Float[Array, "*n heads d_head"]]:
        """This layer's keys and values of memory vectors (normalised first with pre-norm,
        as its queries are)."""
        m = self.norms[0](memory) if self.pre_norm else memory
        shape = (*memory.shape[:-1], self.heads, memory.shape[-1] // self.heads)
        return self.k_proj(m).reshape(shape), self.v_proj(m).reshape(shape)

    def __call__(
        self,
        x: Float[Array, " d_model"],
        keys: Float[Array, "slots heads d_head"],
        values: Float[Array, "slots heads d_head"],
        readable: Bool[Array, " slots"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, " d_model"]:
        """x_t^l from x_t^{l-1} (`x`) and the memory's keys and values (`readable`: the
        slots position t reads)."""
        k1, k2, k3 = split_key(key, 3)
        h = self.norms[0](x) if self.pre_norm else x
        q = self.q_proj(h).reshape(1, self.heads, -1)
        # one query over the memory's slots; none readable (the first position): zero
        a = softmax_attention(q, keys, values, kv_mask=readable).reshape(-1).astype(x.dtype)
        a = self.dropout(self.o_proj(a), key=k1, inference=inference)
        x = x + a if self.pre_norm else self.norms[0](x + a)
        f = self.ffn((self.norms[1](x) if self.pre_norm else x)[None], key=k2, inference=inference)[0]
        f = self.dropout(f, key=k3, inference=inference)
        return x + f if self.pre_norm else self.norms[1](x + f)


class FeedbackLM(eqx.Module):
    """The Feedback Transformer as a causal language model (see the module docstring).

    `model(tokens)` gives the next-token logits `[seq, vocab]`, computed position after
    position; `init_decode_state(max_len)` and `decode_step(token, state)` run the same
    step one token at a time (its state: every layer's memory keys and values, the
    slots' validity, the length).

    Arguments (constructor):
        embedding: the token embedding and its (added) positions.
        layers: the `FeedbackLayer`s, bottom first.
        norm: the final norm before the readout (None: none; the authors' code has one
            with pre-norm only).
        max_len: the longest sequence.
        span: how many earlier positions each position reads (None: all of them; the
            authors' `--attn-lim`).
        tie: the readout shares the embedding table.
        dropout: on the embeddings.
        key: for the untied readout.
    """

    embedding: Embedding
    layers: tuple[FeedbackLayer, ...]
    layer_weights: Float[Array, " sources"]  # w: m = Σ_l softmax(w)_l x^l over l = 0 .. L
    norm: Norm | None
    unembed: Linear | None  # None: tied to the embedding table
    dropout: eqx.nn.Dropout
    max_len: int = eqx.field(static=True)
    span: int | None = eqx.field(static=True)

    def __init__(
        self,
        embedding: Embedding,
        layers: list[FeedbackLayer],
        norm: Norm | None,
        *,
        max_len: int,
        span: int | None = None,
        tie: bool = True,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if span is not None and (isinstance(span, bool) or not isinstance(span, int) or span < 1):
            raise ValueError(f"span must be None or an int >= 1; got {span!r}")
        if not layers:
            raise ValueError("a Feedback Transformer needs at least one layer")
        if embedding.extra is not None:
            raise ValueError("a Feedback Transformer has no extra tokens (its memory plays their part)")
        vocab, d = embedding.table.shape
        self.embedding, self.layers, self.norm = embedding, tuple(layers), norm
        # zeros: every layer weighs the same at the start, as the authors' code initialises w
        self.layer_weights = jnp.zeros((len(layers) + 1,), jnp.float32)
        self.unembed = None if tie else Linear(d, vocab, use_bias=False, key=key)
        self.dropout = eqx.nn.Dropout(dropout)
        self.max_len, self.span = max_len, span

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads: [0, vocab_size)."""
        return self.embedding.table.shape[0]

    def memory(self, states: Float[Array, "sources *n d_model"]) -> Float[Array, "*n d_model"]:
        """m = Σ_l softmax(w)_l x^l of every layer's states (the embeddings first)."""
        weights = jax.nn.softmax(self.layer_weights).astype(states.dtype)
        return jnp.tensordot(weights, states, axes=1)

    def _readout(self, x):
        if self.norm is not None:
            x = self.norm(x)
        if self.unembed is None:
            return self.embedding.logits(x)
        return self.unembed(x).astype(jnp.float32)

    def _empty(self, slots: int) -> dict[str, Array]:
        """Memory of `slots` positions, none written: per layer its keys and values."""
        d = self.embedding.table.shape[1]
        heads = self.layers[0].heads
        zeros = jnp.zeros((len(self.layers), slots, heads, d // heads), jnp.dtype(self.embedding.dtype))
        return {"keys": zeros, "values": zeros, "valid": jnp.zeros((slots,), bool), "length": jnp.zeros((), jnp.int32)}

    def _step(self, state, x, real, key, inference):
        """Position `state["length"]` from its embedding `x`: (the new state, its top
        layer's output). `real`: whether the position is a token (padding is never read)."""
        t = state["length"]
        slots = jnp.arange(state["valid"].shape[0])
        readable = state["valid"] & (slots < t)
        if self.span is not None:
            readable = readable & (slots >= t - self.span)
        keys = split_key(key, len(self.layers))
        states = [x]
        for i, layer in enumerate(self.layers):
            x = layer(x, state["keys"][i], state["values"][i], readable, key=keys[i], inference=inference)
            states.append(x)
        k, v = zip(*(layer.memory_kv(self.memory(jnp.stack(states))) for layer in self.layers), strict=True)
        new = {
            "keys": state["keys"].at[:, t].set(jnp.stack(k).astype(state["keys"].dtype)),
            "values": state["values"].at[:, t].set(jnp.stack(v).astype(state["values"].dtype)),
            "valid": state["valid"].at[t].set(real),
            "length": t + 1,
        }
        return new, x

    def __call__(
        self, tokens: Int[Array, " seq"], mask: Bool[Array, " seq"] | None = None, **kwargs
    ) -> Float[Array, "seq vocab"]:
        """`apply(...)`'s output alone (the arguments are `apply`'s)."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, " seq"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq vocab"], Produced]:
        """Arguments:
            tokens: `[seq]` ids; mask: `[seq]` True for real tokens (padded positions are
                never read as memory).

        Returns:
            `([seq, vocab] float32 logits, Produced())`; row i predicts token i + 1. The
            positions run one after another (`lax.scan`).
        """
        n = check_tokens(tokens, mask)
        if n > self.max_len:
            raise ValueError(f"sequence length {n} exceeds the model's max_len {self.max_len}")
        k_embed, k_steps = split_key(key, 2)
        x = self.dropout(self.embedding(tokens, jnp.arange(n)), key=k_embed, inference=inference)
        real = jnp.ones((n,), bool) if mask is None else mask
        steps = None if k_steps is None else jax.random.split(k_steps, n)

        def step(state, inputs):
            x_t, real_t, k = inputs
            return self._step(state, x_t, real_t, k, inference)

        _, out = jax.lax.scan(step, self._empty(n), (x, real, steps))
        return self._readout(out), Produced()

    def init_decode_state(self, max_len: int) -> dict[str, Any]:
        """Decoding state for up to `max_len` tokens: every layer's memory keys and values
        (`[layers, max_len, heads, d_head]`), which slots hold a token, the length."""
        if max_len > self.max_len:
            raise ValueError(f"decoding length {max_len} exceeds the model's max_len {self.max_len}")
        return self._empty(max_len)

    def decode_step(
        self, token: Int[Array, ""], state: dict[str, Any]
    ) -> tuple[Float[Array, " vocab"], dict[str, Any]]:
        """Feed one token at position `state["length"]`: the next-token logits `[vocab]`
        and the new state (the parallel call's step, the same arithmetic)."""
        x = self.embedding(token[None], state["length"][None])[0]
        state, out = self._step(state, x, jnp.ones((), bool), None, True)
        return self._readout(out), state
