"""A parent process for each process of a multi-process run. When process 0, which holds
JAX's coordination service, dies, JAX ends every other process within a second with
SIGABRT and a C++ stack trace (its error polling aborts; jaxlib's
`missed_heartbeat_callback`, the hook meant for this, cannot be given from Python: it
fails with std::bad_cast). `jxformers train` with several processes therefore runs its
own command again as a child (`supervise`), passes the child's stderr through, and turns
that abort into one line and status 1.

Signals. SIGTERM is passed on to the child: JAX's preemption handler there takes a repeat
as the same notice, so a SIGTERM the child also got from its scheduler does no harm.
SIGINT is passed on only when the child has not acknowledged one within
`FORWARD_AFTER_S`: a terminal's Ctrl-C reaches both (one process group), and a second
SIGINT would stop the child without saving. The child dies with its parent
(`watch_parent`): it reads a pipe the parent holds open and kills itself when the pipe
closes, so a killed parent (a scheduler killing the pid it started) is a killed process,
as without the supervisor.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO

from jxformers._terminal import STDERR_IS_TERMINAL, stderr_is_terminal

# In the child's environment: the descriptor of the pipe from its parent (`watch_parent`).
SUPERVISED = "JXFORMERS_SUPERVISED"
# JAX's line before it ends a process whose coordination service failed (client.h: "...
# detected fatal errors" and SIGABRT; "... detected failure" and SIGSEGV in other versions).
ABORT = b"Terminating process because the JAX distributed service detected"
# JAX's error line just before that one: held back until the next line says whether it is
# the abort's (then dropped with it) or not (then passed on).
PRELUDE = b"Polled an error from coordination service"
# The child's lines acknowledging a SIGINT (loop._Signals).
ACKNOWLEDGED = (b"SIGINT received", b"second SIGINT")
FORWARD_AFTER_S = 1.0


class StderrFilter:
    """The child's stderr, passed through as it comes (a line ends at '\\n' or '\\r', so
    a progress bar is redrawn at once) until JAX's abort line: that line, the error line
    before it and whatever follows it (the C++ stack) are held back; `reason` and `tasks`
    read JAX's status from them."""

    def __init__(self, out: BinaryIO | io.BufferedIOBase):
        self.out = out
        self.pending = b""
        self.aborted = False
        self.held: list[bytes] = []
        self.prelude: list[bytes] = []
        self.acknowledged = 0  # SIGINTs the child said it received

    def feed(self, data: bytes) -> None:
        parts = re.split(rb"(?<=[\r\n])", self.pending + data)
        self.pending = parts.pop()  # the unfinished line ('' when the data ended one)
        for line in parts:
            self._line(line)

    def close(self) -> None:
        if self.pending:
            self._line(self.pending)
            self.pending = b""
        if not self.aborted:
            self._write(*self.prelude)
        self.prelude = []

    def _line(self, line: bytes) -> None:
        if self.aborted or ABORT in line:
            self.aborted = True
            self.held.append(line)
            return
        if PRELUDE in line:
            self.prelude.append(line)
            return
        self.acknowledged += sum(ack in line for ack in ACKNOWLEDGED)
        self._write(*self.prelude, line)
        self.prelude = []

    def _write(self, *lines: bytes) -> None:
        for line in lines:
            self.out.write(line)
        self.out.flush()

    def reason(self) -> str:
        """JAX's status for the abort, its first sentence on one line ("UNAVAILABLE:
        Failed to send RPC to coordination service"); '' when it gave none."""
        text = " ".join(b"".join(self.held).decode("utf-8", "replace").split())
        found = re.search(r"Status: (.+?)(?:\. |\.$|$)", text)
        return found.group(1).strip()[:240] if found else ""

    def tasks(self) -> list[int]:
        """The processes JAX's status names as unhealthy ("/job:jax_worker/replica:0/task:3")."""
        text = b"".join(self.held).decode("utf-8", "replace")
        return sorted({int(n) for n in re.findall(r"/task:(\d+)", text)})


def supervise(command: list[str], describe: Callable[[str, list[int]], str]) -> int:
    """Run `command` as a child and return its exit status (128 + n for signal n). When
    JAX ended it for a failed coordination service, print `describe(reason, tasks)` (one
    line; JAX's status and the processes it names) in place of JAX's trace and return 1."""
    read_end, write_end = os.pipe()  # the child's lifeline: closed when this process dies
    env = os.environ | {SUPERVISED: str(read_end), STDERR_IS_TERMINAL: "1" if stderr_is_terminal() else "0"}
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, pass_fds=(read_end,))
    os.close(read_end)
    assert child.stderr is not None
    stream = StderrFilter(sys.stderr.buffer)
    lock = threading.RLock()  # an RLock: the signal handlers run in the main thread, maybe inside feed
    received = 0  # SIGINTs this process got

    def forward_sigint() -> None:
        with lock:
            if stream.acknowledged < received and child.poll() is None:
                stream.acknowledged += 1  # counted now: the child's line comes later
                child.send_signal(signal.SIGINT)

    def on_sigint(signum, frame) -> None:
        nonlocal received
        with lock:
            received += 1
        timer = threading.Timer(FORWARD_AFTER_S, forward_sigint)
        timer.daemon = True
        timer.start()

    def on_sigterm(signum, frame) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)

    old = {signal.SIGINT: signal.signal(signal.SIGINT, on_sigint)}
    old[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while data := os.read(child.stderr.fileno(), 65536):
            with lock:
                stream.feed(data)
        stream.close()
        status = child.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        os.close(write_end)
    if stream.aborted:
        print(describe(stream.reason(), stream.tasks()), file=sys.stderr, flush=True)
        return 1
    return 128 - status if status < 0 else status


def watch_parent() -> None:
    """In a supervised child: end this process (SIGKILL) when its parent dies. Does
    nothing in a process no supervisor started."""
    fd = os.environ.pop(SUPERVISED, None)  # not for this process's own children
    if fd is None:
        return

    def wait() -> None:
        while os.read(int(fd), 1):  # the parent never writes: returns b"" once it is gone
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="jxformers-parent-watch", daemon=True).start()
