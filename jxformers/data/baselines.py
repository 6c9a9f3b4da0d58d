"""What an accuracy means: the scores of cheap predictors on a classification task's
eval split, to print next to a model's.

    baselines(train_source, eval_source)  # {"majority_class": 0.16, "root_operator": 0.37}

* `majority_class` (every classification task): the share of the eval records' most
  frequent class, what the best constant prediction scores on them.
* `root_operator` (ListOps): for each root operator, predict the label most frequent
  under it in the first `FIT_RECORDS` training records. It reads one token of the
  expression and scores about 0.37 at LRA lengths, the published LRA Transformer's level.
* Pathfinder: the best of its geometric shortcuts (`pathfinder_check`: marker distance,
  ink, components, ink near the markers, all together), which the generator keeps at chance.
* `byte_ngram_bayes` (LRA Text's stand-in, `lra_text`): multinomial naive Bayes on the
  counts of byte 1-, 2- and 3-grams (hashed into `NGRAM_BUCKETS`), fitted on the first
  `FIT_RECORDS` training records: what word and spelling statistics alone reach.
* `ngram_overlap` (LRA Retrieval's stand-in, `lra_retrieval`, and any retrieval task):
  the Jaccard similarity of the two documents' sets of character n-grams, "same" above a
  threshold; n (of `OVERLAP_ORDERS`) and the threshold fitted on the training records.
* Fashion-MNIST (LRA Image's stand-in): `nearest_centroid`, the class whose mean image
  (over the first `FIT_RECORDS` training records) is nearest in pixel space, a cheap
  predictor a sequence model must beat; and `mean_intensity`, the label most frequent in
  each of 16 quantile bins of the image's mean pixel alone (how far ink alone goes).

A shortcut is a function of (train records, eval records), each a dict of stacked
arrays (`tokens [n, max_len]`, `label [n]`, ...), returning {name: accuracy}. `baselines`
scores classification and retrieval tasks (pair records: `tokens`, `other`, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jxformers.data import pathfinder_check
from jxformers.data.loader import make_loader
from jxformers.data.lra_text import LRARetrieval, LRAText
from jxformers.data.real import FashionMNIST
from jxformers.data.tasks import ListOps, Pathfinder

# Training records a fitted shortcut learns from (enough for a table of a few cells).
FIT_RECORDS = 2000
MIN_SHORTCUT_RECORDS = 40
NGRAM_BUCKETS = 2**20  # byte_ngram_bayes's hashed features: trigrams alone have 2^24 codes
BAYES_ORDERS = (1, 2, 3)
OVERLAP_ORDERS = (3, 4, 5, 6, 7)  # a 7-gram's code (7 bytes) fits an int64
INTENSITY_BINS = 16  # quantile bins of the mean pixel (as pathfinder_check's one-feature rules)

Records = dict[str, np.ndarray]


def majority_class(eval_records: Records) -> float:
    """The share of the most frequent label."""
    return float(np.bincount(eval_records["label"]).max() / len(eval_records["label"]))


def predict_by_key(train_keys, train_labels, eval_keys) -> np.ndarray:
    """For each eval key, the label most frequent with that key in training (ties: the
    smallest label; a key unseen in training: the most frequent label overall)."""
    fallback = int(np.bincount(train_labels).argmax())
    table = {int(k): int(np.bincount(train_labels[train_keys == k]).argmax()) for k in np.unique(train_keys)}
    return np.asarray([table.get(int(k), fallback) for k in eval_keys])


def root_operator(train: Records, eval_records: Records) -> dict[str, float]:
    """ListOps: the label predicted from the first token (the root operator) alone."""
    predicted = predict_by_key(train["tokens"][:, 0], train["label"], eval_records["tokens"][:, 0])
    return {"root_operator": float(np.mean(predicted == eval_records["label"]))}


def pathfinder_shortcut(train: Records, eval_records: Records) -> dict[str, float]:
    """Pathfinder's best geometric shortcut: the highest held-out accuracy of the cues in
    `pathfinder_check.SHORTCUTS` (marker distance, ink, components, ink near the markers)
    and of all of them together, fitted on the train records."""

    if min(len(train["label"]), len(eval_records["label"])) < MIN_SHORTCUT_RECORDS:
        return {}  # a cue fitted or scored on a handful of images says nothing

    def images(records):
        n, pixels = records["tokens"].shape
        side = int(round(pixels**0.5))
        return records["tokens"].reshape(n, side, side).astype(np.uint8)

    scores = pathfinder_check.held_out_baselines(
        images(train), train["label"], images(eval_records), eval_records["label"]
    )
    return {"best_shortcut": max(scores[name] for name in (*pathfinder_check.SHORTCUTS, "all shortcuts together"))}


def ngrams(tokens: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """The byte n-grams of one document's real tokens (`tokens[mask]`, each 0..255), as
    int64 codes (the n bytes read as a base-256 number), in order."""
    data = tokens[mask].astype(np.int64)
    count = max(data.shape[0] - n + 1, 0)
    code = data[:count].copy()
    for k in range(1, n):
        code = code * 256 + data[k : k + count]
    return code


def _hashed_ngrams(tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The document's byte n-grams of every order in BAYES_ORDERS, hashed (multiplicative,
    Knuth's constant) into NGRAM_BUCKETS features."""
    codes = [(ngrams(tokens, mask, n) * 2654435761 + n) % NGRAM_BUCKETS for n in BAYES_ORDERS]
    return np.concatenate(codes)


def byte_ngram_bayes(train: Records, eval_records: Records) -> dict[str, float]:
    """Multinomial naive Bayes on each record's hashed byte 1-3-gram counts (add-one
    smoothing, class priors from the train records), fitted on `train`."""
    classes = int(max(train["label"].max(), eval_records["label"].max())) + 1
    counts = np.zeros((classes, NGRAM_BUCKETS), np.float64)
    for tokens, mask, label in zip(train["tokens"], train["mask"], train["label"], strict=True):
        counts[label] += np.bincount(_hashed_ngrams(tokens, mask), minlength=NGRAM_BUCKETS)
    log_p = np.log(counts + 1.0) - np.log(counts.sum(1, keepdims=True) + NGRAM_BUCKETS)
    log_prior = np.log(np.bincount(train["label"], minlength=classes) + 1.0)
    predicted = [
        int(np.argmax(log_p[:, _hashed_ngrams(tokens, mask)].sum(1) + log_prior))
        for tokens, mask in zip(eval_records["tokens"], eval_records["mask"], strict=True)
    ]
    return {"byte_ngram_bayes": float(np.mean(np.asarray(predicted) == eval_records["label"]))}


def jaccard(records: Records, n: int) -> np.ndarray:
    """`[records]`: |A & B| / |A | B| of each pair's sets of byte n-grams (A the first
    document's, B the `other`'s; 0 when both are empty)."""
    out = np.zeros((records["label"].shape[0],), np.float64)
    for i in range(out.shape[0]):
        a = np.unique(ngrams(records["tokens"][i], records["mask"][i], n))
        b = np.unique(ngrams(records["other"][i], records["other_mask"][i], n))
        shared = np.intersect1d(a, b, assume_unique=True).shape[0]
        out[i] = shared / max(a.shape[0] + b.shape[0] - shared, 1)
    return out


def fit_threshold(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """(t, accuracy): the threshold t for which `scores > t` predicts label 1 best on
    these examples (t halfway between two sorted scores, or below them all), and its
    accuracy there."""
    order = np.argsort(scores, kind="stable")
    s, y = scores[order], labels[order].astype(np.int64)
    # threshold below s[k]: the first k predicted 0, the rest 1
    right = np.concatenate([[0], np.cumsum(1 - y)]) + np.concatenate([np.cumsum(y[::-1])[::-1], [0]])
    right[1:-1][s[1:] == s[:-1]] = -1  # no threshold falls between two equal scores
    k = int(np.argmax(right))
    if k == 0:
        t = s[0] - 1.0
    elif k == s.shape[0]:
        t = s[-1] + 1.0
    else:
        t = (s[k - 1] + s[k]) / 2
    return float(t), float(right[k] / y.shape[0])


def ngram_overlap(train: Records, eval_records: Records) -> dict[str, float]:
    """Retrieval: "one source" when the Jaccard similarity of the two documents' byte
    n-gram sets exceeds a threshold; n in OVERLAP_ORDERS and the threshold fitted on
    `train` (the best training accuracy)."""
    fits = {n: fit_threshold(jaccard(train, n), train["label"]) for n in OVERLAP_ORDERS}
    n = max(fits, key=lambda order: fits[order][1])
    predicted = jaccard(eval_records, n) > fits[n][0]
    return {"ngram_overlap": float(np.mean(predicted == eval_records["label"].astype(bool)))}


def image_baselines(train: Records, eval_records: Records) -> dict[str, float]:
    """Fashion-MNIST: nearest class centroid on the pixels, and the mean intensity alone
    (the label most frequent in its quantile bin), both fitted on the train records."""
    x_train, x_eval = train["tokens"].astype(np.float64), eval_records["tokens"].astype(np.float64)
    y_train = train["label"]
    classes = np.unique(y_train)
    centroids = np.stack([x_train[y_train == c].mean(axis=0) for c in classes])
    # squared distances up to the same |x|^2 for every class
    nearest = classes[np.argmin((centroids**2).sum(axis=1) - 2 * x_eval @ centroids.T, axis=1)]
    ink_train, ink_eval = x_train.mean(axis=1), x_eval.mean(axis=1)
    edges = np.unique(np.quantile(ink_train, np.linspace(0, 1, INTENSITY_BINS + 1)[1:-1]))
    by_ink = predict_by_key(np.searchsorted(edges, ink_train), y_train, np.searchsorted(edges, ink_eval))
    return {
        "nearest_centroid": float(np.mean(nearest == eval_records["label"])),
        "mean_intensity": float(np.mean(by_ink == eval_records["label"])),
    }


# A task's source class -> its shortcuts beyond the majority class.
SHORTCUTS: dict[type, Callable[[Records, Records], dict[str, float]]] = {
    ListOps: root_operator,
    Pathfinder: pathfinder_shortcut,
    LRAText: byte_ngram_bayes,
    LRARetrieval: ngram_overlap,
    FashionMNIST: image_baselines,
}
# Tasks whose records `baselines` scores: those with a `label` per record.
SCORED_TASKS = ("classify", "retrieval")


def first_records(source, count: int, *, workers: int = 0) -> Records:
    """The first `count` records of `source` in index order, stacked."""
    count = min(count, len(source))
    iterator = iter(make_loader(source, batch_size=count, seed=0, shuffle=False, num_epochs=1, workers=workers))
    try:
        return next(iterator)
    finally:
        iterator.close()


def baselines(train_source, eval_source, *, records: int | None = None, workers: int = 0) -> dict[str, float]:
    """{baseline name: accuracy} on the first `records` eval records (default: all) of a
    classification or retrieval task; {} for other tasks. `workers`: grain worker
    processes that generate the records."""
    if getattr(eval_source, "model_task", None) not in SCORED_TASKS:
        return {}
    if records is not None and records < 1:
        raise ValueError(f"records must be >= 1 or None; got {records}")
    scored = first_records(eval_source, records or len(eval_source), workers=workers)
    out = {"majority_class": majority_class(scored)}
    shortcut = SHORTCUTS.get(type(getattr(eval_source, "spec", eval_source)))  # a built split: its spec's
    if shortcut is not None:
        out |= shortcut(first_records(train_source, FIT_RECORDS, workers=workers), scored)
    return out
