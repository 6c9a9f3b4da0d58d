"""The data pipeline around the generators: baselines that say what an accuracy means,
grain workers that give the same batches as none (and resume with any worker count),
and built splits on disk that give the same records as generating them."""

import json
import os

import grain
import numpy as np
import pytest
import yaml

from jxformers.data import listops, make_loader, make_source, pathfinder
from jxformers.data.baselines import baselines, predict_by_key
from jxformers.data.cache import build_split, read_split
from jxformers.data.loader import READ_AT_ONCE, _ReadAhead, state_for_workers
from jxformers.tools import cli

SHORT = {"max_len": 64, "min_length": 10, "max_length": 60}  # ListOps at the tiny preset's lengths


def batches(loader, n):
    iterator = iter(loader)
    try:
        return [next(iterator) for _ in range(n)]
    finally:
        iterator.close()


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


# ----------------------------------------------------------------------------- baselines


def test_listops_root_operator_baseline_is_well_above_the_majority_class():
    train = make_source("listops", seed=0, size=500, **SHORT)
    valid = make_source("listops", seed=1, size=300, **SHORT)
    scores = baselines(train, valid)
    labels = np.asarray([int(valid[i]["label"]) for i in range(len(valid))])
    assert scores["majority_class"] == pytest.approx(np.bincount(labels).max() / len(labels))
    assert 0.1 < scores["majority_class"] < 0.3
    assert scores["root_operator"] > scores["majority_class"] + 0.08, scores
    # the root operator is the first token: MIN/MAX of many digits is mostly 0/9
    root = valid[0]["tokens"][0]
    assert listops.VOCAB[root] in listops.OPERATORS


def test_predict_by_key_takes_the_most_frequent_label_per_key():
    keys, labels = np.array([1, 1, 1, 2, 2, 3]), np.array([4, 4, 5, 7, 6, 4])
    assert predict_by_key(keys, labels, np.array([1, 2, 3, 9])).tolist() == [4, 6, 4, 4]  # 9 unseen: overall


class _Counted:
    """A source that counts the records made."""

    def __init__(self, size):
        self.size, self.made = size, 0

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        self.made += 1
        return {"tokens": np.full((4,), index % 7, np.int32), "label": np.int32(index % 3)}


def test_baselines_make_only_the_records_they_score():
    source = _Counted(20_000)
    from jxformers.data.baselines import first_records

    records = first_records(source, 16)
    assert records["label"].tolist() == [i % 3 for i in range(16)]
    assert source.made < 2000  # grain reads a little ahead, never the whole split


def test_baselines_of_other_tasks():
    copy = make_source("copy", seed=0, size=16, max_len=16)
    assert baselines(copy, copy) == {}  # language modelling: no classes
    pf = make_source("pathfinder", seed=1, size=6, image_size=16, contour_length=4, distractors=0)
    assert baselines(pf, pf)["majority_class"] == 0.5  # labels alternate with the index
    with pytest.raises(ValueError, match="records must be >= 1 or None; got 0"):
        baselines(pf, pf, records=0)


def test_pathfinder_baselines_include_its_best_shortcut_at_chance():
    train = make_source("pathfinder", seed=1, size=300, image_size=32, contour_length=9)
    scored = make_source("pathfinder", seed=2, size=300, image_size=32, contour_length=9)
    result = baselines(train, scored)
    assert result["majority_class"] == 0.5 and 0.35 < result["best_shortcut"] < 0.65


def _listops_config(tmp_path, **data):
    config = {
        "name": "tiny_listops",
        "data": {"task": "listops", "train_size": 64, "eval_size": 32, "settings": SHORT} | data,
        "model": {"num_layers": 1, "d_model": 16, "num_heads": 2, "d_ff": 16, "position": "sinusoidal"},
        "train": {"steps": 2, "batch_size": 8, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1},
        "checkpoint": {"every": 2},
    }
    path = tmp_path / "tiny_listops.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ----------------------------------------------------------------------------- the ListOps generator


def test_listops_draws_are_numpys_value_for_value():
    """The generator makes numpy's draws from raw words (for speed): the same values as
    `Generator.random` and `Generator.integers`, in any mix, across block refills."""
    choose = np.random.default_rng(0)
    for seed in range(3):
        numpy_rng, ours = np.random.default_rng([seed, 9]), listops._Draws(np.random.default_rng([seed, 9]))
        for kind in choose.integers(0, 4, size=3 * listops._BLOCK):
            if kind == 0:
                assert numpy_rng.random() == ours.random()
            else:
                k = (10, 4, 9)[kind - 1]
                assert int(numpy_rng.integers(k)) == ours.integers(k)


def _reference_sample(seed, index, min_length, max_length):
    """The generator as first written: a tree drawn with numpy's Generator, then flattened."""
    rng = np.random.default_rng([seed, index])

    def tree(depth, budget):
        budget[0] -= 1
        if budget[0] < 0:
            raise OverflowError
        if depth > 1 and (depth >= listops.MAX_DEPTH or rng.random() < listops.LEAF_PROBABILITY):
            return int(rng.integers(10))
        budget[0] -= 1
        op = listops.OPERATORS[int(rng.integers(4))]
        return op, [tree(depth + 1, budget) for _ in range(int(rng.integers(2, 11)))]

    while True:
        try:
            t = tree(1, [max_length - 1])
        except OverflowError:
            continue
        toks = listops.tokens(t)
        if min_length < len(toks) < max_length:
            return " ".join(toks), listops.evaluate(t)


def test_listops_fast_generator_gives_the_records_of_the_reference():
    for lengths in ((10, 60), (100, 400)):
        for index in range(12):
            assert listops.sample(2, index, min_length=lengths[0], max_length=lengths[1]) == _reference_sample(
                2, index, *lengths
            )
    ids, label = listops.sample_ids(2, 0)
    assert (
        500 < ids.shape[0] < 2000
        and ids.dtype == np.int32
        and label == listops.evaluate(listops.parse(" ".join(listops.VOCAB[i] for i in ids)))
    )


# ----------------------------------------------------------------------------- workers


def batches_and_state(loader, at, n):
    """The first `n` batches of `loader` and its iterator's state after `at` of them."""
    iterator = iter(loader)
    try:
        got = [next(iterator) for _ in range(at)]
        state = iterator.get_state()
        return got + [next(iterator) for _ in range(n - at)], state
    finally:
        iterator.close()


@pytest.mark.heavy
def test_workers_give_the_same_batches_and_resume_with_any_worker_count():
    source = make_source("copy", seed=0, size=40, max_len=16)
    expected = batches(make_loader(source, batch_size=4, seed=3), 14)  # crosses an epoch boundary
    got, state = batches_and_state(make_loader(source, batch_size=4, seed=3, workers=2), 5, 14)
    assert all(same(a, b) for a, b in zip(expected, got, strict=False))
    resumed = iter(make_loader(source, batch_size=4, seed=3))  # saved with 2 workers, resumed with none
    resumed.set_state(state)
    assert all(same(a, next(resumed)) for a in expected[5:])
    # grain's own state after 5 batches with 2 workers is what the rewrite makes of the 0-worker one
    plain = iter(make_loader(source, batch_size=4, seed=3))
    for _ in range(5):
        next(plain)
    assert state_for_workers(json.loads(plain.get_state()), 2) == json.loads(state)
    workers = iter(make_loader(source, batch_size=4, seed=3, workers=2))  # saved with none, resumed with 2
    try:
        workers.set_state(plain.get_state())
        assert all(same(a, next(workers)) for a in expected[5:9])
    finally:
        workers.close()


class OneByOne:
    """A source read one record at a time (no `__getitems__`, so no read-ahead)."""

    def __init__(self, source):
        self.source = source

    def __repr__(self):
        return repr(self.source)

    def __len__(self):
        return len(self.source)

    def __getitem__(self, index):
        return self.source[index]


@pytest.mark.heavy
def test_read_ahead_of_pathfinder_gives_the_records_read_one_by_one_with_any_worker_count():
    source = make_source("pathfinder", seed=2, size=40, image_size=16, contour_length=4, distractors=1)
    expected = batches(make_loader(OneByOne(source), batch_size=4, seed=3), 12)  # crosses an epoch boundary
    assert all(
        same(a, b) for a, b in zip(expected, batches(make_loader(source, batch_size=4, seed=3), 12), strict=False)
    )
    got, state = batches_and_state(make_loader(source, batch_size=4, seed=3, workers=2), 5, 8)
    assert all(same(a, b) for a, b in zip(expected, got, strict=False))
    resumed = iter(make_loader(OneByOne(source), batch_size=4, seed=3))  # checkpoints are interchangeable
    resumed.set_state(state)
    assert all(same(a, next(resumed)) for a in expected[5:])


def test_state_for_workers_keeps_the_position_on_every_shard():
    for shard_index, shard_count in ((0, 1), (1, 2), (2, 3)):
        for consumed in (0, 1, 5, 6, 7):
            state = {
                "worker_count": 0,
                "last_worker_index": -1,
                "last_seen_indices": {"0": shard_index + shard_count * (consumed - 1)},
            }
            there = state_for_workers(state, 3, shard_index=shard_index, shard_count=shard_count)
            back = state_for_workers(there, 0, shard_index=shard_index, shard_count=shard_count)
            assert back == state
            assert there["last_worker_index"] == consumed % 3 - 1


def test_bad_worker_counts_are_refused():
    source = make_source("copy", seed=0, size=8, max_len=16)
    with pytest.raises(ValueError, match="workers must be >= 0 .*got -1"):
        make_loader(source, batch_size=2, seed=0, workers=-1)
    with pytest.raises(ValueError, match="read_threads must be >= 0 .*got -1"):
        make_loader(source, batch_size=2, seed=0, read_threads=-1)
    from jxformers.train import load_experiment

    with pytest.raises(ValueError, match="data.workers"):
        load_experiment("copy", ["data.workers=-2"])


# ----------------------------------------------------------------------------- built splits


def test_a_built_split_gives_the_same_records_the_same_bytes_and_resumes(tmp_path):
    source = make_source("listops", seed=4, size=30, **SHORT)
    build_split(source, tmp_path / "a", processes=2, records_per_shard=7, progress=False)
    build_split(source, tmp_path / "b", processes=1, records_per_shard=7, progress=False)
    shards = sorted(p.name for p in (tmp_path / "a").glob("*.array_record"))
    assert len(shards) == 5
    assert all((tmp_path / "a" / n).read_bytes() == (tmp_path / "b" / n).read_bytes() for n in shards)
    built = read_split(tmp_path, "a", source)
    assert len(built) == 30 and built.vocab_size == source.vocab_size and repr(built) == repr(source)
    assert all(same(built[i], source[i]) for i in range(30))
    # an interrupted build: a shard missing, another half-written; the rest is kept
    kept = tmp_path / "a" / shards[0]
    before = kept.stat().st_mtime_ns
    (tmp_path / "a" / shards[2]).unlink()
    (tmp_path / "a" / (shards[3] + ".partial")).write_bytes(b"junk")
    with pytest.raises(ValueError, match="incomplete .1 of 5 shards missing"):
        read_split(tmp_path, "a", source)
    build_split(source, tmp_path / "a", processes=1, records_per_shard=7, progress=False)
    assert (tmp_path / "a" / shards[2]).read_bytes() == (tmp_path / "b" / shards[2]).read_bytes()
    assert kept.stat().st_mtime_ns == before and not list((tmp_path / "a").glob("*.partial"))
    other = make_source("listops", seed=5, size=30, **SHORT)
    with pytest.raises(ValueError, match="source.fields.seed: 4 built, 5 wanted"):
        read_split(tmp_path, "a", other)
    with pytest.raises(ValueError, match="holds a build of another source"):
        build_split(other, tmp_path / "a", processes=1, records_per_shard=7, progress=False)
    with pytest.raises(ValueError, match="no built split"):
        read_split(tmp_path, "missing", source)


def test_a_built_pathfinder_split_holds_the_records_drawn_together(tmp_path):
    source = make_source("pathfinder", seed=3, size=10, image_size=16, contour_length=4, distractors=1)
    build_split(source, tmp_path / "pf", processes=1, records_per_shard=7, progress=False)
    built = read_split(tmp_path, "pf", source)
    assert all(same(built[i], source[i]) for i in range(10))
    assert all(same(a, source[i]) for a, i in zip(source.__getitems__([7, 2]), [7, 2], strict=True))
    spec_file = tmp_path / "pf" / "spec.json"  # a split built by an older generator is refused
    spec = json.loads(spec_file.read_text())
    del spec["source"]["generator_version"]
    spec_file.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=f"source.generator_version: None built, {pathfinder.VERSION} wanted"):
        read_split(tmp_path, "pf", source)


def test_read_ahead_makes_each_block_once_whatever_the_read_order():
    class Counting:
        calls = 0

        def __len__(self):
            return 1000

        def __getitem__(self, index):
            return {"x": np.asarray(index)}

        def __getitems__(self, indices):
            Counting.calls += 1
            return [self[i] for i in indices]

    sampler = grain.samplers.IndexSampler(
        num_records=1000, shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=0
    )
    ahead = _ReadAhead(Counting(), sampler, stride=2)  # two readers' positions, read in a random order
    for position in np.random.default_rng(0).permutation(256):
        assert ahead[int(position)]["x"] == sampler[int(position)].record_key
    assert Counting.calls == 256 // READ_AT_ONCE


@pytest.mark.heavy
def test_a_run_from_a_built_split_with_workers_matches_one_generating_and_eval_prints_baselines(tmp_path, capsys):
    """Train generating records in this process; train again from a built split, first
    2 steps with 2 workers, then resumed to 4 steps with none: the same losses. Then
    `jxformers eval` prints the task's baselines next to the accuracy."""
    from jxformers.train import load_experiment, train

    config = _listops_config(tmp_path)
    assert (
        cli.main(["data", "build", str(config), "--out", str(tmp_path / "built"), "--processes", "1", "--no-progress"])
        == 0
    )
    assert "data.path=" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "built")) == ["eval", "train"]
    four = ["train.steps=4", "checkpoint.every=2", "train.log_every=1"]
    straight = train(load_experiment(config, four), tmp_path / "straight", progress=False)
    built = [f"data.path={tmp_path / 'built'}"]
    train(
        load_experiment(config, [*built, "data.workers=2", "train.steps=2", *four[1:]]),
        tmp_path / "run",
        progress=False,
    )
    resumed = train(load_experiment(config, [*built, *four]), tmp_path / "run", progress=False)

    def losses(workdir):
        lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in lines if "loss" in r}

    assert losses(tmp_path / "run") == losses(tmp_path / "straight") and len(losses(tmp_path / "run")) == 4
    assert resumed["eval_accuracy"] == straight["eval_accuracy"]

    assert cli.main(["eval", "--workdir", str(tmp_path / "run"), "--batches", "2"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    train_source = make_source("listops", seed=0, size=64, **SHORT)
    eval_source = make_source("listops", seed=1, size=32, **SHORT)
    assert result["eval_examples"] == 16
    assert result["baselines"] == baselines(train_source, eval_source, records=16)
    assert set(result["baselines"]) == {"majority_class", "root_operator"}
    assert "baselines on the same examples: majority class" in captured.err and "root operator" in captured.err
