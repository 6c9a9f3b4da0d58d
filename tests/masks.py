"""Dense masks of the exact patterns, written from the papers' definitions with numpy
and independently of the ops (which never build an N x N mask). Each builder returns the
list of masks whose masked softmax attentions, applied in sequence to the values, equal
the op (one mask for every pattern but axial's row-then-column). An entry may instead be a
step `step(attend, values) -> values`, `attend(mask, values)` the reference masked
softmax, for a composition that is not a plain sequence (axial's causal one)."""

import jax.numpy as jnp
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
            arrays["key"],
            n,
            block_size=b,
            num_random_blocks=hp["num_random_blocks"],
            num_window_blocks=hp["num_window_blocks"],
            num_global_blocks=hp["num_global_blocks"],
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
    if causal and order == "row_then_column":  # Ho et al. 2019, sections 3-4
        above = (i % w == j % w) & (j // w < i // w)  # the column, rows above only (the shift down one row)

        def axial_transformer(attend, values):
            context = attend(above, attend(i // w == j // w, values))  # the unmasked row, then the rows above
            return attend(row, jnp.repeat(values, context.shape[1] // values.shape[1], axis=1) + context)

        return [axial_transformer]
    return {"row": [row], "column": [col], "row_then_column": [row, col]}[order]


def image_local_2d(n, hp, arrays, causal):
    """Parmar et al. 2018, section 3.2, from the image's geometry: pixels in block raster
    order (query blocks of h_q x w_q in raster order, raster order inside a block); the
    memory block of a query block is the block extended h_m rows up and w_m columns
    left and right; masked (causal) attention keeps the pixels not after the query."""
    w, qh, qw = hp["width"], hp["query_height"], hp["query_width"]
    mh, mw = hp["memory_height"], hp["memory_width"]
    rows = -(-n // (qh * w)) * qh
    pixels = []  # (row, column, block row, block column) in generation order
    for br in range(rows // qh):
        for bc in range(w // qw):
            for r in range(qh):
                for c in range(qw):
                    pixels.append((br * qh + r, bc * qw + c, br, bc))
    pixels = np.array(pixels[:n])
    row, col = pixels[:, 0], pixels[:, 1]
    top, left = pixels[:, 2] * qh, pixels[:, 3] * qw
    m = (
        (row[None, :] >= top[:, None] - mh)
        & (row[None, :] < top[:, None] + qh)
        & (col[None, :] >= left[:, None] - mw)
        & (col[None, :] < left[:, None] + qw + mw)
    )
    return [m & _causal(n, causal)]


def etc(n, hp, arrays, causal):
    """ETC's four pieces (Ainslie et al. 2020, section 3.1) over [global | long]: g2g all,
    g2l all (hard: the global token's segment), l2g all (hard: the long token's own
    global token), l2l within the local radius; segments of `global_every` long tokens."""
    assert not causal, "ETC has no causal form"
    g, r = hp["num_global"], hp["local_radius"]
    long_ = np.arange(n - g)
    own = (long_ // hp["global_every"])[:, None] == np.arange(g)[None, :]  # [long, global]
    m = np.zeros((n, n), bool)
    m[:g, :g] = True
    m[:g, g:] = own.T if hp["hard_g2l"] else True
    m[g:, :g] = own if hp["hard_l2g"] else True
    m[g:, g:] = abs(long_[:, None] - long_[None, :]) <= r
    return [m]


def criss_cross(n, hp, arrays, causal):
    """CCNet (Huang et al. 2019, section 3.1): a grid position's row and column, itself
    once (a mask has no multiplicity); R applications of the same map are R masks."""
    i, j = _grid(n)
    w = hp["width"]
    m = ((i // w == j // w) | (i % w == j % w)) & _causal(n, causal)
    return [m] * hp.get("recurrence", 1)


def random(n, hp, arrays, causal):
    """BigBird's random part alone (Zaheer et al. 2020): query block a reads the key blocks
    drawn for it (one draw shared by the heads: `per_head=False`), nothing else."""
    assert not causal and not hp["per_head"], "one mask for every head: the shared draw"
    b = hp["block_size"]
    nb = -(-n // b)
    rnd = np.asarray(
        ops.random_attention_blocks(
            arrays["key"],
            n,
            heads=1,
            block_size=b,
            num_random_blocks=hp["num_random_blocks"],
            num_window_blocks=hp["num_window_blocks"],
            num_global_blocks=hp["num_global_blocks"],
            per_head=False,
        )
    )[0]
    blocks = np.zeros((nb, nb), bool)
    for a in range(nb):
        for c in rnd[a]:
            if c >= 0:
                blocks[a, c] = True
    i, j = _grid(n)
    return [blocks[i // b, j // b]]
