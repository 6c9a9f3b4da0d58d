"""The `jxformers` command: `list` prints the attention registry and the model stacks,
`bench` runs the attention benchmark, `train` / `eval` / `generate` run experiments,
`data build` writes an experiment's splits to disk, `compare` and `lra` train many models
on one task or on the Long Range Arena, `convert` turns a BERT checkpoint into a jxformers
model, `describe` says what an experiment key means and `schema` prints the
experiment file's JSON Schema (see each `--help`)."""

from __future__ import annotations

import argparse
import errno
import functools
import json
import os
import sys
import warnings

from jxformers.tools.help_text import add_overrides

USAGE = """usage: jxformers COMMAND [ARGS]   (jxformers --version prints the version)

commands:
  list      print the attention registry (names, capabilities, hyper-parameters) and the model architectures;
            `list NAME`: one attention's hyper-parameters and allowed values; `list --markdown`: the docs' op table
  bench     time and measure every attention against softmax (--help for options)
  train     train an experiment: jxformers train CONFIG --workdir DIR [--set key=value ...]; without CONFIG
            the run in DIR goes on with its own config.yaml
  eval      evaluate the newest (--best: the best) checkpoint of a work directory: eval --workdir DIR
  generate  sample from a trained language model (seq2seq: write the target of a source): generate --workdir DIR
            --prompt ...
  plot      draw the curves of several work directories into one PNG
  data      build an experiment's generated splits on disk: data build CONFIG --out DIR [--split train|eval]
  demo      train softmax, linear and Fourier-Transformer models on tiny ListOps and compare
  convert   a BERT checkpoint (config.json + model.safetensors) to a jxformers model: convert BERT_DIR --out DIR
            [--experiment CONFIG: DIR is then a run at step 0, for eval and train]
  compare   train an experiment once per registered attention; one table and one plot (--help)
  lra       the Long Range Arena: tasks x attentions x seeds at a preset, one table in LRA's layout (--help)
  describe  what an experiment key means: type, default, allowed values, doc: describe [KEY]
  schema    the JSON Schema of an experiment file, for editors
"""


def _experiment_parser(
    prog: str, description: str, *, run_config: bool = False, resume: bool = False
) -> argparse.ArgumentParser:
    """`run_config`: eval / generate, whose config defaults to the run's WORKDIR/config.yaml;
    `resume`: train, whose config may be left out to resume the run in WORKDIR as saved."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    if run_config:
        p.add_argument(
            "config",
            nargs="?",
            default=None,
            help="optional: the run's WORKDIR/config.yaml is used; if given, it is only checked "
            "against it (needed for work directories without config.yaml)",
        )
    elif resume:
        p.add_argument(
            "config",
            nargs="?",
            default=None,
            help="an experiment name in experiments/ (e.g. copy) or a YAML path; left out, the run in "
            "--workdir goes on with its own config.yaml (e.g. to fine-tune a model `jxformers convert "
            "--experiment` wrote there), --set changing only settings outside the model",
        )
    else:
        p.add_argument("config", help="an experiment name in experiments/ (e.g. copy) or a YAML path")
    p.add_argument("--workdir", required=True, help="checkpoints, metrics.jsonl and config.yaml go here")
    add_overrides(
        p,
        "override a config value, e.g. --set train.steps=100 --set preset=tiny"
        + ("; for eval / generate only settings outside the model" if run_config else ""),
    )
    return p


def _one_line_warnings() -> None:
    """A checkpoint or short-sequence warning is one line for a user, not Python's
    file:line and source line, and each distinct one is said once per command (the model
    is built anew for each evaluation, which would repeat a ShortSequenceWarning)."""
    from jxformers.nn.config import ShortSequenceWarning
    from jxformers.train.checkpoint import CheckpointWarning

    default = warnings.showwarning
    if getattr(default, "one_line", False):
        return
    said = set()

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (CheckpointWarning, ShortSequenceWarning)):
            if str(message) not in said:
                said.add(str(message))
                print(f"jxformers: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    show.one_line = True
    warnings.showwarning = show


def _load(p, args):
    from jxformers.train import load_experiment

    _one_line_warnings()
    try:
        return load_experiment(args.config, args.overrides)
    except ValueError as e:
        p.error(str(e))


def _load_run(p, args):
    """The experiment of the run in --workdir: its config.yaml with --set applied; a config
    named on the command line is only compared with it (or used when there is none)."""
    from jxformers.train import load_experiment
    from jxformers.train.workdir import CONFIG, check_workdir, load_run_experiment, model_disagreement

    _one_line_warnings()
    try:
        workdir = check_workdir(args.workdir, exists=True)
        if args.config is not None and not (workdir / CONFIG).exists():  # a run from before config.yaml
            return load_experiment(args.config, args.overrides)
        experiment = load_run_experiment(workdir, args.overrides)
        if args.config is not None:
            given = load_experiment(args.config, args.overrides)
            if given.name != experiment.name:
                p.error(
                    f"{workdir} holds a run of {experiment.name!r}, not {given.name!r}; drop the config "
                    f"argument to use the run's"
                )
            note = model_disagreement(experiment, given)
            if note:
                print(f"{p.prog}: note: {note}", file=sys.stderr)
        return experiment
    except ValueError as e:
        p.error(str(e))


def _resume_run(p, args):
    """The experiment of the run in --workdir (its config.yaml, --set applied), for a
    `train` without a config."""
    from jxformers.train.workdir import CONFIG, check_workdir, has_checkpoints, load_run_experiment

    _one_line_warnings()
    try:
        workdir = check_workdir(args.workdir, exists=True)
        if not (workdir / CONFIG).exists() and not has_checkpoints(workdir):  # else: the config its checkpoints hold
            p.error(
                f"{workdir} holds no {CONFIG} to resume: name the experiment (jxformers train CONFIG --workdir DIR)"
            )
        return load_run_experiment(workdir, args.overrides)
    except ValueError as e:
        p.error(str(e))


def _train(rest: list[str]) -> int:
    from jxformers.train.distributed import (
        HEARTBEAT_TIMEOUT_S,
        INIT_TIMEOUT_S,
        initialize,
        several_processes,
        watch_peers,
    )
    from jxformers.train.supervise import SUPERVISED, supervise, watch_parent

    p = _experiment_parser("jxformers train", "train (or resume) an experiment in a work directory", resume=True)
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="print only errors and the final summary (default: a bar on a terminal, "
        "periodic plain lines elsewhere, e.g. in a log file)",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="one of several processes (jax.distributed): process 0's address and a free port; "
        "with --num-processes and --process-id. Without them a cluster JAX detects "
        "(Cloud TPU, SLURM, Open MPI) is joined by itself; see docs/distributed.md",
    )
    p.add_argument("--num-processes", type=int, default=None, help="the number of processes (with --coordinator)")
    p.add_argument("--process-id", type=int, default=None, help="this process's index (with --coordinator)")
    p.add_argument(
        "--init-timeout",
        type=float,
        default=INIT_TIMEOUT_S,
        metavar="S",
        help="with several processes: exit (status 1, one line) when not all have connected within S seconds "
        f"(default {INIT_TIMEOUT_S})",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=HEARTBEAT_TIMEOUT_S,
        metavar="S",
        help="with several processes: a process silent for S seconds (killed, its host gone) counts as dead: "
        f"the others exit (status 1, one line naming it) and a rerun resumes (default {HEARTBEAT_TIMEOUT_S})",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start again at step 0 a run whose checkpoints are gone (refused otherwise; the old "
        "metrics.jsonl is kept beside the new one as metrics.jsonl.<time>.old); refused where checkpoints exist",
    )
    args = p.parse_args(rest)
    if several_processes(args.coordinator, args.num_processes) and SUPERVISED not in os.environ:
        # JAX aborts a process whose coordinator died (SIGABRT, a C++ trace): a parent
        # running this same command says so in one line instead (train/supervise.py).
        return supervise(
            [sys.executable, "-m", "jxformers.tools.cli", "train", *rest],
            functools.partial(_coordinator_gone, args),
        )
    watch_parent()
    try:  # first: before anything starts jax's backends
        initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            init_timeout=args.init_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
        )
    except ValueError as e:
        p.error(str(e))
    experiment = _load(p, args) if args.config is not None else _resume_run(p, args)
    from jax.errors import JaxRuntimeError

    from jxformers.train import NonFiniteError, train
    from jxformers.train.loop import to_json

    watch = watch_peers(args.heartbeat_timeout)  # None with one process
    restore_hook = watch.hold_thread_errors() if watch is not None else None
    done = False  # tells the other processes this one finished, not died
    try:
        summary = train(experiment, args.workdir, progress=not args.no_progress, fresh=args.fresh)
        done = True
    except (NonFiniteError, ValueError) as e:
        print(f"jxformers train: {e}", file=sys.stderr)
        return 1
    except JaxRuntimeError:
        if watch is not None:  # a dead peer breaks a collective (gloo) before it counts as silent
            watch.wait_for_verdict()  # ends the process with its line if a peer is silent
        raise
    except SystemExit:  # stopped on a signal: every process saved the same step and ends
        done = True
        raise
    finally:
        if watch is not None:
            watch.stop(done=done)
        if restore_hook is not None:
            restore_hook()
    print(to_json(summary))
    return 0


def _coordinator_gone(args: argparse.Namespace, reason: str, tasks: list[int]) -> str:
    """The line for a process that JAX ended because its coordination service failed:
    the processes JAX names as unhealthy, else the coordinator (its service is gone)."""
    me = f"process {args.process_id} of {args.num_processes}" if args.process_id is not None else "this process"
    if tasks:
        who = ("process " if len(tasks) == 1 else "processes ") + ", ".join(map(str, tasks))
        what = f"{who} stopped sending heartbeats: killed, or its host is gone"
    else:
        where = f" at {args.coordinator}" if args.coordinator else ""
        what = f"process 0, the coordinator{where}, stopped answering: killed, or its host is gone"
    said = f" (JAX: {reason})" if reason else ""
    return (
        f"jxformers train: {me}: {what}{said}; this run stops here; run the same `jxformers train` command "
        f"on every process again to resume from the last checkpoint in {args.workdir}"
    )


def _batches(text: str) -> int | str:
    if text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"an int >= 1 or 'all'; got {text!r}")
    return int(text)


def _eval(rest: list[str]) -> int:
    p = _experiment_parser("jxformers eval", "evaluate the newest checkpoint on the eval split", run_config=True)
    p.add_argument(
        "--batches",
        type=_batches,
        default=None,
        help="eval batches: an int, or 'all' for the whole split (default: train.eval_batches, the "
        "batches training evaluated, so the numbers agree with its log; --set "
        "train.eval_batches=N changes it)",
    )
    p.add_argument(
        "--best", action="store_true", help="the best checkpoint by checkpoint.best_metric instead of the newest"
    )
    args = p.parse_args(rest)
    experiment = _load_run(p, args)
    from jxformers.train import evaluate_checkpoint

    try:
        result = evaluate_checkpoint(experiment, args.workdir, batches=args.batches, best=args.best)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result))
    if "baselines" in result:
        shown = ", ".join(f"{name.replace('_', ' ')} {value:.3f}" for name, value in result["baselines"].items())
        print(
            f"eval accuracy {result['eval_accuracy']:.3f} on {result['eval_examples']} examples; "
            f"baselines on the same examples: {shown}",
            file=sys.stderr,
        )
    return 0


# Data tasks whose tokens are the bytes of text: their prompts and outputs are text.
TEXT_TASKS = ("shakespeare", "shakespeare_stream")


def _prompt_ids(p, experiment, prompt: str) -> list[int]:
    """The prompt as token ids: the UTF-8 bytes of text for a text task, else
    space-separated ids, each inside the vocabulary."""
    if experiment.data.task in TEXT_TASKS:
        ids = list(prompt.encode("utf-8"))
    else:
        try:
            ids = [int(t) for t in prompt.split()]
        except ValueError:
            p.error(f"--prompt must be space-separated integer token ids for {experiment.name}; got {prompt!r}")
    vocab = experiment.model.vocab_size
    if not ids:
        p.error("--prompt is empty; give at least one token")
    outside = [i for i in ids if not 0 <= i < vocab]
    if outside:
        p.error(
            f"--prompt: token id {outside[0]} is outside the vocabulary of {experiment.name} (ids 0 to {vocab - 1})"
        )
    return ids


def _print_generated(experiment, rows) -> None:
    if experiment.data.task not in TEXT_TASKS:
        for row in rows:
            print(" ".join(str(int(t)) for t in row))
        return
    for i, row in enumerate(rows):
        if len(rows) > 1:
            print(f"--- sample {i + 1} ---")
        print(bytes(int(t) for t in row).decode("utf-8", errors="replace"))


def _generate(rest: list[str]) -> int:
    p = _experiment_parser(
        "jxformers generate",
        "continue a prompt with a trained language model, or write a seq2seq model's target for a source",
        run_config=True,
    )
    p.add_argument(
        "--prompt",
        required=True,
        help="space-separated token ids, e.g. '1 5 7' (task seq2seq: the source); text for a "
        f"byte-level text model ({', '.join(TEXT_TASKS)}), e.g. 'ROMEO:'",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="tokens to generate (default 32; seq2seq: the model's max_len - 1)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--best", action="store_true", help="the best checkpoint instead of the newest")
    p.add_argument(
        "--count",
        type=int,
        default=1,
        help="sequences generated in parallel (one per line); "
        "the throughput (sequences/s, e.g. images/s for fmnist_generate) goes to stderr",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="rerun the whole forward at every step instead of decoding incrementally (a key/value "
        "cache for softmax, the recurrent state for linear attention): the baseline of Table 1 of "
        'Katharopoulos et al. 2020 ("Transformers are RNNs", arXiv 2006.16236)',
    )
    args = p.parse_args(rest)
    experiment = _load_run(p, args)
    assert experiment is not None  # _load_run exits with its error
    task = experiment.model.task
    if task not in ("lm", "seq2seq"):
        p.error(f"generate needs a language-model or seq2seq experiment; {experiment.name} is {task!r}")
    steps = args.steps if args.steps is not None else (experiment.model.max_len - 1 if task == "seq2seq" else 32)
    if args.count < 1 or steps < 0:
        p.error("--count must be >= 1 and --steps >= 0")
    prompt = _prompt_ids(p, experiment, args.prompt)
    if task == "seq2seq" and len(prompt) > experiment.model.max_len:
        p.error(f"--prompt: a source of {len(prompt)} tokens exceeds the model's max_len {experiment.model.max_len}")
    import time

    import jax
    import jax.numpy as jnp

    from jxformers.nn.generation import generate, transduce
    from jxformers.train import restore_model

    try:
        model, _ = restore_model(experiment, args.workdir, best=args.best)
        prompt_ids = jnp.asarray(prompt, jnp.int32)
        sampling = dict(temperature=args.temperature, top_k=args.top_k, use_cache=not args.recompute)
        eos = None  # seq2seq: the target after BOS (the data task's ids), up to its EOS
        if task == "seq2seq":
            source = experiment.sources(generated=True)[0]
            eos = source.eos_id
            ends = dict(bos=source.bos_id, eos=eos)
            one = lambda k: transduce(model, prompt_ids, steps=steps, key=k, **ends, **sampling)  # noqa: E731
        else:
            one = lambda k: generate(model, prompt_ids, steps, key=k, **sampling)  # noqa: E731
        keys = jax.random.split(jax.random.key(args.seed), args.count)
        compiled = jax.jit(jax.vmap(one)).lower(keys).compile()
    except ValueError as e:
        p.error(str(e))
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    seconds = time.perf_counter() - start
    _print_generated(experiment, out if eos is None else _targets(out, eos))
    print(
        f"generated {args.count} sequences of {steps} new tokens in {seconds:.3f} s: "
        f"{args.count / seconds:.2f} sequences/s, {args.count * steps / seconds:.0f} tokens/s "
        f"(after compilation)",
        file=sys.stderr,
    )
    return 0


def _targets(rows, eos: int) -> list[list[int]]:
    """Each `transduce` row's target: the tokens after its BOS, up to (not with) its EOS."""
    out = []
    for row in rows.tolist():
        target = row[1:]
        out.append(target[: target.index(eos)] if eos in target else target)
    return out


def _plot(rest: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jxformers plot", description="curves of several runs in one PNG")
    p.add_argument("workdirs", nargs="+", help="work directories of `jxformers train`")
    p.add_argument("--out", default="curves.png")
    p.add_argument("--metrics", nargs="+", default=None, help="default: loss eval_accuracy")
    args = p.parse_args(rest)
    from jxformers.tools.plot import DEFAULT_METRICS, plot_runs

    try:
        print(plot_runs(args.workdirs, args.out, metrics=args.metrics or DEFAULT_METRICS))
    except ValueError as e:
        p.error(str(e))
    return 0


def _data(rest: list[str]) -> int:
    from jxformers.train.experiment import SPLITS

    p = argparse.ArgumentParser(
        prog="jxformers data build",
        description="generate an experiment's splits once and write them to DIR/train and DIR/eval in grain's "
        "ArrayRecord format (resumable; the same bytes for the same config); train with "
        "--set data.path=DIR to read them instead of generating",
    )
    p.add_argument("action", choices=["build"])
    p.add_argument("config", help="an experiment name in experiments/ (e.g. lra_listops) or a YAML path")
    p.add_argument("--out", required=True, help="the directory of the built splits")
    p.add_argument(
        "--split",
        choices=SPLITS,
        action="append",
        default=None,
        help="build only this split (repeatable; default: all)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set preset=paper",
    )
    p.add_argument("--processes", type=int, default=None, help="processes generating records (default: CPUs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(rest)
    experiment = _load(p, args)
    import pathlib

    from jxformers.data.cache import build_split

    specs = dict(zip(SPLITS, experiment.sources(generated=True), strict=True))
    try:
        for split in args.split or SPLITS:
            out = build_split(
                specs[split], pathlib.Path(args.out) / split, processes=args.processes, progress=not args.no_progress
            )
            print(f"{split}: {len(specs[split])} records in {out}")
    except ValueError as e:
        p.error(str(e))
    print(f"train from them with --set data.path={args.out}")
    return 0


def _convert(rest: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="jxformers convert",
        description="convert a BERT checkpoint (config.json + model.safetensors, e.g. MiniLM from "
        "scripts/fetch_minilm.sh) into DIR/config.yaml + DIR/model.eqx (jxformers.pretrained."
        "load_converted reads them); the tokenizer files are copied along. With --experiment, DIR is "
        "also a work directory of that experiment at step 0, with the converted model as its model: "
        "`jxformers eval --workdir DIR` evaluates it and `jxformers train --workdir DIR` fine-tunes it",
    )
    p.add_argument("bert", help="directory holding config.json and model.safetensors")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument(
        "--num-classes",
        type=int,
        default=None,
        help="classes of the new classification head (default 2; with --experiment, its data's)",
    )
    p.add_argument("--max-len", type=int, default=None, help="cut the position table to this length")
    p.add_argument("--attention", default=None, help="swap in this registered attention (keeps the weights)")
    p.add_argument("--attention-kwargs", default="{}", help="its hyper-parameters as JSON, e.g. '{\"window\": 16}'")
    p.add_argument(
        "--experiment",
        default=None,
        metavar="CONFIG",
        help="an experiment (a name in experiments/ or a YAML path) whose data, train and checkpoint "
        "sections the converted model runs with; its model section is not read. Its data must be a "
        "classification task in the checkpoint's vocabulary (e.g. shakespeare_genre with "
        "data.settings.tokenizer=BERT_DIR)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --experiment, override one of its values, e.g. --set train.steps=150 (not the model's)",
    )
    args = p.parse_args(rest)
    if args.overrides and args.experiment is None:
        p.error("--set overrides an experiment's values: give --experiment CONFIG")
    import pathlib
    import shutil

    from jxformers.pretrained import load_bert, save_converted, save_converted_run, swap_attention
    from jxformers.train import load_experiment
    from jxformers.train.experiment import training_source

    _one_line_warnings()
    try:
        num_classes = 2 if args.num_classes is None else args.num_classes
        if args.experiment is not None:  # the head is sized for the experiment's data
            source = training_source(args.experiment, args.overrides)
            if source.model_task != "classify":
                raise ValueError(
                    f"a converted BERT is a classifier; the data of {args.experiment} is a {source.model_task!r} task"
                )
            if args.num_classes not in (None, source.num_classes):
                raise ValueError(
                    f"--num-classes {args.num_classes}, but the experiment's data has {source.num_classes}"
                )
            num_classes = source.num_classes
        extra = {} if args.max_len is None else {"max_len": args.max_len}
        model, config = load_bert(args.bert, num_classes=num_classes, **extra)
        if args.attention is not None:
            model, config = swap_attention(model, config, args.attention, json.loads(args.attention_kwargs))
        experiment = None
        if args.experiment is not None:
            experiment = load_experiment(args.experiment, args.overrides, model=config)
            out = save_converted_run(model, experiment, args.out)
        else:
            out = save_converted(model, config, args.out)
    except (ValueError, json.JSONDecodeError) as e:
        p.error(str(e))
    for name in ("tokenizer.json", "vocab.txt"):
        if (pathlib.Path(args.bert) / name).is_file():
            shutil.copy(pathlib.Path(args.bert) / name, out / name)
    print(f"{config.num_layers} layers, d_model {config.d_model}, attention {config.attention.name}: {out}")
    if experiment is None:
        print(
            "to evaluate or fine-tune it from the command line, convert with --experiment CONFIG (the data "
            "and training settings it runs with)",
            file=sys.stderr,
        )
    else:
        print(
            f"a run of {experiment.name!r} at step 0: evaluate with `jxformers eval --workdir {out}`, "
            f"fine-tune with `jxformers train --workdir {out}`",
            file=sys.stderr,
        )
    return 0


def _compare(rest: list[str]) -> int:
    from jxformers.tools import compare

    return compare.main(rest)


def _lra(rest: list[str]) -> int:
    from jxformers.tools import lra

    return lra.main(rest)


def _demo(rest: list[str]) -> int:
    from jxformers.tools import demo

    return demo.main(rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] == "--version":
        from jxformers import __version__

        print(f"jxformers {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "list":
        parser = argparse.ArgumentParser(
            prog="jxformers list", description="print the attention registry and the model architectures"
        )
        parser.add_argument(
            "name",
            nargs="?",
            help="one attention: its hyper-parameters (type, default, allowed values, doc) and what it can do",
        )
        parser.add_argument("--markdown", action="store_true", help="the op table (Markdown) of docs/guide/ops.md")
        args = parser.parse_args(rest)
        from jxformers import registry
        from jxformers.nn.config import architectures_table

        if args.markdown:
            print(registry.markdown_table())
        elif args.name is not None:
            try:
                print(registry.describe(args.name))
            except ValueError as e:
                print(f"jxformers list: {e}", file=sys.stderr)
                return 2
        else:
            print(registry.table())
            print(architectures_table())
        return 0
    if command in ("describe", "schema"):
        from jxformers.tools import describe

        return (describe.describe_main if command == "describe" else describe.schema_main)(rest)
    if command == "bench":
        from jxformers.tools import bench

        return bench.main(rest)
    commands = {
        "train": _train,
        "eval": _eval,
        "generate": _generate,
        "plot": _plot,
        "demo": _demo,
        "data": _data,
        "convert": _convert,
        "compare": _compare,
        "lra": _lra,
    }
    if command in commands:
        try:
            return commands[command](rest)
        except OSError as e:  # a path the command cannot read or write: one line, not a traceback
            print(f"jxformers {command}: {os_error_line(e)}", file=sys.stderr)
            return 1
    print(f"jxformers: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def os_error_line(error: OSError) -> str:
    """What failed, on which path, and what to do, for an OSError from the file system."""
    what = error.strerror or type(error).__name__
    path = f" {error.filename!r}" if error.filename is not None else ""
    if isinstance(error, PermissionError):
        todo = "give this user write access to it, or use another --workdir"
    elif isinstance(error, (IsADirectoryError, NotADirectoryError, FileExistsError)):
        todo = "something else holds that name in the work directory: move it away, or use another --workdir"
    elif error.errno == errno.ENOSPC:
        todo = "free some space (the last checkpoint is kept; rerun to resume)"
    else:
        todo = "check the path and rerun"
    return f"{what}:{path}; {todo}"


if __name__ == "__main__":
    sys.exit(main())
