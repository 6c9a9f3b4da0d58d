"""Pathfinder (Linsley et al., 2018; LRA's image task): is there a path between the two
marker discs? `render(seed, index, ...)` returns `(image uint8 [size, size], label)`,
a pure function of (seed, index); labels alternate with the index, so any contiguous
range of records is balanced. Difficulty grows with `contour_length` (LRA: 6, 9, 14).

The picture: two main contours of `contour_length` steps and, as in LRA's Pathfinder-32,
`20 // (contour_length // 3)` distractor contours of `contour_length // 3` steps (scaled
by area for other sizes). A step is a dash of `seg` px and a gap of `gap` px, the dash
centred on the step so a contour reads the same from either end; strokes are
anti-aliased grey lines (ink 1 - distance, zero from 0.75 px away), markers anti-aliased
discs of radius 1.5 centred on a pixel (a plus at full intensity, grey corners).

Only connectivity decides the label. The scene is drawn without looking at the label:
contour A runs from marker P; contour B starts at the mirror image of A's far end
across the line of A's first step, and its first steps (about half of them or more) are
the mirror image of A's last steps; the rest of B is a random walk. Label 1 puts the
second marker on A's far end, label 0 on B's start. Both candidate ends lie at the same
distance from P and at the same angle to P's stroke, with mirrored strokes around them
and a clear zone around each, and the two images share every other pixel; so marker
distance, ink, number of components and ink near the markers carry no label
(`pathfinder_check` measures this and more, a test bounds it).

Contours never touch: no inked pixel of one is 8-adjacent to another's or to a marker
zone. With `gap <= 1` each contour is 8-connected at ink > 0, so the markers are
connected in the pixel grid iff the label is 1 (a test does this flood fill).

Speed: every shape is drawn fresh for each image (no bank, so no shape recurs), in
batches of candidates at once (numpy): A with B's mirrored head in A's own frame, then
turned and moved into the canvas; B's free part as walks that steer around what is
drawn; distractors as random walks turned and moved into the canvas. The first
candidate that fits is kept.
"""

from __future__ import annotations

import math

import numpy as np

_MAX_TURN = math.pi / 5  # per step
_INK_RADIUS = 0.75  # px: a stroke inks 1 - distance up to here (thin footprints pack densely)
_CLEAR = 3.0  # px between strokes: > 0.75 + 1.42 + 0.75, so their inked pixels are never 8-adjacent
_ZONES_APART = 5.0  # px between marker centres (and from B's start to A): zones never 8-adjacent
_DENSE = 3  # points per step where clearances are measured (a step is seg + gap = 3 px at size 32)
_CANDIDATES = 64  # contours tried at once; the first that fits is kept
_FEWEST_WALKS, _MOST_WALKS = 16, 512  # walks drawn at once for A: doubled while none fits
_ROTATIONS = 8  # random rotations tried per pair to fit it in the canvas
_TURNS = 6  # turns tried at a vertex of a steered walk
_EXACT = 8  # placements that pass the cheap screen and get the exact test
_BATCHES = 6  # batches tried for one distractor before the image starts again
_RESTARTS = 300  # images started again before the settings are declared too crowded
_LRA_DISTRACTOR_STEPS = 20  # LRA Pathfinder-32: 20 // (contour_length // 3) distractors
_MARKER = np.rint(255 * np.clip(2.0 - np.hypot(*np.mgrid[-1:2, -1:2]), 0, 1)).astype(np.uint8)
_AROUND = np.stack(np.mgrid[-1:2, -1:2], -1).reshape(-1, 2)  # the 8-neighbourhood and the pixel


def default_distractors(size: int, contour_length: int) -> int:
    """LRA's clutter: as many distractor steps as Pathfinder-32 draws, scaled by area."""
    return round(_LRA_DISTRACTOR_STEPS * size**2 / 32**2) // distractor_length(contour_length)


def distractor_length(contour_length: int) -> int:
    return max(1, contour_length // 3)


def _least_copied(steps):
    """B copies at least about half of A's steps: the less it copies, the more B differs
    from A around the candidate end (and A's start maps onto A itself, so not all)."""
    return max(1, (steps - 2) // 2)


def _dashes(vertices, seg, gap):
    """Dash end points [..., n, 2] (a, b) of the steps between consecutive vertices."""
    u = np.diff(vertices, axis=-2) / (seg + gap)
    a = vertices[..., :-1, :] + gap / 2 * u
    return a, a + seg * u


def _ink(a, b, seg, offsets):
    """Pixels near each dash and their ink: (pixels [..., n, p, 2] int, ink [..., n, p] uint8)."""
    pixels = np.rint((a + b) / 2).astype(np.int64)[..., None, :] + offsets
    u = (b - a)[..., None, :] / seg
    w = pixels - a[..., None, :]
    t = np.clip(np.sum(w * u, -1, keepdims=True), 0, seg)
    distance = np.linalg.norm(w - t * u, axis=-1)
    return pixels, np.where(distance < _INK_RADIUS, np.rint(255 * (1 - distance)), 0).astype(np.uint8)


def _dense(vertices, per_step=_DENSE):
    """Points every 1 / per_step of a step along contours [..., n + 1, 2]: [..., n * per_step + 1, 2]."""
    t = np.arange(per_step) / per_step
    inner = vertices[..., :-1, None, :] + t[:, None] * np.diff(vertices, axis=-2)[..., None, :]
    inner = inner.reshape(*inner.shape[:-3], inner.shape[-3] * per_step, 2)
    return np.concatenate([inner, vertices[..., -1:, :]], axis=-2)


def _distance(points, others):
    """[..., n] distance from each of points [..., n, 2] to the nearest of others [..., j, 2]."""
    return np.sqrt(np.min(np.sum((points[..., :, None, :] - others[..., None, :, :]) ** 2, -1), axis=-1))


def _rotate(points, angles):
    """Rotate points [k, ..., 2] (y, x) about the origin by `angles` [k]."""
    shape = (-1,) + (1,) * (points.ndim - 1)
    c, s = np.cos(angles).reshape(shape), np.sin(angles).reshape(shape)
    y, x = points[..., 0:1], points[..., 1:2]
    return np.concatenate([c * y + s * x, c * x - s * y], axis=-1)


def _random_walks(rng, k, steps, size, step):
    """k random contours [k', steps + 1, 2] turned and moved to random places inside
    the canvas: uniform turns of at most _MAX_TURN; those too long to fit are dropped."""
    turns = rng.uniform(-_MAX_TURN, _MAX_TURN, (k, steps))
    angles = np.cumsum(turns, axis=1)  # the first turn sets a random heading, the rest bend
    angles += rng.uniform(0, 2 * math.pi, (k, 1))
    moves = step * np.stack([np.sin(angles), np.cos(angles)], -1)
    walks = np.concatenate([np.zeros((k, 1, 2)), np.cumsum(moves, axis=1)], axis=1)
    lo, hi = walks.min(axis=1, keepdims=True), walks.max(axis=1, keepdims=True)
    room = (size - 3) - (hi - lo)
    fits = np.all(room >= 0, axis=(1, 2))
    return (walks + 1 - lo + rng.uniform(0, 1, lo.shape) * room)[fits]


class _Canvas:
    """The picture being drawn: ink so far and the pixels a new contour may not ink
    (8-neighbours of earlier contours and of the marker zones)."""

    def __init__(self, size, seg, gap):
        self.size, self.seg, self.gap = size, seg, gap
        reach = int(seg / 2 + 1.5)  # a dash inks pixels within seg / 2 + 1 of its middle
        self.offsets = np.stack(np.mgrid[-reach:reach + 1, -reach:reach + 1], -1).reshape(-1, 2)
        self.pad = reach  # blocked is padded so that any pixel near a dash inside can be looked up
        self.blocked = np.zeros((size + 2 * reach, size + 2 * reach), bool)
        self.image = np.zeros((size, size), np.uint8)
        self.along = np.linspace(0, 1, 2 * seg + 1)

    def fit(self, vertices):
        """The index of the first candidate contour [k, n + 1, 2] that stays inside and
        inks no blocked pixel, with its (pixels, ink); None when none fits."""
        a, b = _dashes(vertices, self.seg, self.gap)
        inside = np.all((a >= 1) & (a <= self.size - 2) & (b >= 1) & (b <= self.size - 2), axis=(1, 2))
        # screen: the pixel nearest to any point of a dash is inked (it is < 0.75 px away)
        a, b = a[inside], b[inside]
        points = np.rint(a[..., None, :] + self.along[:, None] * (b - a)[..., None, :]).astype(np.int64)
        clear = ~self.blocked[points[..., 0] + self.pad, points[..., 1] + self.pad].any(axis=(1, 2))
        chosen = np.nonzero(clear)[0][:_EXACT]
        if not len(chosen):
            return None
        pixels, ink = _ink(a[chosen], b[chosen], self.seg, self.offsets)
        hits = self.blocked[pixels[..., 0] + self.pad, pixels[..., 1] + self.pad] & (ink > 0)
        (free,) = np.nonzero(~hits.any(axis=(1, 2)))
        if not len(free):
            return None
        lit = ink[free[0]] > 0
        return np.nonzero(inside)[0][chosen[free[0]]], pixels[free[0]][lit], ink[free[0]][lit]

    def zone_free(self, centre) -> bool:
        y, x = np.asarray(centre) + self.pad
        return not self.blocked[y - 1:y + 2, x - 1:x + 2].any()

    def add(self, pixels, ink, zones=()):
        """Ink a contour and block its neighbourhood and that of its marker zones."""
        np.maximum.at(self.image, (pixels[:, 0], pixels[:, 1]), ink)
        zone_pixels = [np.asarray(c) + _AROUND for c in zones]
        near = (np.concatenate([pixels, *zone_pixels])[:, None, :] + _AROUND).reshape(-1, 2)
        self.blocked[near[:, 0] + self.pad, near[:, 1] + self.pad] = True

    def mark(self, centre):
        y, x = centre
        np.maximum(self.image[y - 1:y + 2, x - 1:x + 2], _MARKER, out=self.image[y - 1:y + 2, x - 1:x + 2])

    def room(self):
        """[size + 2 pad, size + 2 pad] where a stroke point may round to: at least 1.5 px
        inside, with no blocked pixel among its 8 neighbours (all it may ink)."""
        b, n = self.blocked, len(self.blocked)
        near = b[:-2, :-2] | b[:-2, 1:-1] | b[:-2, 2:] | b[1:-1, :-2] | b[1:-1, 1:-1] | b[1:-1, 2:] \
            | b[2:, :-2] | b[2:, 1:-1] | b[2:, 2:]
        room = np.zeros((n, n), bool)
        lo, hi = self.pad + 2, self.pad + self.size - 2
        room[lo:hi, lo:hi] = ~near[lo - 1:hi - 1, lo - 1:hi - 1]
        return room

    def steered(self, rng, starts, headings, steps):
        """Random contours [k, steps + 1, 2] from `starts` [k, 2] along `headings` [k], turning by
        at most _MAX_TURN at each vertex (the first included); a turn whose dash would
        leave the room is drawn again (up to _TURNS times, drawn at once), so a contour
        bends away from borders and other strokes."""
        room, step, k = self.room(), self.seg + self.gap, len(starts)
        turns = rng.uniform(-_MAX_TURN, _MAX_TURN, (steps, k, _TURNS))
        probes = (self.gap / 2 + np.linspace(0, self.seg, 3)) / step  # dash start, middle, end
        rows = np.arange(k)
        position, angle = starts, headings
        vertices = [position]
        for turn in turns:
            angles = angle[:, None] + turn
            move = step * np.stack([np.sin(angles), np.cos(angles)], -1)
            points = np.rint(position[:, None, None, :] + probes[:, None] * move[:, :, None, :]).astype(np.int64)
            points = np.clip(points + self.pad, 0, len(room) - 1)  # a stuck walk wanders off
            first = np.argmax(room[points[..., 0], points[..., 1]].all(axis=-1), axis=1)
            position, angle = position + move[rows, first], angles[rows, first]
            vertices.append(position)
        return np.stack(vertices, axis=1)


def _pairs(rng, k, steps, size, seg, gap):
    """Fresh contours A with room for B's head, in A's frame (first vertex at the origin,
    first step along +x, so P = A's first dash end lies on the x axis): (A [m, n + 1, 2],
    B's head [m, n + 1, 2]: the mirror image of A's vertices from the far end back,
    copied [m]: how many of its steps B takes (as many as stay _CLEAR of A), ends [m, 3,
    2]: P, A's far end and B's start (the mirror image of A's far end))."""
    turns = rng.uniform(-_MAX_TURN, _MAX_TURN, (k, steps))
    turns[:, 0] = 0.0
    angles = np.cumsum(turns, axis=1)
    moves = (seg + gap) * np.stack([np.sin(angles), np.cos(angles)], -1)
    a = np.concatenate([np.zeros((k, 1, 2)), np.cumsum(moves, axis=1)], axis=1)
    a = a[np.max(np.sum((a[:, :, None] - a[:, None]) ** 2, -1), axis=(1, 2)) <= (size - 3) ** 2]
    flip = np.array([-1.0, 1.0])  # the mirror across the x axis
    da, db = _dashes(a, seg, gap)
    ends = np.stack([da[:, 0], db[:, -1], db[:, -1] * flip], axis=1)
    heads = a[:, ::-1] * flip
    dense_a = _dense(a)
    near = _distance(_dense(heads), dense_a)
    # a step of the mirror image is clear when all its points are, both ends included
    clear = np.minimum(near[:, :-1].reshape(len(a), steps, _DENSE).min(axis=2), near[:, _DENSE::_DENSE]) >= _CLEAR
    copied = np.minimum(np.argmax(np.concatenate([~clear, np.ones((len(a), 1), bool)], 1), axis=1), steps - 1)
    ok = (copied >= _least_copied(steps)) & (_distance(ends[:, 2:], dense_a)[:, 0] >= _ZONES_APART)
    return a[ok], heads[ok], copied[ok], ends[ok]


def _place_pair(rng, a, heads, copied, ends, size):
    """Turn and move the first pair (A, B's head, ends) that fits in the canvas in one of
    _ROTATIONS random rotations; (its index, A, head [c + 1, 2], ends [3, 2]) or None."""
    n = a.shape[1]
    used = np.where((np.arange(n) <= copied[:, None])[..., None], heads, a[:, :1])
    points = np.concatenate([a, used, ends], axis=1)
    turned = _rotate(np.repeat(points, _ROTATIONS, 0), rng.uniform(0, 2 * math.pi, len(points) * _ROTATIONS))
    lo, hi = turned.min(axis=1, keepdims=True), turned.max(axis=1, keepdims=True)
    room = (size - 3) - (hi - lo)
    fits = np.nonzero(np.all(room >= 0, axis=(1, 2)))[0]
    if not len(fits):
        return None
    i, pair = fits[0], fits[0] // _ROTATIONS
    placed = turned[i] + 1 - lo[i] + rng.uniform(0, 1, 2) * room[i]
    return pair, placed[:n], placed[n:n + copied[pair] + 1], placed[2 * n:]


def _scene(rng, pool, size, contour_length, distractors, seg, gap):
    """One attempt at a picture: (canvas, P, Q if label 1, Q if label 0) as pixel
    centres, or None. `pool`: `_pairs` not tried yet and the number of walks drawn for
    them last; when it runs out, twice as many are drawn (long contours rarely fit)."""
    canvas, step, least = _Canvas(size, seg, gap), seg + gap, _least_copied(contour_length)
    if not len(pool[0]):
        pool[-1] = min(2 * pool[-1], _MOST_WALKS)
        pool[:-1] = _pairs(rng, pool[-1], contour_length, size, seg, gap)
    placed = _place_pair(rng, *pool[:-1], size)
    if placed is None:
        pool[0] = pool[0][:0]
        return None
    used, a, head, ends = placed
    pool[:-1] = [np.delete(x, used, axis=0) for x in pool[:-1]]
    p, q1, q0 = (tuple(int(v) for v in np.rint(c)) for c in ends)
    found = canvas.fit(a[None])
    if found is None:
        return None
    canvas.add(found[1], found[2], zones=[p, q1])
    if not canvas.zone_free(q0):
        return None
    # B's free part, for every number of copied steps at once (the most copied first)
    cs = np.repeat(np.arange(len(head) - 1, least - 1, -1), _CANDIDATES)
    last = head[cs] - head[cs - 1]
    tails = canvas.steered(rng, head[cs], np.arctan2(last[:, 0], last[:, 1]), contour_length - least)
    rows = np.arange(contour_length + 1)[None, :]
    from_tail = np.clip(rows - cs[:, None], 0, None)
    b = np.where((rows < cs[:, None])[..., None], head[np.minimum(rows, len(head) - 1)],
                 tails[np.arange(len(cs))[:, None], from_tail])
    found = canvas.fit(b)
    if found is None:
        return None
    canvas.add(found[1], found[2], zones=[q0])
    for _ in range(distractors):
        for _ in range(_BATCHES):
            found = canvas.fit(_random_walks(rng, _CANDIDATES, distractor_length(contour_length), size, step))
            if found is not None:
                canvas.add(found[1], found[2])
                break
        else:
            return None
    return canvas, p, q1, q0


def render(seed: int, index: int, *, size: int = 32, contour_length: int = 6, distractors: int | None = None,
           gap: int = 1) -> tuple[np.ndarray, int]:
    """One Pathfinder image and its label (see the module docstring). `distractors`
    None: LRA's count for this size and contour length (`default_distractors`)."""
    if size < 12:
        raise ValueError(f"pathfinder: size must be >= 12; got {size}")
    if contour_length < 4:
        # Shorter contours never fit: the second contour starts at the first one's far end
        # mirrored and must keep clear of both of its ends.
        raise ValueError(f"pathfinder: contour_length must be >= 4; got {contour_length}")
    seg = max(2, size // 16)
    if not 0 <= gap <= seg:
        raise ValueError(f"pathfinder: gap must be in [0, {seg}] (the dash length at size {size}); got {gap}")
    if distractors is None:
        distractors = default_distractors(size, contour_length)
    if distractors < 0:
        raise ValueError(f"pathfinder: distractors must be >= 0 (or None for LRA's count); got {distractors}")
    rng = np.random.default_rng([seed, index])
    label = index % 2
    pool = [np.zeros((0,)), None, None, None, _FEWEST_WALKS // 2]
    for _ in range(_RESTARTS):
        scene = _scene(rng, pool, size, contour_length, distractors, seg, gap)
        if scene is not None:
            canvas, p, q1, q0 = scene
            canvas.mark(p)
            canvas.mark(q1 if label else q0)
            return canvas.image, label
    raise ValueError(f"pathfinder: could not fit 2 contours of {contour_length} steps and {distractors} "
                     f"distractors of {distractor_length(contour_length)} into {size}x{size} pixels in "
                     f"{_RESTARTS} tries; use a larger size, shorter contours or fewer distractors")
