"""Cross-layer attention maps (`stack.attention_maps`, `jxformers.nn.cross_layer`):
RealFormer's residual scores (He et al. 2020, "RealFormer: Transformer Likes Residual
Attention", arXiv 2012.11747) and LazyFormer's shared probabilities (Ying et al. 2021,
"LazyFormer: Self Attention with Lazy Update", arXiv 2102.12702), each layer's attention
against numpy written from the papers' equations; jit, grad and bf16 through
`build_model`; padding; decoding against the parallel forward; the config's refusals and
its YAML / `--set` forms."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from suites import decode_all, forward

from jxformers.nn import ModelConfig, build_model
from jxformers.nn.attention import Attention
from jxformers.nn.blocks import Block

D_MODEL, HEADS, VOCAB = 16, 2, 23


def config(task="lm", maps="residual", layers=3, **stack):
    return ModelConfig(
        task=task,
        vocab_size=VOCAB,
        num_layers=layers,
        d_model=D_MODEL,
        num_heads=HEADS,
        max_len=12,
        head="mean" if task == "classify" else None,
        stack={"attention_maps": maps, **stack},
    )


@eqx.filter_jit
def encoded(encoder, tokens, mask):
    """The encoder's hidden rows, compiled whole."""
    return encoder.apply(tokens, mask)[0][0]


def np_heads(linear, h, heads):
    w, b = np.asarray(linear.weight, np.float64), np.asarray(linear.bias, np.float64)
    out = np.asarray(h, np.float64) @ w.T + b
    return out.reshape(len(h), heads, -1)


def np_logits(attention, h):
    """Q K^T / sqrt(d) per head `[heads, n, n]` (the paper's scaled dot products)."""
    q, k = np_heads(attention.q_proj, h, HEADS), np_heads(attention.k_proj, h, HEADS)
    return np.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])


def np_softmax(s, allowed):
    s = np.where(allowed, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_output(attention, h, p):
    """P X W^V per head, then W^O."""
    v = np_heads(attention.v_proj, h, HEADS)
    out = np.einsum("hqk,khd->qhd", p, v).reshape(len(h), -1)
    w, b = np.asarray(attention.o_proj.weight, np.float64), np.asarray(attention.o_proj.bias, np.float64)
    return out @ w.T + b


def np_evolve(evolve, own, prev, allowed, query_mask):
    """Wang et al.'s step (the mixing of the authors' code): A_in = (1 - beta) S + beta A,
    A = alpha LeakyReLU(Conv3x3(A_in) + b) + (1 - alpha) A_in, zero padding at the borders;
    masked keys and padded query rows enter as 0."""
    mixed = (1 - evolve.beta) * np.where(allowed, own, 0.0) + evolve.beta * np.where(allowed, prev, 0.0)
    mixed = np.where(query_mask[None, :, None], mixed, 0.0)
    w, b = np.asarray(evolve.weight, np.float64), np.asarray(evolve.bias, np.float64)
    heads, n, m = mixed.shape
    padded = np.pad(mixed, ((0, 0), (1, 1), (1, 1)))
    conv = np.zeros_like(mixed)
    for o in range(heads):
        for i in range(n):
            for j in range(m):
                conv[o, i, j] = np.sum(w[o] * padded[:, i : i + 3, j : j + 3]) + b[o]
    refined = np.where(conv > 0, conv, 0.01 * conv)  # LeakyReLU, slope 0.01
    return evolve.alpha * refined + (1 - evolve.alpha) * mixed


def blocks_and_input(model, tokens):
    """The blocks, their input (the embeddings) and whether they are causal."""
    if hasattr(model, "encoder"):
        enc = model.encoder
        return enc.blocks, enc.embedding(tokens, jnp.arange(len(tokens))), False
    return model.blocks, model.embedding(tokens, jnp.arange(len(tokens))), True


def run_against_numpy(model, tokens, mask, kind, lazy_block=2):
    """Run the blocks one at a time, checking every layer's attention weights and output
    against numpy from the paper's equation; returns the last block's output and the
    weights numpy computed per layer."""
    blocks, x, causal = blocks_and_input(model, tokens)
    n = len(tokens)
    allowed = np.ones((n, n), bool) if mask is None else np.broadcast_to(np.asarray(mask)[None], (n, n))
    if causal:
        allowed = allowed & np.tril(np.ones((n, n), bool))
    maps, prev, weights = None, 0.0, []
    positions = jnp.arange(n, dtype=jnp.float32)
    for i, block in enumerate(blocks):
        h = block.norms[0](x)  # pre-norm: the attention reads norm(x)
        if kind == "residual":  # RealFormer: S_l = Q K^T / sqrt(d) + S_{l-1}, S_0 = 0
            s = np_logits(block.attention, h) + prev
            p, prev = np_softmax(s, allowed), s
        elif kind == "predictive":  # Evolving Attention: the first layer's own, then convolved mixes
            s = np_logits(block.attention, h)
            if i > 0:
                query_mask = np.ones(n, bool) if mask is None else np.asarray(mask)
                s = np_evolve(block.evolve, s, prev, allowed, query_mask)
            p, prev = np_softmax(s, allowed), s
        elif i % lazy_block == 0:  # LazyFormer: the lazy block's first layer computes P
            s, p = None, np_softmax(np_logits(block.attention, h), allowed)
        else:  # ... and the others reuse it, with their own values
            s, p = None, weights[-1]
        combine = None if block.evolve is None else functools.partial(block.evolve, query_mask=mask)
        out, new_maps = block.attention.apply_maps(
            h, maps, role=block.maps, kv_mask=mask, positions=positions, combine=combine
        )
        np.testing.assert_allclose(np.asarray(out), np_output(block.attention, h, p), atol=2e-4, rtol=1e-4)
        carried = np.asarray(new_maps)
        if s is not None:  # the residual scores carried on (masked entries carry 0)
            np.testing.assert_allclose(carried, np.where(allowed, s, 0.0), atol=2e-4, rtol=1e-4)
        else:  # the probabilities carried on
            np.testing.assert_allclose(carried, p, atol=2e-5)
        weights.append(p)
        x, _, maps = block.apply_maps(x, maps, kv_mask=mask, positions=positions, inference=True)
        if block.maps == "reuse":
            assert new_maps is maps  # the very same probabilities, not recomputed
    return x, weights


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_realformer_adds_the_previous_layers_scores_before_the_softmax(task):
    # Two layers: every layer's carried scores are checked against S_l = own + S_{l-1}, so
    # the second layer's check already fails on carrying its own scores alone.
    model = build_model(config(task, "residual", layers=2), key=jax.random.key(0))
    tokens = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
    mask = None if task == "lm" else jnp.array([True] * 6 + [False] * 2)
    x, weights = run_against_numpy(model, tokens, mask, "residual")
    # the model's own loop threads the same maps: its output is that of the chain
    if task == "lm":
        np.testing.assert_allclose(np.asarray(forward(model, tokens)), np.asarray(model._logits(x)), atol=1e-5)
    else:
        hidden = encoded(model.encoder, tokens, mask)
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(model.encoder._final(x)), atol=1e-5)
    # a test that can fail: the layers' own scores alone give other weights from layer 2 on
    blocks, x0, causal = blocks_and_input(model, tokens)
    h = blocks[0].norms[0](x0)
    own = np_softmax(np_logits(blocks[0].attention, h), np.tril(np.ones((8, 8), bool)) if causal else mask[None])
    np.testing.assert_allclose(weights[0], own, atol=1e-6)  # the first layer adds nothing
    plain = build_model(config(task, "none", layers=2), key=jax.random.key(0))
    if task == "lm":
        assert not np.allclose(
            np.asarray(forward(plain, tokens, mask)), np.asarray(forward(model, tokens, mask)), atol=1e-3
        )
    else:  # the hidden states: a mean-pooled 2-class head can hide the difference
        plain_hidden = encoded(plain.encoder, tokens, mask)
        assert not np.allclose(np.asarray(plain_hidden), np.asarray(model.encoder._final(x)), atol=1e-3)


@pytest.mark.parametrize("task", ["lm", "classify"])
def test_lazyformer_upper_layers_reuse_the_first_layers_probabilities(task):
    model = build_model(config(task, "lazy", layers=3, lazy_block=2), key=jax.random.key(1))
    blocks = model.blocks if task == "lm" else model.encoder.blocks
    assert [b.maps for b in blocks] == ["lazy", "reuse", "lazy"]
    # the reusing layer computes values and output only: no query or key parameters
    assert blocks[1].attention.q_proj is None and blocks[1].attention.k_proj is None
    assert blocks[2].attention.q_proj is not None
    tokens = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
    mask = None if task == "lm" else jnp.array([True] * 5 + [False] * 3)
    _, weights = run_against_numpy(model, tokens, mask, "lazy", lazy_block=2)
    np.testing.assert_array_equal(weights[1], weights[0])  # layer 2 uses layer 1's P exactly
    assert not np.allclose(weights[2], weights[0], atol=1e-3)  # a new lazy block computes its own


def test_predictive_maps_convolve_the_mix_of_own_and_previous_logits():
    cfg = ModelConfig.from_dict(
        config("classify", "predictive", layers=2).to_dict()
        | {"stack": {"attention_maps": "predictive", "map_alpha": 0.7}}
    )
    model = build_model(cfg, key=jax.random.key(7))
    blocks = model.encoder.blocks
    assert blocks[0].evolve is None and blocks[1].evolve is not None and blocks[1].evolve.weight.shape == (2, 2, 3, 3)
    assert (blocks[1].evolve.alpha, blocks[1].evolve.beta) == (0.7, 0.5)
    tokens = jnp.array([3, 1, 4, 1, 5, 9, 2, 6])
    mask = jnp.array([True] * 6 + [False] * 2)
    for m in (None, mask):  # unpadded, then padded
        x, _ = run_against_numpy(model, tokens, m, "predictive")
        hidden = encoded(model.encoder, tokens, m)
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(model.encoder._final(x)), atol=1e-5)
    # padded queries' rows and keys reach no real output through the kernel
    other = tokens.at[6:].set(jnp.array([20, 21]))
    hidden2 = encoded(model.encoder, other, mask)
    np.testing.assert_allclose(np.asarray(hidden2[:6]), np.asarray(hidden[:6]), atol=1e-5)
    # the convolution is learned: its gradient reaches it
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(tokens, mask) ** 2)))(model)
    assert float(jnp.abs(g.encoder.blocks[1].evolve.weight).sum()) > 0


def test_predictive_maps_are_refused_where_the_kernel_would_read_the_future():
    with pytest.raises(ValueError, match="tasks classify and retrieval only; got task 'lm'"):
        config("lm", "predictive")
    with pytest.raises(ValueError, match="got task 'seq2seq'"):
        ModelConfig(task="seq2seq", stack={"attention_maps": "predictive"})
    causal = Attention("softmax", D_MODEL, HEADS, causal=True, key=jax.random.key(0))
    ffn = build_model(config("lm", "none"), key=jax.random.key(0)).blocks[0].ffn
    with pytest.raises(ValueError, match="non-causal attention only"):
        Block(causal, ffn, d_model=D_MODEL, maps="predictive")
    with pytest.raises(ValueError, match="map_alpha and map_beta mix the predictive maps"):
        ModelConfig(stack={"attention_maps": "residual", "map_beta": 0.2})
    with pytest.raises(ValueError, match=r"stack.map_alpha must be a number in \[0, 1\]; got 1.5"):
        ModelConfig(stack={"attention_maps": "predictive", "map_alpha": 1.5})


def test_one_layer_lazy_blocks_are_the_plain_transformer():
    tokens = jnp.arange(10) % VOCAB
    plain = build_model(config("lm", "none", layers=2), key=jax.random.key(2))
    lazy = build_model(config("lm", "lazy", layers=2, lazy_block=1), key=jax.random.key(2))
    np.testing.assert_allclose(np.asarray(forward(lazy, tokens)), np.asarray(forward(plain, tokens)), atol=1e-5)
    fewer = lambda m: sum(x.size for x in jax.tree.leaves(eqx.filter(m, eqx.is_array)))  # noqa: E731
    lazy2 = build_model(config("lm", "lazy", layers=2, lazy_block=2), key=jax.random.key(2))
    # the reusing layer drops its query and key projections (weights and biases)
    assert fewer(plain) - fewer(lazy2) == 2 * (D_MODEL * D_MODEL + D_MODEL)


@pytest.mark.parametrize("kind", ["residual", "lazy"])
def test_jit_grad_and_bf16_through_a_built_model(kind):
    cfg = config("lm", kind, layers=2)  # lazy: [lazy, reuse]
    model = build_model(cfg, key=jax.random.key(3))
    tokens = jnp.arange(9) % VOCAB

    @eqx.filter_jit
    @eqx.filter_grad
    def grad(m):
        return jnp.mean(jax.nn.log_softmax(m(tokens[:-1]))[jnp.arange(8), tokens[1:]])

    g = grad(model)
    leaves = jax.tree.leaves(eqx.filter(g, eqx.is_array))
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
    # the first layer's queries learn through every later layer that reads its maps
    assert float(jnp.abs(g.blocks[0].attention.q_proj.weight).sum()) > 0
    assert float(jnp.abs(g.blocks[1].attention.v_proj.weight).sum()) > 0
    low = build_model(ModelConfig.from_dict(cfg.to_dict() | {"dtype": "bfloat16"}), key=jax.random.key(3))
    out, out_low = np.asarray(forward(model, tokens)), np.asarray(forward(low, tokens))
    assert np.all(np.isfinite(out_low))
    np.testing.assert_allclose(out_low, out, atol=0.15)


@pytest.mark.parametrize("kind", ["residual", "lazy", "predictive"])
def test_padded_keys_do_not_change_real_outputs(kind):
    model = build_model(config("classify", kind, layers=2), key=jax.random.key(4))
    mask = jnp.array([True] * 5 + [False] * 4)
    a = jnp.array([1, 2, 3, 4, 5, 0, 0, 0, 0])
    b = jnp.array([1, 2, 3, 4, 5, 7, 8, 9, 22])
    ha = encoded(model.encoder, a, mask)
    hb = encoded(model.encoder, b, mask)
    np.testing.assert_allclose(np.asarray(ha[:5]), np.asarray(hb[:5]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(forward(model, a, mask)), np.asarray(forward(model, b, mask)), atol=1e-5)


@pytest.mark.parametrize(("kind", "position"), [("residual", "alibi"), ("lazy", "rope"), ("lazy", "alibi")])
def test_a_language_model_decodes_like_its_parallel_forward(kind, position):
    # two layers: the second reads the first's maps (lazy: [lazy, reuse])
    cfg = ModelConfig.from_dict(config("lm", kind, layers=2).to_dict() | {"embedding": {"position": position}})
    model = build_model(cfg, key=jax.random.key(5))
    tokens = jnp.array([5, 3, 9, 1, 1, 7, 2, 8, 4, 0, 6, 3])
    logits = forward(model, tokens)
    np.testing.assert_allclose(np.asarray(decode_all(model, tokens)), np.asarray(logits), atol=2e-4)
    # the maps never carry the future: a later token changes no earlier row
    later = forward(model, tokens.at[8].set(11))
    np.testing.assert_allclose(np.asarray(later[:8]), np.asarray(logits[:8]), atol=1e-5)
    assert not np.allclose(np.asarray(later[8:]), np.asarray(logits[8:]), atol=1e-4)


def test_an_encoder_decoder_carries_maps_in_both_stacks_and_decodes():
    cfg = ModelConfig(
        task="seq2seq",
        vocab_size=VOCAB,
        num_layers=2,
        d_model=D_MODEL,
        num_heads=HEADS,
        max_len=10,
        stack={"attention_maps": "residual"},
    )
    model = build_model(cfg, key=jax.random.key(6))
    assert [b.maps for b in model.encoder.blocks] == [b.maps for b in model.decoder.blocks] == ["residual"] * 2
    source, target = jnp.arange(7) % VOCAB, jnp.array([1, 4, 2, 8, 5, 7])
    bound = model.conditioned(source)
    np.testing.assert_allclose(
        np.asarray(decode_all(bound, target)),
        np.asarray(eqx.filter_jit(lambda m, s, t: m(s, t, inference=True))(model, source, target)),
        atol=2e-4,
    )


def test_the_config_refuses_what_cannot_carry_maps():
    with pytest.raises(ValueError, match=r"only the dense 'softmax' attention forms; block 0's attention is 'local'"):
        ModelConfig(task="lm", attention={"name": "local", "window": 4}, stack={"attention_maps": "residual"})
    with pytest.raises(ValueError, match=r"block 1's attention is 'performer'"):
        ModelConfig(
            stack={"attention_maps": "lazy", "layer_overrides": {1: {"attention": "performer"}}},
        )
    with pytest.raises(ValueError, match=r"no score options, no kernel.*softcap"):
        ModelConfig(attention={"name": "softmax", "softcap": 5.0}, stack={"attention_maps": "residual"})
    with pytest.raises(ValueError, match=r"impl='pallas'"):
        ModelConfig(attention={"name": "softmax", "impl": "pallas"}, stack={"attention_maps": "residual"})
    for stack in ({"reversible": True}, {"filters": {1: 0.5}}, {"token_learner": {"after_layer": 0, "num_tokens": 4}}):
        with pytest.raises(ValueError, match="plain wiring and one length throughout"):
            ModelConfig(num_layers=3, stack={"attention_maps": "lazy", **stack})
    with pytest.raises(ValueError, match="stack.lazy_block sizes LazyFormer's lazy blocks"):
        ModelConfig(stack={"attention_maps": "residual", "lazy_block": 3})
    with pytest.raises(ValueError, match="lazy_block must be >= 1"):
        ModelConfig(stack={"attention_maps": "lazy", "lazy_block": 0})
    with pytest.raises(ValueError, match="attention_maps"):
        ModelConfig(stack={"attention_maps": "evolving"})
    for heads in ({"collaborative": 8}, {"disagreement": ["output"]}, {"head_aggregation": "routing"}):
        with pytest.raises(ValueError, match="improved multi-heads"):
            ModelConfig(attention={"name": "softmax", **heads}, stack={"attention_maps": "residual"})
    collaborative = Attention("softmax", D_MODEL, HEADS, collaborative=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match="unknown setting"):
        ModelConfig(task="lm", stack={"kind": "transformer_xl", "attention_maps": "residual"})
    # modules built by hand are checked too
    local = Attention("local", D_MODEL, HEADS, attention_kwargs={"window": 2}, key=jax.random.key(0))
    ffn = build_model(config("lm", "none"), key=jax.random.key(0)).blocks[0].ffn
    with pytest.raises(ValueError, match="'local'"):
        Block(local, ffn, d_model=D_MODEL, maps="residual")
    with pytest.raises(ValueError, match="improved multi-heads"):
        Block(collaborative, ffn, d_model=D_MODEL, maps="residual")
    soft = Attention("softmax", D_MODEL, HEADS, key=jax.random.key(0))
    with pytest.raises(ValueError, match="maps must be one of"):
        Block(soft, ffn, d_model=D_MODEL, maps="sideways")
    with pytest.raises(ValueError, match="needs them"):
        Block(soft, ffn, d_model=D_MODEL, maps="reuse").apply(jnp.zeros((3, D_MODEL)))


def test_yaml_and_set_reach_the_option():
    yaml_text = "task: lm\nvocab_size: 30\nstack: {attention_maps: lazy, lazy_block: 3}\nnum_layers: 3\n"
    cfg = ModelConfig.from_yaml(yaml_text)
    assert (cfg.stack.attention_maps, cfg.stack.lazy_block) == ("lazy", 3)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    from jxformers.train import load_experiment

    experiment = load_experiment("copy", ["preset=tiny", "model.stack.attention_maps=lazy", "model.stack.lazy_block=2"])
    assert (experiment.model.stack.attention_maps, experiment.model.stack.lazy_block) == ("lazy", 2)
    experiment = load_experiment("copy", ["preset=tiny", "model.stack.attention_maps=residual"])
    assert experiment.model.stack.attention_maps == "residual"
    with pytest.raises(ValueError, match="'linear'"):
        load_experiment("copy", ["preset=tiny", "model.attention=linear", "model.stack.attention_maps=residual"])
