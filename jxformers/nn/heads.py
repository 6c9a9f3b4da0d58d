"""Improved multi-head attention (Lin et al.'s survey, §4.6): how heads share, disagree
and are aggregated. Settings of `jxformers.nn.Attention`, reachable from the attention
component of a config (`attention.collaborative`, `.disagreement`, `.head_aggregation`).

Collaborative heads (Cordonnier, Loukas & Jaggi 2020, "Multi-Head Attention: Collaborate
Instead of Concatenate", arXiv 2006.16362, §3): one query projection W̃_Q and one key
projection W̃_K of a shared size D̃_k, and a mixing vector m_i per head; head i's logits
are (X W̃_Q diag(m_i)) (X W̃_K)^T / sqrt(d_k), its values its own. `mixed_queries` gives
each head its mixed query (pre-scaled so that the core's 1/sqrt(D̃_k) leaves the paper's
1/sqrt(d_k), d_k the layer's head size) and `shared_keys` the one key, repeated for the
key/value heads, so any content-based core computes it and decodes it.
`concatenated_mixing` starts the layer as concatenated heads (m_i the indicator of head
i's slice of D̃_k: the paper's special case, exactly standard multi-head attention when
D̃_k = heads * d_k).

Disagreement regularisation (Li, Tu, Yang, Lyu & Zhang 2018, "Multi-Head Attention with
Disagreement Regularization", EMNLP, arXiv 1810.10183): D_subspace, D_position and
D_output, each -1/H^2 sum_{i,j} of a similarity between heads i and j (all pairs, i = j
included); training maximises L + λD, so `disagreement_losses` returns -λD per term, what
the objective (minimised) adds.

Routing-by-agreement (Li, Yang, Wang, Tu, Lyu & Tu 2019, "Information Aggregation for
Multi-Head Attention with Routing-by-Agreement", NAACL, arXiv 1904.03100, simple
routing; the same capsule idea as Gu & Feng 2019, "Improving Multi-head Attention with
Capsule Networks"): the heads' outputs are input capsules, each votes for every output
capsule through its own linear map, and dynamic routing with the squash decides how much
of each vote an output capsule takes; the output capsules, concatenated, go through the
output projection in place of the concatenated heads (`HeadRouting`). Li et al.'s second
algorithm, EM routing (after Hinton, Sabour & Frosst 2018, "Matrix Capsules with EM
Routing", with vector capsules), fits a Gaussian per output capsule to the votes
(`HeadEMRouting`). Gu & Feng route the heads with the same two algorithms.
"""

from __future__ import annotations

import inspect
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers import registry
from jxformers.ops.softmax import softmax_attention, softmax_weights

HEAD_AGGREGATIONS = ("concat", "routing", "em_routing")
# The aggregations that route the outputs of the heads as capsules.
ROUTINGS = ("routing", "em_routing")
DISAGREEMENTS = ("subspace", "position", "output")
# The attention whose weights the position term reads (it computes them exactly).
WEIGHTS_FROM = ("softmax",)


def check_head_options(
    spec: registry.AttentionSpec,
    *,
    collaborative: int | None = None,
    disagreement: tuple[str, ...] = (),
    disagreement_weight: float = 1.0,
    head_aggregation: str = "concat",
    routing_iterations: int = 3,
    qk_norm: str = "none",
    rope: bool = False,
    where: str = "attention",
) -> None:
    """ValueError unless the head settings are valid and fit the attention `spec`."""
    if collaborative is not None:
        if isinstance(collaborative, bool) or not isinstance(collaborative, int) or collaborative < 1:
            raise ValueError(
                f"{where}.collaborative is the shared key size D̃_k, an int >= 1 or None; got {collaborative=}"
            )
        if not spec.content_based or spec.shared_qk:
            why = "its weights do not depend on q and k" if not spec.content_based else "it takes its keys from q"
            raise ValueError(f"{where}.collaborative shares the key projection, which {spec.name!r} cannot use: {why}")
        if qk_norm != "none":
            raise ValueError(
                f"{where}.collaborative mixes a shared query per head; qk_norm={qk_norm!r} would normalise each "
                "head's own q and k, which it no longer has: use one or the other"
            )
        if rope and collaborative % 2:
            raise ValueError(
                f"rotary positions (rope, xpos) turn pairs of the shared keys: {where}.collaborative must be even; "
                f"got {collaborative=}"
            )
    bad = [t for t in disagreement if t not in DISAGREEMENTS]
    if bad or len(set(disagreement)) != len(disagreement):
        raise ValueError(f"{where}.disagreement takes distinct terms among {DISAGREEMENTS}; got {disagreement=}")
    if "position" in disagreement and spec.name not in WEIGHTS_FROM:
        raise ValueError(
            f"{where}.disagreement 'position' compares the heads' full attention matrices, read from the "
            f"dense softmax attention; {spec.name!r} has no such matrix to read (allowed: {list(WEIGHTS_FROM)})"
        )
    if not (isinstance(disagreement_weight, (int, float)) and disagreement_weight > 0):
        raise ValueError(f"{where}.disagreement_weight is λ, a number > 0; got {disagreement_weight=}")
    if head_aggregation not in HEAD_AGGREGATIONS:
        raise ValueError(f"{where}.head_aggregation must be one of {HEAD_AGGREGATIONS}; got {head_aggregation=}")
    if isinstance(routing_iterations, bool) or not isinstance(routing_iterations, int) or routing_iterations < 1:
        raise ValueError(f"{where}.routing_iterations must be an int >= 1; got {routing_iterations=}")


# ------------------------------------------------------------------ collaborative heads


def concatenated_mixing(heads: int, shared: int) -> Float[Array, "heads shared"]:
    """Mixing vectors of concatenated heads: m_i is 1 on head i's slice of the D̃_k
    shared dimensions (slices as equal as D̃_k allows), 0 elsewhere."""
    edges = [i * shared // heads for i in range(heads + 1)]
    column = jnp.arange(shared)
    return jnp.stack([(column >= a) & (column < b) for a, b in zip(edges[:-1], edges[1:], strict=True)]).astype(
        jnp.float32
    )


def mixed_queries(
    q: Float[Array, "n shared"], mixing: Float[Array, "heads shared"], d_head: int
) -> Float[Array, "n heads shared"]:
    """Each head's query X W̃_Q diag(m_i), times sqrt(D̃_k / d_head): the core's
    1/sqrt(D̃_k) then leaves the paper's 1/sqrt(d_k), d_k = d_head."""
    scale = math.sqrt(q.shape[-1] / d_head)
    return q[:, None, :] * (mixing * scale).astype(q.dtype)[None]


def shared_keys(k: Float[Array, "n shared"], kv_heads: int) -> Float[Array, "n kv_heads shared"]:
    """The one key X W̃_K, repeated for each key/value head (a broadcast).

    Not the grouped-query form (one key head, kv_heads=1), though the key is one: every
    op and every decoder takes k and v with the same kv_heads (`check_qkv`; a kv head is
    a key *and its value*, and the kv-cache, ring-buffer and recurrent states hold them
    as such), while collaborative heads share the key alone and keep one value per
    kv head. One key head would need each op to take k_heads apart from v_heads (or the
    values folded into one head of kv_heads * d_v, which multiplies the A V products by
    kv_heads). So the repeat stays, and XLA materialises it (CPU, checked): n * kv_heads *
    D̃_k floats beside the O(n^2) logits, and the decoding cache holds kv_heads copies of
    D̃_k per token."""
    return jnp.broadcast_to(k[:, None, :], (k.shape[0], kv_heads, k.shape[-1]))


# ------------------------------------------------------------------ disagreement


def _cosine_mean(x: Float[Array, "n heads d"], mask: Bool[Array, " n"] | None) -> Float[Array, ""]:
    """1/H^2 sum_{i,j} cos(X^i, X^j), X^i head i's matrix over the rows in `mask`
    (flattened: the paper's X^i . X^j / (|X^i| |X^j|))."""
    x = x.astype(jnp.float32)
    if mask is not None:
        x = jnp.where(mask[:, None, None], x, 0.0)
    flat = jnp.moveaxis(x, 1, 0).reshape(x.shape[1], -1)
    unit = flat * jax.lax.rsqrt(jnp.maximum(jnp.sum(flat * flat, -1, keepdims=True), 1e-12))
    return jnp.sum(unit @ unit.T) / x.shape[1] ** 2


def disagreement_losses(
    terms: tuple[str, ...],
    weight: float,
    *,
    values: Float[Array, "kv kv_heads d_v"],
    outputs: Float[Array, "n heads d_v"],
    weights: Float[Array, "n heads kv"] | None = None,
    query_mask: Bool[Array, " n"] | None = None,
    kv_mask: Bool[Array, " kv"] | None = None,
) -> dict[str, Float[Array, ""]]:
    """`{"disagreement_<term>": -λ D_term}` for each of `terms`:
        subspace: D = -1/H^2 sum_{i,j} cos(V^i, V^j) over the value heads' matrices
            (real keys; the kv_heads there are under grouped-query attention);
        position: D = -1/H^2 sum_{i,j} |A^i ⊙ A^j|, the sum of the element-wise product
            of the heads' attention matrices `weights` (real query rows);
        output: D = -1/H^2 sum_{i,j} cos(O^i, O^j) over the heads' outputs (real rows).
    `query_mask` marks real query rows (None: all), `kv_mask` real keys."""
    losses = {}
    for term in terms:
        if term == "subspace":
            similarity = _cosine_mean(values, kv_mask)
        elif term == "output":
            similarity = _cosine_mean(outputs, query_mask)
        else:
            assert weights is not None, "the position term needs the attention weights"
            a = weights.astype(jnp.float32)
            if query_mask is not None:
                a = jnp.where(query_mask[:, None, None], a, 0.0)
            # sum_{i,j} <A^i, A^j> = |sum_i A^i|^2: one pass over the maps' sum, O(H n kv)
            similarity = jnp.sum(jnp.square(a.sum(1))) / a.shape[1] ** 2
        losses[f"disagreement_{term}"] = weight * similarity  # -λ D: D is minus the similarity
    return losses


def attention_weights(
    core: registry.BoundAttention,
    q: Float[Array, "n heads d_k"],
    k: Float[Array, "kv kv_heads d_k"],
    v: Float[Array, "kv kv_heads d_v"],
    *,
    arrays: dict,
    causal: bool,
    kv_mask: Bool[Array, " kv"] | None,
    bias,
) -> Float[Array, "n heads kv"]:
    """The attention matrix of each head, as the softmax core computes it (its score
    options, priors, masks and bias included): the probabilities of its reference path
    (`ops.softmax_weights`), read directly, O(n * kv * d) per head as the attention."""
    assert core.name in WEIGHTS_FROM, core.name
    wanted = inspect.signature(softmax_attention).parameters
    options = {n: x for n, x in core.hyper_parameters.items() if n in wanted} | dict(arrays)
    return softmax_weights(q, k, v, **options, causal=causal, kv_mask=kv_mask, bias=bias)


# ------------------------------------------------------------------ routing-by-agreement


def squash(s: Float[Array, "*batch d"]) -> Float[Array, "*batch d"]:
    """|s|^2 / (1 + |s|^2) * s / |s| (Sabour et al. 2017, "Dynamic Routing Between
    Capsules"; as Li et al. 2019 use it)."""
    sq = jnp.sum(s * s, -1, keepdims=True)
    return s * (jnp.sqrt(sq + 1e-12) / (1.0 + sq))


def _votes(
    heads: Float[Array, "n heads d"], maps: Float[Array, "heads capsules d d"]
) -> Float[Array, "n heads capsules d"]:
    """Each input capsule's vote for each output capsule, V_{h→o} = Ω^in_h W_{h→o}, in float32."""
    return jnp.einsum("nhd,hode->nhoe", heads.astype(jnp.float32), maps)


class HeadRouting(eqx.Module):
    """Routing-by-agreement over the heads (Li et al. 2019, simple routing).

    Per position, the H heads' outputs Ω^in_h [d] are input capsules; each votes for
    output capsule n with V_{h→n} = Ω^in_h W_{h→n} (W [H, N, d, d], N = H output
    capsules of size d). Dynamic routing, `iterations` times from B = 0:
    C_{h→n} = softmax_n(B_{h→n}), Ω^out_n = squash(sum_h C_{h→n} V_{h→n}),
    B_{h→n} += Ω^out_n · V_{h→n}. Returns the last Ω^out `[n, N, d]`, which the
    attention concatenates and projects (W_O) in place of the heads. Float32 inside.
    Time O(n H N d^2) for the votes, O(iterations n H N d) for the routing.
    """

    votes: Float[Array, "heads capsules d d"]
    iterations: int = eqx.field(static=True)

    def __init__(self, heads: int, d: int, iterations: int = 3, *, key: PRNGKeyArray):
        bound = 1.0 / math.sqrt(d)  # each vote map as a Linear(d, d) is drawn
        self.votes = jax.random.uniform(key, (heads, heads, d, d), minval=-bound, maxval=bound)
        self.iterations = iterations

    def __call__(self, heads: Float[Array, "n heads d"]) -> Float[Array, "n heads d"]:
        votes = _votes(heads, self.votes)  # V_{h→o}
        b = jnp.zeros(votes.shape[:3], jnp.float32)
        out = jnp.zeros_like(votes[:, 0])
        for r in range(self.iterations):
            c = jax.nn.softmax(b, axis=-1)  # over the output capsules
            out = squash(jnp.einsum("nho,nhoe->noe", c, votes))
            if r + 1 < self.iterations:
                b = b + jnp.einsum("noe,nhoe->nho", out, votes)
        return out.astype(heads.dtype)


class HeadEMRouting(eqx.Module):
    """Routing-by-agreement over the heads by EM routing (Li et al. 2019, their second
    algorithm; Hinton, Sabour & Frosst 2018 with vector capsules; Gu & Feng 2019).

    Per position, the H heads' outputs Ω^in_h [d] are input capsules with activation
    a_h = sigmoid(w_a · Ω^in_h + b_a); votes V_{h→n} = Ω^in_h W_{h→n} (N = H output
    capsules of size d). From R_{h→n} = 1/N, `iterations` M-steps, each but the last
    followed by an E-step:
        M: R' = a_h R_{h→n}; S_n = sum_h R'; μ_n = sum_h R' V / S_n;
           σ²_n = sum_h R' (V - μ_n)² / S_n (per dimension);
           cost_n = sum_k (β_u,n + log σ_n,k) S_n; a^out_n = sigmoid(λ (β_a,n - cost_n))
        E: p_{h→n} = N(V_{h→n}; μ_n, diag σ²_n); R_{h→n} = a^out_n p / sum_m a^out_m p
    Returns μ `[n, N, d]`, which the attention concatenates and projects (W_O) in place
    of the heads. λ = `INVERSE_TEMPERATURE` (fixed); β_u, β_a [N] start at 0 and are
    learned, as are W, w_a and b_a. Float32 inside; σ² gets `EPS` and S_n `EPS_S` added.
    Time O(n H N d^2) for the votes, O(iterations n H N d) for the routing.
    """

    votes: Float[Array, "heads capsules d d"]
    activation_w: Float[Array, " d"]
    activation_b: Float[Array, ""]
    beta_u: Float[Array, " capsules"]
    beta_a: Float[Array, " capsules"]
    iterations: int = eqx.field(static=True)

    # λ as the EM routing code of the authors' group fixes it (Zheng et al. 2019,
    # zhengzx-nlp/dynamic-nmt); Hinton et al. raise it over the iterations instead.
    INVERSE_TEMPERATURE = 1e-3
    EPS = 1e-8  # added to σ², as that code does
    # Added to S_n: an output capsule no input capsule votes for after an E-step has
    # S_n ~ 0, and the gradient of μ_n = sum_h R' V / S_n overflowed (non-finite
    # gradients at step 33 of the demo's ListOps training; it trains with this).
    EPS_S = 1e-6

    def __init__(self, heads: int, d: int, iterations: int = 3, *, key: PRNGKeyArray):
        kv, ka = jax.random.split(key)
        bound = 1.0 / math.sqrt(d)  # each vote map, and the activation, drawn as a Linear(d, ·)
        self.votes = jax.random.uniform(kv, (heads, heads, d, d), minval=-bound, maxval=bound)
        self.activation_w = jax.random.uniform(ka, (d,), minval=-bound, maxval=bound)
        self.activation_b = jnp.zeros(())
        self.beta_u = jnp.zeros((heads,))
        self.beta_a = jnp.zeros((heads,))
        self.iterations = iterations

    def __call__(self, heads: Float[Array, "n heads d"]) -> Float[Array, "n heads d"]:
        votes = _votes(heads, self.votes)  # [n, H, N, d]
        a_in = jax.nn.sigmoid(heads.astype(jnp.float32) @ self.activation_w + self.activation_b)  # [n, H]
        r = jnp.full(votes.shape[:3], 1.0 / votes.shape[2], jnp.float32)
        mu = jnp.zeros_like(votes[:, 0])
        for step in range(self.iterations):
            weight = r * a_in[..., None]  # R'
            total = weight.sum(1) + self.EPS_S  # S_n [n, N]
            mu = jnp.einsum("nho,nhoe->noe", weight, votes) / total[..., None]
            if step + 1 == self.iterations:
                break  # the output is the last M-step's μ: its σ², cost and E-step go unused
            spread = jnp.square(votes - mu[:, None])
            var = jnp.einsum("nho,nhoe->noe", weight, spread) / total[..., None] + self.EPS
            cost = jnp.sum(self.beta_u[None, :, None] + 0.5 * jnp.log(var), -1) * total
            # log a^out, by log-sigmoid: log(sigmoid(.)) has an infinite gradient where it underflows
            log_a_out = jax.nn.log_sigmoid(self.INVERSE_TEMPERATURE * (self.beta_a[None] - cost))
            log_p = -0.5 * jnp.sum(spread / var[:, None] + jnp.log(2 * math.pi * var[:, None]), -1)
            r = jax.nn.softmax(log_a_out[:, None, :] + log_p, axis=-1)
        return mu.astype(heads.dtype)
