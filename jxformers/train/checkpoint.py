"""Checkpoints with orbax: a `CheckpointManager` that saves the training state (model
parameters, drawn arrays, optimizer state, step, RNG key) and the grain iterator state
together, asynchronously; keeps the latest `keep` plus the best by an eval metric; and
on restore falls back past a damaged checkpoint to the previous one, with a warning
(and refuses, without touching anything, when none restores: usually a changed config).

The state is expected as a flat dict {tree path: array} (see `jxformers.train.state`).
Before any value is read, the saved tree's paths and shapes (orbax metadata) are
compared with the template's, and a mismatch names the first missing, unexpected or
reshaped path. Checkpoints written before path-keyed checkpoints (their `params` is a
list of leaves) are refused with an explanation (`LegacyCheckpointError`).

Orbax writes each checkpoint to a temporary directory and renames it when complete, so
a half-written checkpoint (a run killed mid-save) never appears as a step. Each
checkpoint also holds checksums of its arrays and data position (`checksums.py`), checked
on restore: a flipped bit or an edited position is damage, and falls back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jxformers.train import checksums
from jxformers.train.state import STEP_KEY


class _NoMetricsWarningFilter(logging.Filter):
    """Orbax logs a warning for every save without metrics once best_fn is set; a save
    before the first evaluation has none, by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in str(record.msg)


logging.getLogger("absl").addFilter(_NoMetricsWarningFilter())


class LegacyCheckpointError(ValueError):
    """A checkpoint in the list layout written by jxformers before path-keyed checkpoints."""


class CheckpointWarning(UserWarning):
    """A checkpoint could not be restored and an older one is used (one line: which, why, which instead)."""


class CheckpointMismatch(ValueError):
    """The saved tree's paths or shapes differ from the template's (usually a changed config)."""


def _names(tree) -> dict[str, Any]:
    """{name: leaf}: a flat dict's own keys in its own order, else each leaf's `keystr` path."""
    if isinstance(tree, dict) and all(
        isinstance(k, str) and not isinstance(v, (dict, list, tuple)) for k, v in tree.items()
    ):
        return dict(tree)
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        flat = len(path) == 1 and isinstance(path[0], jax.tree_util.DictKey) and isinstance(path[0].key, str)
        out[path[0].key if flat else jax.tree_util.keystr(path)] = leaf
    return out


def _what(name: str) -> str:
    return "parameter" if name.startswith("['params']") else "array"


def compare_trees(saved, template) -> None:
    """CheckpointMismatch naming the first path missing from `saved`, the first path
    `template` lacks, and the first shape mismatch (with a count of further differences)."""
    saved, template = _names(saved), _names(template)
    missing = [n for n in template if n not in saved]
    unexpected = [n for n in saved if n not in template]
    reshaped = [n for n in template if n in saved and tuple(saved[n].shape) != tuple(template[n].shape)]
    problems = []
    if missing:
        problems.append(f"{_what(missing[0])} {missing[0]} is missing (the model expects it)")
    if unexpected:
        problems.append(f"{_what(unexpected[0])} {unexpected[0]} is unexpected (the model has no such path)")
    if reshaped:
        n = reshaped[0]
        problems.append(
            f"{_what(n)} {n} has shape {tuple(saved[n].shape)}; the model expects {tuple(template[n].shape)}"
        )
    if problems:
        more = len(missing) + len(unexpected) + len(reshaped) - len(problems)
        raise CheckpointMismatch("; ".join(problems) + (f" (and {more} more differences)" if more else ""))


def _reason(error: Exception, limit: int = 160) -> str:
    """Why a restore failed, in a few words: a mismatch or our own message as it is; a
    library error (a TensorStore status, many lines long) as its first line, cut at a word."""
    if isinstance(error, CheckpointMismatch):
        return str(error)
    first = (str(error).strip().splitlines() or [""])[0]
    if len(first) > limit:
        first = first[:limit].rsplit(" ", 1)[0] + " ..."
    return f"unreadable or damaged data: {type(error).__name__}: {first}" if first else type(error).__name__


def _is_late_read(report: Any) -> bool:
    """Whether an unraisable-exception report (`sys.unraisablehook`'s argument) is the
    late end of a failed restore's read: RuntimeError('Event loop is closed') raised by
    asyncio's `call_soon_threadsafe` (a tensorstore read finishing into the closed loop),
    or an orbax read coroutine, abandoned unfinished, that raised when it was closed (it
    turns the GeneratorExit into its own "Encountered error while reading" error)."""
    error = report.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        frames = traceback.extract_tb(report.exc_traceback) if report.exc_traceback is not None else []
        return any(f.name == "call_soon_threadsafe" and "asyncio" in f.filename for f in frames)
    code = getattr(report.object, "cr_code", None)  # the coroutine being closed
    if code is None or "orbax" not in code.co_filename:
        return False
    seen = error
    while seen is not None and not isinstance(seen, GeneratorExit):
        seen = seen.__cause__ or seen.__context__
    return seen is not None


def _drop_late_reads() -> None:
    """Drop the reports of a failed restore's reads that finish after it failed.

    When tensorstore fails one read of a checkpoint (DATA_LOSS on a damaged file), orbax's
    restore stops and closes its asyncio loop with the other reads still in flight; each
    then finishes into the closed loop from a tensorstore thread, and Python prints a
    `RuntimeError: Event loop is closed` traceback for it (through `sys.unraisablehook`),
    after the fallback's warning, as if the run had failed; read coroutines that never
    finished print theirs when they are collected. Those reports alone (`_is_late_read`)
    are dropped; every other one goes to the hook that was there before. Installed once."""
    previous = sys.unraisablehook
    if previous in _LATE_READ_HOOKS:
        return

    def hook(report: Any) -> None:
        if not _is_late_read(report):
            previous(report)

    _LATE_READ_HOOKS.append(hook)
    sys.unraisablehook = hook


_LATE_READ_HOOKS: list[Any] = []  # the hooks `_drop_late_reads` installed

# The lines of a late read's report as Python prints them from tensorstore's threads,
# several at once (so they arrive cut and interleaved): what `_late_reads_unprinted` drops.
_LATE_READ_PARTS = re.compile(
    r"Traceback \(most recent call last\):"
    r"|File \"[^\"]*asyncio[/\\]base_events\.py\", line \d+, in (?:call_soon_threadsafe|_check_closed)"
    r"|self\._check_closed\(\)"
    r"|raise RuntimeError\('Event loop is closed'\)"
    r"|RuntimeError|Event loop is closed"
)


@contextlib.contextmanager
def _late_reads_unprinted() -> Iterator[None]:
    """Hold this process's stderr (the file descriptor) while the body runs, then pass it
    on without the late reads' reports. Python prints them from tensorstore's threads
    with no hook called (neither sys.unraisablehook nor sys.excepthook saw them: up to
    116 in one failed restore, under load), so they are taken out of the stream itself;
    every other line comes through, after the body."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", "replace")
            if "Event loop is closed" in text:
                kept = [
                    line for line in text.splitlines(keepends=True) if _LATE_READ_PARTS.sub("", line).strip(" \t\n:")
                ]
                text = "".join(kept)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()


def _legacy(tree) -> bool:
    return isinstance(tree, dict) and isinstance(tree.get("params"), (list, tuple))


# Each checkpoint also holds the run's resolved config (as config.yaml holds it), so a run
# whose config.yaml was deleted is still checked on a rerun and its config.yaml restored:
# CONFIG_ITEM/CONFIG_FILE inside a step's directory (orbax's JSON item layout).
CONFIG_ITEM, CONFIG_FILE = "config", "metadata"
# And the checksums of its state and data position (jxformers.train.checksums), verified
# on restore; a checkpoint written before them restores unchecked.
CHECKSUMS_ITEM = "checksums"
# What every complete checkpoint directory holds (orbax's metadata file, our two items).
STEP_PARTS = ("_CHECKPOINT_METADATA", "state", "data")
# How often a restore starts over when the checkpoint it reads is deleted meanwhile (a
# training run writing to the same directory rotated it out).
MAX_ROTATIONS = 5


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, except that an unreadable metrics file (junk, a cut line) makes
    that checkpoint one without metrics (not a candidate for the best), with one warning
    naming the file, instead of stopping every command that opens the directory."""

    # orbax's one reader of metrics files (metrics(), metadata(), item_metadata() call it);
    # private, so a test fails should an orbax release rename it
    def _get_metrics(self, step: int):
        try:
            return super()._get_metrics(step)
        except (ValueError, OSError) as error:  # JSONDecodeError is a ValueError
            self.damaged_metrics[step] = _reason(error)
            return None

    _damaged: dict[int, str] | None = None  # per instance once set

    @property
    def damaged_metrics(self) -> dict[int, str]:
        """{step: why its metrics file is unreadable}; filled while orbax's __init__ reads them."""
        if self._damaged is None:
            self._damaged = {}
        return self._damaged


def incomplete_steps(directory: pathlib.Path) -> dict[int, str]:
    """{step: the first of `STEP_PARTS` it lacks} for each step directory under
    `directory` that lacks one: a save or a garbage collection cut short (a second Ctrl-C
    exits at once, even while orbax deletes an old checkpoint). Orbax's unfinished saves
    sit in temporary names, not listed here."""
    found = {}
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        if path.is_dir() and path.name.isdigit():
            missing = [part for part in STEP_PARTS if not (path / part).exists()]
            if missing:
                found[int(path.name)] = missing[0]
    return found


class Checkpointer:
    """Save and restore {"state": pytree of arrays, "data": grain iterator}, with the run's
    `config` (a JSON-able dict) stored beside them when given. `tidy` (a training run,
    process 0): incomplete step directories are moved aside first, one warning each.
    `run`: the run's id, kept in each checkpoint; one holding another id is damage.
    `records_per_step`: the rows each step reads from the restored iterator (a training
    run's, per process); a checkpoint whose data position has not consumed exactly
    step x that many is damage (needs an iterator with `records_consumed()`)."""

    def __init__(
        self,
        directory: str | pathlib.Path,
        *,
        keep: int,
        best_metric: str,
        best_mode: str,
        async_save: bool = True,
        config: dict[str, Any] | None = None,
        tidy: bool = False,
        run: str | None = None,
        records_per_step: int | None = None,
    ):
        self.best_metric = best_metric
        self.config = config
        self.run = run
        self.records_per_step = records_per_step
        preservation = policies.AnyPreservationPolicy(
            [
                policies.LatestN(n=keep),
                policies.BestN(
                    get_metric_fn=lambda m: m[best_metric],
                    reverse=best_mode == "min",
                    n=1,
                    keep_checkpoints_without_metrics=False,
                ),
            ]
        )
        # best_fn makes orbax write each checkpoint's metrics and answer best_step().
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save,
            preservation_policy=preservation,
            create=True,
            best_fn=lambda m: m[best_metric],
            best_mode=best_mode,
        )
        self.directory = pathlib.Path(directory).resolve()
        # Any: grain's handler implements orbax's protocol without subclassing it
        handlers: dict[str, Any] = {
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
            CONFIG_ITEM: ocp.JsonCheckpointHandler(filename=CONFIG_FILE),
            CHECKSUMS_ITEM: ocp.JsonCheckpointHandler(filename=CHECKSUMS_ITEM),
        }
        if tidy and jax.process_index() == 0:
            for step, missing in incomplete_steps(self.directory).items():
                reason = f"it has no {missing}: its writing or deletion was interrupted"
                warnings.warn(
                    f"checkpoint at step {step} is incomplete ({reason}); moved to {self._move_aside(step, reason)}",
                    CheckpointWarning,
                    stacklevel=2,
                )
        for attempt in range(MAX_ROTATIONS + 1):
            try:
                self.manager = _Manager(self.directory, options=options, item_handlers=handlers)
                break
            except FileNotFoundError:  # a step deleted while listed: rotated out by a training run
                if attempt == MAX_ROTATIONS:
                    raise
                time.sleep(0.1)
        for step, reason in sorted(self.manager.damaged_metrics.items()):
            metrics = self.directory / str(step) / "metrics" / "metrics"
            warnings.warn(
                f"checkpoint at step {step}: its metrics file {metrics} is unreadable ({reason}); "
                f"the checkpoint is used, but not as a candidate for the best {best_metric}",
                CheckpointWarning,
                stacklevel=2,
            )

    def save(self, step: int, state: dict[str, Any], iterator, metrics: dict[str, float] | None = None) -> None:
        metrics = metrics if metrics and self.best_metric in metrics else None
        items = {
            "state": ocp.args.StandardSave(state),
            "data": grain.checkpoint.CheckpointSave(iterator),
            CHECKSUMS_ITEM: ocp.args.JsonSave(checksums.checksums(_names(state), iterator, self.run)),
        }
        if self.config is not None:
            items[CONFIG_ITEM] = ocp.args.JsonSave(self.config)
        self.manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def saving(self) -> bool:
        """Whether an async save is still being written."""
        return self.manager.is_saving_in_progress()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(
        self, template: dict[str, Any], iterator, *, training: bool = True
    ) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint that restores cleanly, as (step, state); the iterator is
        moved to its saved position. None when there are no checkpoints.

        Newer checkpoints that fail to restore are reported with one warning line each
        and, when `training` (which will save those steps again), moved out of the way.
        If none restores, nothing is moved and a ValueError explains: that is more often
        a changed config (another model or optimizer) than damage.
        """
        with _late_reads_unprinted():  # a damaged checkpoint's reads end in reports: not printed
            return self._restore_latest(template, iterator, training=training)

    def _restore_latest(
        self, template: dict[str, Any], iterator, *, training: bool
    ) -> tuple[int, dict[str, Any]] | None:
        failed: list[tuple[int, str]] = []
        steps = list(reversed(self.steps()))
        rotations = 0
        while steps:
            step = steps.pop(0)
            try:
                state = self._restore_step(step, template, iterator)
            except LegacyCheckpointError:
                raise
            except Exception as error:  # noqa: BLE001 - any failure: try the previous one
                if not (self.directory / str(step)).exists() and rotations < MAX_ROTATIONS:
                    # deleted while read: a training run writing here rotated it out (not
                    # damage); its newer checkpoints are listed again
                    rotations += 1
                    self.manager.reload()
                    steps = [s for s in reversed(self.steps()) if s not in dict(failed)]
                    continue
                failed.append((step, _reason(error)))
                continue
            for bad, reason in failed:
                where = f"; moved to {self._set_aside(bad, reason)}" if training else ""
                warnings.warn(
                    f"checkpoint at step {bad} could not be restored ({reason}){where}; "
                    f"{'resuming from' if training else 'using'} step {step}",
                    CheckpointWarning,
                    stacklevel=2,
                )
            return step, state
        if failed:
            reasons = "; ".join(f"checkpoint at step {s}: {r}" for s, r in failed)
            raise ValueError(
                f"no checkpoint in {self.directory} could be restored ({reasons}). If the model or optimizer "
                f"config changed since they were written, use the original config or a new work directory."
            )
        return None

    def restore_best(
        self, template: dict[str, Any], iterator, *, training: bool = False
    ) -> tuple[int, dict[str, Any]] | None:
        """The best checkpoint by `best_metric`, as (step, state); None when there are no
        checkpoints, a ValueError when none has the metric or the best does not restore
        (no silent fallback: another step is not the best)."""
        del training  # the best is never set aside
        if not self.steps():
            return None
        best = self.manager.best_step()
        if best is None or self.manager.metrics(best) is None:
            raise ValueError(
                f"no checkpoint in {self.directory} records {self.best_metric} (a checkpoint records "
                f"the last evaluation before it; none had run): evaluate the latest (drop --best)"
            )
        try:
            with _late_reads_unprinted():
                return best, self._restore_step(best, template, iterator)
        except LegacyCheckpointError:
            raise
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"the best checkpoint (step {best}) could not be restored ({_reason(error)})") from None

    def _restore_step(self, step: int, template: dict[str, Any], iterator) -> dict[str, Any]:
        saved = self.saved_tree(step)
        if _legacy(saved):
            raise LegacyCheckpointError(
                f"checkpoint at step {step} in {self.directory} was written by jxformers before "
                f"checkpoints stored arrays by tree path (its parameters are a list by position) and "
                f"cannot be restored safely. Retrain in a new work directory, or check out the older "
                f"jxformers version to use or export it."
            )
        compare_trees(saved, template)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        # Before the restore, not once it failed: a failed read's siblings can finish into
        # orbax's closed loop while the restore is still unwinding (seen under load: 2 of 3
        # bit flips printed their reports with the filter installed in the except clause).
        _drop_late_reads()
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), data=grain.checkpoint.CheckpointRestore(iterator)
            ),
        )
        state = restored["state"]
        inner = int(np.asarray(jax.device_get(state[STEP_KEY]))) if STEP_KEY in state else step
        if inner != step:
            # another run's (or another step's) checkpoint copied in under this name: restoring
            # it would resume a different history and later overwrite real checkpoints with it
            raise ValueError(f"the state inside is step {inner}, not {step}")
        if (self.directory / str(step) / CHECKSUMS_ITEM).exists():
            saved = self.manager.restore(step, args=ocp.args.Composite(**{CHECKSUMS_ITEM: ocp.args.JsonRestore()}))
            # grain's file name for this process's position (grain.checkpoint.CheckpointHandler)
            position = (
                self.directory / str(step) / "data" / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
            )
            checksums.verify(saved[CHECKSUMS_ITEM], _names(state), position.read_text(), self.run)
        if self.records_per_step is not None and hasattr(iterator, "records_consumed"):
            consumed, expected = iterator.records_consumed(), step * self.records_per_step
            if consumed != expected:  # an edited position (the digest finds it too, where one was stored)
                raise ValueError(
                    f"its data position has consumed {consumed} records, not step {step} x "
                    f"{self.records_per_step} rows = {expected}"
                )
        floats = [x for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.floating)]
        # a jitted reduction: the arrays may be sharded over the devices of several processes
        if floats and not bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(floats)):
            raise ValueError("non-finite values in the saved state")
        return state

    def saved_tree(self, step: int):
        """The saved state's tree of array metadata (shape, dtype) at `step`, read without
        loading any values."""
        metadata = self.manager.item_metadata(step)["state"]
        if metadata is None:
            raise ValueError(f"no readable state metadata at step {step}")
        return metadata.tree if hasattr(metadata, "tree") else metadata

    def _set_aside(self, step: int, reason: str) -> pathlib.Path:
        """Move a damaged checkpoint out of the manager's directory (kept for inspection;
        its step can then be saved again). A ValueError saying what to do when it cannot
        be moved: training on would later fail to save that step again."""
        aside = self._move_aside(step, reason)
        self.manager.reload()
        return aside

    def _move_aside(self, step: int, reason: str) -> pathlib.Path:
        aside = self.directory.parent / f"{self.directory.name}_damaged" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            aside.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), aside)
        except OSError as error:
            raise ValueError(
                f"checkpoint at step {step} could not be restored ({reason}) nor moved aside to {aside.parent} "
                f"({error.strerror}: {error.filename}); move or delete {self.directory / str(step)} by hand, "
                "then rerun to resume from the previous checkpoint"
            ) from None
        return aside

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
