"""Segment-level recurrence (Tay et al. 2022, "Efficient Transformers: A Survey", arXiv
2009.06732v2, sections 3.2.16-3.2.17): Transformer-XL (Dai et al.
2019) and the Compressive Transformer (Rae et al. 2020), as causal language models.

    model = build_model({"task": "lm", "stack": {"kind": "transformer_xl", "mem_len": 64}}, key=key)
    memory = model.init_memory()                      # per layer: the cached hidden states
    logits, memory, recon = model.forward(segment, memory)   # segment [n] -> logits [n, vocab]

**Transformer-XL.** Layer l of segment t attends, from the segment's own positions
(queries), to the keys and values of concat(SG(m_l), h_l): m_l holds the last `mem_len`
inputs of layer l before this segment (earlier segments' hidden states, stop-gradient),
h_l the segment's inputs to layer l. A query sees all valid memory and the current
positions up to its own. Scores use the paper's relative positions (section 3.3; the same math serves the position
option `embedding.position: transformer_xl` of the other stacks, `jxformers.nn.relative`):

    A_ij = (q_i + u)^T k_j + (q_i + v)^T W_{k,R} R_{i-j},

q_i = W_q h_i, k_j = W_{k,E} x_j, R the sinusoid of the distance i - j (no learned
position table; nothing absolute enters the embeddings), u and v per-head vectors shared
by all layers, W_{k,R} per layer; scaled by 1/sqrt(d_head). The distance term is an exact
gather of (q_i + v)^T W_{k,R} R_d over the distances d = 0 .. M + n - 1 (the paper's
shift trick computes the same numbers). Memories are right-aligned: slot j of M holds the
position j - M before the segment, `length` counts the valid (filled) slots, and empty
slots are masked.

**Compressive Transformer.** Per layer, besides the FIFO memory of `mem_len`, a
compressed memory of `cmem_len`; attention reads concat(cmem, mem, current) with the same
relative scheme (slots counted as consecutive positions, as in the paper). Every segment
of n pushes n states into the memory and evicts its oldest n (the first n of
concat(mem, h)); the evicted states are compressed at rate c by f_c (strided 1-D
convolution of kernel and stride c, mean pooling or max pooling over c), and the n / c
results pushed into the compressed memory, whose oldest fall off. The compression
network learns only from the attention-reconstruction loss (the paper's Algorithm 2),
per layer ||attn(h, old_mem) - attn(h, f_c(old_mem))||^2 with h, old_mem and the layer's
attention weights stopped: attn(h, m) = softmax((h W_q)(m W_k)^T / sqrt(d_head)) m W_v,
content only, per head; here the mean squared error over the evicted valid states,
averaged over the layers. The LM loss never reaches f_c (compressed memories are used only
by later segments, through a stop-gradient).

**ERNIE-Doc** (Ding et al. 2021, "ERNIE-Doc: A Retrospective Long-Document Modeling
Transformer", section 3.2, eq. 1): the enhanced recurrence. Layer n of segment τ+1 reads
concat(SG(h^n_τ), h^{n-1}_{τ+1}): its memory holds the same layer's *outputs* of the earlier
segments, where Transformer-XL's holds the layer below's (h^{n-1}_τ); information then
climbs no layers to reach a later segment, and the context reach is no longer bounded by
the depth times mem_len. The retrospective feed (section 3.1): a document of segments
S_1 .. S_T is read twice, [S_1 .. S_T] (skimming: the memory collects the whole document)
then [S_1 .. S_T] again (retrospective: every segment reads that memory), and only the
retrospective pass's outputs are trained. On a stream the document is a training record
(`segment_len` cuts it into segments, None: one segment); the retrospective pass reads
memories of the whole record, its own targets included, so it is no causal predictor:
such a model refuses to decode (`init_decode_state`). Decoding otherwise reads the
current segment's layer inputs, which is what the parallel call does within one segment,
so the same-layer memory does not enter one segment's decoding.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import FeedForward, Linear, Norm, check_tokens, lookup, make_norm, split_key
from jxformers.nn.produced import Produced
from jxformers.nn.relative import distance_term, relative_sinusoid

MEMORY_ARCHITECTURES = ("transformer_xl", "compressive", "ernie_doc", "memformer")  # carried by the train step
# The compression functions f_c of Rae et al. 2020, section 3.1 (see `Compressor`).
COMPRESSIONS = ("conv", "mean", "max", "dilated_conv", "most_used")
# What trains f_c (section 3.2): the attention-reconstruction loss, or the auto-encoding loss.
COMPRESSION_LOSSES = ("attention", "autoencoding")


def relative_attention(
    q: Float[Array, "n heads d"],
    k: Float[Array, "m heads d"],
    v: Float[Array, "m heads dv"],
    r: Float[Array, "m heads d"],
    u: Float[Array, "heads d"],
    vb: Float[Array, "heads d"],
    *,
    mask: Bool[Array, "n m"],
    received: bool = False,
) -> Float[Array, "n heads dv"] | tuple[Float[Array, "n heads dv"], Float[Array, " m"]]:
    """Transformer-XL attention of n queries over m keys, the queries being the last n
    positions of the m (query i sits at position m - n + i, key j at j).

    Arguments:
        q, k, v: projected queries, keys, values.
        r: W_{k,R} R_d for the distances d = 0 .. m - 1 (row d).
        u, vb: the global content and position biases (the paper's u and v).
        mask: True where query i may read key j (j after i must be False).
        received: also return the attention each key received, averaged over the heads
            and the queries (`[m]`, the most-used compression's usage).
    """
    n, m = q.shape[0], k.shape[0]
    if n > m:
        raise ValueError(f"relative_attention: the {n} queries must be the last of the {m} keys")
    scale = 1.0 / math.sqrt(q.shape[-1])
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ac = jnp.einsum("nhd,mhd->hnm", f32(q) + f32(u)[None], f32(k))
    distance = jnp.clip((m - n) + jnp.arange(n)[:, None] - jnp.arange(m)[None, :], 0, m - 1)
    bd = distance_term(f32(q) + f32(vb)[None], r, distance)  # row d of r is the distance d
    scores = jnp.where(mask[None], (ac + bd) * scale, -jnp.inf)
    top = jnp.max(scores, -1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(scores - top)
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
    out = jnp.einsum("hnm,mhd->nhd", weights, f32(v)).astype(v.dtype)
    return (out, weights.mean((0, 1))) if received else out


def content_attention(h, m, valid, q_proj: Linear, k_proj: Linear, v_proj: Linear, heads: int):
    """softmax((h W_q)(m W_k)^T / sqrt(d_head)) (m W_v) per head, over the valid rows of
    m (the Compressive Transformer's reconstruction attention); [n, heads * d_head]."""
    n, d = h.shape
    dh = d // heads
    q = q_proj(h).reshape(n, heads, dh)
    k = k_proj(m).reshape(m.shape[0], heads, dh)
    v = v_proj(m).reshape(m.shape[0], heads, dh)
    scores = jnp.einsum("nhd,mhd->hnm", q, k) / math.sqrt(dh)
    scores = jnp.where(valid[None, None], scores, -jnp.inf)
    top = jnp.max(scores, -1, keepdims=True)
    weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0))
    weights = weights / jnp.maximum(weights.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum("hnm,mhd->nhd", weights, v).reshape(n, d)


class Compressor(eqx.Module):
    """The compression function f_c at rate c: [n, d] -> [n / c, d] (Rae et al. 2020,
    section 3.1), over windows of c states. "conv": a 1-D convolution of kernel size and
    stride c (one Linear over each window of c consecutive states, which is exactly that
    convolution); "mean", "max": pooling over each window; "dilated_conv": a 1-D
    convolution of kernel c and dilation n / c (stride 1, no padding: the n / c outputs,
    output j reading states j, j + n/c, ..., j + (c-1) n/c); "most_used": the n / c states
    that received the most attention (`usage`), in their order (no parameters).

    With `autoencoding` it also holds the auto-encoding loss's decoder g: [n / c, d] ->
    [n, d], a Linear from each compressed slot to the c states of its window (the
    transposed convolution of the windows above; `decode`)."""

    kind: str = eqx.field(static=True)
    rate: int = eqx.field(static=True)
    conv: Linear | None
    decoder: Linear | None  # the auto-encoding loss's g

    def __init__(self, kind: str, rate: int, d_model: int, *, autoencoding: bool = False, key: PRNGKeyArray):
        if kind not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}; got {kind!r}")
        if rate < 1:
            raise ValueError(f"compression rate must be >= 1; got {rate}")
        kc, kd = jax.random.split(key)
        self.kind, self.rate = kind, rate
        self.conv = Linear(rate * d_model, d_model, key=kc) if kind in ("conv", "dilated_conv") else None
        self.decoder = Linear(d_model, rate * d_model, key=kd) if autoencoding else None

    def _windows(self, x: Float[Array, "n d"]) -> Float[Array, "nc c d"]:
        """The windows of c states each slot compresses: consecutive ones, or (dilated)
        states n / c apart."""
        n, d = x.shape
        if n % self.rate:
            raise ValueError(f"compression at rate {self.rate} needs a multiple of {self.rate} states; got {n}")
        if self.kind == "dilated_conv":
            return x.reshape(self.rate, n // self.rate, d).transpose(1, 0, 2)
        return x.reshape(n // self.rate, self.rate, d)

    def __call__(
        self, x: Float[Array, "n d"], usage: Float[Array, " n"] | None = None, keep: Int[Array, ""] | None = None
    ) -> Float[Array, "nc d"]:
        """x `[n, d]` -> `[n / c, d]`. "most_used" reads `usage` `[n]` (the attention each
        state received; -inf: not a state to keep) and keeps the `keep` (default n / c)
        most used, in their order, right-aligned (the slots before them repeat state 0)."""
        windows = self._windows(x)
        if self.kind == "mean":
            return windows.mean(1)
        if self.kind == "max":
            return windows.max(1)
        if self.kind == "most_used":
            if usage is None:
                raise ValueError("the most_used compression needs the states' usage")
            n, slots = x.shape[0], windows.shape[0]
            rank = jnp.argsort(jnp.argsort(-usage))  # 0: the most used
            chosen = rank < (slots if keep is None else keep)
            kept = jnp.sort(jnp.where(chosen, jnp.arange(n), -1))[n - slots :]
            return x[jnp.maximum(kept, 0)]
        assert self.conv is not None
        return self.conv(windows.reshape(windows.shape[0], -1))

    def decode(self, y: Float[Array, "nc d"]) -> Float[Array, "n d"]:
        """g: the auto-encoding loss's reconstruction of the n states from their n / c
        compressions, each slot giving its window's c states where they came from."""
        assert self.decoder is not None
        nc, d = y.shape
        windows = self.decoder(y).reshape(nc, self.rate, d)
        if self.kind == "dilated_conv":
            windows = windows.transpose(1, 0, 2)
        return windows.reshape(nc * self.rate, d)


class RecurrentLayer(eqx.Module):
    """One Transformer-XL layer: relative multi-head attention over concat(memory, h),
    then the position-wise FFN, each a residual branch with post-norm (the paper's
    LayerNorm(x + f(x))) or pre-norm (then the memory is normalised with the segment, as
    the official code's `pre_lnorm`). `compressor`: this layer's f_c (Compressive)."""

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    r_proj: Linear
    out_proj: Linear
    ffn: FeedForward
    norms: tuple[Norm, Norm]
    dropout: eqx.nn.Dropout
    compressor: Compressor | None
    heads: int = eqx.field(static=True)
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        d_ff: int,
        ffn: str,
        norm: str,
        pre_norm: bool,
        dropout: float,
        compression: str | None = None,
        rate: int = 1,
        autoencoding: bool = False,
        key: PRNGKeyArray,
    ):
        kq, kk, kv, kr, ko, kf, kc = jax.random.split(key, 7)
        self.q_proj = Linear(d_model, d_model, use_bias=False, key=kq)
        self.k_proj = Linear(d_model, d_model, use_bias=False, key=kk)
        self.v_proj = Linear(d_model, d_model, use_bias=False, key=kv)
        self.r_proj = Linear(d_model, d_model, use_bias=False, key=kr)
        self.out_proj = Linear(d_model, d_model, use_bias=False, key=ko)
        self.ffn = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=kf)
        self.norms = (make_norm(norm, d_model), make_norm(norm, d_model))
        self.dropout = eqx.nn.Dropout(dropout)
        self.compressor = (
            None if compression is None else Compressor(compression, rate, d_model, autoencoding=autoencoding, key=kc)
        )
        self.heads, self.pre_norm = heads, pre_norm

    def __call__(
        self,
        h: Float[Array, "n d"],
        memory: Float[Array, "mem d"],
        mask: Bool[Array, "n kv"],
        u: Float[Array, "heads dh"],
        vb: Float[Array, "heads dh"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
        received: bool = False,
    ) -> Float[Array, "n d"] | tuple[Float[Array, "n d"], Float[Array, " kv"]]:
        """h: the segment's inputs to this layer; memory: what it reads before them;
        mask [n, mem + n]: what each query may read. `received`: also return the
        attention each key received (`relative_attention`'s), `[mem + n]`."""
        n, d = h.shape
        dh = d // self.heads
        k1, k2, k3 = split_key(key, 3)
        context = jnp.concatenate([jax.lax.stop_gradient(memory).astype(h.dtype), h])
        x, c = (self.norms[0](h), self.norms[0](context)) if self.pre_norm else (h, context)
        total = context.shape[0]
        q = self.q_proj(x).reshape(n, self.heads, dh)
        k = self.k_proj(c).reshape(total, self.heads, dh)
        v = self.v_proj(c).reshape(total, self.heads, dh)
        r = self.r_proj(relative_sinusoid(jnp.arange(total), d).astype(h.dtype)).reshape(total, self.heads, dh)
        a = relative_attention(q, k, v, r, u.astype(h.dtype), vb.astype(h.dtype), mask=mask, received=received)
        a, usage = a if isinstance(a, tuple) else (a, None)
        a = self.dropout(self.out_proj(a.reshape(n, d)), key=k1, inference=inference)
        h = h + a if self.pre_norm else self.norms[0](h + a)
        f = self.dropout(
            self.ffn(self.norms[1](h) if self.pre_norm else h, key=k2, inference=inference), key=k3, inference=inference
        )
        out = h + f if self.pre_norm else self.norms[1](h + f)
        return out if usage is None else (out, jax.lax.stop_gradient(usage))

    def autoencoding_loss(self, old, old_valid, compressed) -> Array:
        """The lossless auto-encoding loss (Rae et al. 2020, section 3.2): the mean squared
        difference of the evicted states and g(f_c(them)) over the valid ones, the states
        stopped (f_c and g learn from it); 0 when no valid state was evicted."""
        assert self.compressor is not None
        old = jax.lax.stop_gradient(old).astype(jnp.float32)
        made = self.compressor.decode(compressed.astype(jnp.float32))
        squared = jnp.where(old_valid[:, None], jnp.square(old - made), 0.0)
        return squared.sum() / jnp.maximum(old_valid.sum() * old.shape[1], 1)

    def reconstruction_loss(self, h, old, old_valid, compressed, compressed_valid) -> Array:
        """Mean squared difference of the content attention of h over the evicted states
        and over their compression, with h, the evicted states and the attention weights
        stopped (only f_c learns from it); 0 when no valid state was evicted."""
        stop = jax.lax.stop_gradient
        q, k, v = stop(self.q_proj), stop(self.k_proj), stop(self.v_proj)
        h, old = stop(h).astype(jnp.float32), stop(old).astype(jnp.float32)
        target = content_attention(h, old, old_valid, q, k, v, self.heads)
        got = content_attention(h, compressed.astype(jnp.float32), compressed_valid, q, k, v, self.heads)
        return jnp.where(old_valid.any(), jnp.mean(jnp.square(target - got)), 0.0)


def _with_compressed(memory):
    """`memory` with an empty compressed memory where it has none (Transformer-XL)."""
    if "compressed" in memory:
        return memory
    hidden = memory["hidden"]
    return memory | {
        "compressed": jnp.zeros((hidden.shape[0], 0, hidden.shape[2]), hidden.dtype),
        "compressed_length": jnp.zeros((), jnp.int32),
    }


def _without_empty(memory):
    if memory["compressed"].shape[1]:
        return memory
    return {k: v for k, v in memory.items() if k not in ("compressed", "compressed_length", "usage")}


def _right_aligned(size: int, length) -> Bool[Array, " size"]:
    """Valid slots of a right-aligned memory of `size` holding `length` states."""
    return jnp.arange(size) >= size - length


class RecurrentLM(eqx.Module):
    """Transformer-XL (cmem_len 0) or Compressive Transformer causal language model,
    one example at a time (see the module docstring).

    `model(tokens)` is one segment from an empty memory (the generic language-model
    call); `model.forward(tokens, memory)` returns `(logits, new memory, reconstruction
    loss)`, and `model.init_memory(mem_len, cmem_len)` an empty memory of any length
    (nothing in the parameters depends on it: evaluation may use a longer memory than
    training, `eval_mem_len`).
    """

    table: Float[Array, "vocab d_model"]
    layers: tuple[RecurrentLayer, ...]
    u: Float[Array, "heads dh"]
    v: Float[Array, "heads dh"]
    norm: Norm | None  # the final norm of a pre-norm stack
    unembed: Linear | None  # None: tied to the embedding table
    dropout: eqx.nn.Dropout
    mem_len: int = eqx.field(static=True)
    eval_mem_len: int = eqx.field(static=True)
    cmem_len: int = eqx.field(static=True)
    rate: int = eqx.field(static=True)
    compression: str = eqx.field(static=True)
    compression_loss: str = eqx.field(static=True)  # what trains f_c: one of COMPRESSION_LOSSES
    max_len: int = eqx.field(static=True)
    dtype: str = eqx.field(static=True)
    same_layer: bool = eqx.field(static=True)  # ERNIE-Doc: layer l remembers its own outputs
    retrospective: bool = eqx.field(static=True)  # ERNIE-Doc: each record read twice, the second trained
    segment_len: int | None = eqx.field(static=True)  # segments within a record (None: the record)

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_heads: int,
        num_layers: int,
        *,
        d_ff: int,
        ffn: str = "gelu",
        norm: str = "layernorm",
        pre_norm: bool = False,
        dropout: float = 0.0,
        mem_len: int,
        eval_mem_len: int | None = None,
        cmem_len: int = 0,
        compression: str = "conv",
        compression_loss: str = "attention",
        rate: int = 1,
        max_len: int,
        tie: bool = True,
        dtype: str = "float32",
        same_layer: bool = False,
        retrospective: bool = False,
        segment_len: int | None = None,
        key: PRNGKeyArray,
    ):
        if segment_len is not None and not 1 <= segment_len <= max_len:
            raise ValueError(f"segment_len must be None or in [1, max_len = {max_len}]; got {segment_len}")
        if (same_layer or retrospective or segment_len is not None) and cmem_len:
            raise ValueError("ERNIE-Doc's recurrence and retrospective feed take no compressed memory (cmem_len 0)")
        self.same_layer, self.retrospective, self.segment_len = same_layer, retrospective, segment_len
        for name, value, low in (
            ("mem_len", mem_len, 0),
            ("cmem_len", cmem_len, 0),
            ("rate", rate, 1),
            ("eval_mem_len", mem_len if eval_mem_len is None else eval_mem_len, 0),
        ):
            if value < low:
                raise ValueError(f"{name} must be >= {low}; got {value}")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if compression_loss not in COMPRESSION_LOSSES:
            raise ValueError(f"compression_loss must be one of {COMPRESSION_LOSSES}; got {compression_loss!r}")
        if cmem_len and mem_len % rate:
            raise ValueError(
                f"the compressive memory needs mem_len ({mem_len}) to be a multiple of the compression rate ({rate})"
            )
        kt, kl, ku, kv, ko = jax.random.split(key, 5)
        dh = d_model // num_heads
        self.table = jax.random.normal(kt, (vocab_size, d_model)) / math.sqrt(d_model)
        self.layers = tuple(
            RecurrentLayer(
                d_model,
                num_heads,
                d_ff=d_ff,
                ffn=ffn,
                norm=norm,
                pre_norm=pre_norm,
                dropout=dropout,
                compression=compression if cmem_len else None,
                rate=rate,
                autoencoding=compression_loss == "autoencoding",
                key=k,
            )
            for k in jax.random.split(kl, num_layers)
        )
        self.u = 0.02 * jax.random.normal(ku, (num_heads, dh))
        self.v = 0.02 * jax.random.normal(kv, (num_heads, dh))
        self.norm = make_norm(norm, d_model) if pre_norm else None
        self.unembed = None if tie else Linear(d_model, vocab_size, use_bias=False, key=ko)
        self.dropout = eqx.nn.Dropout(dropout)
        self.mem_len, self.cmem_len, self.rate, self.max_len, self.dtype = mem_len, cmem_len, rate, max_len, dtype
        self.eval_mem_len = mem_len if eval_mem_len is None else eval_mem_len
        self.compression, self.compression_loss = compression, compression_loss

    @property
    def compressive(self) -> bool:
        return self.cmem_len > 0

    def init_memory(self, mem_len: int | None = None, cmem_len: int | None = None) -> dict[str, Array]:
        """An empty memory: `hidden [layers, mem_len, d]` (per layer, that layer's inputs
        of the last mem_len positions, right-aligned), `length` (valid slots), and
        `compressed [layers, cmem_len, d]` with `compressed_length` (only when
        cmem_len > 0: checkpoints refuse empty arrays), and for the most-used compression
        `usage [layers, mem_len]`, the attention each remembered state has received in
        the segments since it came (summed over them; each segment's the mean over its
        heads and queries)."""
        mem_len = self.mem_len if mem_len is None else mem_len
        cmem_len = self.cmem_len if cmem_len is None else cmem_len
        if mem_len < 0 or cmem_len < 0 or (cmem_len and not self.compressive):
            raise ValueError(
                f"a memory needs mem_len >= 0 and cmem_len >= 0 (0 without compression); got {mem_len=}, "
                f"{cmem_len=} for a model with cmem_len {self.cmem_len}"
            )
        if cmem_len and mem_len % self.rate:
            raise ValueError(f"mem_len ({mem_len}) must be a multiple of the compression rate ({self.rate})")
        layers, d = len(self.layers), self.table.shape[1]
        dtype = jnp.dtype(self.dtype)
        memory = {"hidden": jnp.zeros((layers, mem_len, d), dtype), "length": jnp.zeros((), jnp.int32)}
        if cmem_len:
            memory |= {
                "compressed": jnp.zeros((layers, cmem_len, d), dtype),
                "compressed_length": jnp.zeros((), jnp.int32),
            }
            if self.compression == "most_used":
                memory["usage"] = jnp.zeros((layers, mem_len), jnp.float32)
        return memory

    def _logits(self, x):
        if self.norm is not None:
            x = self.norm(x)
        if self.unembed is None:
            return (x @ self.table.T.astype(x.dtype)).astype(jnp.float32)
        return self.unembed(x).astype(jnp.float32)

    def forward(
        self,
        tokens: Int[Array, " n"],
        memory: dict[str, Array],
        *,
        mask: Bool[Array, " n"] | None = None,
        attend: Bool[Array, "n n"] | None = None,
        update: bool = True,
        same_layer: bool | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "n vocab"], dict[str, Array], Float[Array, ""]]:
        """One segment after `memory`: (logits [n, vocab], the memory after it, the mean
        attention-reconstruction loss over the layers (0 without compression)).

        Arguments:
            tokens: the segment; mask: `[n]` True for real tokens (padding is never read
                as a key; memories assume a full segment).
            attend: `[n, n]` an extra restriction of which current positions each query
                reads (ANDed with causality; for tests of the equivalent one-pass mask).
            update: compute the new memory (False: return `memory` as it is).
            same_layer: remember each layer's outputs (ERNIE-Doc) rather than its inputs
                (None: the model's; decoding keeps the inputs, see the module docstring).
        """
        n = check_tokens(tokens, mask)
        if n > self.max_len:
            raise ValueError(f"segment length {n} exceeds the model's max_len {self.max_len}")
        memory = _with_compressed(memory)
        hidden, compressed = memory["hidden"], memory["compressed"]
        mem_len, cmem_len = hidden.shape[1], compressed.shape[1]
        if hidden.shape[0] != len(self.layers) or compressed.shape[0] != len(self.layers):
            raise ValueError(f"memory for {hidden.shape[0]} layers; the model has {len(self.layers)}")
        if cmem_len and n % self.rate:
            raise ValueError(f"a compressive memory needs segments of a multiple of the rate {self.rate}; got {n}")
        mem_valid = jnp.concatenate(
            [_right_aligned(cmem_len, memory["compressed_length"]), _right_aligned(mem_len, memory["length"])]
        )
        total = cmem_len + mem_len + n
        causal = jnp.arange(total)[None, :] <= (cmem_len + mem_len) + jnp.arange(n)[:, None]
        current = jnp.ones((n,), bool) if mask is None else mask
        allowed = causal & jnp.concatenate([mem_valid, current])[None, :]
        if attend is not None:
            allowed = allowed & jnp.concatenate([jnp.ones((n, cmem_len + mem_len), bool), attend], 1)
        keys = split_key(key, len(self.layers) + 1)
        x = (lookup(self.table, tokens) * math.sqrt(self.table.shape[1])).astype(self.dtype)
        x = self.dropout(x, key=keys[-1], inference=inference)
        remembered, same_layer = [], self.same_layer if same_layer is None else same_layer
        track, received = "usage" in memory, []
        for i, layer in enumerate(self.layers):
            context = jnp.concatenate([compressed[i], hidden[i]])
            h = layer(x, context, allowed, self.u, self.v, key=keys[i], inference=inference, received=track)
            if isinstance(h, tuple):  # the most-used compression: what each memory slot and state received
                h, usage = h
                received.append(usage[cmem_len:])
            remembered.append(h if same_layer else x)  # ERNIE-Doc's h^n_τ, Transformer-XL's h^{n-1}_τ
            x = h
        logits = self._logits(x)
        if not update:
            return logits, _without_empty(memory), jnp.zeros((), jnp.float32)
        new, recon = self._update(memory, jnp.stack(remembered), n, jnp.stack(received) if track else None)
        return logits, _without_empty(new), recon

    def _update(self, memory, inputs, n, received=None):
        """The memory after a segment whose layer inputs are `inputs [layers, n, d]`;
        `received [layers, mem + n]`: the attention the memory and the segment's states
        received in it (the most-used compression's usage)."""
        hidden, compressed = memory["hidden"], memory["compressed"]
        mem_len, cmem_len = hidden.shape[1], compressed.shape[1]
        joined = jnp.concatenate([hidden, jax.lax.stop_gradient(inputs).astype(hidden.dtype)], 1)
        new = {
            "hidden": joined[:, n:],
            "length": jnp.minimum(memory["length"] + n, mem_len),
            "compressed": compressed,
            "compressed_length": memory["compressed_length"],
        }
        recon = jnp.zeros((), jnp.float32)
        if not cmem_len:
            return new, recon
        evicted = joined[:, :n]  # the oldest n of memory + segment; the valid ones are its last `count`
        count = jnp.maximum(memory["length"] + n - mem_len, 0)
        old_valid = _right_aligned(n, count)
        new_valid = _right_aligned(n // self.rate, count // self.rate)
        usage = None
        if received is not None:  # each state's usage so far: the memory's plus this segment's
            summed = jnp.concatenate([memory["usage"], jnp.zeros((len(self.layers), n), jnp.float32)], 1) + received
            new["usage"], usage = summed[:, n:], jnp.where(old_valid[None], summed[:, :n], -jnp.inf)
        squeezed, losses = [], []
        for i, layer in enumerate(self.layers):
            assert layer.compressor is not None
            made = layer.compressor(evicted[i], None if usage is None else usage[i], count // self.rate)
            squeezed.append(made)
            if self.compression_loss == "autoencoding":
                losses.append(layer.autoencoding_loss(evicted[i], old_valid, made))
            else:
                losses.append(layer.reconstruction_loss(inputs[i], evicted[i], old_valid, made, new_valid))
        joined_c = jnp.concatenate([compressed, jax.lax.stop_gradient(jnp.stack(squeezed)).astype(compressed.dtype)], 1)
        new["compressed"] = joined_c[:, n // self.rate :]
        new["compressed_length"] = jnp.minimum(memory["compressed_length"] + count // self.rate, cmem_len)
        return new, jnp.mean(jnp.stack(losses))

    def __call__(
        self, tokens: Int[Array, " seq"], mask: Bool[Array, " seq"] | None = None, **kwargs
    ) -> Float[Array, "seq vocab"]:
        """`apply(...)`'s output alone (the arguments are `apply`'s): from no memory, the
        next-token logits of one segment (`[seq, vocab]`, row i predicts token i + 1)."""
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
        """A record after `memory`, as the train step calls every model: (logits
        `[seq, vocab]`, Produced) with the memory after it (`Produced.memory`) and, for a
        compressive model, its attention-reconstruction loss
        (`Produced.losses["reconstruction_loss"]`). The record is one segment, or
        (ERNIE-Doc) segments of `segment_len`, read twice with the retrospective feed.
        `memory` None: one segment from an empty memory, and no memory comes out (the
        retrospective feed: the record read twice from an empty memory)."""
        if memory is None and not self.retrospective:  # one segment (decoding's parallel twin)
            logits, _, _ = self.forward(
                tokens, self.init_memory(0, 0), mask=mask, update=False, key=key, inference=inference
            )
            return logits, Produced()
        logits, new, recon = self._read(tokens, self.init_memory() if memory is None else memory, mask, key, inference)
        if memory is None:
            return logits, Produced()
        name = "reconstruction_loss" if self.compression_loss == "attention" else "autoencoding_loss"
        losses = {name: recon} if self.compressive else {}
        return logits, Produced(losses=losses, memory=new)

    def _read(self, tokens, memory, mask, key, inference):
        """A record after `memory`: its segments (`segment_len`) in order, twice with the
        retrospective feed (the second pass's logits returned); (logits, memory, mean
        reconstruction loss)."""
        n, size = tokens.shape[0], self.segment_len or tokens.shape[0]
        if n % size:
            raise ValueError(f"a record of {n} tokens is no whole number of segments of segment_len {size}")
        passes = 2 if self.retrospective else 1
        starts = [(p, s) for p in range(passes) for s in range(0, n, size)]
        keys, recon, logits = split_key(key, len(starts)), [], []
        for (p, s), k in zip(starts, keys, strict=True):
            part = None if mask is None else mask[s : s + size]
            out, memory, r = self.forward(tokens[s : s + size], memory, mask=part, key=k, inference=inference)
            recon.append(r)
            if p == passes - 1:  # the last pass: the one trained
                logits.append(out)
        return jnp.concatenate(logits), memory, jnp.mean(jnp.stack(recon))

    def init_decode_state(self, max_len: int) -> dict[str, Any]:
        """Decoding state for up to `max_len` tokens: a memory of max_len slots (no
        compression), so token t reads every earlier token, as the parallel call does."""
        if self.retrospective:
            raise ValueError(
                "ERNIE-Doc's retrospective feed cannot generate: its trained (second) pass reads the memory of the "
                "whole record, so every position reads the tokens after it; train with stack.retrospective false "
                "for a causal language model"
            )
        if max_len > self.max_len:
            raise ValueError(f"decoding length {max_len} exceeds the model's max_len {self.max_len}")
        return {"memory": self.init_memory(max_len, 0), "length": jnp.zeros((), jnp.int32)}

    @property
    def vocab_size(self) -> int:
        """Token ids the model reads: [0, vocab_size)."""
        return self.table.shape[0]

    def decode_step(
        self, token: Int[Array, ""], state: dict[str, Any]
    ) -> tuple[Float[Array, " vocab"], dict[str, Any]]:
        """Feed one token (a segment of one after the memory); the next-token logits and
        the new state."""
        logits, memory, _ = self.forward(token[None], state["memory"], same_layer=False, inference=True)
        return logits[0], {"memory": memory, "length": state["length"] + 1}


def segment_mask(length: int, segment: int, mem_len: int) -> Bool[Array, "length length"]:
    """What query p reads when a sequence of `length` is processed in segments of
    `segment` with a Transformer-XL memory of `mem_len`, as one mask over the whole
    sequence: keys q with floor(p / segment) * segment - mem_len <= q <= p. (By induction
    over the layers, each layer's state at q is the one the segmented run computed when
    q's segment was processed, so one pass with this mask is the segmented run.)"""
    p = jnp.arange(length)[:, None]
    q = jnp.arange(length)[None, :]
    return (q <= p) & (q >= (p // segment) * segment - mem_len)
