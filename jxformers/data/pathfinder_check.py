"""Shortcut baselines for Pathfinder: how well does a cue a model should not need predict
the label? Features are read from the image alone, as an adversary would: the two
markers (the only pixels whose 4 neighbours are at full intensity too), then the
SHORTCUTS (marker distance, total ink, the number of 8-connected components of ink > 0,
so anti-aliased grey counts, ink near each marker, and all of them together), which
must sit at chance (a test bounds them at 0.56), and the PATH_CUES (ink along the
straight line between the markers, ink on each marker's side facing the other), which
read the path itself where it runs straight and are reported beside them.

    images, labels = render_many(seed, n, size=32, contour_length=14)
    baselines(images, labels)   # {"marker distance": 0.51, ..., "all shortcuts together": 0.52, ...}

One-feature baselines are the best rule on quantile bins (any 1-D rule, not only a
threshold); several features go through a quadratic logistic regression.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage  # comes with jax

from jxformers.data import pathfinder

SHORTCUTS = ("marker distance", "total ink", "components", "ink near markers")
PATH_CUES = ("ink on the line between markers", "ink facing the other marker")
_NEAR = 4.0  # px: "near a marker"
_BINS = 16
_EIGHT = np.ones((3, 3), bool)


def render_many(seed: int, n: int, **settings) -> tuple[np.ndarray, np.ndarray]:
    """Records 0..n-1 of `pathfinder.render(seed, index, **settings)`: (images [n, s, s], labels [n])."""
    return pathfinder.render_batch(seed, range(n), **settings)


def marker_centres(image: np.ndarray) -> np.ndarray:
    """[k, 2] (y, x) of pixels that are at full intensity with their 4 neighbours: a
    marker disc's centre (a 1-px stroke never fills a plus)."""
    full = image == 255
    core = full[1:-1, 1:-1] & full[:-2, 1:-1] & full[2:, 1:-1] & full[1:-1, :-2] & full[1:-1, 2:]
    return np.argwhere(core) + 1


def features(images: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-image cues ({name: [n, k]}) and a mask of the images with exactly two markers
    (the others get zeros and should be left out)."""
    n, size, _ = images.shape
    ink = images.astype(np.float64) / 255
    yy, xx = np.mgrid[:size, :size]
    out = {
        name: np.zeros((n, k))
        for name, k in [
            ("marker distance", 1),
            ("total ink", 1),
            ("components", 1),
            ("ink near markers", 2),
            ("ink on the line between markers", 1),
            ("ink facing the other marker", 2),
        ]
    }
    ok = np.zeros(n, bool)
    t = np.linspace(0, 1, 64)
    for i in range(n):
        centres = marker_centres(images[i])
        if len(centres) != 2:
            continue
        ok[i] = True
        a, b = centres.astype(np.float64)
        dist = np.hypot(*(b - a))
        out["marker distance"][i] = dist
        out["total ink"][i] = ink[i].sum()
        out["components"][i] = ndimage.label(images[i] > 0, _EIGHT)[1]
        near, facing = [], []
        for m, other in ((a, b), (b, a)):
            dy, dx = yy - m[0], xx - m[1]
            disc = dy**2 + dx**2 <= _NEAR**2
            toward = dy * (other[0] - m[0]) + dx * (other[1] - m[1]) > 0
            near.append(ink[i][disc].sum())
            facing.append(ink[i][disc & toward].sum() - ink[i][disc & ~toward].sum())
        out["ink near markers"][i] = sorted(near)  # markers are unordered
        out["ink facing the other marker"][i] = sorted(facing)
        # the line between the markers, away from the marker discs themselves
        points = a + t[:, None] * (b - a)
        inside = (np.minimum(t, 1 - t) * dist) > 2.5
        py, px = np.rint(points[inside]).astype(int).T
        out["ink on the line between markers"][i] = ink[i][py, px].mean() if inside.any() else 0.0
    return out, ok


def _binned_accuracy(x_train, y_train, x_test, y_test) -> float:
    """Held-out accuracy of the majority label in each quantile bin of one feature."""
    edges = np.unique(np.quantile(x_train, np.linspace(0, 1, _BINS + 1)[1:-1]))
    bins_train, bins_test = np.searchsorted(edges, x_train), np.searchsorted(edges, x_test)
    ones = np.bincount(bins_train, y_train, minlength=len(edges) + 1)
    count = np.bincount(bins_train, minlength=len(edges) + 1)
    majority = ones * 2 > count
    return float(np.mean(majority[bins_test] == y_test))


def _quadratic(x: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(x.shape[1])
    return np.concatenate([np.ones((len(x), 1)), x, x[:, i] * x[:, j]], axis=1)


def _logistic_accuracy(x_train, y_train, x_test, y_test, ridge: float = 1e-2, steps: int = 25) -> float:
    """Held-out accuracy of a quadratic logistic regression fitted by Newton's method."""
    mean, std = x_train.mean(0), x_train.std(0) + 1e-9
    a, b = _quadratic((x_train - mean) / std), _quadratic((x_test - mean) / std)
    w = np.zeros(a.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-np.clip(a @ w, -30, 30)))
        grad = a.T @ (p - y_train) + ridge * w
        hess = (a * (p * (1 - p))[:, None]).T @ a + ridge * np.eye(len(w))
        w -= np.linalg.solve(hess, grad)
    return float(np.mean((b @ w > 0) == y_test))


def baselines(images: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Held-out accuracy of each cue, of all SHORTCUTS together and of every cue
    together: fitted on the first half of the images, scored on the second half (see
    `held_out_baselines`)."""
    half = len(labels) // 2
    return held_out_baselines(images[:half], labels[:half], images[half:], labels[half:])


def held_out_baselines(
    train_images: np.ndarray, train_labels: np.ndarray, test_images: np.ndarray, test_labels: np.ndarray
) -> dict[str, float]:
    """Each cue (and all SHORTCUTS together, and every cue together) fitted on the train
    images and scored on the test images; only images with two visible markers count.
    Also "images used", the number of those."""
    (train, train_ok), (test, test_ok) = features(train_images), features(test_images)
    if train_ok.sum() < 10 or test_ok.sum() < 10:
        raise ValueError(
            f"baselines: need at least 10 images with two markers on each side; "
            f"got {int(train_ok.sum())} train and {int(test_ok.sum())} test"
        )
    y_train, y_test = train_labels[train_ok].astype(np.float64), test_labels[test_ok].astype(np.float64)
    train = {name: value[train_ok] for name, value in train.items()}
    test = {name: value[test_ok] for name, value in test.items()}
    result = {}
    for name in train:
        if train[name].shape[1] == 1:
            result[name] = _binned_accuracy(train[name][:, 0], y_train, test[name][:, 0], y_test)
        else:
            result[name] = _logistic_accuracy(train[name], y_train, test[name], y_test)
    for name, names in (("all shortcuts together", SHORTCUTS), ("all cues together", SHORTCUTS + PATH_CUES)):
        x_train = np.concatenate([train[n] for n in names], axis=1)
        x_test = np.concatenate([test[n] for n in names], axis=1)
        result[name] = _logistic_accuracy(x_train, y_train, x_test, y_test)
    result["images used"] = int(train_ok.sum() + test_ok.sum())
    return result
