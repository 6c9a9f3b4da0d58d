"""Stand-ins for the Long Range Arena's Text and Retrieval tasks (Tay et al. 2021, "Long
Range Arena: A Benchmark for Efficient Transformers"), built from Shakespeare's plays
because LRA's own data (IMDB reviews; the ACL Anthology Network's citation pairs) cannot
be downloaded on these machines. They have LRA's shapes (byte-level documents of 4,000
bytes, vocabulary 256, two classes; Retrieval's two documents read by a dual-tower
model), not its data: their accuracies are not comparable with the published ones.

* `LRAText` (data task `lra_text`): is an excerpt of `max_len` bytes from a comedy (0) or
  a tragedy (1)?
* `LRARetrieval` (data task `lra_retrieval`): do two excerpts come from the same play (1)
  or from two plays of one genre (0)? With `within`, a positive's two excerpts are at
  most that many bytes apart (one passage: an easier version of the task).

A play is read as its speeches (`genre.speeches`: the lines of each speaker's turn, stage
directions and speaker names removed) joined by newlines, so the excerpts hold the
spoken text alone and nothing of an edition's layout (speaker labels, act and scene
headings) that could carry the label. The genres are the First Folio's (`genre`); both
tasks are split by play with `genre.split_plays` (in each genre every fourth play is
eval), so no play is read on both sides.

Records depend only on (seed, index) (and the settings): the label is drawn first, so the
classes are balanced in expectation whatever the plays' lengths, then the plays (each in
proportion to its length), then the windows. An excerpt is a window at a uniform byte
offset; every play here holds far more than 4,000 bytes, so no record is padded at LRA's
length. A play shorter than `max_len` (a small fixture) gives its whole text, padded with
zeros marked False in the mask: padding is told by the mask, never by a token value (a
zero byte could be data).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jxformers.data import genre
from jxformers.data.real import SHAKESPEARE_HOWTO

TEXT_GENRES = ("comedy", "tragedy")  # LRAText's labels, in order; histories are left out


@functools.cache
def play_bytes(path: str, split: str) -> tuple[tuple[str, bytes], ...]:
    """(play, its speeches joined by newlines, UTF-8) of each play of `split`, in name
    order (`genre.split_plays`)."""
    return tuple(
        (play, "\n".join(genre.speeches(text)).encode("utf-8")) for play, text in genre.play_texts(path, split)
    )


def window(data: bytes, start: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens [max_len] int32, mask [max_len] bool)`: the bytes data[start : start +
    max_len], zero-padded where the text ends, the mask True on the bytes read."""
    raw = np.frombuffer(data[start : start + max_len], np.uint8)
    tokens = np.zeros((max_len,), np.int32)
    tokens[: raw.shape[0]] = raw
    return tokens, np.arange(max_len) < raw.shape[0]


def _by_length(rng: np.random.Generator, lengths: list[int]) -> int:
    """An index drawn in proportion to `lengths`."""
    weights = np.asarray(lengths, np.float64)
    return int(rng.choice(len(weights), p=weights / weights.sum()))


@dataclasses.dataclass(frozen=True)
class _Excerpts:
    """The settings both tasks share: `size` records of excerpts of `max_len` bytes from
    the plays of `split` ("train" or "valid") found in `path`, drawn with `seed`."""

    seed: int
    size: int
    path: str = ""
    split: str = "train"
    max_len: int = 4000

    vocab_size = 256

    def _check(self, name: str) -> None:
        if not self.path:
            raise ValueError(f"{name}: data.settings.path is required; {SHAKESPEARE_HOWTO}")
        if self.max_len < 1 or self.size < 1:
            raise ValueError(f"{name}: max_len >= 1 and size >= 1 needed; got {self.max_len=}, {self.size=}")

    def __len__(self) -> int:
        return self.size


@dataclasses.dataclass(frozen=True)
class LRAText(_Excerpts):
    """LRA Text's stand-in: is an excerpt of `max_len` bytes (LRA: 4,000) from a comedy
    (label 0) or a tragedy (1)? The plays of those two genres in `split` (histories are
    left out), read as speeches (see the module docstring).

    Record i: with rng = default_rng([seed, i]), the label is a fair coin, then a play of
    that genre is drawn in proportion to its length, then a window at a uniform byte
    offset. Layout: classification's (`jxformers.data.tasks`), `tokens [max_len] int32`
    (bytes), `mask [max_len] bool` (False only on the padding of a play shorter than
    max_len), `label int32`. Baselines: `baselines.majority_class` and
    `baselines.byte_ngram_bayes` (naive Bayes on byte 1-3-grams)."""

    model_task = "classify"
    num_classes = len(TEXT_GENRES)

    def __post_init__(self):
        self._check("lra_text")
        for label in range(self.num_classes):  # also fails now, with the how-to, if the texts are missing
            if not self._plays(label):
                raise ValueError(f"lra_text: split {self.split!r} holds no {TEXT_GENRES[label]}")

    def _plays(self, label: int) -> list[bytes]:
        return [
            data for play, data in play_bytes(self.path, self.split) if genre.PLAY_GENRE[play] == TEXT_GENRES[label]
        ]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(index)])
        label = int(rng.integers(self.num_classes))
        plays = self._plays(label)
        data = plays[_by_length(rng, [len(p) for p in plays])]
        tokens, mask = window(data, int(rng.integers(0, max(len(data) - self.max_len, 0) + 1)), self.max_len)
        return {"tokens": tokens, "mask": mask, "label": np.asarray(label, np.int32)}


@dataclasses.dataclass(frozen=True)
class LRARetrieval(_Excerpts):
    """LRA Retrieval's stand-in: two excerpts of `max_len` bytes each (LRA: 4,000), label 1
    when both come from one play, 0 when from two plays. The plays of all three Folio
    genres in `split`, read as speeches (see the module docstring).

    Negatives pair two plays of the same genre, so that a model which only tells
    comedies from tragedies or histories (LRAText's task, or the histories' kings and
    battles) gains nothing: what decides is what is particular to a play (its people,
    places, words). Positives take two windows that do not overlap, so no byte run is
    shared by construction. Record i: with rng = default_rng([seed, i]), the label is a
    fair coin; a play is drawn in proportion to its length; for a negative a second play
    of its genre is drawn (in proportion to length among the others); the two windows are
    at uniform byte offsets (for a positive, two non-overlapping ones, in random order).

    `within` (bytes, or None): a positive's second window starts a uniform 0..within
    bytes after the first ends, so both are from one passage (one scene's people and
    matter) rather than anywhere in the play. None (LRA's shape, the `paper` preset)
    leaves them anywhere. Why: at 512 bytes, two windows anywhere in a play share too
    little for any cheap predictor (n-gram overlap 0.53 where chance is 0.50), while two
    windows of one passage share their speakers' names and subject (0.72 with `within`
    0, 0.61 with 2,048); negatives are unchanged. The `cpu` preset does not use it: its
    softmax model stayed at chance on it too (lra_retrieval.yaml has the runs).

    Layout (model task "retrieval", `jxformers.data.tasks`): `tokens`, `mask` the first
    excerpt, `other`, `other_mask` the second (each `[max_len]`; the masks False only on
    padding), `label int32`. Every play of the split must hold 2 * max_len bytes and
    every genre two plays. Baselines: `baselines.majority_class` and
    `baselines.ngram_overlap` (Jaccard of the two excerpts' character n-gram sets)."""

    within: int | None = None

    model_task = "retrieval"
    num_classes = 2

    def __post_init__(self):
        self._check("lra_retrieval")
        if self.within is not None and self.within < 0:
            raise ValueError(f"lra_retrieval: within is a byte count >= 0 or None (anywhere); got {self.within=}")
        plays = play_bytes(self.path, self.split)
        need = 2 * self.max_len + (self.within or 0)
        short = {play: len(data) for play, data in plays if len(data) < need}
        if short:
            raise ValueError(
                f"lra_retrieval: a positive needs two windows of max_len {self.max_len} bytes that do not overlap"
                + (f", at most within {self.within} bytes apart" if self.within is not None else "")
                + f"; these plays of split {self.split!r} hold fewer than {need} bytes of speech: {short}"
            )
        alone = sorted(g for g in genre.GENRES if sum(genre.PLAY_GENRE[p] == g for p, _ in plays) == 1)
        if alone:
            raise ValueError(
                f"lra_retrieval: a negative pairs two plays of a genre; split {self.split!r} has one {alone}"
            )

    def __repr__(self) -> str:
        # A checkpoint stores its data source's repr, and restoring refuses a different one:
        # `within`, added after runs were checkpointed, is left out at its default (None), so
        # those runs still resume. The parent's repr names this class and the older fields.
        base = super().__repr__()
        return base if self.within is None else f"{base[:-1]}, within={self.within!r})"

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        plays = play_bytes(self.path, self.split)
        rng = np.random.default_rng([self.seed, int(index)])
        label = int(rng.integers(2))
        first = _by_length(rng, [len(data) for _, data in plays])
        play, data = plays[first]
        if label and self.within is not None:
            # the first window at x, the second a gap g in [0, within] after its end
            x = int(rng.integers(0, len(data) - 2 * self.max_len - self.within + 1))
            starts = [(data, x), (data, x + self.max_len + int(rng.integers(0, self.within + 1)))]
            if rng.integers(2):
                starts.reverse()
        elif label:
            # two offsets x <= y in [0, n - 2L] (sorted uniforms), the second window at y + L
            x, y = np.sort(rng.integers(0, len(data) - 2 * self.max_len + 1, size=2))
            starts = [(data, int(x)), (data, int(y) + self.max_len)]
            if rng.integers(2):
                starts.reverse()
        else:
            same = [i for i, (p, _) in enumerate(plays) if i != first and genre.PLAY_GENRE[p] == genre.PLAY_GENRE[play]]
            second = plays[same[_by_length(rng, [len(plays[i][1]) for i in same])]][1]
            starts = [(d, int(rng.integers(0, max(len(d) - self.max_len, 0) + 1))) for d in (data, second)]
        (tokens, mask), (other, other_mask) = (window(d, s, self.max_len) for d, s in starts)
        return {
            "tokens": tokens,
            "mask": mask,
            "other": other,
            "other_mask": other_mask,
            "label": np.asarray(label, np.int32),
        }
