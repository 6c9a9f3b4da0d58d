"""PowerNorm (Shen et al. 2020, "PowerNorm: Rethinking Batch Normalization in
Transformers", Algorithm 1) against a numpy transcription: the forward with the authors'
group scaling, the approximate backward (finite differences of the group scaling, the
ν correction by hand), the running statistics' update from a padded batch, the train
step (statistics in the state, not the optimizer's; gradient accumulation), decoding
parity, an interrupted run that resumes with the same losses and statistics, and a
sharded run (8 simulated devices) with the statistics of one device."""

from __future__ import annotations

import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_close
from test_train import losses, write_config

from jxformers import build_model
from jxformers.nn import PowerNorm, statistics, trainable, update_statistics
from jxformers.train import load_experiment, train
from jxformers.train.state import TrainState, split_model
from jxformers.train.step import make_train_step

D, EPS, ALPHA = 8, 1e-5, 0.9


def np_group_scale(x, groups):
    """The authors' GroupScaling1D: each token over the root mean square of its group's features."""
    g = x.reshape(*x.shape[:-1], groups, -1)
    return (g / np.sqrt(np.mean(g**2, -1, keepdims=True) + EPS)).reshape(x.shape)


def with_statistics(norm: PowerNorm, psi2, nu) -> PowerNorm:
    return eqx.tree_at(lambda n: (n.statistics.psi2, n.statistics.nu), norm, (jnp.asarray(psi2), jnp.asarray(nu)))


def drawn_norm(rng, groups=1):
    norm = PowerNorm(D, groups=groups)
    norm = eqx.tree_at(
        lambda n: (n.weight, n.bias),
        norm,
        (jnp.asarray(rng.normal(size=D) + 1, jnp.float32), jnp.asarray(rng.normal(size=D), jnp.float32)),
    )
    return with_statistics(norm, rng.uniform(0.5, 2.0, D).astype(np.float32), rng.normal(size=D).astype(np.float32))


@pytest.mark.parametrize("groups", [1, 2])
def test_the_forward_divides_the_group_scaled_input_by_the_running_quadratic_mean(groups):
    rng = np.random.default_rng(0)
    norm = drawn_norm(rng, groups)
    x = rng.normal(size=(5, D)) * 3 + 1
    s = norm.statistics
    expected = np_group_scale(x, groups) / np.sqrt(np.asarray(s.psi2) + EPS) * np.asarray(norm.weight)
    expected += np.asarray(norm.bias)
    assert_close(norm(jnp.asarray(x, jnp.float32)), expected, atol=1e-5)
    # no statistic of the batch enters the forward: one token alone gives its row
    assert_close(norm(jnp.asarray(x[2:3], jnp.float32)), expected[2:3], atol=1e-5)
    # bfloat16 in, bfloat16 out, computed in float32
    assert norm(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_the_backward_is_algorithm_1s_approximation():
    """∂L/∂x̂ = γ ⊙ ∂L/∂y; ∂L/∂x̂' = ∂L/∂x̂ - ν ⊙ x̂; ∂L/∂(scaled x) = ∂L/∂x̂' / ψ; then
    through the group scaling (its Jacobian by finite differences here)."""
    rng = np.random.default_rng(1)
    norm = drawn_norm(rng)
    x = rng.normal(size=(3, D)) * 2
    w = rng.normal(size=(3, D))
    got = jax.grad(lambda v: jnp.sum(norm(v) * w))(jnp.asarray(x, jnp.float32))
    s = norm.statistics
    psi = np.sqrt(np.asarray(s.psi2, np.float64) + EPS)
    x_hat = np_group_scale(x, 1) / psi
    g_hat = np.asarray(norm.weight) * w - np.asarray(s.nu) * x_hat
    g_scaled = g_hat / psi
    expected = np.zeros_like(x)
    h = 1e-6
    for t in range(3):  # each token's group scaling depends on that token alone
        jac = np.zeros((D, D))
        for i in range(D):
            up, down = x[t].copy(), x[t].copy()
            up[i] += h
            down[i] -= h
            jac[:, i] = (np_group_scale(up, 1) - np_group_scale(down, 1)) / (2 * h)
        expected[t] = jac.T @ g_scaled[t]
    assert_close(got, expected, atol=1e-4)
    # ν matters: with ν = 0 the gradient is the plain one of x / ψ
    plain = with_statistics(norm, s.psi2, jnp.zeros(D))
    assert float(jnp.abs(jax.grad(lambda v: jnp.sum(plain(v) * w))(jnp.asarray(x, jnp.float32)) - got).max()) > 1e-3


def test_the_statistics_update_from_the_unpadded_tokens_of_a_batch():
    """ψ² ← α ψ² + (1 - α) mean(x²), ν ← ν (1 - (1 - α) Γ) + (1 - α) Λ with Γ = mean(x̂²),
    Λ = mean(x̂ ⊙ ∂L/∂x̂), over the real tokens of every example (padding left out)."""
    rng = np.random.default_rng(2)
    norm = drawn_norm(rng)
    x = rng.normal(size=(3, 4, D)) * 2  # batch of 3 examples, 4 tokens each
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
    w = rng.normal(size=(3, 4, D))

    def loss(stats, model):
        model = eqx.combine(stats, model)
        return jnp.mean(jax.vmap(lambda v, m, u: jnp.sum(model(v, mask=m) * u))(x, mask, w))

    held, rest = eqx.partition(norm, statistics(norm))
    sums = jax.grad(loss)(held, rest)
    updated = update_statistics(norm, sums)

    s = norm.statistics
    psi2, nu = np.asarray(s.psi2, np.float64), np.asarray(s.nu, np.float64)
    scaled = np_group_scale(x, 1)[mask]  # [real tokens, D]
    x_hat = scaled / np.sqrt(psi2 + EPS)
    g = (np.asarray(norm.weight) * w / 3)[mask]  # ∂L/∂x̂ of the batch mean
    n = mask.sum()
    gamma, lam = (x_hat**2).sum(0) / n, (x_hat * g).sum(0) / n
    assert_close(updated.statistics.psi2, ALPHA * psi2 + (1 - ALPHA) * (scaled**2).sum(0) / n, atol=1e-5)
    assert_close(updated.statistics.nu, nu * (1 - (1 - ALPHA) * gamma) + (1 - ALPHA) * lam, atol=1e-5)
    assert float(updated.statistics.tokens) == n
    # the padded tokens' values do not matter
    x[~mask] = 1e3
    again = update_statistics(norm, jax.grad(loss)(held, rest))
    assert_close(again.statistics.psi2, updated.statistics.psi2, atol=1e-5)
    # without a mask every token of every example counts (the count must be batched under vmap)
    unmasked = jax.grad(lambda h: jnp.sum(jax.vmap(lambda v: eqx.combine(h, rest)(v))(x)))(held)
    assert float(unmasked.statistics.tokens) == 3 * 4
    # a batch of no tokens leaves the statistics as they were
    zero = jax.tree.map(jnp.zeros_like, held.statistics)
    empty = update_statistics(norm, eqx.tree_at(lambda n: n.statistics, held, zero))
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(empty), jax.tree.leaves(norm), strict=True))


def small_lm(**overrides):
    config = dict(
        task="lm", vocab_size=11, num_layers=2, d_model=D, num_heads=2, max_len=8, dropout=0.0,
        ffn={"d_ff": 16}, norm={"kind": "powernorm"},
    )  # fmt: skip
    return build_model(config | overrides, key=jax.random.key(0))


def test_the_train_step_updates_the_statistics_outside_the_optimizer():
    model = small_lm()
    params, drawn, static = split_model(model)
    assert not any(jax.tree.leaves(eqx.filter(trainable(model), statistics(model))))  # not trained
    assert len(jax.tree.leaves(eqx.filter(drawn, statistics(drawn)))) == 3 * 5  # 2 blocks x 2 norms + the final
    optimizer = optax.adamw(3e-3)
    tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, 11)
    mask = jnp.arange(8)[None] < jnp.array([[8], [6], [8], [5]])  # padded rows
    batch = {"tokens": tokens, "mask": mask, "loss_mask": mask}
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    step = jax.jit(make_train_step(static, optimizer, grad_accum=1))
    once = step(state, batch)[0]
    end = once
    for _ in range(2):
        end, metrics = step(end, batch)
        assert bool(metrics["finite"])
    stats = end.model(static).blocks[0].norms[0].statistics
    assert float(stats.tokens) == 3 * int(mask.sum())  # the real tokens of 3 steps
    assert not bool(jnp.allclose(stats.psi2, 1.0)) and not bool(jnp.allclose(stats.nu, 0.0))
    # by hand: step 1's ψ² from the first norm's input (the embeddings) over the real tokens
    x = jax.vmap(lambda t: model.embedding(t, jnp.arange(8)))(tokens)
    scaled = np_group_scale(np.asarray(x, np.float64), 1)[np.asarray(mask)]
    first = once.model(static).blocks[0].norms[0].statistics
    assert_close(first.psi2, ALPHA + (1 - ALPHA) * (scaled**2).mean(0), atol=1e-5)
    # two micro-batches sum to the batch: the same ψ² and count; ν estimates mean(x̂ ⊙ ∂L/∂x̂)
    # in the scale of the gradient it corrects, each micro-batch's loss (twice the batch's here:
    # unpadded halves of equal size)
    full = {**batch, "mask": jnp.ones((4, 8), bool), "loss_mask": jnp.ones((4, 8), bool)}
    ends = [
        jax.jit(make_train_step(static, optimizer, grad_accum=k))(state, b)[0].model(static).blocks[0].norms[0]
        for k, b in ((1, batch), (2, batch), (1, full), (2, full))
    ]
    assert_close(ends[1].statistics.psi2, ends[0].statistics.psi2, atol=1e-6)
    assert float(ends[1].statistics.tokens) == float(ends[0].statistics.tokens)
    assert_close(ends[3].statistics.nu, 2 * ends[2].statistics.nu, atol=1e-9, rtol=1e-4)


def power_norms(model) -> list[PowerNorm]:
    is_norm = lambda v: isinstance(v, PowerNorm)  # noqa: E731
    return [n for n in jax.tree.leaves(model, is_leaf=is_norm) if is_norm(n)]


def test_decoding_matches_the_forward_with_trained_statistics():
    from test_norm_variants import decoded

    for placement in ("pre", "post"):
        model = small_lm(norm={"kind": "powernorm", "placement": placement})
        rng = np.random.default_rng(3)
        drawn = [jnp.asarray(rng.uniform(0.3, 3.0, D), jnp.float32) for _ in power_norms(model)]
        model = eqx.tree_at(lambda m: [n.statistics.psi2 for n in power_norms(m)], model, drawn)
        tokens = jnp.array([1, 4, 2, 7, 3])
        assert_close(decoded(model, tokens, 8), model(tokens), atol=1e-4)


def test_a_reversible_stack_passes_the_statistics_sums_through_its_own_backward():
    model = small_lm(stack={"kind": "transformer", "reversible": True})
    params, drawn, static = split_model(model)
    optimizer = optax.sgd(1e-2)
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 11)
    batch = {"tokens": tokens, "mask": jnp.ones((2, 8), bool), "loss_mask": jnp.ones((2, 8), bool)}
    state = TrainState(params, drawn, optimizer.init(params), jnp.zeros((), jnp.int32), jax.random.key(1))
    state, metrics = jax.jit(make_train_step(static, optimizer, grad_accum=1))(state, batch)
    stats = [b.norms[i].statistics for b in state.model(static).blocks for i in range(2)]
    assert bool(metrics["finite"]) and all(float(s.tokens) == 16 for s in stats)
    assert all(not bool(jnp.allclose(s.nu, 0.0)) for s in stats)


def test_a_killed_run_resumes_with_the_same_losses_and_statistics(tmp_path):
    from jxformers.train import restore_train_state
    from jxformers.train.state import init_train_state

    config = write_config(tmp_path, model={"norm": {"kind": "powernorm"}}, train={"steps": 8, "eval_every": 8})
    experiment = load_experiment(config, ["checkpoint.async_save=false"])
    run = tmp_path / "run"
    train(experiment, run, progress=False)
    straight, straight_drawn = losses(run), restore_train_state(experiment, run)[0].drawn
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    train(experiment, run, progress=False)
    assert losses(run) == straight  # exact, step by step
    resumed = restore_train_state(experiment, run)[0].drawn
    initial = init_train_state(experiment)[0].drawn
    held = [eqx.filter(d, statistics(d)) for d in (straight_drawn, resumed, initial)]
    for a, b, first in zip(*(jax.tree.leaves(h) for h in held), strict=True):
        assert bool(jnp.all(a == b)) and not bool(jnp.all(a == first))


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_with_the_losses_and_statistics_of_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    import equinox as eqx
    from jxformers.nn import statistics
    from mesh_runs import lm_batch, same_leaves, same_losses, train_both

    config = dict(task="lm", vocab_size=31, num_layers=2, d_model=16, num_heads=2, max_len=16,
                  ffn={"d_ff": 32}, norm={"kind": "powernorm"})
    batch = lm_batch()
    runs = train_both(config, batch)
    same_losses(runs)
    held = {s: eqx.filter(runs[s].state.drawn, statistics(runs[s].state.drawn)) for s in runs}
    same_leaves(held[True], held[False], atol=1e-7)
    assert float(jax.tree.leaves(held[True])[-1]) == 3 * batch["mask"].sum()  # the final norm's count: 3 steps
    """
    )
