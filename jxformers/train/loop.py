"""Training and evaluation of an `Experiment`.

`train(experiment, workdir)` builds the state (`init_train_state`) and the grain loader,
resumes from the newest good checkpoint in `workdir/checkpoints` if there is one, and
runs the jitted train step (`step.py`; state donated, gradient accumulation with
`lax.scan`). Around the step, small hooks: redraw the drawn arrays every `redraw_every`
steps, log (each logged step is one JSON object in `workdir/metrics.jsonl` and
TensorBoard scalars in `workdir/tensorboard/`), evaluate every `eval_every` steps,
checkpoint every `checkpoint.every` steps, and on SIGTERM or SIGINT save a checkpoint
and exit. A non-finite loss or gradient is reported with its step and either stops the
run or skips the update (`train.on_nonfinite`).

Randomness is a function of (seed, step) alone (`fold_in`), and the data iterator's
position is part of every checkpoint, so a resumed run continues exactly where the
interrupted one would have gone: the same per-step losses, bit for bit on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import signal
import sys
import time
from typing import Any

import jax
import yaml
from tqdm import tqdm

from jxformers.data import make_loader
from jxformers.nn import redraw
from jxformers.tools.xla_cost import cost_of
from jxformers.train.checkpoint import Checkpointer
from jxformers.train.experiment import Experiment
from jxformers.train.state import TrainState, init_train_state, load_state_dict, split_model, state_dict
from jxformers.train.step import evaluate, make_eval_step, make_train_step
from jxformers.train.tensorboard import EventWriter


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN or infinite."""


# ----------------------------------------------------------------------------- checkpoints


def _open_checkpointer(experiment: Experiment, workdir: pathlib.Path, *, async_save: bool) -> Checkpointer:
    c = experiment.checkpoint
    return Checkpointer(workdir / "checkpoints", keep=c.keep, best_metric=c.best_metric, best_mode=c.best_mode,
                        async_save=async_save)


def _restore(checkpointer: Checkpointer, template: TrainState, iterator, *, set_aside: bool
             ) -> TrainState | None:
    """The newest good checkpoint's state (the iterator moved to its position), or None."""
    restored = checkpointer.restore_latest(state_dict(template), iterator, set_aside=set_aside)
    return None if restored is None else load_state_dict(restored[1], template)


def restore_train_state(experiment: Experiment, workdir: str | pathlib.Path) -> tuple[TrainState, Any]:
    """(state, static) of the newest good checkpoint in `workdir` (ValueError if none)."""
    state, static, _, _ = init_train_state(experiment)
    train_source, _ = experiment.sources()
    iterator = iter(make_loader(train_source, batch_size=experiment.train.batch_size, seed=0))
    with contextlib.closing(_open_checkpointer(experiment, pathlib.Path(workdir), async_save=False)) as checkpointer:
        restored = _restore(checkpointer, state, iterator, set_aside=False)
    if restored is None:
        raise ValueError(f"no checkpoint in {workdir}/checkpoints: train first (jxformers train ...)")
    return restored, static


def restore_model(experiment: Experiment, workdir: str | pathlib.Path):
    """(model, step) saved in the newest good checkpoint of `workdir` (ValueError if none)."""
    state, static = restore_train_state(experiment, workdir)
    return state.model(static), int(state.step)


def evaluate_checkpoint(experiment: Experiment, workdir: str | pathlib.Path, *, batches: int | None = None):
    """Eval metrics of the newest checkpoint on the eval split."""
    state, static = restore_train_state(experiment, workdir)
    _, eval_source = experiment.sources()
    batch = min(experiment.train.batch_size, len(eval_source))
    loader = make_loader(eval_source, batch_size=batch, seed=0, shuffle=False, num_epochs=1)
    n = batches if batches is not None else math.ceil(len(eval_source) / batch)
    return {"step": int(state.step), **evaluate(make_eval_step(static), state, loader, n,
                                                language_model=experiment.model.task == "lm")}


# ----------------------------------------------------------------------------- hooks


def _due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last


def _peak_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _redraw_if_due(state: TrainState, static, every: int) -> TrainState:
    """New drawn arrays from fold_in(rng, 2 * step + 1) every `every` steps (0: never)."""
    step = int(state.step)
    if not every or step % every:
        return state
    _, drawn, _ = split_model(redraw(state.model(static), jax.random.fold_in(state.rng, 2 * step + 1)))
    return dataclasses.replace(state, drawn=drawn)


class _CompiledStep:
    """The train step, compiled once explicitly (to record its temporary memory) and timed."""

    def __init__(self, jitted):
        self.jitted, self.compiled, self.temp_bytes = jitted, None, None

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float], float]:
        if self.compiled is None:
            self.compiled = self.jitted.lower(state, batch).compile()
            self.temp_bytes = cost_of(self.compiled).temp_bytes
        began = time.perf_counter()
        state, metrics = self.compiled(state, batch)
        metrics = {k: float(v) for k, v in metrics.items()}
        return state, metrics, time.perf_counter() - began


class _MetricsLog:
    """One JSON line per record in metrics.jsonl, mirrored as TensorBoard scalars."""

    def __init__(self, workdir: pathlib.Path):
        self.file = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 - closed by close()
        self.events = EventWriter(workdir / "tensorboard")

    def __call__(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.events.scalars(record["step"], {k: v for k, v in record.items() if k != "step"})

    def close(self) -> None:
        self.file.close()
        self.events.close()


@dataclasses.dataclass
class _StepReport:
    """Logs a step's metrics (every `log_every`, the first and the last step) or, for a
    non-finite step, logs it as skipped and stops the run when `on_nonfinite` is stop."""

    log: _MetricsLog
    experiment: Experiment
    schedule: Any
    start: int
    tokens_per_batch: int
    step_temp_bytes: Any = None

    def __call__(self, step: int, m: dict[str, float], elapsed: float) -> None:
        t = self.experiment.train
        if not m.pop("finite"):
            self.log({"step": step, "loss": m["loss"], "grad_norm": m["grad_norm"], "skipped": True})
            if t.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite loss or gradients at step {step} (loss {m['loss']}, gradient norm "
                    f"{m['grad_norm']}); the update was not applied. Set train.on_nonfinite=skip to "
                    f"skip such steps; the last good checkpoint is kept."
                )
        elif _due(step, t.log_every, t.steps) or step == self.start + 1:
            self.log({"step": step, **m, "lr": float(self.schedule(step - 1)), "step_ms": 1e3 * elapsed,
                      "tokens_per_s": self.tokens_per_batch / elapsed, "step_temp_bytes": self.step_temp_bytes,
                      "peak_memory_bytes": _peak_memory_bytes()})


class _Evaluator:
    """Eval metrics of a state on the first `eval_batches` batches of the eval split."""

    def __init__(self, experiment: Experiment, static, eval_source):
        self.source, self.step = eval_source, make_eval_step(static)
        self.batch = min(experiment.train.batch_size, len(eval_source))
        self.batches, self.lm = experiment.train.eval_batches, experiment.model.task == "lm"

    def __call__(self, state: TrainState) -> dict[str, float]:
        loader = make_loader(self.source, batch_size=self.batch, seed=0, shuffle=False, num_epochs=1)
        return evaluate(self.step, state, loader, self.batches, language_model=self.lm)


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

    def exit_if_received(self, checkpointer: Checkpointer, log: _MetricsLog, step: int) -> None:
        """After the checkpoint of this step was started: wait for it, log, exit 128 + signal."""
        if self.received is not None:
            checkpointer.wait()
            log({"step": step, "interrupted": signal.Signals(self.received).name})
            raise SystemExit(128 + self.received)


def _progress_bar(experiment: Experiment, start: int, progress: bool):
    bar = tqdm(total=experiment.train.steps, initial=start, desc=experiment.name, disable=not progress,
               file=sys.stderr)

    def show(m: dict[str, float], last_eval: dict[str, float]) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{m['loss']:.4f}", acc=f"{m['accuracy']:.3f}",
                        **({"eval_acc": f"{last_eval['eval_accuracy']:.3f}"} if last_eval else {}))

    return bar, show


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
    t, every = experiment.train, experiment.checkpoint.every
    state, static, optimizer, schedule = init_train_state(experiment)
    train_source, eval_source = experiment.sources()
    iterator = iter(make_loader(train_source, batch_size=t.batch_size, seed=t.seed))
    with contextlib.ExitStack() as stack:
        checkpointer = stack.enter_context(contextlib.closing(
            _open_checkpointer(experiment, workdir, async_save=experiment.checkpoint.async_save)))
        state = _restore(checkpointer, state, iterator, set_aside=True) or state
        start = int(state.step)
        run_step = _CompiledStep(make_train_step(static, optimizer, grad_accum=t.grad_accum))
        run_eval = _Evaluator(experiment, static, eval_source)
        log = stack.enter_context(contextlib.closing(_MetricsLog(workdir)))
        report = _StepReport(log, experiment, schedule, start, t.batch_size * train_source.max_len)
        bar, show = _progress_bar(experiment, start, progress)
        stack.enter_context(contextlib.closing(bar))
        signals = stack.enter_context(_Signals())
        summary, last_eval = {"step": start}, {}
        while int(state.step) < t.steps:
            state = _redraw_if_due(state, static, t.redraw_every)
            state, m, elapsed = run_step(state, next(iterator))
            step, report.step_temp_bytes = int(state.step), run_step.temp_bytes
            report(step, m, elapsed)
            if _due(step, t.eval_every, t.steps):
                last_eval = run_eval(state)
                log({"step": step, **last_eval})
            show(m, last_eval)
            summary = {"step": step, **m, **last_eval}
            if _due(step, every, t.steps) or signals.received is not None:
                checkpointer.save(step, state_dict(state), iterator, last_eval)
            signals.exit_if_received(checkpointer, log, step)
        return summary | {"peak_memory_bytes": _peak_memory_bytes(), "train_step_temp_bytes": run_step.temp_bytes}
