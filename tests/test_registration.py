"""What an attention's registration declares is what the rest of the package reads: its
hyper-parameters' allowed values (checked once, by `jxformers.validate.check_value`, when
it is bound: a config is refused before any model is built), the op table of docs/guide/ops.md
(rendered from the registrations), and the names `jxformers.ops` exports (each family
file's `__all__`)."""

import pathlib
import re

import jax
import pytest

from jxformers import ModelConfig, ops, registry
from jxformers.ops import _common
from jxformers.validate import Limits, check_value

OPS_GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "guide" / "ops.md"

# (attention, hyper-parameters, the words the error must hold). Each was accepted by
# `bind` before the registrations declared their limits, and failed at the first call.
BAD_VALUES = [
    ("performer", {"num_features": 0}, "num_features must be >= 1; got 0"),
    ("rfa", {"num_features": 0}, "num_features must be >= 1; got 0"),
    ("rfa", {"sigma": 0.0}, "sigma must be > 0; got 0.0"),
    ("block_local", {"block_size": 0}, "block_size must be >= 1; got 0"),
    ("bigbird", {"block_size": 0}, "block_size must be >= 1; got 0"),
    ("bigbird", {"num_window_blocks": 2}, "num_window_blocks must be >= 1 and odd; got 2"),
    ("bigbird", {"num_random_blocks": -1}, "num_random_blocks must be >= 0; got -1"),
    ("sinkhorn", {"block_size": 0}, "block_size must be >= 1; got 0"),
    ("sinkhorn", {"temperature": 0}, "temperature must be > 0; got 0.0"),
    ("sinkhorn", {"sortcut_blocks": -1}, "sortcut_blocks must be >= 0; got -1"),
    ("lsh", {"n_buckets": 3}, "n_buckets must be >= 1 and 1 or even; got 3"),
    ("lsh", {"chunk_size": 0}, "chunk_size must be >= 1; got 0"),
    ("routing", {"n_clusters": 0}, "n_clusters must be >= 1; got 0"),
    ("routing", {"decay": 1.0}, "decay must be >= 0 and < 1; got 1.0"),
    ("clusterformer", {"n_clusters": 0}, "n_clusters must be >= 1; got 0"),
    ("local", {"window": -1}, "window must be >= 0; got -1"),
    ("dilated", {"window": -1}, "window must be >= 0; got -1"),
    ("longformer", {"window": -1}, "window must be >= 0; got -1"),
    ("longformer", {"global_indices": (0, -1)}, r"global_indices must be >= 0 \(each\); got \(0, -1\)"),
    ("nystrom", {"num_landmarks": 0}, "num_landmarks must be >= 1; got 0"),
    ("linformer", {"proj_len": 0}, "proj_len must be >= 1; got 0"),
    ("chunked", {"chunk_size": 0}, "chunk_size must be >= 1; got 0"),
    ("linear", {"chunk_size": 0}, "chunk_size must be >= 1; got 0"),
    ("axial", {"width": 0}, "width must be >= 1; got 0"),
    ("image_local_2d", {"memory_height": -1}, "memory_height must be >= 0; got -1"),
    ("memory_compressed", {"stride": 0}, "stride must be >= 1; got 0"),
    ("induced", {"num_inducing": 0}, "num_inducing must be >= 1; got 0"),
    ("synthesizer", {"rank": 0}, "rank must be >= 1; got 0"),
    ("etc", {"global_every": 0}, "global_every must be >= 1; got 0"),
    ("long_short", {"segment_size": 0}, "segment_size must be >= 1; got 0"),
    ("poolingformer", {"pool_stride": 0}, "pool_stride must be >= 1; got 0"),
    ("sparse_transformer", {"stride": 0}, "stride must be >= 1; got 0"),
    ("adaptive_sparse", {"alpha": 2.5}, "alpha must be > 1 and <= 2; got 2.5"),
]


@pytest.mark.parametrize(
    "name,hyper_parameters,words", BAD_VALUES, ids=[f"{n}-{'-'.join(map(str, hp))}" for n, hp, _ in BAD_VALUES]
)
def test_bind_refuses_a_value_the_op_would_refuse_naming_attention_parameter_value_and_limits(
    name, hyper_parameters, words
):
    with pytest.raises(ValueError, match=rf"^{name}: hyper-parameter {words}$"):
        registry.get(name).bind(**hyper_parameters)


def test_a_model_config_with_such_a_value_is_refused_before_any_model_is_built():
    with pytest.raises(ValueError, match="performer: hyper-parameter num_features must be >= 1; got 0"):
        ModelConfig(attention={"name": "performer", "num_features": 0}, max_len=64, num_layers=1)


@pytest.mark.parametrize("name", registry.names())
def test_every_default_binds_and_every_numeric_hyper_parameter_declares_its_limits(name):
    spec = registry.get(name)
    spec.bind()
    for p in spec.hyper_parameters:
        if not p.required:
            assert spec.bind(**{p.name: p.default}).hyper_parameters[p.name] == p.default
        if p.numeric:
            assert p.limits is not None, f"{name}.{p.name}: numeric without declared limits"
            assert p.limits.allows(p.default) if isinstance(p.default, (int, float)) else True


def test_a_registration_must_declare_the_limits_of_a_numeric_hyper_parameter():
    def op(q, k, v, *, size: int = 4):
        return q

    with pytest.raises(
        ValueError, match=r"toy_unlimited: declare the numbers that hyper-parameter\(s\) \['size'\] allow"
    ):
        registry.register("toy_unlimited", op, family="toy", paper="-", complexity="O(1)")
    assert "toy_unlimited" not in registry.names()


def test_one_validator_for_configs_and_hyper_parameters():
    assert check_value("x", [1, 2], tuple[int, ...]) == (1, 2)
    assert check_value("x", 2, float) == 2.0 and isinstance(check_value("x", 2, float), float)
    with pytest.raises(ValueError, match=r"^x must be tuple of ints; got \('a',\)$"):
        check_value("x", ("a",), tuple[int, ...])
    with pytest.raises(ValueError, match=r"^x must be one of \['a', 'b'\]; got 'c'$"):
        check_value("x", "c", str, choices=("a", "b"))
    with pytest.raises(ValueError, match=r"^x must be > 0 and < 1; got 1.0$"):
        check_value("x", 1.0, float, limits=Limits(above=0, below=1))
    assert check_value("x", None, int | None, limits=Limits(minimum=1)) is None
    assert str(Limits.of(0)) == ">= 0"
    # the ops' own check reads the same way
    with pytest.raises(ValueError, match="^window must be >= 0; got -1$"):
        _common.check_positive("window", -1, minimum=0)


# ----------------------------------------------------------------------------- the op table of docs/guide/ops.md


def readme_table() -> str:
    text = OPS_GUIDE.read_text()
    section = text[text.index("attention-table:start") : text.index("attention-table:end")]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_readme_op_table_is_the_one_rendered_from_the_registrations():
    assert readme_table() == registry.markdown_table(), (
        "docs/guide/ops.md's op table (between the attention-table markers) is not the registry's: replace it with the "
        "output of `jxformers list --markdown` (registry.markdown_table(); the rows' text is each registration's "
        "summary= and complexity=)"
    )


def test_the_rendered_table_has_one_row_per_shipped_attention_in_registry_order():
    rows = registry.markdown_table().splitlines()[2:]
    ops_named = [re.match(r"\| `(\w+)` \|", r).group(1) for r in rows]  # type: ignore[union-attr]
    shipped = [registry.get(n) for n in registry.names() if registry.get(n).op.__module__.startswith("jxformers.")]
    assert ops_named == [s.op.__name__ for s in shipped]
    assert all(s.summary for s in shipped), "every registration says what it computes (summary=)"


# ----------------------------------------------------------------------------- ops' exports


def test_ops_exports_each_family_files_names_and_every_registered_op():
    families = sorted(p.stem for p in pathlib.Path(ops.__file__).parent.glob("*.py") if not p.stem.startswith("_"))
    exported = []
    for family in families:
        module = __import__(f"jxformers.ops.{family}", fromlist=["__all__"])
        assert module.__all__, f"jxformers/ops/{family}.py has no __all__"
        exported += module.__all__
    assert sorted(exported) == sorted(ops.__all__) and len(set(exported)) == len(exported)
    assert all(hasattr(ops, n) for n in ops.__all__)
    for name in registry.names():
        op = registry.get(name).op
        if op.__module__.startswith("jxformers."):
            assert getattr(ops, op.__name__) is op, f"{name}'s op is not exported from jxformers.ops"


def test_numpy_scalars_are_taken_as_the_python_numbers_they_hold():
    import numpy as np

    bound = registry.bind("local", window=np.int64(8))
    assert bound.hyper_parameters["window"] == 8 and type(bound.hyper_parameters["window"]) is int
    config = ModelConfig(
        d_model=np.int64(64), dropout=np.float32(0.25), attention={"name": "local", "window": np.int32(3)}
    )
    assert type(config.d_model) is int and type(config.dropout) is float and config.dropout == 0.25
    assert config.bound_attention(0).hyper_parameters["window"] == 3


@pytest.mark.parametrize("value", [10**12, 2**31])
def test_a_hyper_parameter_past_int32_is_refused_at_bind(value):
    with pytest.raises(ValueError, match=r"local: hyper-parameter window must be at most 2147483647 in size"):
        registry.bind("local", window=value)


def test_an_op_called_by_hand_refuses_a_size_past_int32_with_a_value_error():
    """Not an OverflowError from deep inside JAX: every int hyper-parameter of every op,
    set to 10**12, is a ValueError naming it (or, for a ramp length, simply works)."""
    from attention_facts import FACTS

    q = jax.random.normal(jax.random.key(0), (16, 2, 8))
    for name in registry.names():
        if not registry.get(name).op.__module__.startswith("jxformers."):
            continue  # an attention registered by another test (test_toy_attention's)
        bound = registry.bind(name, **dict(FACTS[name].variants[0]))
        kwargs = bound._op_kwargs() | bound.init_arrays(jax.random.key(1), heads=2, kv_heads=2, d_k=8, d_v=8)
        for p in bound.spec.hyper_parameters:
            value = kwargs.get(p.name, p.default)
            if p.arrays_only or isinstance(value, bool) or not isinstance(value, int):
                continue
            try:
                bound.spec.op(q, q, q, **(kwargs | {p.name: 10**12}))
            except ValueError as e:
                assert p.name in str(e), (name, p.name, str(e))


def test_a_bound_attention_called_without_its_drawn_arrays_is_refused():
    """Not a TypeError from the op's signature, nor a silent fallback (adaptive_sparse
    took a fixed alpha where its learned one was missing): a ValueError naming them."""
    from attention_facts import FACTS

    q = jax.numpy.ones((16, 2, 8))
    refused = []
    for name in registry.names():
        bound = registry.bind(name, **dict(FACTS[name].variants[0]))
        drawn = sorted(bound.init_arrays(jax.random.key(1), heads=2, kv_heads=2, d_k=8, d_v=8))
        if drawn:
            for arrays in (None, {}):
                with pytest.raises(ValueError, match=rf"{name} was called without its drawn arrays \[.*'{drawn[0]}'"):
                    bound(q, q, q, arrays=arrays)
            refused.append(name)
    assert {"performer", "adaptive_sparse", "linformer", "lsh"} <= set(refused)
