"""The bounded wait for a training batch (jxformers/train/batch_wait.py; issue 37 item 3:
a data worker stopped with `kill -STOP` stalled training for ever, deaf to SIGTERM):
after `data.batch_timeout` an error names the stopped worker and the setting; a signal
cuts the wait short; a run stopped while waiting saves its last step at the data's
position before the batch it waited for, and resumes as an uninterrupted run."""

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from test_train import losses, write_config

from jxformers.train import load_experiment, train
from jxformers.train.batch_wait import BatchFetcher, DataStallError, process_state, stopped_workers


class Blocking:
    """An iterator whose items wait for `release`; `fail` makes the next one raise."""

    def __init__(self):
        self.release, self.count, self.fail = threading.Event(), 0, None

    def __iter__(self):
        return self

    def __next__(self):
        self.release.wait()
        if self.fail is not None:
            raise self.fail
        self.count += 1
        return self.count


def test_a_stopped_worker_ends_the_wait_with_its_pid_and_the_setting():
    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
    worker.start()
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(worker.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.pid in stopped_workers()
        source = Blocking()
        fetch = BatchFetcher(source, timeout_s=0.5, stop_requested=lambda: False)
        source.release.set()
        assert [fetch(), fetch()] == [1, 2]  # batches that come are returned
        source.release.clear()
        started = time.monotonic()
        stalled = rf"within 0.5 s \(data.batch_timeout\): .*\[{worker.pid}\] are stopped"
        with pytest.raises(DataStallError, match=stalled):
            fetch()
        assert 0.5 <= time.monotonic() - started < 5
        worker.join(timeout=10)  # killed: a stopped worker would hold up closing the loader for ever
        assert worker.exitcode == -signal.SIGKILL
        fetch.close()
        source.release.set()
    finally:
        if worker.is_alive():
            worker.kill()


def test_a_stop_request_cuts_the_wait_short_and_errors_pass_through():
    source, stop = Blocking(), threading.Event()
    fetch = BatchFetcher(source, timeout_s=60, stop_requested=stop.is_set)
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    assert fetch() is None and time.monotonic() - started < 5
    other = BatchFetcher(source, timeout_s=60, stop_requested=lambda: False)
    source.fail = StopIteration()
    source.release.set()
    with pytest.raises(StopIteration):
        other()
    fetch.close()
    other.close()


def _grain_workers(pid: int) -> list[int]:
    """grain's worker processes of a `jxformers train` process `pid`: its children started
    by multiprocessing's spawn (not its resource tracker)."""
    workers = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
            for child in children:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        workers.append(child)
        except OSError:
            pass
    return workers


@pytest.mark.heavy
def test_sigterm_while_a_stopped_worker_stalls_the_run_saves_and_the_run_resumes_like_an_uninterrupted_one(tmp_path):
    # A constant learning rate: the run is stopped long before its 4000 steps, and is
    # compared with one of a few steps, whose cosine schedule would differ.
    train_settings = {"steps": 4000, "schedule": "constant", "warmup_steps": 0}
    config = write_config(tmp_path, train=train_settings, checkpoint={"every": 1000})
    run = tmp_path / "run"
    flags = ["--set", "data.workers=1", "--set", "train.log_every=1", "--set", "checkpoint.async_save=false"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jxformers.tools.cli", "train", str(config), "--workdir", str(run), "--no-progress"]
        + flags,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run / "metrics.jsonl").exists() or '"loss"' not in (run / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "no step was logged"
            time.sleep(0.05)
        workers = [pid for pid in _grain_workers(proc.pid) if process_state(pid) is not None]
        assert workers, "no grain worker process"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(3)  # the records the worker made ahead run out: the run waits for a batch
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "stopped while waiting for a batch from the data workers" in err, err[-3000:]
    saved = int(err.split("saved step ")[1].split(";")[0])
    assert 0 < saved < 4000 and (run / "checkpoints" / str(saved)).is_dir(), err[-3000:]
    more = saved + 2
    resumed = train(load_experiment(config, [f"train.steps={more}"]), run, progress=False)
    straight = train(load_experiment(config, [f"train.steps={more}"]), tmp_path / "straight", progress=False)
    assert resumed["step"] == straight["step"] == more
    want = losses(tmp_path / "straight")
    got = {s: x for s, x in losses(run).items() if s > saved}
    assert got == {s: want[s] for s in range(saved + 1, more + 1)}, err[-2000:]
