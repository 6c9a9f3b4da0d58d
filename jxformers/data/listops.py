"""ListOps (Nangia & Bowman, 2018) with the Long Range Arena grammar: nested lists of
digits under the operators MIN, MAX, MED (median, truncated to an int) and SM (sum mod
10); max depth 10, 2 to 10 arguments per operator, and only expressions of more than
500 and fewer than 2000 tokens kept. The label is the expression's value (10 classes).

    >>> text, label = sample(seed=0, index=3)
    >>> text[:30]
    '[MAX 4 3 [MIN 2 3 ] 1 0 [SM ...'

A record depends only on (seed, index): it is drawn by rejection sampling from a
generator seeded with both, so any record can be produced alone, in any order, on any
process.
"""

from __future__ import annotations

import typing

import numpy as np

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
VOCAB = ("<pad>", *OPERATORS, "]", *(str(d) for d in range(10)))
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
NUM_CLASSES = 10
LEAF_PROBABILITY = 0.75  # LRA's VALUE_P = 0.25 is the chance of an operator below the root
MAX_DEPTH, MIN_ARGS, MAX_ARGS = 10, 2, 10
MIN_LENGTH, MAX_LENGTH = 500, 2000  # kept when MIN_LENGTH < tokens < MAX_LENGTH


class _TooLong(Exception):
    pass


# The hot path (`_median`, `_Draws`, `_draw`) is kept out of the tests' runtime type
# checker, which would wrap every call of it (5x slower records).
@typing.no_type_check
def _median(values):
    """int(statistics.median(values)) for non-negative ints, without the float."""
    s, n = sorted(values), len(values)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2


_APPLY = {"[MIN": min, "[MAX": max, "[MED": _median, "[SM": lambda v: sum(v) % 10}
_OPERATOR_IDS = [TOKEN_ID[op] for op in OPERATORS]
_APPLY_BY_INDEX = [_APPLY[op] for op in OPERATORS]
_CLOSE, _DIGIT0 = TOKEN_ID["]"], TOKEN_ID["0"]


# Raw 64-bit words fetched from the bit generator at a time.
_BLOCK = 4096


@typing.no_type_check
class _Draws:
    """`rng.random()` and `rng.integers(k)` of a fresh `np.random.default_rng` (PCG64),
    value for value, made in Python from raw words fetched in blocks: numpy's per-call
    overhead (about 1.6 us for `integers`) was most of the generator's time.

    As numpy's Generator does it: a double is the top 53 bits of one 64-bit word; a
    bounded integer is Lemire's method on 32-bit draws, each word giving its low half
    and keeping its high half for the next 32-bit draw. Words fetched beyond those used
    are never seen (each record has its own generator)."""

    def __init__(self, rng: np.random.Generator):
        self.bits, self.half = rng.bit_generator, None
        self._next = iter(()).__next__

    def _word(self):
        try:
            return self._next()
        except StopIteration:
            self._next = iter(self.bits.random_raw(_BLOCK).tolist()).__next__
            return self._next()

    def _uint32(self):
        if self.half is not None:
            value, self.half = self.half, None
            return value
        word = self._word()
        self.half = word >> 32
        return word & 0xFFFFFFFF

    def random(self):
        return (self._word() >> 11) * 2.0**-53

    def integers(self, k):
        """Uniform in [0, k) (k < 2**32)."""
        m = self._uint32() * k
        if m & 0xFFFFFFFF < k:  # rarely: reject the biased low end
            threshold = (0x100000000 - k) % k
            while m & 0xFFFFFFFF < threshold:
                m = self._uint32() * k
        return m >> 32


@typing.no_type_check
def _draw(draws: _Draws, max_depth: int, budget: int) -> tuple[list[int], int]:
    """One random expression as (token ids, value); the root is always an operator.

    A node is a leaf digit with LEAF_PROBABILITY (always at max_depth, never at the
    root), else an operator with 2-10 children. Token ids and the value are made in
    the same pass as the draws (no tree is built: this is the generator's hot loop).
    `budget` counts the tokens allowed: the draw is abandoned (_TooLong) as soon as it is
    spent, which leaves the distribution of accepted expressions unchanged and saves
    building the huge ones the length window would reject anyway.
    """
    ids: list[int] = []
    random, integers = draws.random, draws.integers
    left = budget

    def node(depth):
        nonlocal left
        left -= 1
        if left < 0:
            raise _TooLong
        if depth > 1 and (depth >= max_depth or random() < LEAF_PROBABILITY):
            digit = integers(10)
            ids.append(_DIGIT0 + digit)
            return digit
        left -= 1  # the closing bracket
        op = integers(len(OPERATORS))
        ids.append(_OPERATOR_IDS[op])
        values = [node(depth + 1) for _ in range(MIN_ARGS + integers(MAX_ARGS - MIN_ARGS + 1))]
        ids.append(_CLOSE)
        return _APPLY_BY_INDEX[op](values)

    value = node(1)
    return ids, value


def evaluate(tree) -> int:
    """The value of a tree (or of a token list via `parse`)."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    if op not in _APPLY:
        raise ValueError(f"unknown operator {op!r}")
    return _APPLY[op]([evaluate(c) for c in children])


def tokens(tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    op, children = tree
    return [op, *(t for c in children for t in tokens(c)), "]"]


def parse(text: str):
    """The tree of a space-separated expression (the inverse of `tokens`)."""
    stack: list = [("root", [])]
    for tok in text.split():
        if tok in OPERATORS:
            stack.append((tok, []))
        elif tok == "]":
            node = stack.pop()
            stack[-1][1].append(node)
        elif tok.isdigit() and len(tok) == 1:
            stack[-1][1].append(int(tok))
        else:
            raise ValueError(f"unknown ListOps token {tok!r}")
    if len(stack) != 1 or len(stack[0][1]) != 1:
        raise ValueError("unbalanced ListOps expression")
    return stack[0][1][0]


def sample_ids(
    seed: int, index: int, *, min_length: int = MIN_LENGTH, max_length: int = MAX_LENGTH, max_depth: int = MAX_DEPTH
) -> tuple[np.ndarray, int]:
    """Record `index` of the stream seeded by `seed`: `(ids, label)`, the expression's
    token ids (`int32`, ids of VOCAB) and its value, with min_length < len(ids) < max_length."""
    if not 0 <= min_length < max_length - 1:
        raise ValueError(f"need 0 <= min_length < max_length - 1; got {min_length}, {max_length}")
    draws = _Draws(np.random.default_rng([seed, index]))
    while True:
        try:
            ids, value = _draw(draws, max_depth, max_length - 1)
        except _TooLong:
            continue
        if min_length < len(ids) < max_length:
            return np.asarray(ids, np.int32), value


def sample(
    seed: int, index: int, *, min_length: int = MIN_LENGTH, max_length: int = MAX_LENGTH, max_depth: int = MAX_DEPTH
) -> tuple[str, int]:
    """`sample_ids` as text: `(text, label)`, the expression as space-separated tokens."""
    ids, value = sample_ids(seed, index, min_length=min_length, max_length=max_length, max_depth=max_depth)
    return " ".join(VOCAB[i] for i in ids), value


def encode(text: str) -> np.ndarray:
    try:
        return np.asarray([TOKEN_ID[t] for t in text.split()], np.int32)
    except KeyError as e:
        raise ValueError(f"unknown ListOps token {e.args[0]!r}; the vocabulary is {VOCAB}") from None
