"""Test configuration and shared helpers.

Runtime shape/type checking of the package is on (pyproject's addopts:
--jaxtyping-packages=jxformers,beartype.beartype) and implicit rank promotion raises.
Hypothesis draws from a few fixed shapes: every new shape is a new XLA compilation.
"""

import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys

# Tests compile thousands of small programs and run each a few times: skip LLVM's
# optimisation passes (4-5x faster compiles on CPU), use XLA's older CPU fusion emitters
# (1.6-1.8x faster cold compiles of the suite's programs than the new MLIR ones) and
# generate each program's code in one piece (splitting it for parallel codegen threads
# cost 10-15% more compile time with two test workers on two cores). HLO-level passes, and
# so the cost and memory analyses the complexity tests read, are unchanged. Set before jax
# starts, and only the flags this XLA knows (probed); subprocesses that set their own
# XLA_FLAGS add FAST_COMPILE.
_FAST_COMPILE_WANTED = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
_KNOWN_FLAGS_ENV = "JXFORMERS_TEST_XLA_FLAGS"  # the probe's answer, inherited by workers and CLI runs


def known_xla_flags(flags, probe_env=None) -> str:
    """The `flags` this jaxlib's XLA accepts, space-separated. XLA aborts the whole process
    on a flag it does not know (jax 0.12 dropped --xla_cpu_use_fusion_emitters), so each
    set is tried in a subprocess: all at once, then one by one if that fails."""

    def accepted(candidate) -> bool:
        env = dict(probe_env if probe_env is not None else os.environ)
        env.update(XLA_FLAGS=" ".join(candidate), JAX_PLATFORMS="cpu")
        probe = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True, timeout=300
        )
        return probe.returncode == 0

    if accepted(flags):
        return " ".join(flags)
    return " ".join(flag for flag in flags if accepted((flag,)))


if _KNOWN_FLAGS_ENV not in os.environ:  # the pytest controller probes once; xdist workers inherit it
    os.environ[_KNOWN_FLAGS_ENV] = known_xla_flags(_FAST_COMPILE_WANTED)
FAST_COMPILE = os.environ[_KNOWN_FLAGS_ENV]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()
# Many tests (and the CLI processes they launch, which inherit the environment) compile
# the same small train steps: JAX's persistent compilation cache, kept in the checkout
# (keyed by the program, jax version and flags), compiles each once (test_train.py: 175 s
# -> 123 s on 2 cores).
# Not under jax 0.12: jaxlib 0.12.0.1 sometimes crashes the process with a segfault in
# LoadedExecutable.serialize() while writing to this cache (2 of 3 full runs under Python
# 3.12 lost a worker there, a different test each time; jxformers.tools.demo skips it too).
_JAX_MINOR = tuple(int(x) for x in importlib.metadata.version("jax").split(".")[:2])
PERSISTENT_CACHE = _JAX_MINOR < (0, 12)
if PERSISTENT_CACHE:
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR",
        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"),
    )
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# No size limit: with one, every write lists and stats the whole directory to evict, which
# made the suite quadratic in its ~18k programs (90% of a worker's time near the end).
# Instead the controller empties a cache grown past _CACHE_LIMIT before workers start.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
_CACHE_LIMIT = 2 * 2**30

import gc  # noqa: E402

# Python's cycle collector at its default thresholds (700, 10, 10) walked the workers'
# large heaps (jaxprs, lowered modules, caches) so often that it took about 9% of the
# CPU (perf: gc_collect_main and its visits); collecting 70x less often made
# tests/test_nn.py and tests/test_learnable.py 14-16% faster at the same peak memory.
gc.set_threshold(50_000, 50, 100)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

# differing_executors: pytest makes a fresh instance of a suite class for each test; the
# suites keep no state on `self`, so replays are reproducible all the same.
settings.register_profile(
    "jxformers",
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)
settings.load_profile("jxformers")


def cuda_target():
    """A context in which `jit(...).lower(lowering_platforms=("cuda",))` lowers Pallas GPU
    kernels on this CPU: jax 0.12's Triton lowering reads the target's compute capability
    from the device, so an abstract H100 stands in for one (older JAX ignores it)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


@functools.cache
def _jitted(fn, static):
    return jax.jit(functools.partial(fn, **dict(static)))


def jitted_call(fn, *args, **kwargs):
    """fn(*args, **kwargs) under jit (array keywords traced, every other keyword static),
    compiled once per function and static keywords."""
    arrays = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    return _jitted(fn, static)(*args, **arrays)


class JittedOps:
    """`jxformers.ops` whose functions run through `jitted_call`: a test of an op's
    math calls it as `ops.local_attention(...)` and gets one compiled program per
    function and static keywords, where eager execution compiles every primitive on its
    own (seconds per call). Eager execution itself is tested once per attention
    (tests/suites.py, test_eager_equals_jit)."""

    def __getattr__(self, name):
        import jxformers.ops

        attr = getattr(jxformers.ops, name)
        if callable(attr) and not isinstance(attr, type) and getattr(attr, "__module__", "").startswith("jxformers."):
            return functools.partial(_jitted_any, attr)
        return attr


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


@functools.cache
def _jitted_positions(fn, slots, static):
    def call(*arrays, **array_kwargs):
        it = iter(arrays)
        args = [next(it) if slot is None else slot[0] for slot in slots]
        return fn(*args, **array_kwargs, **dict(static))

    return jax.jit(call)


def _jitted_any(fn, *args, **kwargs):
    """fn(*args, **kwargs) under jit: array arguments traced, every other one static
    (positional too); eagerly when a static one is not hashable."""
    slots = tuple(None if _is_array(a) else (a,) for a in args)
    static = tuple(sorted((k, v) for k, v in kwargs.items() if not _is_array(v)))
    try:
        compiled = _jitted_positions(fn, slots, static)
    except TypeError:  # unhashable
        return fn(*args, **kwargs)
    return compiled(*(a for a in args if _is_array(a)), **{k: v for k, v in kwargs.items() if _is_array(v)})


def jitted(op):
    """`op` (an attention, a model, any callable of arrays) compiled once per input shapes
    and static arguments (`causal=True`, None): called eagerly, each of its primitives
    compiles on its own, and those compilations were a third of the suite's time. An
    op's eager path is tested once per attention (tests/suites.py, test_eager_equals_jit)."""
    import equinox as eqx

    return eqx.filter_jit(op)


def qkv(seed, n, heads=4, kv_heads=2, d=8, dv=6, kv_len=None, dtype=jnp.float32):
    """Random q [n, heads, d], k [kv_len, kv_heads, d], v [kv_len, kv_heads, dv]."""
    kv_len = n if kv_len is None else kv_len
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k1, (n, heads, d), dtype)
    k = jax.random.normal(k2, (kv_len, kv_heads, d), dtype)
    v = jax.random.normal(k3, (kv_len, kv_heads, dv), dtype)
    return q, k, v


def assert_close(a, b, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol, rtol=rtol)


import pytest  # noqa: E402

pytest_plugins = ["crash_rerun"]  # a test whose worker died under it runs once more (see there)

_RSS_LIMIT = 3 * 2**30  # the first clearing
_RSS_STEP = 2**30  # then again only after this much more growth ...
_RSS_CAP = 6 * 2**30  # ... up to this, past which every test clears
_next_clearing = [_RSS_LIMIT]


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_programs():
    """Drop JAX's compiled programs when a worker's memory grows: one that kept every
    test's executables grew to about 10 GB over the suite, and two such workers crashed
    XLA's compiler on a 24 GiB machine. Clearing gives little back to the system (the
    freed memory is reused, the resident size stays), so clearing at a fixed size cleared
    after every later test, and each then traced and lowered again what it shared with
    the next (test_nn.py: 18% more CPU). So: once past 3 GiB, and again after each 1 GiB
    of growth beyond what a clearing left, at most 6 GiB (two workers, 12 GiB)."""
    yield
    if _resident_bytes() > _next_clearing[0]:
        jax.clear_caches()
        _next_clearing[0] = min(max(_RSS_LIMIT, _resident_bytes() + _RSS_STEP), _RSS_CAP)


def pytest_addoption(parser):
    parser.addoption(
        "--fast-subset",
        action="store_true",
        help="only the files listed in tests/fast_subset.txt, without their heavy tests",
    )


def _fast_subset_files() -> set[str]:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_subset.txt")) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
    """Heavy tests first: xdist hands tests out in this order, so the long ones start
    while the short ones can still fill the other worker, instead of one of them running
    alone at the end (a stable sort: the rest keep their order). With --fast-subset,
    only the light tests of the files in tests/fast_subset.txt."""
    if config.getoption("fast_subset"):
        files = _fast_subset_files()
        keep = [item for item in items if item.path.name in files and item.get_closest_marker("heavy") is None]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller already checked
        return
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    if cache and os.path.isdir(cache):
        size = sum(e.stat().st_size for e in os.scandir(cache) if e.is_file())
        if size > _CACHE_LIMIT:
            shutil.rmtree(cache, ignore_errors=True)


def plain_reversible(blocks, x, bias):
    """The reversible wiring written out (y1 = x1 + F(x2), y2 = x2 + G(y1), the mean of the
    streams out), for plain autodiff against the stack's own backward pass."""
    x1 = x2 = x
    for b in blocks:
        x1 = x1 + b.attention(b.norms[0](x2), bias=bias)
        x2 = x2 + b.ffn(b.norms[-1](x1))
    return (x1 + x2) / 2


@pytest.fixture
def texts(tmp_path):
    """Eight tiny "plays" of random bytes a-d, as the Shakespeare stream source reads them
    (the streams of Transformer-XL, Memformer, ERNIE-Doc)."""
    root = tmp_path / "texts"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        (root / f"play{i}_gut.txt").write_bytes(bytes(rng.integers(97, 101, 3000).astype(np.uint8)))
    return root
