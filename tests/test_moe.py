"""Mixture-of-experts layers (jxformers/nn/moe.py): routers, losses, capacity and
dropless dispatch against per-token loops, padding, jitter, gradients, bf16; the
product-key memory (jxformers/nn/pkm.py) against a brute-force lookup; both in
ModelConfig, with the MoE auxiliary losses in the training loss."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import decode_all

from jxformers import ModelConfig, build_model
from jxformers.nn.layers import FeedForward
from jxformers.nn.moe import (
    MoE,
    capacity_positions,
    load_balancing_loss,
    top_k_route,
    z_loss,
)
from jxformers.nn.pkm import ProductKeyMemory, brute_force_lookup, product_key_lookup
from jxformers.train.step import loss_and_metrics

D, FF = 8, 16


@eqx.filter_jit
def _run(moe, x, mask=None, key=None, inference=False):
    """moe(x, ...) jitted: one compilation instead of one per operation."""
    return moe(x, mask=mask, key=key, inference=inference)


def _x(seed, n=12, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (n, D), dtype)


def _expert(moe, e, x):
    """Expert e of `moe` applied to x [n, d] by FeedForward's formula."""
    ex = moe.experts
    h = x @ ex.w_in[e] + ex.b_in[e][None]
    if ex.kind == "relu":
        h = jax.nn.relu(h)
    elif ex.kind == "gelu":
        h = jax.nn.gelu(h)
    else:
        h = (jax.nn.gelu if ex.kind == "geglu" else jax.nn.silu)(h) * (x @ ex.w_gate[e] + ex.b_gate[e][None])
    return h @ ex.w_out[e] + ex.b_out[e][None]


def _loop(moe, x, experts, gates, active):
    """sum_j gate_j expert_{e_j}(x_t), token by token (the dense reference)."""
    rows = []
    for t in range(x.shape[0]):
        y = jnp.zeros((D,))
        for j in range(experts.shape[1]):
            if bool(active[t, j]):
                y = y + gates[t, j] * _expert(moe, int(experts[t, j]), x[t : t + 1])[0]
        rows.append(y)
    return jnp.stack(rows)


def _uniform_router(moe):
    """All logits 0: every token's top choices are experts 0, 1, ... (ties: lowest index)."""
    return eqx.tree_at(lambda m: m.router.weight, moe, jnp.zeros_like(moe.router.weight))


# ----------------------------------------------------------------------------- losses


def test_load_balancing_loss_hand_example():
    probs = jnp.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    experts = jnp.array([[0], [0], [1], [0]])
    # f = (3/4, 1/4), P = (0.65, 0.35): 2 (0.75 0.65 + 0.25 0.35) = 1.15
    assert float(load_balancing_loss(probs, experts)) == pytest.approx(1.15, abs=1e-6)
    # the last token is padding: f = (2/3, 1/3), P = (2/3, 1/3): 2 * 5/9
    mask = jnp.array([True, True, True, False])
    assert float(load_balancing_loss(probs, experts, mask)) == pytest.approx(10 / 9, abs=1e-6)
    uniform = jnp.full((4, 2), 0.5)
    assert float(load_balancing_loss(uniform, jnp.array([[0], [1], [0], [1]]))) == pytest.approx(1.0)


def test_z_loss_hand_example():
    logits = jnp.array([[0.0, 0.0], [np.log(3.0), 0.0], [50.0, 50.0]])
    want = (np.log(2.0) ** 2 + np.log(4.0) ** 2) / 2
    assert float(z_loss(logits, jnp.array([True, True, False]))) == pytest.approx(want, rel=1e-6)


def test_capacity_positions_rank_major():
    # 3 tokens, top-2, 2 experts; capacity 2. First choices: 0, 0, 1 -> positions 0, 1, 0.
    # Second choices (placed after all first ones): 1, 1, 0 -> positions 1, 2, 2.
    experts = jnp.array([[0, 1], [0, 1], [1, 0]])
    position, kept = capacity_positions(experts, jnp.ones((3, 2), bool), 2, 2)
    np.testing.assert_array_equal(position, [[0, 1], [1, 2], [0, 2]])
    np.testing.assert_array_equal(kept, [[True, True], [True, False], [True, False]])


# ----------------------------------------------------------------------------- dispatch


def test_capacity_overflow_dropped_exactly():
    """Every token picks expert 0; it takes `capacity` of them, in order; the rest get 0
    (the residual carries them) and are counted; padding takes no slot."""
    n, e = 12, 4
    moe = _uniform_router(MoE(D, FF, e, capacity_factor=1.0, min_capacity=1, key=jax.random.key(0)))
    cap = moe.capacity(n, inference=False)
    assert cap == 3  # ceil(1.0 * 12 * 1 / 4)
    x = _x(1, n)
    y, aux = _run(moe, x)
    assert float(aux["dropped"]) == n - cap
    assert_close(aux["expert_load"], [cap, 0, 0, 0])
    assert_close(y[:cap], _expert(moe, 0, x[:cap]) / e, atol=1e-5)  # gate = 1/E
    assert_close(y[cap:], jnp.zeros((n - cap, D)))
    mask = jnp.arange(n) >= 2
    y, aux = _run(moe, x, mask=mask)
    assert float(aux["dropped"]) == n - 2 - cap
    assert_close(y[:2], jnp.zeros((2, D)))
    assert_close(y[2 : 2 + cap], _expert(moe, 0, x[2 : 2 + cap]) / e, atol=1e-5)
    # inference uses the eval factor: 2.0 -> capacity 6
    _, aux = _run(moe, x, inference=True)
    assert float(aux["dropped"]) == n - 6


def test_auto_dropless_method_follows_the_measurements():
    # ragged_dot at 1-2% of a dense matmul on CPU and 13% on an H100 (docs/moe_runs):
    # padded buffers (E / k times the FLOPs at dense speed) win below E / k = 8 on a GPU.
    from jxformers.nn.moe import ragged_pays

    assert not ragged_pays("cpu", 64, 1)
    assert not ragged_pays("gpu", 8, 2) and not ragged_pays("gpu", 64, 8)
    assert ragged_pays("gpu", 64, 2) and ragged_pays("tpu", 8, 2)
    assert not MoE(D, FF, 4, top_k=2, dropless=True, key=jax.random.key(3)).ragged_dispatch  # this CPU


@pytest.mark.parametrize("method", ["ragged", "padded"])
def test_dropless_equals_per_token_loop(method, ffn="swiglu"):
    moe = MoE(D, FF, 4, top_k=2, dropless=True, dropless_method=method, ffn=ffn, key=jax.random.key(3))
    assert moe.ragged_dispatch == (method == "ragged")
    x = _x(4)
    mask = jnp.arange(12) < 10
    y, aux = _run(moe, x, mask=mask)
    experts, gates, active = top_k_route(moe.router_logits(x, inference=True), 2, mask=mask)
    assert float(aux["dropped"]) == 0.0
    assert float(aux["expert_load"].sum()) == 2 * 10
    assert_close(y, _loop(moe, x, experts, gates, active), atol=1e-5)
    # the same with enough capacity, and under vmap (one merged ragged_dot for the batch)
    roomy = MoE(D, FF, 4, top_k=2, ffn=ffn, capacity_factor=2.0, key=jax.random.key(3))
    assert_close(_run(roomy, x, mask=mask)[0], y, atol=1e-5)
    xs, masks = jnp.stack([x, _x(5)]), jnp.stack([mask, jnp.ones(12, bool)])
    yb, _ = eqx.filter_jit(jax.vmap(lambda a, m: moe(a, mask=m)))(xs, masks)
    assert_close(yb[0], y, atol=1e-5)
    assert_close(yb[1], _run(moe, xs[1])[0], atol=1e-5)


def test_dropless_gradients_under_vmap_match_capacity_dispatch():
    kw = dict(top_k=2, ffn="geglu", key=jax.random.key(6))
    # the ragged_dot path (the padded one is the capacity dispatch itself)
    dropless, roomy = (
        MoE(D, FF, 4, dropless=True, dropless_method="ragged", **kw),
        MoE(D, FF, 4, capacity_factor=2.0, **kw),
    )
    xs = jnp.stack([_x(7), _x(8)])

    def loss(m):
        y, aux = jax.vmap(lambda a: m(a))(xs)
        return jnp.sum(y**2) + aux["balance_loss"].mean() + aux["z_loss"].mean()

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    g1, g2 = grad(dropless), grad(roomy)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ffn", ["relu", "swiglu"])
def test_top1_with_one_expert_equals_the_ffn(ffn):
    ffn_mod = FeedForward(D, FF, ffn, key=jax.random.key(9))
    moe = MoE(D, FF, 1, ffn=ffn, capacity_factor=1.0, key=jax.random.key(10))
    t = lambda w: w.T[None]  # noqa: E731  Linear [out, in] -> [1, in, out]
    moe = eqx.tree_at(
        lambda m: (m.experts.w_in, m.experts.b_in, m.experts.w_out, m.experts.b_out),
        moe,
        (t(ffn_mod.w_in.weight), ffn_mod.w_in.bias[None], t(ffn_mod.w_out.weight), ffn_mod.w_out.bias[None]),
    )
    if ffn == "swiglu":
        moe = eqx.tree_at(
            lambda m: (m.experts.w_gate, m.experts.b_gate), moe, (t(ffn_mod.w_gate.weight), ffn_mod.w_gate.bias[None])
        )
    x = _x(11)
    y, aux = _run(moe, x)
    assert_close(y, ffn_mod(x), atol=1e-5)
    assert float(aux["dropped"]) == 0.0 and float(aux["balance_loss"]) == pytest.approx(1.0)


def test_expert_choice_refuses_causal_and_picks_top_tokens():
    with pytest.raises(ValueError, match="leaks future tokens"):
        MoE(D, FF, 4, router="expert_choice", causal=True, key=jax.random.key(0))
    moe = MoE(D, FF, 4, router="expert_choice", capacity_factor=1.0, min_capacity=1, key=jax.random.key(12))
    x, mask = _x(13), jnp.arange(12) != 5
    y, aux = _run(moe, x, mask=mask)
    probs = jax.nn.softmax(moe.router_logits(x, inference=True), -1)
    cap = moe.capacity(12, inference=False)
    want = jnp.zeros((12, D))
    picked = set()
    for e in range(4):
        order = [int(t) for t in jnp.argsort(-jnp.where(mask, probs[:, e], -1.0))[:cap]]
        picked |= set(order)
        want = want.at[jnp.array(order)].add(probs[jnp.array(order), e, None] * _expert(moe, e, x[jnp.array(order)]))
    assert 5 not in picked
    assert_close(y, want, atol=1e-5)
    assert float(aux["dropped"]) == len(set(range(12)) - {5} - picked)
    assert_close(aux["expert_load"], [cap] * 4)


# ----------------------------------------------------------------------------- routing details


def test_padding_is_never_routed_nor_counted():
    moe = MoE(D, FF, 4, top_k=2, dropless=True, key=jax.random.key(14))
    x, mask = _x(15), jnp.arange(12) % 3 != 1
    y, aux = _run(moe, x, mask=mask)
    assert_close(y[~mask], jnp.zeros((int((~mask).sum()), D)))
    y_real, aux_real = _run(moe, x[mask])  # the real tokens alone
    assert_close(y[mask], y_real, atol=1e-5)
    for name in ("balance_loss", "z_loss", "router_entropy", "expert_load", "dropped"):
        assert_close(aux[name], aux_real[name], atol=1e-5)
    # capacity dispatch: padding takes no slot, counts in no drop
    capped = MoE(D, FF, 4, top_k=2, capacity_factor=0.5, min_capacity=1, key=jax.random.key(14))
    _, aux = _run(capped, x, mask=mask)
    assert float(aux["expert_load"].sum() + aux["dropped"]) == 2 * int(mask.sum())


def test_gshard_second_expert_used_in_proportion_to_its_gate():
    logits = jax.random.normal(jax.random.key(16), (4000, 4)) * 2
    _, gates, _ = top_k_route(logits, 2)
    _, _, active = top_k_route(logits, 2, second_policy="random", key=jax.random.key(17))
    assert bool(active[:, 0].all())
    expected = float(jnp.minimum(1.0, 2 * gates[:, 1]).mean())
    assert float(active[:, 1].mean()) == pytest.approx(expected, abs=0.03)
    moe = MoE(D, FF, 4, top_k=2, second_policy="random", capacity_factor=2.0, key=jax.random.key(18))
    x = _x(19)
    train, aux_t = _run(moe, x, key=jax.random.key(1))
    infer, aux_i = _run(moe, x, inference=True)  # inference: every chosen expert
    assert float(aux_i["expert_load"].sum()) == 24 and float(aux_t["expert_load"].sum()) < 24
    with pytest.raises(ValueError, match="needs a key"):
        moe(x)


def test_jitter_only_in_training():
    moe = MoE(D, FF, 4, jitter_eps=0.5, key=jax.random.key(20))
    x = _x(21)
    plain = moe.router(x)
    assert_close(moe.router_logits(x, inference=True), plain)
    assert_close(_run(moe, x, key=jax.random.key(1), inference=True)[0], _run(moe, x, inference=True)[0])
    a, b = (moe.router_logits(x, key=jax.random.key(s)) for s in (1, 2))
    assert not np.allclose(a, plain) and not np.allclose(a, b)
    with pytest.raises(ValueError, match="needs a key"):
        moe(x)


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=2, jitter_eps=0.1, second_policy="random"),
        dict(top_k=2, dropless=True, shared_expert=True),
        dict(router="expert_choice"),
    ],
    ids=["capacity", "dropless", "expert_choice"],
)
def test_gradients_finite_and_bf16(kw):
    moe = MoE(D, FF, 4, ffn="swiglu", key=jax.random.key(22), **kw)
    x, mask = _x(23), jnp.arange(12) < 11

    def loss(m):
        y, aux = m(x, mask=mask, key=jax.random.key(1))
        return jnp.sum(y**2) + 0.01 * aux["balance_loss"] + 1e-3 * aux["z_loss"]

    grads = eqx.filter_jit(eqx.filter_grad(loss))(moe)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)
    assert float(jnp.abs(grads.router.weight).sum()) > 0  # the router learns through the gates
    y16, aux16 = _run(moe, x.astype(jnp.bfloat16), mask=mask, inference=True)
    y32, _ = _run(moe, x, mask=mask, inference=True)
    assert y16.dtype == jnp.bfloat16 and aux16["z_loss"].dtype == jnp.float32
    assert bool(jnp.isfinite(y16.astype(jnp.float32)).all())
    assert_close(y16, y32, atol=0.1, rtol=0.1)


def test_invalid_settings_are_errors():
    with pytest.raises(ValueError, match="router must be one of"):
        MoE(D, FF, 4, router="switch", key=jax.random.key(0))
    with pytest.raises(ValueError, match="top_k must be in"):
        MoE(D, FF, 4, top_k=5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="dropless applies"):
        MoE(D, FF, 4, router="expert_choice", dropless=True, key=jax.random.key(0))
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(D, FF, 4, capacity_factor=0.0, key=jax.random.key(0))


# ----------------------------------------------------------------------------- product-key memory


def test_product_key_lookup_equals_brute_force():
    memory = ProductKeyMemory(D, 16, top_k=5, heads=3, d_key=6, key=jax.random.key(30))
    x = _x(31, 20)
    q = memory.queries(x)
    scores, index = product_key_lookup(q, memory.sub_keys, 5)
    want_scores, want_index = brute_force_lookup(q, memory.sub_keys, 5)
    np.testing.assert_array_equal(index, want_index)
    assert_close(scores, want_scores, atol=1e-5)
    # the layer: softmax over the k best scores, summed over heads, of the value rows
    weights = jax.nn.softmax(want_scores, -1)
    want = jnp.einsum("shk,shkd->sd", weights, memory.values[want_index])
    assert_close(eqx.filter_jit(lambda m, a: m(a))(memory, x), want, atol=1e-5)


def test_product_key_memory_query_norm_padding_gradients_bf16():
    memory = ProductKeyMemory(D, 8, top_k=4, heads=2, query_norm=True, key=jax.random.key(32))
    x, mask = _x(33), jnp.arange(12) < 9
    call = eqx.filter_jit(lambda m, a, mask: m(a, mask=mask))
    y = call(memory, x, mask)
    assert_close(y[:9], call(memory, x[:9], None), atol=1e-5)  # padding is not in the statistics
    q = memory.queries(x[:9])
    assert_close(q.reshape(9, -1).mean(0), jnp.zeros((2 * D,)), atol=1e-5)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x, mask=mask) ** 2)))(memory)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)))
    touched = (jnp.abs(grads.values).sum(-1) > 0).sum()
    assert 0 < int(touched) <= 9 * 2 * 4  # only the looked-up rows get gradient
    y16 = call(memory, x.astype(jnp.bfloat16), mask)
    assert y16.dtype == jnp.bfloat16
    assert_close(y16, y, atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="top_k must be in"):
        ProductKeyMemory(D, 4, top_k=5, key=jax.random.key(0))
    with pytest.raises(ValueError, match="d_key must be even"):
        ProductKeyMemory(D, 4, d_key=5, key=jax.random.key(0))


# ----------------------------------------------------------------------------- configs and the training loss

TINY = dict(vocab_size=29, num_layers=2, d_model=16, num_heads=4, d_ff=24, max_len=32)


def test_config_moe_every_other_layer_adds_weighted_aux_losses_to_the_loss():
    config = ModelConfig(
        task="lm",
        **TINY,
        layer_overrides={1: {"ffn": "moe"}},
        moe={"num_experts": 4, "top_k": 2, "dropless": True, "balance_weight": 0.5},
    )
    model = build_model(config, key=jax.random.key(40))
    assert isinstance(model.blocks[0].ffn, FeedForward) and isinstance(model.blocks[1].ffn, MoE)
    assert model.blocks[1].ffn.balance_weight == 0.5 and model.blocks[1].ffn.causal
    tokens = jax.random.randint(jax.random.key(41), (2, 12), 0, 29)
    mask = jnp.arange(12)[None, :] < jnp.array([[12], [9]])
    batch = {"tokens": tokens, "mask": mask, "loss_mask": mask}
    objective = eqx.filter_value_and_grad(lambda m: loss_and_metrics(m, batch, None, inference=True), has_aux=True)
    (loss, aux), grads = eqx.filter_jit(objective)(model)
    total, _, count = aux.stats
    assert float(jnp.abs(grads.blocks[1].ffn.router.weight).sum()) > 0  # the router learns

    @eqx.filter_jit
    def layer_aux(model, t, m):
        return model.apply(t, m, inference=True)[1].moe  # each MoE layer's aux, as a value

    aux = []
    for t, m in zip(tokens, mask, strict=True):
        layers = layer_aux(model, t, m)
        assert len(layers) == 1
        aux.append(0.5 * layers[0]["balance_loss"] + 0.001 * layers[0]["z_loss"])
    assert float(loss) == pytest.approx(float(total / count + jnp.mean(jnp.stack(aux))), rel=1e-5)


def test_config_pkm_classifier_and_config_errors():
    config = ModelConfig(**TINY, ffn="pkm", pkm={"num_keys": 8, "top_k": 4, "heads": 2, "query_norm": True})
    model = build_model(config, key=jax.random.key(42))
    assert isinstance(model.encoder.blocks[0].ffn, ProductKeyMemory)
    assert eqx.filter_jit(lambda m, t: m(t))(model, jnp.arange(10) % 29).shape == (2,)
    errors = [
        (dict(task="lm", ffn="moe", moe={"router": "expert_choice"}), "leaks future tokens"),
        (dict(ffn="moe", moe={"bogus": 1}), r"ffn 'moe': unknown setting\(s\) \['bogus'\]; known"),
        (dict(moe={"top_k": 2}), "no block has ffn 'moe'"),
        (dict(task="lm", ffn="pkm", pkm={"num_keys": 8, "query_norm": True}), "leaks future tokens"),
        (dict(ffn="pkm"), r"ffn 'pkm' needs \['num_keys'\]"),
        (dict(ffn="pkm", pkm={"top_k": 2}), r"needs \['num_keys'\]"),
        (dict(ffn="moe", reversible=True), "needs stack 'transformer'"),
        (dict(ffn="moe", moe={"num_experts": 2, "top_k": 3}), r"top_k must be in \[1, num_experts=2\]"),
        (dict(layer_overrides={0: {"ffn": "sparsest"}}), r"stack.layer_overrides\[0\].ffn kind must be one of"),
    ]
    for kwargs, match in errors:
        with pytest.raises(ValueError, match=match):
            ModelConfig(**TINY | kwargs)
    # In the component form a setting exists only on its FFN: PKM without num_keys is refused
    # when the config is made (it used to pass and fail in build_model), MoE takes no num_keys.
    small = {k: v for k, v in TINY.items() if k != "d_ff"}
    for ffn, match in (
        ({"kind": "pkm"}, r"needs \['num_keys'\] \(num_keys: sub-keys per half"),
        ("pkm", r"needs \['num_keys'\]"),
        ({"kind": "moe", "num_keys": 4}, r"unknown setting\(s\) \['num_keys'\]"),
        ({"kind": "pkm", "num_keys": 4, "d_ff": 64}, r"unknown setting\(s\) \['d_ff'\]"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**small, ffn=ffn)


def test_pkm_defaults_are_written_once_for_the_config_and_the_module():
    # The config's settings are what the module is built from: unset ones take the
    # same defaults as ProductKeyMemory's own (4 heads, Lample et al.'s multi-head memory).
    from jxformers.nn import pkm

    model = build_model(ModelConfig(**TINY, ffn="pkm", pkm={"num_keys": 4, "top_k": 2}), key=jax.random.key(0))
    memory = model.encoder.blocks[0].ffn
    direct = ProductKeyMemory(TINY["d_model"], 4, top_k=2, key=jax.random.key(0))
    assert memory.heads == direct.heads == pkm.SETTINGS["heads"] == 4
    assert memory.query.weight.shape == direct.query.weight.shape


def test_moe_and_pkm_language_model_decodes_like_its_parallel_forward():
    """Token choice is per token once nothing is dropped (dropless), and the memory
    without query normalisation is per token: decoding one token at a time equals the
    parallel forward."""
    config = ModelConfig(
        task="lm",
        **TINY,
        layer_overrides={0: {"ffn": "pkm"}, 1: {"ffn": "moe"}},
        moe={"num_experts": 4, "top_k": 2, "dropless": True},
        pkm={"num_keys": 4, "top_k": 2},
    )
    model = build_model(config, key=jax.random.key(43))
    tokens = jax.random.randint(jax.random.key(44), (8,), 0, 29)
    parallel = eqx.filter_jit(lambda m, t: m(t, inference=True))(model, tokens)

    assert_close(decode_all(model, tokens), parallel, atol=1e-4)


def test_training_logs_per_layer_moe_metrics_to_jsonl_and_tensorboard(tmp_path):
    import json

    import yaml

    from jxformers.train import load_experiment, train
    from jxformers.train.tensorboard import read_records

    config = {
        "name": "moe_tiny",
        "data": {"task": "copy", "train_size": 64, "eval_size": 16, "settings": {"max_len": 16, "symbols": 4}},
        "model": {
            "attention": "softmax",
            "num_layers": 2,
            "d_model": 16,
            "num_heads": 2,
            "d_ff": 32,
            "layer_overrides": {1: {"ffn": "moe"}},
            "moe": {"num_experts": 4, "top_k": 2, "capacity_factor": 0.5, "min_capacity": 1},
        },
        "train": {
            "steps": 3,
            "batch_size": 4,
            "learning_rate": 0.003,
            "warmup_steps": 1,
            "eval_every": 3,
            "eval_batches": 1,
            "log_every": 1,
            "grad_accum": 2,
        },
        "checkpoint": {"every": 3},
    }
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(config))
    train(load_experiment(path, []), tmp_path / "run", progress=False)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 3
    for r in steps:
        assert len(r["moe0/expert_load"]) == 4 and "moe1/dropped" not in r  # one MoE layer
        # capacity factor 0.5: half the assignments find a slot; both micro-batches are counted
        assert r["moe0/dropped"] > 0
        assert 0 < sum(r["moe0/expert_load"]) + r["moe0/dropped"] <= 4 * 16 * 2  # real tokens x top_k
        assert 0 < r["moe0/router_entropy"] <= math.log(4) + 1e-6
        assert 0.25 <= r["moe0/router_confidence"] <= 1 and r["moe0/load_imbalance"] >= 1
        for name in ("balance_loss", "z_loss", "loss"):
            assert math.isfinite(r[f"moe0/{name}"])
    events = next((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    payload = b"".join(read_records(events))
    assert b"moe0/router_entropy" in payload and b"moe0/dropped" in payload


@pytest.mark.parametrize(
    "module,cls", [("moe", "MoE"), ("pkm", "ProductKeyMemory"), ("tokenlearner", "TokenLearnerStage")]
)
def test_sub_settings_and_their_modules_share_one_set_of_defaults(module, cls):
    # ModelConfig's moe / pkm / token_learner mappings are completed from SETTINGS; the
    # modules' keyword defaults must be the same values, or the config builds another layer.
    import importlib
    import inspect

    lib = importlib.import_module(f"jxformers.nn.{module}")
    params = inspect.signature(getattr(lib, cls).__init__).parameters
    shared = {
        name: value
        for name, value in lib.SETTINGS.items()
        if name in params and params[name].default is not inspect.Parameter.empty
    }
    assert shared, f"{cls} takes none of {sorted(lib.SETTINGS)}"
    assert {name: params[name].default for name in shared} == shared
