"""Score options: changes to the attention logits or the softmax that an op which forms
the logits can take as keywords (`softmax_attention` and `chunked_attention` today).

    softcap   c * tanh(s / c) of the logits (Gemma Team 2024, "Gemma 2: Improving Open
              Language Models at a Practical Size", arXiv 2408.00118, section 2: 50 in
              attention there); bounded logits, smooth gradients.
    top_k     each query keeps its k largest logits among the keys it may attend and
              masks the rest (Zhao et al. 2019, "Explicit Sparse Transformer:
              Concentrated Attention Through Explicit Selection", arXiv 1912.11637, eq. 4-5;
              all keys tied with the k-th value are kept, as a threshold at it does).
    sinks     "zero": one more key of logit 0 and value 0 in every softmax, so a query may
              attend to nothing (the "+1" in the denominator: Miller 2023, "Attention Is
              Off By One"; Xiao et al. 2023, "Efficient Streaming Language Models with
              Attention Sinks", arXiv 2309.17453, section 3.3, Zero Sink); "learned": that
              key's logit is a parameter per head (OpenAI 2025, gpt-oss model card,
              arXiv 2508.10925: "a learned bias in the denominator").
    talking_heads
              the heads' logits mixed by a learned [heads, heads] matrix before the
              softmax and their probabilities by another after it (Shazeer et al. 2020,
              "Talking-Heads Attention", arXiv 2003.02436, section 4: P_l, P_w).
    persistent_kv
              m learned key and value vectors per key head joined in front of the keys of
              every call, attended by every query, causal or not, at no position
              (Sukhbaatar et al. 2019, "Augmenting Self-attention with Persistent Memory",
              arXiv 1907.01470, section 4: the all-attention layer's persistent vectors).

Soft-capping and the sinks are also computed inside the flash kernels: their formula,
their vocabulary (`SINKS`) and their checks live in `jxformers.kernels.scores`.

Each option is a static hyper-parameter of the op (the learned sink logits an array
from its `init_arrays`), so a model config names it beside the attention
(`attention: {name: softmax, softcap: 30, sinks: learned}`), and decoding passes it on.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers._typing import ArrayLike
from jxformers.kernels.scores import check_sinks, check_softcap
from jxformers.validate import Limits

# Every score option's hyper-parameters and arrays: what a kv-cache decoder passes on.
SCORE_OPTIONS = (
    "softcap",
    "top_k",
    "sinks",
    "sink_logits",
    "talking_heads",
    "talking_logits",
    "talking_weights",
    "persistent_kv",
    "persistent_k",
    "persistent_v",
)

# Written once, read by each op's registration.
SCORE_OPTION_DOCS = {
    "softcap": "c: logits become c * tanh(s / c) (Gemma 2); None: uncapped",
    "top_k": "each query keeps its k largest logits (Explicit Sparse Transformer); None: all",
    "sinks": "none, zero (a key of logit 0, value 0: the +1 in the denominator) or learned (a logit per head)",
    "talking_heads": "mix the heads' logits before the softmax and their weights after it (learned matrices)",
    "persistent_kv": "m learned key/value vectors per key head joined to every call's keys (all-attention)",
}
SCORE_OPTION_LIMITS = {"softcap": Limits(above=0), "top_k": Limits(minimum=1), "persistent_kv": Limits(minimum=0)}


def check_score_options(
    heads: int,
    *,
    softcap: float | None = None,
    top_k: int | None = None,
    sinks: str = "none",
    sink_logits: ArrayLike | None = None,
    talking_heads: bool = False,
    talking_logits: ArrayLike | None = None,
    talking_weights: ArrayLike | None = None,
    persistent_kv: int = 0,
    persistent_k: ArrayLike | None = None,
    persistent_v: ArrayLike | None = None,
    kv_heads: int | None = None,
) -> list[str]:
    """The names of the options in use; ValueError naming a bad one."""
    check_softcap(softcap)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None; got {top_k!r}")
    check_sinks(heads, sinks, sink_logits)
    mixers = {"talking_logits": talking_logits, "talking_weights": talking_weights}
    if talking_heads:
        for name, mixer in mixers.items():
            if mixer is None or jnp.shape(mixer) != (heads, heads):
                shape = None if mixer is None else jnp.shape(mixer)
                raise ValueError(f"talking_heads needs {name} of shape ({heads}, {heads}); got {shape}")
    elif any(m is not None for m in mixers.values()):
        raise ValueError("talking_logits and talking_weights are read only with talking_heads=True")
    if isinstance(persistent_kv, bool) or not isinstance(persistent_kv, int) or persistent_kv < 0:
        raise ValueError(f"persistent_kv must be an int >= 0; got {persistent_kv!r}")
    stores = {"persistent_k": persistent_k, "persistent_v": persistent_v}
    if persistent_kv:
        for name, store in stores.items():
            shape = None if store is None else jnp.shape(store)
            if shape is None or len(shape) != 3 or shape[0] != persistent_kv or shape[1] != kv_heads:
                raise ValueError(
                    f"persistent_kv={persistent_kv} needs {name} of shape ({persistent_kv}, {kv_heads}, d); got {shape}"
                )
    elif any(x is not None for x in stores.values()):
        raise ValueError("persistent_k and persistent_v are read only with persistent_kv > 0")
    used = {
        "softcap": softcap is not None,
        "top_k": top_k is not None,
        "sinks": sinks != "none",
        "talking_heads": bool(talking_heads),
        "persistent_kv": persistent_kv > 0,
    }
    return [name for name, on in used.items() if on]


def top_k_mask(s: Float[Array, "*n q k"], allowed: Bool[ArrayLike, "*#n #q k"], top_k: int) -> Bool[Array, "*n q k"]:
    """True where a logit is among its row's `top_k` largest allowed ones (a row with
    fewer allowed keys keeps them all; ties with the k-th value are kept)."""
    k = min(top_k, s.shape[-1])
    candidates = jnp.where(allowed, s, -jnp.inf)
    kth = jax.lax.top_k(candidates, k)[0][..., -1:]
    return candidates >= kth


def sink_part(
    sinks: str, sink_logits: ArrayLike | None, shape: tuple[int, ...]
) -> list[tuple[Float[Array, "h g q 1"], Bool[Array, "h g q 1"]]]:
    """The sink as one more part of a joint softmax (`softmax_parts`) for logits of
    `shape` `[kv_heads, group, q_len, ...]` (query head = kv head * group + index in the
    group, as `group_heads`): a column of its logit, always attended; [] without one."""
    if sinks == "none":
        return []
    h, g, q_len = shape[:3]
    if sinks == "zero":
        logit = jnp.zeros((h, g, q_len, 1), jnp.float32)
    else:
        assert sink_logits is not None  # check_score_options said so
        per_head = jnp.asarray(sink_logits, jnp.float32).reshape(h, g, 1, 1)
        logit = jnp.broadcast_to(per_head, (h, g, q_len, 1))
    return [(logit, jnp.ones((h, g, q_len, 1), bool))]


def mix_heads(x: Float[Array, "h g q k"], mixer: ArrayLike | None) -> Float[Array, "h g q k"]:
    """Talking heads: head j of the result is sum_i x_i mixer[i, j], over the query
    heads (`[kv_heads, group, ...]` flattened in `group_heads`' order)."""
    assert mixer is not None  # check_score_options said so
    h, g = x.shape[:2]
    flat = x.reshape(h * g, *x.shape[2:])
    mixed = jnp.einsum("iqk,ij->jqk", flat, jnp.asarray(mixer, jnp.float32))
    return mixed.reshape(x.shape)


def prepend_persistent(
    persistent_k: ArrayLike | None,
    persistent_v: ArrayLike | None,
    k: ArrayLike,
    v: ArrayLike,
    *,
    kv_mask: ArrayLike | None,
    mask: ArrayLike | None,
    bias: ArrayLike | None,
) -> tuple[Array, Array, Array | None, Array | None, Array | None]:
    """(k, v, kv_mask, mask, bias) with the persistent vectors in front of the keys:
    real (kv_mask True), allowed to every query (mask True) and unbiased (bias 0). With
    the bottom-right causal alignment of the ops, they sit before every query.

    The vectors are sqrt(d_k) and sqrt(m) times the arrays given: the authors' code
    (facebookresearch/adaptive-span, persistent_memory.py) stores keys ~ N(0, 1/d_k) and
    values ~ N(0, 1/m) and uses them times sqrt(d_k) and sqrt(m), so the vectors start
    ~ N(0, 1) and an optimizer's step on the stored arrays moves them that much more."""
    assert persistent_k is not None and persistent_v is not None  # check_score_options said so
    m, d_k = jnp.shape(persistent_k)[0], jnp.shape(persistent_k)[-1]
    scale_k, scale_v = math.sqrt(d_k), math.sqrt(m)
    k = jnp.concatenate([(jnp.asarray(persistent_k) * scale_k).astype(jnp.result_type(k)), jnp.asarray(k)])
    v = jnp.concatenate([(jnp.asarray(persistent_v) * scale_v).astype(jnp.result_type(v)), jnp.asarray(v)])
    if kv_mask is not None:
        kv_mask = jnp.concatenate([jnp.ones((m,), bool), jnp.asarray(kv_mask)])
    if mask is not None:
        mask = jnp.concatenate([jnp.ones((jnp.shape(mask)[0], m), bool), jnp.asarray(mask)], -1)
    if bias is not None:
        bias = jnp.asarray(bias)
        bias = jnp.concatenate([jnp.zeros((*bias.shape[:-1], m), bias.dtype), bias], -1)
    return k, v, kv_mask, mask, bias


def init_score_arrays(
    key: PRNGKeyArray,
    *,
    heads: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    sinks: str = "none",
    talking_heads: bool = False,
    persistent_kv: int = 0,
) -> dict[str, Array]:
    """The learned arrays of the score options: the sink logits (zeros: the zero sink to
    start with) when `sinks` is "learned"; the talking-heads matrices P_l and P_w (the
    identity: plain multi-head attention to start with) when `talking_heads`; the
    persistent keys ~ N(0, 1/d_k) and values ~ N(0, 1/m) (used times sqrt(d_k) and sqrt(m):
    `prepend_persistent`) when `persistent_kv` = m > 0."""
    out = {}
    if sinks == "learned":
        out["sink_logits"] = jnp.zeros((heads,), jnp.float32)
    if talking_heads:
        out["talking_logits"] = jnp.eye(heads, dtype=jnp.float32)
        out["talking_weights"] = jnp.eye(heads, dtype=jnp.float32)
    if persistent_kv:
        kk, kv = jax.random.split(key)
        out["persistent_k"] = jax.random.normal(kk, (persistent_kv, kv_heads, d_k)) / jnp.sqrt(d_k)
        out["persistent_v"] = jax.random.normal(kv, (persistent_kv, kv_heads, d_v)) / jnp.sqrt(persistent_kv)
    return out
