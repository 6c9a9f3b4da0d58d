"""Data: the ListOps generator (grammar, labels checked by an independent evaluator,
determinism), the copy and recall tasks, and the grain loader's resumable order."""

import numpy as np
import pytest

from jxformers.data import listops, make_loader, make_source


def independent_value(text: str) -> int:
    """Evaluate a ListOps expression with an explicit stack (no shared code)."""
    stack = []
    for tok in text.split():
        if tok.startswith("["):
            stack.append([tok])
        elif tok == "]":
            op, *args = stack.pop()
            value = {
                "[MIN": lambda a: min(a), "[MAX": lambda a: max(a),
                "[MED": lambda a: int(np.median(a)), "[SM": lambda a: sum(a) % 10,
            }[op](args)
            if not stack:
                return value
            stack[-1].append(value)
        else:
            stack[-1].append(int(tok))
    raise AssertionError("unbalanced")


def depth_and_arity(text: str):
    depth = max_depth = 0
    arities, counts = [], []
    for tok in text.split():
        if tok.startswith("["):
            if counts:
                counts[-1] += 1
            counts.append(0)
            depth += 1
            max_depth = max(max_depth, depth)
        elif tok == "]":
            arities.append(counts.pop())
            depth -= 1
        else:
            counts[-1] += 1
    return max_depth, arities


def test_listops_follows_the_lra_grammar_and_labels_are_right():
    for index in range(12):
        text, label = listops.sample(7, index)
        n = len(text.split())
        assert 500 < n < 2000
        assert label == independent_value(text)
        max_depth, arities = depth_and_arity(text)
        assert max_depth <= 10 and min(arities) >= 2 and max(arities) <= 10
        assert set(text.split()) <= set(listops.VOCAB[1:])


def test_listops_medians_truncate_and_sums_wrap():
    assert independent_value("[MED 1 2 ]") == listops.evaluate(listops.parse("[MED 1 2 ]")) == 1
    assert listops.evaluate(listops.parse("[SM 9 8 [MAX 4 7 ] ]")) == 4
    assert listops.sample(0, 0, min_length=5, max_length=40)[0].startswith("[")


def test_listops_records_depend_only_on_seed_and_index():
    a = [listops.sample(3, i, min_length=10, max_length=80) for i in (5, 1, 9)]
    b = [listops.sample(3, i, min_length=10, max_length=80) for i in (9, 1, 5)][::-1]
    assert a == b
    assert listops.sample(3, 1, min_length=10, max_length=80) != listops.sample(4, 1, min_length=10, max_length=80)
    labels = [listops.sample(0, i, min_length=10, max_length=80)[1] for i in range(200)]
    assert len(set(labels)) == 10


def test_sources_pad_with_an_explicit_mask():
    src = make_source("listops", seed=0, size=10, max_len=100, min_length=10, max_length=90)
    r = src[3]
    n = int(r["mask"].sum())
    assert r["tokens"].shape == (100,) and bool(r["mask"][:n].all()) and not r["mask"][n:].any()
    assert listops.evaluate(listops.parse(" ".join(listops.VOCAB[t] for t in r["tokens"][:n]))) == int(r["label"])
    copy = make_source("copy", seed=0, size=10, max_len=24, symbols=5)[2]
    ids = copy["tokens"]
    sep = int(np.flatnonzero(ids == 2)[0])
    assert np.array_equal(ids[1:sep], ids[sep + 1 : 2 * sep])
    predicted = np.flatnonzero(copy["loss_mask"]) + 1  # positions whose next token is scored
    assert np.array_equal(predicted, np.arange(sep + 1, 2 * sep))
    recall = make_source("recall", seed=1, size=10, max_len=20, pairs=5, keys=6, values=4)[0]
    ids, n = recall["tokens"], int(recall["mask"].sum())
    pairs = dict(zip(ids[0 : 10 : 2], ids[1:10:2]))
    assert ids[10] == 1 and pairs[ids[11]] == ids[12] and n == 13
    assert np.flatnonzero(recall["loss_mask"]).tolist() == [11]


def test_source_errors():
    with pytest.raises(ValueError, match="unknown data task"):
        make_source("imdb", seed=0, size=1)
    with pytest.raises(ValueError, match="unknown setting"):
        make_source("copy", seed=0, size=1, lenght=3)
    with pytest.raises(ValueError, match="max_len"):
        make_source("listops", seed=0, size=1, max_len=100)
    with pytest.raises(ValueError, match="batch"):
        make_loader(make_source("copy", seed=0, size=4), batch_size=8, seed=0)


def test_loader_order_is_seeded_and_resumes_from_its_state():
    src = make_source("copy", seed=0, size=40, max_len=16)
    it = iter(make_loader(src, batch_size=4, seed=3))
    first = [next(it)["tokens"] for _ in range(3)]
    state = it.get_state()
    rest = [next(it)["tokens"] for _ in range(12)]  # crosses an epoch boundary
    again = iter(make_loader(src, batch_size=4, seed=3))
    assert all(np.array_equal(a, next(again)["tokens"]) for a in first)
    resumed = iter(make_loader(src, batch_size=4, seed=3))
    resumed.set_state(state)
    assert all(np.array_equal(a, next(resumed)["tokens"]) for a in rest)
    other = iter(make_loader(src, batch_size=4, seed=4))
    assert not np.array_equal(first[0], next(other)["tokens"])
