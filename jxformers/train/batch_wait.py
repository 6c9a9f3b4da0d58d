"""Waiting for the next training batch with a bound, signals honoured.

With `data.workers` > 0, grain's worker processes make the records, and the training
process blocks in `next(iterator)` until they arrive: a worker that is stopped (`kill
-STOP`, a debugger) or stuck used to stall training for ever, deaf to SIGTERM. Here the
batch is fetched by a helper thread while the training thread waits in short slices, so
it can give up after `data.batch_timeout` seconds with an error naming the stopped
worker processes and the setting, or leave the wait when a signal asks the run to stop.

    fetch = BatchFetcher(iterator, timeout_s=300.0, stop_requested=lambda: signals.received is not None)
    position = Position(iterator.get_state())   # for a checkpoint, should the wait be cut short
    batch = fetch()   # the batch, or None when a stop was requested while waiting
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class DataStallError(ValueError):
    """No batch came from the data workers within `data.batch_timeout` seconds."""


# How often (seconds) the waiting thread looks at the clock and at the stop request.
_POLL_S = 0.1


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` in /proc (R running, S sleeping, T stopped, t
    traced, Z zombie, ...), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stopped_workers() -> list[int]:
    """The pids of this process's multiprocessing children (grain's workers) that are
    stopped (state T or t)."""
    return sorted(p.pid for p in multiprocessing.active_children() if p.pid and process_state(p.pid) in ("T", "t"))


def _kill_stopped_workers() -> list[int]:
    """SIGKILL the stopped workers (a stopped process never exits, and closing the loader
    waits for its workers to exit); their pids."""
    stopped = stopped_workers()
    for pid in stopped:
        os.kill(pid, signal.SIGKILL)
    return stopped


class BatchFetcher:
    """`next(iterator)` on a helper thread, waited for at most `timeout_s` seconds (see
    the module docstring). Each call fetches one batch; one fetch at a time."""

    def __init__(self, iterator: Iterator[Any], *, timeout_s: float | int, stop_requested: Callable[[], bool]):
        self.iterator, self.timeout_s, self.stop_requested = iterator, timeout_s, stop_requested
        self._asks: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _serve(self) -> None:
        while self._asks.get():
            try:
                self._answers.put((True, next(self.iterator)))
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread, which raises it
                self._answers.put((False, error))

    def __call__(self) -> Any:
        """The next batch; None when `stop_requested()` turned True while waiting (the
        fetch is abandoned: do not call again); DataStallError after `timeout_s`."""
        if self._thread is None:  # a daemon: a fetch stuck for ever never holds up the exit
            self._thread = threading.Thread(target=self._serve, name="jxformers-batch-fetch", daemon=True)
            self._thread.start()
        self._asks.put(True)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                ok, value = self._answers.get(timeout=_POLL_S)
            except queue.Empty:
                if self.stop_requested():  # stopped workers are killed by close(), before the loader closes
                    return None
                if time.monotonic() > deadline:
                    raise DataStallError(self._stall_message()) from None
                continue
            if not ok:
                raise value
            return value

    def _stall_message(self) -> str:
        stopped = _kill_stopped_workers()
        if stopped:
            why = (
                f"data worker process(es) {stopped} are stopped (kill -STOP or a debugger; they were killed so "
                "that the run can end)"
            )
        else:
            why = "the data workers are stuck, or a record takes longer than that to make"
        return (
            f"no training batch within {self.timeout_s:g} s (data.batch_timeout): {why}. The last checkpoint "
            "is kept; rerun to resume (raise data.batch_timeout if records are slow to make)"
        )

    def close(self) -> None:
        """End the helper thread once its fetch (if any) returns, and kill stopped workers:
        the loader, closed next, would wait for them for ever."""
        if self._thread is not None:
            self._asks.put(False)
        _kill_stopped_workers()


class Position:
    """An iterator's position (`get_state()` bytes) taken before a fetch: what a
    checkpoint saves for the data when the run stops while that fetch is still waiting
    (the iterator itself is then busy on the helper thread)."""

    def __init__(self, state: bytes):
        self.state = state

    def get_state(self) -> bytes:
        return self.state
