"""Expert parallelism for `MoE` with `jax.shard_map` (GShard's dispatch): the experts are
split over the mesh axis "expert" (E / P experts per device), the batch over that axis
(and over a data-parallel axis too, `data_axis`), and each device routes its own
tokens, fills its buffers `[E, C, d]`, sends each expert's buffer to the device that
holds it (`all_to_all` over "expert"), runs its local experts on the `P * C` tokens it
receives per expert, and sends the results back (`all_to_all`) to be combined.

    y, aux = expert_parallel_moe(moe, x, mask, mesh=mesh)                      # mesh ("expert",)
    y, aux = expert_parallel_moe(moe, x, mask, mesh=mesh, data_axis="data")    # mesh ("data", "expert")

Each device's tokens (its share of the batch, flattened) are one routing group, and the
result equals `moe` applied to each device's flattened tokens on one device:
    token choice, capacity   C = max(min_capacity, ceil(cf * tokens_per_device * k / E)).
    expert choice            each expert picks its top C = ceil(cf * tokens / E) of the
                             device's tokens; the picked tokens travel the same way.
    hash                     each token to the expert its id hashes to (`token_ids`,
                             sharded like the batch); every token is processed (dropless).
    base                     in training, the balanced assignment of the device's tokens
                             (each expert ceil(tokens / E) slots at most, filled exactly
                             when E divides the real tokens): per-device groups, as the
                             paper's workers each assign their own tokens; at inference,
                             greedy and dropless.
    prototype                top-1 in each of the k groups of experts, dispatched as top-k
                             token choice (capacity or dropless).
    dropless                 fixed buffers of the worst case, C = tokens_per_device (an
                             expert takes a token at most once), so nothing can drop. With
                             the ragged method the receiving device packs the filled rows
                             of its experts (the counts travel with the buffers) and runs
                             them through the grouped matmul (`ragged_dot`), so expert
                             FLOPs follow the real assignments (the padded method, CPU's
                             default, multiplies the whole buffers); either way the
                             exchange moves E * C * d per device,
                             E / k times the ideal. `jax.lax.ragged_all_to_all` would move
                             only the assignments, but it does not run on CPU, where this
                             is tested, so it is not used.
The losses and router entropy in aux are means over the devices' groups; dropped and
expert_load are sums. Parameters other than the experts' are replicated; their
gradients are summed over devices by shard_map's transpose. Communication per layer:
two all_to_alls of E * C * d activations per device.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.moe import AUX_NAMES, SUMMED, MoE

AXIS = "expert"


def _is_param(leaf) -> bool:
    """The arrays that go through shard_map: weights (scalars such as dropout's rate stay
    outside, concrete, so that the modules can branch on them)."""
    return eqx.is_array(leaf) and leaf.ndim > 0


def _param_specs(moe: MoE, axis: str):
    """PartitionSpecs for the MoE's weights: the experts' stacked weights split on their
    leading (expert) dimension, everything else replicated."""
    specs = jax.tree.map(lambda _: PartitionSpec(), eqx.filter(moe, _is_param))
    expert_specs = jax.tree.map(lambda _: PartitionSpec(axis), eqx.filter(moe.experts, _is_param))
    return eqx.tree_at(lambda m: m.experts, specs, expert_specs)


def _packed_experts(experts, received, counts, *, key, inference):
    """Local experts on received buffers `[E_local, S, d]` whose first counts[e, p]
    slots of source p's block (S = P * C, source-major) are filled: the filled rows are
    packed by expert and run through the grouped matmul; empty slots return zeros."""
    local, slots, d = received.shape
    sources = counts.shape[1]
    cap = slots // sources
    filled = (jnp.arange(cap)[None, None, :] < counts[:, :, None]).reshape(local, slots)
    expert_of_row = jnp.where(filled, jnp.arange(local)[:, None], local).reshape(-1)  # empty rows sort last
    order = jnp.argsort(expert_of_row, stable=True)
    rows = experts.ragged(
        received.reshape(-1, d)[order], counts.sum(1), expert_of_row[order], key=key, inference=inference
    )
    out = jnp.zeros_like(rows).at[order].set(rows)
    return jnp.where(filled.reshape(-1, 1), out, 0).reshape(local, slots, d)


def expert_parallel_moe(
    moe: MoE,
    x: Float[Array, "batch seq d_model"],
    mask: Bool[Array, "batch seq"] | None = None,
    *,
    token_ids: Int[Array, "batch seq"] | None = None,
    mesh: Mesh,
    axis: str = AXIS,
    data_axis: str | None = None,
    key: PRNGKeyArray | None = None,
    inference: bool = False,
) -> tuple[Float[Array, "batch seq d_model"], dict[str, Array]]:
    """`moe` over `mesh`: experts split over `axis`, the batch over `axis` and, when
    given, `data_axis` (see the module docstring). `key` is folded with the device's
    index for per-device randomness. `token_ids` (router "hash" needs them) are split
    like the batch.

    Returns: (y [batch, seq, d_model], aux as `MoE` returns it, reduced over devices)."""
    for name in (axis, data_axis):
        if name is not None and name not in mesh.shape:
            raise ValueError(f"mesh axis {name!r} is not in the mesh {dict(mesh.shape)}")
    devices = mesh.shape[axis]
    groups = devices * (1 if data_axis is None else mesh.shape[data_axis])
    num_experts = moe.num_experts
    if num_experts % devices:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of the {axis!r} axis size ({devices})")
    if x.shape[0] % groups:
        raise ValueError(
            f"batch ({x.shape[0]}) must be a multiple of the number of routing groups ({groups}: "
            f"the devices over {(data_axis, axis) if data_axis else axis!r})"
        )
    mask = jnp.ones(x.shape[:2], bool) if mask is None else mask
    if moe.routing == "hash" and token_ids is None:
        raise ValueError("router 'hash' routes by token id: pass token_ids [batch, seq]")
    # ids travel with the batch; routers other than hash ignore them (zeros then)
    ids = jnp.zeros(x.shape[:2], jnp.int32) if token_ids is None else token_ids
    params, static = eqx.partition(moe, _is_param)
    local_experts = num_experts // devices
    batch_axes = axis if data_axis is None else (data_axis, axis)

    def local(params, x, mask, ids):
        m = eqx.combine(params, static)

        def exchange(buffers, counts, k):
            """[E, C, d] buffers of this device's tokens -> the experts' outputs for them."""
            cap, d = buffers.shape[1], buffers.shape[2]
            sent = jax.lax.all_to_all(buffers.reshape(devices, local_experts, cap, d), axis, 0, 0)
            # sent[p]: device p's tokens for this device's experts -> [E/P, P * C, d]
            grouped = sent.transpose(1, 0, 2, 3).reshape(local_experts, devices * cap, d)
            if m.drops_none(inference) and m.ragged_dispatch:
                got = jax.lax.all_to_all(counts.reshape(devices, local_experts), axis, 0, 0).T  # [E/P, P]
                out = _packed_experts(m.experts, grouped, got, key=k, inference=inference)
            else:
                out = m.experts.dense(grouped, key=k, inference=inference)
            out = out.reshape(local_experts, devices, cap, d).transpose(1, 0, 2, 3)
            back = jax.lax.all_to_all(out, axis, 0, 0)  # back[p]: device p's experts on this device's tokens
            return back.reshape(num_experts, cap, d)

        b, n, d = x.shape
        k = None if key is None else jax.random.fold_in(key, jax.lax.axis_index(batch_axes))
        y, aux = m.forward(
            x.reshape(b * n, d),
            mask=mask.reshape(b * n),
            token_ids=ids.reshape(b * n),
            key=k,
            inference=inference,
            experts_fn=exchange,
        )
        out = {name: (jax.lax.psum if name in SUMMED else jax.lax.pmean)(v, batch_axes) for name, v in aux.items()}
        return y.reshape(b, n, d), out

    spec_x = PartitionSpec(batch_axes)
    aux_specs = {name: PartitionSpec() for name in AUX_NAMES}
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(_param_specs(moe, axis), spec_x, spec_x, spec_x), out_specs=(spec_x, aux_specs)
    )
    return fn(params, x, mask, ids)
