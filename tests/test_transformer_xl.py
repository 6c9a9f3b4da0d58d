"""Transformer-XL and the Compressive Transformer (`jxformers.nn.transformer_xl`): segments with
memory against one pass with the equivalent mask, the relative scores against their
formula, stop-gradient memories, the compressive memory's bookkeeping, the
reconstruction loss's gradient, config errors, and a tiny LM that learns."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from suites import decode_all

from jxformers.nn import ModelConfig, build_model
from jxformers.nn.transformer_xl import (
    RecurrentLM,
    relative_attention,
    relative_sinusoid,
    segment_mask,
)

SMALL = dict(task="lm", vocab_size=40, num_layers=2, d_model=16, num_heads=2, d_ff=32, max_len=64, position="none")


def xl(mem_len, **extra):
    return build_model(
        ModelConfig(architecture="transformer_xl", mem_len=mem_len, **SMALL | extra), key=jax.random.key(0)
    )


@eqx.filter_jit
def fwd(model, tokens, memory, attend=None, update=True):
    """model.forward, compiled (tests run op by op otherwise, slowly)."""
    return model.forward(tokens, memory, attend=attend, update=update)


def run_segments(model, tokens, segment, memory):
    out = []
    for s in range(0, tokens.shape[0], segment):
        logits, memory, _ = fwd(model, tokens[s : s + segment], memory)
        out.append(logits)
    return jnp.concatenate(out), memory


@pytest.mark.parametrize("mem_len,segment,pre", [(3, 4, False), (4, 4, False), (10, 4, False), (6, 3, True)])
def test_segments_with_memory_equal_one_pass_with_the_equivalent_mask(mem_len, segment, pre):
    model = xl(mem_len, norm_placement="pre" if pre else "post")
    tokens = jax.random.randint(jax.random.key(1), (4 * segment,), 0, 40)
    segmented, memory = run_segments(model, tokens, segment, model.init_memory())
    one_pass, _, _ = fwd(model, tokens, model.init_memory(0), segment_mask(tokens.shape[0], segment, mem_len), False)
    np.testing.assert_allclose(segmented, one_pass, atol=2e-5, rtol=2e-5)
    plain_causal = eqx.filter_jit(lambda m, t: m(t))(
        model, tokens
    )  # no segment restriction: a different function, which the test tells apart
    assert float(jnp.abs(plain_causal - segmented).max()) > 1e-3
    assert int(memory["length"]) == mem_len


def test_the_equivalent_mask_is_the_segments_reach():
    mask = np.asarray(segment_mask(8, 4, 2))
    assert mask[5].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]  # segment 1 reads 2 memories and its prefix
    assert mask[3].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def test_relative_scores_are_the_papers_four_terms():
    n, m, h, d = 3, 7, 2, 4
    ks = jax.random.split(jax.random.key(2), 6)
    q, k, v = (
        jax.random.normal(kk, shape) for kk, shape in zip(ks[:3], [(n, h, d), (m, h, d), (m, h, d)], strict=True)
    )
    w_r = jax.random.normal(ks[3], (8, h * d))
    u, vb = jax.random.normal(ks[4], (h, d)), jax.random.normal(ks[5], (h, d))
    r = (relative_sinusoid(jnp.arange(m), 8) @ w_r).reshape(m, h, d)
    mask = jnp.arange(m)[None] <= (m - n) + jnp.arange(n)[:, None]
    got = relative_attention(q, k, v, r, u, vb, mask=mask)
    want = np.zeros((n, h, d))
    table = np.asarray(relative_sinusoid(jnp.arange(m), 8) @ w_r).reshape(m, h, d)
    q, k, v, u, vb = (np.asarray(x, np.float64) for x in (q, k, v, u, vb))
    for i in range(n):
        for head in range(h):
            scores = []
            for j in range(m - n + i + 1):  # query i at position m - n + i sees keys 0 .. m - n + i
                rel = table[m - n + i - j, head]
                a = q[i, head] @ k[j, head] + q[i, head] @ rel + u[head] @ k[j, head] + vb[head] @ rel
                scores.append(float(a) / math.sqrt(d))
            p = np.exp(np.array(scores) - max(scores))
            want[i, head] = (p / p.sum()) @ v[: len(scores), head]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_memory_is_a_stop_gradient_and_u_v_are_shared():
    model = xl(4)
    tokens = jax.random.randint(jax.random.key(3), (8,), 0, 40)
    first_memory = fwd(model, tokens[:4], model.init_memory())[1]

    def through(m):  # memory computed inside the differentiated function
        memory = m.forward(tokens[:4], m.init_memory())[1]
        return m.forward(tokens[4:], memory)[0].sum()

    def given(m):
        return m.forward(tokens[4:], first_memory)[0].sum()

    g1, g2 = eqx.filter_jit(eqx.filter_grad(through))(model), eqx.filter_jit(eqx.filter_grad(given))(model)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert model.u.shape == (2, 8) and not hasattr(model.layers[0], "u")


def test_evaluation_may_use_a_longer_memory():
    model = xl(2, eval_mem_len=6)
    assert model.eval_mem_len == 6
    tokens = jax.random.randint(jax.random.key(4), (12,), 0, 40)
    long, _ = run_segments(model, tokens, 3, model.init_memory(model.eval_mem_len))
    one_pass = fwd(model, tokens, model.init_memory(0), segment_mask(12, 3, 6), False)[0]
    np.testing.assert_allclose(long, one_pass, atol=2e-5, rtol=2e-5)


# ----------------------------------------------------------------------------- compressive


def compressive(kind="mean", rate=2, mem_len=6, cmem_len=4, **extra):
    return build_model(
        ModelConfig(
            architecture="compressive",
            mem_len=mem_len,
            cmem_len=cmem_len,
            compression=kind,
            compression_rate=rate,
            **SMALL | extra,
        ),
        key=jax.random.key(5),
    )


@pytest.mark.parametrize("kind,rate,n", [("mean", 2, 4), ("max", 2, 4), ("conv", 2, 4), ("mean", 3, 3)])
def test_compressive_memory_bookkeeping_across_segments(kind, rate, n):
    """Layer 0's inputs are the scaled embeddings, so the memories can be followed by hand:
    the FIFO keeps the last mem_len states, the oldest n leave it each segment, and the
    evicted ones arrive compressed over windows of c in the compressed FIFO."""
    mem_len, cmem_len = 6, 4
    model = compressive(kind, rate, mem_len, cmem_len)
    tokens = jax.random.randint(jax.random.key(6), (6 * n,), 0, 40)
    states = np.asarray(model.table[tokens] * math.sqrt(16))
    conv = model.layers[0].compressor.conv
    pool = {
        "mean": lambda w: w.mean(1),
        "max": lambda w: w.max(1),
        "conv": lambda w: (
            w.reshape(w.shape[0], -1) @ np.asarray(conv.weight).T + np.asarray(conv.bias) if conv is not None else None
        ),
    }[kind]
    memory = model.init_memory()
    evicted = 0
    for s in range(6):
        _, memory, _ = fwd(model, tokens[s * n : (s + 1) * n], memory)
        seen = states[: (s + 1) * n]
        kept = seen[-mem_len:]
        assert int(memory["length"]) == len(kept)
        np.testing.assert_allclose(memory["hidden"][0][mem_len - len(kept) :], kept, atol=1e-6)
        gone = seen[: max(len(seen) - mem_len, 0)]
        assert len(gone) - evicted == (0 if len(seen) <= mem_len else min(n, len(seen) - mem_len))  # <= n leave
        evicted = len(gone)
        squeezed = pool(gone.reshape(-1, rate, 16)) if len(gone) else np.zeros((0, 16))
        squeezed = squeezed[-cmem_len:]
        assert int(memory["compressed_length"]) == len(squeezed) == min(len(gone) // rate, cmem_len)
        np.testing.assert_allclose(memory["compressed"][0][cmem_len - len(squeezed) :], squeezed, atol=1e-5)
    assert evicted == 6 * n - mem_len


def test_compressive_attends_to_the_compressed_memory():
    model = compressive("mean")
    tokens = jax.random.randint(jax.random.key(7), (16,), 0, 40)
    _, memory = run_segments(model, tokens[:12], 4, model.init_memory())
    assert int(memory["compressed_length"]) > 0
    a = fwd(model, tokens[12:], memory)[0]
    b = fwd(model, tokens[12:], memory | {"compressed": memory["compressed"] + 1.0})[0]
    c = fwd(
        model,
        tokens[12:],
        memory | {"compressed_length": jnp.zeros((), jnp.int32), "compressed": memory["compressed"] + 1.0},
    )[0]
    assert float(jnp.abs(a - b).max()) > 1e-4  # read
    d = fwd(model, tokens[12:], memory | {"compressed_length": jnp.zeros((), jnp.int32)})[0]
    np.testing.assert_allclose(c, d, atol=1e-6)  # empty slots are never read


def test_reconstruction_loss_trains_only_the_compressor():
    model = compressive("conv", rate=2)
    tokens = jax.random.randint(jax.random.key(8), (16,), 0, 40)
    _, memory = run_segments(model, tokens[:8], 4, model.init_memory())

    def recon(m):
        return m.forward(tokens[8:12], memory)[2]

    def lm(m):
        return m.forward(tokens[8:12], memory)[0].sum()

    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(recon))(model)
    assert float(loss) > 0
    compressor = {id(x) for layer in grads.layers for x in jax.tree.leaves(layer.compressor)}
    flat = jax.tree.leaves(grads)
    assert any(float(jnp.abs(g).max()) > 0 for g in flat if id(g) in compressor)
    assert all(float(jnp.abs(g).max()) == 0 for g in flat if id(g) not in compressor)
    lm_grads = eqx.filter_jit(eqx.filter_grad(lm))(model)  # and the LM loss never reaches f_c
    assert all(float(jnp.abs(x).max()) == 0 for layer in lm_grads.layers for x in jax.tree.leaves(layer.compressor))


def test_nothing_evicted_means_no_reconstruction_loss():
    model = compressive("conv", rate=2, mem_len=8)
    tokens = jax.random.randint(jax.random.key(9), (8,), 0, 40)
    _, memory, first = fwd(model, tokens[:4], model.init_memory())
    _, memory, second = fwd(model, tokens[4:], memory)
    assert float(first) == float(second) == 0.0 and int(memory["compressed_length"]) == 0


@pytest.mark.parametrize(
    "extra,match",
    [
        (dict(architecture="transformer_xl", mem_len=4, position="sinusoidal"), "set embedding.position 'none'"),
        (dict(architecture="transformer_xl", position="none", mem_len=0), "mem_len must be >= 1; got 0"),
        (
            dict(architecture="transformer_xl", position="none", mem_len=4, cmem_len=4),
            r"stack 'transformer_xl': unknown setting\(s\) \['cmem_len'\]",
        ),
        (dict(mem_len=3), r"stack 'transformer': unknown setting\(s\) \['mem_len'\]"),
        (dict(architecture="compressive", position="none", mem_len=4, cmem_len=2), "multiples"),
        (dict(architecture="compressive", position="none", mem_len=6, cmem_len=0), "cmem_len must be >= 1"),
        (dict(architecture="compressive", position="none", mem_len=6, cmem_len=2, compression="avg"), "compression"),
        (dict(architecture="transformer_xl", position="none", mem_len=4, attention="performer"), "own softmax"),
        (dict(architecture="transformer_xl", position="none", mem_len=4, task="classify"), "serves tasks"),
        (dict(architecture="transformer_xl", position="none", mem_len=4, ffn="moe"), "ffn"),
    ],
)
def test_config_errors(extra, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{"task": "lm"} | extra)


def test_memory_and_segment_errors_show_the_values():
    model = compressive("mean", rate=2)
    with pytest.raises(ValueError, match="multiple of the rate 2; got 3"):
        model.forward(jnp.arange(3), model.init_memory())
    with pytest.raises(ValueError, match=r"mem_len \(5\)"):
        model.init_memory(5)
    with pytest.raises(ValueError, match="cmem_len 0"):
        xl(4).init_memory(4, 2)


def test_a_tiny_compressive_lm_learns_on_a_stream():
    model = compressive("conv", rate=2, mem_len=4, cmem_len=4)
    stream = jnp.tile(jnp.arange(10), 8)  # period 10 > segment 4: memory is needed to predict well
    opt = optax.adam(3e-3)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = opt.init(params)

    @jax.jit
    def step(params, state, memory, tokens):
        def loss_fn(p):
            logits, new, recon = eqx.combine(p, static).forward(tokens[:-1], memory)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[1:]).mean()
            return ce + recon, (ce, new)

        (_, (ce, new)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, new, ce

    memory, losses = model.init_memory(), []
    for _ in range(6):
        for s in range(0, 76, 4):
            params, state, memory, ce = step(params, state, memory, stream[s : s + 5])
            losses.append(float(ce))
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert isinstance(eqx.combine(params, static), RecurrentLM)


@pytest.mark.parametrize("architecture", ["transformer_xl", "compressive"])
def test_decoding_token_by_token_matches_the_parallel_call(architecture):
    from jxformers.nn.generation import generate

    model = xl(4) if architecture == "transformer_xl" else compressive("conv")
    tokens = jax.random.randint(jax.random.key(10), (9,), 0, 40)
    parallel = eqx.filter_jit(lambda m, t: m(t))(model, tokens)

    np.testing.assert_allclose(decode_all(model, tokens), parallel, atol=2e-5, rtol=2e-5)
    out = generate(model, tokens[:3], steps=4, key=jax.random.key(0))
    assert out.shape == (7,)


def test_the_compressor_learns_to_reconstruct_the_attention():
    """Descending the reconstruction loss alone (it reaches only f_c) lowers it."""
    model = compressive("conv", rate=2)
    tokens = jax.random.randint(jax.random.key(11), (16,), 0, 40)
    _, memory = run_segments(model, tokens[:8], 4, model.init_memory())
    opt = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(lambda p: eqx.combine(p, static).forward(tokens[8:12], memory)[2])(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = opt.init(params), []
    for _ in range(30):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]
