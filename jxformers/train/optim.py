"""The optimizer: optax AdamW or RAdam, linear warmup then cosine or inverse-sqrt decay,
global-norm clipping, and weight decay on weight matrices only (norm scales, biases and
other vectors are not decayed)."""

from __future__ import annotations

import jax
import optax

OPTIMIZERS = ("adamw", "radam")
SCHEDULES = ("cosine", "inverse_sqrt", "constant")


def learning_rate_schedule(*, peak: float, warmup_steps: int, total_steps: int, kind: str) -> optax.Schedule:
    """Linear warmup from 0 to `peak` over `warmup_steps`, then cosine decay to 0 at
    `total_steps`, inverse-sqrt decay (peak * sqrt(warmup / step)), or constant."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}; got {kind!r}")
    warmup = max(warmup_steps, 0)
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
    warmup_steps: int = 0,
    total_steps: int = 1,
    schedule: str = "cosine",
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.999,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its learning-rate schedule (for logging)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {optimizer!r}")
    lr = learning_rate_schedule(peak=learning_rate, warmup_steps=warmup_steps, total_steps=total_steps, kind=schedule)
    parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    if optimizer == "adamw":
        parts.append(optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))
    else:
        parts += [  # RAdam with decoupled weight decay, as AdamW decouples it from Adam
            optax.scale_by_radam(b1=b1, b2=b2),
            optax.add_decayed_weights(weight_decay, mask=decay_mask),
            optax.scale_by_learning_rate(lr),
        ]
    return optax.chain(*parts), lr
