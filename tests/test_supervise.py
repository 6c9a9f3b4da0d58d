"""jxformers.train.supervise: the parent process of each process of a multi-process run
(issue 37 item 4). Its stderr filter, the line it prints for JAX's abort, exit statuses,
the signals it passes on (once), and a child that dies with its parent. The whole path,
a real two-process run whose coordinator is killed, is in tests/test_sharding.py."""

from __future__ import annotations

import io
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jxformers.train import supervise

ROOT = pathlib.Path(__file__).parents[1]
# The module loaded by its path in the processes these tests start: importing the package
# jxformers.train imports jax, seconds a process.
LOAD = (
    "import importlib.util; spec = importlib.util.spec_from_file_location('supervise', "
    f"{str(ROOT / 'jxformers/train/supervise.py')!r}); sup = importlib.util.module_from_spec(spec); "
    "spec.loader.exec_module(sup)"
)

# What JAX 0.10 printed in process 1 when process 0 was killed (tests/test_sharding.py).
COORDINATOR_GONE = (
    b"E1127 15:04:04.020667 21938 coordination_service_agent.cc:289] Polled an error from coordination "
    b"service (this can be an error from this or another task).\n"
    b"F1127 15:04:04.020800 21938 client.h:80] Terminating process because the JAX distributed service "
    b"detected fatal errors. This most likely indicates that another task died; see the other task logs "
    b"for more details. Disable Python buffering, i.e. `python -u`, to be sure to see all the previous "
    b"output. absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader "
    b"task was preempted/died/restarted unexpectedly or this task is experiencing network issues.\n"
    b"*** Check failure stack trace: ***\n    @     0x7f0a2c3e1b2a  absl::log_internal::LogMessage::Die()\n"
)
# JAX's documentation's example of a peer that stopped sending heartbeats.
PEER_GONE = (
    b"F0926 17:26:32.075587  157988 client.h:77] Terminating process because the JAX distributed service "
    b"detected fatal errors. This most likely indicates that another task died; see the other task logs "
    b"for more details. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
    b"heartbeats):\n/job:jax_worker/replica:0/task:3\nThe tasks have crashed. Check the task logs.\n"
)


def filtered(*chunks: bytes) -> tuple[bytes, supervise.StderrFilter]:
    out = io.BytesIO()
    stream = supervise.StderrFilter(out)
    for chunk in chunks:
        stream.feed(chunk)
    stream.close()
    return out.getvalue(), stream


def test_the_filter_passes_lines_and_progress_through_and_holds_back_jaxs_abort():
    text = b"step 1 loss 2.0\nbar 10%\rbar 20%\r"
    data = text + COORDINATOR_GONE
    # fed in pieces cut anywhere: lines split across reads still pass whole
    out, stream = filtered(*(data[i : i + 7] for i in range(0, len(data), 7)))
    assert out == text
    assert stream.aborted
    assert stream.reason() == "UNAVAILABLE: Failed to send RPC to coordination service"
    assert stream.tasks() == []
    out, stream = filtered(PEER_GONE)
    assert out == b"" and stream.aborted and stream.tasks() == [3]
    assert stream.reason().startswith("UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats)")


def test_the_filter_releases_an_error_line_no_abort_follows_and_counts_acknowledgements():
    prelude = COORDINATOR_GONE.split(b"\n")[0] + b"\n"
    out, stream = filtered(prelude, b"jxformers train: SIGINT received: every process saves\n", prelude)
    assert out == prelude + b"jxformers train: SIGINT received: every process saves\n" + prelude
    assert not stream.aborted and stream.acknowledged == 1
    out, stream = filtered(b"partial line without end")
    assert out == b"partial line without end" and not stream.aborted


def run_supervised(child: str, *, timeout: float = 60) -> subprocess.CompletedProcess:
    """`supervise` in a process of its own, over a Python child running `child`."""
    driver = textwrap.dedent(
        f"""
        import sys
        {LOAD}
        describe = lambda reason, tasks: f"ONE LINE reason={{reason!r}} tasks={{tasks}}"
        sys.exit(sup.supervise([sys.executable, "-c", {child!r}], describe))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", driver], capture_output=True, env=env, timeout=timeout, cwd=ROOT)


def test_jaxs_abort_becomes_one_line_and_status_1():
    text = b"working\n" + COORDINATOR_GONE
    child = f"import os, sys; sys.stderr.buffer.write({text!r}); sys.stderr.flush(); os.abort()"
    done = run_supervised(child)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.decode().splitlines()
    assert lines == [
        "working",
        "ONE LINE reason='UNAVAILABLE: Failed to send RPC to coordination service' tasks=[]",
    ], done.stderr


@pytest.mark.parametrize(
    ("child", "status"),
    [
        ("import sys; print('out'); sys.exit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
        ("import os; os.abort()", 128 + signal.SIGABRT),  # another abort: passed on as it is
    ],
)
def test_the_childs_status_and_output_pass_through(child, status):
    done = run_supervised(child)
    assert done.returncode == status, done.stderr
    assert b"ONE LINE" not in done.stderr
    if status == 3:
        assert done.stdout == b"out\n"


# A child that prints each SIGINT and SIGTERM it gets, and its count 2 s after the first.
SIGNALLED = textwrap.dedent(
    """
    import signal, sys, time
    got = []
    def on(signum, frame):
        got.append(signum)
        if signum == signal.SIGINT:
            print("jxformers train: SIGINT received", file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, on)
    signal.signal(signal.SIGTERM, on)
    print("ready", flush=True)
    while not got:
        time.sleep(0.01)
    time.sleep(2)  # a SIGINT the parent passes on comes after FORWARD_AFTER_S = 1
    print(f"SIGINT x{got.count(signal.SIGINT)} SIGTERM x{got.count(signal.SIGTERM)}", flush=True)
    """
)


@pytest.mark.parametrize(
    ("sig", "to_group", "expected"),
    [
        (signal.SIGTERM, False, "SIGINT x0 SIGTERM x1"),  # passed on
        (signal.SIGINT, False, "SIGINT x1 SIGTERM x0"),  # the child did not get it: passed on after 1 s
        (signal.SIGINT, True, "SIGINT x1 SIGTERM x0"),  # a terminal's Ctrl-C reached both: not passed on
    ],
)
def test_signals_reach_the_child_once(sig, to_group, expected):
    driver = textwrap.dedent(
        f"""
        import sys
        {LOAD}
        sys.exit(sup.supervise([sys.executable, "-c", {SIGNALLED!r}], lambda reason, tasks: "unused"))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT,
        start_new_session=True,  # its own process group, which the test may signal whole
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        if to_group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert out.decode().strip() == expected, err


def test_the_child_dies_with_its_parent(tmp_path):
    """A scheduler that kills the process it started (the supervisor) kills the run: the
    child reads its parent's pipe (`watch_parent`) and ends itself when the pipe closes."""
    pid_file = tmp_path / "child.pid"
    child = (
        f"import os, time; {LOAD}; sup.watch_parent(); "
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    driver = textwrap.dedent(
        f"""
        import sys
        {LOAD}
        sys.exit(sup.supervise([sys.executable, "-c", {child!r}], lambda reason, tasks: "unused"))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", driver], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and parent.poll() is None, "the child did not start"
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by init, counts as gone)."""
    if not pathlib.Path("/proc").is_dir():  # not Linux: a zombie counts as alive until reaped
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_watch_parent_does_nothing_in_a_process_no_supervisor_started(monkeypatch):
    monkeypatch.delenv(supervise.SUPERVISED, raising=False)
    supervise.watch_parent()  # returns, starts no thread that could kill the test
    assert supervise.SUPERVISED not in os.environ
