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

import statistics

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


def _tree(rng: np.random.Generator, depth: int, max_depth: int, budget: list[int]):
    """A leaf digit, or (operator, [children]); the root is always an operator.
    `budget[0]` counts the tokens still allowed: generation stops (the draw is rejected)
    as soon as it is spent, which leaves the distribution of accepted trees unchanged
    and saves building the huge trees the length window would reject anyway."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooLong
    if depth > 1 and (depth >= max_depth or rng.random() < LEAF_PROBABILITY):
        return int(rng.integers(10))
    budget[0] -= 1  # the closing bracket
    op = OPERATORS[int(rng.integers(len(OPERATORS)))]
    return op, [_tree(rng, depth + 1, max_depth, budget) for _ in range(int(rng.integers(MIN_ARGS, MAX_ARGS + 1)))]


def evaluate(tree) -> int:
    """The value of a tree (or of a token list via `parse`)."""
    if isinstance(tree, int):
        return tree
    op, children = tree
    values = [evaluate(c) for c in children]
    if op == "[MIN":
        return min(values)
    if op == "[MAX":
        return max(values)
    if op == "[MED":
        return int(statistics.median(values))
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown operator {op!r}")


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


def sample(seed: int, index: int, *, min_length: int = MIN_LENGTH, max_length: int = MAX_LENGTH,
           max_depth: int = MAX_DEPTH) -> tuple[str, int]:
    """Record `index` of the stream seeded by `seed`: `(text, label)`, the expression
    as space-separated tokens and its value, with min_length < len(tokens) < max_length."""
    if not 0 <= min_length < max_length - 1:
        raise ValueError(f"need 0 <= min_length < max_length - 1; got {min_length}, {max_length}")
    rng = np.random.default_rng([seed, index])
    while True:
        try:
            tree = _tree(rng, 1, max_depth, [max_length - 1])
        except _TooLong:
            continue
        toks = tokens(tree)
        if min_length < len(toks) < max_length:
            return " ".join(toks), evaluate(tree)


def encode(text: str) -> np.ndarray:
    try:
        return np.asarray([TOKEN_ID[t] for t in text.split()], np.int32)
    except KeyError as e:
        raise ValueError(f"unknown ListOps token {e.args[0]!r}; the vocabulary is {VOCAB}") from None
