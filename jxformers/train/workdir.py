"""A run's work directory, checked before anything in it is read or written.

    WORKDIR/config.yaml   the resolved config of the run (written by `train`); `eval` and
                          `generate` read it, so they rebuild exactly the trained model
    WORKDIR/lock          held (flock) by the one `train` process using the directory;
                          it says who: pid, host, since when
    WORKDIR/checkpoints/  orbax checkpoints (checkpoint.py)
    WORKDIR/metrics.jsonl one JSON object per logged record (`open_metrics_log`,
                          `read_metrics_log`)
    WORKDIR/tensorboard/  the same scalars as TensorBoard event files
    WORKDIR/run_id        the run's identity (`run_identity`), kept in every checkpoint

`check_writable` refuses, before anything is written, a directory where any of these
could not be written.

A rerun of `train` may change only what leaves the saved state valid (`RESUMABLE`);
anything else is refused, naming what differs, before config.yaml is rewritten.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import pathlib
import socket
import tempfile
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

from jxformers.nn import ModelConfig
from jxformers.nn.config import legacy
from jxformers.train.checkpoint import CHECKSUMS_ITEM, CONFIG_FILE, CONFIG_ITEM
from jxformers.train.experiment import SECTIONS, Experiment, load_experiment, parse_override, read_yaml

CONFIG = "config.yaml"
CONVERTED_WEIGHTS = "model.eqx"  # jxformers.pretrained.bert.CONVERTED_WEIGHTS (a higher layer), beside
# the bare model config.yaml that `jxformers convert` writes without --experiment
LOCK = "lock"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
RUN_ID = "run_id"  # the run's identity: kept in every checkpoint, checked on restore
OWN_FILES = (CONFIG, LOCK, METRICS, RUN_ID)  # written by the run: never through a symbolic link
# What a rerun may change once checkpoints exist: none of these changes the saved state's
# tree, the data order or the meaning of the steps already taken (workers and a built
# split give the same records; the iterator state is rewritten for the worker count;
# model.attention.impl picks a kernel for the same function and the same parameters).
RESUMABLE = frozenset(
    {
        "data.workers",
        "data.batch_timeout",
        "data.path",
        "model.attention.impl",
        "model.decoder.cross_attention.impl",
        "train.steps",
        "train.learning_rate",
        "train.warmup_steps",
        "train.schedule",
        "train.weight_decay",
        "train.eval_every",
        "train.eval_batches",
        "train.log_every",
        "train.on_nonfinite",
        "train.max_consecutive_skips",
        "checkpoint.every",
        "checkpoint.keep",
        "checkpoint.async_save",
        "checkpoint.max_steps_in_flight",
        "checkpoint.best_metric",
        "checkpoint.best_mode",
        "mesh.data",
        "mesh.fsdp",
        "mesh.tensor",
        "mesh.expert",  # checkpoints restore onto another mesh
    }
)
# Labels, not settings: the resolved sections are what is compared.
_LABELS = ("name", "preset")
# Model fields that come from the data: the saved config holds them, load_experiment refuses them.
_FROM_DATA = ("task", "vocab_size", "num_classes")
_ABSENT = "(absent)"


class WorkdirLocked(ValueError):
    """Another live process holds the work directory's lock."""


def check_workdir(path: str | os.PathLike, *, exists: bool) -> pathlib.Path:
    """`path` as a Path; a ValueError when it is a file, or (`exists`) when it is missing."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"work directory {str(path)!r} is a file, not a directory")
    if exists and not path.exists():
        raise ValueError(
            f"work directory {str(path)!r} does not exist: train first (jxformers train CONFIG --workdir {path})"
        )
    return path


def check_writable(workdir: pathlib.Path) -> None:
    """A ValueError, naming the path and what to do, when the run could not write in one
    of its directories: a file where it makes a directory, or a directory it cannot
    create files in (an unwritable checkpoints/ used to train until the first save, then
    hang there for minutes). Each existing one is tried with a file created and removed
    at once. (Its files are opened at start-up: an error there is an OSError the CLI
    prints as one line.) The run's own files are never written through a symbolic
    link: a planted link would make it truncate or append to another file."""
    for name in OWN_FILES:
        check_not_a_link(workdir / name)
    for name in ("", CHECKPOINTS, TENSORBOARD):
        folder = workdir / name
        if not folder.exists():
            continue  # created by the run, in a directory checked here
        if not folder.is_dir():
            raise ValueError(
                f"{folder} is a file where the run writes a directory: move it away or use another work directory"
            )
        try:
            fd, probe = tempfile.mkstemp(prefix=".jxformers-write-check-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as error:
            raise ValueError(
                f"cannot write in {folder} ({error.strerror}): the run writes there; make it writable "
                f"(chmod u+w) or use another work directory"
            ) from None


def check_not_a_link(path: pathlib.Path) -> None:
    """A ValueError when `path`, one of the run's own files, is a symbolic link."""
    if path.is_symlink():
        raise ValueError(
            f"{path} is a symbolic link (to {os.readlink(path)}): the run writes its own files, never "
            "through a link; remove the link or use another work directory"
        )


def open_own(path: pathlib.Path, flags: int) -> int:
    """`os.open` of one of the run's own files, never through a symbolic link (a
    ValueError naming it, as `check_not_a_link`)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError:
        check_not_a_link(path)
        raise


def read_metrics_log(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `workdir/metrics.jsonl` in order ([] when there is none). A line
    that is not a JSON object (a write cut short by a crash or a full disk) is skipped
    with a warning naming the file and the line, instead of refusing the whole log."""
    path = pathlib.Path(workdir) / METRICS
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
        elif line.strip():
            warnings.warn(f"{path}:{number} is not a metrics record (a write cut short?): skipped", stacklevel=2)
    return records


def open_metrics_log(workdir: pathlib.Path) -> int:
    """A file descriptor appending to `workdir/metrics.jsonl`: never through a symlink
    (a planted link would append to another file), and with a line a crash cut short
    ended first, so the next record starts on a line of its own."""
    fd = open_own(workdir / METRICS, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":  # the last line was cut short
        write_line(fd, "")
    return fd


def write_line(fd: int, line: str) -> None:
    """`line` and a newline, appended in one write where the system allows (a reader sees
    whole records; `read_metrics_log` skips a line that a full disk cut)."""
    data = (line + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def check_history(workdir: pathlib.Path, experiment: Experiment, *, fresh: bool) -> bool:
    """Refuse to start a logged run again at step 0 because its checkpoints are gone
    (deleted or moved: the run would silently retrain and append a second history to
    metrics.jsonl), unless `fresh` asks for it; refuse `fresh` where checkpoints exist.
    Returns whether `set_history_aside` must move the old log before the new run writes."""
    if has_checkpoints(workdir):
        if fresh:
            raise ValueError(
                f"{workdir / CHECKPOINTS} holds checkpoints, which a fresh start would discard: "
                "resume without --fresh, or start in a new work directory"
            )
        return False
    records = read_metrics_log(workdir)
    # A save is logged when it starts; an async one is surely on disk once the next save
    # has started (orbax waits for the previous one), a synchronous one at once. A run
    # killed during its first save has none to lose: it starts again without a word.
    saves = [r["step"] for r in records if "checkpoint_save_ms" in r]
    confirmed = saves[-2:-1] if experiment.checkpoint.async_save else saves[-1:]
    if confirmed and not fresh:
        raise ValueError(
            f"{workdir / METRICS} logs a run to step {max(r['step'] for r in records)} with a checkpoint saved at "
            f"step {confirmed[0]}, but {workdir / CHECKPOINTS} holds none (deleted or moved?): put the "
            "checkpoints back to resume, or start again at step 0 with --fresh (Python: train(..., fresh=True)), "
            f"which keeps the old log as {METRICS}.<time>.old"
        )
    return fresh and (workdir / METRICS).exists()


def set_history_aside(workdir: pathlib.Path) -> pathlib.Path:
    """Move metrics.jsonl to metrics.jsonl.<UTC time>.old (a fresh start's log begins empty)."""
    aside = workdir / f"{METRICS}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.old"
    (workdir / METRICS).rename(aside)
    return aside


def has_checkpoints(workdir: pathlib.Path) -> bool:
    directory = workdir / CHECKPOINTS
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def config_in_checkpoints(workdir: pathlib.Path) -> tuple[int, dict[str, Any]] | None:
    """(step, the run's resolved config) stored in its newest checkpoint that holds one
    (checkpoint.CONFIG_ITEM), or None (no checkpoints, or all older than that)."""
    directory = workdir / CHECKPOINTS
    if not directory.is_dir():
        return None
    for step in sorted((int(p.name) for p in directory.iterdir() if p.name.isdigit()), reverse=True):
        path = directory / str(step) / CONFIG_ITEM / CONFIG_FILE
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # older than stored configs, or damaged: the previous one
        if isinstance(values, dict):
            return step, values
    return None


def runs_in_checkpoints(workdir: pathlib.Path) -> list[str]:
    """The run ids the checkpoints hold (in their checksums item), oldest step first;
    checkpoints from before run ids, or unreadable, are left out."""
    directory = workdir / CHECKPOINTS
    found = []
    for step in sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.is_dir() else ():
        try:
            run = json.loads((directory / str(step) / CHECKSUMS_ITEM / CHECKSUMS_ITEM).read_text()).get("run")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(run, str):
            found.append(run)
    return found


def read_run_identity(workdir: pathlib.Path) -> str | None:
    """The run's id from `workdir/run_id`, or None where there is none (a run from before
    run ids: its checkpoints are then restored without the check)."""
    path = workdir / RUN_ID
    if not path.exists():
        return None
    check_not_a_link(path)
    return path.read_text().strip() or None


def run_identity(workdir: pathlib.Path) -> str:
    """The run's id, made at its first start and written to `workdir/run_id` (process 0
    only calls this). Every checkpoint keeps it, and a checkpoint of another run (copied
    in under a step name this run uses) is then damage on restore. A run without
    checkpoints gets a new id; one whose run_id file is gone takes the id most of its
    checkpoints hold (the oldest first on a tie)."""
    ident = read_run_identity(workdir) if has_checkpoints(workdir) else None
    if ident is None:
        found = runs_in_checkpoints(workdir)
        ident = max(found, key=found.count) if found else uuid.uuid4().hex
        fd = open_own(workdir / RUN_ID, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            f.write(ident + "\n")
    return ident


def saved_config(workdir: pathlib.Path) -> dict[str, Any] | None:
    """The run's config.yaml as a dict; when that file is gone but a checkpoint holds the
    run's config, that one (a warning says so; `train` writes config.yaml again); None
    when there is neither."""
    path = workdir / CONFIG
    if not path.exists():
        stored = config_in_checkpoints(workdir) if has_checkpoints(workdir) else None
        if stored is None:
            return None
        warnings.warn(
            f"{path} is missing: using the run's config stored in its checkpoint of step {stored[0]}",
            stacklevel=2,
        )
        values = stored[1]
    else:
        values = read_yaml(path.read_text(), str(path))
    if not isinstance(values, dict):
        raise ValueError(f"{path}: not a YAML mapping; it should hold the run's resolved config")
    if "model" not in values and "vocab_size" in values and (workdir / CONVERTED_WEIGHTS).is_file():
        raise ValueError(
            f"{workdir} holds a model converted by `jxformers convert` ({CONFIG} is its model config, not a "
            f"run's): to evaluate or fine-tune it from the command line, convert it again with --experiment "
            f"CONFIG (the data and training settings it runs with), which makes the directory a run at step 0"
        )
    model = values.get("model")
    if isinstance(model, Mapping):  # resolved anew: an older version's flat keys or missing settings filled in
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", legacy.FlatConfigWarning)
            values["model"] = ModelConfig.from_dict(model).to_dict()
    return values


def write_config(workdir: pathlib.Path, experiment: Experiment) -> None:
    fd = open_own(workdir / CONFIG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump(experiment.raw, sort_keys=False))


def _flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(saved: Mapping, new: Mapping, *, section: str | None = None) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, new value)} for every resolved value that differs (in one
    `section` only, when given)."""
    # Both as they read back from config.yaml (tuples become lists).
    a, b = (
        {k: v for k, v in _flat(yaml.safe_load(yaml.safe_dump(dict(tree)))).items() if k.split(".")[0] not in _LABELS}
        for tree in (saved, new)
    )
    # A setting added after the run was saved reads as its default there, so that old runs
    # resume under a newer version unless the rerun asks for something else.
    defaults = _field_defaults()
    a |= {k: defaults[k] for k in b.keys() - a.keys() if k in defaults}
    keys = sorted(k for k in a.keys() | b.keys() if section is None or k.split(".")[0] == section)
    return {k: (a.get(k, _ABSENT), b.get(k, _ABSENT)) for k in keys if a.get(k, _ABSENT) != b.get(k, _ABSENT)}


def _field_defaults() -> dict[str, Any]:
    """{"section.field": default} of every config field that has a plain default."""
    out = {}
    for section, cls in SECTIONS.items() | {("model", ModelConfig)}:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                out[f"{section}.{f.name}"] = yaml.safe_load(yaml.safe_dump(f.default))  # as config.yaml reads back
    return out


def describe(changes: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {old!r} in the run, {new!r} now" for k, (old, new) in changes.items())


def check_rerun(workdir: pathlib.Path, experiment: Experiment) -> dict[str, tuple[Any, Any]]:
    """The changes of this rerun against the saved config (all in RESUMABLE), or a
    ValueError naming the others. Anything may change while no checkpoint exists."""
    saved = saved_config(workdir)
    if saved is None or not has_checkpoints(workdir):
        return {}
    changes = differences(saved, experiment.raw)
    refused = {k: v for k, v in changes.items() if k not in RESUMABLE}
    if refused:
        raise ValueError(
            f"the config changed since the checkpoints in {workdir} were written: {describe(refused)}. "
            f"Rerun with the run's config ({workdir / CONFIG}) or use a new work directory; a rerun may change "
            f"only {sorted(RESUMABLE)}."
        )
    return changes


def _base_config(saved: dict[str, Any]) -> dict[str, Any]:
    """The saved config as load_experiment input: no preset (already applied), no
    data-given model fields."""
    base = {k: copy.deepcopy(v) for k, v in saved.items() if k != "preset"}
    base["model"] = {k: v for k, v in (base.get("model") or {}).items() if k not in _FROM_DATA}
    train = base.get("train")
    if isinstance(train, dict) and _exceeds(train.get("warmup_steps"), train.get("steps")):
        # Versions before the warm-up was checked saved their default, 100, for shorter runs
        # too; it is the default now (null, cut to the run), and evaluation does not use it.
        train["warmup_steps"] = None
    return base


def _exceeds(warmup: Any, steps: Any) -> bool:
    numbers = all(isinstance(x, int) and not isinstance(x, bool) for x in (warmup, steps))
    return numbers and warmup > steps


def _overrides_for_saved(saved: dict[str, Any], overrides: Sequence[str]) -> list[str]:
    """The overrides without `preset=` (the saved config has it applied); another preset
    than the run's is refused."""
    kept = []
    for text in overrides:
        path, value = parse_override(text)
        if path != ["preset"]:
            kept.append(text)
        elif value != saved.get("preset"):
            raise ValueError(
                f"--set {text}: the run was trained with preset {saved.get('preset')!r}; a preset "
                f"cannot change after training (its model is in the checkpoints)"
            )
    return kept


# Model settings that evaluation and generation may change: they choose what runs at
# inference, not the parameters (LayerDrop's pruning, jxformers.nn.layouts).
INFERENCE_SETTINGS = frozenset({"model.stack.keep_layers", "model.stack.prune"})


def load_run_experiment(workdir: pathlib.Path, overrides: Sequence[str] = ()) -> Experiment:
    """The experiment of the run in `workdir` (its config.yaml), with `overrides` that
    leave the model alone (eval sizes, batch size; or `INFERENCE_SETTINGS`); one that
    changes the model is refused."""
    saved = saved_config(workdir)
    if saved is None:
        raise ValueError(
            f"{workdir} holds no {CONFIG} (is it a work directory of jxformers train?); for a run "
            f"from before config.yaml was saved, name its experiment: CONFIG --workdir {workdir}"
        )
    experiment = load_experiment(_base_config(saved), _overrides_for_saved(saved, overrides))
    changed = {k: v for k, v in differences(saved, experiment.raw, section="model").items()
               if k not in INFERENCE_SETTINGS}  # fmt: skip
    if changed:
        raise ValueError(
            f"--set would change the model the checkpoints in {workdir} were trained with "
            f"({describe(changed)}); only settings outside the model can change after training"
        )
    return experiment


def model_disagreement(run: Experiment, given: Experiment) -> str | None:
    """A note when a config named on the command line builds another model than the run's."""
    changed = differences(run.raw, given.raw, section="model")
    if not changed:
        return None
    return (
        f"the config given on the command line builds another model than the run's ({describe(changed)}); "
        f"using the run's config"
    )


def _holder(path: pathlib.Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('since', '?')}"


@contextlib.contextmanager
def workdir_lock(workdir: pathlib.Path) -> Iterator[None]:
    """Hold `workdir/lock` (an flock, which the kernel releases when its process dies, so
    a stale lock never blocks); a WorkdirLocked error names the holder."""
    path = workdir / LOCK
    fd = open_own(path, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WorkdirLocked(
                f"{workdir} is in use by another jxformers train ({_holder(path)}); wait for "
                f"it to finish or stop it, or use another work directory"
            ) from None
        except OSError as error:  # a file system without locks (some network mounts): run, but say so
            warnings.warn(
                f"cannot lock {path} ({error.strerror}); a second train on {workdir} would not be stopped", stacklevel=3
            )
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
            ).encode(),
        )
        yield
    finally:
        os.close(fd)  # closing releases the flock
