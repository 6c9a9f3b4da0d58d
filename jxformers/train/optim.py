"""The optimizer: optax AdamW or RAdam, linear warmup then cosine or inverse-sqrt decay,
global-norm clipping, and weight decay on weight matrices only (norm scales, biases and
other vectors are not decayed)."""

from __future__ import annotations

import jax
import optax

OPTIMIZERS = ("adamw", "radam")
SCHEDULES = ("cosine", "inverse_sqrt", "constant")
# The warm-up of a run that sets none: this many steps, or the whole run when it is shorter.
DEFAULT_WARMUP_STEPS = 100


def default_warmup_steps(total_steps: int) -> int:
    """The warm-up when none is set: DEFAULT_WARMUP_STEPS, cut to a shorter run (a set
    warm-up longer than the run is refused instead: `TrainConfig`)."""
    return min(DEFAULT_WARMUP_STEPS, total_steps)


def learning_rate_schedule(*, peak: float, warmup_steps: int | None, total_steps: int, kind: str) -> optax.Schedule:
    """Linear warmup from 0 to `peak` over `warmup_steps` (None: `default_warmup_steps`),
    then cosine decay to 0 at `total_steps`, inverse-sqrt decay (peak * sqrt(warmup /
    step)), or constant."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {kind!r}")
    warmup = default_warmup_steps(total_steps) if warmup_steps is None else max(warmup_steps, 0)
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1))
    ramp = optax.linear_schedule(0.0, peak, max(warmup, 1))
    if kind == "constant":
        return optax.join_schedules([ramp, optax.constant_schedule(peak)], [warmup])
    decay = lambda step: peak * jax.lax.rsqrt((step + max(warmup, 1)) / max(warmup, 1))  # noqa: E731
    return optax.join_schedules([ramp, decay], [warmup])


def decay_mask(params):
    """True for leaves that weight decay applies to: arrays with two or more axes."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(
    *,
    optimizer: str = "adamw",
    learning_rate: float = 1e-3,
    warmup_steps: int | None = 0,
    total_steps: int = 1,
    schedule: str = "cosine",
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its learning-rate schedule (for logging); `warmup_steps` None:
    `default_warmup_steps(total_steps)`."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}")
    lr = learning_rate_schedule(peak=learning_rate, warmup_steps=warmup_steps, total_steps=total_steps, kind=schedule)
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    if optimizer == "adamw":
        parts.append(optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask))
    else:
        parts += [  # RAdam with decoupled weight decay, as AdamW decouples it from Adam
            optax.scale_by_radam(b1=b1, b2=b2, eps=eps),
            optax.add_decayed_weights(weight_decay, mask=decay_mask),
            optax.scale_by_learning_rate(lr),
        ]
    return optax.chain(*parts), lr
