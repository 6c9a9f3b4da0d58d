"""Incremental decoding: one token at a time against a state of fixed shape, so a whole
generation compiles once; and `generate`, sampling from a model with `lax.scan`.

Each registered attention with a `decoder` decodes through one of three states:

* "cache" (softmax, chunked): a preallocated key/value cache of `max_len` slots. A step
  costs O(max_len * d); the slots not yet written are masked out.
* "window" (causal sliding-window `local`): a ring buffer of the last `window + 1` keys
  and values, O(window * d) memory and time per step whatever the length.
* "recurrent" (linear, Performer, RFA): the constant-size state of seed 002 eq. 4-6,
  S = sum_j phi(k_j) v_j^T and Z = sum_j phi(k_j): the transformer as an RNN, O(m * d) per
  step and O(1) memory in the length. Performer keeps its stabiliser as a running max
  of the keys' log-features, rescaling (S, Z) when it grows, as its chunked form does.

Parity (tested): decoding a sequence token by token gives the causal parallel forward's
outputs to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from jxformers import registry
from jxformers.ops import performer_features, rfa_features, softmax_attention
from jxformers.ops._common import group_heads
from jxformers.ops.kernelized import (
    FEATURE_MAPS,
    guarded_divide,
    performer_log_features,
    performer_query_features,
)

_NO_SCALE = -1e30  # the Performer stabiliser before any key: exp(_NO_SCALE - x) == 0


class KVCache(eqx.Module):
    """Keys and values of the positions decoded so far, in `slots` slots; position p
    lives in slot p % slots (a ring buffer when slots is the window)."""

    k: Float[Array, "slots kv_heads d_k"]
    v: Float[Array, "slots kv_heads d_v"]
    slot_pos: Int[Array, " slots"]  # the position each slot holds; -1 while empty
    length: Int[Array, ""]  # tokens decoded so far (the next position)


class RecurrentState(eqx.Module):
    """Kernelized attention's prefix sums, in float32."""

    s: Float[Array, "kv_heads m d_v"]
    z: Float[Array, "kv_heads m"]
    log_scale: Float[Array, ""]  # key features were divided by exp(log_scale) (Performer)
    length: Int[Array, ""]


State = KVCache | RecurrentState
BiasFn = Callable[[Int[Array, " q"], Int[Array, " kv"]], Float[Array, "heads q kv"]]


def _key_features(name: str, k: Array, arrays: Mapping[str, Any], hp: Mapping[str, Any]) -> tuple[Array, Array | None]:
    """Key features [kv_heads, m] of one token, or (for Performer's softmax kernel) the
    log-features and their max, which the caller shifts by the running stabiliser."""
    if name == "linear":
        return FEATURE_MAPS[hp["feature_map"]](k.astype(jnp.float32)), None
    if name == "rfa":
        return rfa_features(k[None], arrays["projection"])[0], None
    if name == "performer":
        if hp["kernel"] == "relu":
            return performer_features(k[None], arrays["projection"], kernel="relu")[0], None
        log_k = performer_log_features(k[None], arrays["projection"])[0]
        return log_k, jnp.max(log_k)
    raise ValueError(f"no recurrent features for attention {name!r}")


def _query_features(name: str, q: Array, arrays: Mapping[str, Any], hp: Mapping[str, Any]) -> Array:
    if name == "performer" and hp["kernel"] == "softmax":
        return performer_query_features(q[None], arrays["projection"])[0]
    features, _ = _key_features(name, q, arrays, hp)
    return features


RECURRENT = ("linear", "performer", "rfa")  # the attentions `_key_features` knows


def init_state(
    name: str,
    *,
    max_len: int,
    kv_heads: int,
    d_k: int,
    d_v: int,
    arrays: Mapping[str, Any] | None = None,
    dtype: jnp.dtype = jnp.float32,
    **hyper_parameters,
) -> State:
    """The empty decoding state of attention `name` for sequences up to `max_len`.

    Arguments:
        name: a registered attention with a decoder (`registry.names(decode=True)`).
        max_len: longest sequence to decode (the cache's slots; unused by "recurrent").
        kv_heads, d_k, d_v: key/value heads and head sizes.
        arrays: the attention's arrays (Performer's projection sets the feature count).
        dtype: of cached keys and values (recurrent states are always float32).
        **hyper_parameters: as for the op (e.g. `window` for "local").
    """
    spec = registry.get(name)
    hp = spec.validate(hyper_parameters)
    if spec.decoder is None:
        raise ValueError(f"{name} attention cannot decode incrementally; ones that can: {registry.names(decode=True)}")
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int; got {max_len!r}")
    zero = jnp.zeros((), jnp.int32)
    if spec.decoder in ("cache", "window"):
        slots = max_len if spec.decoder == "cache" else min(max_len, hp["window"] + 1)
        return KVCache(
            jnp.zeros((slots, kv_heads, d_k), dtype), jnp.zeros((slots, kv_heads, d_v), dtype),
            jnp.full((slots,), -1, jnp.int32), zero,
        )
    probe = jax.eval_shape(lambda: _key_features(name, jnp.zeros((kv_heads, d_k)), arrays or {}, hp)[0])
    m = probe.shape[-1]
    return RecurrentState(
        jnp.zeros((kv_heads, m, d_v), jnp.float32), jnp.zeros((kv_heads, m), jnp.float32),
        jnp.asarray(_NO_SCALE, jnp.float32), zero,
    )


def decode_step(
    name: str,
    q: Float[Array, "heads d_k"],
    k: Float[Array, "kv_heads d_k"],
    v: Float[Array, "kv_heads d_v"],
    state: State,
    *,
    arrays: Mapping[str, Any] | None = None,
    bias_fn: BiasFn | None = None,
    **hyper_parameters,
) -> tuple[Float[Array, "heads d_v"], State]:
    """Attend the next token's query to every key so far (its own included).

    Arguments:
        name: the attention (as `init_state`).
        q, k, v: the new token's query, key and value (one position, no length axis).
        state: from `init_state` or the previous step.
        arrays: the attention's arrays (Performer's projection...).
        bias_fn: optional additive bias from positions, `bias_fn(q_pos [1], kv_pos [slots])
            -> [heads, 1, slots]` (ALiBi, T5); only for attentions that take a bias.

    Returns:
        The output `[heads, d_v]` (dtype of q) and the new state.
    """
    spec = registry.get(name)
    hp = spec.validate(hyper_parameters)
    arrays = arrays or {}
    if isinstance(state, KVCache):
        slot = state.length % state.k.shape[0]
        state = KVCache(
            state.k.at[slot].set(k.astype(state.k.dtype)), state.v.at[slot].set(v.astype(state.v.dtype)),
            state.slot_pos.at[slot].set(state.length), state.length + 1,
        )
        bias = None
        if bias_fn is not None:
            if not spec.bias:
                raise ValueError(f"{name} attention does not take a bias; ones that do: {registry.names(bias=True)}")
            bias = bias_fn(state.length[None] - 1, jnp.maximum(state.slot_pos, 0))
        out = softmax_attention(q[None], state.k, state.v, kv_mask=state.slot_pos >= 0, bias=bias)[0]
        return out.astype(q.dtype), state
    if bias_fn is not None:
        raise ValueError(f"{name} attention does not take a bias; ones that do: {registry.names(bias=True)}")
    phi_k, log_max = _key_features(name, k, arrays, hp)
    s, z, log_scale = state.s, state.z, state.log_scale
    if log_max is not None:  # Performer: phi_k holds log-features; shift by the running max
        new_scale = jnp.maximum(log_scale, jax.lax.stop_gradient(log_max))
        shrink = jnp.exp(log_scale - new_scale)
        s, z, log_scale = s * shrink, z * shrink, new_scale
        phi_k = jnp.exp(phi_k - new_scale) / math.sqrt(phi_k.shape[-1])
    s = s + jnp.einsum("hm,hd->hmd", phi_k, v.astype(jnp.float32))
    z = z + phi_k
    phi_q = group_heads(_query_features(name, q, arrays, hp)[None], k.shape[0])[0]  # [kv_heads, g, m]
    out = guarded_divide(jnp.einsum("hgm,hmd->hgd", phi_q, s), jnp.einsum("hgm,hm->hg", phi_q, z))
    return out.reshape(q.shape[0], v.shape[-1]).astype(q.dtype), RecurrentState(s, z, log_scale, state.length + 1)


def _check_registry():
    missing = [n for n in registry.names() if registry.get(n).decoder == "recurrent" and n not in RECURRENT]
    if missing:
        raise RuntimeError(f"attentions {missing} declare a recurrent decoder but decoding.py has no features for them")


_check_registry()


# ----------------------------------------------------------------------------- generation


def sample_logits(logits: Float[Array, " vocab"], key: PRNGKeyArray, *, temperature: float, top_k: int | None) -> Int[Array, ""]:
    """One token from `logits`: greedy when temperature == 0, else softmax(logits / T)
    restricted to the `top_k` largest logits when given."""
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(
    model,
    prompt: Int[Array, " prompt_len"],
    steps: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
) -> Int[Array, " total"]:
    """Continue `prompt` by `steps` tokens sampled from a language model.

    The prompt is fed through `model.decode_step` one token at a time, then each sampled
    token is fed back; both loops are `lax.scan`s over a state of fixed shape, so the
    whole call compiles once. With `use_cache=False` every step instead reruns the
    parallel forward on the whole (padded) sequence and reads one row: the recompute
    baseline of seed 002's table 2, which works for any causal attention.

    Arguments:
        model: a `jxformers.nn.LanguageModel` (anything with `init_decode_state(max_len)`,
            `decode_step(token, state)` and `max_len`; and `__call__` for use_cache=False).
        prompt: `[prompt_len]` token ids, at least one.
        steps: tokens to generate (>= 0).
        key: PRNG key for sampling.
        temperature: 0 for greedy decoding; > 0 to sample.
        top_k: sample among the k most likely tokens (None: all).
        use_cache: decode incrementally (True) or recompute (False).

    Returns:
        `[prompt_len + steps]`: the prompt followed by the generated tokens.
    """
    n_prompt = prompt.shape[0]
    total = n_prompt + steps
    if n_prompt < 1:
        raise ValueError("prompt must hold at least one token")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0; got {steps!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0; got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
    if total > model.max_len:
        raise ValueError(f"prompt_len + steps = {total} exceeds the model's max_len {model.max_len}")
    prompt = prompt.astype(jnp.int32)
    sample = lambda logits, k: sample_logits(logits, k, temperature=temperature, top_k=top_k)  # noqa: E731
    keys = jax.random.split(key, max(steps, 1))

    if not use_cache:
        buffer = jnp.zeros((total,), jnp.int32).at[:n_prompt].set(prompt)

        def recompute(buffer, xs):
            pos, k = xs
            token = sample(model(buffer)[pos - 1], k)
            return buffer.at[pos].set(token), None

        buffer, _ = jax.lax.scan(recompute, buffer, (jnp.arange(n_prompt, total), keys[:steps]))
        return buffer

    def feed(state, token):
        logits, state = model.decode_step(token, state)
        return state, logits

    state, logits = jax.lax.scan(feed, model.init_decode_state(total), prompt)

    def step(carry, k):
        logits, state = carry
        token = sample(logits, k)
        logits, state = model.decode_step(token, state)
        return (logits, state), token

    _, new = jax.lax.scan(step, (logits[-1], state), keys[:steps])
    return jnp.concatenate([prompt, new])
