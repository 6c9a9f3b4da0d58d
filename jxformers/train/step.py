"""Losses and the jitted steps over a `TrainState`.

    train_step = make_train_step(static, optimizer, grad_accum=2)
    state, metrics = train_step(state, batch)        # state donated; metrics are arrays
    stats = make_eval_step(static)(state, batch)     # (loss sum, correct, count)

The train step draws its dropout key as `fold_in(state.rng, 2 * state.step)` (redraws use
the odd numbers), so randomness is a function of (seed, step) alone; micro-batches are
accumulated with `lax.scan`; the update is applied only when the loss and the gradient
norm are finite (`metrics["finite"]`), and the step counter advances either way.

State updated outside the gradient (the k-means centroids of Routing and Cluster-Former
attention, `spec.update_arrays`) is updated by the same step: the forward records those
attention modules' inputs (`nn.record_attention_inputs`) and the step replaces their
drawn arrays with `nn.update_arrays` of the batch (not when the step is skipped).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from jxformers.nn import record_attention_inputs, update_arrays, updates_arrays
from jxformers.nn.moe import aux_loss, has_moe, layer_metrics, reduce_aux
from jxformers.train import streams
from jxformers.train.sharding import ShardingPlan, jit_train_step
from jxformers.train.state import TrainState, split_model


class LossAux(NamedTuple):
    """What `loss_and_metrics` returns beside the objective."""

    stats: tuple  # (loss sum, correct, count) of the cross-entropy alone
    records: list  # recorded inputs of the attention modules that update arrays (with `owners`)
    moe: list  # per MoE layer in call order, its aux dict reduced over the batch (`reduce_aux`)


def _forward(model, batch, key, inference, owners=None):
    """(batched logits, the MoE layers' aux dicts reduced over the batch ([] when the
    model has none), recorded attention inputs). With `owners` (a list), the inputs of
    the attention modules that update arrays are recorded (their indices appended to
    `owners`); otherwise the records are []."""
    keys = None if key is None else jax.random.split(key, batch["tokens"].shape[0])  # None vmaps as an empty tree
    moe = has_moe(model)
    if owners is None and not moe:
        return (
            jax.vmap(lambda t, m, k: model(t, m, key=k, inference=inference))(batch["tokens"], batch["mask"], keys),
            [],
            [],
        )

    def one(t, m, k):
        sink: list = []  # the MoE layers' aux dicts, collected within this trace
        extra = {"aux": sink} if moe else {}
        if owners is None:
            return model(t, m, key=k, inference=inference, **extra), sink, []
        with record_attention_inputs(model) as recorder:
            out = model(t, m, key=k, inference=inference, **extra)
        owners[:] = recorder.owners  # traced once: the same modules for every example
        return out, sink, recorder.values

    out, layers, records = jax.vmap(one)(batch["tokens"], batch["mask"], keys)
    return out, [reduce_aux(a) for a in layers], records


def loss_and_metrics(
    model, batch: dict[str, jax.Array], key, *, inference: bool = False, owners=None
) -> tuple[jax.Array, LossAux]:
    """Mean cross-entropy (plus the MoE layers' weighted auxiliary losses, averaged over
    the batch, when the model has any) and its `LossAux`, for a classification batch
    (`label`) or a language-modelling batch (`loss_mask`). With `owners` (a list to
    fill), the attention inputs are recorded (see `_forward`)."""
    logits, layers, records = _forward(model, batch, key, inference, owners)
    if "label" in batch:
        labels, weights = batch["label"], jnp.ones(batch["label"].shape, jnp.float32)
    else:  # position i predicts token i + 1
        logits = logits[:, :-1]
        labels, weights = batch["tokens"][:, 1:], batch["loss_mask"][:, :-1].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    count = jnp.maximum(weights.sum(), 1.0)
    correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
    total = (losses * weights).sum()
    objective = total / count + aux_loss(layers)  # the layers' losses are already batch means
    return objective, LossAux((total, correct, weights.sum()), records, layers)


def make_train_step(
    static, optimizer: optax.GradientTransformation, *, grad_accum: int, sharding: ShardingPlan | None = None
):
    """A jitted (state, batch) -> (state, metrics) with the state donated; metrics: loss,
    accuracy, grad_norm, finite (the update was applied), and per MoE layer its
    `layer_metrics` (means over micro-batches; counts summed). With a `sharding` plan
    (`jxformers.train.sharding`) the state comes in and goes out on the plan's
    shardings, the batch split over (data, fsdp), the metrics replicated."""
    if streams.carries_memory(static):  # memory carried between steps: its own step
        return streams.make_train_step(static, optimizer, grad_accum=grad_accum, sharding=sharding)

    updating = updates_arrays(static)
    owners: list[int] = []

    def micro_grads(params, drawn, batch, key):
        def loss_fn(p):
            return loss_and_metrics(eqx.combine(p, drawn, static), batch, key, owners=owners if updating else None)

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, aux, grads

    def step(state: TrainState, batch):
        params, key = state.params, jax.random.fold_in(state.rng, 2 * state.step)
        if grad_accum == 1:
            loss, aux, grads = micro_grads(params, state.drawn, batch, key)
            stats, records, layers = aux
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

            def body(acc, xs):
                b, k = xs
                loss, aux, grads = micro_grads(params, state.drawn, b, k)
                return jax.tree.map(jnp.add, acc, (loss, aux.stats, grads)), (aux.records, aux.moe)

            zero = (jnp.zeros(()), (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())), jax.tree.map(jnp.zeros_like, params))
            (loss, stats, grads), (records, layers) = jax.lax.scan(
                body, zero, (micro, jax.random.split(key, grad_accum))
            )
            records = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), records)  # micro-batches back to one batch
            layers = [reduce_aux(a) for a in layers]
            loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        metrics = {
            "loss": loss,
            "accuracy": stats[1] / jnp.maximum(stats[2], 1.0),
            "grad_norm": grad_norm,
            "finite": finite,
            **layer_metrics(layers),
        }
        drawn = state.drawn
        if updating:  # state moved outside the gradient (k-means centroids)
            _, drawn, _ = split_model(update_arrays(eqx.combine(params, drawn, static), owners, records))
            drawn = keep(drawn, state.drawn)
        new_state = TrainState(
            params=keep(new_params, params),
            drawn=drawn,
            opt_state=keep(new_opt_state, state.opt_state),
            step=state.step + 1,
            rng=state.rng,
        )
        return new_state, metrics

    return jit_train_step(step, sharding)


def make_eval_step(static):
    """A jitted (state, batch) -> (loss sum, correct, count) in inference mode (on a
    sharded state and batch, it runs where they are)."""
    if streams.carries_memory(static):  # carries its memory across the evaluated batches
        return streams.make_eval_step(static)

    @jax.jit
    def step(state: TrainState, batch):
        _, aux = loss_and_metrics(state.model(static), batch, None, inference=True)
        return aux.stats

    return step


def evaluate(eval_step, state: TrainState, loader, batches: int, *, language_model: bool = False) -> dict[str, float]:
    """Mean loss and accuracy over `batches` batches; for language models also the loss
    in bits per predicted token (bits per dimension for pixels, per byte for text)."""
    total = correct = count = 0.0
    if hasattr(eval_step, "reset"):  # a step carrying memory starts each evaluation empty
        eval_step.reset()
    for _, batch in zip(range(batches), loader, strict=False):
        t, c, n = (float(x) for x in eval_step(state, batch))
        total, correct, count = total + t, correct + c, count + n
    out = {"eval_loss": total / max(count, 1.0), "eval_accuracy": correct / max(count, 1.0)}
    if language_model:
        out["eval_bits_per_token"] = out["eval_loss"] / math.log(2)
    return out
