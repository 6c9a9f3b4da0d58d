"""Memory tokens (Burtsev et al. 2020, "Memory Transformer", arXiv 2006.11527), registers
(Darcet et al. 2023, "Vision Transformers Need Registers", arXiv 2309.16588) and the
all-attention layer without an FFN (Sukhbaatar et al. 2019, "Augmenting Self-attention
with Persistent Memory", arXiv 1907.01470, section 4): each model against the same
weights run by hand on the papers' sequences ([mem; x], [CLS; reg; x], LN(x + A(x)) with
A over [persistent; keys] in numpy); padding, jit and grad, decoding parity, the
config's refusals and the YAML / `--set` forms."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import decode_all, forward, forward_and_grad

from jxformers.nn import ModelConfig, build_model
from jxformers.train.experiment import load_experiment

D, HEADS, VOCAB, M = 16, 2, 13, 3


def config(task, layers=1, **values):
    """One layer unless a test needs more: the extra tokens' rows act within each layer."""
    return ModelConfig(task=task, vocab_size=VOCAB, num_layers=layers, d_model=D, num_heads=HEADS, max_len=16, **values)


@eqx.filter_jit
def by_hand(blocks, x, mask, positions, bias=None):
    for block in blocks:
        x = block(x, kv_mask=mask, positions=positions, bias=bias)
    return x


def moved(model_part, rows=slice(None)):
    """The model with its extra tokens `rows` moved at random (a shift along all ones
    would vanish in the LayerNorm)."""
    extra = model_part.embedding.extra
    noise = jax.random.normal(jax.random.key(9), extra.shape)[rows]
    return eqx.tree_at(lambda m: m.embedding.extra, model_part, extra.at[rows].add(noise))


@eqx.filter_jit
def encode(encoder, tokens, mask):
    """The encoder's (hidden rows, mask), compiled whole."""
    return encoder.apply(tokens, mask)[0]


TOKENS = jnp.array([3, 1, 4, 1, 5, 9])
MASK = jnp.array([True, True, True, True, False, False])


def test_memory_tokens_are_the_encoder_run_on_mem_then_x():
    model = build_model(
        config("classify", head="mean", embedding={"extra_tokens": M, "position": "rope"}), key=jax.random.key(0)
    )
    enc = model.encoder
    n = TOKENS.shape[0]
    h, mask = encode(enc, TOKENS, MASK)
    assert h.shape == (M + n, D) and bool(mask[:M].all()) and bool((mask[M:] == MASK).all())  # kept, real
    # By hand: [mem; x], x at positions M.., every row of the grid a rotary position.
    x = jnp.concatenate([enc.embedding.extra, enc.embedding(TOKENS, jnp.arange(M, M + n))])
    full = jnp.concatenate([jnp.ones(M, bool), MASK])
    ref = enc.norm(by_hand(enc.blocks, x, full, jnp.arange(M + n, dtype=jnp.float32)))
    np.testing.assert_allclose(h, ref, atol=1e-5)
    # The mean head reads the real tokens only, not the memory rows.
    w = MASK[:, None].astype(jnp.float32)
    pooled = (ref[M:] * w).sum(0) / w.sum()
    np.testing.assert_allclose(forward(model, TOKENS, MASK), model.head(pooled), atol=1e-5)
    # Padding: what sits in padded slots changes nothing.
    np.testing.assert_allclose(forward(model, TOKENS.at[4:].set(7), MASK), forward(model, TOKENS, MASK), atol=1e-6)
    # The memory acts: other memory vectors, other real outputs.
    other = moved(enc)
    assert float(jnp.abs(encode(other, TOKENS, MASK)[0][M:] - h[M:]).max()) > 1e-3


def test_registers_are_discarded_at_the_output_and_change_the_real_tokens():
    model = build_model(
        config("classify", embedding={"extra_tokens": M, "extra_kind": "registers"}), key=jax.random.key(1)
    )
    enc = model.encoder
    n = TOKENS.shape[0]
    h, mask = encode(enc, TOKENS, MASK)
    assert h.shape == (1 + n, D) and bool((mask == jnp.concatenate([jnp.ones(1, bool), MASK])).all())
    # By hand: [CLS; reg; x] (tokens at positions 1 + M..), registers dropped afterwards.
    x = enc.embedding(TOKENS, jnp.arange(1 + M, 1 + M + n))
    x = jnp.concatenate([enc.cls[None], enc.embedding.extra, x])
    full = jnp.concatenate([jnp.ones(1 + M, bool), MASK])
    ref = enc.norm(by_hand(enc.blocks, x, full, jnp.arange(1 + M + n, dtype=jnp.float32)))
    np.testing.assert_allclose(h, jnp.concatenate([ref[:1], ref[1 + M :]]), atol=1e-5)
    np.testing.assert_allclose(forward(model, TOKENS, MASK), model.head(ref[0]), atol=1e-5)  # CLS is h[0]
    other = moved(enc)
    assert float(jnp.abs(encode(other, TOKENS, MASK)[0] - h).max()) > 1e-3  # they act, yet never appear
    np.testing.assert_allclose(forward(model, TOKENS.at[4:].set(0), MASK), forward(model, TOKENS, MASK), atol=1e-6)


def test_causal_lm_memory_by_hand_decoding_and_grad():
    model = build_model(config("lm", embedding={"extra_tokens": M, "position": "alibi"}), key=jax.random.key(2))
    n = TOKENS.shape[0]
    logits, grads = forward_and_grad(model, TOKENS)
    assert logits.shape == (n, VOCAB)
    # By hand: [mem; x] under the causal mask (memory i sees memory <= i; every token all memory).
    x = jnp.concatenate([model.embedding.extra, model.embedding(TOKENS, jnp.arange(M, M + n))])
    bias = model.embedding.positions.grid_bias(M + n)
    ref = model._logits(by_hand(model.blocks, x, None, jnp.arange(M + n, dtype=jnp.float32), bias)[M:])
    np.testing.assert_allclose(logits, ref, atol=1e-5)
    # The first real token reads the last memory token.
    other = moved(model, slice(-1, None))
    assert float(jnp.abs(forward(other, TOKENS)[0] - logits[0]).max()) > 1e-4
    # Decoding: the memory prefilled in init_decode_state; the same logits as the parallel forward.
    np.testing.assert_allclose(decode_all(model, TOKENS), logits, atol=1e-5)
    assert int(model.init_decode_state(4)["length"]) == M
    # Gradients reach the memory vectors.
    g = grads.embedding.extra
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0


def test_seq2seq_decoder_cross_attends_the_encoders_memory():
    """MemTransformer's translation model: memory in the encoder, whose output [mem; x]
    the decoder cross-attends; the decoder has none."""
    model = build_model(config("seq2seq", embedding={"extra_tokens": M}), key=jax.random.key(7))
    memory, memory_mask = model.encode(TOKENS, MASK)
    assert memory.shape == (M + TOKENS.shape[0], D) and bool(memory_mask[:M].all())
    assert model.decoder.embedding.extra is None
    target = jnp.array([2, 7, 1])
    moved_model = eqx.tree_at(lambda m: m.encoder, model, moved(model.encoder))
    translate = eqx.filter_jit(lambda m: m(TOKENS, target, MASK))
    assert float(jnp.abs(translate(moved_model) - translate(model)).max()) > 1e-4


def test_length_sized_attentions_hold_the_extra_tokens_within_max_len():
    """Linformer's projections are sized by max_len, which counts the extra tokens: no refusal."""
    linformer = {"name": "linformer", "proj_len": 4}
    cfg = config("classify", attention=linformer, embedding={"extra_tokens": M, "position": "learned"})
    model = build_model(cfg, key=jax.random.key(6))
    np.testing.assert_allclose(forward(model, TOKENS.at[4:].set(2), MASK), forward(model, TOKENS, MASK), atol=1e-6)
    with pytest.raises(ValueError, match="exceeds the model's max_len 16"):
        model(jnp.zeros(16 - M, jnp.int32))  # CLS + 13 tokens + 3 extra = 17


def np_all_attention(block, x):
    """LN(x + A(x)): A causal multi-head softmax over [persistent; keys] (persistent keys
    at no position, seen by every query), in float64 numpy; no FFN term."""
    a = block.attention

    def lin(layer, h):
        w, b = np.asarray(layer.weight, np.float64), np.asarray(layer.bias, np.float64)
        return np.asarray(h, np.float64) @ w.T + b

    n, dh = x.shape[0], a.d_head
    q, k, v = (lin(p, x).reshape(n, HEADS, dh) for p in (a.q_proj, a.k_proj, a.v_proj))
    pk, pv = (np.asarray(a.arrays[name], np.float64) for name in ("persistent_k", "persistent_v"))
    pk, pv = pk * math.sqrt(dh), pv * math.sqrt(pk.shape[0])  # used at sqrt(d) and sqrt(m) (the authors' code)
    heads = []
    for i in range(HEADS):
        keys, values = np.concatenate([pk[:, i], k[:, i]]), np.concatenate([pv[:, i], v[:, i]])
        s = q[:, i] @ keys.T / math.sqrt(dh)
        s[:, pk.shape[0] :][np.triu(np.ones((n, n), bool), 1)] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        heads.append((p / p.sum(1, keepdims=True)) @ values)
    out = lin(a.o_proj, np.concatenate(heads, 1))
    y = np.asarray(x, np.float64) + out
    y = (y - y.mean(1, keepdims=True)) / np.sqrt(y.var(1, keepdims=True) + 1e-5)
    norm = block.norms[0]
    return y * np.asarray(norm.weight) + np.asarray(norm.bias)


def test_all_attention_layer_is_attention_over_persistent_and_keys_without_ffn():
    cfg = config("lm", layers=2, ffn="none", attention={"name": "softmax", "persistent_kv": 4})
    assert cfg.norm.placement == "post"  # the paper's AddNorm, LN(x + sublayer(x)), by default
    model = build_model(cfg, key=jax.random.key(3))
    block = model.blocks[0]
    assert block.ffn is None and len(block.norms) == 1  # one sublayer, one LayerNorm
    x = jax.random.normal(jax.random.key(4), (5, D))
    np.testing.assert_allclose(block(x), np_all_attention(block, x), atol=1e-4)
    logits, grads = forward_and_grad(model, TOKENS)
    np.testing.assert_allclose(decode_all(model, TOKENS), logits, atol=1e-5)
    assert float(jnp.abs(grads.blocks[1].attention.arrays["persistent_v"]).max()) > 0
    # Only the blocks named in layer_overrides drop their FFN; pre-norm also builds.
    mixed = config(
        "classify",
        layers=2,
        head="mean",
        stack={"layer_overrides": {1: {"ffn": "none", "attention": {"name": "chunked", "persistent_kv": 2}}}},
    )
    assert mixed.norm.placement == "pre"  # the model's ffn is dense: the transformer stack's default
    classifier = build_model(mixed, key=jax.random.key(5))
    assert classifier.encoder.blocks[0].ffn is not None and classifier.encoder.blocks[1].ffn is None
    assert forward(classifier, TOKENS, MASK).shape == (2,)


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"task": "lm", "ffn": "none"}, r"ffn 'none' at block 0.*persistent_kv > 0.*persistent_kv=0"),
        (
            {
                "task": "lm",
                "ffn": "none",
                "attention": {"name": "softmax", "persistent_kv": 2},
                "stack": {"reversible": True},
            },
            "reversible",
        ),
        (
            {"task": "lm", "embedding": {"extra_tokens": 2, "extra_kind": "registers"}},
            "registers follow the real tokens",
        ),
        ({"task": "classify", "head": "mean", "embedding": {"extra_tokens": 16}}, r"extra_tokens=16.*max_len=16"),
        ({"task": "classify", "embedding": {"extra_tokens": 15}}, r"\(\+1 CLS\).*max_len=16"),
        ({"task": "classify", "embedding": {"extra_tokens": 2}, "stack": {"filters": {0: 0.5}}}, "no stack.filters"),
        ({"task": "classify", "head": "mean", "embedding": {"extra_tokens": 2}, "stack": "isab"}, "stack 'isab'"),
        (
            {"task": "lm", "embedding": {"extra_tokens": 2, "position": "none"}, "stack": "transformer_xl"},
            "stack 'transformer_xl'",
        ),
        ({"task": "classify", "embedding": {"extra_kind": "registers"}}, "needs embedding.extra_tokens > 0"),
        ({"task": "classify", "embedding": {"extra_tokens": -1}}, r"extra_tokens must be >= 0"),
    ],
)
def test_config_refusals(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(vocab_size=VOCAB, d_model=D, num_heads=HEADS, max_len=16, **values)


def test_yaml_and_set_reach_the_options():
    cfg = ModelConfig.from_yaml(
        "task: lm\nmax_len: 16\nembedding: {extra_tokens: 2}\nffn: none\n"
        "attention: {name: softmax, persistent_kv: 4}\nnorm: {placement: post}\n"
    )
    assert (cfg.embedding.extra_tokens, cfg.embedding.extra_kind, cfg.ffn.kind) == (2, "memory", "none")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    experiment = load_experiment(
        "copy",
        [
            "preset=tiny",
            "model.embedding.extra_tokens=2",
            "model.ffn=none",
            "model.attention.persistent_kv=4",
        ],
    )
    model = experiment.model
    assert model.max_len == 16 + 2  # the data's records (tiny copy: 16) and the memory
    assert (model.embedding.extra_tokens, model.ffn.kind, model.attention.hyper_parameters["persistent_kv"]) == (
        2,
        "none",
        4,
    )
