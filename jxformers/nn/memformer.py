"""Memformer (Wu et al. 2020, "Memformer: A Memory-Augmented Transformer for Sequence
Modeling", arXiv 2010.06891, section 3), built as a causal language model: an external
dynamic memory M_t of k slots per model, read by every layer and written once per segment.

    model = build_model({"task": "lm", "stack": {"kind": "memformer", "num_slots": 8, "segment_len": 16}}, key=key)
    memory = model.init_memory()                          # {"slots": [k, d], "written": 0}
    logits, produced = model.apply(tokens, memory=memory)  # tokens: whole segments; produced.memory: M after them

**Memory reader (eq. 1-3).** Every layer is a transformer block with a cross-attention
sublayer after its (causal) self-attention whose context is the memory: Q_x = x W_Q,
K_M = M_t W_K, V_M = M_t W_V, H_x = softmax(Q_x K_M^T / sqrt(d_head)) V_M, multi-head,
with the block's residual and norm (`jxformers.nn.blocks.Block`'s cross branch). The slots
carry no positions.

**Memory writer (eq. 4-7): slot attention.** After a segment, each slot m^i attends to
itself and to the segment's token states x (the last layer's output, before the final
norm): Q_{m^i} = m^i W_Q, K_{m^i} = m^i W_K, K_x = x W_K, V_x = x W_V,
A'_i = Q_{m^i} [K_{m^i}; K_x]^T / sqrt(d_head), m'^i = softmax(A'_i / τ) [m^i; V_x], per
head (a slot never reads another slot; τ < 1 sharpens the write).

**Forgetting (eq. 8-10): biased memory normalisation.** m^i <- (m'^i + v_b^i) /
||m'^i + v_b^i||, with a learned bias v_b^i per slot; the initial memory is
m_0^i = v_b^i / ||v_b^i|| (a memory with `written` 0 is read as that, so the start follows
the parameters). With no input the slots drift towards v_b's direction: the forgetting.

**Segments and memory replay back-propagation (section 3.3).** `apply` reads its tokens as
consecutive segments of `segment_len` with a `lax.scan`, the memory passed from segment to
segment with its gradient (back-propagation through time over the record); with
`replay` each segment's step is under `jax.checkpoint`, so the backward keeps only the
memories M_1 .. M_K and replays each segment's forward when it needs its activations: the
paper's MRBP, in O(k d) stored per segment instead of every activation. Between records
(`Produced.memory`, carried by the train step) the memory is a stop-gradient.

**The causal variant.** The paper's model is an encoder-decoder: its encoder reads and
writes the memory, its decoder cross-attends the encoder's output. Here one causal stack
does both (the encoder made causal, with the language-model readout): token t of a
segment reads the memory written before its segment and the segment's tokens up to t,
so the model predicts every token of a stream, and decodes token by token
(`init_decode_state`, `decode_step`: the memory is written when a segment fills).
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import Linear, check_tokens, split_key
from jxformers.nn.produced import Produced


class MemoryWriter(eqx.Module):
    """Memformer's memory writer (eq. 4-10, see the module docstring): slot attention of
    each slot over itself and the segment's token states, then biased memory
    normalisation. `__call__(memory [k, d], x [n, d], mask [n])` -> the next memory
    `[k, d]`; `initial()` -> M_0 `[k, d]`."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    bias: Float[Array, "slots d"]  # v_b, one per slot
    heads: int = eqx.field(static=True)
    temperature: float = eqx.field(static=True)

    def __init__(self, slots: int, d_model: int, heads: int, *, temperature: float, key: PRNGKeyArray):
        if slots < 1 or d_model % heads or not temperature > 0:
            raise ValueError(
                f"a memory writer needs slots >= 1, d_model divisible by heads and temperature > 0; got "
                f"{slots=}, {d_model=}, {heads=}, {temperature=}"
            )
        kq, kk, kv, kb = jax.random.split(key, 4)
        self.q_proj = Linear(d_model, d_model, use_bias=False, key=kq)
        self.k_proj = Linear(d_model, d_model, use_bias=False, key=kk)
        self.v_proj = Linear(d_model, d_model, use_bias=False, key=kv)
        self.bias = jax.random.normal(kb, (slots, d_model))
        self.heads, self.temperature = heads, temperature

    def initial(self) -> Float[Array, "slots d"]:
        """M_0 = v_b / ||v_b|| per slot (eq. 10)."""
        return _unit(self.bias)

    def __call__(
        self, memory: Float[Array, "slots d"], x: Float[Array, "n d"], mask: Bool[Array, " n"] | None = None
    ) -> Float[Array, "slots d"]:
        """M_{t+1} from M_t and the segment's token states x (padding, mask False, unread)."""
        k, d = memory.shape
        h, dh = self.heads, d // self.heads
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        memory, x = f32(memory), f32(x)
        split = lambda a: a.reshape(a.shape[0], h, dh)  # noqa: E731
        q, k_self, k_x, v_x = (
            split(self.q_proj(memory)),
            split(self.k_proj(memory)),
            split(self.k_proj(x)),
            split(self.v_proj(x)),
        )
        own = jnp.einsum("khd,khd->hk", q, k_self)[..., None]  # each slot against itself only
        tokens = jnp.einsum("khd,nhd->hkn", q, k_x)
        if mask is not None:
            tokens = jnp.where(mask[None, None], tokens, -jnp.inf)
        weights = jax.nn.softmax(jnp.concatenate([own, tokens], -1) / (math.sqrt(dh) * self.temperature), -1)
        written = weights[..., 0, None] * split(memory).transpose(1, 0, 2) + jnp.einsum(
            "hkn,nhd->hkd", weights[..., 1:], v_x
        )
        return _unit(written.transpose(1, 0, 2).reshape(k, d) + self.bias)  # eq. 8-9


def _unit(x: Float[Array, "k d"]) -> Float[Array, "k d"]:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _segment_produced(stacked: Produced) -> Produced:
    """The `Produced` of a scan's segments (stacked on axis 0) as one: named and layer
    losses averaged over the segments (as the cross-entropy is), tallies summed.
    (ModelConfig refuses what else a block could make here: MoE layers, attentions that
    update arrays, Admin's moments.)"""
    return Produced(
        losses={n: v.mean(0) for n, v in stacked.losses.items()},
        layer_losses={n: v.mean(0) for n, v in stacked.layer_losses.items()},
        tallies={n: v.sum(0) for n, v in stacked.tallies.items()},
    )


class MemformerLM(eqx.Module):
    """Memformer as a causal language model, one example at a time (see the module
    docstring).

    Arguments (constructor): `lm` (a `LanguageModel` whose blocks cross-attend: the memory
    readers), `writer` (`MemoryWriter`), `segment_len` (tokens between two writes),
    `replay` (memory replay back-propagation: each segment's step under `jax.checkpoint`).
    """

    lm: Any  # jxformers.nn.models.LanguageModel (imported by the config builder: no cycle)
    writer: MemoryWriter
    segment_len: int = eqx.field(static=True)
    replay: bool = eqx.field(static=True)
    eval_mem_len: None = eqx.field(static=True, default=None)  # the memory's size is fixed: k slots

    def __init__(self, lm, writer: MemoryWriter, *, segment_len: int, replay: bool = True):
        if not 1 <= segment_len <= lm.max_len:
            raise ValueError(f"segment_len must be in [1, max_len = {lm.max_len}]; got {segment_len}")
        self.lm, self.writer, self.segment_len, self.replay = lm, writer, segment_len, replay

    @property
    def max_len(self) -> int:
        return self.lm.max_len

    @property
    def vocab_size(self) -> int:
        return self.lm.vocab_size

    def init_memory(self, mem_len: None = None) -> dict[str, Array]:
        """An empty memory: `slots [k, d]` and `written` (segments written so far; 0 reads
        as M_0 = v_b / ||v_b||). `mem_len` must be None: the memory has k slots."""
        if mem_len is not None:
            raise ValueError(f"a Memformer memory has a fixed number of slots; got mem_len={mem_len}")
        return {"slots": jnp.zeros(self.writer.bias.shape, jnp.float32), "written": jnp.zeros((), jnp.int32)}

    def _slots(self, memory) -> Float[Array, "slots d"]:
        return jnp.where(memory["written"] > 0, jax.lax.stop_gradient(memory["slots"]), self.writer.initial())

    def segment(self, slots, tokens, mask, key, inference):
        """One segment read after `slots`: (logits `[n, vocab]`, the slots it writes, Produced)."""
        x, mask, produced = self.lm.features(
            tokens, mask, context=slots.astype(self.lm.embedding.dtype), key=key, inference=inference
        )
        return self.lm.logits(x), self.writer(slots, x, mask), produced

    def __call__(
        self, tokens: Int[Array, " seq"], mask: Bool[Array, " seq"] | None = None, **kwargs
    ) -> Float[Array, "seq vocab"]:
        """`apply(...)`'s logits alone."""
        return self.apply(tokens, mask, **kwargs)[0]

    def apply(
        self,
        tokens: Int[Array, " seq"],
        mask: Bool[Array, " seq"] | None = None,
        *,
        memory: dict[str, Array] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq vocab"], Produced]:
        """The tokens as consecutive segments of `segment_len` after `memory` (None: M_0,
        and no memory comes out; a last partial segment is read and writes nothing):
        (logits `[seq, vocab]`, Produced with the memory after the last segment). With a
        memory the tokens must be whole segments (the memory after a partial one would
        miss its tokens)."""
        n, s = check_tokens(tokens, mask), self.segment_len
        whole, rest = divmod(n, s)
        if memory is not None and rest:
            raise ValueError(
                f"a Memformer reads whole segments of segment_len {s} when it carries a memory; got {n} tokens"
            )
        start = self.init_memory() if memory is None else memory
        mask = jnp.ones((n,), bool) if mask is None else mask
        keys = split_key(key, whole + 1)
        stacked = None if key is None else jnp.stack(keys[:whole]) if whole else None

        def step(slots, xs):
            t, m, k = xs
            logits, slots, made = self.segment(slots, t, m, k, inference)
            return slots, (logits, made)

        body = jax.checkpoint(step) if self.replay else step
        slots, logits, produced = self._slots(start), [], Produced()
        if whole:
            xs = (tokens[: whole * s].reshape(whole, s), mask[: whole * s].reshape(whole, s), stacked)
            slots, (out, made) = jax.lax.scan(body, slots, xs)
            logits.append(out.reshape(whole * s, -1))
            produced = _segment_produced(made)
        if rest:
            out, _, made = self.segment(slots, tokens[whole * s :], mask[whole * s :], keys[-1], inference)
            logits.append(out)
            produced = produced + made
        if memory is not None:
            produced = produced + Produced(memory={"slots": slots, "written": start["written"] + whole})
        return jnp.concatenate(logits), produced

    # ------------------------------------------------------------------ decoding

    def init_decode_state(self, max_len: int) -> dict[str, Any]:
        """Decoding state for up to `max_len` tokens: the memory (M_0), the language
        model's state for one segment, and the last layer's states of the segment so
        far (the writer reads them when it fills)."""
        if max_len > self.max_len:
            raise ValueError(f"decoding length {max_len} exceeds the model's max_len {self.max_len}")
        d = self.writer.bias.shape[1]
        return {
            "segment": self.lm.init_decode_state(self.segment_len),
            "slots": self.writer.initial(),
            "states": jnp.zeros((self.segment_len, d), jnp.float32),
        }

    def decode_step(
        self, token: Int[Array, ""], state: dict[str, Any]
    ) -> tuple[Float[Array, " vocab"], dict[str, Any]]:
        """Feed one token; the next-token logits and the new state (the memory is written,
        and the segment's state emptied, after its last token)."""
        inner, slots = state["segment"], state["slots"]
        position = inner["length"]
        context_kv = tuple(
            block.cross_attention.project_context(slots.astype(self.lm.embedding.dtype))
            for block in self.lm.plan.filled(self.lm.blocks)
        )
        x, inner = self.lm.decode_features(token, inner, context_kv=context_kv)
        states = state["states"].at[position].set(x.astype(jnp.float32))
        full = position + 1 == self.segment_len
        fresh = self.lm.init_decode_state(self.segment_len)
        inner = jax.tree.map(lambda a, b: jnp.where(full, a, b), fresh, inner)
        slots = jnp.where(full, self.writer(slots, states), slots)
        return self.lm.logits(x), {"segment": inner, "slots": slots, "states": states}
