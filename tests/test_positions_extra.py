"""Position options beyond the survey (issue 31): xPos (Sun et al. 2022), RoPE context
scaling by position interpolation (Chen et al. 2023) and NTK-aware scaling (bloc97 2023),
and FLASH's scaled sinusoidal embedding (Hua et al. 2022). Each against a numpy reference
written from the paper's formula, decoding parity for the causal ones, and the config."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import TINY, decode_all, forward, tokens

from jxformers import ModelConfig, build_model
from jxformers.nn import Attention, Positions, Rotary, trainable, xpos
from jxformers.nn.positions import xpos_max_len, xpos_zeta

N, HEADS, D = 6, 2, 8


def _pairs(x):
    """Feature pairs (i, i + d/2) as complex numbers, the layout `rotary` turns."""
    half = x.shape[-1] // 2
    return x[..., :half] + 1j * x[..., half:]


def _unpairs(z):
    return np.concatenate([z.real, z.imag], axis=-1)


def _rope_reference(x, positions, base):
    """RoFormer's rotation in complex form: pair i times e^{i p θ_i}, θ_i = base^(-2i/d)."""
    d = x.shape[-1]
    theta = base ** (-2.0 * np.arange(d // 2) / d)
    turn = np.exp(1j * positions[:, None, None] * theta)  # [n, 1, d/2]
    return _unpairs(_pairs(np.asarray(x, np.float64)) * turn)


def _inputs(seed=0):
    return jax.random.normal(jax.random.key(seed), (N, HEADS, D))


# ----------------------------------------------------------------------------- xPos


def test_xpos_turns_like_rope_and_scales_queries_up_and_keys_down():
    # Sun et al. 2022 §3.2: f_q(q, n) = q e^{inθ} ζ^{n/B}, f_k(k, n) = k e^{-inθ}... for keys
    # the scale is ζ^{-n/B}; ζ_i = (i/(d/2) + γ)/(1 + γ). A small B makes the decay large
    # enough to fail a wrong ζ, a wrong sign or a missing scale.
    x, pos = _inputs(), np.array([0.0, 1, 2, 5, 9, 20])
    gamma, scale_base = 0.4, 8.0
    zeta = (np.arange(D // 2) / (D / 2) + gamma) / (1 + gamma)
    assert_close(xpos_zeta(D, gamma), (np.arange(0, D, 2) + 0.4 * D) / (1.4 * D))  # torchscale's buffer
    rotated = _rope_reference(x, pos, 10000.0)
    for downscale, sign in [(False, 1.0), (True, -1.0)]:
        scale = zeta ** (sign * pos[:, None, None] / scale_base)
        want = _unpairs(_pairs(rotated) * scale)
        got = xpos(x, jnp.asarray(pos), downscale=downscale, gamma=gamma, scale_base=scale_base)
        assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_xpos_logits_depend_on_the_offset_and_decay_with_it():
    rotary = Rotary(kind="xpos", xpos_scale_base=8.0)
    q, k = _inputs(1)[:1], _inputs(2)[:1]

    def score(m, n):
        return float(jnp.sum(rotary.queries(q, jnp.array([m])) * rotary.keys(k, jnp.array([n]))))

    assert score(9, 3) == pytest.approx(score(15, 9), rel=1e-4)  # relative
    # |q.k| is bounded by Σ_i |q_i||k_i| ζ_i^{(m-n)/B}: it falls with the distance.
    pair_q, pair_k = np.abs(_pairs(np.asarray(q)))[0, 0], np.abs(_pairs(np.asarray(k)))[0, 0]
    zeta = np.asarray(xpos_zeta(D))
    for distance in (8, 32):
        assert abs(score(distance, 0)) <= float(np.sum(pair_q * pair_k * zeta ** (distance / 8.0))) + 1e-6


# ----------------------------------------------------------------------------- RoPE scaling


@pytest.mark.parametrize("scaling", ["none", "linear", "ntk"])
def test_rope_scaling_is_position_interpolation_or_an_ntk_base(scaling):
    # Fractional positions: a shortened encoder's grid (token j at j L / M).
    x, pos, s, base = _inputs(3), np.array([0.0, 0.5, 1.75, 3, 10.25, 40]), 4.0, 500.0
    if scaling == "none":
        want = _rope_reference(x, pos, base)
        rotary = Rotary(base=base)
    elif scaling == "linear":  # Chen et al. 2023 eq. 4: f(x, m L / L'), s = L'/L
        want = _rope_reference(x, pos / s, base)
        rotary = Rotary(base=base, scaling="linear", factor=s)
    else:  # bloc97: base * alpha^(d / (d - 2)), positions unchanged
        want = _rope_reference(x, pos, base * s ** (D / (D - 2)))
        rotary = Rotary(base=base, scaling="ntk", factor=s)
    assert_close(rotary.queries(x, jnp.asarray(pos)), want, atol=1e-5, rtol=1e-5)
    assert_close(rotary.keys(x, jnp.asarray(pos)), want, atol=1e-5, rtol=1e-5)  # no decay: keys turn alike


def test_ntk_keeps_the_fastest_pair_and_slows_the_slowest_by_the_factor():
    # The NTK-aware argument: high frequencies are extrapolated, the lowest interpolated.
    x = jnp.zeros((1, 1, D)).at[0, 0, 0].set(1.0).at[0, 0, D // 2 - 1].set(1.0)
    plain, ntk = Rotary(), Rotary(scaling="ntk", factor=8.0)
    fast, slow = (0, D // 2), (D // 2 - 1, D - 1)  # (cos, sin) slots of pairs 0 and d/2 - 1
    p = jnp.array([3.0])
    assert_close(ntk.queries(x, p)[0, 0, fast[1]], plain.queries(x, p)[0, 0, fast[1]])
    assert_close(ntk.queries(x, 8 * p)[0, 0, slow[1]], plain.queries(x, p)[0, 0, slow[1]], atol=1e-6)


# ----------------------------------------------------------------------------- scaled sinusoidal


def test_scaled_sinusoidal_is_the_sinusoids_times_one_learned_scalar():
    d_model = 16
    positions = Positions("scaled_sinusoidal", dim=d_model, heads=4, max_len=32, causal=False, key=jax.random.key(0))
    p = np.arange(10.0)
    # Vaswani et al. §3.5: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...).
    angle = p[:, None] / 10000.0 ** (2 * np.arange(d_model // 2) / d_model)
    table = np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(10, d_model)
    assert float(positions.gain) == pytest.approx(1 / math.sqrt(d_model))  # its start: 1/sqrt(d_model)
    assert_close(positions.embed(jnp.arange(10)), table / math.sqrt(d_model), atol=1e-6)
    learned = eqx.tree_at(lambda m: m.gain, positions, jnp.asarray(0.7))
    assert_close(learned.embed(jnp.arange(10)), 0.7 * table, atol=1e-6)
    assert trainable(positions).gain  # a parameter, not a constant
    grad = jax.grad(lambda g: jnp.sum(eqx.tree_at(lambda m: m.gain, positions, g).embed(jnp.arange(10))))(0.5)
    assert float(grad) == pytest.approx(float(table.sum()), rel=1e-5)


# ----------------------------------------------------------------------------- models, decoding


@pytest.mark.parametrize(
    ("attention", "embedding"),
    [
        ("softmax", {"position": "xpos", "xpos_scale_base": 4.0}),  # a steep decay that decoding must keep
        ("linear", {"position": "xpos"}),
        ("softmax", {"position": "rope", "rope_scaling": "linear", "rope_factor": 4.0}),
        ("local", {"position": "rope", "rope_scaling": "ntk", "rope_factor": 4.0, "rope_base": 500.0}),
        ("softmax", {"position": "scaled_sinusoidal"}),
    ],
)
def test_language_models_decode_like_their_parallel_forward(attention, embedding):
    hp = {"window": 3} if attention == "local" else {}
    sizes = {k: v for k, v in TINY.items() if k != "d_ff"} | {"num_layers": 1}
    config = ModelConfig(
        task="lm", **sizes, ffn={"d_ff": TINY["d_ff"]}, attention={"name": attention, **hp}, embedding=embedding
    )
    model = build_model(config, key=jax.random.key(0))
    x = tokens(5)
    assert_close(decode_all(model, x), forward(model, x), atol=3e-5, rtol=1e-4)


def test_the_settings_reach_the_attentions_from_yaml():
    common = "task: lm\nvocab_size: 11\nmax_len: 16\nd_model: 16\nnum_layers: 1\n"
    config = ModelConfig.from_yaml(
        common + "embedding: {position: rope, rope_scaling: ntk, rope_factor: 8, rope_base: 500000}\n"
    )
    model = build_model(config, key=jax.random.key(0))
    assert model.blocks[0].attention.rope == Rotary(base=500000.0, scaling="ntk", factor=8.0)
    assert ModelConfig.from_dict(config.to_dict()) == config  # the YAML form keeps them
    config = ModelConfig.from_yaml(common + "embedding: {position: xpos, xpos_scale_base: 256, xpos_gamma: 0.5}\n")
    rope = build_model(config, key=jax.random.key(0)).blocks[0].attention.rope
    assert rope == Rotary(kind="xpos", xpos_gamma=0.5, xpos_scale_base=256.0)
    config = ModelConfig.from_yaml(common.replace("lm", "classify") + "embedding: {position: scaled_sinusoidal}\n")
    model = build_model(config, key=jax.random.key(0))
    assert model.encoder.embedding.positions.gain is not None and model.encoder.blocks[0].attention.rope is None


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"embedding": {"position": "rope", "rope_scaling": "dynamic"}},
         r"embedding.rope_scaling must be one of \['none', 'linear', 'ntk'\]; got 'dynamic'"),
        ({"embedding": {"position": "rope", "rope_scaling": "linear", "rope_factor": 0.5}},
         r"embedding.rope_factor must be >= 1; got 0.5"),
        ({"embedding": {"position": "rope", "rope_scaling": "linear"}},
         r"rope_factor s > 1 goes with rope_scaling one of \['linear', 'ntk'\].*rope_factor=1.0"),
        ({"embedding": {"position": "rope", "rope_factor": 4}}, r"rope_scaling='none', rope_factor=4.0"),
        ({"embedding": {"position": "rope", "rope_base": 1}}, r"embedding.rope_base must be > 1; got 1.0"),
        ({"embedding": {"position": "sinusoidal", "rope_base": 500.0}},
         r"\{'rope_base': 500.0\}.*embedding.position one of \['rope', 'xpos'\]; got position='sinusoidal'"),
        ({"embedding": {"position": "xpos", "rope_scaling": "ntk", "rope_factor": 2}},
         r"position='xpos' takes \['rope_base', 'xpos_gamma', 'xpos_scale_base'\].*\['rope_factor', 'rope_scaling'\]"),
        ({"embedding": {"position": "rope", "xpos_gamma": 0.5}}, r"position='rope' takes .*got \['xpos_gamma'\]"),
        ({"embedding": {"position": "xpos", "xpos_scale_base": 0}}, r"embedding.xpos_scale_base must be > 0; got 0"),
        ({"embedding": {"position": "xpos"}, "task": "classify"}, r"needs task 'lm'.*got task 'classify'"),
        ({"embedding": {"position": "xpos"}, "task": "seq2seq"}, r"needs task 'lm'.*got task 'seq2seq'"),
        ({"embedding": {"position": "xpos"}, "dtype": "float16", "max_len": 4096},
         r"max_len must be <= 2266 .*got max_len=4096"),
        ({"embedding": {"position": "rope", "rope_scaling": "ntk", "rope_factor": 2}, "d_model": 8},
         r"rope_scaling 'ntk' .* head size d > 2; block 0's attention's is 2"),
        ({"embedding": {"position": "xpos"}, "stack": "luna"}, r"stack 'luna' takes positions added .*got 'xpos'"),
        ({"embedding": {"position": "mystery"}}, r"embedding.position must be one of \[.*'scaled_sinusoidal'.*'xpos'"),
    ],
)  # fmt: skip
def test_config_refusals_name_the_key_and_the_allowed_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**({"task": "lm", "vocab_size": 11, "max_len": 16, "num_heads": 4} | values))


def test_python_refusals():
    with pytest.raises(ValueError, match="needs causal attention.*got causal=False"):
        Attention("softmax", 16, 4, rope=Rotary(kind="xpos"), key=jax.random.key(0))
    with pytest.raises(ValueError, match="needs causal attention.*got causal=False"):
        Positions("xpos", dim=16, heads=4, max_len=8, causal=False, key=jax.random.key(0))
    with pytest.raises(ValueError, match="scaling='ntk', factor=1"):
        Rotary(scaling="ntk")
    with pytest.raises(ValueError, match="xPos is not scaled"):
        Rotary(kind="xpos", scaling="linear", factor=2.0)
    assert xpos_max_len("float32") == 18130 and xpos_max_len("bfloat16") > 18000  # e^44 keys at most
