"""One model config trained on one device and on the simulated 2x2x2 mesh (data, fsdp,
tensor) with the library's train step, for the multidevice tests: each runs a script in
a fresh process with 8 host devices (`test_sharding.PRELUDE`, `run_script`) that imports
this module and compares the two runs.

    runs = train_both(config, lm_batch())
    same_losses(runs)  # and whatever else the test compares: runs[sharded].state, .metrics
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jxformers import build_model
from jxformers.train.sharding import make_mesh, plan_sharding
from jxformers.train.state import TrainState, empty_memories, split_model
from jxformers.train.step import make_train_step

MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def lm_batch(rows: int = 8, length: int = 16, vocab: int = 31, shortest: int = 8, seed: int = 0) -> dict:
    """A language-model batch of `rows` random sequences, each padded after a length
    drawn in [shortest, length]."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, length)).astype(np.int32)
    mask = np.arange(length)[None, :] < rng.integers(shortest, length + 1, (rows, 1))
    return {"tokens": tokens, "mask": mask, "loss_mask": mask}


@dataclasses.dataclass
class Run:
    """A run's final train state (its arrays gathered to the host where sharded) and
    each step's metrics as floats."""

    state: TrainState
    metrics: list[dict[str, float]]

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def train_both(config: dict | Any, batch: dict, *, steps: int = 3, learning_rate: float = 3e-3) -> dict[bool, Run]:
    """{False: the one-device run, True: the 2x2x2 mesh's} of `steps` AdamW steps on
    `batch` from the same initial model (key 0) and train key (1); a model with a memory
    (Transformer-XL and kin) starts from empty ones and carries them from step to step."""
    optimizer = optax.adamw(learning_rate)
    rows, runs = len(batch["tokens"]), {}
    for sharded in (False, True):
        model = build_model(config, key=jax.random.key(0))
        params, drawn, static = split_model(model)
        state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1),
                           memory=empty_memories(model, rows))  # fmt: skip
        plan = plan_sharding(state, static, make_mesh(MESH), batch_size=rows) if sharded else None
        if plan is not None:
            state = plan.place_state(state)
        step = make_train_step(static, optimizer, grad_accum=1, sharding=plan)
        metrics = []
        for _ in range(steps):
            state, m = step(state, batch if plan is None else plan.place_batch(batch))
            metrics.append({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
        runs[sharded] = Run(jax.device_get(state), metrics)
    return runs


def same_losses(runs: dict[bool, Run], *, rtol: float = 1e-5, learns: bool = True) -> None:
    """The mesh's losses are the one device's and, with `learns`, the last is below the
    first (off where random layer drops make the steps' losses incomparable)."""
    np.testing.assert_allclose(runs[True].losses, runs[False].losses, rtol=rtol)
    assert not learns or runs[True].losses[-1] < runs[True].losses[0], runs[True].losses


def same_leaves(a: Any, b: Any, *, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Two pytrees of arrays (the two runs' parameters, statistics...) agree leaf by leaf."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
