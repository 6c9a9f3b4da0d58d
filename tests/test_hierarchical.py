"""Hierarchical document encoders (issue 32, Lin et al. 2021 section 6.4): HIBERT (Zhang et
al. 2019, `stack: hibert`) and Hi-Transformer (Wu et al. 2021, `stack: hi_transformer`), and
their document tasks (`documents`, generated; `shakespeare_scene`, genre of a scene's speeches).

Both encoders are checked against numpy references written from the papers in float64,
the transformer blocks included (post-norm softmax blocks with a ReLU FFN): HIBERT's
sentence encoder per sentence, the EOS (last real token) state, sinusoidal sentence
positions, the document encoder, the final norm and the head's mean; Hi-Transformer's
interaction: the attention-pooled sentences plus learned sentence positions through the
document block, whose r_i is put before sentence i's token states for the next sentence
block (its row dropped), then the attention pooling of each sentence. Then: padded
sentences and padded tokens (garbage ids there) change nothing, another registered
attention, gradients and training steps through the config, the refusals, the records
of both tasks (split by play on a fixture), a command-line run resumed exactly, and a
2x2x2 mesh.

Mutations the references catch: pooling HIBERT's first token instead of the EOS; the
sentence positions left out or added after the document blocks; Hi-Transformer's r_i
appended after the tokens, added to them, or its output row kept in place of the first
token's; the document block skipped; one attention pool shared by every step.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from suites import train_steps

from jxformers import ModelConfig, build_model
from jxformers.data import genre as genre_data
from jxformers.data import make_source
from jxformers.data.baselines import majority_class

TINY = dict(
    task="classify", vocab_size=13, num_classes=3, num_layers=2, d_model=8, num_heads=2, max_len=9,
    ffn={"kind": "relu", "d_ff": 16},
)  # fmt: skip
KINDS = {
    "hibert": {"kind": "hibert", "max_sentences": 5, "document_layers": 1},
    "hi_transformer": {"kind": "hi_transformer", "max_sentences": 5},
}


def _np(x):
    return np.asarray(x, np.float64)


def _linear(x, layer):
    return x @ _np(layer.weight).T + _np(layer.bias)


def _layernorm(x, norm):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + norm.eps) * _np(norm.weight) + _np(norm.bias)


def _softmax(a):
    a = a - a.max(-1, keepdims=True)
    e = np.exp(a)
    return e / e.sum(-1, keepdims=True)


def _block(x, mask, block):
    """A post-norm block: h = LN(x + MHA(x)), y = LN(h + W_2 relu(W_1 h + b_1) + b_2)."""
    att, heads = block.attention, block.attention.num_heads
    n, d = x.shape
    split = lambda y: y.reshape(n, heads, d // heads).transpose(1, 0, 2)  # noqa: E731
    q, k, v = (split(_linear(x, p)) for p in (att.q_proj, att.k_proj, att.v_proj))
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(d // heads)
    probs = _softmax(np.where(mask[None, None, :], scores, -np.inf))
    a = _linear((probs @ v).transpose(1, 0, 2).reshape(n, d), att.o_proj)
    h = _layernorm(x + a, block.norms[0])
    f = _linear(np.maximum(_linear(h, block.ffn.w_in), 0), block.ffn.w_out)
    return _layernorm(h + f, block.norms[1])


def _sinusoid(n, d):
    pos, i = np.arange(n)[:, None], np.arange(d // 2)[None, :]
    angle = pos / 10000 ** (i / (d // 2))
    out = np.zeros((n, d))
    out[:, 0::2], out[:, 1::2] = np.sin(angle), np.cos(angle)
    return out


def _words(tokens, encoder):
    """The token embeddings of each sentence: table x sqrt(d) plus the word positions 0..W-1."""
    table = _np(encoder.embedding.table)
    return table[tokens] * math.sqrt(table.shape[1]) + _sinusoid(tokens.shape[1], table.shape[1])[None]


def _attention_pool(h, mask, pool):
    scores = np.tanh(_linear(h, pool.proj)) @ _np(pool.query)
    w = _softmax(np.where(mask, scores, -np.inf))
    return w @ h


def hibert_reference(encoder, tokens, mask):
    """HIBERT (Zhang et al. 2019, section 3.1): each sentence through the sentence encoder,
    its EOS (last real token) state, plus the sentence's sinusoidal position, the
    document encoder over the sentences, the final norm."""
    real = mask.any(1)
    words = np.where(real[:, None], mask, True)
    x = _words(tokens, encoder)
    rows = []
    for i in range(tokens.shape[0]):
        h = x[i]
        for block in encoder.sentence_blocks:
            h = _block(h, words[i], block)
        h = _layernorm(h, encoder.sentence_norm)
        rows.append(h[np.flatnonzero(words[i])[-1]])
    s = np.stack(rows) + _sinusoid(len(rows), x.shape[-1])
    for block in encoder.document_blocks:
        s = _block(s, real, block)
    return _layernorm(s, encoder.norm), real


def hi_transformer_reference(encoder, tokens, mask):
    """Hi-Transformer (Wu et al. 2021, section 3) of two sentence blocks: the sentence
    block, each sentence attention-pooled, plus its learned position, the document block
    (r_i), then [r_i; h_i] through the next sentence block (r_i's row dropped), the final
    norm and each sentence attention-pooled by the last pool."""
    real = mask.any(1)
    words = np.where(real[:, None], mask, True)
    first, second = encoder.sentence_blocks
    x = np.stack([_block(h, m, first) for h, m in zip(_words(tokens, encoder), words, strict=True)])
    s = np.stack([_attention_pool(h, m, encoder.pools[0]) for h, m in zip(x, words, strict=True)])
    r = _block(s + _np(encoder.sentence_table)[: len(s)], real, encoder.document_blocks[0])
    x = np.stack([
        _block(np.concatenate([r[i][None], x[i]]), np.concatenate([[True], words[i]]), second)[1:]
        for i in range(len(x))
    ])  # fmt: skip
    x = _layernorm(x, encoder.norm)
    return np.stack([_attention_pool(h, m, encoder.pools[1]) for h, m in zip(x, words, strict=True)]), real


def _document(seed=0, sentences=5, words=7, real_sentences=3):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, TINY["vocab_size"], (sentences, words)).astype(np.int32)
    lengths = np.array([words, 2, 5, 0, 0][:sentences])
    lengths[real_sentences:] = 0
    mask = np.arange(words)[None, :] < lengths[:, None]
    return tokens, mask


@eqx.filter_jit
def _logits(model, tokens, mask):
    return model(tokens, mask, inference=True)


@eqx.filter_jit
def _encoded(model, tokens, mask):
    return model.encoder.apply(tokens, mask, inference=True)[0]


@pytest.fixture(scope="module")
def models():
    """The two tiny models (post-norm, softmax, a ReLU FFN), built once."""
    return {k: build_model(ModelConfig(**TINY, stack=s), key=jax.random.key(3)) for k, s in KINDS.items()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_encoders_follow_the_papers_equations(models, kind):
    model = models[kind]
    tokens, mask = _document()
    h, real = _encoded(model, jnp.asarray(tokens), jnp.asarray(mask))
    reference = hibert_reference if kind == "hibert" else hi_transformer_reference
    want, want_real = reference(model.encoder, tokens, mask)
    np.testing.assert_array_equal(np.asarray(real), want_real)
    np.testing.assert_allclose(np.asarray(h)[want_real], want[want_real], rtol=2e-4, atol=2e-5)
    pooled = want[want_real].mean(0)  # the head: the mean over the real sentences
    np.testing.assert_allclose(
        np.asarray(_logits(model, jnp.asarray(tokens), jnp.asarray(mask))),
        _linear(pooled, model.head), rtol=2e-4, atol=2e-5,
    )  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_padded_sentences_and_padded_tokens_change_nothing(models, kind):
    model = models[kind]
    tokens, mask = _document(sentences=3, words=6)
    big = np.random.default_rng(9).integers(0, TINY["vocab_size"], (5, 7)).astype(np.int32)  # garbage around
    big[:3, :6] = np.where(mask, tokens, big[:3, :6])
    big_mask = np.zeros((5, 7), bool)
    big_mask[:3, :6] = mask
    small = _logits(model, jnp.asarray(tokens), jnp.asarray(mask))
    padded = _logits(model, jnp.asarray(big), jnp.asarray(big_mask))
    np.testing.assert_allclose(np.asarray(padded), np.asarray(small), rtol=1e-5, atol=1e-6)


def test_another_registered_attention_trains_through_the_config():
    tokens, mask = _document()
    batch_tokens, batch_mask = jnp.asarray(np.stack([tokens, tokens[::-1]])), jnp.asarray(np.stack([mask, mask[::-1]]))
    model = build_model(ModelConfig(**TINY, attention="linear", stack=KINDS["hi_transformer"]), key=jax.random.key(0))
    state, losses = train_steps(model, batch_tokens, batch_mask, steps=3)  # steps apply only with finite gradients
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] and int(state.step) == 3


def test_yaml_reaches_every_setting():
    config = ModelConfig.from_yaml(
        "task: classify\nnum_layers: 2\nmax_len: 16\nstack: {kind: hibert, document_layers: 3, max_sentences: 8,"
        " pooling: mean, sentence_position: learned}\n"
    )
    assert config.stack.document_layers == 3 and config.stack.pooling == "mean"
    assert config.head.kind == "mean"  # no CLS token: the sentences are averaged
    assert ModelConfig.from_dict(config.to_dict()) == config
    model = eqx.filter_eval_shape(build_model, config, key=jax.random.key(0))
    assert len(model.encoder.sentence_blocks) == 2 and len(model.encoder.document_blocks) == 3


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"task": "lm", "stack": "hibert"}, "reads a document of sentences"),
        ({"task": "retrieval", "stack": "hi_transformer"}, "task classify"),
        ({"stack": "hibert", "embedding": {"position": "rope"}}, "positions added to the embeddings"),
        ({"stack": "hibert", "head": "cls"}, "no CLS token"),
        ({"stack": "hi_transformer", "norm": {"kind": "powernorm"}}, "powernorm"),
        ({"stack": "hibert", "attention": {"name": "routing", "n_clusters": 2}}, "k-means"),
        ({"stack": "hi_transformer", "num_layers": 1}, "num_layers >= 2"),
        ({"stack": {"kind": "hibert", "max_sentences": 64}}, "max_sentences must be <= max_len"),
        ({"stack": {"kind": "hibert", "filters": {0: 0.5}}}, r"unknown setting\(s\) \['filters'\]"),
        ({"stack": {"kind": "hi_transformer", "reversible": True}}, r"unknown setting\(s\) \['reversible'\]"),
        ({"stack": {"kind": "hibert", "pooling": "max"}}, "pooling must be one of"),
    ],
)
def test_config_refusals_name_the_setting_and_the_values(values, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**TINY, "max_len": 16, **values})


def test_a_document_longer_than_the_model_is_refused(models):
    with pytest.raises(ValueError, match="exceeds max_sentences 5 or max_len 9"):
        _logits(models["hi_transformer"], jnp.ones((5, 9), jnp.int32), None)  # 9 tokens + its context row > 9


def test_generated_documents_records_and_their_baseline():
    source = make_source("documents", seed=0, size=200, sentences=6, max_len=10, min_sentences=3)
    assert (source.vocab_size, source.num_classes, source.model_task) == (2 + 4 * 8, 4, "classify")
    labels = []
    for i in range(200):
        r = source[i]
        assert r["tokens"].shape == r["mask"].shape == (6, 10) and r["tokens"].dtype == np.int32
        lengths = r["mask"].sum(1)
        assert np.array_equal(r["mask"], np.arange(10)[None] < lengths[:, None])  # real tokens first
        real = lengths > 0
        assert 3 <= real.sum() <= 6 and np.all(real[: real.sum()])  # real sentences first
        last = r["tokens"][np.arange(6), np.maximum(lengths - 1, 0)]
        assert np.all(last[real] == 1) and np.all(r["tokens"][~r["mask"]] == 0)  # EOS ends each; 0 pads
        labels.append(int(r["label"]))
    np.testing.assert_array_equal(source[7]["tokens"], source[7]["tokens"])
    assert majority_class({"label": np.array(labels)}) < 0.4  # no constant answer comes near a model
    # flat: the same documents as one sequence, for a flat encoder on the same examples
    flat = make_source("documents", seed=0, size=200, sentences=6, max_len=10, min_sentences=3, flat=True)
    for i in (0, 7, 199):
        r, f = source[i], flat[i]
        assert f["tokens"].shape == f["mask"].shape == (60,) and int(f["label"]) == int(r["label"])
        np.testing.assert_array_equal(f["tokens"][f["mask"]], r["tokens"][r["mask"]])
        assert f["mask"].sum() == r["mask"].sum() and np.all(f["mask"][: f["mask"].sum()])


def _scene_texts(root: pathlib.Path) -> pathlib.Path:
    """Every Folio play of genre.PLAY_GENRE as a text of two scenes of three speeches."""
    root.mkdir()
    for play in genre_data.PLAY_GENRE:
        scenes = "".join(
            f"Scene {n}. Somewhere.\n\n" + "".join(f"Ham.\n{play} speech {n} {k}.\n\n" for k in range(3))
            for n in ("I", "II")
        )
        (root / f"{play}_gut.txt").write_text(f"{play.upper()}\n\nSCENE. Nowhere.\n\n{scenes}")
    return root


def test_scene_records_are_windows_of_one_scene_split_by_play(tmp_path):
    texts = _scene_texts(tmp_path / "texts")
    train = make_source("shakespeare_scene", path=str(texts), sentences=2, max_len=64)
    valid = make_source("shakespeare_scene", path=str(texts), split="valid", sentences=2, max_len=64)
    docs, labels, plays = genre_data.scene_windows(str(texts), "train", 1, 2, 2)
    # each scene (3 speeches) gives one window of 2 (its last speech alone is dropped: min_speeches 2)
    assert len(train) == len(docs) == 2 * len(genre_data.split_plays("train"))
    assert all(d[0].split()[1:3] == d[1].split()[1:3] for d in docs)  # the same scene's speeches
    assert not set(plays) & set(genre_data.scene_windows(str(texts), "valid", 1, 2, 2)[2])
    assert all(genre_data.GENRES[y] == genre_data.PLAY_GENRE[p] for y, p in zip(labels, plays, strict=True))
    record = valid[0]
    assert record["tokens"].shape == record["mask"].shape == (2, 64)
    lengths = record["mask"].sum(1)
    assert np.all(record["tokens"][np.arange(2), lengths - 1] == genre_data.EOS)
    first = bytes(record["tokens"][0, : lengths[0] - 1].astype(np.uint8)).decode()
    assert first.endswith(" 0.")  # a window starts its scene
    with pytest.raises(ValueError, match="fetch_shakespeare"):
        make_source("shakespeare_scene", path=str(tmp_path / "absent"))


@pytest.mark.heavy
def test_the_command_line_trains_evaluates_and_resumes_exactly(tmp_path, capsys):
    from test_train import losses

    from jxformers.tools import cli

    config = tmp_path / "documents.yaml"
    config.write_text(yaml.safe_dump({
        "name": "documents",
        "data": {"task": "documents", "train_size": 128, "eval_size": 16,
                 "settings": {"sentences": 4, "max_len": 6, "min_sentences": 2}},
        "model": {"stack": {"kind": "hi_transformer", "max_sentences": 4}, "num_layers": 2, "d_model": 16,
                  "num_heads": 2, "ffn": {"d_ff": 32}},
        "train": {"steps": 8, "batch_size": 8, "learning_rate": 0.003, "warmup_steps": 2, "eval_every": 8,
                  "eval_batches": 2, "log_every": 1},
        "checkpoint": {"every": 4, "keep": 2, "async_save": False},
    }))  # fmt: skip
    run = str(tmp_path / "run")
    train = ["train", str(config), "--workdir", run, "--no-progress"]
    assert cli.main(train) == 0
    straight = losses(run)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "8")  # as if killed after step 4's checkpoint
    assert cli.main(train) == 0
    assert losses(run) == straight and len(straight) == 8
    capsys.readouterr()
    assert cli.main(["eval", str(config), "--workdir", run]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["step"] == 8 and 0 <= result["eval_accuracy"] <= 1


@pytest.mark.multidevice
def test_a_2x2x2_mesh_trains_each_model_with_the_losses_of_one_device():
    from test_sharding import PRELUDE, run_script

    run_script(
        PRELUDE
        + """
    from mesh_runs import same_losses, train_both
    from jxformers.data import make_source
    from jxformers.data.loader import stack

    source = make_source("documents", seed=0, size=8, sentences=4, max_len=6, min_sentences=2)
    batch = stack([source[i] for i in range(8)])  # tokens [8, 4, 6]: rows over data x fsdp
    for kind in ("hibert", "hi_transformer"):
        config = dict(task="classify", vocab_size=source.vocab_size, num_classes=4, num_layers=2, d_model=16,
                      num_heads=2, max_len=8, stack={"kind": kind, "max_sentences": 4})
        same_losses(train_both(config, batch), learns=False)  # 3 steps of a classifier on 8 documents
    """
    )
