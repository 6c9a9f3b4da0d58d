"""Dense masks of the exact patterns, written from the papers' definitions with numpy
and independently of the ops (which never build an N x N mask). Each builder returns the
list of masks whose masked softmax attentions, applied in sequence to the values, equal
the op (one mask for every pattern but axial's row-then-column)."""

import numpy as np

from jxformers import ops


def _grid(n):
    return np.arange(n)[:, None], np.arange(n)[None, :]


def _causal(n, causal):
    i, j = _grid(n)
    return (j <= i) if causal else np.ones((n, n), bool)


def softmax(n, hp, arrays, causal):
    return [_causal(n, causal)]


chunked = softmax


def local(n, hp, arrays, causal):
    i, j = _grid(n)
    w = hp["window"]
    return [((i - j >= 0) & (i - j <= w)) if causal else (abs(i - j) <= w)]


def block_local(n, hp, arrays, causal):
    i, j = _grid(n)
    b = hp["block_size"]
    return [(i // b == j // b) & _causal(n, causal)]


def dilated(n, hp, arrays, causal):
    i, j = _grid(n)
    w, d = hp["window"], hp["dilation"]
    return [((i - j) % d == 0) & (abs(i - j) <= w * d) & _causal(n, causal)]


def sparse_transformer(n, hp, arrays, causal):
    i, j = _grid(n)
    s = hp["stride"]
    if hp.get("pattern", "strided") == "strided":
        m = (abs(i - j) < s) | ((i - j) % s == 0)
    else:
        c = hp.get("num_summary", 1)
        m = (j // s == i // s) | (j % s >= s - c)
    return [m & _causal(n, causal)]


def longformer(n, hp, arrays, causal):
    i, j = _grid(n)
    g = np.zeros(n, bool)
    g[list(hp["global_indices"])] = True
    d = hp["dilation"]
    window = ((i - j) % d == 0) & (abs(i - j) <= hp["window"] * d)
    return [(window | g[:, None] | g[None, :]) & _causal(n, causal)]


def bigbird(n, hp, arrays, causal):
    b = hp["block_size"]
    nb = -(-n // b)
    rnd = np.asarray(
        ops.bigbird_random_blocks(
            arrays["key"], n, block_size=b, num_random_blocks=hp["num_random_blocks"],
            num_window_blocks=hp["num_window_blocks"], num_global_blocks=hp["num_global_blocks"],
        )
    )
    g = hp["num_global_blocks"]
    glob = set(range(-(-g // 2))) | set(range(nb - g // 2, nb))
    blocks = np.zeros((nb, nb), bool)
    for a in range(nb):
        for c in range(nb):
            blocks[a, c] = abs(a - c) <= hp["num_window_blocks"] // 2 or a in glob or c in glob or c in rnd[a]
    i, j = _grid(n)
    return [blocks[i // b, j // b]]


def axial(n, hp, arrays, causal):
    i, j = _grid(n)
    w = hp["width"]
    row = (i // w == j // w) & _causal(n, causal)
    col = (i % w == j % w) & _causal(n, causal)
    order = hp.get("order", "row_then_column")
    return {"row": [row], "column": [col], "row_then_column": [row, col]}[order]
