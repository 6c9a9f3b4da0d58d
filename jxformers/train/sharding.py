"""Sharded training: the device mesh of an experiment and the rules that shard its state.

    mesh = make_mesh(experiment.mesh)                      # axes data, fsdp, tensor, expert
    plan = plan_sharding(state, static, mesh)              # NamedShardings for state and batch
    state = plan.place_state(state)                        # device_put, every leaf on its sharding
    batch = plan.place_batch(numpy_batch)                  # the batch split over (data, fsdp)
    step = make_train_step(static, optimizer, grad_accum=1, sharding=plan)

The mesh has four named axes (`MeshConfig`, the experiment's `mesh` section): `data`,
`fsdp`, `tensor` and `expert`, built with `jax.make_mesh` with `AxisType.Auto` axes: the
jitted steps fix the shardings of their inputs and outputs (`in_shardings`,
`out_shardings`) and XLA's partitioner propagates them through the model. (JAX 0.10's
default, `AxisType.Explicit`, puts shardings in the types and refuses any op whose output
sharding it cannot infer; the registry's attentions sort, gather, scatter and scan in ways
that would each need an explicit `reshard`, so the automatic mode is used.)

Rules, on the dimensions' names (read from each leaf's tree path; Linear weights are
`[out, in]`, `jxformers.nn.layers.Linear`):
    batch      every array of a batch, and a Transformer-XL's per-row memory, is split on
               its leading (batch) dimension over (`data`, `fsdp`).
    tensor     attention heads: the output dimension of q_proj / k_proj / v_proj / r_proj
               (weights and biases) and the input dimension of o_proj / out_proj, when the
               module's head count (query heads for q and o, key/value heads for k and v)
               is divisible by the `tensor` size, so that each device holds whole heads;
               feed-forward hidden units: the output dimension of ffn.w_in / ffn.w_gate,
               the input dimension of ffn.w_out; MoE experts' hidden units (their d_ff
               dimension).
    expert     the leading (expert) dimension of an MoE's stacked expert weights
               (`jxformers.nn.moe.Experts`: w_in, w_gate, w_out, b_in, b_gate, b_out).
    fsdp       then every array (parameters, optimizer moments, drawn arrays) is split over
               `fsdp` on its largest dimension not already split and divisible by the
               `fsdp` size (the first such on ties).
    otherwise  replicated: scalars (the step, the optimizer's counts), PRNG keys, and any
               dimension a rule cannot split (not divisible by the axis size).
The optimizer state follows the parameters because the rules read only a leaf's path and
shape: Adam's `mu` of `.blocks[0].attention.q_proj.weight` has that path as its suffix and
the same shape. A rule that cannot apply never fails: the dimension stays replicated,
and `ShardingPlan.fallbacks` lists (and the log reports, once, at INFO) each such case.
Axes of size 1 are left out of the specs.

The MoE layer's expert-parallel `shard_map` dispatch (`jxformers.nn.moe_sharded`) is not
in the model path: under these rules the expert weights are split over `expert` and XLA
partitions the one-device dispatch (gathers of the tokens to all experts' buffers); the
all_to_all layer is tested on its own (tests/test_moe_sharded.py).

On one device (the default mesh of a one-device machine) the loop does not shard at all,
so such a run is exactly the unsharded run.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jxformers.train.experiment import MESH_AXES, MeshConfig

log = logging.getLogger(__name__)

BATCH_AXES = ("data", "fsdp")


def mesh_shape(config: MeshConfig | Mapping[str, int], devices: int) -> dict[str, int]:
    """{axis: size} for `devices` devices, the -1 axis resolved; a ValueError showing the
    sizes when their product is not the device count."""
    sizes = {
        a: (config.get(a, 1 if a != "data" else -1) if isinstance(config, Mapping) else getattr(config, a))
        for a in MESH_AXES
    }
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - set(MESH_AXES))
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; the axes are {list(MESH_AXES)}")
        MeshConfig(**sizes)  # the section's checks
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = [a for a, v in sizes.items() if v == -1]
    if rest:
        if fixed == 0 or devices % fixed:
            raise ValueError(
                f"mesh {sizes}: the fixed axes' product {fixed} does not divide the {devices} devices, "
                f"so mesh.{rest[0]}=-1 cannot take the rest"
            )
        sizes[rest[0]] = devices // fixed
    if math.prod(sizes.values()) != devices:
        raise ValueError(
            f"mesh {sizes} has {math.prod(sizes.values())} devices "
            f"({' x '.join(str(v) for v in sizes.values())}); there are {devices} devices"
        )
    return sizes


def make_mesh(config: MeshConfig | Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """The mesh (axes data, fsdp, tensor, expert, in that order) over `devices` (default:
    all devices of all processes), built with `jax.make_mesh` (which orders the devices
    for the hardware's topology) and automatic axes (see the module docstring)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(MeshConfig() if config is None else config, len(devices))
    return jax.make_mesh(
        tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def _sizes(mesh: Mesh) -> dict[str, int]:
    return dict(mesh.shape)


# ----------------------------------------------------------------------------- rules

# (regex searched in a leaf's tree path, the logical name of each dimension). `heads` and
# `kv_heads` are attention head dimensions (the count read from the owning module), `mlp`
# feed-forward hidden units, `expert` the experts of stacked expert weights.
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(?P<owner>.*)\.q_proj\.weight$", ("heads", None)),
    (r"(?P<owner>.*)\.q_proj\.bias$", ("heads",)),
    (r"(?P<owner>.*)\.(k_proj|v_proj)\.weight$", ("kv_heads", None)),
    (r"(?P<owner>.*)\.(k_proj|v_proj)\.bias$", ("kv_heads",)),
    (r"(?P<owner>.*)\.r_proj\.weight$", ("heads", None)),
    (r"(?P<owner>.*)\.(o_proj|out_proj)\.weight$", (None, "heads")),
    (r"\.ffn\.(w_in|w_gate)\.weight$", ("mlp", None)),
    (r"\.ffn\.(w_in|w_gate)\.bias$", ("mlp",)),
    (r"\.ffn\.w_out\.weight$", (None, "mlp")),
    (r"\.experts\.(w_in|w_gate)$", ("expert", None, "mlp")),
    (r"\.experts\.(b_in|b_gate)$", ("expert", "mlp")),
    (r"\.experts\.w_out$", ("expert", "mlp", None)),
    (r"\.experts\.b_out$", ("expert", None)),
)
# The mesh axis each logical dimension is split over.
LOGICAL_AXES = {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "expert": "expert"}


def head_counts(model) -> dict[str, dict[str, int]]:
    """{tree path of a module with heads: {"heads": query heads, "kv_heads": key/value
    heads}} for the model's attention modules (`num_heads`/`kv_heads`, or `heads`)."""

    def has_heads(x):
        return isinstance(x, eqx.Module) and (hasattr(x, "num_heads") or hasattr(x, "heads"))

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=has_heads)[0]:
        if has_heads(leaf):
            heads = getattr(leaf, "num_heads", None) or getattr(leaf, "heads", None)
            if isinstance(heads, int):
                kv = getattr(leaf, "kv_heads", None)
                out[jax.tree_util.keystr(path)] = {"heads": heads, "kv_heads": kv if isinstance(kv, int) else heads}
    return out


def _owner_heads(owner: str, heads: Mapping[str, Mapping[str, int]]) -> Mapping[str, int] | None:
    """The head counts of the module at the end of `owner` (the longest matching path:
    an optimizer state's path is a prefix plus the parameter's)."""
    best = max((p for p in heads if owner.endswith(p) and p), key=len, default=None)
    if best is None and "" in heads and owner == "":
        best = ""
    return None if best is None else heads[best]


def leaf_spec(
    path: str,
    shape: tuple[int, ...],
    sizes: Mapping[str, int],
    heads: Mapping[str, Mapping[str, int]] | None = None,
    fallbacks: list[str] | None = None,
) -> PartitionSpec:
    """The PartitionSpec of an array at tree path `path` (a `keystr`) of `shape` on a mesh
    of axis `sizes` (see the module docstring); each case where a rule could not apply
    is appended to `fallbacks`."""
    dims: list[str | None] = [None] * len(shape)
    heads = heads or {}
    note = fallbacks.append if fallbacks is not None else (lambda _: None)
    for pattern, names in RULES:
        match = re.search(pattern, path)
        if match is None or len(names) != len(shape):
            continue
        owner = _owner_heads(match.groupdict().get("owner") or "", heads) if "owner" in match.groupdict() else None
        for i, name in enumerate(names):
            axis = LOGICAL_AXES.get(name) if name else None
            if axis is None or sizes.get(axis, 1) == 1:
                continue
            size = sizes[axis]
            count = owner[name] if owner is not None and name in ("heads", "kv_heads") else shape[i]
            if shape[i] % size or count % size:
                what = f"{count} {name}" if count != shape[i] else f"size {shape[i]}"
                note(f"{path}: dimension {i} ({what}) is not divisible by {axis}={size}: not split over {axis}")
                continue
            dims[i] = axis
        break
    f = sizes.get("fsdp", 1)
    if f > 1 and shape:
        free = [i for i in range(len(shape)) if dims[i] is None and shape[i] % f == 0]
        if free:
            dims[max(free, key=lambda i: (shape[i], -i))] = "fsdp"
        elif math.prod(shape) >= f:
            note(f"{path}: no dimension of {tuple(shape)} is divisible by fsdp={f}: not split over fsdp")
    while dims and dims[-1] is None:
        dims.pop()
    return PartitionSpec(*dims)


def batch_spec(sizes: Mapping[str, int], rows: int) -> PartitionSpec:
    """Split the leading dimension over the batch axes of size > 1 when `rows` divides
    evenly; replicated otherwise."""
    axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    if not axes or rows % math.prod(sizes[a] for a in axes):
        return PartitionSpec()
    return PartitionSpec(axes if len(axes) > 1 else axes[0])


# ----------------------------------------------------------------------------- the plan


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every leaf of a train state lives on `mesh`, and how batches are split.

    state: a TrainState of NamedShardings (the state's own tree structure); batch: the
    NamedSharding of a train batch's arrays; replicated: for metrics and scalars;
    fallbacks: the rules that could not apply (see the module docstring)."""

    mesh: Mesh
    state: Any
    batch: NamedSharding
    replicated: NamedSharding
    fallbacks: tuple[str, ...] = ()

    def spec(self, tree_path: str):
        """The PartitionSpec of the state leaf at `tree_path` (a keystr of the state, e.g.
        ".params.blocks[0].attention.q_proj.weight")."""
        for path, sharding in jax.tree_util.tree_leaves_with_path(self.state):
            if jax.tree_util.keystr(path) == tree_path:
                return sharding.spec
        raise KeyError(f"no state leaf at {tree_path}")

    def gathered(self, shardings):
        """`shardings` (a tree of NamedShardings, e.g. the plan's `state.params`) without the
        `fsdp` axis: where the forward computes with the parameters. FSDP keeps each
        parameter split over `fsdp` between steps and gathers it whole for the forward (its
        gradient is reduce-scattered back by the step's out_shardings); left to XLA's
        propagation, a table split on d_model (the embedding's fsdp split) made the
        batch-split activations meet a d_model-split gather output, which XLA could only
        resolve by replicating them ("involuntary full rematerialization")."""

        def drop_fsdp(sharding):
            spec = [_without(dim, "fsdp") for dim in sharding.spec]
            return NamedSharding(self.mesh, PartitionSpec(*spec))

        return jax.tree.map(drop_fsdp, shardings)

    def place_state(self, state):
        """`state` with every leaf on its sharding (a no-op for leaves already there). With
        several processes each process fills its own devices' shards from its copy of the
        value (every process holds the same state)."""
        if jax.process_count() == 1:
            return jax.device_put(state, self.state)
        return jax.tree.map(_put_global, state, self.state)

    def batch_sharding(self, rows: int) -> NamedSharding:
        """The sharding of a batch of `rows` rows: split over (data, fsdp), or replicated
        when `rows` is not divisible (an eval batch smaller than the train batch)."""
        return NamedSharding(self.mesh, batch_spec(_sizes(self.mesh), rows))

    def place_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        """A batch of this process's rows (numpy) as global arrays split over (data, fsdp)
        (`jax.make_array_from_process_local_data`: with several processes each passes its
        own rows and the global batch is their concatenation)."""
        out = {}
        for name, value in batch.items():
            value = np.asarray(value)
            rows = value.shape[0] * jax.process_count()
            sharding = self.batch_sharding(rows)
            global_shape = (rows, *value.shape[1:])
            out[name] = jax.make_array_from_process_local_data(sharding, value, global_shape)
        return out


def _without(dim, axis: str):
    """A PartitionSpec entry (None, an axis name, or a tuple of them) without `axis`."""
    if dim == axis:
        return None
    if isinstance(dim, tuple):
        rest = tuple(a for a in dim if a != axis)
        return rest if len(rest) > 1 else (rest[0] if rest else None)
    return dim


def _put_global(x, sharding: NamedSharding):
    """`x` on a sharding over the devices of several processes."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
    elif not x.is_fully_addressable:  # already global: move it with a jitted identity
        return x if x.sharding == sharding else jax.jit(lambda a: a, out_shardings=sharding)(x)
    elif _is_key(x):
        return jax.random.wrap_key_data(_put_global(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def plan_sharding(state, static, mesh: Mesh, *, batch_size: int) -> ShardingPlan:
    """The ShardingPlan of a TrainState `state` (whose model is `state.model(static)`) on
    `mesh` for train batches of `batch_size` rows; a ValueError when that batch cannot be
    split over (data, fsdp) (an experiment's mistake, reported before any step)."""
    sizes = _sizes(mesh)
    split = sizes["data"] * sizes["fsdp"]
    if batch_size % split:
        raise ValueError(
            f"train.batch_size ({batch_size}) must be divisible by mesh.data x mesh.fsdp "
            f"({sizes['data']} x {sizes['fsdp']} = {split}) to split the batch over them"
        )
    heads = head_counts(state.model(static))
    fallbacks: list[str] = []
    replicated = NamedSharding(mesh, PartitionSpec())

    def spec(path, x):
        if not hasattr(x, "shape") or not x.ndim or _is_key(x):
            return replicated
        if getattr(path[0], "name", None) == "memory":  # one memory per batch row
            return NamedSharding(mesh, batch_spec(sizes, x.shape[0]))
        return NamedSharding(mesh, leaf_spec(jax.tree_util.keystr(path), tuple(x.shape), sizes, heads, fallbacks))

    shardings = jax.tree_util.tree_map_with_path(spec, state)
    if fallbacks:
        log.info(
            "sharding: %d rule(s) could not apply and those dimensions are replicated: %s",
            len(fallbacks),
            "; ".join(fallbacks[:8]) + (" ..." if len(fallbacks) > 8 else ""),
        )
    return ShardingPlan(
        mesh, shardings, NamedSharding(mesh, batch_spec(sizes, batch_size)), replicated, tuple(fallbacks)
    )


def jit_train_step(step, plan: ShardingPlan | None):
    """`step` (state, batch) -> (state, metrics) jitted with the state donated; with a
    plan, its inputs and outputs on the plan's shardings (state in and out, the batch
    split, metrics replicated)."""
    if plan is None:
        return jax.jit(step, donate_argnums=(0,))
    return jax.jit(
        step, donate_argnums=(0,), in_shardings=(plan.state, plan.batch), out_shardings=(plan.state, plan.replicated)
    )
