"""Inject faults into tiny training runs through the CLI and tabulate what happened
(issue 37's measure): each fault is injected `--repeat` times (at random steps, bytes or
moments where it has them), and each outcome is classified:

    exact resume   the rerun's per-step losses equal an uninterrupted run's, bit for bit
    fallback       the damaged checkpoint was named in a warning and an older one used
    clear error    the command stopped with one line naming what and where (no traceback)
    no effect      the fault touched nothing the run reads (e.g. a byte outside any array)
    SILENT         a different result without a word        (the goal: never)
    HANG           no answer within the time limit           (the goal: never)
    TRACEBACK      a raw Python traceback                    (the goal: never)

    python scripts/fault_injection.py --out docs/faults.md            # every fault, 3 times
    python scripts/fault_injection.py --only sigkill bitflip --repeat 1

Runs on a CPU in a few minutes (each run is a subprocess: jax starts and compiles each
time). Needs a user that file permissions apply to for `unwritable` (root writes anyway:
the fault is then reported as not injectable).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import platform
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

from jxformers.tools.help_text import description

STEPS, EVERY = 24, 4
TINY = {
    "name": "faults",
    "data": {"task": "copy", "train_size": 512, "eval_size": 16, "settings": {"max_len": 16, "symbols": 4}},
    "model": {"attention": "softmax", "d_model": 16, "num_heads": 2, "num_layers": 1, "ffn": {"d_ff": 32}},
    "train": {
        "batch_size": 8,
        "steps": STEPS,
        "learning_rate": 0.003,
        "warmup_steps": 2,
        "log_every": 1,
        "eval_every": 12,
        "eval_batches": 2,
    },
    "checkpoint": {"every": EVERY, "keep": 3, "async_save": False},
}
LIMIT_S = 180  # a command that has not answered by then is a HANG
PEER_TIMEOUT_S = 6  # --heartbeat-timeout of the two-process faults


Outcome = tuple[str, float, str]  # (kind, seconds, detail)


def cli(
    command: str, workdir: pathlib.Path, *args: str, config: pathlib.Path | None = None, limit: float = LIMIT_S
) -> tuple[int | None, str, str, float]:
    """(exit code or None for a hang, stdout, stderr, seconds) of `jxformers COMMAND`."""
    argv = [sys.executable, "-m", "jxformers.tools.cli", command]
    argv += [str(config)] if config else []
    argv += ["--workdir", str(workdir), *args]
    if command == "train":
        argv.append("--no-progress")
    began = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return None, out, err, time.perf_counter() - began
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - began


def losses(workdir: pathlib.Path) -> dict[int, float]:
    """{step: loss} of the run's log (the last record of a step logged twice)."""
    found = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def last_json(out: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


class Harness:
    def __init__(self, root: pathlib.Path, rng: random.Random):
        self.root, self.rng = root, rng
        self.config = root / "faults.yaml"
        self.config.write_text(yaml.safe_dump(TINY))
        self.reference = root / "reference"
        code, _, err, _ = cli("train", self.reference, config=self.config)
        if code != 0:
            raise SystemExit(f"the uninterrupted reference run failed:\n{err}")
        self.want = losses(self.reference)
        self.want_eval = last_json(cli("eval", self.reference)[1])
        self.count = 0
        self._parameters: list[bytes] | None = None

    def fresh(self) -> pathlib.Path:
        self.count += 1
        return self.root / f"run{self.count}"

    def copy(self) -> pathlib.Path:
        run = self.fresh()
        shutil.copytree(self.reference, run)
        return run

    def judge_rerun(self, run: pathlib.Path, code: int | None, err: str, seconds: float, how: str) -> Outcome:
        if code is None:
            return ("HANG", seconds, how)
        if "Traceback" in err:
            return ("TRACEBACK", seconds, err.strip().splitlines()[-1])
        code, _, err, more = cli("train", run, config=self.config)
        if code is None:
            return ("HANG", seconds + more, "the rerun")
        if "Traceback" in err:
            return ("TRACEBACK", seconds + more, err.strip().splitlines()[-1])
        got = losses(run)
        same = all(got.get(step) == loss for step, loss in self.want.items())
        return ("exact resume" if same else "SILENT", seconds, how)

    def judge_eval(self, run: pathlib.Path, expect: str) -> Outcome:
        """An eval after damage: a warning containing `expect` (fallback), the reference's
        numbers without one (no effect), or other numbers without one (SILENT)."""
        code, out, err, seconds = cli("eval", run)
        if code is None:
            return ("HANG", seconds, "")
        if "Traceback" in err:
            return ("TRACEBACK", seconds, err.strip().splitlines()[-1])
        if expect in err or "could not be restored" in err:
            reason = expect if expect in err else err.split("could not be restored", 1)[1].strip()[:80]
            return ("fallback", seconds, f"to step {last_json(out).get('step')}: {reason}")
        if code != 0:
            return ("clear error", seconds, err.strip().splitlines()[-1][:100])
        return ("no effect" if last_json(out) == self.want_eval else "SILENT", seconds, "")

    def refused(self, run: pathlib.Path, expect: str, *args: str, config: bool = True) -> Outcome:
        code, _, err, seconds = cli("train", run, *args, config=self.config if config else None)
        if code is None:
            return ("HANG", seconds, "")
        if "Traceback" in err:
            return ("TRACEBACK", seconds, err.strip().splitlines()[-1])
        ok = code != 0 and expect in err and len([x for x in err.splitlines() if x.strip()]) <= 3
        return ("clear error" if ok else "SILENT", seconds, err.strip().splitlines()[-1][:100] if err else "")

    # ------------------------------------------------------------------ the faults

    def signal_at_random_step(self, signum: int) -> Outcome:
        run, step = self.fresh(), self.rng.randint(3, STEPS - 3)
        argv = [sys.executable, "-m", "jxformers.tools.cli", "train", str(self.config), "--workdir", str(run)]
        process = subprocess.Popen([*argv, "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        began = time.perf_counter()
        while process.poll() is None and time.perf_counter() - began < LIMIT_S:
            if (run / "metrics.jsonl").exists() and max(losses(run), default=0) >= step:
                process.send_signal(signum)
                break
            time.sleep(0.05)
        try:
            _, err = process.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            return ("HANG", LIMIT_S, f"{signal.Signals(signum).name} at step {step}")
        return self.judge_rerun(
            run, process.returncode, err, time.perf_counter() - began, f"{signal.Signals(signum).name} near step {step}"
        )

    def sigkill(self) -> Outcome:
        return self.signal_at_random_step(signal.SIGKILL)

    def sigterm(self) -> Outcome:
        return self.signal_at_random_step(signal.SIGTERM)

    def latest(self, run: pathlib.Path) -> pathlib.Path:
        return max((p for p in (run / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))

    def bitflip(self) -> Outcome:
        """A bit of a parameter's stored value (found by its bytes in the array files;
        a random byte of them where no value is found: stored compressed)."""
        run = self.copy()
        files = sorted((self.latest(run) / "state").rglob("d/*"))
        value = self.rng.choice(self.parameter_bytes())
        start = self.rng.randrange(max(1, len(value) - 16))
        found = [(path, path.read_bytes().find(value[start : start + 16])) for path in files]
        hits = [(path, at + self.rng.randrange(16)) for path, at in found if at >= 0]
        if hits:
            target, where = hits[0]
        else:
            target = self.rng.choice(files)
            where = self.rng.randrange(target.stat().st_size)
        raw = bytearray(target.read_bytes())
        raw[where] ^= 1 << self.rng.randrange(8)
        target.write_bytes(bytes(raw))
        return self.judge_eval(run, "could not be restored")

    def parameter_bytes(self) -> list[bytes]:
        """The raw bytes of each parameter of the reference run's latest checkpoint."""
        if self._parameters is None:
            import equinox as eqx
            import jax
            import numpy as np

            from jxformers.train.loop import restore_model
            from jxformers.train.workdir import load_run_experiment

            model, _ = restore_model(load_run_experiment(self.reference), self.reference)
            leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
            self._parameters = [np.asarray(x).tobytes() for x in leaves if np.asarray(x).nbytes >= 32]
        return self._parameters

    def edited_position(self) -> Outcome:
        run = self.copy()
        (position,) = (self.latest(run) / "data").glob("process_*.json")
        state = json.loads(position.read_text())
        state["last_seen_indices"] = {k: v - self.rng.randint(1, 40) for k, v in state["last_seen_indices"].items()}
        position.write_text(json.dumps(state, indent=4))
        return self.judge_eval(run, "checksum of the data position")

    def junk_metrics(self) -> Outcome:
        run = self.copy()
        (self.latest(run) / "metrics" / "metrics").write_text(self.rng.choice(["junk{", "", "[1, 2"]))
        kind, seconds, _ = self.judge_eval(run, "metrics file")
        return ("fallback" if kind == "fallback" else kind, seconds, "used, not as the best")

    def foreign_checkpoint(self) -> Outcome:
        run, other = self.copy(), self.fresh()
        # the same data and seed (so only the run id tells them apart), another learning rate
        code, _, err, _ = cli("train", other, "--set", "train.learning_rate=0.002", config=self.config)
        assert code == 0, err
        shutil.rmtree(self.latest(run))
        shutil.copytree(self.latest(other), run / "checkpoints" / self.latest(other).name)
        return self.judge_eval(run, "written by another run")

    def half_deleted(self) -> Outcome:
        run = self.copy()
        oldest = min((p for p in (run / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        victims = sorted(oldest.iterdir())
        for path in self.rng.sample(victims, self.rng.randint(1, len(victims) - 1)):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        code, _, err, seconds = cli("train", run, config=self.config)
        if code is None or "Traceback" in err:
            return ("HANG" if code is None else "TRACEBACK", seconds, "")
        return ("fallback" if "is incomplete" in err or code == 0 else "SILENT", seconds, "moved aside")

    def symlink(self) -> Outcome:
        run = self.fresh()
        run.mkdir()
        target = self.root / f"someone_elses_{self.count}.txt"
        target.write_text("theirs\n")
        name = self.rng.choice(["lock", "config.yaml", "metrics.jsonl", "run_id"])
        (run / name).symlink_to(target)
        kind, seconds, detail = self.refused(run, "is a symbolic link")
        if target.read_text() != "theirs\n":
            kind = "SILENT"
        return (kind, seconds, name)

    def deleted_checkpoints(self) -> Outcome:
        run = self.copy()
        shutil.rmtree(run / "checkpoints")
        return self.refused(run, "--fresh")

    def deleted_config(self) -> Outcome:
        run = self.copy()
        (run / "config.yaml").unlink()
        kind, seconds, detail = self.judge_eval(run, "config.yaml is missing")
        return ("fallback" if kind in ("fallback", "no effect") else kind, seconds, "read from a checkpoint")

    def unwritable(self) -> Outcome:
        if os.geteuid() == 0:
            return ("not injectable", 0.0, "root ignores file modes")
        run = self.copy()
        (run / "checkpoints").chmod(0o555)
        try:
            return self.refused(run, "cannot write in", "--set", f"train.steps={STEPS + 4}")
        finally:
            (run / "checkpoints").chmod(0o755)

    def stopped_worker(self) -> Outcome:
        run = self.fresh()
        timeout = 8
        argv = [sys.executable, "-m", "jxformers.tools.cli", "train", str(self.config), "--workdir", str(run)]
        argv += ["--no-progress", "--set", "data.workers=2", "--set", f"data.batch_timeout={timeout}"]
        argv += ["--set", f"train.steps={STEPS * 20}"]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        began = time.perf_counter()
        stopped = None
        while process.poll() is None and time.perf_counter() - began < LIMIT_S and stopped is None:
            if (run / "metrics.jsonl").exists() and max(losses(run), default=0) >= 3:
                children = _children(process.pid)
                if children:
                    stopped = self.rng.choice(children)
                    os.kill(stopped, signal.SIGSTOP)
            time.sleep(0.05)
        stopped_at = time.perf_counter()
        try:
            _, err = process.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            return ("HANG", LIMIT_S, "stopped worker")
        finally:
            for child in _children(process.pid):
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
        seconds = time.perf_counter() - stopped_at
        if "Traceback" in err:
            return ("TRACEBACK", seconds, err.strip().splitlines()[-1])
        ok = process.returncode != 0 and "data.batch_timeout" in err
        return ("clear error" if ok else "SILENT", seconds, f"worker {stopped} stopped, limit {timeout} s")

    def killed_peer(self) -> Outcome:
        return self.kill_one_of_two(1)

    def killed_coordinator(self) -> Outcome:
        return self.kill_one_of_two(0)

    def kill_one_of_two(self, victim: int) -> Outcome:
        """Two processes of one run (2 CPU devices each, a 4-way data mesh, loopback
        coordinator); SIGKILL to process `victim` a random moment after the first logged
        step; the survivor must end within the limit with one line and no traceback."""
        import socket

        run = self.fresh()
        config = self.root / "two.yaml"
        config.write_text(yaml.safe_dump(TINY | {"mesh": {"data": 4}, "train": TINY["train"] | {"steps": 10_000}}))
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        argv = [sys.executable, "-m", "jxformers.tools.cli", "train", str(config), "--workdir", str(run)]
        argv += ["--no-progress", "--coordinator", f"localhost:{port}", "--num-processes", "2"]
        argv += ["--heartbeat-timeout", str(PEER_TIMEOUT_S)]
        procs = [
            subprocess.Popen(
                [*argv, "--process-id", str(i)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
            for i in range(2)
        ]
        survivor = procs[1 - victim]
        try:
            began = time.perf_counter()
            while not (run / "metrics.jsonl").exists() or not losses(run):
                if time.perf_counter() - began > LIMIT_S or any(p.poll() is not None for p in procs):
                    return ("HANG" if survivor.poll() is None else "SILENT", LIMIT_S, "training did not start")
                time.sleep(0.05)
            time.sleep(self.rng.uniform(0, 2))
            procs[victim].kill()
            killed = time.perf_counter()
            try:
                _, err = survivor.communicate(timeout=LIMIT_S)
            except subprocess.TimeoutExpired:
                return ("HANG", LIMIT_S, f"process {1 - victim} after process {victim} was killed")
            seconds = time.perf_counter() - killed
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()
        lines = [line for line in err.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        if survivor.returncode < 0 or "Traceback" in err or "Terminating process" in err:
            why = "SIGABRT" if survivor.returncode == -signal.SIGABRT else f"status {survivor.returncode}"
            said = next((line for line in lines if "Terminating process" in line), last).strip()
            return ("TRACEBACK", seconds, f"{why}: {said[:90]}")
        # one line naming the killed process (the coordinator's death is told at once, a
        # peer's after --heartbeat-timeout)
        ok = survivor.returncode == 1 and last.startswith("jxformers train:") and f"process {victim}" in last
        return ("clear error" if ok else "SILENT", seconds, last[:100])


def _children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


FAULTS = {
    "sigkill": "SIGKILL at a random step, then the same command again",
    "sigterm": "SIGTERM at a random step, then the same command again",
    "bitflip": "one bit flipped in a parameter's stored value in the latest checkpoint, then eval",
    "edited_position": "the latest checkpoint's data position moved back, then eval",
    "junk_metrics": "junk in the latest checkpoint's metrics file, then eval",
    "foreign_checkpoint": "another run's latest checkpoint copied in under this run's latest step, then eval",
    "half_deleted": "part of the oldest checkpoint deleted (an interrupted garbage collection), then train",
    "symlink": "lock, config.yaml, metrics.jsonl or run_id a symbolic link to another file, then train",
    "deleted_checkpoints": "checkpoints/ deleted, then train (refused without --fresh)",
    "deleted_config": "config.yaml deleted, then eval",
    "unwritable": "checkpoints/ made read-only, then train",
    "stopped_worker": "one of two data workers stopped (SIGSTOP) after step 3",
    "killed_peer": f"process 1 of 2 killed (SIGKILL) after the first step, --heartbeat-timeout {PEER_TIMEOUT_S}",
    "killed_coordinator": "process 0 of 2, the coordinator, killed (SIGKILL) after the first step",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--only", nargs="+", choices=sorted(FAULTS), help="these faults only")
    parser.add_argument("--repeat", type=int, default=3, help="injections of each fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the table here (markdown)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jxformers-faults-") as tmp:
        harness = Harness(pathlib.Path(tmp), rng)
        for name in args.only or FAULTS:
            outcomes = [getattr(harness, name)() for _ in range(args.repeat)]
            counts = collections.Counter(kind for kind, _, _ in outcomes)
            worst = max(seconds for _, seconds, _ in outcomes)
            details = "; ".join(sorted({d for _, _, d in outcomes if d}))[:160]
            summary = ", ".join(f"{kind} x{n}" for kind, n in counts.items())
            rows.append((name, FAULTS[name], args.repeat, summary, f"{worst:.0f}", details))
            print(f"{name}: {summary} (longest {worst:.0f} s) {details}", flush=True)
    bad = sum(1 for row in rows if any(word in row[3] for word in ("SILENT", "HANG", "TRACEBACK")))
    if args.out:
        command = "python scripts/fault_injection.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        with open(args.out, "w") as f:
            f.write(f"<!-- generated by: {command} -->\n# Fault injection\n\n")
            f.write(
                f"`{command}` on {platform.platform()}, Python {platform.python_version()}: tiny runs of "
                f"{STEPS} steps, a checkpoint every {EVERY}, through the CLI. Outcomes as the script's "
                "docstring defines them; seconds: the longest command (or, for a stopped worker, from "
                "the stop to the exit).\n\n"
            )
            f.write("| fault | what was done | injected | outcomes | longest s | detail |\n|---|---|---|---|---|---|\n")
            for row in rows:
                f.write("| " + " | ".join(str(x) for x in row) + " |\n")
            f.write(f"\nFaults with a silent outcome, a hang or a raw traceback: {bad}.\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
