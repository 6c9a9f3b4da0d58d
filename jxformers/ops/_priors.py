"""Attention priors: terms that a query's distance to a key adds to the softmax (Lin et al.
2021, "A Survey of Transformers", arXiv 2106.04554, section 4.5), as score options of
the ops that form the logits (`softmax_attention`, `chunked_attention`).

    localness       Yang et al. 2018, "Modeling Localness for Self-Attention Networks"
                    (EMNLP, arXiv 1810.10182), eq. 4-9, query-specific window: from each
                    head's query, p = U_p^T tanh(W_p q), z = U_d^T tanh(W_p q); centre
                    P = I sigmoid(p), window D = I sigmoid(z), and the logits gain
                    G_ij = -2 (j - P_i)^2 / D_i^2 (a Gaussian of sigma = D / 2). I is the
                    number of keys the query may attend (the sentence length; causal: i + 1).
    gaussian_prior  Guo et al. 2019, "Gaussian Transformer: A Lightweight Approach for
                    Natural Language Inference" (AAAI), as Lin et al. write it (eq. 20):
                    G_ij = -|w (i - j)^2 + b| with scalars w >= 0 and b <= 0 (learned;
                    kept in range by clipping in the forward).
    adaptive_span   Sukhbaatar et al. 2019, "Adaptive Attention Span in Transformers"
                    (ACL, arXiv 1905.07799), eq. 3-4: each head's weights are
                    m_z(x) exp(s) / sum m_z(x') exp(s') with the soft mask
                    m_z(x) = clamp((R + z - x) / R, 0, 1) over the distance x = i - j
                    (|i - j| without causality), z = S span_z in [0, S] learned per head
                    (`span_z` clamped into [0, 1], as the authors' code), R = `span_ramp`. The
                    module adds their L1 loss (`span_loss`); keys past S + R have weight
                    0, and `chunked_attention` visits only the key chunks within S + R.
    head_windows    Guo et al. 2020, "Multi-Scale Self-Attention for Text Classification"
                    (AAAI, arXiv 1912.00544), section 3: head h attends the keys within
                    w_h positions on either side (w_h = -1: all of them); per layer with
                    the model's stack.layer_overrides.

A query's position is its index aligned bottom-right against the keys (as the ops'
causal mask), or `query_positions` / `key_positions` when the caller gives them (the
kv-cache decoder: the step's position and the cache slots'). Persistent keys
(`persistent_kv`) have no position: no prior touches them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Real

from jxformers._typing import ArrayLike
from jxformers.validate import Limits

# lambda of adaptive span's L1 loss, per layer (a setting: span_loss_weight).
SPAN_LOSS_WEIGHT = 2e-6
# The priors' hyper-parameters and arrays: what a kv-cache decoder passes on.
PRIOR_OPTIONS = (
    "localness",
    "localness_w",
    "localness_up",
    "localness_ud",
    "gaussian_prior",
    "gaussian_w",
    "gaussian_b",
    "adaptive_span",
    "span_ramp",
    "span_z",
    "head_windows",
)
PRIOR_DOCS = {
    "localness": "a Gaussian bias around a centre and window predicted from each query (Yang et al. 2018)",
    "gaussian_prior": "the bias -|w (i - j)^2 + b| with learned scalars w >= 0, b <= 0 (Gaussian Transformer)",
    "adaptive_span": "S: each head's learned span z in [0, S] softly masks keys past it (Sukhbaatar et al. 2019)",
    "span_ramp": "R: the soft mask's ramp length (adaptive_span)",
    "span_loss_weight": "lambda of adaptive span's L1 loss on the spans (lambda * mean of z over heads)",
    "head_windows": "per head, the keys within w positions on either side (-1: all; Multi-Scale Self-Attention)",
}
PRIOR_LIMITS = {
    "adaptive_span": Limits(minimum=1),
    "span_ramp": Limits(minimum=1),
    "span_loss_weight": Limits(minimum=0),
    "head_windows": Limits(minimum=-1),
}


class Priors(NamedTuple):
    """An op's prior hyper-parameters and arrays, as its keywords of the same names."""

    localness: bool = False
    localness_w: ArrayLike | None = None
    localness_up: ArrayLike | None = None
    localness_ud: ArrayLike | None = None
    gaussian_prior: bool = False
    gaussian_w: ArrayLike | None = None
    gaussian_b: ArrayLike | None = None
    adaptive_span: int | None = None
    span_ramp: int = 32
    span_z: ArrayLike | None = None
    head_windows: tuple[int, ...] | None = None


def gather_priors(options: Mapping[str, Any]) -> Priors:
    """The prior keywords among an op's arguments `options` (by name: the op's `locals()`,
    or the keywords a caller forwards) as one `Priors`, built once per call and passed on
    to `check_priors`, `prior_terms` and `localness_centres`; a field absent from
    `options` keeps its default."""
    return Priors(**{name: options[name] for name in Priors._fields if name in options})


class PriorTerms(NamedTuple):
    """What the priors do to logits `[h, g, q, k]` (each None when unused): `bias` is
    added with the logits' bias (before a cap), `log_mask` after the cap (adaptive
    span's log m), and `allowed` narrows the keys a head may attend."""

    bias: Float[Array, "h g q k"] | None
    log_mask: Float[Array, "h g q k"] | None
    allowed: Bool[Array, "h g q k"] | None


def check_priors(heads: int, d_k: int, p: Priors) -> list[str]:
    """The names of the priors in use; ValueError naming a bad one."""
    localness, gaussian_prior, adaptive_span = p.localness, p.gaussian_prior, p.adaptive_span
    span_ramp, span_z, head_windows = p.span_ramp, p.span_z, p.head_windows
    arrays = {
        "localness": (localness, {"localness_w": (d_k, d_k), "localness_up": (d_k,), "localness_ud": (d_k,)}),
        "gaussian_prior": (gaussian_prior, {"gaussian_w": (), "gaussian_b": ()}),
    }
    given = {n: getattr(p, n) for n in ("localness_w", "localness_up", "localness_ud", "gaussian_w", "gaussian_b")}
    for option, (on, shapes) in arrays.items():
        if not isinstance(on, bool):
            raise ValueError(f"{option} must be True or False; got {on!r}")
        for name, shape in shapes.items():
            array = given[name]
            got = None if array is None else tuple(jnp.shape(array))
            if on and got != shape:
                raise ValueError(f"{option}=True needs {name} of shape {shape}; got {got}")
            if not on and got is not None:
                raise ValueError(f"{name} is read only with {option}=True")
    if adaptive_span is not None:
        if isinstance(adaptive_span, bool) or not isinstance(adaptive_span, int) or adaptive_span < 1:
            raise ValueError(f"adaptive_span must be an int >= 1 (the largest span S) or None; got {adaptive_span!r}")
        if isinstance(span_ramp, bool) or not isinstance(span_ramp, int) or span_ramp < 1:
            raise ValueError(f"span_ramp must be an int >= 1; got {span_ramp!r}")
        shape = None if span_z is None else tuple(jnp.shape(span_z))
        if shape != (heads,):
            raise ValueError(f"adaptive_span needs span_z of shape ({heads},) (one per query head); got {shape}")
    elif span_z is not None:
        raise ValueError("span_z is read only with adaptive_span set")
    if head_windows is not None:
        windows = tuple(head_windows)
        if len(windows) != heads or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in windows):
            raise ValueError(
                f"head_windows must give one int >= 0 (or -1: every key) per head, {heads} of them; "
                f"got {head_windows!r}"
            )
    used = {
        "localness": localness,
        "gaussian_prior": gaussian_prior,
        "adaptive_span": adaptive_span is not None,
        "head_windows": head_windows is not None,
    }
    return [name for name, on in used.items() if on]


def reach(adaptive_span: int | None, span_ramp: int, head_windows: tuple[int, ...] | None) -> int | None:
    """The farthest distance at which any key can still have weight (None: any)."""
    reaches = []
    if adaptive_span is not None:
        reaches.append(adaptive_span + span_ramp)
    if head_windows is not None and -1 not in head_windows:
        reaches.append(max(head_windows))
    return min(reaches) if reaches else None


def default_positions(q_len: int, kv_len: int) -> tuple[Int[Array, " q"], Int[Array, " k"]]:
    """Query i at i + kv_len - q_len, key j at j: the ops' bottom-right alignment."""
    return jnp.arange(q_len) + (kv_len - q_len), jnp.arange(kv_len)


def prior_terms(
    qg: Float[ArrayLike, "q h g d"],
    q_pos: Int[ArrayLike, " q"],
    k_pos: Int[ArrayLike, " k"],
    visible: Real[ArrayLike, " q"],
    *,
    causal: bool,
    p: Priors,
    centres: tuple[Array, Array] | None = None,
) -> PriorTerms:
    """The priors' terms for grouped queries `qg` (`group_heads`' layout) at `q_pos`
    against keys at `k_pos`; `visible` is I, the number of keys each query may attend
    (the localness prior's length). `p` as `check_priors` checked it; `centres`, the
    localness centres and windows of these queries when already computed (a chunked
    caller computes them once per query chunk, not once per key chunk)."""
    h, g = qg.shape[1], qg.shape[2]
    q_pos = jnp.asarray(q_pos, jnp.float32)
    k_pos = jnp.asarray(k_pos, jnp.float32)
    signed = q_pos[:, None] - k_pos[None, :]  # [q, k]: i - j
    bias = log_mask = allowed = None

    def add(total, term):
        return term if total is None else total + term

    if p.localness:
        centre, window = localness_centres(qg, visible, p) if centres is None else centres
        # Key at position p is Yang et al.'s j = p + 1 of 1..I (P_i in [0, I]).
        gap = (k_pos + 1.0)[None, None, None, :] - centre[..., None]  # [q, h, g, k]
        term = -2.0 * gap**2 / jnp.maximum(window[..., None] ** 2, 1e-6)
        bias = add(bias, jnp.moveaxis(term, 0, 2))  # [h, g, q, k]
    if p.gaussian_prior:
        assert p.gaussian_w is not None and p.gaussian_b is not None
        w = jnp.maximum(jnp.asarray(p.gaussian_w, jnp.float32), 0.0)
        b = jnp.minimum(jnp.asarray(p.gaussian_b, jnp.float32), 0.0)
        bias = add(bias, jnp.broadcast_to(-jnp.abs(w * signed**2 + b), (h, g, *signed.shape)))
    distance = signed if causal else jnp.abs(signed)
    if p.adaptive_span is not None:
        assert p.span_z is not None
        raw = jnp.asarray(p.span_z, jnp.float32)
        # The authors clamp z into [0, 1] after each update; here the forward clamps it
        # and lets the gradient through, so a z pushed below 0 can come back.
        z = p.adaptive_span * (raw + jax.lax.stop_gradient(jnp.clip(raw, 0.0, 1.0) - raw)).reshape(h, g, 1, 1)
        m = jnp.clip((p.span_ramp + z - distance[None, None]) / p.span_ramp, 0.0, 1.0)  # [h, g, q, k]
        # log m where m > 0 (its gradient reaches z on the ramp); those keys alone are allowed.
        log_mask = jnp.log(jnp.maximum(m, 1e-30))
        allowed = m > 0
    if p.head_windows is not None:
        windows = jnp.asarray([w if w >= 0 else jnp.inf for w in p.head_windows], jnp.float32).reshape(h, g, 1, 1)
        inside = jnp.abs(signed)[None, None] <= windows
        allowed = inside if allowed is None else allowed & inside
    return PriorTerms(bias, log_mask, allowed)


def localness_centres(
    qg: Float[ArrayLike, "q h g d"], visible: Real[ArrayLike, " q"], p: Priors
) -> tuple[Float[Array, "q h g"], Float[Array, "q h g"]]:
    """Yang et al.'s centre P_i = I sigmoid(U_p^T tanh(W_p q_i)) and window D_i = I
    sigmoid(U_d^T tanh(W_p q_i)) of each grouped query (I = `visible`)."""
    assert p.localness_w is not None and p.localness_up is not None and p.localness_ud is not None
    hidden = jnp.tanh(jnp.einsum("qhgd,de->qhge", jnp.asarray(qg, jnp.float32), p.localness_w))
    length = jnp.asarray(visible, jnp.float32)[:, None, None]
    centre = length * jax.nn.sigmoid(hidden @ jnp.asarray(p.localness_up, jnp.float32))
    window = length * jax.nn.sigmoid(hidden @ jnp.asarray(p.localness_ud, jnp.float32))
    return centre, window


def init_prior_arrays(
    key: PRNGKeyArray,
    *,
    heads: int,
    d_k: int,
    localness: bool = False,
    gaussian_prior: bool = False,
    adaptive_span: int | None = None,
) -> dict[str, Array]:
    """The priors' learned arrays: localness's W_p ~ N(0, 1/d_k) and U_p, U_d ~ N(0, 1/d_k)
    (Glorot-like; the paper does not say); the Gaussian prior's w = 0.01 and b = 0 (a
    weak prior that learning sharpens); adaptive span's z = 0 for every head (the
    authors' default start: a span of R)."""
    out = {}
    if localness:
        kw, kp, kd = jax.random.split(key, 3)
        out["localness_w"] = jax.random.normal(kw, (d_k, d_k)) / jnp.sqrt(d_k)
        out["localness_up"] = jax.random.normal(kp, (d_k,)) / jnp.sqrt(d_k)
        out["localness_ud"] = jax.random.normal(kd, (d_k,)) / jnp.sqrt(d_k)
    if gaussian_prior:
        out["gaussian_w"] = jnp.asarray(0.01, jnp.float32)
        out["gaussian_b"] = jnp.asarray(0.0, jnp.float32)
    if adaptive_span is not None:
        out["span_z"] = jnp.zeros((heads,), jnp.float32)
    return out


def span_loss(span_z: ArrayLike, adaptive_span: int, weight: float) -> Float[Array, ""]:
    """Adaptive span's L1 penalty on one layer's spans: weight * mean over heads of
    z = S clamp(span_z, 0, 1) (the authors' code: loss_coeff * max_size * mean)."""
    return jnp.float32(weight) * adaptive_span * jnp.clip(jnp.asarray(span_z, jnp.float32), 0.0, 1.0).mean()
