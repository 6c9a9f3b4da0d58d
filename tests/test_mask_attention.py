"""Mask Attention Networks (Fan et al. 2021, "Mask Attention Networks: Rethinking and
Strengthen Transformer"; issue 32, Lin et al. 2021's survey section 6.5): the dynamic
mask attention sublayer (`jxformers.nn.mask_attention`) and the DMAN -> SAN -> FFN block
(`stack.dman`).

The sublayer is checked against a numpy reference of the paper's equations (float64,
loops over heads, queries and keys: M = sigmoid(x_t w + P[s - t] + U_h) times each
softmax term, renormalised), then as a model: decoding parity, padding, gradients reaching
w, P and U, the config from YAML, a training step, and the refusals.

Mutations the reference test was seen to fail (by hand, once): the mask added to the
logits rather than its log (softmax(z + M)); P indexed by t - s instead of s - t; the head
bias U dropped; the gate read from the un-normalised input under pre-norm; the mask not
renormalised (M * softmax(z) without the division). A decode step whose bias ignores the
cached positions fails the parity test.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import decode_all, finite_grads, forward, forward_and_grad, train_steps

from jxformers import ModelConfig, build_model
from jxformers.nn.mask_attention import DynamicMaskAttention, dynamic_mask_logits

D, HEADS, N = 8, 2, 7
TINY = dict(vocab_size=23, num_layers=2, d_model=16, num_heads=4, max_len=24, stack={"dman": True})


def _np(x):
    return np.asarray(x, np.float64)


def _layer_norm(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def _dman_reference(module: DynamicMaskAttention, x, mask=None, causal=False):
    """The paper's DMAN on rows x (float64): per head h, query t and key s,
    weight = M[h,t,s] exp(q_t.k_s / sqrt(d)) / sum_s' M[h,t,s'] exp(q_t.k_s' / sqrt(d)),
    M = sigmoid(h_t w + P[s - t] + U_h), over the real (and, causal, earlier) keys."""
    a = module.attention
    n = x.shape[0]
    real = np.ones(n, bool) if mask is None else np.asarray(mask)
    d_head = a.d_head

    def proj(layer, h):
        return h @ _np(layer.weight).T + _np(layer.bias)

    q = proj(a.q_proj, x).reshape(n, HEADS, d_head)
    k = proj(a.k_proj, x).reshape(n, HEADS, d_head)
    v = proj(a.v_proj, x).reshape(n, HEADS, d_head)
    w, p, u = _np(module.gate), _np(module.distance_bias), _np(module.head_bias)
    reach = (p.shape[0] - 1) // 2
    out = np.zeros((n, HEADS, d_head))
    for h in range(HEADS):
        for t in range(n):
            weights = np.zeros(n)
            for s in range(n):
                if not real[s] or (causal and s > t):
                    continue
                m = 1 / (1 + np.exp(-(x[t] @ w + p[reach + s - t] + u[h])))
                weights[s] = m * np.exp(q[t, h] @ k[s, h] / np.sqrt(d_head))
            out[t, h] = (weights / weights.sum()) @ v[:, h]
    return proj(a.o_proj, out.reshape(n, HEADS * d_head))


@pytest.mark.parametrize(("pre_norm", "causal"), [(False, False), (True, False), (False, True)])
def test_dman_is_softmax_attention_reweighted_by_its_learned_mask(pre_norm, causal):
    module = DynamicMaskAttention(D, HEADS, max_len=12, causal=causal, pre_norm=pre_norm, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (N, D))
    xs = _np(x)
    mask = jnp.array([True, True, False, True, True, True, False])
    if pre_norm:  # x + DMAN(LN(x)), the gate reading the normalised row
        want = xs + _dman_reference(module, _layer_norm(xs), mask, causal)
    else:  # the paper's post-norm: LN(x + DMAN(x))
        want = _layer_norm(xs + _dman_reference(module, xs, mask, causal))
    got = module(x.at[2].set(jnp.nan), mask)  # a padded key's content cannot reach a real row
    assert_close(got[mask], want[np.asarray(mask)], atol=2e-5)


def test_the_mask_logit_is_gate_plus_distance_plus_head_terms():
    gate = jnp.array([0.5, -1.0, 2.0])
    distance_bias = jnp.arange(5.0) * 10  # distances -2 .. 2 -> 0, 10, 20, 30, 40; P[0] = 20 here
    head_bias = jnp.array([100.0, 200.0])
    got = dynamic_mask_logits(gate, distance_bias, head_bias, jnp.arange(3), jnp.arange(4))
    want = np.zeros((2, 3, 4))
    for h in range(2):
        for t in range(3):
            for s in range(4):
                want[h, t, s] = gate[t] + 10 * (min(max(s - t, -2), 2) + 2) + head_bias[h]  # beyond reach: clipped
    assert_close(got, want, atol=0)
    # a module's own P is zero at distance 0, as the authors' `self_x`
    module = DynamicMaskAttention(D, HEADS, max_len=5, key=jax.random.key(2))
    assert module.distance_bias.shape == (9,) and float(module.distance_bias[4]) == 0.0


def test_a_saturated_mask_is_plain_softmax_attention():
    # M -> 1 everywhere (U large): DMAN is the block's SAN, the paper's all-ones mask
    module = DynamicMaskAttention(D, HEADS, max_len=8, key=jax.random.key(3))
    module = eqx.tree_at(lambda m: m.head_bias, module, jnp.full((HEADS,), 60.0))
    x = jax.random.normal(jax.random.key(4), (N, D))
    plain = module.norm(x + module.attention(x))
    assert_close(module(x), plain, atol=1e-5)


def test_the_module_decodes_like_its_causal_forward():
    module = DynamicMaskAttention(D, HEADS, max_len=12, causal=True, key=jax.random.key(5))
    x = jax.random.normal(jax.random.key(6), (N, D))
    state, rows = module.init_state(12, jnp.float32), []
    for i in range(N):
        y, state = module.step(x[i], state)
        rows.append(y)
    assert_close(jnp.stack(rows), module(x), atol=2e-5)


# ----------------------------------------------------------------------------- models


@pytest.mark.parametrize(
    "extra",
    [{}, dict(attention="linear", norm={"placement": "pre"}, embedding={"position": "rope"})],
    ids=["post-softmax", "pre-linear-rope"],
)
def test_language_models_decode_like_their_parallel_forward(extra):
    model = build_model(ModelConfig(task="lm", **TINY | extra), key=jax.random.key(0))
    assert all(isinstance(b.local, DynamicMaskAttention) for b in model.blocks)
    tokens = jax.random.randint(jax.random.key(1), (9,), 0, TINY["vocab_size"])
    assert_close(decode_all(model, tokens), forward(model, tokens), atol=3e-5)
    other = forward(model, tokens.at[-1].set((tokens[-1] + 1) % TINY["vocab_size"]))
    assert_close(other[:-1], forward(model, tokens)[:-1], atol=1e-6)  # causal: no row sees a later token


def test_an_encoder_keeps_padding_out_and_every_mask_parameter_learns():
    model = build_model(ModelConfig(**TINY, head="mean"), key=jax.random.key(2))
    tokens, mask = jnp.array([3, 7, 1, 9, 4, 4, 2, 8]), jnp.arange(8) < 6
    out, grads = forward_and_grad(model, tokens, mask)
    assert finite_grads(grads)
    assert_close(forward(model, tokens.at[6:].set(5), mask), out, atol=1e-5)
    dman = grads.encoder.blocks[0].local
    for name in ("gate", "distance_bias", "head_bias"):
        assert float(jnp.abs(getattr(dman, name)).max()) > 0, name


YAML = """
task: lm
vocab_size: 23
num_layers: 2
d_model: 16
num_heads: 4
max_len: 16
stack: {dman: true}
norm: {placement: post}
"""


def test_the_setting_reaches_the_blocks_from_yaml_and_trains():
    config = ModelConfig.from_yaml(YAML)
    assert ModelConfig.from_dict(config.to_dict()) == config
    model = build_model(config, key=jax.random.key(0))
    assert all(b.local.attention.causal and not b.local.pre_norm for b in model.blocks)
    tokens = jax.random.randint(jax.random.key(2), (4, 12), 0, 23)
    state, losses = train_steps(model, tokens, jnp.ones((4, 12), bool), steps=4)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    trained = eqx.combine(state.params, state.drawn, eqx.filter(model, lambda _: False))
    assert float(jnp.abs(trained.blocks[1].local.distance_bias - model.blocks[1].local.distance_bias).max()) > 0


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (dict(stack={"dman": True, "local_rnn": {}}), "choose one"),
        (dict(norm={"placement": "rezero"}), "stack.dman's sublayers .* got norm.placement 'rezero'"),
        (dict(stack={"dman": True, "reversible": True}), r"stack.dman is refused with \['reversible'\]"),
        (dict(stack={"dman": True, "macaron": True}), "Mask Attention Networks' block is DMAN, SAN, FFN"),
        (dict(stack={"dman": True, "cct": {}}), r"refused with stack settings \['dman'\]"),
    ],
)
def test_config_refusals_name_the_setting_and_the_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**TINY | values)


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_like_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    from mesh_runs import lm_batch, same_leaves, same_losses, train_both

    config = dict(task="lm", vocab_size=31, num_layers=2, d_model=16, num_heads=2, max_len=16,
                  ffn={"d_ff": 32}, stack={"dman": True})
    runs = train_both(config, lm_batch())
    same_losses(runs)
    dman = lambda run: [b.local for b in run.state.params.blocks]
    same_leaves(dman(runs[True]), dman(runs[False]), rtol=0, atol=1e-4)  # Adam scales up a rounding
    """
    )
