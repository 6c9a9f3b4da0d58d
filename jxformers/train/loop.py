"""Training and evaluation of an `Experiment`.

`train(experiment, workdir)` builds the model and the grain loaders, resumes from the
newest good checkpoint in `workdir/checkpoints` if there is one, and runs jitted train
steps (buffers donated; gradient accumulation over micro-batches with `lax.scan`),
evaluating every `eval_every` steps and checkpointing every `checkpoint.every` steps.
Each logged step is one JSON object in `workdir/metrics.jsonl` and TensorBoard scalars in
`workdir/tensorboard/`. SIGTERM or SIGINT saves a
checkpoint and exits. A non-finite loss or gradient is reported with its step and
either stops the run or skips the update (`train.on_nonfinite`).

Randomness is a function of (seed, step) alone (`fold_in`), and the data iterator's
position is part of every checkpoint, so a resumed run continues exactly where the
interrupted one would have gone: the same per-step losses, bit for bit on a CPU.
"""

from __future__ import annotations

import json
import math
import pathlib
import signal
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from tqdm import tqdm

from jxformers.data import make_loader
from jxformers.nn import build_model, redraw, trainable
from jxformers.train.checkpoint import Checkpointer
from jxformers.train.experiment import Experiment
from jxformers.train.optim import make_optimizer
from jxformers.train.tensorboard import EventWriter


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN or infinite."""


# ----------------------------------------------------------------------------- losses


def _forward(model, batch, key, inference):
    keys = None if key is None else jax.random.split(key, batch["tokens"].shape[0])  # None vmaps as an empty tree
    return jax.vmap(lambda t, m, k: model(t, m, key=k, inference=inference))(batch["tokens"], batch["mask"], keys)


def loss_and_metrics(model, batch: dict[str, jax.Array], key, *, inference: bool = False):
    """Mean cross-entropy and (loss sum, correct, count) for a classification batch
    (`label`) or a language-modelling batch (`loss_mask`)."""
    logits = _forward(model, batch, key, inference)
    if "label" in batch:
        labels, weights = batch["label"], jnp.ones(batch["label"].shape, jnp.float32)
    else:  # position i predicts token i + 1
        logits = logits[:, :-1]
        labels, weights = batch["tokens"][:, 1:], batch["loss_mask"][:, :-1].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    count = jnp.maximum(weights.sum(), 1.0)
    correct = ((jnp.argmax(logits, -1) == labels) * weights).sum()
    total = (losses * weights).sum()
    return total / count, (total, correct, weights.sum())


# ----------------------------------------------------------------------------- steps


def make_train_step(static, optimizer, *, grad_accum: int):
    """(params, opt_state, frozen, batch, key) -> (params, opt_state, metrics); the update
    is applied only when the loss and the gradients are finite."""

    def micro_grads(params, frozen, batch, key):
        def loss_fn(p):
            model = eqx.combine(p, frozen, static)
            loss, stats = loss_and_metrics(model, batch, key)
            return loss, stats

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    def step(params, opt_state, frozen, batch, key):
        if grad_accum == 1:
            (loss, stats), grads = micro_grads(params, frozen, batch, key)
        else:
            micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

            def body(acc, xs):
                b, k = xs
                (loss, stats), grads = micro_grads(params, frozen, b, k)
                return jax.tree.map(jnp.add, acc, (loss, stats, grads)), None

            zero = (jnp.zeros(()), (jnp.zeros(()), jnp.zeros(()), jnp.zeros(())), jax.tree.map(jnp.zeros_like, params))
            (loss, stats, grads), _ = jax.lax.scan(body, zero, (micro, jax.random.split(key, grad_accum)))
            loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        metrics = {"loss": loss, "accuracy": stats[1] / jnp.maximum(stats[2], 1.0), "grad_norm": grad_norm,
                   "finite": finite}
        return keep(new_params, params), keep(new_opt_state, opt_state), metrics

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(static):
    @jax.jit
    def step(params, frozen, batch):
        _, stats = loss_and_metrics(eqx.combine(params, frozen, static), batch, None, inference=True)
        return stats

    return step


def evaluate(eval_step, params, frozen, loader, batches: int, *, language_model: bool = False) -> dict[str, float]:
    """Mean loss and accuracy over `batches` batches; for language models also the loss
    in bits per predicted token (bits per dimension for pixels, per byte for text)."""
    total = correct = count = 0.0
    for _, batch in zip(range(batches), loader):
        t, c, n = (float(x) for x in eval_step(params, frozen, batch))
        total, correct, count = total + t, correct + c, count + n
    out = {"eval_loss": total / max(count, 1.0), "eval_accuracy": correct / max(count, 1.0)}
    if language_model:
        out["eval_bits_per_token"] = out["eval_loss"] / math.log(2)
    return out


# ----------------------------------------------------------------------------- state


def _split_model(model):
    """(trainable params, frozen arrays, static): frozen holds drawn arrays and keys."""
    params, rest = eqx.partition(model, trainable(model))
    frozen, static = eqx.partition(rest, eqx.is_array)
    return params, frozen, static


def _state_dict(params, frozen, opt_state, step: int, key) -> dict[str, Any]:
    """The checkpointed pytree: leaves as lists (orbax-friendly; no None leaves)."""
    frozen_leaves = [jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
                     for x in jax.tree.leaves(frozen)]
    return {
        "params": jax.tree.leaves(params), "frozen": frozen_leaves, "opt_state": jax.tree.leaves(opt_state),
        "step": np.asarray(step, np.int64), "key": np.asarray(jax.random.key_data(key)),
    }


def _from_state_dict(state, params, frozen, opt_state):
    params = jax.tree.unflatten(jax.tree.structure(params), [jnp.asarray(x) for x in state["params"]])
    old = jax.tree.leaves(frozen)
    new_frozen = [jax.random.wrap_key_data(jnp.asarray(x)) if jnp.issubdtype(o.dtype, jax.dtypes.prng_key)
                  else jnp.asarray(x) for o, x in zip(old, state["frozen"])]
    frozen = jax.tree.unflatten(jax.tree.structure(frozen), new_frozen)
    opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), [jnp.asarray(x) for x in state["opt_state"]])
    return params, frozen, opt_state, int(state["step"]), jax.random.wrap_key_data(jnp.asarray(state["key"]))


class _Signals:
    """Records SIGTERM/SIGINT so the loop can checkpoint and exit cleanly."""

    def __init__(self):
        self.received: int | None = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ----------------------------------------------------------------------------- the loop


def train(experiment: Experiment, workdir: str | pathlib.Path, *, progress: bool = True) -> dict[str, Any]:
    """Train (or resume) `experiment` in `workdir`; returns the final metrics.

    Writes `workdir/config.yaml` (the resolved config), `workdir/metrics.jsonl` and
    `workdir/checkpoints/`. Exits with an exception on a non-finite step when
    `train.on_nonfinite` is "stop" (the last good checkpoint stays).
    """
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.yaml").write_text(yaml.safe_dump(experiment.raw, sort_keys=False))
    tcfg, ccfg = experiment.train, experiment.checkpoint
    train_source, eval_source = experiment.sources()
    key = jax.random.key(tcfg["seed"])
    model = build_model(experiment.model, key=jax.random.fold_in(key, 0))
    params, frozen, static = _split_model(model)
    optimizer, schedule = _optimizer(experiment)
    opt_state = optimizer.init(params)
    loader = make_loader(train_source, batch_size=tcfg["batch_size"], seed=tcfg["seed"])
    iterator = iter(loader)
    checkpointer = Checkpointer(workdir / "checkpoints", keep=ccfg["keep"], best_metric=ccfg["best_metric"],
                                best_mode=ccfg["best_mode"], async_save=ccfg["async_save"])
    start = 0
    try:
        restored = checkpointer.restore_latest(_state_dict(params, frozen, opt_state, 0, key), iterator)
    except BaseException:
        checkpointer.close()
        raise
    if restored is not None:
        params, frozen, opt_state, start, key = _from_state_dict(restored[1], params, frozen, opt_state)
    train_step = make_train_step(static, optimizer, grad_accum=tcfg["grad_accum"])
    eval_step = make_eval_step(static)
    eval_batch = min(tcfg["batch_size"], len(eval_source))

    def run_eval():
        eval_loader = make_loader(eval_source, batch_size=eval_batch, seed=0, shuffle=False, num_epochs=1)
        return evaluate(eval_step, params, frozen, eval_loader, tcfg["eval_batches"],
                        language_model=experiment.model.task == "lm")

    metrics_file = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 - closed in finally
    events = EventWriter(workdir / "tensorboard")

    def log(record):
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        events.scalars(record["step"], {k: v for k, v in record.items() if k != "step"})

    tokens_per_batch = tcfg["batch_size"] * train_source.max_len
    last_eval: dict[str, float] = {}
    summary: dict[str, Any] = {"step": start}
    compiled, step_temp = None, None
    bar = tqdm(total=tcfg["steps"], initial=start, desc=experiment.name, disable=not progress, file=sys.stderr)
    try:
        with _Signals() as signals:
            step = start
            while step < tcfg["steps"]:
                if tcfg["redraw_every"] and step % tcfg["redraw_every"] == 0:
                    model = eqx.combine(params, frozen, static)
                    _, frozen, _ = _split_model(redraw(model, jax.random.fold_in(key, 2 * step + 1)))
                batch = next(iterator)
                step_key = jax.random.fold_in(key, 2 * step)
                if compiled is None:  # compile once, explicitly, to record the step's memory
                    compiled = train_step.lower(params, opt_state, frozen, batch, step_key).compile()
                    analysis = compiled.memory_analysis()
                    step_temp = int(analysis.temp_size_in_bytes) if analysis is not None else None
                began = time.perf_counter()
                params, opt_state, m = compiled(params, opt_state, frozen, batch, step_key)
                m = {k: float(v) for k, v in m.items()}
                elapsed = time.perf_counter() - began
                step += 1
                if not m.pop("finite"):
                    log({"step": step, "loss": m["loss"], "grad_norm": m["grad_norm"], "skipped": True})
                    if tcfg["on_nonfinite"] == "stop":
                        raise NonFiniteError(
                            f"non-finite loss or gradients at step {step} (loss {m['loss']}, gradient norm "
                            f"{m['grad_norm']}); the update was not applied. Set train.on_nonfinite=skip to "
                            f"skip such steps; the last good checkpoint is kept."
                        )
                elif step % tcfg["log_every"] == 0 or step == tcfg["steps"] or step == start + 1:
                    log({"step": step, **m, "lr": float(schedule(step - 1)), "step_ms": 1e3 * elapsed,
                         "tokens_per_s": tokens_per_batch / elapsed, "step_temp_bytes": step_temp,
                         "peak_memory_bytes": _peak_memory_bytes()})
                if step % tcfg["eval_every"] == 0 or step == tcfg["steps"]:
                    last_eval = run_eval()
                    log({"step": step, **last_eval})
                bar.update(1)
                bar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m['accuracy']:.3f}",
                                **({"eval_acc": f"{last_eval['eval_accuracy']:.3f}"} if last_eval else {}))
                summary = {"step": step, **m, **last_eval}
                if step % ccfg["every"] == 0 or step == tcfg["steps"] or signals.received is not None:
                    checkpointer.save(step, _state_dict(params, frozen, opt_state, step, key), iterator, last_eval)
                if signals.received is not None:
                    checkpointer.wait()
                    log({"step": step, "interrupted": signal.Signals(signals.received).name})
                    raise SystemExit(128 + signals.received)
        summary["peak_memory_bytes"] = _peak_memory_bytes()
        summary["train_step_temp_bytes"] = step_temp
        return summary
    finally:
        bar.close()
        checkpointer.close()
        metrics_file.close()
        events.close()


def _optimizer(experiment: Experiment):
    t = experiment.train
    return make_optimizer(
        optimizer=t["optimizer"], learning_rate=t["learning_rate"], warmup_steps=t["warmup_steps"],
        total_steps=t["steps"], schedule=t["schedule"], weight_decay=t["weight_decay"], clip_norm=t["clip_norm"],
    )


def restore_model(experiment: Experiment, workdir: str | pathlib.Path):
    """The model saved in the newest good checkpoint of `workdir` (ValueError if none)."""
    key = jax.random.key(experiment.train["seed"])
    model = build_model(experiment.model, key=jax.random.fold_in(key, 0))
    params, frozen, static = _split_model(model)
    optimizer, _ = _optimizer(experiment)
    opt_state = optimizer.init(params)
    ccfg = experiment.checkpoint
    checkpointer = Checkpointer(pathlib.Path(workdir) / "checkpoints", keep=ccfg["keep"],
                                best_metric=ccfg["best_metric"], best_mode=ccfg["best_mode"], async_save=False)
    try:
        train_source, _ = experiment.sources()
        iterator = iter(make_loader(train_source, batch_size=experiment.train["batch_size"], seed=0))
        restored = checkpointer.restore_latest(_state_dict(params, frozen, opt_state, 0, key), iterator,
                                               set_aside=False)
    finally:
        checkpointer.close()
    if restored is None:
        raise ValueError(f"no checkpoint in {workdir}/checkpoints: train first (jxformers train ...)")
    params, frozen, _, step, _ = _from_state_dict(restored[1], params, frozen, opt_state)
    return eqx.combine(params, frozen, static), step


def evaluate_checkpoint(experiment: Experiment, workdir: str | pathlib.Path, *, batches: int | None = None):
    """Eval metrics of the newest checkpoint on the eval split."""
    model, step = restore_model(experiment, workdir)
    params, frozen, static = _split_model(model)
    _, eval_source = experiment.sources()
    batch = min(experiment.train["batch_size"], len(eval_source))
    loader = make_loader(eval_source, batch_size=batch, seed=0, shuffle=False, num_epochs=1)
    n = batches if batches is not None else math.ceil(len(eval_source) / batch)
    return {"step": step, **evaluate(make_eval_step(static), params, frozen, loader, n,
                                     language_model=experiment.model.task == "lm")}
