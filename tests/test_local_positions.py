"""Positions from a token's neighbours (issue 31, Lin et al. 2021's survey section 5.1):
conditional positional encodings (Chu et al. 2021, CPE: a PEG, x + DWConv(x), after
chosen blocks; `embedding.cpe`) and R-Transformer's LocalRNN (Wang et al. 2019: an RNN
over the window of the M positions ending at each position, before every block's
attention; `stack.local_rnn`), both `jxformers.nn.local`.

Each is checked against a numpy reference written from the paper's formula (float64,
loops over positions and window rows), then as models: decoding parity (causal PEG,
LocalRNN windows, with memory tokens, with rope, in seq2seq), padding that cannot leak,
gradients, the config from YAML, a training step, and the refusals.

Mutations each reference test was seen to fail (by hand, once): the PEG without its
residual x (DWConv(x) alone), its causal padding put on the right, its padded rows not
zeroed (NaN reaches real rows); the GRU's reset gate applied outside b_hn (r * W_hn h +
b_hn); the LSTM's forget and input gates swapped; the window read one row late (from
h_{i-M+2}); post-norm normalising the branch input instead of the sum; a decoding step
that does not shift its window (parity fails); the PEG run over memory tokens while
prefilling them (parity with memory tokens fails).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from suites import decode_all, finite_grads, forward, forward_and_grad, train_steps

from jxformers import ModelConfig, build_model
from jxformers.nn.local import PEG, LocalRNN, RNNCell

D, N = 6, 9
TINY = dict(vocab_size=23, num_layers=2, d_model=16, num_heads=4, max_len=40)


def _np(x):
    return np.asarray(x, np.float64)


def _x(seed=0, n=N, d=D):
    return jax.random.normal(jax.random.key(seed), (n, d))


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


# ----------------------------------------------------------------------------- PEG (Chu et al. 2021)


def _peg_reference(peg, x, causal, mask=None):
    """y_i = x_i + b + sum_t w_t x_{i + t - o}, o = k - 1 (causal) or k // 2 (centred),
    rows outside the sequence or padded (mask False) read as zeros."""
    w, b, x = _np(peg.weight), _np(peg.bias), _np(x)
    k, n = w.shape[0], x.shape[0]
    real = np.ones(n, bool) if mask is None else np.asarray(mask)
    offset = k - 1 if causal else k // 2
    y = x.copy()
    for i in range(n):
        if not real[i]:
            continue
        y[i] = x[i] + b
        for t in range(k):
            j = i + t - offset
            if 0 <= j < n and real[j]:
                y[i] += w[t] * x[j]
    return y


@pytest.mark.parametrize(("kernel", "causal"), [(3, False), (5, False), (3, True), (4, True)])
def test_peg_is_a_depthwise_convolution_with_zero_padding_added_to_its_input(kernel, causal):
    peg, x = PEG(D, kernel, causal=causal, key=jax.random.key(kernel)), _x(1)
    assert_close(peg(x), _peg_reference(peg, x, causal), atol=1e-5)
    # padded rows read as zeros (NaN there cannot reach a real row) and are left as they are
    mask = jnp.array([True, True, False, True, True, True, True, False, False])
    poisoned = x.at[2].set(jnp.nan).at[8].set(jnp.inf)
    got = peg(poisoned, mask)
    assert_close(got[mask], _peg_reference(peg, x, causal, mask)[np.asarray(mask)], atol=1e-5)
    assert bool(jnp.isnan(got[2]).all()) and bool(jnp.isinf(got[8]).all())


def test_the_zero_padding_is_what_tells_positions_apart():
    # CPE's argument (section 3.2): on a constant input every interior row is alike, and
    # only the rows near a border, whose window holds padding, differ; a 1-tap kernel has
    # no padding and tells nothing.
    x = jnp.ones((N, D))
    y = PEG(D, 3, causal=False, key=jax.random.key(0))(x)
    assert_close(y[1:-1], jnp.broadcast_to(y[1], (N - 2, D)), atol=1e-6)
    assert float(jnp.abs(y[0] - y[1]).max()) > 1e-3 and float(jnp.abs(y[-1] - y[1]).max()) > 1e-3
    one = PEG(D, 1, causal=False, key=jax.random.key(0))(x)
    assert_close(one, jnp.broadcast_to(one[0], (N, D)), atol=1e-6)


def test_peg_decodes_like_its_causal_forward_and_the_centred_one_refuses():
    peg, x = PEG(D, 4, causal=True, key=jax.random.key(2)), _x(3)
    state, rows = peg.init_state(jnp.float32), []
    for i in range(N):
        y, state = peg.step(x[i], state)
        rows.append(y)
    assert_close(jnp.stack(rows), peg(x), atol=1e-6)
    with pytest.raises(ValueError, match="centred PEG reads later positions"):
        PEG(D, 3, causal=False, key=jax.random.key(0)).step(x[0], jnp.zeros((2, D)))
    with pytest.raises(ValueError, match="odd unless causal"):
        PEG(D, 4, causal=False, key=jax.random.key(0))


# ----------------------------------------------------------------------------- LocalRNN (Wang et al. 2019)


def _cell_reference(cell, kind, x, h, c):
    """One step of PyTorch's GRU / LSTM / RNN equations (its documentation's)."""
    w_ih, w_hh, b_ih, b_hh = (_np(a) for a in (cell.w_ih, cell.w_hh, cell.b_ih, cell.b_hh))
    gi, gh = w_ih @ x + b_ih, w_hh @ h + b_hh
    if kind == "rnn":
        return np.tanh(gi + gh), c
    if kind == "gru":
        d = h.shape[0]
        r = _sigmoid(gi[:d] + gh[:d])
        z = _sigmoid(gi[d : 2 * d] + gh[d : 2 * d])
        n = np.tanh(gi[2 * d :] + r * gh[2 * d :])
        return (1 - z) * n + z * h, c
    d = h.shape[0]
    i, f, g, o = (gi + gh)[:d], (gi + gh)[d : 2 * d], (gi + gh)[2 * d : 3 * d], (gi + gh)[3 * d :]
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    return _sigmoid(o) * np.tanh(c), c


def _layer_norm(x, eps=1e-5):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)


def _local_rnn_reference(cell, kind, x, window, mask=None):
    """LocalRNN(x)_i: the cell run from h = c = 0 over x_{i-M+1} .. x_i, rows before the
    first or padded read as zeros; the last hidden state."""
    x = _np(x)
    n, d = x.shape
    real = np.ones(n, bool) if mask is None else np.asarray(mask)
    out = np.zeros_like(x)
    for i in range(n):
        h, c = np.zeros(d), np.zeros(d)
        for j in range(i - window + 1, i + 1):
            row = x[j] if j >= 0 and real[j] else np.zeros(d)
            h, c = _cell_reference(cell, kind, row, h, c)
        out[i] = h
    return out


@pytest.mark.parametrize("kind", ["gru", "lstm", "rnn"])
@pytest.mark.parametrize("pre_norm", [True, False])
def test_local_rnn_is_the_last_state_over_each_window_with_residual_and_norm(kind, pre_norm):
    m = 3
    local = LocalRNN(D, window=m, cell=kind, pre_norm=pre_norm, key=jax.random.key(4))
    cell, x = local.cells[0], _x(5)
    xs = _np(x)
    if pre_norm:  # the authors' code: x + LocalRNN(LN(x))
        want = xs + _local_rnn_reference(cell, kind, _layer_norm(xs), m)
    else:  # the paper's: LN(x + LocalRNN(x))
        want = _layer_norm(xs + _local_rnn_reference(cell, kind, xs, m))
    assert_close(local(x), want, atol=1e-5)
    # a padded row in the middle reads as zeros, whatever it holds
    mask = jnp.array([True, True, True, False, True, True, True, True, False])
    got = local(x.at[3].set(jnp.nan).at[8].set(jnp.inf), mask)
    inner = _layer_norm(xs) if pre_norm else xs
    rnn = _local_rnn_reference(cell, kind, inner, m, mask)
    want = xs + rnn if pre_norm else _layer_norm(xs + rnn)
    assert_close(got[mask], want[np.asarray(mask)], atol=1e-5)


def test_stacked_sublayers_each_read_their_own_window_and_decode_alike():
    local = LocalRNN(D, window=4, cell="lstm", layers=2, key=jax.random.key(6))
    x = _x(7)
    h = _np(x)
    for cell in local.cells:
        h = h + _local_rnn_reference(cell, "lstm", _layer_norm(h), 4)
    assert_close(local(x), h, atol=1e-5)
    state, rows = local.init_state(N, jnp.float32), []
    for i in range(N):
        y, state = local.step(x[i], state)
        rows.append(y)
    assert_close(jnp.stack(rows), local(x), atol=1e-5)


def test_a_window_of_one_is_a_single_step_from_zero():
    cell = RNNCell("gru", D, key=jax.random.key(8))
    x = _x(9)
    want = np.stack([_cell_reference(cell, "gru", row, np.zeros(D), np.zeros(D))[0] for row in _np(x)])
    assert_close(cell.last_of_windows(x, 1), want, atol=1e-5)


# ----------------------------------------------------------------------------- models

CAUSAL_VARIANTS = {
    "cpe-alone": dict(embedding={"cpe": {}}),
    "cpe-even-kernel-everywhere": dict(embedding={"cpe": {"kernel_size": 4, "after": [-1, 0, 1]}}),
    "cpe-rope-memory": dict(embedding={"position": "rope", "cpe": {"after": [-1, 1]}, "extra_tokens": 2}),
    "local-gru": dict(stack={"local_rnn": {"window": 3}}),
    "local-lstm-2-post": dict(
        stack={"local_rnn": {"window": 4, "cell": "lstm", "layers": 2}}, norm={"placement": "post"}
    ),
    "local-rnn-maps-memory": dict(
        stack={"local_rnn": {"cell": "rnn", "window": 2}, "attention_maps": "residual"}, embedding={"extra_tokens": 1}
    ),
    "both-linear": dict(attention="linear", embedding={"cpe": {"after": [0]}}, stack={"local_rnn": {"window": 3}}),
}


@pytest.mark.parametrize("variant", list(CAUSAL_VARIANTS))
def test_language_models_decode_like_their_parallel_forward(variant):
    model = build_model(ModelConfig(task="lm", **TINY | CAUSAL_VARIANTS[variant]), key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (N,), 0, TINY["vocab_size"])
    assert_close(decode_all(model, tokens), forward(model, tokens), atol=2e-5)
    # causal: a later token never changes an earlier row
    other = forward(model, tokens.at[-1].set((tokens[-1] + 1) % TINY["vocab_size"]))
    assert_close(other[:-1], forward(model, tokens)[:-1], atol=1e-6)


def test_seq2seq_decodes_with_a_causal_decoder_and_a_centred_encoder():
    extra = dict(embedding={"cpe": {"after": [-1, 0]}}, stack={"local_rnn": {"window": 3}})
    model = build_model(ModelConfig(task="seq2seq", **TINY | extra), key=jax.random.key(2))
    assert not model.encoder.embedding.positions.pegs[0].causal and model.decoder.embedding.positions.pegs[0].causal
    src, tgt = jnp.array([3, 1, 4, 1, 5, 9]), jnp.array([2, 6, 5, 3, 5])
    decoder = model.conditioned(src)
    assert_close(decode_all(decoder, tgt), decoder(tgt), atol=2e-5)


def test_cpe_gives_a_position_free_encoder_its_order():
    # without positions, mean pooling makes the classifier blind to the order of its
    # tokens; one PEG (CPE alone: position none) makes it see it
    base = TINY | dict(head="mean")
    tokens = jnp.array([3, 7, 1, 9, 4, 4, 2])
    swapped = tokens[::-1]
    blind = build_model(ModelConfig(**base, embedding={"position": "none"}), key=jax.random.key(3))
    assert_close(forward(blind, tokens), forward(blind, swapped), atol=1e-5)
    config = ModelConfig(**base, embedding={"cpe": {}})
    assert config.embedding.position == "none"  # CPE alone, as CPVT
    seeing = build_model(config, key=jax.random.key(3))
    assert float(jnp.abs(forward(seeing, tokens) - forward(seeing, swapped)).max()) > 1e-4


def test_position_is_none_by_default_where_cpe_or_a_local_rnn_gives_the_order():
    assert ModelConfig(**TINY, embedding={"cpe": {}}).embedding.position == "none"
    assert ModelConfig(**TINY, stack={"local_rnn": {}}).embedding.position == "none"
    assert ModelConfig(**TINY, embedding={"position": "learned", "cpe": {}}).embedding.position == "learned"
    assert ModelConfig(**TINY).embedding.position == "sinusoidal"


@pytest.mark.parametrize(
    "extra",
    [
        # the second PEG convolves the shortened grid (after block 1, the filter before it)
        dict(embedding={"cpe": {"after": [-1, 1]}}, head="cls", stack={"filters": {1: 0.5}}, num_layers=3),
        dict(embedding={"position": "learned", "cpe": {}, "extra_tokens": 2, "extra_kind": "registers"}),
        dict(stack={"local_rnn": {"window": 3, "cell": "lstm"}, "filters": {1: 0.5}}, head="mean"),
    ],
    ids=["cpe-cls-filter", "cpe-learned-registers", "local-filter"],
)
def test_encoders_keep_padding_out_and_have_finite_gradients(extra):
    model = build_model(ModelConfig(**TINY | extra), key=jax.random.key(5))
    tokens = jnp.array([3, 7, 1, 9, 4, 4, 2, 8])
    mask = jnp.arange(8) < 6
    out, grads = forward_and_grad(model, tokens, mask)
    assert finite_grads(grads)
    assert_close(forward(model, tokens.at[6:].set(5), mask), out, atol=1e-5)  # padded tokens change nothing
    if "cpe" in extra.get("embedding", {}):  # every PEG parameter is reached
        pegs = grads.encoder.embedding.positions.pegs
        assert all(float(jnp.abs(p.weight).max()) > 0 for p in pegs)


def test_the_cls_token_passes_the_peg_by():
    model = build_model(ModelConfig(**TINY, head="cls", embedding={"cpe": {"after": [-1]}}), key=jax.random.key(6))
    positions = model.encoder.embedding.positions
    x, mask = _x(1, 5, TINY["d_model"]), jnp.ones((5,), bool)
    y = positions.condition(-1, x, mask, skip=1)
    assert_close(y[0], x[0], atol=0)
    assert_close(y[1:], positions.pegs[0](x[1:]), atol=1e-6)
    assert positions.condition(0, x, mask, skip=1) is x  # no PEG after block 0


YAML = """
task: lm
vocab_size: 23
num_layers: 3
d_model: 16
num_heads: 4
max_len: 32
embedding:
  position: alibi
  cpe: {kernel_size: 5, after: [0, 2]}
stack:
  local_rnn: {window: 5, cell: lstm, layers: 2}
"""


def test_the_settings_reach_the_modules_from_yaml_and_train():
    config = ModelConfig.from_yaml(YAML)
    assert ModelConfig.from_dict(config.to_dict()) == config
    model = build_model(config, key=jax.random.key(0))
    positions = model.embedding.positions
    assert positions.kind == "alibi" and positions.peg_after == (0, 2)
    assert [p.kernel_size for p in positions.pegs] == [5, 5] and all(p.causal for p in positions.pegs)
    for block in model.blocks:
        assert block.local.window == 5 and [c.kind for c in block.local.cells] == ["lstm", "lstm"]
    tokens = jax.random.randint(jax.random.key(2), (4, 12), 0, 23)
    state, losses = train_steps(model, tokens, jnp.ones((4, 12), bool), steps=4)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    trained = eqx.combine(state.params, state.drawn, eqx.filter(model, lambda _: False))
    for got, was in ((trained.blocks[0].local.cells[0].w_hh, model.blocks[0].local.cells[0].w_hh),
                     (trained.embedding.positions.pegs[1].weight, positions.pegs[1].weight)):  # fmt: skip
        assert float(jnp.abs(got - was).max()) > 0


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (dict(embedding={"cpe": {"kernel_size": 4}}), "must be odd in an encoder"),
        (dict(embedding={"cpe": {"after": [2]}}), r"names blocks in \[-1, 2\)"),
        (dict(embedding={"cpe": {"after": [-2]}}), r"embedding.cpe.after"),
        (dict(embedding={"cpe": {"after": [0, 0]}}), "distinct block indices"),
        (dict(embedding={"cpe": {"after": []}}), "distinct block indices"),
        (dict(embedding={"cpe": {"size": 3}}), r"unknown setting\(s\) \['size'\]"),
        (dict(embedding={"cpe": {"after": [0]}}, stack={"reversible": True}), "PEGs on the embeddings only"),
        (dict(embedding={"cpe": {}}, stack="isab"), "apply to stack 'transformer'"),
        (
            dict(
                embedding={"cpe": {"after": [1]}},
                num_layers=3,
                stack={"token_learner": {"after_layer": 1, "num_tokens": 2}},
            ),
            "a set with no order",
        ),
        (
            dict(task="seq2seq", embedding={"cpe": {"after": [2]}}, num_layers=3, decoder={"num_layers": 2}),
            "decoder layers 2",
        ),
        (dict(stack={"local_rnn": {"cell": "transformer"}}), "stack.local_rnn.cell"),
        (dict(stack={"local_rnn": {"window": 0}}), "stack.local_rnn.window"),
        (dict(stack={"local_rnn": {}}, norm={"placement": "rezero"}), "got norm.placement 'rezero'"),
        (dict(stack={"local_rnn": {}, "reversible": True}), r"refused with \['reversible'\]"),
        (dict(stack={"local_rnn": {}, "filters": {1: 0.5}, "downsample": "funnel"}), r"refused with \['funnel'\]"),
    ],
)
def test_config_refusals_name_the_setting_and_the_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**TINY | values)


def test_python_refusals():
    from jxformers.nn import Positions

    with pytest.raises(ValueError, match="kernel size and distinct block indices together"):
        Positions("none", dim=8, heads=2, max_len=8, causal=False, key=jax.random.key(0), cpe_kernel=3)
    with pytest.raises(ValueError, match="window M >= 1"):
        LocalRNN(D, window=0, cell="gru", key=jax.random.key(0))
    with pytest.raises(ValueError, match="cell must be one of"):
        RNNCell("transformer", D, key=jax.random.key(0))
