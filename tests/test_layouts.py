"""Layouts, sharing and LayerDrop (issue 32, Lin et al. 2021's survey section 6.5 and
around it; `jxformers.nn.layouts`): the Sandwich Transformer's sublayer orders (Press,
Smith & Levy 2020), Macaron Net's half-step FFNs (Lu et al. 2019), ALBERT's cross-layer
sharing and factorised embedding (Lan et al. 2020), LayerDrop and its pruning (Fan,
Grave & Joulin 2020).

Each is checked against a numpy reference written from the paper's equations (float64,
the sublayers walked one by one from the order string the paper writes), then as models:
parameter counts (ALBERT's Tables 3-4 at BERT-base size, by shapes alone), one shared
array trained as one (its gradient the sum of the layers'), LayerDrop's draws with a
fixed key, pruning, decoding parity, a training step, YAML, the refusals, and the command
line (train, resume, eval with pruning, generate).

Mutations the reference tests were seen to fail (by hand, once): the sandwich's f^k put
before the s^k; group_order giving the leading f's to the last block; Macaron's halves
at scale 1; a post-norm sublayer normalising its input instead of the sum; sharing
"attention" leaving block 0's norm unshared; the factorised readout using the table
without its projection; LayerDrop comparing u < p (keeping with probability p); the
"batch" unit taking each example's own draws.
"""

import copy

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import assert_close
from suites import decode_all, finite_grads, forward, forward_and_grad, train_losses

from jxformers import ModelConfig, build_model
from jxformers.nn.layouts import BATCH_AXIS, StackPlan, every_other, group_order, sandwich_order

TINY = dict(task="lm", vocab_size=23, num_layers=3, d_model=16, num_heads=4, max_len=40, ffn={"d_ff": 32})
N = 11


def _np(x):
    return np.asarray(x, np.float64)


def _tokens(seed=0, n=N):
    return jax.random.randint(jax.random.key(seed), (n,), 0, TINY["vocab_size"])


def replan(model, plan: StackPlan, blocks=None):
    """`model` running its blocks (or `blocks`) by another plan (a static field)."""
    model = copy.copy(model)
    if blocks is not None:
        object.__setattr__(model, "blocks", tuple(blocks))
    object.__setattr__(model, "plan", plan)
    return model


@eqx.filter_jit
def infer(model, x):
    """The model at inference (where pruning acts); `suites.forward` runs training mode without a key."""
    return model(x, inference=True)


def lm(**settings):
    config = TINY | {k: v for k, v in settings.items() if k not in ("stack", "norm", "embedding")}
    config |= {k: settings[k] for k in ("stack", "norm", "embedding") if k in settings}
    return build_model(config, key=jax.random.key(0))


# ----------------------------------------------------------------------------- numpy references


def _ln(x, norm):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + norm.eps) * _np(norm.weight) + _np(norm.bias)


def _linear(x, layer):
    return x @ _np(layer.weight).T + _np(layer.bias)


def _attention(x, a, heads):
    """Causal multi-head softmax attention, written out."""
    n = x.shape[0]
    q, k, v = (_linear(x, p).reshape(n, heads, -1) for p in (a.q_proj, a.k_proj, a.v_proj))
    scores = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return _linear(np.einsum("hij,jhd->ihd", p, v).reshape(n, -1), a.o_proj)


def _ffn(x, f):
    h = _linear(x, f.w_in)
    h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))  # GELU, tanh form
    return _linear(h, f.w_out)


def _sublayer(x, fn, norm, pre, scale=1.0):
    """x + c f(LN(x)) (pre-norm) or LN(x + c f(x)) (post-norm)."""
    return x + scale * fn(_ln(x, norm)) if pre else _ln(x + scale * fn(x), norm)


def _modules(model):
    """The model's sublayers in the order its blocks hold them: ("s", attention, norm) and
    ("f", ffn, norm, scale)."""
    out = []
    for b in model.plan.filled(model.blocks):
        out += [("f", s.ffn, s.norm, s.scale) for s in b.pre_ffns]
        out.append(("s", b.attention, b.norms[0], 1.0))
        if b.ffn is not None:
            out.append(("f", b.ffn, b.norms[1], 1.0))
        out += [("f", s.ffn, s.norm, s.scale) for s in b.post_ffns]
    return out


def _reference_logits(model, tokens, order, *, pre=True, scale=1.0):
    """The stack walked sublayer by sublayer as `order` (the paper's string) says, from the
    model's embeddings to its tied logits; each f takes the next FFN module, each s the next
    attention, and every f has output scale `scale`."""
    x = _np(model.embedding(tokens, jnp.arange(tokens.shape[0])))
    modules = _modules(model)
    assert "".join(m[0] for m in modules) == order
    for kind, module, norm, _ in modules:
        fn = (lambda h, a=module: _attention(h, a, TINY["num_heads"])) if kind == "s" else (
            lambda h, f=module: _ffn(h, f))  # fmt: skip
        x = _sublayer(x, fn, norm, pre, scale if kind == "f" else 1.0)
    return _ln(x, model.norm) @ _np(model.embedding.table).T


# ----------------------------------------------------------------------------- Sandwich (Press et al. 2020)


def test_sandwich_and_order_strings():
    assert sandwich_order(4, 2) == "ss" + "sfsf" + "ff"
    assert sandwich_order(3, 0) == "sfsfsf"
    assert group_order("sssfsfff") == [(0, 0), (0, 0), (0, 1), (0, 3)]
    assert group_order("ffsfs") == [(2, 1), (0, 0)]
    for bad in ("", "fff", "sfx"):
        with pytest.raises(ValueError, match="string of s"):
            group_order(bad)


@pytest.mark.parametrize(
    ("stack", "order"),
    [({"sandwich": 2}, "ss" + "s" + "f" + "ff"), ({"order": "ffsssf"}, "ffsssf"), ({}, "sfsfsf")],
)
def test_an_ordered_stack_runs_its_sublayers_as_the_string_says(stack, order):
    model, x = lm(stack=stack), _tokens(1)
    assert_close(forward(model, x), _reference_logits(model, x, order), atol=2e-4)


def test_post_norm_sublayers_follow_the_order_too():
    model, x = lm(stack={"order": "sffssf"}, norm={"placement": "post"}), _tokens(2)
    assert_close(forward(model, x), _reference_logits(model, x, "sffssf", pre=False), atol=2e-4)


# ----------------------------------------------------------------------------- Macaron (Lu et al. 2019)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_macaron_blocks_are_half_ffn_attention_half_ffn(placement):
    model, x = lm(stack={"macaron": True}, norm={"placement": placement}), _tokens(3)
    want = _reference_logits(model, x, "fsf" * 3, pre=placement == "pre", scale=0.5)
    assert_close(forward(model, x), want, atol=2e-4)
    # the halves are Macaron's 1/2: at scale 1 the reference differs
    full = _reference_logits(model, x, "fsf" * 3, pre=placement == "pre", scale=1.0)
    assert not np.allclose(full, want, atol=1e-3)


# ----------------------------------------------------------------------------- ALBERT (Lan et al. 2020)


def _count(tree) -> int:
    """Parameters by shapes alone (arrays or `eval_shape`'s structs)."""
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(x.shape)) for x in leaves if hasattr(x, "shape") and jnp.issubdtype(x.dtype, jnp.floating))


def test_sharing_counts_each_shared_array_once():
    d, f, v, layers = 16, 32, 23, 3
    attention, norm, ffn = 4 * (d * d + d), 2 * d, d * f + f + f * d + d
    block = attention + ffn + 2 * norm
    rest = v * d + norm  # the table and the final norm (positions sinusoidal)
    counts = {s: _count(lm(stack={"sharing": s})) for s in ("none", "all", "attention", "ffn")}
    assert counts == {
        "none": rest + layers * block,
        "all": rest + block,
        "attention": rest + block + (layers - 1) * (ffn + norm),
        "ffn": rest + block + (layers - 1) * (attention + norm),
    }
    # factorised: vocab x E, then E x d (with its bias)
    assert _count(lm(embedding={"factorized": 4})) == counts["none"] - v * d + v * 4 + 4 * d + d


# ALBERT's Tables 3 and 4 (ALBERT base: 12 layers, H 768, 12 heads, d_ff 3072, 30k vocab):
# millions of parameters by E and sharing. The paper's figures are rounded and include its
# pooler and MLM head (about 0.7M), which this encoder has not.
ALBERT_BASE = {(None, "none"): 108, (None, "all"): 31, (None, "attention"): 83, (None, "ffn"): 57,
               (128, "none"): 89, (128, "all"): 12, (128, "attention"): 64, (128, "ffn"): 38,
               (64, "all"): 10, (256, "all"): 16}  # fmt: skip


def test_albert_base_sizes_are_the_papers():
    base = dict(
        task="classify", vocab_size=30000, num_layers=12, d_model=768, num_heads=12, max_len=512,
        ffn={"kind": "gelu_exact", "d_ff": 3072}, norm={"placement": "post", "final": False, "eps": 1e-12},
    )  # fmt: skip
    for (e, sharing), paper in ALBERT_BASE.items():
        embedding = {"position": "learned", "scale": False, "norm": True, "type_vocab_size": 2, "factorized": e}
        config = base | {"embedding": embedding, "stack": {"sharing": sharing}}
        made = eqx.filter_eval_shape(build_model, config, key=jax.random.key(0))
        assert abs(_count(made) / 1e6 - paper) < 1.0, (e, sharing, _count(made))


@pytest.mark.parametrize(
    ("sharing", "reversible"), [("all", False), ("attention", False), ("ffn", False), ("all", True)]
)
def test_a_shared_array_is_one_leaf_and_its_gradient_is_the_sum_of_the_layers(sharing, reversible):
    model, x = lm(stack={"sharing": sharing, "reversible": reversible}), _tokens(4)
    hollow = model.blocks[1]
    if sharing == "all":
        assert hollow is None
    else:  # block 1 holds None where block 0's shared sublayer goes
        assert (hollow.attention is None, hollow.ffn is None) == (sharing == "attention", sharing == "ffn")
    # the same model with the layers as copies: same output, each copy its own gradient
    copies = replan(model, StackPlan(), model.plan.filled(model.blocks))
    out, grads = forward_and_grad(model, x)
    out_copies, grads_copies = forward_and_grad(copies, x)
    assert_close(out, out_copies, atol=1e-6)
    assert finite_grads(grads)
    part = (lambda b: b.attention.q_proj.weight) if sharing != "ffn" else (lambda b: b.ffn.w_in.weight)
    summed = sum(part(b) for b in grads_copies.blocks)
    assert_close(part(grads.blocks[0]), summed, atol=1e-5)
    assert float(jnp.abs(part(grads_copies.blocks[0]) - summed).max()) > 1e-6  # the sum is not one layer's


def test_the_factorised_embedding_is_a_small_table_then_a_projection():
    model = lm(embedding={"factorized": 4, "position": "learned", "norm": True})
    emb, x = model.embedding, _tokens(5)
    table, proj = _np(emb.table), emb.project
    assert table.shape == (23, 4) and emb.positions.table.shape[1] == 4  # positions in E (ALBERT's code)
    e = table[np.asarray(x)] * np.sqrt(4) + _np(emb.positions.table)[:N]
    want = _linear(_ln(e, emb.norm), proj)
    assert_close(emb(x, jnp.arange(N)), want, atol=1e-5)
    h = _np(jax.random.normal(jax.random.key(1), (3, 16)))
    assert_close(emb.logits(jnp.asarray(h, jnp.float32)), h @ (table @ _np(proj.weight).T).T, atol=1e-4)


# ----------------------------------------------------------------------------- LayerDrop (Fan et al. 2020)


def test_layerdrop_draws_each_block_with_probability_p_from_a_fixed_key():
    p, layers, draws = 0.3, 4, 4000
    plan = StackPlan(layerdrop=p, drop_unit="example")
    keys = jax.random.split(jax.random.key(7), draws)
    kept = np.asarray(jax.vmap(lambda k: plan.gates(layers, k, False))(keys))
    rate = 1 - kept.mean(0)  # per block, over the draws
    assert np.all(np.abs(rate - p) < 4 * np.sqrt(p * (1 - p) / draws)), rate
    again = np.asarray(jax.vmap(lambda k: plan.gates(layers, k, False))(keys))
    assert (kept == again).all()  # a function of the key
    assert plan.gates(layers, keys[0], True) is None and plan.gates(layers, None, False) is None
    # the batch unit: under the train step's map, every example takes the first one's draws
    batch = jax.vmap(lambda k: StackPlan(layerdrop=p).gates(layers, k, False), axis_name=BATCH_AXIS)(keys[:64])
    assert (np.asarray(batch) == kept[0]).all()
    example = jax.vmap(lambda k: plan.gates(layers, k, False), axis_name=BATCH_AXIS)(keys[:64])
    assert (np.asarray(example) == kept[:64]).all() and not (kept[:64] == kept[0]).all()


@pytest.mark.parametrize("unit", ["batch", "example"])
def test_a_dropped_block_is_skipped_whole(unit):
    model, x = lm(stack={"layerdrop": 0.5, "layerdrop_unit": unit}), _tokens(6)
    for seed in range(4):
        key = jax.random.key(seed)
        kept = tuple(int(i) for i in np.flatnonzero(model.plan.gates(3, key, False)))
        trained = eqx.filter_jit(lambda m, t, k: m(t, key=k, inference=False))(model, x, key)
        if not kept:  # every block dropped: the embeddings read out
            continue
        # the same as running the kept blocks alone (pruning at inference to that set)
        pruned = replan(model, StackPlan(keep_layers=kept))
        assert_close(trained, infer(pruned, x), atol=1e-5)


def test_every_other_pruning_is_the_papers():
    assert every_other(6, 0.5) == (0, 2, 4)  # fairseq's --encoder-layers-to-keep 0,2,4
    assert every_other(8, 0.25) == (0, 1, 2, 4, 5, 6)  # d = 4, 8 dropped
    assert every_other(3, 0.9) == ()  # floor(1/p) = 1: every block
    model, x = lm(stack={"prune": 0.5}), _tokens(7)
    assert model.plan.keep_layers == (0, 2)
    alone = replan(model, StackPlan(), model.blocks[::2])
    assert_close(infer(model, x), infer(alone, x), atol=1e-6)
    assert not np.allclose(infer(model, x), forward(model, x), atol=1e-3)
    # training runs every block
    full = replan(model, StackPlan())
    k = jax.random.key(0)
    assert_close(model(x, key=k, inference=False), full(x, key=k, inference=False), atol=1e-6)


# ----------------------------------------------------------------------------- as models


DECODED = {
    "sandwich": {"stack": {"sandwich": 1}},
    "order": {"stack": {"order": "fssfsf"}},
    "macaron": {"stack": {"macaron": True}},
    "all": {"stack": {"sharing": "all"}, "embedding": {"factorized": 8}},
    "attention": {"stack": {"sharing": "attention", "macaron": True}},
    "ffn": {"stack": {"sharing": "ffn", "macaron": True}, "norm": {"placement": "post"}},
    "pruned": {"stack": {"layerdrop": 0.2, "keep_layers": [0, 2], "sharing": "ffn"}},
}


@pytest.mark.parametrize("name", list(DECODED))
def test_decoding_matches_the_parallel_forward(name):
    model, x = lm(**DECODED[name]), _tokens(8)
    assert_close(decode_all(model, x), infer(model, x), atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["order", "all", "pruned"])
def test_a_training_step_lowers_the_loss(name):
    losses, _ = train_losses(lm(**DECODED[name] | {"vocab_size": 11}), steps=4)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_seq2seq_and_classify_take_macaron_sharing_and_layerdrop():
    config = dict(TINY, task="seq2seq", stack={"macaron": True, "sharing": "all", "layerdrop": 0.3},
                  decoder={"num_layers": 2})  # fmt: skip
    model, x = build_model(config, key=jax.random.key(0)), _tokens(9)
    assert model.decoder.blocks[1] is None and model.encoder.blocks[1] is None
    conditioned = model.conditioned(x)
    assert_close(decode_all(conditioned, x), forward(conditioned, x), atol=3e-5, rtol=1e-4)
    classify = build_model(dict(TINY, task="classify", stack={"order": "sfssff"}), key=jax.random.key(0))
    logits, grads = forward_and_grad(classify, x, jnp.arange(N) < 8)
    assert logits.shape == (2,) and finite_grads(grads)


def test_yaml_reaches_every_setting():
    config = ModelConfig.from_yaml(
        """
        task: lm
        num_layers: 4
        embedding: {factorized: 8}
        stack: {kind: transformer, sandwich: 1, layerdrop: 0.1, layerdrop_unit: example, keep_layers: [0, 1, 3]}
        """
    )
    assert config.stack.sandwich == 1 and config.stack.keep_layers == (0, 1, 3)
    assert config.embedding.factorized == 8 and config.stack.layerdrop_unit == "example"
    again = ModelConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict())))
    assert again == config


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"stack": {"order": "sfsx"}}, "string of s and f"),
        ({"stack": {"order": "sfsf"}}, "one s per block"),
        ({"stack": {"sandwich": 3}}, "k < num_layers"),
        ({"stack": {"sandwich": 1, "macaron": True}}, "give one"),
        ({"stack": {"macaron": True}, "norm": {"placement": "sandwich"}}, "pre or post"),
        ({"stack": {"macaron": True, "reversible": True}}, "reversible"),
        ({"stack": {"order": "sfsfsf"}, "task": "seq2seq"}, "cross-attention"),
        ({"stack": {"sharing": "all", "order": "ssfsff"}}, "blocks differ"),
        ({"stack": {"sharing": "ffn", "layer_overrides": {1: {"ffn": "relu"}}}}, "layer_overrides"),
        ({"stack": {"sharing": "all", "attention_maps": "residual"}}, "attention_maps"),
        ({"stack": {"layerdrop": 0.2, "reversible": True}}, "reversible"),
        ({"stack": {"layerdrop": 1.0}}, "layerdrop"),
        ({"stack": {"keep_layers": [0, 3]}}, r"blocks in \[0, 3\)"),
        ({"stack": {"keep_layers": [0], "prune": 0.5}}, "give one"),
        ({"embedding": {"factorized": 4, "position": "complex"}}, "complex"),
        ({"stack": {"kind": "luna"}, "embedding": {"factorized": 4}}, "stack 'transformer'"),
    ],
)
def test_refusals_say_why(settings, message):
    config = TINY | settings
    if config.get("norm", {}).get("placement") == "sandwich":
        config = config | {"stack": config["stack"] | {"macaron": True}}
    with pytest.raises(ValueError, match=message):
        ModelConfig(**config)


# ----------------------------------------------------------------------------- the command line


@pytest.mark.heavy
def test_train_resume_eval_pruned_and_generate_from_the_command_line(tmp_path, capsys):
    import json
    import shutil

    from test_train import losses, write_config

    from jxformers.tools import cli

    model = {"num_layers": 3, "attention": "softmax", "embedding": {"factorized": 8},
             "stack": {"macaron": True, "sharing": "attention", "layerdrop": 0.3}}  # fmt: skip
    config = write_config(tmp_path, model=model, train={"steps": 8, "eval_every": 8})
    run = tmp_path / "run"
    assert cli.main(["train", str(config), "--workdir", str(run), "--no-progress", "--set",
                     "checkpoint.async_save=false"]) == 0  # fmt: skip
    straight = losses(run)
    shutil.rmtree(run / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    assert cli.main(["train", "--workdir", str(run), "--no-progress"]) == 0
    assert losses(run) == straight  # LayerDrop's draws are the step's: the same losses exactly
    capsys.readouterr()
    assert cli.main(["eval", "--workdir", str(run)]) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[0])
    assert cli.main(["eval", "--workdir", str(run), "--set", "model.stack.keep_layers=[0,2]"]) == 0
    pruned = json.loads(capsys.readouterr().out.splitlines()[0])
    assert full["eval_loss"] != pruned["eval_loss"]
    assert cli.main(["generate", "--workdir", str(run), "--prompt", "1 2 3", "--steps", "4"]) == 0
    assert len(capsys.readouterr().out.split()) >= 4


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_like_one_device():
    # the batch unit's all_gather over the batch axis and the shared arrays on a sharded mesh
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    from mesh_runs import lm_batch, same_leaves, same_losses, train_both

    configs = [
        dict(stack={"sharing": "all", "layerdrop": 0.5, "macaron": True}, embedding={"factorized": 8}),
        dict(stack={"sharing": "attention", "layerdrop": 0.4, "layerdrop_unit": "example", "sandwich": 1}),
    ]
    for extra in configs:
        config = dict(task="lm", vocab_size=31, num_layers=3, d_model=16, num_heads=2, max_len=16,
                      ffn={"d_ff": 32}) | extra
        runs = train_both(config, lm_batch(), steps=4)
        same_losses(runs, learns=False)  # each step drops other layers
        # Adam scales a float rounding of a tiny gradient up
        same_leaves(runs[True].state.params, runs[False].state.params, rtol=0, atol=1e-4)
    """
    )
