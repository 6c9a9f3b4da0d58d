"""Several processes (JAX's multi-controller runtime): each process runs the same
program on its own devices, and `jax.devices()` lists the devices of all of them.

    initialize(coordinator="10.0.0.1:1234", num_processes=2, process_id=0)   # explicit
    initialize()          # on a cluster JAX detects (Cloud TPU, SLURM, Open MPI, ...)

`initialize` starts `jax.distributed` (before anything else uses jax) with the explicit
arguments when given; without them, only when the environment names a cluster that
`jax.distributed.initialize()` detects by itself (`cluster_environment`); otherwise it
does nothing and the run is one process. On CPU it also turns on the gloo collectives,
which CPU devices of several processes need to talk.

In `train` (loop.py) every process reads its own rows of each batch (grain's
`ShardByJaxProcess`: process p takes rows p, p + P, ... of the global batch), the batch
is assembled with `jax.make_array_from_process_local_data`, every process saves its
shards of each checkpoint (orbax), and process 0 alone holds the work directory's lock,
writes config.yaml, metrics.jsonl and TensorBoard, and prints progress.

`watch_peers` (started by the CLI after `initialize`) notices a process that went silent
(killed, its host gone) and ends this one with one line and status 1, before JAX's own
heartbeat check would end it with SIGABRT and a C++ stack trace.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

# Environment variables by which `jax.distributed.initialize()` finds a cluster by itself
# (jax._src.clusters): SLURM, Open MPI / mpirun, Cloud TPU VMs, Kubernetes (JobSet).
CLUSTER_VARIABLES = {
    "SLURM_JOB_ID": "SLURM",
    "OMPI_MCA_orte_hnp_uri": "Open MPI",
    "PMI_RANK": "MPICH",
    "TPU_WORKER_HOSTNAMES": "Cloud TPU",
    "CLOUD_TPU_TASK_ID": "Cloud TPU",
    "JOBSET_NAME": "Kubernetes JobSet",
    "JAX_COORDINATOR_ADDRESS": "JAX_COORDINATOR_ADDRESS",
}


def cluster_environment() -> str | None:
    """The name of the cluster the environment names (see CLUSTER_VARIABLES), or None.
    A SLURM allocation of one task is not a cluster."""
    for name, cluster in CLUSTER_VARIABLES.items():
        if os.environ.get(name):
            if cluster == "SLURM" and int(os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_NPROCS", "1"))) < 2:
                continue
            if cluster == "Cloud TPU" and "," not in os.environ.get("TPU_WORKER_HOSTNAMES", "a,b"):
                continue  # a single-host TPU VM
            return cluster
    return None


# How long (seconds) a process waits for all processes to connect to the coordinator, and
# after how long without news a process counts as dead (JAX's own defaults; the CLI's
# --init-timeout and --heartbeat-timeout).
INIT_TIMEOUT_S = 300
HEARTBEAT_TIMEOUT_S = 100
# JAX's own deadlines (connecting, heartbeats) come this much after ours, so ours (one
# line, exit 1) speaks first: JAX's end the process with SIGABRT and a C++ stack trace.
_JAX_DEADLINE_MARGIN_S = 30


def several_processes(coordinator: str | None, num_processes: int | None) -> bool:
    """Whether `initialize(coordinator, num_processes, ...)` would start several
    processes: more than one asked for, or none asked for on a cluster JAX detects."""
    if coordinator is not None or num_processes is not None:
        return num_processes is not None and num_processes > 1
    return cluster_environment() is not None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    init_timeout: float | int = INIT_TIMEOUT_S,
    heartbeat_timeout: float | int = HEARTBEAT_TIMEOUT_S,
) -> bool:
    """Start jax.distributed (see the module docstring); True when this is one of several
    processes. ValueError when only some of the explicit arguments are given, or a
    timeout is not positive. A process whose peers have not all connected within
    `init_timeout` seconds prints one line saying so and exits with status 1.
    `heartbeat_timeout` is `watch_peers`' (how long a process may stay silent); JAX's own
    heartbeat check gets a margin beyond it."""
    for name, value in (("--init-timeout", init_timeout), ("--heartbeat-timeout", heartbeat_timeout)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds; got {value}")
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"--coordinator, --num-processes and --process-id go together; missing {missing}")
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"--process-id must be in [0, --num-processes); got {process_id} of {num_processes}")
        if num_processes == 1:
            return False
        where = f"process {process_id} of {num_processes}: not every process connected to the coordinator {coordinator}"
    elif cluster_environment() is None:
        return False
    else:
        where = f"not every process of the {cluster_environment()} job connected to its coordinator"
    _cpu_collectives()
    message = (
        f"jxformers train: {where} within {init_timeout:g} s (--init-timeout); start every process with the "
        "same --coordinator and --num-processes (a process that died at start-up says why in its own log)"
    )
    with _deadline(init_timeout, message):
        jax.distributed.initialize(
            coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=math.ceil(init_timeout) + _JAX_DEADLINE_MARGIN_S,
            heartbeat_timeout_seconds=math.ceil(heartbeat_timeout) + _JAX_DEADLINE_MARGIN_S,
        )
    return jax.process_count() > 1


@contextlib.contextmanager
def _deadline(seconds: float, message: str) -> Iterator[None]:
    """Print `message` and exit with status 1 if the body has not returned after
    `seconds` (a timer thread: jax.distributed's connect waits in C++ with the GIL
    released, and its own deadline aborts the process)."""
    timer = threading.Timer(seconds, lambda: (print(message, file=sys.stderr, flush=True), os._exit(1)))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# Each process's liveness counter, in the coordination service's key-value store (held by
# process 0, the coordinator, for the life of one launch); DONE once its run has ended.
_ALIVE = "jxformers/alive/"
_DONE = "done"


class Liveness:
    """Per peer, the local (monotonic) time its counter last changed: a peer unchanged for
    `timeout` seconds is silent; one that wrote DONE has finished (processes end at
    slightly different times) and is never silent. Kept apart from the thread and the
    store so that the bookkeeping is tested without processes."""

    def __init__(self, peers: list[int], timeout: float | int, now: float):
        self.timeout = timeout
        self.value: dict[int, str | None] = dict.fromkeys(peers)
        self.changed = dict.fromkeys(peers, now)  # a peer that never wrote counts from the start
        self.failing_since: float | None = None  # since when the store has not answered

    def saw(self, values: Mapping[int, str], now: float) -> None:
        """The store answered with every process's counter."""
        self.failing_since = None
        for peer, old in self.value.items():
            new = values.get(peer)
            if new != old:
                self.value[peer], self.changed[peer] = new, now

    def failed(self, now: float) -> None:
        """The store did not answer (its holder, process 0, gone or unreachable)."""
        if self.failing_since is None:
            self.failing_since = now

    def silent(self, now: float) -> dict[int, float]:
        """{peer: seconds since its counter changed} for those silent `timeout` s or more;
        none while the store does not answer (then nothing is known of the peers, and
        `unreachable` blames the store's holder)."""
        if self.failing_since is not None:
            return {}
        return {
            peer: now - changed
            for peer, changed in self.changed.items()
            if self.value[peer] != _DONE and now - changed >= self.timeout
        }

    def unreachable(self, now: float) -> float | None:
        """Seconds the store has not answered, once that is `timeout` or more; else None."""
        if self.failing_since is not None and now - self.failing_since >= self.timeout:
            return now - self.failing_since
        return None


class PeerWatch:
    """A daemon thread that, every `interval` s, bumps this process's counter in the
    coordination service's store and reads every process's; a peer silent for `timeout`
    s, or a store that has not answered for as long, ends this process with one line and
    status 1. Without it a killed peer leaves the others waiting in a collective until
    JAX's heartbeat check aborts them (SIGABRT, a C++ stack trace). `stop(done=True)` at
    the end of a run that finished (or stopped together on SIGTERM) tells the others
    this process is not silent but done. `end(message)` ends the process (a test's stand-in
    records it)."""

    def __init__(
        self,
        client: Any,
        me: int,
        count: int,
        timeout: float | int,
        coordinator: str | None,
        end: Callable[[str], None] | None = None,
    ):
        self.client, self.me, self.count, self.timeout = client, me, count, timeout
        self.coordinator, self.end = coordinator, end or _end_process
        self.interval = min(5.0, timeout / 4)
        self.liveness = Liveness([p for p in range(count) if p != me], timeout, time.monotonic())
        self._counter = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jxformers-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        self._counter += 1
        self.client.key_value_set(f"{_ALIVE}{self.me}", str(self._counter), allow_overwrite=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                found = self.client.key_value_dir_get(_ALIVE)
            except Exception:  # noqa: BLE001 - any failure of the store is "no news"
                self.liveness.failed(time.monotonic())
            else:
                values = {int(p): value for key, value in found if (p := key.rsplit("/", 1)[-1]).isdigit()}
                self.liveness.saw(values, time.monotonic())
            message = self.verdict(time.monotonic())
            if message is not None and not self._stop.is_set():
                self.end(message)
                return

    def verdict(self, now: float) -> str | None:
        """The line that ends this process, or None while every peer is heard."""
        me = f"jxformers train: process {self.me} of {self.count}"
        rerun = (
            "this run stops here; run the same `jxformers train` command on every process again to resume "
            "from the last checkpoint"
        )
        waited = self.liveness.unreachable(now)
        if waited is not None:
            where = f" at {self.coordinator}" if self.coordinator else ""
            return (
                f"{me}: the coordinator (process 0{where}) has not answered for {waited:.0f} s "
                f"(--heartbeat-timeout {self.timeout:g}): it was killed, or its host is gone; {rerun}"
            )
        silent = self.liveness.silent(now)
        if not silent:
            return None
        if len(silent) == 1:
            [(peer, seconds)] = silent.items()
            who = f"process {peer} has been silent for {seconds:.0f} s"
        else:
            who = "processes " + ", ".join(f"{p} ({s:.0f} s)" for p, s in sorted(silent.items())) + " have been silent"
        return f"{me}: {who} (--heartbeat-timeout {self.timeout:g}): killed, or its host is gone; {rerun}"

    def wait_for_verdict(self) -> None:
        """After an error in a collective (gloo's "Connection closed by peer"), which a
        dead peer causes sooner than the timeout: give the thread the time to name the
        silent process (it ends this one). Returns when no peer fell silent."""
        self._thread.join(self.timeout + 2 * self.interval)

    def hold_thread_errors(self) -> Callable[[], None]:
        """Make a failed collective in a background thread (orbax's async save syncing
        the processes, say) wait for the verdict as the main thread does, before its
        traceback is printed: a dead peer then ends this process with the one line, not
        a traceback first (seen in 1 of 3 killed peers). Other errors print as before.
        Returns the function that puts the previous `threading.excepthook` back."""
        from jax.errors import JaxRuntimeError

        previous = threading.excepthook

        def hook(args) -> None:
            if isinstance(args.exc_value, JaxRuntimeError):
                self.wait_for_verdict()  # ends the process with its line if a peer is silent
            previous(args)

        threading.excepthook = hook

        def restore() -> None:
            threading.excepthook = previous

        return restore

    def stop(self, *, done: bool) -> None:
        """Stop watching; `done`: this process finished its run, tell the others so."""
        self._stop.set()
        self._thread.join(self.timeout)  # at most one exchange with the store to wait for
        if done:
            with contextlib.suppress(Exception):
                self.client.key_value_set(f"{_ALIVE}{self.me}", _DONE, allow_overwrite=True)


def _end_process(message: str) -> None:
    """One line, status 1, at once: the main thread may be stuck in a collective, and
    unwinding would wait for it (and JAX's shutdown for the dead peer)."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def watch_peers(timeout: float | int) -> PeerWatch | None:
    """A started `PeerWatch` over every process of this run, or None with one process."""
    if jax.process_count() < 2:
        return None
    from jax._src import distributed as jax_distributed  # the client: the public API has no store

    state = jax_distributed.global_state
    client = getattr(state, "client", None)
    if client is None:  # a JAX whose runtime moved: its own heartbeat check is left
        return None
    coordinator = getattr(state, "coordinator_address", None)
    return PeerWatch(client, jax.process_index(), jax.process_count(), timeout, coordinator).start()


def _cpu_collectives() -> None:
    """CPU devices of several processes exchange data through gloo (a no-op elsewhere)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def is_main() -> bool:
    """Process 0: the one that writes logs."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait for every process (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@functools.cache
def code_digest() -> str:
    """A hash of jxformers' own source files: two processes that would run different code."""
    root = pathlib.Path(__file__).parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


_WORDS = 4  # 128 bits of each sha256, as uint32 words: what the processes exchange
STARTED_WITH = ("config", "code")  # what processes of one run must share, in `started_with`'s order


def _words(value: Any) -> np.ndarray:
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return np.frombuffer(hashlib.sha256(text).digest()[: 4 * _WORDS], np.uint32)


def disagreements(gathered: np.ndarray) -> dict[str, list[int]]:
    """{name in STARTED_WITH: the processes whose hash of it differs from process 0's},
    from the `started_with` words of every process, `[processes, words]`."""
    out = {}
    for i, name in enumerate(STARTED_WITH):
        part = gathered[:, i * _WORDS : (i + 1) * _WORDS]
        differ = [p for p in range(part.shape[0]) if not np.array_equal(part[p], part[0])]
        if differ:
            out[name] = differ
    return out


def started_with(config: Mapping[str, Any]) -> np.ndarray:
    """This process's words for `check_same_run`: the hashes of STARTED_WITH's values."""
    values = {"config": config, "code": code_digest()}
    return np.concatenate([_words(values[name]) for name in STARTED_WITH])


def check_same_run(config: Mapping[str, Any]) -> None:
    """Refuse, on every process alike, processes started differently: the resolved
    `config` and jxformers' code, hashed on each process and compared with process 0's.
    Processes that disagree run different programs and wait for each other's
    collectives for ever (launched with train.steps 120 and 60, both hung at step 60).
    Nothing with one process."""
    if jax.process_count() < 2:
        return
    from jax.experimental import multihost_utils

    mine = started_with(config)
    found = disagreements(np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, mine.size))
    if found:
        what = "; ".join(f"its {name} differs on processes {processes}" for name, processes in found.items())
        raise ValueError(
            f"process {jax.process_index()} of {jax.process_count()}: the processes were not started alike "
            f"(compared with process 0: {what}); launch every process with the same config file, the same "
            "overrides and the same jxformers code"
        )


def from_process_zero(text: str | None, *, size: int = 64) -> str:
    """Process 0's `text` (ASCII, at most `size` bytes) on every process; the others pass
    None. One process: `text` itself."""
    if jax.process_count() < 2:
        assert text is not None
        return text
    from jax.experimental import multihost_utils

    mine = np.zeros(size, np.uint8)
    if text is not None:
        raw = text.encode("ascii")
        if len(raw) > size:
            raise ValueError(f"{text!r} is longer than {size} bytes")
        mine[: len(raw)] = np.frombuffer(raw, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine))).rstrip(b"\0").decode("ascii")


def preemption_service() -> bool:
    """Whether JAX's preemption service runs: several processes and
    `jax_enable_preemption_service` on (the default). `jax.distributed.initialize` then
    installs a C-level SIGTERM handler that tells every process of the notice, and
    `reached_preemption_sync_point(step)` turns True on all of them at the same step."""
    if jax.process_count() < 2:
        return False
    from jax._src import distributed as jax_distributed  # the public call raises instead of telling

    return jax_distributed.global_state.preemption_sync_manager is not None


def reached_preemption_sync_point(step: int) -> bool:
    """True on every process at the same step once any process got SIGTERM (JAX's
    preemption sync point; every process must call it at every step)."""
    from jax.experimental import multihost_utils

    return multihost_utils.reached_preemption_sync_point(step)
