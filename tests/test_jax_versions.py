"""The JAX versions the suite runs on: the XLA flags the tests set are only those this
jaxlib's XLA knows (XLA aborts every process on an unknown one, as jax 0.12 did on the
flag 0.10 took), and the installed jax is inside the range pyproject.toml states as
tested."""

import os
import re
import tomllib
from importlib.metadata import version

from conftest import FAST_COMPILE, known_xla_flags
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_unknown_xla_flag_is_dropped_and_known_ones_kept():
    known = "--xla_backend_optimization_level=0"
    assert known_xla_flags((known, "--xla_jxformers_no_such_flag=1")) == known
    assert known_xla_flags((known,)) == known


def test_the_suite_runs_with_the_flags_this_xla_knows():
    assert "--xla_backend_optimization_level=0" in FAST_COMPILE  # known to every supported XLA
    assert all(flag in os.environ["XLA_FLAGS"] for flag in FAST_COMPILE.split())


def test_the_installed_jax_is_in_the_tested_range():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    jax_spec = next(Requirement(d) for d in dependencies if re.match(r"jax\b(?!lib)", d))
    assert jax_spec.specifier, "pyproject.toml must state the tested jax range"
    assert version("jax") in jax_spec.specifier, (version("jax"), str(jax_spec.specifier))
