"""PowerNorm (Shen, Yao, Gholami, Mahoney & Keutzer 2020, "PowerNorm: Rethinking Batch
Normalization in Transformers", ICML, Algorithm 1), with its running statistics as
model state that a train step updates and a checkpoint keeps.

PowerNorm divides each feature by a running quadratic mean over the batches seen,
not by the current example's or batch's statistics, and trains with an approximate
backward that stands in for the batch dependence the forward lacks:

    forward:   x̂ = x / ψ_{t-1},  y = γ ⊙ x̂ + β       (ψ² = psi2 + eps, per feature)
    backward:  ∂L/∂x = (∂L/∂x̂ - ν_{t-1} ⊙ x̂) / ψ_{t-1}
    after the step, over the batch's (unpadded) tokens:
               ψ_t² = α_f ψ_{t-1}² + (1 - α_f) mean(x²)
               ν_t = ν_{t-1} (1 - (1 - α_b) Γ) + (1 - α_b) Λ,  Γ = mean(x̂²),  Λ = mean(x̂ ⊙ ∂L/∂x̂)

As the authors' code (sIncerass/powernorm, fairseq/modules/norms/mask_powernorm.py),
x is first divided by its own root mean square over the features of each of `groups`
groups (their `GroupScaling1D`), and ψ_0 = 1, ν_0 = 0, α_f = α_b = 0.9.

How the statistics travel: a model sees one example at a time (batches are `jax.vmap`
over it), so a norm cannot average over the batch itself. The batch sums the update
needs are instead what differentiating the loss with respect to the statistics
returns: the normalisation's custom backward gives, as the "gradient" of `psi2`, the
sum of x² over the tokens, of `nu` the sum of x̂ ⊙ ∂L/∂x̂, and of `tokens` their count
(`jax.vmap` and gradient accumulation add them over examples and micro-batches). The
train step (`jxformers.train.step`) differentiates with respect to the statistics
beside the parameters and hands those sums to `update_statistics`; nothing travels
through a side channel. The statistics are not trainable (`jxformers.nn.trainable`
leaves them out), so in a training state they sit with the drawn arrays and are
checkpointed with them. Outside the train step:

    stats = statistics(model)                      # a filter: True at the statistics
    params, rest = eqx.partition(model, trainable(model))
    s, rest = eqx.partition(rest, stats)
    grads, sums = jax.grad(loss, argnums=(0, 1))(params, s, rest)
    model = update_statistics(eqx.combine(params, s, rest), sums)

Inference uses the same forward (x / ψ with the latest statistics); decoding a token
needs no other token.
"""

from __future__ import annotations

import functools
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

# The attribute holding a module's running statistics: `trainable` leaves these out.
STATISTICS = "statistics"
# The authors' defaults (mask_powernorm.py: alpha_fwd, alpha_bkw, eps, group_num).
ALPHA = 0.9
EPS = 1e-5


class PowerStatistics(eqx.Module):
    """PowerNorm's running statistics, one per feature, and the count of tokens they
    have seen. In a gradient with respect to them, each field holds instead the batch's
    sum that updates it (see the module docstring)."""

    psi2: Float[Array, " dim"]  # ψ², the running quadratic mean of the group-scaled input
    nu: Float[Array, " dim"]  # ν, the backward's running estimate of mean(x̂ ⊙ ∂L/∂x̂)
    tokens: Float[Array, ""]  # tokens seen by the updates so far (float32: a cotangent carries the batch's)

    def __init__(self, dim: int):
        self.psi2 = jnp.ones((dim,), jnp.float32)
        self.nu = jnp.zeros((dim,), jnp.float32)
        self.tokens = jnp.zeros((), jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _scale(xs, weights, psi2, nu, tokens, eps):
    """x̂ = xs / sqrt(psi2 + eps), with PowerNorm's backward (`_scale_bwd`)."""
    del weights, nu, tokens
    return xs * jax.lax.rsqrt(psi2 + eps)[None]


def _scale_fwd(xs, weights, psi2, nu, tokens, eps):
    del tokens
    return xs * jax.lax.rsqrt(psi2 + eps)[None], (xs, weights, psi2, nu)


def _scale_bwd(eps, saved, g):
    xs, weights, psi2, nu = saved
    inverse = jax.lax.rsqrt(psi2 + eps)[None]
    x_hat = xs * inverse
    dx = (g - nu[None] * x_hat) * inverse  # Algorithm 1: the correction ν ⊙ x̂, then / ψ_{t-1}
    w = weights[:, None]
    # Not derivatives: the batch's sums the statistics' update needs (module docstring).
    sums = (jnp.sum(w * jnp.square(xs), 0), jnp.sum(w * x_hat * g, 0), jnp.sum(weights))
    return (dx, jnp.zeros_like(weights), *sums)


_scale.defvjp(_scale_fwd, _scale_bwd)


class PowerNorm(eqx.Module):
    """PowerNorm over the last axis (see the module docstring), computed in float32 and
    returned in the input dtype.

    Arguments (constructor): `dim` features, `eps` (added to ψ² and to each group's
    mean square), `groups` the group scaling's groups (dividing `dim`), `alpha_forward`
    and `alpha_backward` the running averages' α_f and α_b.

    Arguments (call): `x` `[*batch, dim]`; `mask` `[*batch]` True for the tokens the
    statistics count (None: all), e.g. the unpadded ones, as the authors' code.
    Returns `[*batch, dim]`."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    statistics: PowerStatistics
    eps: float = eqx.field(static=True)
    groups: int = eqx.field(static=True)
    alpha_forward: float = eqx.field(static=True)
    alpha_backward: float = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        eps: float = EPS,
        *,
        groups: int = 1,
        alpha_forward: float = ALPHA,
        alpha_backward: float = ALPHA,
    ):
        if groups < 1 or dim % groups:
            raise ValueError(f"{groups=} must be >= 1 and divide {dim=}")
        for name, alpha in (("alpha_forward", alpha_forward), ("alpha_backward", alpha_backward)):
            if not 0 <= alpha < 1:
                raise ValueError(f"{name}={alpha} must be in [0, 1)")
        self.weight, self.bias = jnp.ones((dim,)), jnp.zeros((dim,))
        self.statistics = PowerStatistics(dim)
        self.eps, self.groups = eps, groups
        self.alpha_forward, self.alpha_backward = alpha_forward, alpha_backward

    def __call__(
        self, x: Float[Array, "*batch dim"], *, mask: Bool[Array, "*batch"] | None = None
    ) -> Float[Array, "*batch dim"]:
        dim = x.shape[-1]
        if mask is not None and jnp.shape(mask) != x.shape[:-1]:
            raise ValueError(f"mask must have shape {x.shape[:-1]} (x's without the features); got {jnp.shape(mask)}")
        xf = x.astype(jnp.float32).reshape(-1, self.groups, dim // self.groups)
        # the authors' GroupScaling1D: each token over its own features' mean square, per group
        xs = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)).reshape(-1, dim)
        # Every token counts without a mask. The ones are computed from x (an always-true
        # test) so that under `jax.vmap` they are batched like x: an unbatched count would
        # come out of the backward once, not summed over the examples.
        real = (jnp.isfinite(xs[:, 0]) | True) if mask is None else mask.reshape(-1)
        weights = real.astype(jnp.float32)
        s = self.statistics
        x_hat = cast(Array, _scale(xs, weights, s.psi2, s.nu, s.tokens, self.eps))
        y = x_hat * self.weight[None] + self.bias[None]
        return y.reshape(x.shape).astype(x.dtype)

    def updated(self, sums: PowerStatistics) -> PowerNorm:
        """This norm with its statistics updated from a batch's `sums` (the gradient with
        respect to `statistics`; see the module docstring); unchanged when the batch had
        no tokens."""
        s, n = self.statistics, sums.tokens
        seen = n > 0
        count = jnp.maximum(n, 1.0)
        mean_square = sums.psi2 / count  # mean(x²), the batch's quadratic mean
        gamma = mean_square / (s.psi2 + self.eps)  # mean(x̂²): x̂ = x / ψ_{t-1}, one ψ for every token
        lam = sums.nu / count
        af, ab = self.alpha_forward, self.alpha_backward
        new = (
            jnp.where(seen, af * s.psi2 + (1 - af) * mean_square, s.psi2),
            jnp.where(seen, s.nu * (1 - (1 - ab) * gamma) + (1 - ab) * lam, s.nu),
            s.tokens + n,
        )
        return eqx.tree_at(lambda m: (m.statistics.psi2, m.statistics.nu, m.statistics.tokens), self, new)


def _is_power_norm(x) -> bool:
    return isinstance(x, PowerNorm)


def has_statistics(model) -> bool:
    """True when `model` holds a norm with running statistics (PowerNorm)."""
    return any(_is_power_norm(x) for x in jax.tree.leaves(model, is_leaf=_is_power_norm))


def statistics(model) -> object:
    """A pytree of bools like `model`: True at the running statistics of its norms
    (the leaves under a `statistics` attribute). Use it as an `eqx.partition` filter."""

    def leaf(path, x):
        return eqx.is_array(x) and any(isinstance(p, jax.tree_util.GetAttrKey) and p.name == STATISTICS for p in path)

    return jax.tree_util.tree_map_with_path(leaf, model)


def update_statistics(model, sums):
    """`model` with each PowerNorm's statistics updated from `sums`, the gradient of a
    batch's loss with respect to the model's statistics (a tree like `model`, e.g. the
    `eqx.partition(model, statistics(model))` part, with None elsewhere)."""

    def one(module, got):
        if not _is_power_norm(module):
            return module
        return module.updated(got.statistics)

    return jax.tree.map(one, model, sums, is_leaf=_is_power_norm)
