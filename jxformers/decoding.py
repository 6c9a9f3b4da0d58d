"""Decoder factories: each builds the `(init, step)` pair (a `registry.Decoder`) that
decodes an attention one token at a time against a state of fixed shape, so a whole
generation compiles once. An attention's registration picks one and parameterises it
with its own pieces; nothing here knows any attention by name.

* `kv_cache(attend)`: a preallocated key/value cache of `max_len` slots (softmax,
  chunked); a step costs O(max_len * d), slots not yet written are masked out.
* `ring_buffer(attend, slots)`: the last `slots(hyper_parameters)` keys and values
  (causal sliding window: `window + 1`), O(window * d) memory and time per step.
* `full_cache_init`, `cache_append`: that cache for attentions that write their own step
  over every key (adaptive sparse, Long-Short).
* `TaggedCache`: every key with integer tags (buckets, clusters), the state of the
  decoders the learnable patterns (LSH, Routing, Sinkhorn) build from their own steps.
* `recurrent(features, query_features=None, gate=None)`: the constant-size state of
  Katharopoulos et al. 2020 ("Transformers are RNNs", arXiv 2006.16236) eq. 4-6,
  S = sum_j phi(k_j) v_j^T and Z = sum_j phi(k_j): the transformer as an RNN, O(m * d)
  per step and O(1) memory in the length. Log-features (Performer's) are stabilised by a
  running max per head that rescales (S, Z) when it grows, as the chunked form does; an
  optional gate decays the state, S_t = g_t S_{t-1} + phi(k_t) v_t^T. Given the rotation
  tables `q_rotation`, `k_rotation` in its arrays (RoPE with linear attention, RoFormer
  eq. 19), S sums the turned features R_t phi(k_t) and the query's turned features read
  it, while Z and the denominator keep the plain ones.

Parity (tested for every registered decoder): decoding a sequence token by token gives
the causal parallel forward's outputs to float32 rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jxformers._arrays import group_heads, guarded_divide, rotate_pairs
from jxformers.registry import Decoder

_NO_SCALE = -1e30  # the stabiliser before any key: exp(_NO_SCALE - x) == 0

HyperParameters = Mapping[str, Any]
Arrays = Mapping[str, Any]
BiasFn = Callable[[Int[Array, " q"], Int[Array, " kv"]], Float[Array, "heads q kv"]]
# (q [1, heads, d_k], k [slots, kv_heads, d_k], v [slots, kv_heads, d_v], *, kv_mask, bias) -> [1, heads, d_v]
Attend = Callable[..., Float[Array, "1 heads d_v"]]
# (x [n_heads, d_k], arrays, hyper_parameters) -> (features [n_heads, m], log_max [n_heads] or None)
Features = Callable[[Array, Arrays, HyperParameters], tuple[Array, Array | None]]


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
    log_scale: Float[Array, " kv_heads"]  # each head's key features were divided by exp(this) (log-features)
    length: Int[Array, ""]


class TaggedCache(eqx.Module):
    """Every key and value so far (slot p holds position p) with integer tags per key
    (the buckets or clusters of the learnable patterns, per head and hash round; none
    for Sinkhorn, which recomputes its sort from the keys): the state of a decoder that
    recomputes a content-based pattern from the whole cache at each step, O(max_len * d)
    per step, so one token at a time equals the causal parallel forward. Built by the
    attention's own `init` and `step` (`jxformers/ops/learnable.py`)."""

    k: Float[Array, "slots kh d_k"]
    v: Float[Array, "slots kv_heads d_v"]
    buckets: Int[Array, "slots heads rounds"]
    length: Int[Array, ""]


State = KVCache | RecurrentState | TaggedCache


# ----------------------------------------------------------------------------- caches


def _empty_cache(n: int, kv_heads: int, d_k: int, d_v: int, dtype) -> KVCache:
    dtype = jnp.float32 if dtype is None else dtype
    return KVCache(
        jnp.zeros((n, kv_heads, d_k), dtype),
        jnp.zeros((n, kv_heads, d_v), dtype),
        jnp.full((n,), -1, jnp.int32),
        jnp.zeros((), jnp.int32),
    )


def cache_append(state: KVCache, k, v) -> KVCache:
    """`state` with one position's `k [kv_heads, d_k]` and `v [kv_heads, d_v]` written
    to the next slot (position p goes to slot p % slots)."""
    slot = state.length % state.k.shape[0]
    return KVCache(
        state.k.at[slot].set(k.astype(state.k.dtype)),
        state.v.at[slot].set(v.astype(state.v.dtype)),
        state.slot_pos.at[slot].set(state.length),
        state.length + 1,
    )


def full_cache_init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> KVCache:
    """An empty cache of every key and value (`max_len` slots, slot p holds position p):
    the `init` of an attention that writes its own `Decoder` step over the whole cache
    (each step `cache_append`s its token first)."""
    return _empty_cache(max_len, kv_heads, d_k, d_v, dtype)


def _cache(
    kind: str,
    attend: Attend,
    slots: Callable[[HyperParameters, int], int],
    forward: tuple[str, ...] = (),
    positions: bool = False,
) -> Decoder:
    def init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> KVCache:
        return _empty_cache(slots(hyper_parameters, max_len), kv_heads, d_k, d_v, dtype)

    def step(q, k, v, state: KVCache, *, hyper_parameters, arrays, bias_fn):
        state = cache_append(state, k, v)
        bias = None if bias_fn is None else bias_fn(state.length[None] - 1, jnp.maximum(state.slot_pos, 0))
        passed = {n: x for n, x in (*hyper_parameters.items(), *arrays.items()) if n in forward}
        if positions:  # the step's position and the slots' (a slot not yet written: masked)
            passed |= {"query_positions": state.length[None] - 1, "key_positions": jnp.maximum(state.slot_pos, 0)}
        out = attend(q[None], state.k, state.v, kv_mask=state.slot_pos >= 0, bias=bias, **passed)[0]
        return out.astype(q.dtype), state

    return Decoder(kind, init, step)


def kv_cache(attend: Attend, forward: tuple[str, ...] = (), positions: bool = False) -> Decoder:
    """Cache every key and value (`max_len` slots); each step runs `attend` (an exact
    softmax attention taking `kv_mask` and `bias`) over the cache, passing it the op's
    hyper-parameters and arrays named in `forward` (the score options: softcap, sinks)
    and, with `positions`, the step's `query_positions` and the slots' `key_positions`
    (for an op whose weights depend on distance: the attention priors)."""
    return _cache("cache", attend, lambda hp, max_len: max_len, forward, positions)


def ring_buffer(attend: Attend, slots: Callable[[HyperParameters], int]) -> Decoder:
    """Keep only the last `slots(hyper_parameters)` keys and values (a causal sliding
    window of w keys behind needs w + 1 slots); each step runs `attend` over them."""
    return _cache("ring buffer", attend, lambda hp, max_len: min(max_len, slots(hp)))


# ----------------------------------------------------------------------------- recurrent


def recurrent(
    features: Features,
    query_features: Callable[[Array, Arrays, HyperParameters], Array] | None = None,
    gate: Callable[[Array, Arrays, HyperParameters], Array] | None = None,
    magnitude: Callable[[Array, Arrays, HyperParameters], Array | None] | None = None,
) -> Decoder:
    """The RNN form of kernelized attention, built from the op's own feature maps.

    Arguments:
        features: `(x [n_heads, d_k], arrays, hyper_parameters) -> (phi [n_heads, m],
            log_max)`; `log_max` is None for plain features, or each head's max of `phi`
            `[n_heads]` when `phi` holds log-features (exp is taken here, shifted by a
            running max per head, so heads never share a stabiliser).
        query_features: `(q [heads, d_k], arrays, hyper_parameters) -> [heads, m]`, when
            queries are featurised differently (Performer stabilises each query by its
            own max); default: `features` (which must then return plain features).
        gate: `(k [kv_heads, d_k], arrays, hyper_parameters) -> [kv_heads]` in (0, 1],
            or None for no decay this step: S_t = g_t S_{t-1} + phi(k_t) v_t^T (gated
            linear attention; RFA's gate, which the module computes from the token and
            passes in `arrays`, its key features carrying the (1 - g_t)).
        magnitude: `(k [kv_heads, d_k], arrays, hyper_parameters) -> [kv_heads]` or None:
            the log of a positive per-head factor of the key features (plain features,
            not log-features: Performer's trigonometric h(k) = exp(|k'|^2 / 2)), applied
            here as exp(magnitude - running max) with the same per-head stabiliser.
    """

    def query(q, arrays, hp):
        if query_features is not None:
            return query_features(q, arrays, hp)
        phi, log_max = features(q, arrays, hp)
        if log_max is not None:
            raise ValueError("log-features need query_features (queries are stabilised per row)")
        return phi

    def init(*, hyper_parameters, arrays, max_len, kv_heads, d_k, d_v, dtype) -> RecurrentState:
        probe = jax.eval_shape(lambda: features(jnp.zeros((kv_heads, d_k)), arrays, hyper_parameters)[0])
        m = probe.shape[-1]
        return RecurrentState(
            jnp.zeros((kv_heads, m, d_v), jnp.float32),
            jnp.zeros((kv_heads, m), jnp.float32),
            jnp.full((kv_heads,), _NO_SCALE, jnp.float32),
            jnp.zeros((), jnp.int32),
        )

    def step(q, k, v, state: RecurrentState, *, hyper_parameters, arrays, bias_fn):
        phi_k, log_max = features(k, arrays, hyper_parameters)
        log_mag = None if magnitude is None else magnitude(k, arrays, hyper_parameters)
        s, z, log_scale = state.s, state.z, state.log_scale
        # Log-features (log_max) or plain features times exp(log_mag): shift by the running
        # per-head max, shrinking the state when it grows.
        running = log_max if log_max is not None else log_mag
        if running is not None:
            new_scale = jnp.maximum(log_scale, jax.lax.stop_gradient(running))
            shrink = jnp.exp(log_scale - new_scale)
            s, z, log_scale = s * shrink[:, None, None], z * shrink[:, None], new_scale
        if log_max is not None:
            phi_k = jnp.exp(phi_k - log_scale[:, None]) / math.sqrt(phi_k.shape[-1])
        elif log_mag is not None:
            phi_k = phi_k * jnp.exp(log_mag - log_scale)[:, None]
        phi_k = phi_k.astype(jnp.float32)
        g = None if gate is None else gate(k, arrays, hyper_parameters)
        if g is not None:
            g = g.astype(jnp.float32)
            s, z = s * g[:, None, None], z * g[:, None]
        phi_q = query(q, arrays, hyper_parameters)
        num_k, num_q = phi_k, phi_q
        if "k_rotation" in arrays:  # RoFormer eq. 19: the numerator's features turned by position
            num_k = rotate_pairs(phi_k[None], arrays["k_rotation"])[0]
            num_q = rotate_pairs(phi_q[None], arrays["q_rotation"])[0]
        s = s + jnp.einsum("hm,hd->hmd", num_k, v.astype(jnp.float32))
        z = z + phi_k
        phi_q, num_q = (group_heads(x[None], k.shape[0])[0] for x in (phi_q, num_q))  # [kv_heads, g, m]
        out = guarded_divide(jnp.einsum("hgm,hmd->hgd", num_q, s), jnp.einsum("hgm,hm->hg", phi_q, z))
        return out.reshape(q.shape[0], v.shape[-1]).astype(q.dtype), RecurrentState(s, z, log_scale, state.length + 1)

    return Decoder("recurrent", init, step)
