"""Unidirectional (causal) encoders for classification: `model.causal: true` on task
classify / retrieval makes every block's attention causal, `head: last` reads the last
real token, causal-only attentions (the delta rule) train as classifiers, and what cannot
take a causal encoder is refused at config time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import finite_grads, forward_and_grad, train_steps

from jxformers.nn import ModelConfig, build_model
from jxformers.nn.models import last_real

N, VOCAB = 12, 11
TINY = dict(vocab_size=VOCAB, num_classes=2, num_layers=2, d_model=8, num_heads=2, max_len=16)


def hidden(model, x, mask=None):
    """The encoder's output states `[n, d_model]` (the classifier's pooling reads them)."""
    return model.encoder.apply(x, mask, inference=True)[0][0]


hidden_jit = jax.jit(hidden)


@pytest.fixture(scope="module")
def causal_softmax():
    # a LocalRNN before every attention: its causal form is taken too
    config = ModelConfig(task="classify", causal=True, stack={"local_rnn": {"window": 3}}, **TINY)
    return build_model(config, key=jax.random.key(0))


@pytest.fixture(scope="module")
def causal_delta():
    return build_model(ModelConfig(task="classify", causal=True, attention="delta", **TINY), key=jax.random.key(1))


def test_the_default_is_the_tasks_and_causal_true_defaults_the_head_to_last():
    assert [ModelConfig(task=t).causal for t in ("classify", "retrieval", "lm", "seq2seq")] == [
        False,
        False,
        True,
        True,
    ]
    config = ModelConfig(task="retrieval", causal=True, attention="gated_delta", **TINY)
    assert config.causal_encoder and config.head.kind == "last"
    assert ModelConfig.from_dict(config.to_dict()) == config  # the resolved value round-trips
    assert ModelConfig(task="lm", causal=True).causal  # the task's own value may be written


@pytest.mark.parametrize("which", ["causal_softmax", "causal_delta"])
def test_a_causal_encoders_states_never_read_later_tokens(which, request):
    model = request.getfixturevalue(which)
    x = jax.random.randint(jax.random.key(2), (N,), 0, VOCAB)
    h = hidden_jit(model, x)
    for i in (3, 8):
        changed = hidden_jit(model, x.at[i:].set((x[i:] + 1) % VOCAB))
        np.testing.assert_allclose(changed[:i], h[:i], atol=1e-5)
        assert not np.allclose(changed[i:], h[i:], atol=1e-4)  # the later states do read them
    _, grads = forward_and_grad(model, x)
    assert finite_grads(grads)


def test_a_bidirectional_encoder_does_read_later_tokens():
    """The check above can fail: the same stack without `causal` mixes later tokens in."""
    config = ModelConfig(task="classify", head="mean", stack={"local_rnn": {"window": 3}}, **TINY)
    model = build_model(config, key=jax.random.key(0))
    x = jax.random.randint(jax.random.key(2), (N,), 0, VOCAB)
    assert not np.allclose(hidden_jit(model, x.at[8:].set((x[8:] + 1) % VOCAB))[:8], hidden_jit(model, x)[:8])


def test_last_pooling_reads_the_last_real_token_under_padding(causal_softmax):
    model, real = causal_softmax, 7
    x = jax.random.randint(jax.random.key(3), (N,), 0, VOCAB)
    mask = jnp.arange(N) < real
    pooled = jax.jit(lambda m, x, mask: m.pool(x, mask, inference=True)[0])
    out = pooled(model, x, mask)
    np.testing.assert_allclose(out, hidden_jit(model, x, mask)[real - 1], atol=1e-6)
    # padding (whatever its ids) is never read; the last real token is
    np.testing.assert_allclose(pooled(model, x.at[real:].set(0), mask), out, atol=1e-5)
    assert not np.allclose(pooled(model, x.at[real - 1].set((x[real - 1] + 1) % VOCAB), mask), out, atol=1e-4)
    assert [int(last_real(jnp.array(m, bool))) for m in ([1, 1, 0, 0], [0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0])] == [
        1,
        3,
        3,
        0,
    ]


def test_a_delta_classifier_trains_one_step_through_the_config(causal_delta):
    x = jax.random.randint(jax.random.key(4), (2, N), 0, VOCAB)
    mask = jnp.arange(N)[None] < jnp.array([[N], [9]])
    state, losses = train_steps(causal_delta, x, mask, steps=2)
    assert all(np.isfinite(losses)) and losses[1] < losses[0]
    assert finite_grads(state.params)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(task="lm", causal=False), "model.causal false: task 'lm' is causal"),
        (dict(task="seq2seq", causal=False), "model.causal false: task 'seq2seq' is causal"),
        (dict(causal=True, head="cls"), "head 'cls' \\(the CLS token at position 0 would see no token: use head last"),
        (dict(attention="delta"), "'delta' is causal only.*set model.causal: true"),
        (dict(task="retrieval", attention="gated_delta", head="last"), "set model.causal: true"),
        (dict(task="seq2seq", attention="delta"), "task 'seq2seq' has a non-causal encoder"),
        (dict(causal=True, stack="isab"), "stack 'isab' \\(its blocks are built bidirectional"),
        (dict(causal=True, stack={"filters": {0: 0.5}}), "stack.filters \\{0: 0.5\\} \\(Funnel"),
        (
            dict(causal=True, attention={"name": "nystrom", "num_landmarks": 4}),
            "model.causal true \\(task 'classify'\\) needs causal attention",
        ),
        (dict(causal=True, stack={"attention_maps": "predictive"}), "got task 'classify', model.causal true"),
    ],
)
def test_what_cannot_take_a_causal_encoder_is_refused_with_a_reason(values, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**TINY | values)


def test_deepnorm_gives_a_causal_encoder_the_encoders_constants():
    config = ModelConfig(task="classify", causal=True, norm={"placement": "deepnorm"}, **TINY)
    model = build_model(config, key=jax.random.key(0))
    assert model.encoder.blocks[0].attention.causal


def test_the_demo_trains_a_causal_only_attention_as_a_unidirectional_classifier(capsys):
    from jxformers.tools import demo
    from jxformers.train import load_experiment

    models = demo._models(["delta", "lsh"])
    assert models["delta"] == ["model.attention=delta", "model.causal=true", "model.head.kind=last"]
    assert models["lsh"] == ["model.attention=lsh"] and demo.unidirectional(models) == ["delta"]
    model = load_experiment("lra_listops", ["preset=tiny", *models["delta"]]).model
    assert model.causal_encoder and model.head.kind == "last"
    with pytest.raises(SystemExit):  # delta is accepted; the run stops at the next argument, before training
        demo.main(["--attention", "delta", "--attention", "gated_delta", "--seeds", "0"])
    assert "--seeds must be >= 1" in capsys.readouterr().err
