"""Mixture-of-experts layers for one example `[seq, d_model]` (batch with `jax.vmap`):
pure router functions, the two dispatches, stacked experts, and the `MoE` module.

    moe = MoE(d_model=64, d_ff=128, num_experts=8, top_k=2, key=key)
    y, aux = moe(x, mask=mask, key=key)          # y [seq, d_model]; aux: dict of scalars, [E]

Routers (logits always in float32):
    token choice  each token picks its top-k experts. k=1 is Switch (Fedus et al. 2021;
                  gate = the router probability); k>1 normalises the k gates to sum 1
                  (GShard, Lepikhin et al. 2020). GShard's second-expert policy
                  (`second_policy="random"`): in training, with an explicit key, the
                  expert of rank j >= 1 is used with probability min(1, g_j / threshold),
                  threshold 0.5 = GShard's Algorithm 1 (use e2 if 2 g2 > U(0, 1)); at
                  inference every chosen expert is used.
    expert choice each expert picks its top-C tokens by router probability (softmax over
                  experts; Zhou et al. 2022), C = max(min_capacity, ceil(cf * seq / E)),
                  at most seq; a token may get several experts or none. An expert sees
                  the whole sequence before it picks, so it leaks future tokens: a causal
                  layer refuses it (ValueError).
    hash          (Roller et al. 2021, "Hash Layers For Large Sparse Models", arXiv
                  2106.04426, section 3, its "Random Hash"; the paper's other hashes,
                  frequency-balanced assignment, bigram, previous-token, position,
                  clustered, dispersed and MultiHash, are not here): a table drawn
                  uniformly once at initialisation sends token id v to expert
                  table[v]; y_t = FFN_{table[x_t]}(h_t), no gate, no learned
                  router, no loss, nothing dropped. Needs the token ids (`token_ids`);
                  rows that hold no input token (CLS, memory tokens) have id NO_TOKEN
                  and share one extra table entry. Per token, so causal and decodable.
    base          (Lewis et al. 2021, "BASE Layers: Simplifying Training of Large, Sparse
                  Models", arXiv 2103.16716, section 2): expert embeddings w_e (the
                  router's rows), affinities s_te = h_t . w_e. In training the balanced
                  assignment a = argmax sum_t s_{t a_t}, each expert taking m / E of the
                  group's m real tokens (`balanced_assignment`: exact min-cost flow, not
                  the paper's auction); at inference greedy, a_t = argmax_e s_te. Output
                  sigma(s_{t a_t}) f_{a_t}(h_t); the paper's "+ h_t" is the block's
                  residual. No auxiliary loss, nothing dropped. The training assignment
                  reads the whole group, so a causal layer refuses it (ValueError).
    prototype     (Yang et al. 2021, "M6-T: Exploring Sparse Expert Models and Beyond",
                  arXiv 2105.15082, section 4, expert prototyping, "k top-1"): the E
                  experts form k = top_k groups of E / k, each group a softmax router of
                  its own; a token takes its top-1 expert in every group and the layer
                  sums the k gated outputs, y = sum_i p_i(x)_{j_i} E_{i j_i}(x)
                  (`prototype_route`). Dispatched as top-k token choice (capacity
                  ceil(cf * seq * k / E), or dropless); each expert receives one group's
                  tokens, in token order, so capacity drops depend on earlier tokens only.
                  Losses: Switch's balancing loss within each group (over its E / k
                  experts), averaged over the groups; z-loss, entropy and confidence too.
    jitter        multiplicative uniform noise U(1 - eps, 1 + eps) on the router input,
                  training only, explicit key (Switch).
    losses        router z-loss mean_t logsumexp(logits_t)^2 (ST-MoE, Zoph et al. 2022);
                  load balancing E * sum_e f_e P_e (Switch), f_e the fraction of the
                  router's choices (all k ranks, before the policy and capacity) that
                  name e, P_e the mean router probability of e.
    padding       tokens with mask False are never routed, get zero expert output, and
                  count in no loss, load or drop statistic.

Dispatch:
    capacity   each expert takes at most C = max(min_capacity, ceil(cf * seq * k / E))
               assignments, at most seq (seq is the static length, padding included; `capacity_factor` in training,
               `eval_capacity_factor` at inference); first choices of every token are
               placed before any second choice (GShard), tokens in order. An overflowing
               assignment gets zero output (the residual carries the token) and is
               counted in aux["dropped"]. Memory O(E C d) plus an O(seq k E) position count.
    dropless   (token choice and prototype with `dropless`; hash always; base at inference)
               every assignment is processed, by one of two methods
               (`dropless_method`; "auto" picks "padded" on CPU and on GPUs unless
               E / k > 8, "ragged" otherwise: `ragged_pays`):
               "ragged": assignments sorted by expert and multiplied with
               `jax.lax.ragged_dot` (grouped matmul), FLOPs = the assignments'. On CPU
               (jax 0.10.2) ragged_dot runs at about 1% of a dense matmul of the same
               size (docs/moe.md), so it is not the CPU default; on an H100 at 13% of
               dense (so padded wins while E / k <= 8); not run on a TPU in this work.
               "padded": the capacity dispatch with C = seq (an
               expert takes a token at most once, so nothing can drop): dense einsums at
               E / k times the assignments' FLOPs, and E * seq * d buffer memory.
               `ragged_dot` has no batching rule for a batched lhs with
               unbatched weights, so `grouped_matmul` carries its own (custom_vmap inside
               a custom_vjp): under vmap the batch's rows are merged and sorted by expert
               into one ragged_dot (forward and input gradient); the weight gradient is
               formed per example and summed by vmap (transient batch x expert-weights
               memory). Every token is independent here, so the layer may also be
               called on a flattened batch [batch * seq, d].

aux (all float32; AUX_NAMES): balance_loss, z_loss, router_entropy (mean over real
tokens of the router distribution's entropy), router_confidence (mean over real tokens
of the top router probability), dropped (token choice: assignments lost to capacity;
expert choice: real tokens that no expert picked), expert_load [E] (assignments each
expert processed), loss (balance_weight * balance_loss + z_loss_weight * z_loss: what
a model adds to its training loss). Expert choice is balanced by construction: its
balance_loss is 0.

Hash and base report balance_loss and z_loss as 0 (their papers have none; base's entropy
and confidence are those of softmax over its affinities, hash's 0 and 1).

Elsewhere: `Block` takes an MoE as its FFN and returns its aux dict from `apply`
(`Produced.moe`, in call order); `ModelConfig(ffn={"kind": "moe", ...})` (a `MoEConfig`) builds them (per block with
`stack.layer_overrides`) and the train step adds the losses; `moe_sharded.py` runs the layer
with its experts split over devices (shard_map, all_to_all).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import custom_batching
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import ACTIVATIONS, FFN_KINDS, GATED_KINDS, FeedForward, Linear, split_key
from jxformers.validate import check_fields, setting

ROUTERS = ("token_choice", "expert_choice", "hash", "base", "prototype")
NO_TOKEN = -1  # the token id of a row that holds no input token (CLS, memory, registers)
AUX_NAMES = ("balance_loss", "z_loss", "router_entropy", "router_confidence", "dropped", "expert_load", "loss")
SUMMED = ("dropped", "expert_load")  # aux counts: summed over examples and devices; the rest are means
SECOND_POLICIES = ("all", "random")
DROPLESS_METHODS = ("auto", "ragged", "padded")
# On an H100 (jax 0.11.2, bf16, docs/moe_runs/gpu.md) XLA's ragged_dot ran at 13% of a
# dense matmul of the same size, about 1/8 of its speed, while the padded dispatch runs at
# dense speed on E / k times the FLOPs: ragged pays only above this ratio there.
GPU_RAGGED_MIN_RATIO = 8


def ragged_pays(backend: str, num_experts: int, top_k: int) -> bool:
    """dropless_method="auto": ragged_dot over padded buffers? Never on CPU (ragged_dot at
    1-2% of a dense matmul), on GPUs only when E / k > GPU_RAGGED_MIN_RATIO (measured on
    an H100), always elsewhere (TPU: unmeasured)."""
    if backend == "cpu":
        return False
    if backend in ("gpu", "cuda", "rocm"):
        return num_experts / top_k > GPU_RAGGED_MIN_RATIO
    return True


# ----------------------------------------------------------------------------- routers


def _real(mask: Bool[Array, " seq"] | None, seq: int) -> Bool[Array, " seq"]:
    return jnp.ones((seq,), bool) if mask is None else mask


def _mean_over_real(values: Float[Array, " seq"], mask: Bool[Array, " seq"]) -> Float[Array, ""]:
    return jnp.where(mask, values, 0.0).sum() / jnp.maximum(mask.sum(), 1)


def jitter(x: Float[Array, "seq d"], eps: float, key: PRNGKeyArray) -> Float[Array, "seq d"]:
    """x * U(1 - eps, 1 + eps), elementwise (Switch's router jitter)."""
    noise = jax.random.uniform(key, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
    return (x.astype(jnp.float32) * noise).astype(x.dtype)


def z_loss(logits: Float[Array, "seq experts"], mask: Bool[Array, " seq"] | None = None) -> Float[Array, ""]:
    """ST-MoE's router z-loss: mean over real tokens of logsumexp(logits)^2."""
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return _mean_over_real(jnp.square(lse), _real(mask, logits.shape[0]))


def router_entropy(logits: Float[Array, "seq experts"], mask: Bool[Array, " seq"] | None = None) -> Float[Array, ""]:
    """Mean over real tokens of the entropy (nats) of the router's distribution."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return _mean_over_real(-(jnp.exp(logp) * logp).sum(-1), _real(mask, logits.shape[0]))


def router_confidence(logits: Float[Array, "seq experts"], mask: Bool[Array, " seq"] | None = None) -> Float[Array, ""]:
    """Mean over real tokens of the router's top probability."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    return _mean_over_real(probs.max(-1), _real(mask, logits.shape[0]))


def load_balancing_loss(
    probs: Float[Array, "seq experts"], experts: Int[Array, "seq k"], mask: Bool[Array, " seq"] | None = None
) -> Float[Array, ""]:
    """Switch's auxiliary loss E * sum_e f_e P_e over real tokens: f_e the fraction of
    the router's choices (all k ranks) naming expert e, P_e the mean probability of e.
    1 when routing is uniform; E when every token goes to one expert with certainty."""
    num_experts = probs.shape[-1]
    real = _real(mask, probs.shape[0])
    count = jnp.maximum(real.sum(), 1)
    chosen = (jax.nn.one_hot(experts, num_experts, dtype=jnp.float32) * real[:, None, None]).sum((0, 1))
    f = chosen / (count * experts.shape[1])
    p = jnp.where(real[:, None], probs.astype(jnp.float32), 0.0).sum(0) / count
    return num_experts * jnp.sum(f * p)


def top_k_route(
    logits: Float[Array, "seq experts"],
    k: int,
    *,
    mask: Bool[Array, " seq"] | None = None,
    second_policy: str = "all",
    threshold: float = 0.5,
    key: PRNGKeyArray | None = None,
) -> tuple[Int[Array, "seq k"], Float[Array, "seq k"], Bool[Array, "seq k"]]:
    """Token-choice routing: (experts, gates, active), each `[seq, k]`, rank-ordered.

    gates: the router probability for k = 1 (Switch), the top-k probabilities
    normalised to sum 1 for k > 1 (GShard, Mixtral). active: False for padding tokens
    and for ranks >= 1 dropped by the "random" policy (with `key`; rank j kept with
    probability min(1, gate_j / threshold), GShard's 2 g2 > U for k=2, threshold 0.5).
    Gates of inactive assignments are 0; kept gates are not renormalised (GShard)."""
    if second_policy not in SECOND_POLICIES:
        raise ValueError(f"second_policy must be one of {SECOND_POLICIES}; got {second_policy!r}")
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[-1]}] (the number of experts); got {k}")
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    gates, experts = jax.lax.top_k(probs, k)
    if k > 1:
        gates = gates / gates.sum(-1, keepdims=True)
    active = jnp.broadcast_to(_real(mask, logits.shape[0])[:, None], gates.shape)
    if second_policy == "random" and key is not None and k > 1:
        draw = jax.random.uniform(key, gates.shape)
        keep = (draw < gates / threshold) | (jnp.arange(k) == 0)[None, :]
        active = active & keep
    return experts, jnp.where(active, gates, 0.0), active


def capacity_positions(
    experts: Int[Array, "seq k"], active: Bool[Array, "seq k"], num_experts: int, capacity: int
) -> tuple[Int[Array, "seq k"], Bool[Array, "seq k"]]:
    """(position of each assignment in its expert's buffer, kept = active and position <
    capacity). Rank-major priority: every token's first choice is placed before any
    second choice; within a rank, tokens in order."""
    seq, k = experts.shape
    flat = experts.T.reshape(-1)
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32) * active.T.reshape(-1, 1)
    position = ((jnp.cumsum(onehot, axis=0) - 1) * onehot).sum(-1)
    position = position.reshape(k, seq).T
    return position, active & (position < capacity)


def hash_table(vocab_size: int, num_experts: int, key: PRNGKeyArray) -> Int[Array, " vocab_plus_one"]:
    """Hash layers' random hash (Roller et al. 2021, "Hash Layers For Large Sparse
    Models", section 3, "Random Hash"): every token id of [0, vocab_size) gets an expert
    drawn uniformly from [0, E) once, at initialisation, and keeps it; entry vocab_size
    is the expert of rows that hold no input token (`NO_TOKEN`: CLS, memory tokens)."""
    if vocab_size < 1 or num_experts < 1:
        raise ValueError(f"hash_table needs vocab_size >= 1 and num_experts >= 1; got {vocab_size=}, {num_experts=}")
    return jax.random.randint(key, (vocab_size + 1,), 0, num_experts, dtype=jnp.int32)


def hash_route(table: Int[Array, " vocab_plus_one"], token_ids: Int[Array, " seq"]) -> Int[Array, " seq"]:
    """The expert of each token: table[id], for ids in [0, vocab); `NO_TOKEN` (any
    negative id) reads the last entry (rows that hold no input token)."""
    return table[jnp.where(token_ids < 0, table.shape[0] - 1, token_ids)]


def prototype_route(
    logits: Float[Array, "seq experts"], prototypes: int, *, mask: Bool[Array, " seq"] | None = None
) -> tuple[Int[Array, "seq k"], Float[Array, "seq k"], Bool[Array, "seq k"]]:
    """Expert prototyping, "k top-1" (Yang et al. 2021, "M6-T: Exploring Sparse Expert
    Models and Beyond", section 4): the E experts form k = `prototypes` groups of E / k
    (group i: experts i E/k ... (i+1) E/k - 1), each with its own router softmax
    p_i = softmax(W_i x) over its experts; in every group the token takes its top-1
    expert, gate p_i[j*] (no renormalisation across groups), and the layer sums the k
    outputs: y = sum_i p_i[j*_i] E_{i, j*_i}(x).

    Returns (experts, gates, active), each `[seq, k]`: column i is group i's choice (a
    global expert index); active is False for padding, whose gates are 0."""
    seq, num_experts = logits.shape
    if prototypes < 1 or num_experts % prototypes:
        raise ValueError(f"prototypes must divide the number of experts ({num_experts}); got {prototypes}")
    per = num_experts // prototypes
    probs = jax.nn.softmax(logits.astype(jnp.float32).reshape(seq, prototypes, per), axis=-1)
    local = jnp.argmax(probs, axis=-1)  # [seq, k]
    gates = jnp.take_along_axis(probs, local[..., None], axis=-1)[..., 0]
    experts = local + per * jnp.arange(prototypes)[None, :]
    active = jnp.broadcast_to(_real(mask, seq)[:, None], gates.shape)
    return experts, jnp.where(active, gates, 0.0), active


def balanced_assignment(scores: Float[Array, "n experts"], mask: Bool[Array, " n"] | None = None) -> Int[Array, " n"]:
    """BASE layers' balanced assignment (Lewis et al. 2021, "BASE Layers: Simplifying
    Training of Large, Sparse Models", section 2): the expert a_t of each real token t
    that maximises sum_t scores[t, a_t] subject to every expert receiving m / E of the m
    real tokens (when E does not divide m: floor(m / E) or ceil(m / E), exactly
    m mod E experts taking one more). Padding rows get E (no expert).

    Solved exactly (up to float32 rounding), not by the paper's auction: a min-cost flow
    by successive shortest paths. Tokens enter in order; each takes the cheapest path
    from itself through a chain of reassignments (token i moves from expert e to f at
    cost scores[i, e] - scores[i, f]) to an expert with room, found by Bellman-Ford on
    the E experts; an expert below floor(m / E) is preferred over any above it (a lower
    bound, as an arbitrarily large reward). Each insertion keeps the partial assignment
    optimal, so the last one is. Time O(m (n E + E^3)) (0.6-1.6 s for n = 2,048,
    E = 64 on a 2-core CPU; docs/moe.md), memory O(n E); sequential loops, so keep the
    routing group small. Non-finite scores are replaced by the least finite one (as fairseq's
    implementation does). No gradient flows through the assignment."""
    n, num_experts = scores.shape
    real = _real(mask, n)
    a = jax.lax.stop_gradient(scores).astype(jnp.float32)
    finite = jnp.isfinite(a) & real[:, None]
    low = jnp.min(jnp.where(finite, a, jnp.inf))
    a = jnp.where(finite, a, jnp.where(jnp.isfinite(low), low, 0.0))
    # A relaxation must gain more than the rounding of a path of E steps: without this
    # margin a cycle of float32 round-offs (a zero-cost cycle in exact arithmetic) could
    # loop the predecessors.
    tol = 2 * num_experts * num_experts * jnp.finfo(jnp.float32).eps * jnp.max(jnp.abs(a))
    count = real.sum()
    floor, rest = count // num_experts, count % num_experts
    ceil = floor + (rest > 0)
    rows, experts = jnp.arange(n), jnp.arange(num_experts)
    # Inside shard_map a loop's carry must vary over the axes its updates do (the scores'):
    # the constants that start a carry are cast to them.
    axes = tuple(sorted(_varying_axes(a) | _varying_axes(real)))
    vary = (lambda c: jax.lax.pcast(c, axes, to="varying")) if axes else (lambda c: c)
    no_pred = vary(jnp.full((num_experts,), -1, jnp.int32))
    unsettled, not_done = vary(jnp.array(True)), vary(jnp.array(False))

    def insert(t, state):
        at, load = state
        placed = at < num_experts
        home = jnp.where(placed, at, 0)
        # move[e, f]: the cheapest move of a token at e to f, and which token (lowest index)
        delta = jnp.where(placed[:, None], jnp.take_along_axis(a, home[:, None], 1) - a, jnp.inf)
        move = jnp.full((num_experts, num_experts), jnp.inf).at[home].min(delta)
        move = jnp.where(experts[:, None] == experts[None, :], jnp.inf, move)
        hit = placed[:, None] & (delta == move[home])
        mover = jnp.full((num_experts, num_experts), n, jnp.int32).at[home].min(jnp.where(hit, rows[:, None], n))

        def relax(s):
            i, dist, pred, _ = s
            through = dist[:, None] + move
            new = through.min(0)
            better = new < dist - tol
            return i + 1, jnp.where(better, new, dist), jnp.where(better, through.argmin(0), pred), better.any()

        # Bellman-Ford from t (cost of t joining f directly: -scores[t, f]); E - 1 rounds at most
        _, dist, pred, _ = jax.lax.while_loop(
            lambda s: (s[0] < num_experts - 1) & s[3], relax, (0, -a[t], no_pred, unsettled)
        )
        below = load < floor
        room = jnp.where(below.any(), below, load < ceil)
        end = jnp.argmin(jnp.where(room, dist, jnp.inf))

        def walk(_, s):  # back along the predecessors from the expert with room to t
            at, cur, done = s
            p = pred[cur]
            first = p < 0
            token = jnp.where(first, t, mover[jnp.maximum(p, 0), cur])
            at = jnp.where(done, at, at.at[token].set(cur))
            return at, jnp.where(first | done, cur, p), done | first

        at = jax.lax.fori_loop(0, num_experts, walk, (at, end, not_done))[0]
        return at, load.at[end].add(1)

    def step(t, state):
        return jax.lax.cond(real[t], insert, lambda _, s: s, t, state)

    start = (vary(jnp.full((n,), num_experts, jnp.int32)), vary(jnp.zeros((num_experts,), jnp.int32)))
    return jax.lax.fori_loop(0, n, step, start)[0]


def capacity(tokens: int, num_experts: int, k: int, factor: float, minimum: int) -> int:
    """max(minimum, ceil(factor * tokens * k / E)), at most `tokens` (an expert can take
    each token once)."""
    return min(tokens, max(minimum, math.ceil(factor * tokens * k / num_experts)))


# ----------------------------------------------------------------------------- experts


def _merged_ragged_dot(x, w, group_sizes):
    """ragged_dot of a batch of row sets `x [batch, rows, a]` (each sorted by group, with
    `group_sizes [batch, E]`) against shared `w [E, a, b]`: the rows are merged, sorted
    by group (stable: batch order within a group) into one ragged_dot, and put back."""
    batch, rows, _ = x.shape
    ends = jnp.cumsum(group_sizes, axis=-1)
    group = jax.vmap(lambda e: jnp.searchsorted(e, jnp.arange(rows), side="right"))(ends)  # [batch, rows]
    order = jnp.argsort((group * batch + jnp.arange(batch)[:, None]).reshape(-1), stable=True)
    y = jax.lax.ragged_dot(x.reshape(batch * rows, -1)[order], w, group_sizes.sum(0))
    return jnp.zeros_like(y).at[order].set(y).reshape(batch, rows, -1)


def _batched(axis_size, in_batched, *args):
    return [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched, strict=True)]


@custom_batching.custom_vmap
def _gmm(x, w, group_sizes):
    return jax.lax.ragged_dot(x, w, group_sizes)


@_gmm.def_vmap
def _gmm_vmap(axis_size, in_batched, x, w, group_sizes):
    if in_batched[1]:
        return jax.vmap(jax.lax.ragged_dot)(*_batched(axis_size, in_batched, x, w, group_sizes)), True
    x, group_sizes = _batched(axis_size, (in_batched[0], in_batched[2]), x, group_sizes)
    return _merged_ragged_dot(x, w, group_sizes), True


def _gmm_weight_grad_one(x, ct, group_sizes, w):
    """d(sum ct * ragged_dot(x, w, g)) / dw: [E, a, b], group e's rows of x^T ct."""
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return jax.lax.ragged_dot_general(x, ct, group_sizes, numbers, preferred_element_type=w.dtype)


@custom_batching.custom_vmap
def _gmm_weight_grad(x, ct, group_sizes, w):
    return _gmm_weight_grad_one(x, ct, group_sizes, w)


@_gmm_weight_grad.def_vmap
def _gmm_weight_grad_vmap(axis_size, in_batched, x, ct, group_sizes, w):
    x, ct, group_sizes = _batched(axis_size, in_batched[:3], x, ct, group_sizes)
    if in_batched[3]:
        return jax.vmap(_gmm_weight_grad_one)(x, ct, group_sizes, w), True
    return jax.vmap(lambda a, c, g: _gmm_weight_grad_one(a, c, g, w))(x, ct, group_sizes), True


@jax.custom_vjp
def grouped_matmul(x: Array, w: Array, group_sizes: Array) -> Array:
    """`jax.lax.ragged_dot(x [m, a], w [E, a, b], group_sizes [E]) -> [m, b]`: rows of x
    sorted by group, group g multiplied by w[g]; rows past sum(group_sizes) give 0.

    `ragged_dot` has no batching rule for a batched x with shared w; this one has
    (`custom_vmap`): under `jax.vmap` the batch's rows are merged into one ragged_dot,
    forward and for x's gradient. Works under grad, vmap, grad of vmap and vmap of grad.
    Under vmap, w's gradient is formed per example and summed by vmap: transient memory
    of batch x w; a dropless layer is per token, so call it on the flattened batch
    `[batch * seq, d]` where that matters."""
    return _gmm(x, w, group_sizes)


def _varying_axes(a) -> frozenset:
    """The shard_map axes `a` varies over (empty outside shard_map); jax 0.10 keeps them
    in the aval's `manual_axis_type.varying`, other versions in `vma`."""
    aval = jax.typeof(a)
    axes = getattr(aval, "vma", None)
    if axes is None:
        axes = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(axes or ())


def _grouped_matmul_fwd(x, w, group_sizes):
    return _gmm(x, w, group_sizes), (x, w, group_sizes)


def _grouped_matmul_bwd(res, ct):
    x, w, group_sizes = res
    dx = _gmm(ct, jnp.swapaxes(w, 1, 2).astype(ct.dtype), group_sizes).astype(x.dtype)
    dw = _gmm_weight_grad(x, ct.astype(x.dtype), group_sizes, w).astype(w.dtype)
    # Inside shard_map, weights replicated over an axis the rows vary over (a data axis)
    # get that axis's sum, as JAX's own transpose of the implicit broadcast would give.
    extra = tuple(sorted(_varying_axes(dw) - _varying_axes(w)))
    if extra:
        dw = jax.lax.psum(dw, extra)
    return dx, dw, None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


class Experts(eqx.Module):
    """E feed-forward networks of one kind (`FFN_KINDS`: relu, gelu, silu, swiglu, ...) with stacked
    weights: w_in, w_gate `[E, d_model, d_ff]`, w_out `[E, d_ff, d_model]`, biases
    `[E, d_ff]`, `[E, d_model]` (float32; computed in the activations' dtype). Expert e
    computes what `FeedForward` computes with its weights."""

    kind: str = eqx.field(static=True)
    w_in: Float[Array, "experts d_model d_ff"]
    b_in: Float[Array, "experts d_ff"]
    w_gate: Float[Array, "experts d_model d_ff"] | None
    b_gate: Float[Array, "experts d_ff"] | None
    w_out: Float[Array, "experts d_ff d_model"]
    b_out: Float[Array, "experts d_model"]
    dropout: eqx.nn.Dropout

    def __init__(
        self, num_experts: int, d_model: int, d_ff: int, kind: str = "gelu", *, dropout: float = 0.0, key: PRNGKeyArray
    ):
        if kind not in FFN_KINDS:
            raise ValueError(f"ffn must be one of {FFN_KINDS}; got {kind!r}")
        keys = jax.random.split(key, 6)

        def uniform(k, shape, fan_in):
            bound = 1.0 / math.sqrt(fan_in)
            return jax.random.uniform(k, shape, minval=-bound, maxval=bound)

        self.kind = kind
        self.w_in = uniform(keys[0], (num_experts, d_model, d_ff), d_model)
        self.b_in = uniform(keys[1], (num_experts, d_ff), d_model)
        gated = kind in GATED_KINDS
        self.w_gate = uniform(keys[2], (num_experts, d_model, d_ff), d_model) if gated else None
        self.b_gate = uniform(keys[3], (num_experts, d_ff), d_model) if gated else None
        self.w_out = uniform(keys[4], (num_experts, d_ff, d_model), d_ff)
        self.b_out = uniform(keys[5], (num_experts, d_model), d_ff)
        self.dropout = eqx.nn.Dropout(dropout)

    @property
    def num_experts(self) -> int:
        return self.w_in.shape[0]

    def _hidden(self, h, g):
        h = ACTIVATIONS[self.kind](h)
        return h if g is None else h * g

    def dense(
        self, x: Float[Array, "experts cap d_model"], *, key: PRNGKeyArray | None = None, inference: bool = False
    ) -> Float[Array, "experts cap d_model"]:
        """Expert e applied to its buffer x[e]."""
        dt = x.dtype

        def proj(w, b, inp):
            return jnp.einsum("ecd,edf->ecf", inp, w.astype(dt)) + b.astype(dt)[:, None, :]

        g = None if self.w_gate is None else proj(self.w_gate, self.b_gate, x)
        h = self.dropout(self._hidden(proj(self.w_in, self.b_in, x), g), key=key, inference=inference)
        return proj(self.w_out, self.b_out, h)

    def ragged(
        self,
        x: Float[Array, "rows d_model"],
        group_sizes: Int[Array, " experts"],
        expert_of_row: Int[Array, " rows"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "rows d_model"]:
        """Rows sorted by expert (`group_sizes[e]` rows for expert e, `expert_of_row`
        their expert, clipped into range for rows past the groups, whose output is
        meaningless and must be discarded), each through its expert (ragged_dot)."""
        dt, e = x.dtype, jnp.clip(expert_of_row, 0, self.num_experts - 1)

        def proj(w, b, inp):
            return grouped_matmul(inp, w.astype(dt), group_sizes) + b.astype(dt)[e]

        g = None if self.w_gate is None else proj(self.w_gate, self.b_gate, x)
        h = self.dropout(self._hidden(proj(self.w_in, self.b_in, x), g), key=key, inference=inference)
        return proj(self.w_out, self.b_out, h)


# ----------------------------------------------------------------------------- the layer


@typing.no_type_check  # values come from users' YAML: check_fields names the key instead
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts FFN, as a model config's `ffn` component
    (`ffn: {kind: moe, num_experts: 8, top_k: 2}`): the `MoE` constructor's settings,
    declared once here (its keyword defaults read them). Whether the layer is causal is
    the model's, checked there (expert choice cannot be)."""

    kind: str = setting("moe", "this FFN component: a mixture of experts", choices=("moe",))
    d_ff: int | None = setting(None, "each expert's hidden width (None: 4 d_model)")
    num_experts: int = setting(8, "experts E")
    top_k: int = setting(
        1, "experts per token (token choice: 1 is Switch, 2 GShard; prototype: the k groups, one expert in each)"
    )
    router: str = setting(
        "token_choice",
        "who picks: tokens their top-k experts (token_choice), experts their tokens (expert_choice), a fixed "
        "random hash of the token id (hash: Roller et al. 2021), a balanced assignment (base: Lewis et al. 2021), "
        "top-1 in each of top_k groups of experts (prototype: M6-T's expert prototyping)",
        choices=ROUTERS,
    )
    ffn: str = setting("gelu", "the experts' feed-forward kind", choices=FFN_KINDS)
    second_policy: str = setting("all", "GShard's policy for ranks >= 2 in training", choices=SECOND_POLICIES)
    capacity_factor: float = setting(1.25, "expert capacity over the even share, in training")
    eval_capacity_factor: float = setting(2.0, "expert capacity over the even share, at inference")
    min_capacity: int = setting(4, "the least capacity of an expert")
    dropless: bool = setting(
        False, "token choice and prototype without capacity: every assignment is processed (hash and base never drop)"
    )
    dropless_method: str = setting("auto", "how dropless runs (ragged_dot or padded buffers)", choices=DROPLESS_METHODS)
    jitter_eps: float = setting(0.0, "router input jitter U(1 - eps, 1 + eps) in training (Switch); 0: none")
    shared_expert: bool = setting(False, "add a FeedForward every token goes through")
    balance_weight: float = setting(0.01, "weight of the load-balancing loss (Switch: 0.01; hash and base have none)")
    z_loss_weight: float = setting(0.001, "weight of the router z-loss (ST-MoE: 0.001; hash and base have none)")
    every: int = setting(
        1, "the model's ffn only: experts in blocks 0, k, 2k, ... and a dense FFN of the experts' kind and d_ff in "
        "the others (GShard, Switch and GLaM's 'every other layer': 2); 1: experts in every block", limits=1,
    )  # fmt: skip
    dense_ffn: str | None = setting(
        None, "with every > 1: the kind of the dense FFN in the blocks between (None: the experts' kind; GLaM: "
        "geglu, its gated GELU outside the experts)", choices=(*FFN_KINDS, None),
    )  # fmt: skip

    def __post_init__(self):
        check_fields(self, "moe.")
        if self.dense_ffn is not None and self.every == 1:
            raise ValueError(
                f"moe.dense_ffn ({self.dense_ffn!r}) is the FFN of the blocks between experts: set every > 1 too"
            )
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"moe.d_ff must be >= 1 or None (4 d_model); got {self.d_ff}")
        if self.num_experts < 1:
            raise ValueError(f"moe.num_experts must be >= 1; got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"moe.top_k must be in [1, num_experts={self.num_experts}]; got {self.top_k}")
        for name in ("capacity_factor", "eval_capacity_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name} must be > 0; got {getattr(self, name)}")
        if self.min_capacity < 1:
            raise ValueError(f"moe.min_capacity must be >= 1; got {self.min_capacity}")
        if not 0 <= self.jitter_eps < 1:
            raise ValueError(f"moe.jitter_eps must be in [0, 1); got {self.jitter_eps}")
        for name in ("balance_weight", "z_loss_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"moe.{name} must be >= 0; got {getattr(self, name)}")
        if self.router == "expert_choice" and self.dropless:
            raise ValueError("moe.dropless applies to router 'token_choice'; expert choice has a fixed capacity")
        if self.router in ("hash", "base") and self.top_k != 1:
            raise ValueError(
                f"moe.router {self.router!r} sends each token to one expert: top_k must be 1; got {self.top_k}"
            )
        if self.router == "hash" and self.jitter_eps:
            raise ValueError(
                f"moe.router 'hash' has no learned router to jitter: jitter_eps must be 0; got {self.jitter_eps}"
            )
        if self.router == "prototype":
            if self.num_experts % self.top_k:
                raise ValueError(
                    f"moe.router 'prototype' splits the experts into top_k groups: num_experts must be a multiple "
                    f"of top_k; got num_experts={self.num_experts}, top_k={self.top_k}"
                )
            if self.second_policy != "all":
                raise ValueError(
                    f"moe.second_policy {self.second_policy!r} ranks a token's choices (GShard); prototype groups "
                    "are not ranked: use 'all'"
                )

    def check_causal(self, causal: bool) -> None:
        """Expert choice and BASE's balanced assignment see the whole sequence: refused in
        a causal model."""
        if causal and self.router == "expert_choice":
            raise ValueError(
                "moe.router 'expert_choice' leaks future tokens (each expert picks among the whole "
                "sequence), so it cannot be causal; use router 'token_choice' in causal models"
            )
        if causal and self.router == "base":
            raise ValueError(
                "moe.router 'base' leaks future tokens in training: the balanced assignment of token t depends on "
                "the affinities of every later token of its group, the token t predicts included (the paper's "
                "language models shuffle tokens across workers to dilute this; a group here is one sequence), so "
                "it cannot be causal; use router 'token_choice', 'hash' or 'prototype' in causal models"
            )

    def settings(self) -> dict:
        """The `MoE` constructor's keywords (everything but kind, d_ff and the placement:
        `every`, `dense_ffn`)."""
        placement = ("kind", "d_ff", "every", "dense_ffn")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in placement}


# The MoE constructor's defaults, read from MoEConfig.
SETTINGS = MoEConfig().settings()


def check_settings(settings: dict, *, causal: bool, prefix: str = "") -> dict:
    """`settings` (a subset of SETTINGS) completed with the defaults, after ValueErrors
    for unknown names and out-of-range values (those of `MoEConfig`); nothing is built."""
    unknown = sorted(set(settings) - set(SETTINGS), key=str)
    if unknown:
        raise ValueError(f"{prefix}unknown MoE setting(s) {unknown}; known: {sorted(SETTINGS)}")
    config = MoEConfig(**settings)
    config.check_causal(causal)
    return config.settings()


def has_moe(tree) -> bool:
    """Whether `tree` (a model) holds an MoE layer (and so has auxiliary losses)."""
    return any(isinstance(leaf, MoE) for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, MoE)))


def aux_loss(aux: Sequence[dict[str, Array]]) -> Float[Array, ""]:
    """The sum of the MoE layers' weighted auxiliary losses (aux["loss"] each)."""
    return sum((a["loss"] for a in aux), jnp.zeros((), jnp.float32))


def reduce_aux(aux: dict[str, Array], axis: int = 0) -> dict[str, Array]:
    """One layer's aux stacked over examples (or micro-batches) on `axis`, reduced:
    counts (SUMMED) summed, the rest averaged."""
    return {name: v.sum(axis) if name in SUMMED else v.mean(axis) for name, v in aux.items()}


def layer_metrics(layers: Sequence[dict[str, Array]]) -> dict[str, Array]:
    """Per-layer metrics to log, named "moe{j}/{name}" for the j-th MoE layer in call
    order: the aux entries (expert_load is a vector [E]) and load_imbalance, the
    busiest expert's load over the mean load (1 = perfectly balanced)."""
    out = {}
    for j, aux in enumerate(layers):
        out |= {f"moe{j}/{name}": v for name, v in aux.items()}
        load = aux["expert_load"]
        out[f"moe{j}/load_imbalance"] = load.max() / jnp.maximum(load.mean(), 1e-9)
    return out


class MoE(eqx.Module):
    """A mixture-of-experts FFN replacement: router, dispatch, E experts, an optional
    shared expert (a FeedForward every token goes through, added to the routed output).

    Arguments (constructor):
        d_model, d_ff, num_experts, ffn: the experts (ffn kind in FFN_KINDS).
        top_k: experts per token (token choice); with router "prototype", the number
            of groups k (each token takes one expert in each). router: "token_choice",
            "expert_choice", "hash", "base" or "prototype" (the module docstring).
            second_policy: "all" or "random" (GShard; training, keyed).
        capacity_factor, eval_capacity_factor, min_capacity: capacity in training /
            inference (token choice and prototype with dispatch by capacity, and expert
            choice, where C = ceil(cf * seq / E) tokens per expert).
        dropless: token choice (or prototype) without capacity; dropless_method:
            "ragged" (ragged_dot), "padded" (buffers of C = seq) or "auto"
            (`ragged_pays`: padded on CPU, and on GPUs unless E / k > 8); see the module
            docstring. Hash and base never drop, whatever `dropless` says.
        jitter_eps: router input jitter (training only; 0 disables).
        shared_expert: add a FeedForward of width d_ff applied to every token.
        balance_weight, z_loss_weight: aux["loss"] = balance_weight * balance_loss +
            z_loss_weight * z_loss, what a model adds to its training loss (Switch: 0.01;
            ST-MoE: z-loss 0.001); hash and base report both as 0 (their papers have
            no auxiliary loss).
        causal: the layer sits in a causal model (expert choice and base then refuse).
        vocab_size: the token ids' range, for router "hash" (its table; required there).

    Call: `(x [seq, d_model], *, mask [seq] | None, token_ids [seq] | None, key,
    inference) -> (y, aux)`; `token_ids` (ids in [0, vocab_size), `NO_TOKEN` for rows
    that hold no input token) is read by router "hash" only, which needs it.
    Time: router O(seq d E); experts O(E C d d_ff) (capacity) or O(seq k d d_ff)
    (dropless); base's balanced assignment O(seq^2 E + seq E^3) in training.
    Decoding: token choice, hash and prototype work token by token (seq = 1, capacity 1
    per expert); expert choice and base (in training) are not causal.
    """

    router: Linear | None  # None for hash (no learned router); base: the expert embeddings w_e
    table: Int[Array, " vocab_plus_one"] | None  # hash: token id -> expert, drawn once, never trained
    experts: Experts
    shared: FeedForward | None
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    routing: str = eqx.field(static=True)
    second_policy: str = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)
    eval_capacity_factor: float = eqx.field(static=True)
    min_capacity: int = eqx.field(static=True)
    dropless: bool = eqx.field(static=True)
    dropless_method: str = eqx.field(static=True)
    jitter_eps: float = eqx.field(static=True)
    balance_weight: float = eqx.field(static=True)
    z_loss_weight: float = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        num_experts: int,
        *,
        top_k: int = SETTINGS["top_k"],
        router: str = SETTINGS["router"],
        ffn: str = SETTINGS["ffn"],
        second_policy: str = SETTINGS["second_policy"],
        capacity_factor: float = SETTINGS["capacity_factor"],
        eval_capacity_factor: float = SETTINGS["eval_capacity_factor"],
        min_capacity: int = SETTINGS["min_capacity"],
        dropless: bool = SETTINGS["dropless"],
        dropless_method: str = SETTINGS["dropless_method"],
        jitter_eps: float = SETTINGS["jitter_eps"],
        shared_expert: bool = SETTINGS["shared_expert"],
        balance_weight: float = SETTINGS["balance_weight"],
        z_loss_weight: float = SETTINGS["z_loss_weight"],
        causal: bool = False,
        vocab_size: int | None = None,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        check_settings(
            dict(
                num_experts=num_experts,
                top_k=top_k,
                router=router,
                ffn=ffn,
                second_policy=second_policy,
                capacity_factor=capacity_factor,
                eval_capacity_factor=eval_capacity_factor,
                min_capacity=min_capacity,
                dropless=dropless,
                dropless_method=dropless_method,
                jitter_eps=jitter_eps,
                shared_expert=shared_expert,
                balance_weight=balance_weight,
                z_loss_weight=z_loss_weight,
            ),
            causal=causal,
        )
        if router == "hash" and (vocab_size is None or vocab_size < 1):
            raise ValueError(f"router 'hash' draws a table over the token ids: pass vocab_size >= 1; got {vocab_size}")
        kr, ke, ks = jax.random.split(key, 3)
        self.router = None if router == "hash" else Linear(d_model, num_experts, use_bias=False, key=kr)
        self.table = hash_table(vocab_size, num_experts, kr) if router == "hash" and vocab_size else None
        self.experts = Experts(num_experts, d_model, d_ff, ffn, dropout=dropout, key=ke)
        self.shared = FeedForward(d_model, d_ff, ffn, dropout=dropout, key=ks) if shared_expert else None
        self.num_experts = num_experts
        self.top_k, self.routing, self.second_policy = top_k, router, second_policy
        self.capacity_factor, self.eval_capacity_factor, self.min_capacity = (
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
        )
        self.dropless, self.dropless_method, self.jitter_eps, self.causal = (
            dropless,
            dropless_method,
            jitter_eps,
            causal,
        )
        self.balance_weight, self.z_loss_weight = balance_weight, z_loss_weight

    def router_logits(
        self, x: Float[Array, "seq d_model"], *, key: PRNGKeyArray | None = None, inference: bool = False
    ) -> Float[Array, "seq experts"]:
        """float32 router logits (base: the affinities h_t . w_e), with jitter on the
        input in training (needs `key`)."""
        if self.router is None:
            raise ValueError(f"router {self.routing!r} has no learned router (no logits)")
        x = x.astype(jnp.float32)
        if self.jitter_eps > 0 and not inference:
            if key is None:
                raise ValueError("MoE jitter in training needs a key (or pass inference=True)")
            x = jitter(x, self.jitter_eps, key)
        return self.router(x)

    def __call__(
        self,
        x: Float[Array, "seq d_model"],
        *,
        mask: Bool[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Float[Array, "seq d_model"], dict[str, Array]]:
        return self.forward(x, mask=mask, token_ids=token_ids, key=key, inference=inference)

    def forward(
        self,
        x: Float[Array, "seq d_model"],
        *,
        mask: Bool[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
        experts_fn: Callable | None = None,
    ) -> tuple[Float[Array, "seq d_model"], dict[str, Array]]:
        """The layer, with the experts' step replaceable: `experts_fn(buffers [E, C, d],
        counts [E], key) -> [E, C, d]`, where expert e's first counts[e] slots hold
        tokens and the rest are empty (expert parallelism passes one that sends the
        buffers to the experts' devices and back). With `experts_fn`, a dropless layer
        dispatches into buffers of C = seq (an expert takes each token at most once,
        so nothing can drop)."""
        seq = x.shape[0]
        real = _real(mask, seq)
        if key is None and not inference and self.second_policy == "random" and self.top_k > 1:
            raise ValueError("MoE second_policy 'random' in training needs a key (or pass inference=True)")
        k_jitter, k_policy, k_experts, k_shared = split_key(key, 4)
        ragged = experts_fn is None and self.drops_none(inference) and self.ragged_dispatch
        if experts_fn is None:
            experts_fn = lambda b, _, k: self.experts.dense(b, key=k, inference=inference)  # noqa: E731
        if self.routing == "expert_choice":
            logits = self.router_logits(x, key=k_jitter, inference=inference)
            aux = _router_statistics(logits, real)
            y, more = self._expert_choice(x, logits, real, key=k_experts, inference=inference, experts_fn=experts_fn)
        else:
            experts, gates, active, aux = self.route(
                x,
                mask=real,
                token_ids=token_ids,
                key=k_jitter,
                policy_key=None if inference else k_policy,
                inference=inference,
            )
            y, more = self._dispatch(
                x, experts, gates, active, key=k_experts, inference=inference, experts_fn=experts_fn, ragged=ragged
            )
        aux.update(more)
        aux["loss"] = self.balance_weight * aux["balance_loss"] + self.z_loss_weight * aux["z_loss"]
        if self.shared is not None:
            y = y + self.shared(x, key=k_shared, inference=inference)
        return y, aux

    def route(
        self,
        x: Float[Array, "seq d_model"],
        *,
        mask: Bool[Array, " seq"] | None = None,
        token_ids: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
        policy_key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> tuple[Int[Array, "seq k"], Float[Array, "seq k"], Bool[Array, "seq k"], dict[str, Array]]:
        """Every router but expert choice: (experts, gates, active), each `[seq, k]` (k =
        top_k for token choice and prototype, 1 for hash and base), and the router's aux
        entries (balance_loss, z_loss, router_entropy, router_confidence). `key`: the
        jitter's; `policy_key`: GShard's random policy (token choice in training)."""
        seq = x.shape[0]
        real = _real(mask, seq)
        if self.routing == "hash":
            if token_ids is None:
                raise ValueError("MoE router 'hash' routes by token id: pass token_ids ([seq] ids, NO_TOKEN for none)")
            assert self.table is not None  # built with router "hash"
            # Roller et al.'s hash layer: y_t = FFN_{hash(x_t)}(h_t), no gate, no loss
            experts = hash_route(self.table, token_ids)[:, None]
            active = real[:, None]
            zero = jnp.zeros((), jnp.float32)
            aux = {"balance_loss": zero, "z_loss": zero, "router_entropy": zero, "router_confidence": zero + 1.0}
            return experts, active.astype(jnp.float32), active, aux
        logits = self.router_logits(x, key=key, inference=inference)
        if self.routing == "base":
            # BASE: balanced assignment in training, greedy at inference; gate
            # sigma(h_t . w_{a_t}) (the block's residual adds h_t); no auxiliary loss.
            chosen = jnp.argmax(logits, -1) if inference else balanced_assignment(logits, real)
            chosen = jnp.where(real, chosen, 0)[:, None]
            gates = jax.nn.sigmoid(jnp.take_along_axis(logits, chosen, -1))
            active = real[:, None]
            aux = _router_statistics(logits, real)
            aux["z_loss"] = jnp.zeros((), jnp.float32)
            aux["balance_loss"] = jnp.zeros((), jnp.float32)
            return chosen, jnp.where(active, gates, 0.0), active, aux
        if self.routing == "prototype":
            k, per = self.top_k, self.num_experts // self.top_k
            experts, gates, active = prototype_route(logits, k, mask=real)
            groups = jnp.moveaxis(logits.reshape(seq, k, per), 1, 0)  # [k, seq, E/k]
            stats = jax.vmap(lambda g: _router_statistics(g, real))(groups)
            aux = {name: v.mean() for name, v in stats.items()}
            # Switch's loss within each group, over the group's experts; their mean
            local = jnp.moveaxis(experts - per * jnp.arange(k)[None, :], 1, 0)[..., None]  # [k, seq, 1]
            balance = jax.vmap(lambda g, e: load_balancing_loss(jax.nn.softmax(g, -1), e, real))(groups, local)
            aux["balance_loss"] = balance.mean()
            return experts, gates, active, aux
        experts, gates, active = top_k_route(
            logits, self.top_k, mask=real, second_policy=self.second_policy, key=policy_key
        )
        aux = _router_statistics(logits, real)
        aux["balance_loss"] = load_balancing_loss(jax.nn.softmax(logits, -1), experts, real)
        return experts, gates, active, aux

    @property
    def ragged_dispatch(self) -> bool:
        """Whether a dropless layer multiplies with ragged_dot (else padded buffers)."""
        if self.dropless_method == "auto":
            k = self.top_k if self.routing in ("token_choice", "prototype") else 1
            return ragged_pays(jax.default_backend(), self.num_experts, k)
        return self.dropless_method == "ragged"

    def drops_none(self, inference: bool) -> bool:
        """Whether the dispatch processes every assignment (no capacity): dropless token
        choice or prototype, hash always, base at inference (greedy). In training base
        has a capacity that its balanced assignment fills exactly: nothing drops either."""
        if self.routing == "hash" or (self.routing == "base" and inference):
            return True
        return self.dropless and self.routing != "expert_choice"

    def capacity(self, seq: int, *, inference: bool) -> int:
        """Slots per expert of the dispatch by capacity: ceil(cf * seq * k / E) (at least
        min_capacity, at most seq); base in training: ceil(seq / E), which its balanced
        assignment never exceeds; seq where nothing can drop (`drops_none`)."""
        if self.drops_none(inference):
            return seq
        if self.routing == "base":
            return math.ceil(seq / self.num_experts)
        factor = self.eval_capacity_factor if inference else self.capacity_factor
        k = 1 if self.routing == "expert_choice" else self.top_k
        return capacity(seq, self.num_experts, k, factor, self.min_capacity)

    def _dispatch(self, x, experts, gates, active, *, key, inference, experts_fn, ragged):
        """y_t = sum_j gates[t, j] expert_{experts[t, j]}(x_t) over the kept assignments,
        and the dispatch's aux entries (dropped, expert_load)."""
        seq, num_experts, k = x.shape[0], self.num_experts, experts.shape[1]
        if ragged:
            expert_id = jnp.where(active, experts, num_experts).reshape(-1)  # inactive sort last
            order = jnp.argsort(expert_id, stable=True)
            group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[expert_id].add(1)[:num_experts]
            rows = self.experts.ragged(x[order // k], group_sizes, expert_id[order], key=key, inference=inference)
            out = jnp.zeros_like(rows).at[order].set(rows).reshape(seq, k, -1)
            kept = active
        else:
            cap = self.capacity(seq, inference=inference)
            position, kept = capacity_positions(experts, active, num_experts, cap)
            slot = jnp.where(kept, experts * cap + position, num_experts * cap).reshape(-1)  # dropped: out of range
            tokens = jnp.broadcast_to(x[:, None, :], (seq, k, x.shape[1])).reshape(seq * k, -1)
            buffer = jnp.zeros((num_experts * cap, x.shape[1]), x.dtype).at[slot].set(tokens, mode="drop")
            counts = jnp.zeros((num_experts,), jnp.int32).at[experts.reshape(-1)].add(kept.reshape(-1))
            y = experts_fn(buffer.reshape(num_experts, cap, -1), counts, key)
            out = y.reshape(num_experts * cap, -1).at[slot].get(mode="fill", fill_value=0).reshape(seq, k, -1)
        weight = jnp.where(kept, gates, 0.0).astype(x.dtype)
        y = (out * weight[..., None]).sum(1)
        load = jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(kept.reshape(-1).astype(jnp.float32))
        return y, {"dropped": (active & ~kept).sum().astype(jnp.float32), "expert_load": load}

    def _expert_choice(self, x, logits, real, *, key, inference, experts_fn):
        seq, num_experts = x.shape[0], self.num_experts
        cap = self.capacity(seq, inference=inference)
        probs = jax.nn.softmax(logits, -1)
        scores = jnp.where(real[:, None], probs, -1.0)  # padding ranks below every real token
        gates, token = jax.lax.top_k(scores.T, cap)  # [E, cap]; real tokens first
        valid = real[token]
        y = experts_fn(x[token], valid.sum(1, dtype=jnp.int32), key)
        weight = jnp.where(valid, gates, 0.0).astype(x.dtype)
        out = jnp.zeros_like(x).at[token.reshape(-1)].add((y * weight[..., None]).reshape(num_experts * cap, -1))
        picked = jnp.zeros((seq,), bool).at[token.reshape(-1)].max(valid.reshape(-1))
        aux = {
            "balance_loss": jnp.zeros((), jnp.float32),
            "dropped": (real & ~picked).sum().astype(jnp.float32),
            "expert_load": valid.sum(1).astype(jnp.float32),
        }
        return out, aux


def _router_statistics(logits: Float[Array, "seq experts"], real: Bool[Array, " seq"]) -> dict[str, Array]:
    """z_loss, router_entropy and router_confidence of one softmax router."""
    return {
        "z_loss": z_loss(logits, real),
        "router_entropy": router_entropy(logits, real),
        "router_confidence": router_confidence(logits, real),
    }
