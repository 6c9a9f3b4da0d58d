"""Expert parallelism (jxformers/nn/moe_sharded.py) on 8 simulated CPU devices, in its
own process: the shard_map layer equals the one-device layer applied to each device's
tokens (outputs, drop counts, losses, gradients) for top-1 and top-2 token choice with
capacity, dropless token choice, expert choice, hash routing (token ids split like the
batch), BASE (the balanced assignment of each device's tokens in training, greedy at
inference) and expert prototyping (capacity and dropless), with padding, on an
expert-only mesh and on a data x expert mesh."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST_COMPILE

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 FAST_COMPILE"
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from jxformers.nn.moe import MoE
    from jxformers.nn.moe_sharded import expert_parallel_moe

    assert len(jax.devices()) == 8
    x = jax.random.normal(jax.random.key(1), (8, 6, 8))
    mask = jnp.arange(6)[None, :] < jnp.array([6, 5, 6, 4, 6, 6, 3, 6])[:, None]
    ids = jax.random.randint(jax.random.key(7), (8, 6), 0, 11)  # token ids: hash routing reads them
    expert_mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
    grid = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "expert"))

    def reference(m, groups, inference):
        ys, auxs, per = [], [], x.shape[0] // groups
        for g in range(groups):  # routing group g: examples g*per ... (g+1)*per - 1
            sl = slice(g * per, (g + 1) * per)
            y, aux = m(x[sl].reshape(per * 6, 8), mask=mask[sl].reshape(per * 6),
                       token_ids=ids[sl].reshape(per * 6), inference=inference)
            ys.append(y.reshape(per, 6, 8))
            auxs.append(aux)
        return jnp.concatenate(ys), auxs

    def check(moe, mesh, data_axis, groups, *, drops, inference_too=False):
        sharded = lambda m, inference: expert_parallel_moe(  # noqa: E731
            m, x, mask, token_ids=ids, mesh=mesh, data_axis=data_axis, inference=inference)
        # inference differs in capacity, and for BASE in routing (greedy, not balanced)
        for inference in (False, True) if inference_too else (False,):
            y, aux = eqx.filter_jit(sharded)(moe, inference)
            want, auxs = eqx.filter_jit(reference)(moe, groups, inference)
            np.testing.assert_allclose(y, want, atol=1e-5)
            assert float(aux["dropped"]) == sum(float(a["dropped"]) for a in auxs)
            if drops is not None and not inference:
                assert (float(aux["dropped"]) > 0) == drops, float(aux["dropped"])
            np.testing.assert_allclose(aux["expert_load"], sum(a["expert_load"] for a in auxs), atol=1e-6)
            for name in ("z_loss", "balance_loss", "router_entropy", "loss"):
                np.testing.assert_allclose(aux[name], np.mean([float(a[name]) for a in auxs]), rtol=1e-5, atol=1e-7)

        def loss_sharded(m):
            y, aux = sharded(m, False)
            return jnp.sum(y ** 2) + aux["loss"]

        def loss_reference(m):
            y, auxs = reference(m, groups, False)
            return jnp.sum(y ** 2) + jnp.mean(jnp.stack([a["loss"] for a in auxs]))

        g1 = eqx.filter_jit(eqx.filter_grad(loss_sharded))(moe)
        g2 = eqx.filter_jit(eqx.filter_grad(loss_reference))(moe)  # compiled once, not op by op
        for a, b in zip(jax.tree.leaves(eqx.filter(g1, eqx.is_inexact_array)),
                        jax.tree.leaves(eqx.filter(g2, eqx.is_inexact_array))):
            np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)

    top2 = MoE(8, 16, 8, top_k=2, ffn="swiglu", capacity_factor=1.0, min_capacity=1, key=jax.random.key(0))
    check(top2, expert_mesh, None, 4, drops=True, inference_too=True)
    check(top2, grid, "data", 8, drops=True)
    top1 = MoE(8, 16, 8, top_k=1, capacity_factor=0.5, min_capacity=1, key=jax.random.key(4))
    check(top1, grid, "data", 8, drops=True)
    for method in ("ragged", "padded"):
        dropless = MoE(8, 16, 8, top_k=2, dropless=True, dropless_method=method, key=jax.random.key(5))
        check(dropless, expert_mesh, None, 4, drops=False)
    ragged = MoE(8, 16, 8, top_k=2, dropless=True, dropless_method="ragged", key=jax.random.key(5))
    check(ragged, grid, "data", 8, drops=False)
    choice = MoE(8, 16, 8, router="expert_choice", capacity_factor=1.0, min_capacity=1, key=jax.random.key(6))
    check(choice, grid, "data", 8, drops=None)
    hashed = MoE(8, 16, 8, router="hash", vocab_size=11, key=jax.random.key(8))
    check(hashed, grid, "data", 8, drops=False)
    base = MoE(8, 16, 8, router="base", ffn="swiglu", key=jax.random.key(9))
    check(base, expert_mesh, None, 4, drops=False, inference_too=True)
    check(base, grid, "data", 8, drops=False, inference_too=True)
    proto = MoE(8, 16, 8, router="prototype", top_k=2, capacity_factor=1.0, min_capacity=1, key=jax.random.key(10))
    check(proto, grid, "data", 8, drops=None)
    for method in ("ragged", "padded"):
        dropless = MoE(8, 16, 8, router="prototype", top_k=4, dropless=True, dropless_method=method,
                       key=jax.random.key(11))
        check(dropless, expert_mesh, None, 4, drops=False)

    # training randomness (jitter, GShard's random second expert): a key per device
    noisy = MoE(8, 16, 8, top_k=2, jitter_eps=0.1, second_policy="random", key=jax.random.key(2))
    y, aux = eqx.filter_jit(lambda m, a, k: expert_parallel_moe(m, a, mesh=grid, data_axis="data", key=k))(
        noisy, x, jax.random.key(3))
    assert bool(jnp.isfinite(y).all()) and float(aux["expert_load"].sum()) < 2 * x.shape[0] * x.shape[1]
    for bad, words in ((dict(mesh=expert_mesh, data_axis="data"), "'data' is not in the mesh"),
                       (dict(mesh=Mesh(np.array(jax.devices()[:3]), ("expert",))), "multiple of the 'expert'")):
        try:
            expert_parallel_moe(top2, x, mask, **bad)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError(bad)
    try:
        expert_parallel_moe(hashed, x, mask, mesh=grid, data_axis="data")
    except ValueError as e:
        assert "pass token_ids" in str(e), e
    else:
        raise AssertionError("hash routing without token ids")
    print("OK")
""")


@pytest.mark.heavy
@pytest.mark.multidevice
def test_expert_parallel_moe_equals_per_device_layer():
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("FAST_COMPILE", FAST_COMPILE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]
