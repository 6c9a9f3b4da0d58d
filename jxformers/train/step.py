"""Losses and the jitted steps over a `TrainState`: one train step for every model.

    train_step = make_train_step(static, optimizer, grad_accum=2)
    state, metrics = train_step(state, batch)        # state donated; metrics are arrays
    stats = make_eval_step(static)(state, batch)     # (loss sum, correct, count, rows right, rows)

The forward is the model's `apply` on the batch's inputs (`model_inputs`: an
encoder-decoder's batch, with a `target`, is read teacher-forced), which returns what the
model made besides its logits as a value (`jxformers.nn.Produced`); the step threads each
part explicitly:

- the MoE layers' auxiliary losses are added to the objective and their load, drops and
  entropy logged (`moe{j}/...` metrics);
- named losses (the Compressive Transformer's attention reconstruction) and per-layer
  losses (adaptive span's) are added to the
  objective and logged under their names;
- the k-means inputs of Routing and Cluster-Former attention (`spec.update_arrays`)
  move those modules' drawn centroids outside the gradient (`nn.update_arrays`, not
  when the step is skipped);
- the running statistics of norms that keep them (PowerNorm) are differentiated beside
  the parameters, which gives the batch's sums, and updated from them after the step
  (`jxformers.nn.power_norm`; not when the step is skipped);
- the tallies a model keeps (`Produced.tallies`, (sum, count): the depth an adaptive model
  used) are summed over the batch and logged as sum / count; an early-exit model's exits
  (`Produced.exits`) replace the cross-entropy of its output by their weighted sum;
- a model that carries a memory between segments (Transformer-XL, the Compressive
  Transformer; `state.memory` is not None) reads each record's first max_len - 1 tokens
  after its row's memory, predicts the next max_len - 1, and leaves the new memory in
  the state (an empty one when the step is skipped, as its states would not be finite).

The train step draws its dropout key as `fold_in(state.rng, 2 * state.step)` (redraws use
the odd numbers), so randomness is a function of (seed, step) alone; micro-batches are
accumulated with `lax.scan`; the update is applied only when the loss and the gradient
norm are finite (`metrics["finite"]`), and the step counter advances either way.
Evaluation is in inference mode; a model with a memory starts each evaluation from an
empty one of `eval_mem_len` slots and carries it across the evaluated batches in order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jxformers.nn import Produced, has_statistics, statistics, update_arrays, update_statistics, updates_arrays
from jxformers.nn.layouts import BATCH_AXIS
from jxformers.nn.moe import aux_loss, layer_metrics, reduce_aux
from jxformers.train.sharding import ShardingPlan, jit_train_step
from jxformers.train.state import TrainState, carries_memory, empty_memories, split_model


class LossAux(NamedTuple):
    """What `loss_and_metrics` returns beside the objective."""

    stats: tuple  # (loss sum, correct, count) of the cross-entropy alone
    sequences: tuple  # (rows whose every counted prediction is right, rows with one counted at least)
    produced: Produced  # over the batch: MoE aux and named losses reduced, k-means inputs and memories per row


def _over_batch(produced: Produced, axis: int = 0) -> Produced:
    """`produced` stacked over examples (or micro-batches) on `axis`, its statistics
    reduced: each MoE layer's aux by `reduce_aux`, the named losses by their mean; the
    k-means inputs and the memories stay per example."""
    return Produced(
        moe=tuple(reduce_aux(a, axis) for a in produced.moe),
        attention_inputs=produced.attention_inputs,
        losses={name: v.mean(axis) for name, v in produced.losses.items()},
        layer_losses={name: v.mean(axis) for name, v in produced.layer_losses.items()},
        memory=produced.memory,
        tallies={name: v.sum(axis) for name, v in produced.tallies.items()},
        exits=produced.exits,
    )


def model_inputs(batch) -> tuple:
    """The positional arguments of `model.apply` for a batch (each with a leading batch
    axis): (tokens, mask); for a seq2seq batch (`target`, `jxformers.data.tasks`) (source,
    target[:-1], source mask, target_mask[:-1]): the decoder reads the target but its last
    token (teacher forcing); for a retrieval batch (pair records: `other`) (tokens, other,
    mask, other_mask), the dual tower's two documents."""
    if "target" in batch:
        return batch["tokens"], batch["target"][:, :-1], batch["mask"], batch["target_mask"][:, :-1]
    if "other" in batch:
        return batch["tokens"], batch["other"], batch["mask"], batch["other_mask"]
    return batch["tokens"], batch["mask"]


def _forward(model, batch, memory, key, inference) -> tuple[jax.Array, Produced]:
    """(Batched logits, what the model produced over the batch). With `memory` (one per
    row), the model reads all but each record's last token after its row's memory."""
    inputs = model_inputs(batch)
    if memory is not None:
        inputs = tuple(x[:, :-1] for x in inputs)
    keys = None if key is None else jax.random.split(key, inputs[0].shape[0])  # None vmaps as an empty tree

    def one(row, mem, k):
        carried = {} if mem is None else {"memory": mem}
        return model.apply(*row, key=k, inference=inference, **carried)

    # named, so that LayerDrop's "batch" unit can share one draw over it (jxformers.nn.layouts)
    logits, produced = jax.vmap(one, axis_name=BATCH_AXIS)(inputs, memory, keys)
    return logits, _over_batch(produced)


def loss_and_metrics(
    model, batch: dict[str, jax.Array | np.ndarray], key, *, inference: bool = False, memory: Any = None
) -> tuple[jax.Array, LossAux]:
    """Mean cross-entropy, plus the auxiliary losses the model produced (its MoE layers'
    weighted losses and its named losses, each a batch mean), and its `LossAux`, for a
    classification batch (`label`), a sequence-to-sequence batch (`target`: teacher-forced,
    the loss on each target token after the BOS where `target_mask`) or a
    language-modelling batch (`loss_mask`); with `memory` (a model carrying one), each
    row's segment is read after its memory."""
    logits, produced = _forward(model, batch, memory, key, inference)
    if "label" in batch:
        labels, weights = batch["label"], jnp.ones(batch["label"].shape, jnp.float32)
    elif "target" in batch:  # the decoder's row i read target[: i + 1] and predicts target[i + 1]
        labels, weights = batch["target"][:, 1:], batch["target_mask"][:, 1:].astype(jnp.float32)
    else:  # position i predicts token i + 1 (with a memory, the last token was not read)
        logits = logits if memory is not None else logits[:, :-1]
        labels, weights = batch["tokens"][:, 1:], batch["loss_mask"][:, :-1].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    count = jnp.maximum(weights.sum(), 1.0)
    right = jnp.argmax(logits, -1) == labels
    correct = (right * weights).sum()
    total = (losses * weights).sum()
    # a row is right when all its counted predictions are (teacher-forced: greedy decoding then
    # reproduces its target exactly, EOS included)
    row_weights = weights.reshape(weights.shape[0], -1)
    counted = row_weights.sum(1) > 0
    wrong = ((~right).reshape(row_weights.shape) * row_weights).sum(1)
    sequences = ((counted & (wrong == 0)).sum().astype(jnp.float32), counted.sum().astype(jnp.float32))
    named = (*produced.losses.values(), *produced.layer_losses.values())
    objective = total / count if produced.exits is None else _exits_loss(produced.exits, labels, weights, count)
    objective = objective + aux_loss(produced.moe) + sum(named, jnp.zeros((), jnp.float32))
    # the exits' logits [batch, exits, ...] served the objective: not kept (nor stacked by micro-batches)
    stats = (total, correct, weights.sum())
    return objective, LossAux(stats, sequences, dataclasses.replace(produced, exits=None))


def _exits_loss(exits, labels, weights, count) -> jax.Array:
    """sum_k w_k CE_k: each exit's mean cross-entropy (`exits.logits` `[batch, exits,
    *out]`, a language model's last row dropped as its output's is) weighted by the
    exits' weights (`jxformers.nn.adaptive.ExitStack`)."""
    logits = exits.logits if exits.logits.ndim == 3 else exits.logits[:, :, :-1]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels[:, None])
    per_exit = (losses * weights[:, None]).reshape(*losses.shape[:2], -1).sum((0, 2)) / count
    return (per_exit * exits.weights[0]).sum()


def make_train_step(
    static, optimizer: optax.GradientTransformation, *, grad_accum: int, sharding: ShardingPlan | None = None
):
    """A jitted (state, batch) -> (state, metrics) with the state donated; metrics: loss,
    accuracy, grad_norm, finite (the update was applied), per MoE layer its
    `layer_metrics` (means over micro-batches; counts summed), and each named loss the
    model produced (`reconstruction_loss`). With `grad_accum` > 1 the batch rows (and
    their memories) are split into that many micro-batches, accumulated with `lax.scan`
    and averaged. With a `sharding` plan (`jxformers.train.sharding`) the state comes in
    and goes out on the plan's shardings, the batch split over (data, fsdp), the metrics
    replicated."""
    updating = updates_arrays(static)
    # Norms with running statistics (PowerNorm): the loss is differentiated with respect to
    # them too, which gives the batch's sums that update them (`jxformers.nn.power_norm`).
    keeps_statistics = has_statistics(static)

    gathered = None if sharding is None else sharding.gathered(sharding.state.params)

    def micro_grads(params, drawn, batch, memory, key):
        """(loss, aux, (grads, statistics' sums)); the sums are None without statistics."""
        held, rest = eqx.partition(drawn, statistics(drawn)) if keeps_statistics else (None, drawn)

        def loss_fn(p, s):
            if gathered is not None:  # FSDP: the forward reads whole parameters (ShardingPlan.gathered)
                p = jax.lax.with_sharding_constraint(p, gathered)
            model = eqx.combine(p, rest, static) if s is None else eqx.combine(p, s, rest, static)
            return loss_and_metrics(model, batch, key, memory=memory)

        (loss, aux), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, held)
        return loss, aux, grads

    def step(state: TrainState, batch):
        params, key = state.params, jax.random.fold_in(state.rng, 2 * state.step)
        if grad_accum == 1:
            loss, (stats, _, produced), (grads, sums) = micro_grads(params, state.drawn, batch, state.memory, key)
        else:
            split = lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:])  # noqa: E731
            rows = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731 - micro-batches back to one batch

            def body(acc, xs):
                b, m, k = xs
                loss, aux, grads = micro_grads(params, state.drawn, b, m, k)
                return jax.tree.map(jnp.add, acc, (loss, aux.stats, grads)), aux.produced

            held = eqx.filter(state.drawn, statistics(state.drawn)) if keeps_statistics else None
            zero_grads = jax.tree.map(jnp.zeros_like, (params, held))
            zero = (jnp.zeros(()), (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())), zero_grads)
            xs = (jax.tree.map(split, batch), jax.tree.map(split, state.memory), jax.random.split(key, grad_accum))
            (loss, stats, (grads, sums)), produced = jax.lax.scan(body, zero, xs)
            produced = _over_batch(produced)
            produced = Produced(
                moe=produced.moe,
                attention_inputs=jax.tree.map(rows, produced.attention_inputs),
                losses=produced.losses,
                layer_losses=produced.layer_losses,
                memory=jax.tree.map(rows, produced.memory),
                tallies=produced.tallies,
            )
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
            **layer_metrics(produced.moe),
            **produced.losses,
            **produced.layer_losses,
            **{name: _mean(v) for name, v in produced.tallies.items()},
        }
        drawn = state.drawn
        if updating:  # state moved outside the gradient (k-means centroids)
            _, drawn, _ = split_model(update_arrays(eqx.combine(params, drawn, static), produced.attention_inputs))
            drawn = keep(drawn, state.drawn)
        if keeps_statistics:  # the norms' running statistics, from the batch's sums (sums over micro-batches)
            _, updated, _ = split_model(update_statistics(eqx.combine(params, drawn, static), sums))
            drawn = keep(updated, drawn)
        memory = state.memory
        if memory is not None:  # a skipped step's states are not finite: start its rows afresh
            memory = keep(produced.memory, jax.tree.map(jnp.zeros_like, memory))
        new_state = TrainState(
            params=keep(new_params, params),
            drawn=drawn,
            opt_state=keep(new_opt_state, state.opt_state),
            step=state.step + 1,
            rng=state.rng,
            memory=memory,
        )
        return new_state, metrics

    return jit_train_step(step, sharding)


def _mean(tally: jax.Array) -> jax.Array:
    """A tally's sum / count (over micro-batches too: `[..., 2]`)."""
    summed = tally.reshape(-1, 2).sum(0)
    return summed[0] / jnp.maximum(summed[1], 1.0)


class EvalStep:
    """(state, batch) -> (loss sum, correct, count, rows right, rows) in inference mode (on a sharded state
    and batch, it runs where they are). A model carrying a memory starts from an empty
    one of `eval_mem_len` slots per row and carries it from batch to batch; `reset()`
    empties it (`evaluate` does, before every evaluation). The model's tallies (the depth
    an adaptive model used) add up in `tallies` ({name: (sum, count)}) until `reset()`."""

    def __init__(self, static):
        self.static, self.memory, self.tallies = static, None, {}
        self.carries = carries_memory(static)

        @jax.jit
        def run(state, batch, memory):
            _, aux = loss_and_metrics(state.model(static), batch, None, inference=True, memory=memory)
            return (*aux.stats, *aux.sequences), aux.produced.memory, aux.produced.tallies

        self.run = run

    def reset(self) -> None:
        self.memory, self.tallies = None, {}

    def __call__(self, state, batch):
        if self.carries and self.memory is None:
            model = state.model(self.static)
            self.memory = empty_memories(model, batch["tokens"].shape[0], model.eval_mem_len)
        stats, memory, tallies = self.run(state, batch, self.memory)
        for name, value in tallies.items():
            self.tallies[name] = self.tallies.get(name, 0.0) + np.asarray(value, np.float64)
        if self.carries:
            self.memory = memory
        return stats


def make_eval_step(static) -> EvalStep:
    """The `EvalStep` of a model (its static part)."""
    return EvalStep(static)


def evaluate(
    eval_step, state: TrainState, loader, batches: int, *, language_model: bool = False, sequences: bool = False
) -> dict[str, float]:
    """Mean loss and accuracy over `batches` batches; for language models also the loss
    in bits per predicted token (bits per dimension for pixels, per byte for text); with
    `sequences` (task seq2seq) `eval_sequence_accuracy`, the share of rows whose every
    target token (EOS included) is predicted right, teacher-forced, which is the share
    greedy decoding reproduces exactly; and each tally the model keeps, as
    `eval_<name>` (`EvalStep.tallies`)."""
    sums = np.zeros(5)  # loss sum, correct, count, rows right, rows
    if hasattr(eval_step, "reset"):  # a step carrying memory starts each evaluation empty
        eval_step.reset()
    for _, batch in zip(range(batches), loader, strict=False):
        sums += [float(x) for x in eval_step(state, batch)]
    total, correct, count, rows_right, rows = sums.tolist()
    out = {"eval_loss": total / max(count, 1.0), "eval_accuracy": correct / max(count, 1.0)}
    if sequences:
        out["eval_sequence_accuracy"] = rows_right / max(rows, 1.0)
    for name, (summed, n) in getattr(eval_step, "tallies", {}).items():  # the depth an adaptive model used
        out[f"eval_{name}"] = float(summed) / max(float(n), 1.0)
    if language_model:
        out["eval_bits_per_token"] = out["eval_loss"] / math.log(2)
    return out
