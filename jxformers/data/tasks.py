"""Task sources: random-access grain data sources whose records depend only on (seed,
index), already padded to a fixed length with an explicit mask.

Record layouts (numpy, one example):

* classification: `tokens [max_len] int32`, `mask [max_len] bool` (True for real
  tokens; padding is never inferred from a token value), `label int32`.
* language modelling: `tokens`, `mask` and `loss_mask [max_len] bool`: position i's
  prediction of token i + 1 counts in the loss where `loss_mask[i]` is True.
* documents (classification by hierarchical encoders): `tokens [sentences, max_len]
  int32` and `mask [sentences, max_len] bool`, one row per sentence (a padded sentence's
  row all False), `label int32`.
* sequence to sequence (model task seq2seq): `tokens`, `mask` the source (what the
  encoder reads; no BOS or EOS), `target [max_len] int32` = `BOS y_1 .. y_m EOS` padded
  and `target_mask [max_len] bool`. The decoder reads `target[:-1]` (teacher forcing)
  and its row i predicts `target[i + 1]`, counted in the loss where `target_mask[i + 1]`
  is True: every y_j and the EOS, never the BOS. Ids 0 (padding), `BOS` (1) and `EOS` (2)
  are the same in every seq2seq task (a source's `bos_id`, `eos_id`).
* retrieval (model task retrieval, a dual-tower `DualClassifier`): two documents,
  `tokens`, `mask` the first and `other [max_len] int32`, `other_mask [max_len] bool` the
  second (each padded alone, its mask True for real tokens), and `label int32` (e.g.
  `lra_retrieval`: 1 when both come from one play). The model reads `apply(tokens,
  other, mask, other_mask)`.

`TASKS` maps a task name to its source class; each class says its vocabulary size,
number of classes (classification) and model task.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jxformers.data import listops, pathfinder
from jxformers.data.genre import ShakespeareGenre, ShakespeareScene, document_record
from jxformers.data.lra_text import LRARetrieval, LRAText
from jxformers.data.real import FashionMNIST, ShakespeareBytes, ShakespeareStream

BOS, EOS = 1, 2  # a seq2seq target's first and last token (0 pads)


def _pad(ids: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    if ids.shape[0] > max_len:
        raise ValueError(f"a record of {ids.shape[0]} tokens does not fit max_len {max_len}")
    tokens = np.zeros((max_len,), np.int32)
    tokens[: ids.shape[0]] = ids
    return tokens, np.arange(max_len) < ids.shape[0]


@dataclasses.dataclass(frozen=True)
class ListOps:
    """Generated ListOps (LRA grammar), classification into 10 values.

    Arguments: seed (one stream per split), size (records), max_len (padded length; LRA:
    2000), min_length/max_length (the expression length window: LRA 500 < n < 2000).
    """

    seed: int
    size: int
    max_len: int = 2000
    min_length: int = listops.MIN_LENGTH
    max_length: int = listops.MAX_LENGTH

    model_task = "classify"
    vocab_size = len(listops.VOCAB)
    num_classes = listops.NUM_CLASSES

    def __post_init__(self):
        if self.max_length - 1 > self.max_len:
            raise ValueError(
                f"listops: max_len ({self.max_len}) must hold expressions of max_length - 1 "
                f"({self.max_length - 1}) tokens"
            )
        if self.size < 1:
            raise ValueError(f"listops: size must be >= 1; got {self.size}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        ids, label = listops.sample_ids(self.seed, int(index), min_length=self.min_length, max_length=self.max_length)
        tokens, mask = _pad(ids, self.max_len)
        return {"tokens": tokens, "mask": mask, "label": np.int32(label)}


@dataclasses.dataclass(frozen=True)
class Copy:
    """The copy task (Katharopoulos et al. 2020, "Transformers are RNNs", arXiv 2006.16236,
    section 4.1): `BOS x_1 .. x_n SEP x_1 .. x_n`, n uniform in
    [min_symbols, max_symbols], symbols from an alphabet of `symbols`; the loss counts only
    the copy. Ids: 0 padding, 1 BOS, 2 SEP, 3.. symbols."""

    seed: int
    size: int
    max_len: int = 128
    symbols: int = 10
    min_symbols: int = 1
    max_symbols: int | None = None

    model_task = "lm"

    @property
    def vocab_size(self) -> int:
        return 3 + self.symbols

    def _max_symbols(self) -> int:
        return self.max_symbols or (self.max_len - 2) // 2

    def __post_init__(self):
        if not 1 <= self.min_symbols <= self._max_symbols() or 2 * self._max_symbols() + 2 > self.max_len:
            raise ValueError(
                f"copy: need 1 <= min_symbols <= max_symbols and 2 * max_symbols + 2 <= max_len; "
                f"got {self.min_symbols}, {self._max_symbols()}, max_len {self.max_len}"
            )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(index)])
        n = int(rng.integers(self.min_symbols, self._max_symbols() + 1))
        x = rng.integers(3, 3 + self.symbols, size=n)
        ids = np.concatenate([[1], x, [2], x]).astype(np.int32)
        tokens, mask = _pad(ids, self.max_len)
        loss_mask = np.zeros((self.max_len,), bool)
        loss_mask[n + 1 : 2 * n + 1] = True  # position i predicts token i + 1: the copied half
        return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


@dataclasses.dataclass(frozen=True)
class AssociativeRecall:
    """Associative recall: `k_1 v_1 .. k_n v_n SEP k_j` -> `v_j`, distinct keys, as
    language modelling with the loss on the answer only. Ids: 0 padding, 1 SEP, 2..
    keys (`keys` of them), then values (`values` of them)."""

    seed: int
    size: int
    max_len: int = 64
    pairs: int = 8
    keys: int = 16
    values: int = 16

    model_task = "lm"

    @property
    def vocab_size(self) -> int:
        return 2 + self.keys + self.values

    def __post_init__(self):
        if self.pairs > self.keys or 2 * self.pairs + 3 > self.max_len:
            raise ValueError(
                f"recall: need pairs <= keys and 2 * pairs + 3 <= max_len; got {self.pairs}, "
                f"{self.keys}, {self.max_len}"
            )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(index)])
        keys = rng.choice(self.keys, size=self.pairs, replace=False) + 2
        values = rng.integers(0, self.values, size=self.pairs) + 2 + self.keys
        j = int(rng.integers(self.pairs))
        ids = np.concatenate([np.stack([keys, values], 1).reshape(-1), [1, keys[j], values[j]]]).astype(np.int32)
        tokens, mask = _pad(ids, self.max_len)
        loss_mask = np.zeros((self.max_len,), bool)
        loss_mask[ids.shape[0] - 2] = True  # the query key's position predicts the answer
        return {"tokens": tokens, "mask": mask, "loss_mask": loss_mask}


@dataclasses.dataclass(frozen=True)
class Pathfinder:
    """Generated Pathfinder images as pixel sequences (row-major, values 0..255 as
    tokens), 2 classes. Every pixel is a real token (mask all True): a black pixel is
    data, never padding (the LRA code's fault). `distractors` defaults to LRA's
    20 // (contour_length // 3)."""

    seed: int
    size: int
    image_size: int = 32
    contour_length: int = 6
    distractors: int | None = None  # None: LRA's clutter for the contour length

    model_task = "classify"
    vocab_size = 256
    num_classes = 2
    generator_version = pathfinder.VERSION

    @property
    def max_len(self) -> int:
        return self.image_size**2

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices) -> list[dict[str, np.ndarray]]:
        """Records `indices` drawn together (`pathfinder.render_batch`: about 2.5x the
        records/s of one at a time); each the same as `self[index]`."""
        images, labels = pathfinder.render_batch(
            self.seed, indices, size=self.image_size, contour_length=self.contour_length, distractors=self.distractors
        )
        tokens = images.reshape(len(images), -1).astype(np.int32)
        return [
            {"tokens": t.copy(), "mask": np.ones(t.shape, bool), "label": np.int32(y)}  # copies: a record
            for t, y in zip(tokens, labels, strict=True)
        ]  # kept alone does not keep its whole batch


@dataclasses.dataclass(frozen=True)
class Documents:
    """Generated documents of sentences for hierarchical encoders: each sentence is about
    one of `topics` topics (its words drawn from that topic's `band` word ids, each word
    instead drawn from all topics' words with probability `noise`); the label is the
    topic most sentences are about (a tie goes to the one that comes first in the
    document), so every sentence counts and none alone decides. Sentences: between
    `min_sentences` and `sentences`, each of 1 to max_len - 1 words, then EOS. Ids: 0
    padding, 1 EOS, 2.. words (topic t's: 2 + t band ..). Record layout: the module
    docstring's documents; its majority-class baseline is `baselines.majority_class`.
    With `flat`, the same documents as one sequence (each sentence's words and EOS one
    after another, then padding, `sentences * max_len` ids) for a flat encoder to be
    compared with the hierarchical ones on the same examples."""

    seed: int
    size: int
    sentences: int = 8
    max_len: int = 16
    min_sentences: int = 3
    topics: int = 4
    band: int = 8
    noise: float = 0.25
    flat: bool = False

    model_task = "classify"

    @property
    def vocab_size(self) -> int:
        return 2 + self.topics * self.band

    @property
    def num_classes(self) -> int:
        return self.topics

    def __post_init__(self):
        if not (1 <= self.min_sentences <= self.sentences and self.max_len >= 2 and self.topics >= 2
                and self.band >= 1 and 0 <= self.noise <= 1 and self.size >= 1):  # fmt: skip
            raise ValueError(
                f"documents: need 1 <= min_sentences <= sentences, max_len >= 2, topics >= 2, band >= 1, "
                f"0 <= noise <= 1, size >= 1; got {self.min_sentences=}, {self.sentences=}, {self.max_len=}, "
                f"{self.topics=}, {self.band=}, {self.noise=}, {self.size=}"
            )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(index)])
        topics = rng.integers(self.topics, size=int(rng.integers(self.min_sentences, self.sentences + 1)))
        rows = []
        for t in topics:
            n = int(rng.integers(1, self.max_len))
            own = 2 + t * self.band + rng.integers(self.band, size=n)
            anywhere = 2 + rng.integers(self.topics * self.band, size=n)
            rows.append(np.append(np.where(rng.random(n) < self.noise, anywhere, own), 1))
        counts = np.bincount(topics, minlength=self.topics)
        label = next(int(t) for t in topics if counts[t] == counts.max())  # ties: the first in the document
        if self.flat:
            record = document_record([np.concatenate(rows)], 1, self.sentences * self.max_len, label)
            return record | {"tokens": record["tokens"][0], "mask": record["mask"][0]}
        return document_record(rows, self.sentences, self.max_len, label)


TRANSDUCTIONS = ("reverse", "sort", "add")


@dataclasses.dataclass(frozen=True)
class Transduction:
    """String transduction, a sequence-to-sequence task (model task seq2seq) in one of
    three `operation`s on a source x of n symbols, n uniform in [min_symbols,
    max_symbols]:

    * `reverse`: y = x reversed;
    * `sort`: y = x sorted ascending;
    * `add`: x = `a + b`, two numbers in base `symbols` (each of n digits, n drawn per
      operand; no leading zero unless n = 1), most significant digit first; y = the
      digits of a + b, most significant first (n or n + 1 of them).

    Ids: 0 padding, 1 BOS, 2 EOS (`BOS`, `EOS`), 3 .. 2 + symbols the symbols (add: digit
    d is 3 + d), and for add 3 + symbols the `+`. The record (module docstring): the
    source as `tokens`/`mask`, `target` = BOS y EOS with `target_mask`, both padded to
    `max_len` (the model's max_len: the encoder reads max_len tokens, the decoder
    max_len - 1). `max_symbols` defaults to the longest that fits: max_len - 2 (reverse,
    sort: BOS y EOS), (max_len - 1) // 2 (add: a + b)."""

    seed: int
    size: int
    max_len: int = 16
    operation: str = "reverse"
    symbols: int = 10
    min_symbols: int = 1
    max_symbols: int | None = None

    model_task = "seq2seq"
    bos_id, eos_id = BOS, EOS

    @property
    def vocab_size(self) -> int:
        return 3 + self.symbols + (self.operation == "add")

    def _max_symbols(self) -> int:
        if self.max_symbols is not None:
            return self.max_symbols
        return (self.max_len - 1) // 2 if self.operation == "add" else self.max_len - 2

    def __post_init__(self):
        if self.operation not in TRANSDUCTIONS:
            raise ValueError(f"transduction: operation must be one of {TRANSDUCTIONS}; got {self.operation!r}")
        if self.symbols < 2 or self.size < 1:
            raise ValueError(f"transduction: need symbols >= 2 and size >= 1; got {self.symbols}, {self.size}")
        n = self._max_symbols()
        # the longest source and target (BOS y EOS) must fit max_len
        source, target = (2 * n + 1, n + 3) if self.operation == "add" else (n, n + 2)
        if not 1 <= self.min_symbols <= n or max(source, target) > self.max_len:
            raise ValueError(
                f"transduction ({self.operation}): need 1 <= min_symbols <= max_symbols and a source of "
                f"{source} and a target of {target} tokens (max_symbols {n}) to fit max_len; got min_symbols "
                f"{self.min_symbols}, max_symbols {n}, max_len {self.max_len}"
            )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, int(index)])
        draw = lambda: int(rng.integers(self.min_symbols, self._max_symbols() + 1))  # noqa: E731
        if self.operation == "add":
            a, b = (self._number(rng, draw()) for _ in range(2))
            source = [*a, self.symbols, *b]
            y = self._digits(self._value(a) + self._value(b))
        else:
            source = rng.integers(0, self.symbols, size=draw()).tolist()
            y = source[::-1] if self.operation == "reverse" else sorted(source)
        tokens, mask = _pad(np.asarray(source, np.int32) + 3, self.max_len)  # symbol s is id 3 + s
        target, target_mask = _pad(np.asarray([BOS, *(3 + d for d in y), EOS], np.int32), self.max_len)
        return {"tokens": tokens, "mask": mask, "target": target, "target_mask": target_mask}

    def _number(self, rng, n: int) -> list[int]:
        """n digits in base `symbols`, the first nonzero unless n = 1."""
        first = int(rng.integers(1 if n > 1 else 0, self.symbols))
        return [first, *rng.integers(0, self.symbols, size=n - 1).tolist()]

    def _value(self, digits: list[int]) -> int:
        value = 0
        for d in digits:
            value = value * self.symbols + d
        return value

    def _digits(self, value: int) -> list[int]:
        out = [value % self.symbols]
        while value >= self.symbols:
            value //= self.symbols
            out.append(value % self.symbols)
        return out[::-1]


TASKS = {
    "listops": ListOps,
    "pathfinder": Pathfinder,
    "copy": Copy,
    "recall": AssociativeRecall,
    "transduction": Transduction,
    "fashion_mnist": FashionMNIST,
    "shakespeare": ShakespeareBytes,
    "shakespeare_stream": ShakespeareStream,
    "shakespeare_genre": ShakespeareGenre,
    "documents": Documents,
    "shakespeare_scene": ShakespeareScene,
    "lra_text": LRAText,
    "lra_retrieval": LRARetrieval,
}


def make_source(task: str, *, split: str = "train", **kwargs):
    """The source of task `task` (a name in TASKS) with these settings; `split` ("train"
    or "valid") picks the files of real data sets (generated ones differ by seed)."""
    if task not in TASKS:
        raise ValueError(f"unknown data task {task!r}; known: {sorted(TASKS)}")
    cls = TASKS[task]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"data task {task!r}: unknown setting(s) {unknown}; known: {sorted(known)}")
    if "split" in kwargs:
        raise ValueError(f"data task {task!r}: the split is chosen by the trainer (train / valid), not a setting")
    if "split" in known:
        kwargs["split"] = split
    return cls(**kwargs)
