"""Expert parallelism for `MoE` with `jax.shard_map` (GShard's dispatch): the experts are
split over the mesh axis "expert" (E / P experts per device), the batch over the same
axis, and each device routes its own tokens, fills its capacity buffers `[E, C, d]`,
sends each expert's buffer to the device that holds it (`all_to_all`), runs its local
experts on the `P * C` tokens it receives per expert, and sends the results back
(`all_to_all`) to be combined.

    y, aux = expert_parallel_moe(moe, x, mask, mesh=mesh)   # x [batch, seq, d], batch % P == 0

Each device's tokens (its `batch / P` examples, flattened) are one routing group: the
capacity is C = max(min_capacity, ceil(cf * tokens_per_device * k / E)), and the result
equals `moe` applied to each device's flattened tokens on one device. The losses and
router entropy in aux are means over the devices' groups; dropped and expert_load are
sums. Token choice with capacity only (expert choice and dropless: not yet).
Communication per layer: two all_to_alls of E * C * d activations per device.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers.nn.moe import MoE

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


def expert_parallel_moe(
    moe: MoE, x: Float[Array, "batch seq d_model"], mask: Bool[Array, "batch seq"] | None = None, *, mesh: Mesh,
    axis: str = AXIS, key: PRNGKeyArray | None = None, inference: bool = False,
) -> tuple[Float[Array, "batch seq d_model"], dict[str, Array]]:
    """`moe` over `mesh`'s `axis`, experts and batch both split over it (see the module
    docstring). `key` is folded with the device index for per-device randomness."""
    devices = mesh.shape[axis]
    num_experts = moe.num_experts
    if moe.routing != "token_choice" or moe.dropless:
        raise ValueError("expert_parallel_moe supports router 'token_choice' with capacity dispatch (dropless False)")
    if num_experts % devices or x.shape[0] % devices:
        raise ValueError(f"num_experts ({num_experts}) and batch ({x.shape[0]}) must be multiples of the "
                         f"{axis!r} axis size ({devices})")
    mask = jnp.ones(x.shape[:2], bool) if mask is None else mask
    params, static = eqx.partition(moe, _is_param)
    local_experts = num_experts // devices

    def local(params, x, mask):
        m = eqx.combine(params, static)

        def exchange(buffers, k):
            """[E, C, d] buffers of this device's tokens -> the experts' outputs for them."""
            cap, d = buffers.shape[1], buffers.shape[2]
            sent = jax.lax.all_to_all(buffers.reshape(devices, local_experts, cap, d), axis, 0, 0)
            # sent[p]: device p's tokens for this device's experts -> [E/P, P * C, d]
            grouped = sent.transpose(1, 0, 2, 3).reshape(local_experts, devices * cap, d)
            out = m.experts.dense(grouped, key=k, inference=inference)
            out = out.reshape(local_experts, devices, cap, d).transpose(1, 0, 2, 3)
            back = jax.lax.all_to_all(out, axis, 0, 0)  # back[p]: device p's experts on this device's tokens
            return back.reshape(num_experts, cap, d)

        b, n, d = x.shape
        k = None if key is None else jax.random.fold_in(key, jax.lax.axis_index(axis))
        y, aux = m.forward(x.reshape(b * n, d), mask=mask.reshape(b * n), key=k, inference=inference,
                           experts_fn=exchange)
        out = {name: jax.lax.psum(v, axis) if name in ("dropped", "expert_load") else jax.lax.pmean(v, axis)
               for name, v in aux.items()}
        return y.reshape(b, n, d), out

    spec_x = PartitionSpec(axis)
    aux_specs = {name: PartitionSpec() for name in
                 ("z_loss", "router_entropy", "balance_loss", "dropped", "expert_load", "loss")}
    fn = jax.shard_map(local, mesh=mesh, in_specs=(_param_specs(moe, axis), spec_x, spec_x),
                       out_specs=(spec_x, aux_specs))
    return fn(params, x, mask)
