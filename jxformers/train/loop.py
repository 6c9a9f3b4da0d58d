"""Training and evaluation of an `Experiment`.

`train(experiment, workdir)` locks the work directory and checks a rerun against its
saved config (`workdir.py`), builds the state (`init_train_state`) and the grain loader,
resumes from the newest good checkpoint in `workdir/checkpoints` if there is one, and
runs the jitted train step (`step.py`; state donated, gradient accumulation with
`lax.scan`). A fresh run of a model with Admin's norm placement first profiles its first
batch (`jxformers.nn.residual.admin_profile`; the authors profile their first training
batch) and then trains on it. Around the step, small hooks: redraw the drawn features every `redraw_every`
steps (default 1000; see `TrainConfig`), log (each logged step is one JSON object in `workdir/metrics.jsonl`, with
non-finite numbers as the strings "NaN" / "Infinity" that float() reads, and TensorBoard
scalars in `workdir/tensorboard/`; tokens_per_s counts real tokens, padded_tokens_per_s
all), evaluate every `eval_every` steps, checkpoint every `checkpoint.every` steps (logging
`checkpoint_save_ms`, the time the step path waited for the save; `compile_seconds`,
`parameters` and XLA's `train_step_flops` at the first step; `resumed_from_step` first when
resuming), and
on SIGTERM or SIGINT save a checkpoint and exit (with several processes, all after
the same step: JAX's preemption sync point). A non-finite loss or gradient is
reported with its step and either stops the run or skips the update (`train.on_nonfinite`).

On several devices the state and each batch are sharded over the experiment's device
mesh (`mesh` section; `sharding.py`, `sharding_plan`): the state is placed before a
checkpoint is restored, so a run resumes onto whatever mesh it now has; on one device
nothing is sharded.

Randomness is a function of (seed, step) alone (`fold_in`), and the data iterator's
position is part of every checkpoint, so a resumed run continues exactly where the
interrupted one would have gone: the same per-step losses, bit for bit on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from typing import Any

import jax
from tqdm import tqdm

from jxformers._terminal import stderr_is_terminal
from jxformers.data import make_loader
from jxformers.data.baselines import SCORED_TASKS, baselines
from jxformers.nn import redraw, residual
from jxformers.train import distributed
from jxformers.train.batch_wait import BatchFetcher, Position
from jxformers.train.checkpoint import Checkpointer, CheckpointMismatch, compare_trees
from jxformers.train.experiment import Experiment
from jxformers.train.sharding import ShardingPlan, make_mesh, plan_sharding
from jxformers.train.state import TrainState, init_train_state, load_state_dict, split_model, state_dict
from jxformers.train.step import evaluate, make_eval_step, make_train_step, model_inputs
from jxformers.train.tensorboard import EventWriter
from jxformers.train.workdir import (
    CHECKPOINTS,
    TENSORBOARD,
    check_history,
    check_rerun,
    check_workdir,
    check_writable,
    has_checkpoints,
    open_metrics_log,
    read_metrics_log,
    read_run_identity,
    run_identity,
    set_history_aside,
    workdir_lock,
    write_config,
    write_line,
)
from jxformers.xla_cost import cost_of


class NonFiniteError(RuntimeError):
    """The loss or the gradients became NaN or infinite."""


# ----------------------------------------------------------------------------- checkpoints


def _open_checkpointer(
    experiment: Experiment, workdir: pathlib.Path, *, async_save: bool, run: str | None = None, training: bool = False
) -> Checkpointer:
    c = experiment.checkpoint
    return Checkpointer(
        workdir / CHECKPOINTS,
        keep=c.keep,
        best_metric=c.best_metric,
        best_mode=c.best_mode,
        async_save=async_save,
        config=experiment.raw,
        tidy=training,
        run=run,
        # a resume checks the restored position against the steps taken
        records_per_step=_per_process(experiment.train.batch_size, "train.batch_size") if training else None,
    )


def _restore(
    checkpointer: Checkpointer, template: TrainState, iterator, *, training: bool, best: bool = False
) -> TrainState | None:
    """The newest good (or the `best`) checkpoint's state, the iterator moved to its
    position; None when there is none."""
    restore = checkpointer.restore_best if best else checkpointer.restore_latest
    restored = restore(state_dict(template), iterator, training=training)
    return None if restored is None else load_state_dict(restored[1], template)


def restore_train_state(
    experiment: Experiment, workdir: str | pathlib.Path, *, best: bool = False
) -> tuple[TrainState, Any]:
    """(state, static) of the newest good checkpoint in `workdir`, or of the best by
    `checkpoint.best_metric` (ValueError if none)."""
    workdir = check_workdir(workdir, exists=True)
    state, static, _, _ = init_train_state(experiment)
    train_source, _ = experiment.sources()
    iterator = iter(
        make_loader(
            train_source,
            batch_size=experiment.train.batch_size,
            seed=0,
            shuffle=not getattr(train_source, "stream", False),
        )
    )
    if not has_checkpoints(workdir):  # checked first: opening the manager would create the directory
        raise ValueError(f"no checkpoint in {workdir / CHECKPOINTS}: train first (jxformers train ...)")
    run = read_run_identity(workdir)
    with contextlib.closing(_open_checkpointer(experiment, workdir, async_save=False, run=run)) as checkpointer:
        restored = _restore(checkpointer, state, iterator, training=False, best=best)
    return restored, static


def restore_model(experiment: Experiment, workdir: str | pathlib.Path, *, best: bool = False):
    """(model, step) saved in the newest good (or the best) checkpoint of `workdir`."""
    state, static = restore_train_state(experiment, workdir, best=best)
    return state.model(static), int(state.step)


def evaluate_checkpoint(
    experiment: Experiment, workdir: str | pathlib.Path, *, batches: int | str | None = None, best: bool = False
):
    """Eval metrics of the newest (or the best) checkpoint on the eval split; for a
    classification or retrieval task also `eval_examples` and `baselines` ({name: accuracy} of the
    task's cheap predictors on the same examples, see `jxformers.data.baselines`).

    `batches`: None (the default) evaluates the first `train.eval_batches` batches, the
    ones training evaluated, so the numbers agree with the run's log; "all" the whole
    split (whole batches); an int that many."""
    if not (batches is None or batches == "all" or (isinstance(batches, int) and batches >= 1)):
        raise ValueError(f"batches must be None (train.eval_batches), 'all' or an int >= 1; got {batches!r}")
    state, static = restore_train_state(experiment, workdir, best=best)
    train_source, eval_source = experiment.sources()
    batch = min(experiment.train.batch_size, len(eval_source))
    workers = experiment.data.workers
    loader = make_loader(eval_source, batch_size=batch, seed=0, shuffle=False, num_epochs=1, workers=workers)
    wanted = {None: experiment.train.eval_batches, "all": math.ceil(len(eval_source) / batch)}.get(batches, batches)
    n = min(wanted, len(eval_source) // batch)
    metrics = {
        "step": int(state.step),
        **evaluate(make_eval_step(static), state, loader, n, **_eval_kind(experiment)),
    }
    if experiment.model.task not in SCORED_TASKS:
        return metrics
    return metrics | {
        "eval_examples": n * batch,
        "baselines": baselines(train_source, eval_source, records=n * batch, workers=workers),
    }


def _eval_kind(experiment: Experiment) -> dict[str, bool]:
    """`evaluate`'s extra metrics for the experiment's task: bits per token (lm), sequence accuracy (seq2seq)."""
    return {"language_model": experiment.model.task == "lm", "sequences": experiment.model.task == "seq2seq"}


def _real_tokens(batch) -> int:
    """The real tokens of a batch: its masks' (a seq2seq batch's source and target, a
    retrieval batch's two documents)."""
    return int(batch["mask"].sum()) + sum(int(batch[m].sum()) for m in ("target_mask", "other_mask") if m in batch)


# ----------------------------------------------------------------------------- hooks


def _due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last


def _peak_memory_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _redraw_if_due(state: TrainState, static, every: int, plan: ShardingPlan | None = None) -> TrainState:
    """New drawn arrays from fold_in(rng, 2 * step + 1) every `every` steps (0: never),
    put back on the plan's shardings."""
    step = int(state.step)
    if not every or step % every:
        return state
    _, drawn, _ = split_model(redraw(state.model(static), jax.random.fold_in(state.rng, 2 * step + 1)))
    state = dataclasses.replace(state, drawn=drawn)
    return state if plan is None else plan.place_state(state)


def _admin_profiled(state: TrainState, static, optimizer, batch, plan: ShardingPlan | None) -> TrainState:
    """`state` with its model's Admin weights set by a profile of `batch`, the run's first
    (`residual.admin_profile`, in training mode with the dropout key of step 0,
    fold_in(rng, 0)), and the optimizer state made again for the new parameters."""
    if jax.process_count() > 1:
        raise ValueError(
            f"norm.placement 'admin' profiles the first batch in one process; this run has {jax.process_count()} "
            "processes, whose rows differ (and so would their weights): train it in one process"
        )
    model = residual.admin_profile(state.model(static), *model_inputs(batch), key=jax.random.fold_in(state.rng, 0))
    params, _, _ = split_model(model)
    state = dataclasses.replace(state, params=params, opt_state=optimizer.init(params))
    return state if plan is None else plan.place_state(state)


def sharding_plan(experiment: Experiment, state: TrainState, static) -> ShardingPlan | None:
    """The plan that shards `state` on the experiment's mesh over all devices (a
    ValueError when the mesh does not fit them); None on one device, where the run is
    the unsharded one."""
    mesh = make_mesh(experiment.mesh)
    if mesh.size == 1:
        return None
    return plan_sharding(state, static, mesh, batch_size=experiment.train.batch_size)


class _CompiledStep:
    """The train step, compiled once explicitly (to record its temporary memory and XLA's
    count of its FLOPs) and timed."""

    def __init__(self, jitted):
        self.jitted, self.compiled, self.temp_bytes, self.compile_seconds = jitted, None, None, None
        self.flops = None

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float], float]:
        if self.compiled is None:
            began = time.perf_counter()
            self.compiled = self.jitted.lower(state, batch).compile()
            self.compile_seconds = time.perf_counter() - began
            cost = cost_of(self.compiled)
            self.temp_bytes, self.flops = cost.temp_bytes, cost.flops
        began = time.perf_counter()
        state, metrics = self.compiled(state, batch)
        metrics = {k: float(v) if v.ndim == 0 else [float(x) for x in v] for k, v in metrics.items()}
        return state, metrics, time.perf_counter() - began


def to_json(record: dict[str, Any]) -> str:
    """`record` as one line of strict JSON: a non-finite float becomes the string float()
    reads back ("NaN", "Infinity", "-Infinity"), since a bare NaN is not JSON."""

    def number(value):
        return json.dumps(value) if isinstance(value, float) and not math.isfinite(value) else value

    return json.dumps({k: number(v) for k, v in record.items()}, allow_nan=False)


class _MetricsLog:
    """One JSON line per record in metrics.jsonl, mirrored as TensorBoard scalars."""

    def __init__(self, workdir: pathlib.Path):
        self.fd = open_metrics_log(workdir)
        self.events = EventWriter(workdir / TENSORBOARD)

    def __call__(self, record: dict[str, Any]) -> None:
        write_line(self.fd, to_json(record))
        self.events.scalars(record["step"], {k: v for k, v in record.items() if k != "step"})

    def close(self) -> None:
        os.close(self.fd)
        self.events.close()


class _NoLog:
    """The metrics log of a process other than 0: it writes nothing."""

    def __call__(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _per_process(rows: int, what: str) -> int:
    """`rows` of a global batch split evenly over the processes (each reads its own)."""
    count = jax.process_count()
    if rows % count:
        raise ValueError(
            f"{what} ({rows}) must be divisible by the number of processes ({count}): each process "
            f"reads its own rows of every batch"
        )
    return rows // count


@dataclasses.dataclass
class _StepReport:
    """Logs a step's metrics (every `log_every`, the first and the last step) or, for a
    non-finite step, logs it as skipped and stops the run when `on_nonfinite` is stop."""

    log: _MetricsLog
    experiment: Experiment
    schedule: Any
    start: int
    padded_tokens_per_batch: int
    saved_steps: Any  # () -> the steps checkpointed so far
    step_temp_bytes: Any = None
    skipped: int = 0  # non-finite steps of this process's run
    in_a_row: int = 0  # ... ending at the latest step

    def _kept(self) -> str:
        steps = self.saved_steps()
        if not steps:
            return "no checkpoint was saved yet, so a rerun starts from step 0"
        return f"the last checkpoint (step {steps[-1]}) is kept, and a rerun resumes from it"

    def __call__(self, step: int, m: dict[str, float], elapsed: float, tokens: int) -> None:
        """`tokens`: the real (unpadded) tokens of the step's batch."""
        t = self.experiment.train
        finite = m.pop("finite")
        self.in_a_row = 0 if finite else self.in_a_row + 1
        if not finite:
            self.skipped += 1
            self.log({"step": step, "loss": m["loss"], "grad_norm": m["grad_norm"], "skipped": True})
            if t.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"non-finite loss or gradients at step {step} (loss {m['loss']}, gradient norm "
                    f"{m['grad_norm']}); the update was not applied. Set train.on_nonfinite=skip to "
                    f"skip such steps; {self._kept()}."
                )
            if self.in_a_row >= t.max_consecutive_skips:  # skipping forever would end "successfully"
                raise NonFiniteError(
                    f"{self.in_a_row} non-finite steps in a row (steps {step - self.in_a_row + 1}-{step}, "
                    f"train.max_consecutive_skips = {t.max_consecutive_skips}): the model is not recovering; "
                    f"lower train.learning_rate or check the data; {self._kept()}."
                )
        elif _due(step, t.log_every, t.steps) or step == self.start + 1:
            self.log(
                {
                    "step": step,
                    **m,
                    "lr": float(self.schedule(step - 1)),
                    "step_ms": 1e3 * elapsed,
                    "tokens_per_s": tokens / elapsed,
                    "padded_tokens_per_s": self.padded_tokens_per_batch / elapsed,
                    "step_temp_bytes": self.step_temp_bytes,
                    "peak_memory_bytes": _peak_memory_bytes(),
                }
            )


class _Evaluator:
    """Eval metrics of a state on the first `eval_batches` batches of the eval split.
    Those batches are the same at every evaluation: made once (by `data.workers`
    workers) and kept in memory."""

    def __init__(self, experiment: Experiment, static, eval_source, plan: ShardingPlan | None = None):
        self.source, self.step, self.plan = eval_source, make_eval_step(static), plan
        count = jax.process_count()  # each process reads its own rows of the eval batches
        self.batch = max(min(experiment.train.batch_size, len(eval_source)) // count, 1)
        self.batches, self.kind = experiment.train.eval_batches, _eval_kind(experiment)
        self.workers, self.kept = experiment.data.workers, None

    def __call__(self, state: TrainState) -> dict[str, float]:
        if self.kept is None:
            loader = make_loader(
                self.source, batch_size=self.batch, seed=0, shuffle=False, num_epochs=1, workers=self.workers
            )
            self.kept = list(itertools.islice(loader, self.batches))
            if self.plan is not None:
                self.kept = [self.plan.place_batch(b) for b in self.kept]
        return evaluate(self.step, state, self.kept, self.batches, **self.kind)


class _Signals:
    """SIGTERM/SIGINT: acknowledged at once, then the loop checkpoints after the current
    step and exits. Python runs signal handlers only between bytecodes, so during a long
    compile a handler would wait ~20 s; the C-level handler writes the signal to a wakeup
    socket that a thread reads and acknowledges immediately. A second signal stops the
    process at once, without saving (an unfinished orbax save never appears as a step).

    With several processes every one must stop after the same step, or those that go on
    wait forever in collectives the others never join. JAX's preemption service
    (`distributed.preemption_service`) owns SIGTERM there: whichever process gets it, all
    of them reach the sync point at the same step (`stop_after`). A SIGINT is passed on
    to it as a SIGTERM to this process."""

    def __init__(self):
        self.received: int | None = None  # the signal this process got (or the notice, SIGTERM)
        self.coordinated = distributed.preemption_service()
        self._old: dict[int, Any] = {}
        self._old_fd, self._sockets = None, None

    def __enter__(self):
        try:
            for sig in (signal.SIGINT,) if self.coordinated else (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, lambda signum, frame: None)  # the watcher acts
            reader, writer = socket.socketpair()
            writer.setblocking(False)
            self._old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread: leave signals alone
            self.__exit__()
            return self
        self._sockets = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), daemon=True).start()
        return self

    def _watch(self, reader: socket.socket) -> None:
        while data := reader.recv(16):
            for signum in data:
                if signum in self._old:
                    self._acknowledge(signum)
        reader.close()

    def _acknowledge(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            print(f"\njxformers train: second {name}: stopping now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        everyone = "every process saves after the same step" if self.coordinated else "saving after the current step"
        print(
            f"\njxformers train: {name} received: {everyone}, then exiting (again to stop at once, without saving)",
            file=sys.stderr,
            flush=True,
        )
        # Only now: the main thread stops (and says what it saved) once it sees this, so
        # set before the line above, its message could come first (seen under load).
        self.received = signum
        if self.coordinated:
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's handler, which tells the other processes

    def stop_after(self, step: int) -> bool:
        """Whether to save `step` and exit. With several processes, every process calls
        this at every step and gets the same answer."""
        if not self.coordinated:
            return self.received is not None
        if not distributed.reached_preemption_sync_point(step):
            return False
        if self.received is None:
            self.received = signal.SIGTERM
            print(
                f"\njxformers train: preemption notice (SIGTERM to one of the processes): every process "
                f"saves after step {step}, then exits",
                file=sys.stderr,
                flush=True,
            )
        return True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        if self._sockets is not None:
            signal.set_wakeup_fd(self._old_fd)
            self._sockets[1].close()  # the watcher's recv returns b"" and it ends
            self._sockets = None

    def exit_after_saving(self, checkpointer: Checkpointer, log: _MetricsLog, step: int, start: int) -> None:
        """After the loop stopped for a signal: wait for the checkpoint of `step`, say what
        was saved, log, exit 128 + signal."""
        checkpointer.wait()
        log({"step": step, "interrupted": signal.Signals(self.received).name})
        if step > start:
            said = f"saved step {step}; rerun to resume"
        elif step:
            said = f"nothing new to save (the checkpoint of step {step} is kept); rerun to resume"
        else:
            said = "nothing to save yet"
        print(f"jxformers train: {said}", file=sys.stderr, flush=True)
        raise SystemExit(128 + self.received)


# Seconds between progress lines when stderr is not a terminal (CI, a log file).
PLAIN_PROGRESS_EVERY_S = 30.0


class _Progress:
    """A tqdm bar on a terminal; elsewhere a plain line after the first step, every
    PLAIN_PROGRESS_EVERY_S seconds and at the last step (a redrawn bar fills a log file);
    nothing when off."""

    def __init__(self, experiment: Experiment, start: int, enabled: bool):
        self.name, self.total, self.enabled = experiment.name, experiment.train.steps, enabled
        self.terminal = enabled and stderr_is_terminal()
        self.bar = tqdm(total=self.total, initial=start, desc=self.name, file=sys.stderr, disable=not self.terminal)
        self.last_line = None

    def __call__(
        self, step: int, m: dict[str, float], last_eval: dict[str, float], *, elapsed: float, tokens: int
    ) -> None:
        shown = {
            "loss": f"{m['loss']:.4f}",
            "acc": f"{m['accuracy']:.3f}",
            **({"eval_acc": f"{last_eval['eval_accuracy']:.3f}"} if last_eval else {}),
            "step_ms": f"{1e3 * elapsed:.1f}",
            "tokens/s": f"{tokens / max(elapsed, 1e-9):.0f}",
        }
        if self.terminal:
            self.bar.update(1)
            self.bar.set_postfix(**shown)
            return
        now = time.monotonic()
        due = self.last_line is None or now - self.last_line >= PLAIN_PROGRESS_EVERY_S or step == self.total
        if self.enabled and due:
            self.last_line = now
            print(
                f"{self.name}: step {step}/{self.total} " + " ".join(f"{k} {v}" for k, v in shown.items()),
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()


# ----------------------------------------------------------------------------- the loop


def _last_eval(workdir: pathlib.Path) -> dict[str, Any]:
    """The last evaluation logged in `workdir/metrics.jsonl` ({} if none)."""
    evals = [r for r in read_metrics_log(workdir) if any(key.startswith("eval_") for key in r)]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else {}


def _prepare_workdir(experiment: Experiment, workdir: pathlib.Path, stack: contextlib.ExitStack, fresh: bool):
    """Lock the work directory, check a rerun against the saved config and the log, then
    (only then) write config.yaml. Returns the changes a rerun made (all resumable) and
    the run's id (`workdir.run_identity`, process 0's on every process).
    Several processes must have been started alike (`distributed.check_same_run`)."""
    distributed.check_same_run(experiment.raw)
    check_workdir(workdir, exists=False)
    workdir.mkdir(parents=True, exist_ok=True)
    check_writable(workdir)
    if distributed.is_main():  # with several processes, process 0 holds the lock and writes
        stack.enter_context(workdir_lock(workdir))
    changes = check_rerun(workdir, experiment)
    aside = check_history(workdir, experiment, fresh=fresh)
    distributed.barrier("jxformers: config checked")  # every process read the old config.yaml
    if distributed.is_main():
        if aside:
            print(f"jxformers train: a fresh start; the old log is {set_history_aside(workdir)}", file=sys.stderr)
        write_config(workdir, experiment)
    run = distributed.from_process_zero(run_identity(workdir) if distributed.is_main() else None)
    return changes, run


def _bounded_fetch(experiment: Experiment, iterator, signals: _Signals) -> BatchFetcher:
    """The next batch from data workers, waited for at most `data.batch_timeout` seconds;
    None once a signal (one process: with several, the stop waits for the sync point)
    asks the run to stop."""
    return BatchFetcher(
        iterator,
        timeout_s=experiment.data.batch_timeout,
        stop_requested=lambda: signals.received is not None and not signals.coordinated,
    )


def _train_iterator(experiment: Experiment, train_source):
    """The iterator over this process's rows of the training batches (its position is
    part of every checkpoint); a stream's rows continue from batch to batch, unshuffled."""
    t = experiment.train
    return iter(
        make_loader(
            train_source,
            batch_size=_per_process(t.batch_size, "train.batch_size"),
            seed=t.seed,
            workers=experiment.data.workers,
            shuffle=not getattr(train_source, "stream", False),
        )
    )


def start_run(experiment: Experiment, workdir: str | pathlib.Path, model) -> pathlib.Path:
    """Write `workdir` as a run of `experiment` at step 0 whose model is `model` (a model
    of `experiment.model`, e.g. a converted checkpoint: its parameters and drawn arrays,
    with a fresh optimizer state): its config.yaml and a checkpoint of step 0, which
    `jxformers eval` evaluates and `jxformers train` resumes, i.e. fine-tunes. A work
    directory that holds checkpoints already is refused."""
    workdir = check_workdir(workdir, exists=False)
    if has_checkpoints(workdir):
        raise ValueError(f"{workdir} holds checkpoints of a run already; start from the model in a new directory")
    state, static, optimizer, _ = init_train_state(experiment)
    params, drawn, _ = split_model(model)
    given = dataclasses.replace(state, params=params, drawn=drawn, opt_state=optimizer.init(params))
    try:  # the arrays by tree path and shape, as a checkpoint's are checked
        compare_trees(state_dict(given), state_dict(state))
    except CheckpointMismatch as error:
        raise ValueError(f"the model is not a model of the experiment's config: {error}") from None
    if jax.tree.structure((params, drawn)) != jax.tree.structure((state.params, state.drawn)):
        raise ValueError("the model is not a model of the experiment's config: its modules differ")
    state = given
    with contextlib.ExitStack() as stack:
        workdir.mkdir(parents=True, exist_ok=True)
        check_writable(workdir)
        stack.enter_context(workdir_lock(workdir))
        write_config(workdir, experiment)  # no checkpoints: nothing a config.yaml there must agree with
        train_source, _ = experiment.sources()
        iterator = stack.enter_context(contextlib.closing(_train_iterator(experiment, train_source)))
        checkpointer = stack.enter_context(
            contextlib.closing(_open_checkpointer(experiment, workdir, async_save=False, run=run_identity(workdir)))
        )
        checkpointer.save(0, state_dict(state), iterator)
    return workdir


def _emergency_save(checkpointer: Checkpointer, state: TrainState, iterator, last_eval, start: int, error) -> None:
    """Save `state`'s step before the error that ends the run propagates, saying on one
    line whether it could (a full disk may refuse this save too)."""
    step = int(state.step)
    if step <= start or step in checkpointer.steps():
        return
    try:
        checkpointer.save(step, state_dict(state), iterator, last_eval)
        checkpointer.wait()
    except Exception as failed:  # noqa: BLE001 - the original error is what the run reports
        why = (str(failed).strip().splitlines() or [""])[0][:200]
        print(
            f"jxformers train: could not save step {step} after the error ({type(failed).__name__}: {why})",
            file=sys.stderr,
        )
        return
    print(f"jxformers train: saved step {step} before stopping on {type(error).__name__}", file=sys.stderr)


def train(
    experiment: Experiment, workdir: str | pathlib.Path, *, progress: bool = True, fresh: bool = False
) -> dict[str, Any]:
    """Train (or resume) `experiment` in `workdir`; returns the final metrics.

    Holds `workdir/lock` while it runs; writes `workdir/config.yaml` (the resolved config,
    after checking a rerun against it), `workdir/metrics.jsonl` and `workdir/checkpoints/`.
    Exits with an exception on a non-finite step when `train.on_nonfinite` is "stop" (the
    checkpoints stay). `progress`: a bar on a terminal, plain lines elsewhere. A run whose
    log shows checkpoints that are gone is refused; `fresh` starts it again at step 0
    (the old metrics.jsonl moved aside), and is refused where checkpoints exist.
    """
    workdir = pathlib.Path(workdir)
    t, every = experiment.train, experiment.checkpoint.every
    if workdir.is_dir():  # read-only, before anything is built: fails in a moment, not after compiling
        check_history(workdir, experiment, fresh=fresh)
    with contextlib.ExitStack() as stack:
        signals = stack.enter_context(_Signals())  # first: a signal during setup is acknowledged too
        # What can still fail once the config is valid (the model's constructors, a mesh the
        # devices cannot form) fails here, before the work directory is touched.
        state, static, optimizer, schedule = init_train_state(experiment)
        plan = sharding_plan(experiment, state, static)
        changes, run = _prepare_workdir(experiment, workdir, stack, fresh)
        train_source, eval_source = experiment.sources()
        iterator = stack.enter_context(contextlib.closing(_train_iterator(experiment, train_source)))
        checkpointer = stack.enter_context(
            contextlib.closing(
                _open_checkpointer(
                    experiment, workdir, async_save=experiment.checkpoint.async_save, run=run, training=True
                )
            )
        )
        if plan is not None:  # the template on the mesh: a checkpoint restores onto it, whatever mesh saved it
            state = plan.place_state(state)
        state = _restore(checkpointer, state, iterator, training=True) or state
        if plan is not None:
            state = plan.place_state(state)
        start = int(state.step)
        run_step = _CompiledStep(make_train_step(static, optimizer, grad_accum=t.grad_accum, sharding=plan))
        run_eval = _Evaluator(experiment, static, eval_source, plan)
        log = stack.enter_context(contextlib.closing(_MetricsLog(workdir) if distributed.is_main() else _NoLog()))
        if changes:  # a rerun changed resumable settings: the log says from which step
            log({"step": start, "config_changed": {k: list(v) for k, v in changes.items()}})
        # + the targets (seq2seq) or the second documents (retrieval)
        padded = t.batch_size * train_source.max_len * (2 if experiment.model.task in ("seq2seq", "retrieval") else 1)
        report = _StepReport(log, experiment, schedule, start, padded, checkpointer.steps)
        show = stack.enter_context(contextlib.closing(_Progress(experiment, start, progress and distributed.is_main())))
        if start >= t.steps:  # a rerun of a finished run: say so rather than summarise nothing
            return {
                "step": start,
                "complete": True,
                **_last_eval(workdir),
                "note": f"already complete: step {start} of train.steps = {t.steps}; nothing was run "
                "(raise train.steps to train further, or use `jxformers eval`)",
            }
        if start:  # steps logged after this checkpoint by the interrupted run are logged again below
            log({"step": start, "resumed_from_step": start})
        summary, last_eval = {"step": start}, {}
        in_flight = None  # the step of a save that may still be written (async)
        # With worker processes, the wait for a batch is bounded and a signal cuts it short.
        bounded = experiment.data.workers > 0
        fetch = (
            stack.enter_context(contextlib.closing(_bounded_fetch(experiment, iterator, signals)))
            if bounded
            else lambda: next(iterator)
        )
        stop = signals.stop_after(start)  # a signal during setup: nothing to run
        consistent = False  # whether (state, iterator) are a pair a checkpoint may hold
        try:
            while int(state.step) < t.steps and not stop:
                consistent = False  # from here until the step is taken, the iterator is ahead
                position = Position(iterator.get_state()) if bounded else None
                batch = fetch()  # this process's rows, numpy
                if (
                    batch is None
                ):  # a signal while waiting for it: save the last step (at the data's position before it)
                    stop, step = True, int(state.step)
                    print("jxformers train: stopped while waiting for a batch from the data workers", file=sys.stderr)
                    if step > start and step != in_flight and step not in checkpointer.steps():
                        checkpointer.save(step, state_dict(state), position, last_eval)
                    break
                state = _redraw_if_due(state, static, t.redraw_every, plan)
                if int(state.step) == 0 and experiment.model.norm.placement == "admin":
                    state = _admin_profiled(state, static, optimizer, batch, plan)
                tokens = _real_tokens(batch) * jax.process_count()  # this process's rows, scaled
                state, m, elapsed = run_step(state, batch if plan is None else plan.place_batch(batch))
                step, report.step_temp_bytes = int(state.step), run_step.temp_bytes
                consistent = True
                if step == start + 1:  # the first step of this process compiled the train step
                    # with what the summary reports of it, so a finished run reused can be read back
                    parameters = sum(int(x.size) for x in jax.tree.leaves(state.params))
                    log(
                        {"step": step, "compile_seconds": run_step.compile_seconds, "parameters": parameters}
                        | ({"train_step_flops": run_step.flops} if run_step.flops is not None else {})
                    )
                report(step, m, elapsed, tokens)
                if _due(step, t.eval_every, t.steps):
                    last_eval = run_eval(state)
                    log({"step": step, **last_eval})
                show(step, m, last_eval, elapsed=elapsed, tokens=tokens)
                summary = {"step": step, **m, **last_eval}
                stop = signals.stop_after(step)
                if _due(step, every, t.steps) or stop:
                    began = time.perf_counter()
                    consistent = False  # a save that failed is not tried again on the way out
                    checkpointer.save(step, state_dict(state), iterator, last_eval)
                    consistent = True
                    # the time the step path waits for the save (async: copying to host memory)
                    log({"step": step, "checkpoint_save_ms": 1e3 * (time.perf_counter() - began)})
                    in_flight = step
                elif in_flight is not None and step - in_flight >= experiment.checkpoint.save_lag:
                    # an async save unfinished for this long is waited for: what a SIGKILL can lose stays bounded
                    if checkpointer.saving():
                        began = time.perf_counter()
                        checkpointer.wait()
                        log({"step": step, "checkpoint_wait_ms": 1e3 * (time.perf_counter() - began)})
                    in_flight = None
        except Exception as error:
            # The run dies of an error (a full disk while logging, a failing evaluation): keep
            # its last step where (state, iterator) agree. Not for a non-finite state, and not
            # with several processes (a save is collective; the others may be elsewhere).
            if consistent and not isinstance(error, NonFiniteError) and jax.process_count() == 1:
                _emergency_save(checkpointer, state, iterator, last_eval, start, error)
            raise
        if stop:
            signals.exit_after_saving(checkpointer, log, int(state.step), start)
        return summary | {
            "skipped_steps": report.skipped,
            "peak_memory_bytes": _peak_memory_bytes(),
            "train_step_temp_bytes": run_step.temp_bytes,
            "train_step_flops": run_step.flops,
            "parameters": sum(int(x.size) for x in jax.tree.leaves(state.params)),
            "compile_seconds": run_step.compile_seconds,
        }
