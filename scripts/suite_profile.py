"""Where the test suite's time goes: a pytest plugin that writes, per test, its wall time
and JAX's tracing, lowering and XLA compilation seconds, and counts the compilations of
single jax.numpy / lax functions run eagerly (each eager primitive is compiled on its
own: about 50 ms of tracing, lowering and compiling on a 2-core CPU, and they were a third
of the suite's CPU time in November 2026).

    PYTHONPATH=scripts .venv/bin/python -m pytest -n 2 -q -p suite_profile
    .venv/bin/python scripts/suite_profile.py          # the summary of the last run

Each pytest process writes `.suite_profile/<worker>.json`; the summary reads them all.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib
import re
import sys
import time
from typing import Any

OUT = pathlib.Path(".suite_profile")
_EVENTS = {
    "jaxpr_trace_duration": "trace_s",
    "jaxpr_to_mlir_module_duration": "lower_s",
    "backend_compile_duration": "compile_s",
}


def _eager_names() -> set[str]:
    """Names of jax.numpy, lax, random and nn functions: a compilation named jit(<one of
    these>) is an eager call of it (jitted functions of the suite have other names)."""
    import jax
    import jax.numpy as jnp

    names = set(dir(jnp)) | set(dir(jax.lax)) | set(dir(jax.random)) | set(dir(jax.nn))
    return names | {f"_{n}" for n in names} | {"mul", "scatter-add", "_reduce_sum", "_reduce_max", "_reduce_all"}


class _Recorder(logging.Handler):
    """Reads JAX's "Compiling <name> ..." log lines (jax_log_compiles) and its duration events."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.eager = _eager_names()
        self.test: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.test and message.startswith("Compiling "):
            match = re.match(r"jit\((.*)\)$", message.split()[1])
            self.test["compiles"] += 1
            self.test["eager_compiles"] += bool(match and match.group(1) in self.eager)

    def duration(self, event: str, duration_secs: float, **_: str | int) -> None:
        key = _EVENTS.get(event.rsplit("/", 1)[-1])
        if self.test and key:
            self.test[key] += duration_secs


_recorder: _Recorder | None = None
_rows: list[dict[str, Any]] = []


def pytest_configure(config: Any) -> None:
    global _recorder
    import jax

    jax.config.update("jax_log_compiles", True)
    _recorder = _Recorder()
    for name in ("jax._src.interpreters.pxla", "jax._src.dispatch", "jax._src.pjit"):
        logger = logging.getLogger(name)
        logger.addHandler(_recorder)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the compile lines would flood the captured logs
    jax.monitoring.register_event_duration_secs_listener(_recorder.duration)


def pytest_runtest_setup(item: Any) -> None:
    if _recorder is not None:
        _recorder.test = dict.fromkeys(("compiles", "eager_compiles", *_EVENTS.values()), 0)
        _recorder.test |= {"test": item.nodeid, "start": time.perf_counter()}


def pytest_runtest_teardown(item: Any) -> None:
    if _recorder is not None and _recorder.test:
        row = dict(_recorder.test)
        row["wall_s"] = time.perf_counter() - row.pop("start")
        _rows.append(row)
        _recorder.test = {}


def pytest_sessionfinish(session: Any) -> None:
    if not _rows:
        return
    OUT.mkdir(exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (OUT / f"{worker}.json").write_text(json.dumps(_rows))


def summary(rows: list[dict[str, Any]], top: int = 25) -> str:
    """Totals, then the files by wall time with their compile seconds and eager compilations."""
    keys = ("wall_s", "trace_s", "lower_s", "compile_s", "compiles", "eager_compiles")
    total = {k: sum(r[k] for r in rows) for k in keys}
    lines = [" ".join(f"{k} {total[k]:.0f}" for k in keys) + f" over {len(rows)} tests (worker-seconds)"]
    files: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for row in rows:
        files[row["test"].split("::")[0]].update({k: row[k] for k in keys})
    lines.append(f"{'file':42} " + " ".join(f"{k:>14}" for k in keys))
    for name, sums in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"])[:top]:
        lines.append(f"{name:42} " + " ".join(f"{sums[k]:14.1f}" for k in keys))
    return "\n".join(lines)


if __name__ == "__main__":
    found = [row for path in sorted(OUT.glob("*.json")) for row in json.loads(path.read_text())]
    if not found:
        sys.exit(f"no {OUT}/*.json: run the suite with the plugin first (see {__file__}'s docstring)")
    print(summary(found))
