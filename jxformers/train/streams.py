"""Training and evaluating models that carry a memory between steps (Transformer-XL,
the Compressive Transformer; `jxformers.nn.transformer_xl.RecurrentLM`).

The data is a stream source (`shakespeare_stream`): batches of `rows` records read in
order, row b of batch t + 1 continuing row b of batch t. The train state holds one
memory per batch row (`TrainState.memory`, made by `init_train_state` with the train
mem_len and saved in every checkpoint, so a resumed run carries the same memory). A
step reads each record's first max_len - 1 tokens after its row's memory, predicts the
next max_len - 1, adds the Compressive Transformer's reconstruction loss (which trains
only the compression networks), and moves the memories on (to an empty memory instead
when the step is not finite, as its states would be). Evaluation starts from an empty
memory of `eval_mem_len` slots and carries it across the evaluated batches in order.

`step.py` hands these models to `make_train_step` / `make_eval_step` here.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from jxformers.nn.transformer_xl import RecurrentLM
from jxformers.train.sharding import jit_train_step


def carries_memory(model) -> bool:
    """True for a model (or its static part) with a memory carried between segments."""
    return isinstance(model, RecurrentLM)


def init_train_memory(model, rows: int):
    """`rows` empty train memories stacked (None for a model without memory)."""
    if not carries_memory(model):
        return None
    return jax.tree.map(lambda x: jnp.repeat(x[None], rows, 0), model.init_memory())


def stream_loss(model, batch, memory, key, *, inference: bool):
    """(mean cross-entropy + mean reconstruction loss, ((loss sum, correct, count), new
    memories, reconstruction loss)) of a batch of segments after `memory`."""
    tokens = batch["tokens"]
    keys = None if key is None else jax.random.split(key, tokens.shape[0])  # None vmaps as an empty tree

    def one(t, m, k):
        return model.forward(t[:-1], m, key=k, inference=inference)

    logits, new, recon = jax.vmap(one)(tokens, memory, keys)
    labels, weights = tokens[:, 1:], batch["loss_mask"][:, :-1].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    total = (losses * weights).sum()
    correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
    recon = recon.mean()
    objective = total / jnp.maximum(weights.sum(), 1.0) + recon
    return objective, ((total, correct, weights.sum()), new, recon)


def make_train_step(static, optimizer: optax.GradientTransformation, *, grad_accum: int, sharding=None):
    """A jitted (state, batch) -> (state, metrics) with the state donated (as
    `step.make_train_step`), the memory carried in `state.memory`; metrics add
    `reconstruction_loss` for a compressive model. With `grad_accum` > 1 the rows are
    split into that many micro-batches (each with its rows' memories), accumulated with
    `lax.scan` and averaged. `sharding`: a `jxformers.train.sharding.ShardingPlan` or None."""
    compressive = static.compressive

    def micro(params, drawn, batch, memory, key):
        def loss_fn(p):
            return stream_loss(eqx.combine(p, drawn, static), batch, memory, key, inference=False)

        (loss, (stats, memory, recon)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return (loss, stats, recon, grads), memory

    def step(state, batch):
        params, key = state.params, jax.random.fold_in(state.rng, 2 * state.step)
        if grad_accum == 1:
            (loss, stats, recon, grads), memory = micro(params, state.drawn, batch, state.memory, key)
        else:
            split = lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:])  # noqa: E731

            def body(acc, xs):
                b, m, k = xs
                out, memory = micro(params, state.drawn, b, m, k)
                return jax.tree.map(jnp.add, acc, out), memory

            zero = (
                jnp.zeros(()),
                (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())),
                jnp.zeros(()),
                jax.tree.map(jnp.zeros_like, params),
            )
            xs = (jax.tree.map(split, batch), jax.tree.map(split, state.memory), jax.random.split(key, grad_accum))
            (loss, stats, recon, grads), memory = jax.lax.scan(body, zero, xs)
            memory = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), memory)  # micro-batches back to the rows
            loss, recon = loss / grad_accum, recon / grad_accum
            grads = jax.tree.map(lambda g: g / grad_accum, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        memory = keep(memory, jax.tree.map(jnp.zeros_like, state.memory))
        metrics = {
            "loss": loss,
            "accuracy": stats[1] / jnp.maximum(stats[2], 1.0),
            "grad_norm": grad_norm,
            "finite": finite,
        }
        if compressive:
            metrics["reconstruction_loss"] = recon
        new_state = eqx.tree_at(
            lambda s: (s.params, s.opt_state, s.step, s.memory),
            state,
            (keep(new_params, params), keep(new_opt_state, state.opt_state), state.step + 1, memory),
        )
        return new_state, metrics

    return jit_train_step(step, sharding)


class StreamEvalStep:
    """(state, batch) -> (loss sum, correct, count) in inference mode, carrying its own
    memory (`eval_mem_len` slots per row) from batch to batch; `reset()` empties it
    (`step.evaluate` does, before every evaluation)."""

    def __init__(self, static):
        self.static, self.memory = static, None

        @jax.jit
        def run(state, batch, memory):
            _, (stats, new, _) = stream_loss(state.model(static), batch, memory, None, inference=True)
            return stats, new

        self.run = run

    def reset(self) -> None:
        self.memory = None

    def __call__(self, state, batch):
        if self.memory is None:
            model = state.model(self.static)
            rows = batch["tokens"].shape[0]
            self.memory = jax.tree.map(lambda x: jnp.repeat(x[None], rows, 0), model.init_memory(model.eval_mem_len))
        stats, self.memory = self.run(state, batch, self.memory)
        return stats


def make_eval_step(static) -> StreamEvalStep:
    return StreamEvalStep(static)
