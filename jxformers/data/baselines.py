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
* Fashion-MNIST (LRA Image's stand-in): `nearest_centroid`, the class whose mean image
  (over the first `FIT_RECORDS` training records) is nearest in pixel space, a cheap
  predictor a sequence model must beat; and `mean_intensity`, the label most frequent in
  each of 16 quantile bins of the image's mean pixel alone (how far ink alone goes).

A shortcut is a function of (train records, eval records), each a dict of stacked
arrays (`tokens [n, max_len]`, `label [n]`, ...), returning {name: accuracy}.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jxformers.data import pathfinder_check
from jxformers.data.loader import make_loader
from jxformers.data.real import FashionMNIST
from jxformers.data.tasks import ListOps, Pathfinder

# Training records a fitted shortcut learns from (enough for a table of a few cells).
FIT_RECORDS = 2000
MIN_SHORTCUT_RECORDS = 40
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
    FashionMNIST: image_baselines,
}


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
    classification task; {} for other tasks. `workers`: grain worker processes that
    generate the records."""
    if getattr(eval_source, "model_task", None) != "classify":
        return {}
    if records is not None and records < 1:
        raise ValueError(f"records must be >= 1 or None; got {records}")
    scored = first_records(eval_source, records or len(eval_source), workers=workers)
    out = {"majority_class": majority_class(scored)}
    shortcut = SHORTCUTS.get(type(getattr(eval_source, "spec", eval_source)))  # a built split: its spec's
    if shortcut is not None:
        out |= shortcut(first_records(train_source, FIT_RECORDS, workers=workers), scored)
    return out
