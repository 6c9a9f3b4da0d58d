"""Linformer's parameter sharing (Wang, Li, Khabsa, Fang & Ma 2020, "Linformer:
Self-Attention with Linear Complexity", section 4, "Additional Efficiency Techniques"):
headwise (E, F per layer, shared by its heads), key-value (E = F per layer) and layerwise
(one E = F for every layer of the model), the `sharing` hyper-parameter of `linformer`.

The op against a numpy reference of softmax(Q (E K)^T / sqrt(d)) (F V) with F = E; the
models by their parameter counts (shapes alone) and, for layerwise, by holding one E that
every layer reads (a leaf once; its gradient the sum of the layers', a gradient step
keeping it one); the refusals. The generic suite (tests/attention_facts.py) trains the
attention through the config.

Mutations the tests were seen to fail (by hand, once): "kv" keeping its own F; the layerwise
tie skipped (each layer its own E); the filled blocks reading block 0's E only in block 1.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import finite_grads, forward_and_grad

from jxformers import ModelConfig, build_model, registry
from jxformers.nn.attention import attention_modules

K, MAX_LEN, D, LAYERS = 4, 16, 8, 3
CONFIG = dict(
    task="classify", vocab_size=13, num_classes=2, num_layers=LAYERS, d_model=D, num_heads=2, max_len=MAX_LEN,
    ffn={"d_ff": 16},
)  # fmt: skip


def _config(sharing, **extra):
    return CONFIG | {"attention": {"name": "linformer", "proj_len": K, "sharing": sharing}} | extra


def _count(tree) -> int:
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(x.shape)) for x in leaves if hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.floating))


@pytest.fixture(scope="module")
def layerwise():
    return build_model(_config("layerwise"), key=jax.random.key(0))


def test_kv_sharing_projects_keys_and_values_by_one_e():
    rng = np.random.default_rng(0)
    n, heads, d = 10, 2, 4
    q, k, v = (rng.standard_normal((n, heads, d)).astype(np.float32) for _ in range(3))
    arrays = registry.get("linformer").init_arrays(
        jax.random.key(1), heads=heads, kv_heads=heads, d_k=d, d_v=d, proj_len=K, max_len=MAX_LEN, sharing="kv"
    )
    assert set(arrays) == {"e_proj"}
    e = np.asarray(arrays["e_proj"], np.float64)[:, :n]
    want = np.empty((n, heads, d))
    for h in range(heads):
        pk, pv = e @ k[:, h], e @ v[:, h]  # E K and F V with F = E
        s = q[:, h] @ pk.T / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        want[:, h] = (p / p.sum(-1, keepdims=True)) @ pv
    got = registry.get("linformer")(q, k, v, arrays=arrays, proj_len=K, max_len=MAX_LEN, sharing="kv")
    assert_close(got, want, atol=1e-5)


def test_parameter_counts_by_sharing():
    counts = {
        s: _count(eqx.filter_eval_shape(build_model, _config(s), key=jax.random.key(0)))
        for s in ("headwise", "kv", "layerwise")
    }
    e = K * MAX_LEN
    assert counts["headwise"] - counts["kv"] == LAYERS * e  # one F per layer gone
    assert counts["kv"] - counts["layerwise"] == (LAYERS - 1) * e  # one E for the model


def test_a_layerwise_model_holds_one_e_that_every_layer_reads(layerwise):
    blocks = layerwise.encoder.blocks if hasattr(layerwise, "encoder") else layerwise.blocks
    held = [m.arrays.get("e_proj") for b in blocks for m in attention_modules(b)]
    assert held[0] is not None and all(x is None for x in held[1:])
    assert all("f_proj" not in m.arrays for b in blocks for m in attention_modules(b))
    encoder = layerwise.encoder
    filled = encoder.plan.filled(encoder.blocks)
    assert all(attention_modules(b)[0].arrays["e_proj"] is held[0] for b in filled)
    # a kv-shared model (each layer its own E) with every E set to that one: the same model, E's
    # gradient the sum of its layers'
    kv = build_model(_config("kv"), key=jax.random.key(0))
    where = lambda m: [a.arrays["e_proj"] for b in m.encoder.blocks for a in attention_modules(b)]  # noqa: E731
    copies = eqx.tree_at(where, kv, [held[0]] * LAYERS)
    x = jax.random.randint(jax.random.key(3), (MAX_LEN - 3,), 0, CONFIG["vocab_size"])
    out, grads = forward_and_grad(layerwise, x)
    out_copies, grads_copies = forward_and_grad(copies, x)
    assert_close(out, out_copies, atol=1e-6)
    assert finite_grads(grads)
    each = [attention_modules(b)[0].arrays["e_proj"] for b in grads_copies.encoder.blocks]
    assert_close(attention_modules(grads.encoder.blocks[0])[0].arrays["e_proj"], sum(each), atol=1e-6)
    assert float(jnp.abs(each[0] - sum(each)).max()) > 1e-7  # the later layers do read it
    # a gradient step (the train step's update: the model's leaves, the hollow ones None) keeps one E
    stepped = eqx.apply_updates(layerwise, jax.tree.map(lambda g: -0.1 * g, grads))
    after = [m.arrays.get("e_proj") for b in stepped.encoder.blocks for m in attention_modules(b)]
    assert after[0] is not None and all(x is None for x in after[1:])
    assert_close(after[0], held[0] - 0.1 * sum(each), atol=1e-6)


def test_refusals_name_the_setting_and_the_values():
    with pytest.raises(ValueError, match="sharing.*'per_layer'"):
        ModelConfig.from_dict(_config("per_layer"))
    with pytest.raises(ValueError, match="layerwise.*'universal'"):
        ModelConfig.from_dict(_config("layerwise", stack={"kind": "universal"}))
