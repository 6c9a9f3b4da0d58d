"""Model-level benchmark, Table 2 of He et al. 2023 ("Fourier Transformer: Fast Long Range
Modeling by Removing Sequence Redundancy with FFT Operator", arXiv 2305.15099): training
steps per second and memory of the
vanilla encoder and the Fourier Transformer at the LRA Text shape, as ratios to vanilla
measured side by side in one run (`scripts/bench_models.py`).

The model is LRA's Text classifier (Tay et al. 2021, which He et al.'s section 5.1.1
follows): 4 layers, d_model 256, 4 heads, MLP 1024, byte tokens, 2 classes, mean
pooling (He et al.'s section 4.2 for a model trained from scratch), dropout 0.1, AdamW.
The Fourier Transformer is the same model with the spectral filter right before block
0's attention keeping 20% of the tokens (`stack.filters` `{0: 0.2}`, He et al.'s section 5.1.1).
The paper's batch is 32 (16 at 4K) on an A100-80G; `--batch` sets a smaller one for a CPU.

Measured per model and length: the train step (forward, backward, AdamW update; the
library's `make_train_step`) compiled once, timed over `--steps` steps per repeat with
the repeats interleaved across models (the minimum is kept); XLA's FLOP count of the
step; and its memory from XLA's compiled memory analysis: temporaries (activations,
workspaces) plus arguments (parameters, optimizer state, batch). A CPU reports no device
peak, and a compiled figure is the same on every backend, so that is the measure here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from jxformers import registry
from jxformers.nn.config import ModelConfig
from jxformers.tools.bench import print_report, provenance
from jxformers.tools.help_text import description
from jxformers.train import init_train_state, load_experiment
from jxformers.train.experiment import deep_merge
from jxformers.train.step import make_train_step
from jxformers.xla_cost import compile_with_cost

LENGTHS = (1024, 2048, 3072, 4096)
# The paper's batch per length (He et al. 2023, section 5.1.2: 32, and 16 at 4K for vanilla's memory).
PAPER_BATCH = {4096: 16}
DEFAULT_BATCH = 32
TEXT_MODEL: dict[str, Any] = dict(
    task="classify",
    vocab_size=256,
    num_classes=2,
    num_layers=4,
    d_model=256,
    num_heads=4,
    ffn={"kind": "gelu", "d_ff": 1024},
    embedding={"position": "sinusoidal"},
    head="mean",
    dropout=0.1,
)
BASELINE = "vanilla"
MODELS = {BASELINE: {}, "fourier_transformer": {"stack": {"filters": {0: 0.2}}}}
# He et al. 2023, Table 2: steps/s and peak memory as ratios to vanilla at 1K, 2K, 3K, 4K.
PAPER = {"steps_per_s": (6.9, 12.2, 16.8, 17.7), "memory": (0.23, 0.19, 0.18, 0.18)}


@dataclasses.dataclass
class Row:
    model: str
    length: int
    batch: int
    step_s: float
    flops: float
    temp_bytes: int
    argument_bytes: int

    @property
    def memory_bytes(self) -> int:
        return self.temp_bytes + self.argument_bytes


def models(attentions: list[str]) -> dict[str, dict]:
    """label -> ModelConfig fields beyond TEXT_MODEL: vanilla, the Fourier Transformer and
    one model per extra registered attention."""
    for name in attentions:
        registry.get(name)
    return MODELS | {name: {"attention": name} for name in attentions if name not in MODELS}


def _build(fields: dict, length: int, batch: int, model_size: dict):
    """(compiled train step, state, batch, cost) of one model at one length."""
    base = load_experiment("lra_listops")  # its train section (AdamW): the model is replaced
    config = ModelConfig(**deep_merge(deep_merge(TEXT_MODEL, model_size), {"max_len": length} | fields))
    experiment = dataclasses.replace(base, model=config, train=dataclasses.replace(base.train, batch_size=batch))
    state, static, optimizer, _ = init_train_state(experiment)
    k_tokens, k_label = jax.random.split(jax.random.key(length))
    data = {
        "tokens": jax.random.randint(k_tokens, (batch, length), 0, config.vocab_size),
        "mask": jnp.ones((batch, length), bool),
        "label": jax.random.randint(k_label, (batch,), 0, config.num_classes),
    }
    step = make_train_step(static, optimizer, grad_accum=1)
    compiled, cost = compile_with_cost(step, state, data)
    return compiled, state, data, cost


def run(
    labels: dict[str, dict],
    lengths,
    *,
    batch: int | None = None,
    steps: int = 2,
    repeats: int = 2,
    model_size: dict | None = None,
    progress=True,
) -> list[Row]:
    """Measure every model at every length (batch: the paper's unless given)."""
    rows = []
    for length in lengths:
        b = batch or PAPER_BATCH.get(length, DEFAULT_BATCH)
        built = {}
        for label, fields in labels.items():
            if progress:
                print(f"N={length} batch {b}: compiling {label}", file=sys.stderr)
            built[label] = list(_build(fields, length, b, model_size or {}))
        best = {label: float("inf") for label in built}
        for rep in range(repeats + 1):  # the first round warms up
            for label, item in built.items():
                compiled, state, data, _ = item
                start = time.perf_counter()
                for _ in range(steps):
                    state, metrics = compiled(state, data)  # the state is donated: carry the new one
                jax.block_until_ready(metrics["loss"])
                item[1] = state
                if rep > 0:
                    best[label] = min(best[label], (time.perf_counter() - start) / steps)
        for label, (_, _, _, cost) in built.items():
            rows.append(Row(label, length, b, best[label], cost.flops, cost.temp_bytes, cost.argument_bytes))
            if progress:
                print(f"N={length} {label}: {best[label]:.3f} s a step", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    base = {r.length: r for r in rows if r.model == BASELINE}
    paper = {n: i for i, n in enumerate(LENGTHS)}
    lines = [
        "| N | batch | model | step s | steps/s / vanilla | paper | memory MiB | memory / vanilla | paper "
        "| GFLOP a step (XLA) | FLOP / vanilla |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b = base.get(r.length)
        i = paper.get(r.length)
        is_fourier = r.model == "fourier_transformer" and i is not None
        speed = f"{b.step_s / r.step_s:.2f}" if b else "-"
        memory = f"{r.memory_bytes / b.memory_bytes:.2f}" if b else "-"
        flops = f"{r.flops / b.flops:.3f}" if b and b.flops else "-"
        lines.append(
            f"| {r.length} | {r.batch} | {r.model} | {r.step_s:.3f} | {speed} "
            f"| {PAPER['steps_per_s'][i] if is_fourier else ''} | {r.memory_bytes / 2**20:.0f} | {memory} "
            f"| {PAPER['memory'][i] if is_fourier else ''} | {r.flops / 1e9:.1f} | {flops} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_models", description=description(__doc__))
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=list(LENGTHS),
        metavar="N",
        help="sequence lengths (default %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="examples a step at every length (default: the paper's, 32 and 16 at 4096)",
    )
    p.add_argument("--steps", type=int, default=2, help="train steps timed per repeat (default %(default)s)")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed repeats after one warm-up round; the minimum is kept (default %(default)s)",
    )
    p.add_argument(
        "--attentions",
        nargs="*",
        default=[],
        metavar="NAME",
        help="also measure the Text model with these registered attentions",
    )
    p.add_argument(
        "--set",
        dest="model_size",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="change the model's integer sizes (ModelConfig keys, dotted into components), e.g. "
        "--set num_layers=2 --set ffn.d_ff=128",
    )
    p.add_argument("--out", metavar="FILE", help="also write the markdown report to this file")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        labels = models(args.attentions)
        size: dict[str, Any] = {}
        for item in args.model_size:
            key, value = item.split("=", 1)
            *parents, name = key.split(".")
            node = size
            for part in parents:
                node = node.setdefault(part, {})
            node[name] = int(value)
    except ValueError as e:
        p.error(str(e))
    if any(n < 1 for n in args.lengths) or min(args.steps, args.repeats) < 1 or (args.batch or 1) < 1:
        p.error(f"lengths, --batch, --steps and --repeats must be positive; got {args}")
    rows = run(labels, args.lengths, batch=args.batch, steps=args.steps, repeats=args.repeats, model_size=size)
    command = " ".join(["python scripts/bench_models.py", *(argv if argv is not None else sys.argv[1:])])
    model = deep_merge(TEXT_MODEL, size)
    text = (
        provenance(command)
        + f"Model: {model}; Fourier Transformer: filters {MODELS['fourier_transformer']['stack']['filters']}. "
        f"Step times are the minimum over {args.repeats} interleaved repeats of {args.steps} steps after a "
        "warm-up; memory is XLA's compiled temporaries + arguments of the train step; ratios are to "
        "vanilla at the same N and batch, measured in this run. 'paper': He et al. 2023 "
        "(arXiv 2305.15099), Table 2 (A100-80G, batch 32, 16 at 4K).\n\n" + table(rows) + "\n"
    )
    print_report(text, args.out)
    return 0
