"""Expert parallelism (jxformers/nn/moe_sharded.py) on 8 simulated CPU devices, in its
own process: the shard_map layer equals the one-device layer applied to each device's
tokens (outputs, drop counts, losses, gradients)."""

import os
import pathlib
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    import equinox as eqx, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from jxformers.nn.moe import MoE
    from jxformers.nn.moe_sharded import expert_parallel_moe

    assert len(jax.devices()) == 8
    mesh = Mesh(np.array(jax.devices()[:4]), ("expert",))
    moe = MoE(8, 16, 8, top_k=2, ffn="swiglu", capacity_factor=1.0, min_capacity=1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 6, 8))
    mask = jnp.arange(6)[None, :] < jnp.array([6, 5, 6, 4, 6, 6, 3, 6])[:, None]

    def reference(m, inference):
        ys, auxs = [], []
        for p in range(4):  # device p holds examples 2p, 2p + 1: one routing group
            y, aux = m(x[2 * p:2 * p + 2].reshape(12, 8), mask=mask[2 * p:2 * p + 2].reshape(12), inference=inference)
            ys.append(y.reshape(2, 6, 8))
            auxs.append(aux)
        return jnp.concatenate(ys), auxs

    for inference in (False, True):
        y, aux = eqx.filter_jit(lambda m, a, b: expert_parallel_moe(m, a, b, mesh=mesh, inference=inference))(
            moe, x, mask)
        want, auxs = reference(moe, inference)
        np.testing.assert_allclose(y, want, atol=1e-5)
        assert float(aux["dropped"]) == sum(float(a["dropped"]) for a in auxs)
        assert (float(aux["dropped"]) > 0) == (not inference), float(aux["dropped"])
        np.testing.assert_allclose(aux["expert_load"], sum(a["expert_load"] for a in auxs), atol=1e-6)
        for name in ("z_loss", "balance_loss", "router_entropy"):
            np.testing.assert_allclose(aux[name], np.mean([float(a[name]) for a in auxs]), rtol=1e-5)

    def loss_sharded(m):
        y, aux = expert_parallel_moe(m, x, mask, mesh=mesh)
        return jnp.sum(y ** 2) + aux["loss"]

    def loss_reference(m):
        y, auxs = reference(m, False)
        return jnp.sum(y ** 2) + jnp.mean(jnp.stack([a["loss"] for a in auxs]))

    g1 = eqx.filter_jit(eqx.filter_grad(loss_sharded))(moe)
    g2 = eqx.filter_grad(loss_reference)(moe)
    for a, b in zip(jax.tree.leaves(eqx.filter(g1, eqx.is_inexact_array)),
                    jax.tree.leaves(eqx.filter(g2, eqx.is_inexact_array))):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    # training randomness (jitter, GShard's random second expert): a key per device
    noisy = MoE(8, 16, 8, top_k=2, jitter_eps=0.1, second_policy="random", key=jax.random.key(2))
    y, aux = eqx.filter_jit(lambda m, a, k: expert_parallel_moe(m, a, mesh=mesh, key=k))(noisy, x, jax.random.key(3))
    assert bool(jnp.isfinite(y).all()) and float(aux["expert_load"].sum()) < 2 * x.shape[0] * x.shape[1]
    print("OK")
""")


def test_expert_parallel_moe_equals_per_device_layer():
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("XLA_FLAGS", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]
