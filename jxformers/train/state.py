"""The training state and its one constructor.

    state, static, optimizer, schedule = init_train_state(experiment)
    model = state.model(static)                  # eqx.combine(params, drawn, static)

`TrainState` is the pytree a train step carries: the trainable `params`, the `drawn`
arrays (attention's drawn features / random blocks / rotations and PRNG keys inside the
model: non-trainable, replaced by `redraw`; and norms' running statistics, which the
train step updates), the optimizer state, the step (an int32
array), the run's PRNG key, and, for a model with a memory carried from step to step
(Transformer-XL, the Compressive Transformer, ERNIE-Doc, Memformer), that `memory` (one per batch row, which
the train step threads; None otherwise). The static rest of the model (activation functions,
shapes, bound attentions) is kept outside, as `static`.

For checkpoints, `state_dict(state)` flattens the state to one dict keyed by each leaf's
tree path (`jax.tree_util.keystr`, e.g. "['params'].blocks[0].attention.q_proj.weight";
PRNG keys as their key data), and `load_state_dict(values, template)` puts each value
back at its own path: reordering fields in a module never moves a weight to another.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from jxformers.nn import MemformerLM, RecurrentLM, build_model, trainable
from jxformers.train.optim import make_optimizer


class TrainState(eqx.Module):
    """Everything a train step reads and updates (see the module docstring)."""

    params: PyTree
    drawn: PyTree
    opt_state: PyTree
    step: Int[Array, ""]
    rng: PRNGKeyArray
    memory: PyTree = None

    def model(self, static: PyTree) -> Any:
        """The model these parameters and drawn arrays belong to."""
        return eqx.combine(self.params, self.drawn, static)


def carries_memory(model) -> bool:
    """True for a model (or its static part) with a memory carried between segments."""
    return isinstance(model, (RecurrentLM, MemformerLM))


def empty_memories(model, rows: int, mem_len: int | None = None) -> PyTree:
    """`rows` empty memories of `mem_len` slots (default: the model's train mem_len)
    stacked, one per batch row; None for a model without memory."""
    if not carries_memory(model):
        return None
    return jax.tree.map(lambda x: jnp.repeat(x[None], rows, 0), model.init_memory(mem_len))


def split_model(model) -> tuple[PyTree, PyTree, PyTree]:
    """(trainable params, drawn arrays and keys, static rest) of a model."""
    params, rest = eqx.partition(model, trainable(model))
    drawn, static = eqx.partition(rest, eqx.is_array)
    return params, drawn, static


def make_experiment_optimizer(experiment) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and learning-rate schedule of `experiment.train`."""
    t = experiment.train
    return make_optimizer(
        optimizer=t.optimizer,
        learning_rate=t.learning_rate,
        warmup_steps=t.warmup_steps,
        total_steps=t.steps,
        schedule=t.schedule,
        weight_decay=t.weight_decay,
        clip_norm=t.clip_norm,
        b1=t.adam_b1,
        b2=t.adam_b2,
        eps=t.adam_eps,
    )


def init_train_state(experiment) -> tuple[TrainState, PyTree, optax.GradientTransformation, optax.Schedule]:
    """(state at step 0, static part of the model, optimizer, schedule) of `experiment`:
    the model is built from `fold_in(key(train.seed), 0)`, the run's key is `key(train.seed)`.
    The one place a training state is made: train, evaluation and restore all start here."""
    rng = jax.random.key(experiment.train.seed)
    model = build_model(experiment.model, key=jax.random.fold_in(rng, 0))
    params, drawn, static = split_model(model)
    optimizer, schedule = make_experiment_optimizer(experiment)
    state = TrainState(
        params=params,
        drawn=drawn,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=rng,
        memory=empty_memories(model, experiment.train.batch_size),
    )
    return state, static, optimizer, schedule


# ----------------------------------------------------------------------------- checkpoint layout


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _tree(state: TrainState) -> dict[str, Any]:
    return {
        "params": state.params,
        "drawn": state.drawn,
        "opt_state": state.opt_state,
        "step": state.step,
        "rng": state.rng,
        "memory": state.memory,
    }


STEP_KEY = jax.tree_util.keystr((jax.tree_util.DictKey("step"),))  # the step's entry in a state_dict


def state_dict(state: TrainState) -> dict[str, Any]:
    """The checkpointed form of `state`: {tree path: array}, PRNG keys as key data."""
    out = {}
    for group, tree in _tree(state).items():  # params first (jax would sort the groups' names)
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            out[jax.tree_util.keystr((jax.tree_util.DictKey(group), *path))] = (
                jax.random.key_data(x) if _is_key(x) else x
            )
    return out


def load_state_dict(values: dict[str, Any], template: TrainState) -> TrainState:
    """`template` with each leaf replaced by `values[its tree path]` (key data re-wrapped as
    PRNG keys). A ValueError names the first path `values` lacks or a shape mismatch."""

    def put(path, old):
        name = jax.tree_util.keystr(path)
        if name not in values:
            raise ValueError(f"the checkpoint has no {name}")
        new = jnp.asarray(values[name])
        if _is_key(old):
            new = jax.random.wrap_key_data(new, impl=jax.random.key_impl(old))
        if new.shape != old.shape:
            raise ValueError(f"{name} has shape {tuple(new.shape)}; the model expects {tuple(old.shape)}")
        return new.astype(old.dtype) if not _is_key(old) and new.dtype != old.dtype else new

    tree = jax.tree_util.tree_map_with_path(put, _tree(template))
    return TrainState(
        params=tree["params"],
        drawn=tree["drawn"],
        opt_state=tree["opt_state"],
        step=jnp.asarray(np.asarray(tree["step"]), jnp.int32),
        rng=tree["rng"],
        memory=tree["memory"],
    )
