"""A checkpoint's own tokenizer (`tokenizer.json`, read by the `tokenizers` library) and
batch encoding to the fixed-length ids and masks jxformers models take."""

from __future__ import annotations

import pathlib

import numpy as np


def load_tokenizer(path: str | pathlib.Path):
    """The `tokenizers.Tokenizer` in `path` (a directory holding tokenizer.json, or the
    file itself)."""
    from tokenizers import Tokenizer

    path = pathlib.Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"no tokenizer.json at {path}; a converted BERT directory ships one "
            "(scripts/fetch_minilm.sh fetches MiniLM's)"
        )
    return Tokenizer.from_file(str(file))


def encode(tokenizer, texts: list[str], *, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids `[len(texts), max_len]` (int32; the tokenizer's special tokens, e.g.
    BERT's [CLS] ... [SEP], truncated to max_len, padded with its pad id) and the mask
    `[len(texts), max_len]` (True for real tokens). The tokenizer's own padding and
    truncation settings are replaced by these."""
    if max_len < 2:
        raise ValueError(f"{max_len=} must be >= 2 (room for the special tokens)")
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_len)
    tokenizer.enable_padding(length=max_len)
    out = tokenizer.encode_batch(list(texts))
    ids = np.array([e.ids for e in out], np.int32).reshape(len(out), max_len)
    mask = np.array([e.attention_mask for e in out], bool).reshape(len(out), max_len)
    return ids, mask
