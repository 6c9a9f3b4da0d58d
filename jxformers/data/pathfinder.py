"""Pathfinder (Linsley et al., 2018; LRA's image task): is there a path between the two
marker discs? `render(seed, index, ...)` returns `(image uint8 [size, size], label)`,
a pure function of (seed, index); labels alternate with the index, so any contiguous
range of records is balanced. Difficulty grows with `contour_length` (LRA: 6, 9, 14).

The picture: two main contours of `contour_length` steps and LRA's clutter: distractor
contours of `contour_length // 3` steps, as many as LRA's budget of distractor steps for
the image size allows (`default_distractors`: 20 at 32 px, so `20 // (contour_length //
3)`; 22, 35 and 30 at 64, 128 and 256 px, the settings of LRA's Pathfinder data, Kim et
al. 2020). A step is a dash of `seg` px (`size // 16`, at least 2) and a gap of `gap` px, the dash
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

Speed (see docs/data.md): `render_batch` draws _CHUNK images at once, in arrays of
all their candidates, each image from its own generator (so record i is the same in any
batch, and `render` is a batch of one); every shape is drawn fresh for each image (no
bank, so no shape recurs), many candidates at once (numpy; points are complex numbers
and canvas pixels flat indices, so that a turn, a distance or a lookup is one call), the
cheap tests first:

* pairs (`_pairs`): walks for A are drawn in A's own frame until enough pass the cheap
  diameter test (`_short_walks`); only those get the costly clearance of B's mirrored
  head; each image's pair that copies the most steps is turned (24 angles) and moved
  into the canvas (`_place_pairs`);
* B's free part (`_Canvases.steered`): walks from the end of the head that look ahead
  for room and steer around what is drawn; a walk that is cornered goes on as a copy of
  a live one (resampling), so one of them usually gets through;
* distractors (`_cluttered`): batches of random walks, kept in order as long as each
  fits beside the ones before; when the clutter does not fit it is drawn again on the
  same A and B, which cost the most.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# 3: sizes above 32 take LRA's distractor budget of their resolution (Path-X: 35 steps at
# 128 px, 8 distractors at contour length 14) instead of Pathfinder-32's scaled by area
# (80 there, which did not fit); images of 32 px and less did not change.
VERSION = 3  # raised whenever the same (seed, index, settings) give other images: built splits record it
_MAX_TURN = math.pi / 5  # per step
_INK_RADIUS = 0.75  # px: a stroke inks 1 - distance up to here (thin footprints pack densely)
_CLEAR = 3.0  # px between strokes: > 0.75 + 1.42 + 0.75, so their inked pixels are never 8-adjacent
_ZONES_APART = 5.0  # px between marker centres (and from B's start to A): zones never 8-adjacent
_DENSE = 3  # points per step where clearances are measured (a step is seg + gap = 3 px at size 32)
_WALKS = 256  # distractors drawn at once; the first that fit are kept
_TAILS = 16  # free parts of B tried at once for each number of copied steps
_FEWEST_WALKS, _BATCH_WALKS, _MOST_WALKS = 16, 256, 1024  # walks for A drawn at first, at once, in all
_ENOUGH_WALKS = 16  # walks for A that fit in the canvas, gathered before the costly tests
_ROTATIONS = 24  # evenly spaced rotations tried per pair to fit it in the canvas
_TURNS = 6  # turns tried at a vertex of a steered walk
_AHEAD = 2.0  # steps: how far ahead a steered walk looks for room
_EXACT = 8  # placements that pass the cheap screen and get the exact test
_BATCHES = 1  # batches of distractors per distractor tried before the clutter starts again
_CLUTTER_TRIES = 3  # clutters tried on the same two main contours
_RESTARTS = 300  # images started again before the settings are declared too crowded
_CHUNK = 64  # images drawn together (arrays grow with it; the per-call cost shrinks)
# Distractor steps per image in LRA's Pathfinder data (lra_benchmarks/data/pathfinder.py's
# builders: num_distractor_snakes = BUDGET / distractor_length) by image size: Pathfinder-32
# 20, 64 px 22, Path-X (128 px) 35, 256 px 30. Clutter does not grow with the area: the
# larger images are sparser, and the contours longer in pixels.
_LRA_DISTRACTOR_STEPS = {32: 20, 64: 22, 128: 35, 256: 30}
_MARKER = np.rint(255 * np.clip(2.0 - np.hypot(*np.mgrid[-1:2, -1:2]), 0, 1)).astype(np.uint8).ravel()
_AROUND = np.mgrid[-1:2, -1:2].reshape(2, -1)  # (dy, dx) [2, 9]: the 8-neighbourhood and the pixel
_ONE = 1 + 1j  # one pixel along both axes


def default_distractors(size: int, contour_length: int) -> int:
    """LRA's clutter: its budget of distractor steps for the largest of its image sizes
    (32, 64, 128, 256) that is at most `size`, Pathfinder-32's scaled by area below 32 px,
    divided into distractors of `distractor_length(contour_length)` steps."""
    smallest = min(_LRA_DISTRACTOR_STEPS)
    if size < smallest:
        steps = round(_LRA_DISTRACTOR_STEPS[smallest] * size**2 / smallest**2)
    else:
        steps = _LRA_DISTRACTOR_STEPS[max(s for s in _LRA_DISTRACTOR_STEPS if s <= size)]
    return steps // distractor_length(contour_length)


def distractor_length(contour_length: int) -> int:
    return max(1, contour_length // 3)


def _least_copied(steps):
    """B copies at least about half of A's steps: the less it copies, the more B differs
    from A around the candidate end (and A's start maps onto A itself, so not all)."""
    return max(1, (steps - 2) // 2)


# Points are complex numbers x + iy (column x, row y): a turn is a product, a length an
# abs and the mirror across the x axis a conjugate, one fast numpy call each, where
# (y, x) pairs need reductions over an axis of 2 (slow in numpy).
#
# Many images are drawn at once. Candidates (walks, pairs, placements) of all of them
# lie in one array, sorted by `owner` (the image's place in the chunk), and each image
# draws its random numbers from its own generator, so that it is the same whichever
# images are drawn beside it.


def _rank(owner):
    """[k] the place of each row among the rows of its owner (owner [k] sorted)."""
    return np.arange(len(owner)) - np.searchsorted(owner, owner)


def _walk(angles, step):
    """Contours [..., n + 1] from the origin whose n steps of length `step` head along
    `angles` [..., n] (radians from +x towards +y)."""
    walks = np.zeros((*angles.shape[:-1], angles.shape[-1] + 1), complex)
    np.cumsum(step * np.exp(1j * angles), axis=-1, out=walks[..., 1:])
    return walks


def _box(points, axis):
    """Corners (lowest x + i lowest y, highest x + i highest y) of points along `axis`."""
    x, y = points.real, points.imag
    return x.min(axis) + 1j * y.min(axis), x.max(axis) + 1j * y.max(axis)


def _room_left(lo, hi, size):
    """How far boxes [lo, hi] (complex corners) can move along x (real) and y (imag)
    and stay at least 1 px inside the canvas; negative where they do not fit."""
    return (size - 3) * _ONE - (hi - lo)


def _moved_in(lo, room, u):
    """The shift that puts a box with lowest corner `lo` at a random place inside the
    canvas: uniform draws u [..., 2] ((y, x) fractions) of its `room` [...] left."""
    return _ONE - lo + u[..., 1] * room.real + 1j * u[..., 0] * room.imag


def _pixel_index(points, width, origin):
    """[...] int: the flat index of the pixel nearest each point in a row-major grid of
    `width` columns whose pixel (0, 0) has flat index `origin` (an int or [...])."""
    return (np.rint(points.imag) * width + np.rint(points.real)).astype(np.int64) + origin


def _dashes(vertices, seg, gap):
    """Dash end points [..., n] (a, b) of the steps between consecutive vertices [..., n + 1]."""
    u = np.diff(vertices, axis=-1) / (seg + gap)
    a = vertices[..., :-1] + gap / 2 * u
    return a, a + seg * u


def _dense(vertices, per_step=_DENSE):
    """Points every 1 / per_step of a step along contours [..., n + 1]: [..., n * per_step + 1]."""
    t = np.arange(per_step) / per_step
    inner = vertices[..., :-1, None] + t * np.diff(vertices, axis=-1)[..., None]
    inner = inner.reshape(*inner.shape[:-2], inner.shape[-2] * per_step)
    return np.concatenate([inner, vertices[..., -1:]], axis=-1)


def _distance(points, others):
    """[..., n] distance from each of points [..., n] to the nearest of others [..., j]."""
    return np.abs(points[..., :, None] - others[..., None, :]).min(axis=-1)


def _random_walks(rngs, k, steps, size, step):
    """k random contours per generator, turned and moved to random places inside the
    canvas, uniform turns of at most _MAX_TURN; those too long to fit are dropped:
    (walks [k', steps + 1], owner [k'])."""
    u = np.concatenate([rng.random((k, steps + 3)) for rng in rngs])
    angles = np.cumsum((2 * u[:, :steps] - 1) * _MAX_TURN, axis=1)  # the first turn sets a random heading
    angles += 2 * math.pi * u[:, steps : steps + 1]
    walks = _walk(angles, step)
    lo, hi = _box(walks, 1)
    room = _room_left(lo, hi, size)
    fits = (room.real >= 0) & (room.imag >= 0)
    walks = walks + _moved_in(lo, room, u[:, steps + 1 :])[:, None]
    return walks[fits], np.repeat(np.arange(len(rngs)), k)[fits]


@functools.cache
def _grid(size, seg):
    """Constants of a canvas: (pad, width, offsets, flat offsets, flat 3x3): the canvas
    is padded by `pad` on each side (width = size + 2 pad) so that any pixel near a dash
    inside can be looked up; offsets (complex) and flat offsets [p] of the pixels near
    a dash's middle, flat offsets [9] of a pixel's 8-neighbourhood and itself."""
    reach = int(seg / 2 + 1.5)  # a dash inks pixels within seg / 2 + 1 of its middle
    width = size + 2 * reach
    dy, dx = np.mgrid[-reach : reach + 1, -reach : reach + 1].reshape(2, -1)
    return reach, width, dx + 1j * dy, dy * width + dx, _AROUND[0] * width + _AROUND[1]


class _Canvases:
    """The pictures being drawn, one per image of a chunk: ink so far and the pixels a
    new contour may not ink (8-neighbours of earlier contours and of the marker zones),
    padded and flat: picture j's pixel is one index into [count * width**2] (its pixels
    from j * width**2), so a lookup of any pixels of any pictures is one call."""

    def __init__(self, count, size, seg, gap):
        self.size, self.seg, self.gap = size, seg, gap
        self.pad, self.width, self.offsets, self.flat_offsets, self.around = _grid(size, seg)
        self.area, self.count = self.width**2, count
        self.blocked = np.zeros(count * self.area, bool)
        self.image = np.zeros(count * self.area, np.uint8)
        self.along = np.linspace(0, 1, 2 * seg + 1)

    def pixel(self, points, owner):
        """[...] flat index of the pixel nearest each point [...] (complex) of picture
        `owner` [...] (broadcast against points)."""
        return _pixel_index(points, self.width, self.pad * (self.width + 1) + owner * self.area)

    def pictures(self, owners):
        """The images [len(owners), size, size] uint8, padding cut off."""
        p, w = self.pad, self.width
        return self.image.reshape(-1, w, w)[owners, p : p + self.size, p : p + self.size]

    def copy(self):
        twin = _Canvases.__new__(_Canvases)
        twin.__dict__ = dict(self.__dict__, blocked=self.blocked.copy(), image=self.image.copy())
        return twin

    def _ink(self, a, b, owner):
        """Pixels near each dash and their ink: (pixels [..., n, p] flat, ink [..., n, p] uint8)."""
        centre = np.rint((a + b) / 2)
        w = (centre[..., None] + self.offsets) - a[..., None]
        u = (b - a)[..., None] / self.seg
        t = np.clip((w * u.conj()).real, 0, self.seg)  # along the dash, of its nearest point
        distance = np.abs(w - t * u)
        ink = np.where(distance < _INK_RADIUS, np.rint(255 * (1 - distance)), 0).astype(np.uint8)
        return self.pixel(centre, owner)[..., None] + self.flat_offsets, ink

    def _clear(self, vertices, owner, most=None, inside=False):
        """Candidates [k, n + 1] of pictures `owner` [k] (sorted) that stay inside and ink
        no blocked pixel, at most `most` per picture, in order: (their rows [c], pixels
        [c, m] flat, ink [c, m]). `inside`: the vertices are known to lie 1 px inside,
        and so do the dashes between them."""
        a, b = _dashes(vertices, self.seg, self.gap)
        if inside:
            inside = np.arange(len(a))
        else:
            lo, hi = _box(np.concatenate([a, b], axis=1), 1)
            (inside,) = np.nonzero(
                (lo.real >= 1) & (lo.imag >= 1) & (hi.real <= self.size - 2) & (hi.imag <= self.size - 2)
            )
        # screen: the pixel nearest to any point of a dash is inked (it is < 0.75 px away)
        a, b, owner = a[inside], b[inside], owner[inside]
        points = a[..., None] + self.along * (b - a)[..., None]
        clear = ~self.blocked[self.pixel(points, owner[:, None, None])].any(axis=(1, 2))
        (chosen,) = np.nonzero(clear)
        if most is not None:
            chosen = chosen[_rank(owner[chosen]) < most]
        pixels, ink = self._ink(a[chosen], b[chosen], owner[chosen, None])
        c, n, m = ink.shape
        pixels, ink = pixels.reshape(c, n * m), ink.reshape(c, n * m)
        hits = self.blocked[pixels] & (ink > 0)
        (free,) = np.nonzero(~hits.any(axis=1))
        return inside[chosen[free]], pixels[free], ink[free]

    def fit(self, vertices, owner):
        """The first candidate contour [k, n + 1] of each picture (owner [k], sorted) that
        stays inside and inks no blocked pixel: (the pictures that have one [j], their
        pixels [j, m] flat, ink [j, m])."""
        rows, pixels, ink = self._clear(vertices, owner, _EXACT)
        owners, first = np.unique(owner[rows], return_index=True)
        return owners, pixels[first], ink[first]

    def add(self, pixels, ink, zones=None):
        """Ink contours (flat pixels [j, m], ink [j, m]; pixels with no ink are skipped) and
        block their neighbourhood and that of their marker zones (flat centres [j, z])."""
        lit = ink > 0
        pixels = pixels[lit]
        np.maximum.at(self.image, pixels, ink[lit])
        if zones is not None:
            pixels = np.concatenate([pixels, (zones[..., None] + self.around).ravel()])
        self.blocked[(pixels[:, None] + self.around).ravel()] = True

    def add_many(self, vertices, owner, wanted):
        """Ink on each picture j the first `wanted[j]` of its candidate contours [k, n + 1]
        (owner [k] sorted; 1 px inside, as `_random_walks` places them) that fit, each
        checked against those inked before it as well; returns how many each got [count].
        One candidate at a time: a picture needs only its first few (a loop over them
        costs less than rounds over all candidates of all pictures)."""
        added = np.zeros_like(wanted)
        rows, pixels, ink = self._clear(vertices, owner, inside=True)
        owner = owner[rows]
        bounds = np.searchsorted(owner, np.arange(self.count + 1))
        for j in np.nonzero(wanted)[0]:
            for row in range(bounds[j], bounds[j + 1]):
                lit = ink[row] > 0
                if not self.blocked[pixels[row][lit]].any():
                    self.add(pixels[row][lit], ink[row][lit])
                    added[j] += 1
                    if added[j] == wanted[j]:
                        break
        return added

    def zone_free(self, centres):
        """[j] whether no pixel of the zones around flat `centres` [j] is blocked."""
        return ~self.blocked[centres[:, None] + self.around].any(axis=1)

    def mark(self, centres):
        zone = centres[:, None] + self.around
        self.image[zone] = np.maximum(self.image[zone], _MARKER)

    def room(self, margin):
        """Where a stroke point may round to: at least 1.5 px inside, with no blocked pixel
        among its 8 neighbours (all it may ink); (room flat [count * w * w], its width w,
        the flat index of pixel (0, 0) of picture 0), with `margin` more pixels of no room
        on each side so that points that far out can be looked up."""
        b, n = self.blocked.reshape(-1, self.width, self.width), self.width
        near = (
            b[:, :-2, :-2]
            | b[:, :-2, 1:-1]
            | b[:, :-2, 2:]
            | b[:, 1:-1, :-2]
            | b[:, 1:-1, 1:-1]
            | b[:, 1:-1, 2:]
            | b[:, 2:, :-2]
            | b[:, 2:, 1:-1]
            | b[:, 2:, 2:]
        )
        w, lo, hi = n + 2 * margin, self.pad + 2, self.pad + self.size - 2
        room = np.zeros((len(b), w, w), bool)
        room[:, margin + lo : margin + hi, margin + lo : margin + hi] = ~near[:, lo - 1 : hi - 1, lo - 1 : hi - 1]
        return room.ravel(), w, (margin + self.pad) * (w + 1)

    def steered(self, u, starts, headings, needed, group, owner):
        """Random contours [k, max(needed) + 1] on pictures `owner` [k] from `starts` [k]
        along `headings` [k], turning by at most _MAX_TURN at each vertex (the first
        included), walk i for `needed[i]` steps (its later vertices mean nothing), from
        uniform draws u [most, k, _TURNS + 1] (the turns, then the resampling). Of _TURNS
        turns at a vertex, the first whose dash stays in the room and that has room ahead
        (a point _AHEAD steps on) is taken, else the first whose dash stays in the room:
        a contour bends away from borders and other strokes. A walk that finds no room
        goes on as a copy of a live walk of its `group` [k] (ints), drawn at random
        (`_resample`)."""
        step, k, most = self.seg + self.gap, len(starts), u.shape[0]
        room, width, origin = self.room(int((most + _AHEAD) * step) + 2)  # as far as a walk reaches
        origin = origin + owner[:, None, None] * width**2
        turns = (2 * u[..., :_TURNS] - 1) * _MAX_TURN
        probes = np.append(self.gap / 2 + np.linspace(0, self.seg, 3), _AHEAD * step) / step
        rows = np.arange(k)
        path = np.empty((most + 1, k), complex)
        path[0], angle = starts, headings
        for i, turn in enumerate(turns):
            angles = angle[:, None] + turn
            move = step * np.exp(1j * angles)
            free = room[_pixel_index(path[i, :, None, None] + probes * move[..., None], width, origin)]
            dash = free[..., :-1].all(axis=-1)
            first = np.argmax(2 * dash + (dash & free[..., -1]), axis=1)
            path[i + 1], angle = path[i] + move[rows, first], angles[rows, first]
            alive = dash[rows, first] | (i >= needed)
            if not alive.all():
                source = _resample(alive, group, u[i, :, _TURNS])
                path[: i + 2] = path[: i + 2, source]
                angle = angle[source]
        return path.T


def _resample(alive, group, u):
    """[k] the walk each walk goes on as: itself when `alive` [k] (or when its group has
    no live walk), else the live walk of its `group` [k] (sorted) that the uniform draw
    u [k] picks."""
    k = len(alive)
    order = np.lexsort((~alive, group))  # by group, live first
    live = np.bincount(group, alive, minlength=group[-1] + 1).astype(np.int64)
    first = np.searchsorted(group[order], group)
    pick = order[np.minimum(first + (u * live[group]).astype(np.int64), k - 1)]
    return np.where(alive | (live[group] == 0), np.arange(k), pick)


def _diameter_at_most(points, limit):
    """[k] whether no two of points [k, n] lie more than `limit` apart. Most long walks
    fail already on the distance between their two ends (O(1)) or from them (O(n)), so
    the pairwise test (O(n^2)) runs only on the few that pass."""
    near = np.abs(points[:, -1] - points[:, 0]) <= limit
    (rows,) = np.nonzero(near)
    ends = points[rows][:, [0, -1]]
    near[rows] = np.all(np.abs(points[rows, None] - ends[:, :, None]) <= limit, axis=(1, 2))
    (rows,) = np.nonzero(near)
    near[rows] = np.abs(points[rows, :, None] - points[rows, None]).max(axis=(1, 2)) <= limit
    return near


def _fits_turned(points, angles, size):
    """[k, r] whether points [k, n] turned by each of angles [r] (or [k, r]) fit in the
    canvas (at least 1 px from its border). In floats, points first: numpy is slow at
    complex products broadcast over three axes and at reductions over a short last axis."""
    c, s = np.cos(angles), np.sin(angles)
    x, y = points.real.T[..., None], points.imag.T[..., None]
    tx, ty = x * c - y * s, x * s + y * c  # [n, k, r]
    return (tx.max(0) - tx.min(0) <= size - 3) & (ty.max(0) - ty.min(0) <= size - 3)


def _short_walks(rngs, steps, size, step):
    """Contours in A's frame (from the origin, first step along +x, uniform turns of at
    most _MAX_TURN after it) whose diameter fits in the canvas, for each generator:
    walks are drawn (_FEWEST_WALKS, then batches of _BATCH_WALKS) until _ENOUGH_WALKS
    fit or _MOST_WALKS are drawn, so that the costly tests after this one run once on
    many walks (long walks rarely fit): (walks [m, steps + 1], owner [m] sorted)."""
    count, drawn = np.zeros(len(rngs), np.int64), 0
    todo, kept, owners, k = np.arange(len(rngs)), [], [], _FEWEST_WALKS
    while len(todo):
        turns = np.concatenate([rngs[j].uniform(-_MAX_TURN, _MAX_TURN, (k, steps)) for j in todo])
        turns[:, 0] = 0.0
        walks = _walk(np.cumsum(turns, axis=1), step)
        fit = _diameter_at_most(walks, size - 3)
        kept.append(walks[fit])
        owners.append(np.repeat(todo, k)[fit])
        count += np.bincount(owners[-1], minlength=len(rngs))
        drawn, k = drawn + k, _BATCH_WALKS
        todo = todo[(count[todo] < _ENOUGH_WALKS) & (drawn < _MOST_WALKS)]
    owner = np.concatenate(owners)
    order = np.argsort(owner, kind="stable")
    return np.concatenate(kept)[order], owner[order]


def _pairs(rngs, steps, size, seg, gap):
    """Fresh contours A with room for B's head, in A's frame (first vertex at the origin,
    first step along +x, so P = A's first dash end lies on the x axis): (A [m, n + 1],
    B's head [m, n + 1]: the mirror image of A's vertices from the far end back, copied
    [m]: how many of its steps B takes (as many as stay _CLEAR of A), ends [m, 3]: P, A's
    far end and B's start (the mirror image of A's far end), owner [m]). The cheap tests
    (A's diameter, the ends, a fit in the canvas) run before the costly clearance."""
    a, owner = _short_walks(rngs, steps, size, seg + gap)
    da, db = _dashes(a, seg, gap)
    ends = np.stack([da[:, 0], db[:, -1], db[:, -1].conj()], axis=1)  # conj: the mirror across the x axis
    dense_a = _dense(a)
    ok = _distance(ends[:, 2:], dense_a)[:, 0] >= _ZONES_APART
    ok &= _fits_turned(np.concatenate([a, ends], 1), np.linspace(0, math.pi, _ROTATIONS, endpoint=False), size).any(
        axis=1
    )
    a, ends, dense_a, owner = a[ok], ends[ok], dense_a[ok], owner[ok]
    heads = a[:, ::-1].conj()
    near = _distance(_dense(heads), dense_a)
    # a step of the mirror image is clear when all its points are, both ends included
    clear = np.minimum(near[:, :-1].reshape(len(a), steps, _DENSE).min(axis=2), near[:, _DENSE::_DENSE]) >= _CLEAR
    copied = np.minimum(np.argmax(np.concatenate([~clear, np.ones((len(a), 1), bool)], 1), axis=1), steps - 1)
    ok = copied >= _least_copied(steps)
    ok[ok] = _fits_turned(
        _union(a[ok], heads[ok], copied[ok], ends[ok]), np.linspace(0, math.pi, _ROTATIONS // 2, endpoint=False), size
    ).any(axis=1)
    return a[ok], heads[ok], copied[ok], ends[ok], owner[ok]


def _union(a, heads, copied, ends):
    """[k, 2 n + 5]: A's vertices, B's head's (the uncopied ones moved onto A's first
    vertex, which is inside anyway) and the ends: what must fit in the canvas."""
    used = np.where(np.arange(a.shape[1]) <= copied[:, None], heads, a[:, :1])
    return np.concatenate([a, used, ends], axis=1)


def _place_pairs(u, a, heads, copied, ends, owner, size):
    """For each image, turn and move its pair (A, B's head, ends; rows of `owner`) that
    copies the most steps among those that fit in the canvas at one of _ROTATIONS evenly
    spaced angles (random phase), at a random fitting one of them, from uniform draws
    u [images, 4]: (the images placed [j], A [j, n + 1], head [j, n + 1] (its first
    copied + 1 vertices are B's), copied [j], ends [j, 3])."""
    n = a.shape[1]
    points = _union(a, heads, copied, ends)
    angles = 2 * math.pi * (u[owner, :1] + np.arange(_ROTATIONS) / _ROTATIONS)
    fits = _fits_turned(points, angles, size)
    (rows,) = np.nonzero(fits.any(axis=1))
    rows = rows[np.lexsort((-copied[rows], owner[rows]))]  # B's free part is short: it fits more often
    placed, first = np.unique(owner[rows], return_index=True)
    pair = rows[first]
    fits = fits[pair]
    choice = (u[placed, 1] * fits.sum(axis=1)).astype(np.int64)
    angle = angles[pair, np.argmax(np.cumsum(fits, axis=1) > choice[:, None], axis=1)]
    turned = points[pair] * np.exp(1j * angle)[:, None]
    lo, hi = _box(turned, 1)
    moved = turned + _moved_in(lo, _room_left(lo, hi, size), u[placed, 2:])[:, None]
    return placed, moved[:, :n], moved[:, n : 2 * n], copied[pair], moved[:, 2 * n :]


def _main_contours(rngs, size, contour_length, seg, gap):
    """A and B for each image on a fresh canvas: (canvases, the images drawn [j], their
    ends (P, Q if label 1, Q if label 0) as flat pixels [j, 3]). An image fails when no
    pair fits, or A, B or B's start zone find no room."""
    count, least = len(rngs), _least_copied(contour_length)
    pairs = _pairs(rngs, contour_length, size, seg, gap)
    u = np.stack([rng.random(4) for rng in rngs])
    drawn, a, head, copied, ends = _place_pairs(u, *pairs, size)
    canvas = _Canvases(count, size, seg, gap)
    ends = canvas.pixel(ends, drawn[:, None])
    fitted, pixels, ink = canvas.fit(a, drawn)
    keep = np.isin(drawn, fitted)
    canvas.add(pixels, ink, zones=ends[keep, :2])
    keep[keep] = canvas.zone_free(ends[keep, 2])
    drawn, head, copied, ends = drawn[keep], head[keep], copied[keep], ends[keep]
    if not len(drawn):
        return canvas, drawn, ends
    # B's free part, for every number of copied steps at once (the most copied first)
    tried = (copied - least + 1) * _TAILS
    at = np.repeat(np.arange(len(drawn)), tried)
    rank = _rank(at)
    cs = copied[at] - rank // _TAILS
    group = np.cumsum(rank % _TAILS == 0) - 1  # one per image and number of copied steps
    most = contour_length - least
    u = np.concatenate([rngs[j].random((k, most, _TURNS + 1)) for j, k in zip(drawn, tried, strict=True)])
    starts, before = head[at, cs], head[at, cs - 1]
    tails = canvas.steered(
        u.transpose(1, 0, 2), starts, np.angle(starts - before), contour_length - cs, group, drawn[at]
    )
    rows = np.arange(contour_length + 1)[None, :]
    b = np.where(
        rows < cs[:, None],
        head[at[:, None], rows],
        tails[np.arange(len(cs))[:, None], np.clip(rows - cs[:, None], 0, None)],
    )
    fitted, pixels, ink = canvas.fit(b, drawn[at])
    keep = np.isin(drawn, fitted)
    canvas.add(pixels, ink, zones=ends[keep, 2:])
    return canvas, drawn[keep], ends[keep]


def _cluttered(rngs, canvas, drawn, count, steps):
    """`count` distractors of `steps` steps on the pictures of images `drawn` (on a copy
    of the canvases), from up to _BATCHES * count batches of _WALKS random walks each:
    (the canvases, [len(drawn)] whether each picture found room for all)."""
    canvas, wanted = canvas.copy(), np.zeros(canvas.count, np.int64)
    wanted[drawn] = count
    for _ in range(_BATCHES * count):
        (todo,) = np.nonzero(wanted)
        if not len(todo):
            break
        walks, owner = _random_walks([rngs[j] for j in todo], _WALKS, steps, canvas.size, canvas.seg + canvas.gap)
        wanted -= canvas.add_many(walks, todo[owner], wanted)
    return canvas, wanted[drawn] == 0


def _scenes(rngs, labels, size, contour_length, distractors, seg, gap):
    """One attempt at a picture for each image: (the images that got one [j], their
    pictures [j, size, size]). The clutter is drawn again (up to _CLUTTER_TRIES times)
    on the same A and B before the picture starts again: A and B cost the most."""
    canvas, drawn, ends = _main_contours(rngs, size, contour_length, seg, gap)
    made, pictures = [np.zeros(0, np.int64)], [np.zeros((0, size, size), np.uint8)]
    for _ in range(_CLUTTER_TRIES):
        if not len(drawn):
            break
        cluttered, ok = _cluttered(rngs, canvas, drawn, distractors, distractor_length(contour_length))
        done, (p, q1, q0) = drawn[ok], ends[ok].T
        cluttered.mark(p)
        cluttered.mark(np.where(labels[done] == 1, q1, q0))
        made.append(done)
        pictures.append(cluttered.pictures(done))
        drawn, ends = drawn[~ok], ends[~ok]
    return np.concatenate(made), np.concatenate(pictures)


def _settings(size, contour_length, distractors, gap):
    """(dash length, distractor count) of valid settings; a clear error otherwise."""
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
    return seg, distractors


def render_batch(
    seed: int, indices, *, size: int = 32, contour_length: int = 6, distractors: int | None = None, gap: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Pathfinder images [n, size, size] uint8 and labels [n] of records `indices` [n]
    (ints >= 0), drawn _CHUNK at a time; record i is `render(seed, i, ...)` whatever
    else is drawn with it (each image draws from its own generator)."""
    seg, distractors = _settings(size, contour_length, distractors, gap)
    indices = np.asarray(indices if isinstance(indices, np.ndarray) else list(indices))
    if indices.size and indices.dtype.kind not in "iu":
        raise ValueError(f"pathfinder: record indices must be integers; got dtype {indices.dtype}")
    indices = indices.astype(np.int64).reshape(-1)
    if (indices < 0).any():
        raise ValueError(f"pathfinder: record indices must be >= 0; got {indices[indices < 0][:5].tolist()}")
    images = np.empty((len(indices), size, size), np.uint8)
    for start in range(0, len(indices), _CHUNK):
        chunk = indices[start : start + _CHUNK]
        rngs, labels, todo = [np.random.default_rng([seed, int(i)]) for i in chunk], chunk % 2, np.arange(len(chunk))
        for _ in range(_RESTARTS):
            made, pictures = _scenes([rngs[j] for j in todo], labels[todo], size, contour_length, distractors, seg, gap)
            images[start + todo[made]] = pictures
            todo = np.delete(todo, made)
            if not len(todo):
                break
        else:
            raise ValueError(
                f"pathfinder: could not fit 2 contours of {contour_length} steps and {distractors} "
                f"distractors of {distractor_length(contour_length)} into {size}x{size} pixels in "
                f"{_RESTARTS} tries; use a larger size, shorter contours or fewer distractors"
            )
    return images, indices % 2


def render(
    seed: int, index: int, *, size: int = 32, contour_length: int = 6, distractors: int | None = None, gap: int = 1
) -> tuple[np.ndarray, int]:
    """One Pathfinder image and its label (see the module docstring). `distractors`
    None: LRA's count for this size and contour length (`default_distractors`)."""
    images, labels = render_batch(
        seed, [index], size=size, contour_length=contour_length, distractors=distractors, gap=gap
    )
    return images[0], int(labels[0])
