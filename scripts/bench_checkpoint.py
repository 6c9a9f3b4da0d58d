"""What checkpointing costs the step path: `train` runs the same experiment three times
in one process (no checkpoint until the last step, synchronous saves, asynchronous saves
every `--every` steps) and compares, side by side:

- blocked: the time the loop waits in `checkpointer.save` (logged as
  `checkpoint_save_ms`); asynchronous saves only copy the state to host memory there;
- steps: the summed step time, which asynchronous saves can slow while they write in
  the background (the writer shares the CPU cores or the host's memory bandwidth);
- overhead: (blocked + steps) / (steps without checkpoints) - 1, the whole cost of
  checkpointing on the step path as a fraction of step time (the goal: under 5%).

The state saved is parameters + AdamW's two moments + step + key: 3 x 4 bytes per
parameter, and the data iterator's position.

    python scripts/bench_checkpoint.py --out docs/checkpoint_runs/cpu.md
    python scripts/bench_checkpoint.py --simulate-devices 8 --mesh fsdp=8 --out docs/checkpoint_runs/cpu_fsdp8.md
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile

from jxformers.tools.bench import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(sys.argv[1:])

import jax

from jxformers.train import load_experiment, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ("none", "sync", "async")


def experiment_for(mode: str, args) -> object:
    every = args.steps if mode == "none" else args.every  # "none": one save, after the last step
    overrides = [
        f"train.steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        "train.log_every=1",
        f"train.eval_every={args.steps}",
        "train.eval_batches=1",
        f"train.warmup_steps={args.steps}",
        f"model.num_layers={args.layers}",
        f"model.d_model={args.d_model}",
        f"model.ffn.d_ff={4 * args.d_model}",
        f"model.num_heads={args.d_model // 64}",
        f"data.settings.max_len={args.seq_len}",
        f"data.settings.symbols={args.seq_len // 2 - 2}",
        f"data.train_size={args.steps * args.batch_size}",
        "data.eval_size=64",
        f"checkpoint.every={every}",
        f"checkpoint.async_save={mode == 'async'}",
        "checkpoint.keep=2",
        *(f"mesh.{m}" for m in args.mesh),
    ]
    return load_experiment(ROOT / "experiments" / "copy.yaml", overrides)


def measure(mode: str, args) -> dict:
    """Step and blocked-save times (ms) of one run, the first step (compilation) left out."""
    with tempfile.TemporaryDirectory() as workdir:
        train(experiment_for(mode, args), workdir, progress=False)
        records = [json.loads(line) for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
        newest = max(
            (p for p in (pathlib.Path(workdir) / "checkpoints").iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
        )
        size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    steps = {r["step"]: r["step_ms"] for r in records if "step_ms" in r}
    saves = {r["step"]: r["checkpoint_save_ms"] for r in records if "checkpoint_save_ms" in r}
    last = max(steps)  # every mode saves the last step; that save is not on a step's path
    return {
        "steps_ms": sum(ms for s, ms in steps.items() if s > 1),
        "blocked_ms": sum(ms for s, ms in saves.items() if s != last),
        "saves": len([s for s in saves if s != last]),
        "checkpoint_bytes": size,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=20, help="steps between checkpoints (sync and async)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--mesh", nargs="*", default=[], help="mesh axes, e.g. fsdp=8 (with --simulate-devices)")
    p.add_argument("--simulate-devices", type=int, default=0, help="N simulated CPU devices")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved; the fastest is kept")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args()

    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved, so a slow spell of a shared machine hits every mode
            got = measure(mode, args)
            key = got["steps_ms"] + got["blocked_ms"]
            if mode not in best or key < best[mode]["steps_ms"] + best[mode]["blocked_ms"]:
                best[mode] = got
    base = best["none"]["steps_ms"]
    lines = [
        "| checkpoints | saves on the step path | blocked per save (ms) | blocked / step time | "
        "step time vs none | overhead (blocked + steps) / none - 1 |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        r = best[mode]
        per_save = r["blocked_ms"] / r["saves"] if r["saves"] else 0.0
        lines.append(
            f"| {mode} | {r['saves']} | {per_save:.1f} | {r['blocked_ms'] / r['steps_ms']:.2%} | "
            f"{r['steps_ms'] / base:.3f} | {(r['steps_ms'] + r['blocked_ms']) / base - 1:+.2%} |"
        )
    size = best["none"]["checkpoint_bytes"]
    mesh = " ".join(args.mesh) or "one device"
    header = [
        f"Command: `python scripts/bench_checkpoint.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].platform} x {len(jax.devices())} ({mesh}); jax {jax.__version__}.",
        "",
        f"Model: copy task, {args.layers} layers, d_model {args.d_model}, batch {args.batch_size} x "
        f"{args.seq_len} tokens, {args.steps} steps, a checkpoint every {args.every} steps "
        f"(about {size / 2**20:.1f} MiB each on disk); fastest of {args.repeats} interleaved runs per row; "
        "the first step (compilation) and the save after the last step are left out.",
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
