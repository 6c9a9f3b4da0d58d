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

A shortcut is a function of (train records, eval records), each a dict of stacked
arrays (`tokens [n, max_len]`, `label [n]`, ...), returning {name: accuracy}.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jxformers.data import pathfinder_check
from jxformers.data.loader import make_loader
from jxformers.data.tasks import ListOps, Pathfinder

# Training records a fitted shortcut learns from (enough for a table of a few cells).
FIT_RECORDS = 2000
MIN_SHORTCUT_RECORDS = 40

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


# A task's source class -> its shortcuts beyond the majority class.
SHORTCUTS: dict[type, Callable[[Records, Records], dict[str, float]]] = {
    ListOps: root_operator,
    Pathfinder: pathfinder_shortcut,
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
