"""Sharded training (jxformers/train/sharding.py) on 8 simulated CPU devices, each script
in its own process (the device count is fixed when jax starts): every registered
attention trains under a 2 x 2 x 2 (data x fsdp x tensor) mesh with the per-step losses
of one device; the parameters really are split; an MoE's experts split over `expert`;
the mesh config's errors; and a run saved on 8 devices as 4 x 2 resumes on 4 devices as
2 x 2 with identical parameters."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST_COMPILE

from jxformers.train.experiment import MeshConfig, load_experiment
from jxformers.train.sharding import leaf_spec, mesh_shape

ROOT = pathlib.Path(__file__).parents[1]


def run_script(script: str, timeout: int = 600) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    # XLA's partitioner replicating an array it cannot reshard (ShardingPlan.gathered)
    assert "Involuntary full rematerialization" not in out.stderr, out.stderr[-6000:]
    return out.stdout


PRELUDE = f"""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 {FAST_COMPILE}"
    import jax, jax.numpy as jnp, numpy as np
    assert len(jax.devices()) == 8
"""


# The registry in PARTS interleaved parts, each its own process (about 4 s per attention
# on this CPU: two compilations, one of them partitioned for 8 devices). Two parts, not
# more: each process pays again for starting jax and its first (eager) compilations.
PARTS = 2


@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.heavy
@pytest.mark.multidevice
def test_every_registered_attention_trains_on_a_2x2x2_mesh_with_the_losses_of_one_device(part):
    run_script(
        (
            PRELUDE
            + """
    from attention_facts import FACTS
    from suites import model_config
    from jxformers import registry
    from jxformers.nn import build_model
    import optax
    from jxformers.train.sharding import make_mesh, plan_sharding
    from jxformers.train.state import TrainState, split_model
    from jxformers.train.step import make_train_step

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    # Plain SGD: what differs between attentions is the model, and an AdamW update (its
    # moments sharded like the parameters) doubled each compilation; the checkpoint and
    # MoE tests below train sharded with the configured AdamW.
    optimizer = optax.sgd(3e-2)
    rows, n, steps = 8, 21, 3
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 31, (rows, n)).astype(np.int32),
                "mask": np.arange(n)[None, :] < rng.integers(12, n + 1, (rows, 1)),
                "label": rng.integers(0, 2, rows).astype(np.int32)} for _ in range(steps)]

    def run(name, sharded):
        extra = dict(FACTS[name].model) if name in FACTS else {}
        if registry.get(name).causal_only:  # the delta rules: a unidirectional classifier
            extra |= {"causal": True, "pooling": "last"}
        config = model_config(name, "classify", num_layers=1, **extra)
        params, drawn, static = split_model(build_model(config, key=jax.random.key(0)))
        state = TrainState(params=params, drawn=drawn, opt_state=optimizer.init(params),
                           step=jnp.zeros((), jnp.int32), rng=jax.random.key(1))
        plan = plan_sharding(state, static, mesh, batch_size=rows) if sharded else None
        if plan is not None:
            state = plan.place_state(state)
        step = make_train_step(static, optimizer, grad_accum=1, sharding=plan)
        losses = []
        for b in batches:
            state, m = step(state, b if plan is None else plan.place_batch(b))
            losses.append(float(m["loss"]))
        return losses, state, plan

    worst = 0.0
    for name in registry.names()[PART::PARTS]:
        want, _, _ = run(name, False)
        got, state, plan = run(name, True)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
        worst = max(worst, max(abs(a - b) / abs(b) for a, b in zip(got, want)))
        leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
        q = next((x for p, x in leaves.items() if p.endswith("attention.q_proj.weight")), None)
        assert (q is None) == registry.get(name).mixes_input, name  # FNet, MLP-Mixer: no projections
        if q is not None:
            assert q.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp"), (name, q.sharding)
            half = (q.shape[0] // 2, q.shape[1] // 2)
            assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == half
        w_out = next(p for p in leaves if p.endswith("ffn.w_out.weight"))
        assert plan.spec(".params" + w_out) == jax.sharding.PartitionSpec("fsdp", "tensor"), name
        assert plan.batch.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    print("worst relative loss difference", worst)
    """
        )
        .replace("PARTS", str(PARTS))
        .replace("PART", str(part))
    )


@pytest.mark.multidevice
def test_moe_experts_split_over_the_expert_axis_and_train_like_one_device():
    run_script(
        PRELUDE
        + """
    from jax.sharding import PartitionSpec as P
    from jxformers.train import load_experiment, init_train_state
    from jxformers.train.sharding import make_mesh, plan_sharding
    from jxformers.train.step import make_train_step

    e = load_experiment({"name": "moe", "data": {"task": "copy", "train_size": 64, "eval_size": 8,
                                                 "settings": {"max_len": 12, "symbols": 4}},
                         "model": {"num_layers": 1, "d_model": 16, "num_heads": 2, "d_ff": 16, "ffn": "moe",
                                   "moe": {"num_experts": 4, "top_k": 2, "dropless": True}},
                         "train": {"batch_size": 4}}, [])
    from jxformers.data import make_loader
    batch = next(iter(make_loader(e.sources()[0], batch_size=4, seed=0)))
    losses = {}
    for shape in (None, {"data": 2, "fsdp": 1, "tensor": 2, "expert": 2}):
        state, static, optimizer, _ = init_train_state(e)
        plan = None if shape is None else plan_sharding(state, static, make_mesh(shape), batch_size=4)
        if plan is not None:
            state = plan.place_state(state)
            w_in = plan.spec(".params.blocks[0].ffn.experts.w_in")
            assert w_in == P("expert", None, "tensor"), w_in
        step = make_train_step(static, optimizer, grad_accum=1, sharding=plan)
        out = []
        for _ in range(2):
            state, m = step(state, batch if plan is None else plan.place_batch(batch))
            out.append(float(m["loss"]))
        losses[shape is None] = out
    np.testing.assert_allclose(losses[False], losses[True], rtol=1e-5)
    """
    )


def _losses(workdir):
    """step -> loss in a run's metrics.jsonl (the last record of each step)."""
    import json

    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.heavy
@pytest.mark.multidevice
def test_sharded_checkpoint_saved_as_4x2_on_8_devices_resumes_as_2x2_on_4_devices(tmp_path):
    """`train` on a 4 x 2 mesh (with gradient accumulation) checkpoints at step 2; the
    checkpoint restores on 4 of the 8 devices as 2 x 2 with identical parameters; then a
    process with 4 devices resumes the run on a 2 x 2 mesh with the losses of an
    uninterrupted 8-device run."""
    config = {
        "name": "ckpt",
        "data": {"task": "copy", "train_size": 64, "eval_size": 8, "settings": {"max_len": 12, "symbols": 4}},
        "model": {"attention": "softmax", "num_layers": 1, "d_model": 16, "num_heads": 2, "d_ff": 32},
        # A set warm-up: the default one is cut to the run's steps, which this run raises from 2 to 4.
        "train": {
            "steps": 2,
            "warmup_steps": 2,
            "batch_size": 8,
            "grad_accum": 2,
            "eval_every": 2,
            "eval_batches": 1,
            "log_every": 1,
        },
        "checkpoint": {"every": 2, "async_save": False},
    }
    run_script(
        PRELUDE
        + f"""
    import pathlib
    from jxformers.data import make_loader
    from jxformers.train import load_experiment, train, restore_train_state
    from jxformers.train.loop import _open_checkpointer, _restore
    from jxformers.train.sharding import make_mesh, plan_sharding
    from jxformers.train.state import init_train_state

    config, workdir = {config!r}, pathlib.Path({str(tmp_path / "run")!r})
    e = load_experiment(config, ["mesh.data=4", "mesh.fsdp=2"])
    train(e, workdir, progress=False)
    train(load_experiment(config, ["mesh.data=4", "mesh.fsdp=2", "train.steps=4"]), {str(tmp_path / "full")!r},
          progress=False)
    saved, _ = restore_train_state(e, workdir)  # unsharded, on one device

    state, static, _, _ = init_train_state(e)
    mesh = make_mesh({{"data": 2, "fsdp": 2}}, devices=jax.devices()[:4])
    plan = plan_sharding(state, static, mesh, batch_size=8)
    template = plan.place_state(state)
    train_source, _ = e.sources()
    iterator = iter(make_loader(train_source, batch_size=8, seed=0))
    checkpointer = _open_checkpointer(e, workdir, async_save=False)
    restored = _restore(checkpointer, template, iterator, training=False)
    checkpointer.close()
    assert int(restored.step) == 2
    for (path, a), b, s in zip(jax.tree_util.tree_leaves_with_path(restored.params), jax.tree.leaves(saved.params),
                               jax.tree.leaves(plan.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
        assert a.sharding == s and set(a.sharding.device_set) == set(jax.devices()[:4]), (path, a.sharding)
    q = restored.params.blocks[0].attention.q_proj.weight
    assert "fsdp" in q.sharding.spec, q.sharding.spec
    """
    )
    run_script(
        PRELUDE.replace("count=8", "count=4").replace("== 8", "== 4")
        + f"""
    from jxformers.train import load_experiment, train
    train(load_experiment({config!r}, ["mesh.data=2", "mesh.fsdp=2", "train.steps=4"]), {str(tmp_path / "run")!r},
          progress=False)
    """
    )
    resumed, full = _losses(tmp_path / "run"), _losses(tmp_path / "full")
    assert sorted(resumed) == sorted(full) == [1, 2, 3, 4]
    assert resumed[1] == full[1] and resumed[2] == full[2]  # the same 4 x 2 run up to the checkpoint
    assert resumed[3] == pytest.approx(full[3], rel=1e-5) and resumed[4] == pytest.approx(full[4], rel=1e-5)


def test_mesh_sizes_and_their_errors():
    assert mesh_shape(MeshConfig(), 8) == {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}
    assert mesh_shape({"fsdp": 2, "tensor": 2}, 8) == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}
    assert mesh_shape({"data": 2, "fsdp": -1}, 8) == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
    with pytest.raises(
        ValueError,
        match=r"mesh \{'data': 2, 'fsdp': 2, 'tensor': 1, 'expert': 1\} has 4 devices "
        r"\(2 x 2 x 1 x 1\); there are 8 devices",
    ):
        mesh_shape({"data": 2, "fsdp": 2}, 8)
    with pytest.raises(ValueError, match="fixed axes' product 3 does not divide the 8 devices"):
        mesh_shape({"tensor": 3}, 8)
    with pytest.raises(ValueError, match=r"at most one mesh axis may be -1; got \['data', 'fsdp'\]"):
        MeshConfig(fsdp=-1)
    with pytest.raises(ValueError, match="mesh.tensor must be >= 1 or -1"):
        MeshConfig(tensor=0)
    with pytest.raises(ValueError, match=r"mesh: unknown key\(s\) \['model'\]"):
        load_experiment("copy", ["preset=tiny", "mesh.model=2"])
    e = load_experiment("copy", ["preset=tiny", "mesh.fsdp=2"])
    assert e.mesh.fsdp == 2 and e.raw["mesh"] == {"data": -1, "fsdp": 2, "tensor": 1, "expert": 1}
    import jax

    from jxformers.train.sharding import make_mesh

    with pytest.raises(ValueError, match=r"mesh .* has 2 devices .*there are 1 devices"):
        make_mesh({"data": 1, "fsdp": 2}, devices=jax.devices()[:1])


def test_rules_fall_back_to_replication_when_a_dimension_does_not_divide():
    from jax.sharding import PartitionSpec as P

    sizes = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}
    heads = {".blocks[0].attention": {"heads": 3, "kv_heads": 3}}
    notes = []
    # 3 heads of 4: the rows divide by 2, the heads do not: no tensor split; fsdp takes the larger dimension
    assert leaf_spec(".params.blocks[0].attention.q_proj.weight", (12, 16), sizes, heads, notes) == P(None, "fsdp")
    assert "3 heads" in notes[0] and "tensor=2" in notes[0]
    assert leaf_spec(".opt_state[0].mu.blocks[0].ffn.w_in.weight", (6, 16), sizes, heads) == P("tensor", "fsdp")
    notes.clear()
    assert leaf_spec(".params.x", (3, 5), sizes, {}, notes) == P()
    assert "no dimension of (3, 5) is divisible by fsdp=2" in notes[0]
    assert (
        leaf_spec(".params.blocks[0].ffn.w_in.weight", (6, 16), {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1}) == P()
    )


@pytest.mark.multidevice
def test_transformer_xl_memory_split_over_the_batch_axes_trains_like_one_device(tmp_path):
    """A model carrying a memory between steps (a part of the state the one train step
    threads): the memory's rows split like the batch, the losses those of one device."""
    root = tmp_path / "texts"
    root.mkdir()
    rng = __import__("numpy").random.default_rng(0)
    for i in range(8):
        (root / f"play{i}_gut.txt").write_bytes(bytes(rng.integers(97, 101, 3000).astype("uint8")))
    overrides = [
        "preset=tiny",
        f"data.settings.path={root}",
        "data.settings.max_len=9",
        "data.settings.rows=4",
        "data.train_size=64",
        "data.eval_size=8",
        "train.batch_size=4",
        "model.mem_len=6",
        "model.eval_mem_len=12",
        "model.d_model=16",
        "model.num_heads=2",
        "model.d_ff=32",
        "model.num_layers=1",
    ]
    run_script(
        PRELUDE
        + f"""
    from jax.sharding import PartitionSpec as P
    from jxformers.data import make_loader
    from jxformers.train import load_experiment, init_train_state
    from jxformers.train.sharding import make_mesh, plan_sharding
    from jxformers.train.step import make_eval_step, make_train_step, evaluate

    e = load_experiment("shakespeare_txl", {overrides!r})
    loader = iter(make_loader(e.sources()[0], batch_size=4, seed=0, shuffle=False))
    batches = [next(loader) for _ in range(3)]
    results = []
    for shape in (None, {{"data": 2, "fsdp": 2, "tensor": 2}}):
        state, static, optimizer, _ = init_train_state(e)
        plan = None if shape is None else plan_sharding(state, static, make_mesh(shape), batch_size=4)
        if plan is not None:
            state = plan.place_state(state)
            memory = jax.tree.leaves(plan.state.memory)
            assert memory and all(s.spec == P(("data", "fsdp")) for s in memory), memory
        step = make_train_step(static, optimizer, grad_accum=1, sharding=plan)
        losses = []
        for b in batches:
            state, m = step(state, b if plan is None else plan.place_batch(b))
            losses.append(float(m["loss"]))
        kept = batches if plan is None else [plan.place_batch(b) for b in batches]
        results.append((losses, evaluate(make_eval_step(static), state, kept, 3, language_model=True)["eval_loss"]))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5)
    """
    )


@pytest.mark.heavy
@pytest.mark.multidevice
def test_two_processes_train_stop_together_on_sigterm_and_resume_after_sigkill_like_one_process(tmp_path):
    """`jxformers train` launched as 2 processes (loopback coordinator, 4 simulated CPU
    devices each, gloo collectives) on a 4 x 2 mesh, in one work directory: SIGTERM to
    process 1 alone after a checkpoint stops both processes after the same step, with
    that step saved, process 0 alone having written the logs, with the per-step losses
    of one process with 8 devices; relaunched, both are killed with SIGKILL after a later
    checkpoint; relaunched again, the run ends with the losses of one process."""
    import re
    import signal
    import socket
    import time

    import yaml

    # Long enough that JAX's preemption notice (polled once a second; a step takes
    # 0.1-0.5 s here) arrives with a checkpoint still to come.
    steps, every = 40, 4
    config = {
        "name": "mp",
        "data": {"task": "copy", "train_size": 512, "eval_size": 8, "settings": {"max_len": 12, "symbols": 4}},
        "model": {"attention": "softmax", "num_layers": 1, "d_model": 16, "num_heads": 2, "d_ff": 32},
        "train": {"steps": steps, "batch_size": 8, "eval_every": steps, "eval_batches": 1, "log_every": 1},
        "checkpoint": {"every": every, "async_save": False},
        "mesh": {"data": 4, "fsdp": 2},
    }
    path = tmp_path / "mp.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def launch(workdir, devices, *flags):
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jxformers.tools.cli",
                "train",
                str(path),
                "--workdir",
                str(workdir),
                "--no-progress",
                *flags,
            ],
            cwd=ROOT,
            env=env | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def two_processes(workdir, flags_of=lambda i: ()):
        """Processes 0 and 1 of one run; process i also gets `flags_of(i)`."""
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        return [
            launch(
                workdir, 4, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
                *flags_of(i),
            )
            for i in range(2)
        ]  # fmt: skip

    def finish(procs, code=0):
        """Each process's stderr, once all exited with `code`."""
        errs = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=600)
                assert proc.returncode == code, out[-2000:] + err[-4000:]
                errs.append(err)
        finally:  # one process failing leaves the other waiting for it
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        return errs

    def saved(workdir):
        folder = workdir / "checkpoints"
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []

    def wait_for_checkpoint_after(workdir, step, procs):
        deadline = time.monotonic() + 240
        while not saved(workdir) or saved(workdir)[-1] <= step:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no checkpoint appeared"
            time.sleep(0.02)

    # launched with different configs, both refuse at start-up (they used to hang at the
    # shorter run's last step), before a file is written
    started = time.monotonic()
    unlike = two_processes(tmp_path / "unlike", lambda i: ("--set", f"train.steps={steps // (i + 1)}"))
    for err in finish(unlike, code=1):
        assert "were not started alike" in err and "its config differs on processes [1]" in err, err[-2000:]
        assert "Traceback" not in err, err[-2000:]
    assert time.monotonic() - started < 120 and not (tmp_path / "unlike" / "config.yaml").exists()

    # the reference, one process with 8 devices, runs beside the first two-process launch
    single_process = launch(tmp_path / "one", 8)
    try:
        # SIGTERM to process 1 alone: both stop after the same step and it is saved. Sent
        # to its supervisor and to the training process under it at once, as a scheduler
        # signalling every process of a job does: the supervisor passes it on, so the
        # training process gets two, which JAX's preemption handler takes as one notice.
        run = tmp_path / "interrupted"
        procs = two_processes(run)
        try:
            wait_for_checkpoint_after(run, 0, procs)
            trained_by = _child_pids(procs[1].pid)
            assert len(trained_by) == 1, trained_by  # the supervised training process
            procs[1].send_signal(signal.SIGTERM)
            os.kill(trained_by[0], signal.SIGTERM)
        finally:
            errs = finish(procs, code=128 + signal.SIGTERM)
    finally:
        finish([single_process])
    single = _losses(tmp_path / "one")
    assert sorted(single) == list(range(1, steps + 1))
    stopped = [int(re.search(r"saves after step (\d+)", err).group(1)) for err in errs]
    assert stopped[0] == stopped[1] < steps, stopped
    assert saved(run)[-1] == stopped[0] and f"saved step {stopped[0]}" in errs[0]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"loss"' in line]) == stopped[0]  # written once, by process 0
    two = _losses(run)
    assert sorted(two) == list(range(1, stopped[0] + 1))
    for step in two:
        assert two[step] == pytest.approx(single[step], rel=1e-5), (step, two[step], single[step])

    # relaunched, then both killed with SIGKILL after a later checkpoint
    procs = two_processes(run)
    try:
        wait_for_checkpoint_after(run, stopped[0], procs)
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert max(_losses(run)) < steps, "the run ended before it was killed"
    finish(two_processes(run))
    resumed = _losses(run)
    assert sorted(resumed) == list(range(1, steps + 1))
    for step in single:
        assert resumed[step] == pytest.approx(single[step], rel=1e-5), (step, resumed[step], single[step])


def test_a_process_whose_peers_never_connect_says_so_in_one_line_after_its_init_timeout(tmp_path):
    """Issue 37 item 4: process 0 of 2 with no process 1 waited 307 s, then JAX aborted it
    (SIGABRT, a C++ stack trace). With --init-timeout 3 it exits with status 1 and one line
    after about 3 s, having written nothing; a timeout that is not positive is refused."""
    import socket
    import time

    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "lone", "data": {"task": "copy", "train_size": 16, "eval_size": 8}}))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    base = [sys.executable, "-m", "jxformers.tools.cli", "train", str(path), "--workdir", str(tmp_path / "run")]
    lone = [*base, "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", "0"]
    started = time.monotonic()
    out = subprocess.run(
        [*lone, "--init-timeout", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert "process 0 of 2: not every process connected to the coordinator" in out.stderr
    assert "within 3 s (--init-timeout)" in out.stderr
    assert time.monotonic() - started < 60 and not (tmp_path / "run").exists()
    from jxformers.train import distributed

    with pytest.raises(ValueError, match="--heartbeat-timeout must be > 0 seconds; got 0"):
        distributed.initialize(f"localhost:{port}", 2, 0, heartbeat_timeout=0)


@pytest.mark.heavy
def _child_pids(pid):
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found.append(int(entry.name))
    return found


def _one_of_two_killed(tmp_path, victim):
    """Two processes of one run (2 CPU devices each, --heartbeat-timeout 6); process
    `victim` killed (SIGKILL) at the first logged step. The survivor's status, its stderr,
    and the seconds from the kill to its exit."""
    import signal
    import socket
    import time

    import yaml

    steps = 10_000  # never reached: a process is killed at its first logged step
    config = {
        "name": "killed",
        "data": {"task": "copy", "train_size": 512, "eval_size": 8, "settings": {"max_len": 12, "symbols": 4}},
        "model": {"attention": "softmax", "num_layers": 1, "d_model": 16, "num_heads": 2, "d_ff": 32},
        "train": {"steps": steps, "batch_size": 8, "eval_every": steps, "eval_batches": 1, "log_every": 1},
        "checkpoint": {"every": steps, "async_save": False},
        "mesh": {"data": 2, "fsdp": 2},
    }
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(config))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    flags = f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    run = tmp_path / "run"
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "jxformers.tools.cli", "train", str(path), "--workdir", str(run), "--no-progress",
                "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i),
                "--heartbeat-timeout", "6",
            ],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + 300
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and '"loss"' in metrics.read_text()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training did not start"
            time.sleep(0.05)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = survivor.communicate(timeout=120)
        waited = time.monotonic() - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    for fatal in ("Traceback", "SIGABRT", "Check failure", "Terminating process", "F0000"):
        assert fatal not in err, err[-4000:]
    assert not any(line[:1] == "F" and line[1:5].isdigit() for line in err.splitlines()), err[-4000:]  # glog FATAL
    return survivor.returncode, err, waited


@pytest.mark.multidevice
def test_a_process_whose_peer_is_killed_says_so_in_one_line_after_its_heartbeat_timeout(tmp_path):
    """Issue 37 item 4: with process 1 killed (SIGKILL) mid-training, process 0 waited in a
    collective until JAX's heartbeat check aborted it (SIGABRT, a C++ stack trace). With
    --heartbeat-timeout 6 it exits with status 1 and one line naming process 1."""
    status, err, waited = _one_of_two_killed(tmp_path, victim=1)
    assert status == 1, err[-4000:]
    assert 6 - 1.5 <= waited < 60, waited  # silent since its last beat, up to 1.5 s (6 / 4) before the kill
    last = err.strip().splitlines()[-1]
    assert last.startswith("jxformers train: process 0 of 2: process 1 has been silent for "), err[-4000:]
    assert "(--heartbeat-timeout 6)" in last and "resume from the last checkpoint" in last, last


@pytest.mark.multidevice
def test_a_process_whose_coordinator_is_killed_says_so_in_one_line(tmp_path):
    """Issue 37 item 4: with process 0 (the coordinator, holding JAX's coordination
    service) killed, JAX aborted process 1 within a second (SIGABRT, "Terminating process
    because the JAX distributed service detected fatal errors", a C++ stack trace). Its
    supervisor (train/supervise.py) now ends it with status 1 and one line."""
    status, err, waited = _one_of_two_killed(tmp_path, victim=0)
    assert status == 1, err[-4000:]
    assert waited < 60, waited
    last = err.strip().splitlines()[-1]
    assert last.startswith("jxformers train: process 1 of 2: process 0, the coordinator at localhost:"), err[-4000:]
    assert "stopped answering: killed, or its host is gone (JAX: " in last, last
    assert "resume from the last checkpoint in " in last, last
    assert "Polled an error" not in err, err[-4000:]  # JAX's error line before its abort


def test_the_peer_watch_counts_a_peer_silent_once_its_counter_stops_changing():
    """distributed.Liveness, the watchdog's bookkeeping: a peer whose counter has not
    changed for the timeout is silent, one that finished (DONE) never is, and a store
    that has not answered for the timeout is unreachable."""
    from jxformers.train import distributed

    live = distributed.Liveness([1, 2], timeout=10, now=0.0)
    assert live.silent(9.9) == {} and live.unreachable(100.0) is None
    assert live.silent(10.0) == {1: 10.0, 2: 10.0}  # never wrote: counted from the start
    live.saw({0: "1", 1: "1", 2: "1"}, now=5.0)
    live.saw({0: "2", 1: "2", 2: "1"}, now=12.0)
    assert live.silent(14.0) == {} and live.silent(15.0) == {2: 10.0}
    live.saw({1: "3", 2: distributed._DONE}, now=16.0)  # 2 finished its run
    assert live.silent(100.0) == {1: 84.0}
    live.failed(20.0)
    live.failed(25.0)  # counted from the first failure
    assert live.unreachable(29.0) is None and live.unreachable(31.0) == 11.0
    assert live.silent(100.0) == {}  # nothing known of the peers while the store is silent
    live.saw({1: "4"}, now=32.0)
    assert live.unreachable(100.0) is None


def test_the_peer_watch_names_a_silent_peer_or_an_unreachable_coordinator_and_tells_when_done():
    """distributed.PeerWatch's thread over a stand-in for the coordination service's store
    (0.1 s between beats): a peer that stopped beating is named once it has been silent
    for the timeout (`wait_for_verdict` returns then); a store that fails names the
    coordinator; `stop(done=True)` leaves DONE for the others."""
    from jxformers.train import distributed

    class Store:
        def __init__(self, fail=False):
            self.values, self.fail = {"jxformers/alive/1": "1"}, fail  # process 1 beat once, then died

        def key_value_set(self, key, value, allow_overwrite=False):
            if self.fail:
                raise RuntimeError("UNAVAILABLE: Socket closed")
            self.values[key] = value

        def key_value_dir_get(self, key):
            return sorted(self.values.items())

    ended = []
    store = Store()
    watch = distributed.PeerWatch(store, 0, 2, 0.4, "localhost:1234", end=ended.append).start()
    watch.wait_for_verdict()
    [line] = ended
    assert line.startswith("jxformers train: process 0 of 2: process 1 has been silent for 0 s"), line
    assert "(--heartbeat-timeout 0.4): killed, or its host is gone" in line, line
    assert int(store.values["jxformers/alive/0"]) > 1  # its own counter went on
    watch.stop(done=True)
    assert store.values["jxformers/alive/0"] == distributed._DONE

    ended.clear()
    watch = distributed.PeerWatch(Store(), 1, 2, 0.4, "localhost:1234", end=ended.append)
    watch.client.fail = True
    watch._thread.start()  # its first beat fails too
    watch.wait_for_verdict()
    assert ended and "the coordinator (process 0 at localhost:1234) has not answered for 0 s" in ended[0], ended
    watch.stop(done=False)


def test_processes_started_differently_are_refused_by_each_with_what_differs(monkeypatch):
    """distributed.check_same_run, process 1 of 2 in this process (the gathered hashes
    stand in for the collective, which the two-process test above runs)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from jxformers.train import distributed

    config = {"train": {"steps": 60}}
    distributed.check_same_run(config)  # one process: nothing to compare
    mine, theirs = distributed.started_with(config), distributed.started_with({"train": {"steps": 120}})
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([theirs, x]))
    with pytest.raises(ValueError, match=r"process 1 of 2: .*its config differs on processes \[1\]\)"):
        distributed.check_same_run(config)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, x]))
    distributed.check_same_run(config)  # alike: nothing
    other_code = np.concatenate([mine[:4], theirs[4:] + 1])
    assert distributed.disagreements(np.stack([mine, mine, theirs])) == {"config": [2]}
    assert distributed.disagreements(np.stack([mine, other_code])) == {"code": [1]}


def test_each_process_reads_its_rows_of_the_global_batches():
    """ProcessRows: the rows of processes 0..P-1 of batch t, in process order, are the
    global batch t of one process (so the assembled batch is the same)."""
    import grain

    from jxformers.data.loader import ProcessRows

    base = grain.samplers.IndexSampler(
        num_records=40, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=3
    )
    keys = [base[i].record_key for i in range(40)]
    parts = [ProcessRows(base, 4, p, 3) for p in range(3)]
    assert [len(part) for part in parts] == [12, 12, 12]  # 3 whole global batches of 12; the rest dropped
    for t in range(3):
        rows = [part[t * 4 + j].record_key for part in parts for j in range(4)]
        assert rows == keys[t * 12 : (t + 1) * 12]
    assert parts[1][5].index == 5
    with pytest.raises(IndexError):
        parts[0][12]


def test_a_failed_collective_in_a_thread_waits_for_the_peer_watch_before_its_traceback(monkeypatch):
    """Orbax's async save syncs the processes from a thread; with a peer killed, gloo's
    error there printed a traceback before the peer watch's one line (1 of 3 killed peers
    in the fault run). `hold_thread_errors` makes such a thread wait for the verdict (which
    ends the process) first; an error of another kind is printed at once."""
    import threading

    import jax

    from jxformers.train import distributed

    class Store:  # process 1 beat once, then died
        values = {"jxformers/alive/1": "1"}

        def key_value_set(self, key, value, allow_overwrite=False):
            self.values[key] = value

        def key_value_dir_get(self, key):
            return sorted(self.values.items())

    events = []
    monkeypatch.setattr(threading, "excepthook", lambda args: events.append(("printed", type(args.exc_value))))
    watch = distributed.PeerWatch(Store(), 0, 2, 0.4, "localhost:1234", end=lambda line: events.append(("ended",)))
    watch.start()
    restore = watch.hold_thread_errors()

    def fail(error):
        raise error

    for error in (jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed"), KeyError("other")):
        t = threading.Thread(target=fail, args=(error,))
        t.start()
        t.join()
    restore()
    watch.stop(done=False)
    # the collective's error waited for the verdict; the KeyError was printed at once
    assert events == [("ended",), ("printed", jax.errors.JaxRuntimeError), ("printed", KeyError)], events
    assert threading.excepthook is not None and "hook" not in getattr(threading.excepthook, "__qualname__", "")
