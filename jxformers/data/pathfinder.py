"""Pathfinder (Linsley et al., 2018; LRA's image task): is there a path between the two
marker discs? Each image holds two main contours of `contour_length` dashed segments,
some short distractor contours, and two markers. Label 1: both markers sit at the two
ends of one contour; label 0: one marker at an end of each contour. Both classes draw
the same strokes (two long contours, the same distractors), so only the path decides.
Difficulty grows with `contour_length` (LRA: 6, 9, 14). Labels alternate with the
index, so any contiguous range of records is balanced.

Contours never touch one another (a one-pixel margin is kept), which makes the label
checkable: with `gap=0` (solid strokes) the markers are connected in the pixel grid iff
the label is 1 (a test does this flood fill).

`render(seed, index, ...)` returns `(image uint8 [size, size], label)`; a record depends
only on (seed, index).
"""

from __future__ import annotations

import math

import numpy as np

_TRIES = 200


def _stroke(rng, size, length, seg, gap, max_turn):
    """Pixels of a dashed curve: `length` segments of `seg` px separated by `gap` px,
    turning by at most `max_turn` radians per segment (a segment that would leave the
    canvas is redrawn with another turn); (pixels, start, end), or None when stuck."""
    pos = rng.uniform(2, size - 3, size=2)
    angle = rng.uniform(0, 2 * math.pi)
    pixels: list[tuple[int, int]] = []
    for i in range(length):
        for _ in range(12):
            turn = rng.uniform(-max_turn, max_turn) if i else 0.0
            step = np.array([math.cos(angle + turn), math.sin(angle + turn)])
            points = [pos + t * step for t in np.arange(0.0, seg + gap + 0.25, 0.5)]
            if all(1 <= p[0] < size - 1 and 1 <= p[1] < size - 1 for p in points):
                break
        else:
            return None
        angle += turn
        pixels += [(int(p[0]), int(p[1])) for p, t in zip(points, np.arange(0.0, seg + gap + 0.25, 0.5)) if t < seg]
        pos = pos + (seg + gap) * step
    return sorted(set(pixels)), pixels[0], pixels[-1]


def _disc(center, radius, size):
    cy, cx = center
    r = int(math.ceil(radius))
    return [(y, x) for y in range(cy - r, cy + r + 1) for x in range(cx - r, cx + r + 1)
            if 0 <= y < size and 0 <= x < size and (y - cy) ** 2 + (x - cx) ** 2 <= radius**2]


def _near(pixels, occupied, size):
    for y, x in pixels:
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                if occupied[min(max(y + dy, 0), size - 1), min(max(x + dx, 0), size - 1)]:
                    return True
    return False


def render(seed: int, index: int, *, size: int = 32, contour_length: int = 6, distractors: int = 2,
           gap: int = 1) -> tuple[np.ndarray, int]:
    """One Pathfinder image and its label (see the module docstring)."""
    if size < 16:
        raise ValueError(f"pathfinder: size must be >= 16; got {size}")
    if contour_length < 2:
        raise ValueError(f"pathfinder: contour_length must be >= 2; got {contour_length}")
    rng = np.random.default_rng([seed, index])
    label = index % 2
    seg = max(2, size // 16)
    radius = max(1.0, size / 24)
    while True:
        occupied = np.zeros((size, size), bool)
        image = np.zeros((size, size), np.uint8)
        strokes = []
        for length in [contour_length, contour_length] + [max(2, contour_length // 3)] * distractors:
            for _ in range(_TRIES):
                drawn = _stroke(rng, size, length, seg, gap, max_turn=math.pi / 5)
                if drawn is None:
                    continue
                pixels, start, end = drawn
                marks = _disc(start, radius, size) + _disc(end, radius, size) if len(strokes) < 2 else []
                if not _near(pixels + marks, occupied, size):
                    break
            else:
                break  # no room: start the image again
            strokes.append(drawn)
            # reserve the stroke and the space its markers may take
            for y, x in pixels + marks:
                occupied[y, x] = True
        if len(strokes) < 2 + distractors:
            continue
        for pixels, _, _ in strokes:
            for y, x in pixels:
                image[y, x] = 255
        (_, a0, a1), (_, b0, _) = strokes[0], strokes[1]
        markers = (a0, a1) if label == 1 else (a0, b0)
        for m in markers:
            for y, x in _disc(m, radius, size):
                image[y, x] = 255
        return image, label
