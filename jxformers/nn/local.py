"""Local mixers that tell a transformer where each token is from its neighbours (Lin et
al. 2021, "A Survey of Transformers", arXiv 2106.04554, section 5.1: position
representations learned by a convolution or a recurrence):

* `PEG`: the position encoding generator of conditional positional encodings (Chu, Tian,
  Zhang, Wang, Wei, Xia & Shen 2021, "Conditional Positional Encodings for Vision
  Transformers", arXiv 2102.10882, section 3.2): x + DWConv(x), a depthwise convolution
  over the positions added residually; the zero padding at the borders is what lets it
  tell positions apart. Here 1-D over the sequence, centred (k odd) or causal (left
  padding k - 1) for a language model.
* `LocalRNN`: R-Transformer's local recurrence (Wang, Ma, Liu & Tang 2019,
  "R-Transformer: Recurrent Neural Network Enhanced Transformer", arXiv 1907.05572,
  section 3.1): before a block's attention, an RNN (GRU, LSTM or tanh) runs over the
  window of the M positions ending at each position (zero padded at the start), and its
  last hidden state replaces the token, with a residual connection and a LayerNorm.

Both read the rows of a padded sequence, so one function serves the parallel forward
(the sequence padded with zeros) and a decoding step (the last k - 1 or M - 1 inputs,
zeros until filled, then the new row): decoding holds exactly those rows
(`init_state`, `step`), and equals the causal parallel forward. Padded rows (mask False)
enter as zeros, as the border's padding does, so their values never reach a real row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers.nn.layers import Norm, make_norm

# The recurrent cells of R-Transformer's LocalRNN (the authors' code: GRU, LSTM, else a
# tanh RNN), and how many gate blocks each projects: (r, z, n), (i, f, g, o), (h).
CELLS = ("gru", "lstm", "rnn")
_GATES = {"gru": 3, "lstm": 4, "rnn": 1}


def _zero_padding(x, mask):
    """x with its padded rows (mask False) set to zero, NaN and inf included."""
    return x if mask is None else jnp.where(mask[:, None], x, jnp.zeros((), x.dtype))


def _windows_of(
    f: Callable[[Array], Array], x: Array, mask: Bool[Array, " n"] | None, before: int, after: int
) -> Array:
    """f of x with `before` zero rows in front and `after` behind (padded rows zeroed);
    f maps `[n + before + after, d]` to `[n, d]`."""
    return f(jnp.pad(_zero_padding(x, mask), ((before, after), (0, 0))))


def _window_step(f: Callable[[Array], Array], x: Array, state: Array) -> tuple[Array, Array]:
    """One decoding step of a causal windowed f: (f's row for x, the new state). `state`
    `[w - 1, d]` holds the inputs before x (zeros before the first), oldest first."""
    padded = jnp.concatenate([state, x[None].astype(state.dtype)])
    return f(padded)[0], padded[1:]


class PEG(eqx.Module):
    """CPE's position encoding generator (Chu et al. 2021, section 3.2, eq. 3 and its
    code's PosCNN): y_i = x_i + b + sum_t w_t * x_{i + t - k//2} (centred) or
    x_i + b + sum_t w_t * x_{i + t - (k - 1)} (causal), a depthwise convolution (one
    kernel `[k]` per feature, w `[k, d]`, bias b `[d]`) with zero padding, added to its
    input. Weights drawn as PyTorch's Conv default, U(±1/sqrt(k)) (fan-in k of a
    depthwise kernel), as the authors' code leaves them.

    Shapes: `__call__(x [n, d], mask [n])` -> `[n, d]`, padded rows (mask False) left as
    they are and read as zeros; `step(x [d], state [k - 1, d])` -> (`[d]`, state), causal
    only. Cost O(n k d).
    """

    weight: Float[Array, "kernel d"]
    bias: Float[Array, " d"]
    causal: bool = eqx.field(static=True)

    def __init__(self, dim: int, kernel_size: int, *, causal: bool, key: PRNGKeyArray):
        if kernel_size < 1 or (not causal and kernel_size % 2 == 0):
            raise ValueError(
                f"a PEG's kernel size k must be >= 1, and odd unless causal (k // 2 zeros on each side of a centred "
                f"kernel); got kernel_size={kernel_size}, {causal=}"
            )
        bound = 1 / math.sqrt(kernel_size)
        kw, kb = jax.random.split(key)
        self.weight = jax.random.uniform(kw, (kernel_size, dim), minval=-bound, maxval=bound)
        self.bias = jax.random.uniform(kb, (dim,), minval=-bound, maxval=bound)
        self.causal = causal

    @property
    def kernel_size(self) -> int:
        return self.weight.shape[0]

    def _conv(self, padded: Float[Array, "m d"]) -> Float[Array, "n d"]:
        k = self.kernel_size
        n = padded.shape[0] - k + 1
        w = self.weight.astype(padded.dtype)
        out = sum((padded[t : t + n] * w[t][None] for t in range(k)), self.bias.astype(padded.dtype)[None])
        return padded[k - 1 - self._after : k - 1 - self._after + n] + out  # the residual: x_i itself

    @property
    def _after(self) -> int:
        """Zero rows behind the sequence: k // 2 centred, none causal."""
        return 0 if self.causal else self.kernel_size // 2

    def __call__(self, x: Float[Array, "n d"], mask: Bool[Array, " n"] | None = None) -> Float[Array, "n d"]:
        k = self.kernel_size
        y = _windows_of(self._conv, x, mask, k - 1 - self._after, self._after)
        return y if mask is None else jnp.where(mask[:, None], y, x)

    def init_state(self, dtype: Any) -> Float[Array, "k1 d"]:
        """The decoding state: the k - 1 inputs before the next, zeros at the start."""
        return jnp.zeros((self.kernel_size - 1, self.weight.shape[1]), dtype)

    def step(self, x: Float[Array, " d"], state: Float[Array, "k1 d"]) -> tuple[Float[Array, " d"], Array]:
        """One token of the causal PEG: (its output, the new state)."""
        if not self.causal:
            raise ValueError("a centred PEG reads later positions: only a causal one decodes")
        y, state = _window_step(self._conv, x, state)
        return y.astype(x.dtype), state


class RNNCell(eqx.Module):
    """One recurrent cell in PyTorch's layout (what the authors' `nn.GRU`, `nn.LSTM` and
    `nn.RNN` compute), input and hidden size d, weights U(±1/sqrt(d)) as PyTorch draws
    them; the gates g = x W_ih^T + b_ih come apart from the recurrence so that a window's
    inputs are projected once per position, not once per window:

    * gru: r = σ(g_r + h W_hr^T + b_hr), z = σ(g_z + ...), n = tanh(g_n + r ⊙ (h W_hn^T
      + b_hn)), h' = (1 - z) ⊙ n + z ⊙ h;
    * lstm: i, f, o = σ(.), c~ = tanh(.) of g + h W_hh^T + b_hh; c' = f ⊙ c + i ⊙ c~,
      h' = o ⊙ tanh(c');
    * rnn: h' = tanh(g + h W_hh^T + b_hh).
    """

    w_ih: Float[Array, "gates d"]
    w_hh: Float[Array, "gates d"]
    b_ih: Float[Array, " gates"]
    b_hh: Float[Array, " gates"]
    kind: str = eqx.field(static=True)

    def __init__(self, kind: str, dim: int, *, key: PRNGKeyArray):
        if kind not in CELLS:
            raise ValueError(f"cell must be one of {CELLS}; got {kind!r}")
        bound, shape = 1 / math.sqrt(dim), (_GATES[kind] * dim, dim)
        k1, k2, k3, k4 = jax.random.split(key, 4)
        draw = lambda k, s: jax.random.uniform(k, s, minval=-bound, maxval=bound)  # noqa: E731
        self.w_ih, self.w_hh, self.b_ih, self.b_hh = (
            draw(k1, shape),
            draw(k2, shape),
            draw(k3, shape[:1]),
            draw(k4, shape[:1]),
        )
        self.kind = kind

    def gates(self, x: Float[Array, "n d"]) -> Float[Array, "n gates"]:
        """The input's part of the gates, x W_ih^T + b_ih, in float32."""
        return x.astype(jnp.float32) @ self.w_ih.T + self.b_ih[None]

    def update(self, g: Float[Array, "n gates"], carry: tuple[Array, Array]) -> tuple[Array, Array]:
        """(h, c) after one step from the gates' input part g (c: the LSTM's cell, else unused)."""
        h, c = carry
        r = h @ self.w_hh.T + self.b_hh[None]
        if self.kind == "rnn":
            return jnp.tanh(g + r), c
        if self.kind == "gru":
            (gr, gz, gn), (rr, rz, rn) = jnp.split(g, 3, -1), jnp.split(r, 3, -1)
            reset, keep = jax.nn.sigmoid(gr + rr), jax.nn.sigmoid(gz + rz)
            new = jnp.tanh(gn + reset * rn)
            return (1 - keep) * new + keep * h, c
        gi, gf, gg, go = jnp.split(g + r, 4, -1)
        c = jax.nn.sigmoid(gf) * c + jax.nn.sigmoid(gi) * jnp.tanh(gg)
        return jax.nn.sigmoid(go) * jnp.tanh(c), c

    def last_of_windows(self, padded: Float[Array, "m d"], window: int) -> Float[Array, "n d"]:
        """The hidden state after each window of `window` consecutive rows of `padded`
        (from h = c = 0): row i of the result reads rows i .. i + window - 1. Every window
        runs at once, one step per row of the window: O(n M d^2) for n = m - M + 1."""
        n, d = padded.shape[0] - window + 1, padded.shape[1]
        g = self.gates(padded)

        def step(carry, t):
            return self.update(jax.lax.dynamic_slice_in_dim(g, t, n), carry), None

        zeros = jnp.zeros((n, d), jnp.float32)
        (h, _), _ = jax.lax.scan(step, (zeros, zeros), jnp.arange(window))
        return h.astype(padded.dtype)


class LocalRNN(eqx.Module):
    """R-Transformer's LocalRNN sublayers of one block (Wang et al. 2019, section 3.1 and
    the authors' `LocalRNNLayer`), each a residual branch

        pre-norm (the authors' code):  x + dropout(LocalRNN(LN(x)))
        post-norm (the paper's text):  LN(x + dropout(LocalRNN(x)))

    where LocalRNN(h)_i is the last hidden state of a cell (`RNNCell`) run over h_{i-M+1},
    ..., h_i from a zero state, rows before the first taken as zeros (the code's zero
    padding): causal by construction, in encoders too (the paper's windows end at each
    position). The authors stack `layers` (their n) such sublayers before each block's
    attention, one cell each.

    Arguments (constructor): `dim`, `window` M, `cell` (one of CELLS), `layers`, `norm`
    (the block's norm kind) and `norm_eps`, `pre_norm`, `dropout` (on each branch's
    output, as the block's), `key`.

    Shapes: `__call__(x [n, d], mask [n])` -> `[n, d]` (padded rows read as zeros);
    `step(x [d], state)` -> (`[d]`, state), the state holding each sublayer's last M - 1
    inputs. Cost O(n M d^2) per sublayer.
    """

    cells: tuple[RNNCell, ...]
    norms: tuple[Norm, ...]
    dropout: eqx.nn.Dropout
    window: int = eqx.field(static=True)
    pre_norm: bool = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        *,
        window: int,
        cell: str,
        layers: int = 1,
        norm: str = "layernorm",
        norm_eps: float | None = None,
        pre_norm: bool = True,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        if window < 1 or layers < 1:
            raise ValueError(f"LocalRNN needs a window M >= 1 and layers >= 1; got {window=}, {layers=}")
        self.cells = tuple(RNNCell(cell, dim, key=k) for k in jax.random.split(key, layers))
        self.norms = tuple(make_norm(norm, dim, norm_eps) for _ in range(layers))
        self.dropout = eqx.nn.Dropout(dropout)
        self.window, self.pre_norm = window, pre_norm

    def _sublayer(self, i: int, x, rnn: Callable[[Array], Array], key, inference):
        h = self.norms[i](x) if self.pre_norm else x
        y = self.dropout(rnn(h), key=key, inference=inference)
        return x + y if self.pre_norm else self.norms[i](x + y)

    def __call__(
        self,
        x: Float[Array, "n d"],
        mask: Bool[Array, " n"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool = False,
    ) -> Float[Array, "n d"]:
        keys = [None] * len(self.cells) if key is None else list(jax.random.split(key, len(self.cells)))
        for i, (cell, k) in enumerate(zip(self.cells, keys, strict=True)):
            rnn = lambda h, cell=cell: _windows_of(self._last(cell), h, mask, self.window - 1, 0)  # noqa: E731
            x = self._sublayer(i, x, rnn, k, inference)
        return x

    def _last(self, cell: RNNCell) -> Callable[[Array], Array]:
        return lambda padded: cell.last_of_windows(padded, self.window)

    def init_state(self, max_len: int, dtype: Any) -> tuple[Float[Array, "m1 d"], ...]:
        """The decoding state: each sublayer's last M - 1 inputs, zeros at the start
        (`max_len` unused: the windows' width is M - 1 at any length; the argument is the
        pre-attention sublayers' common protocol, `Block`'s `local`)."""
        return tuple(jnp.zeros((self.window - 1, c.w_ih.shape[1]), dtype) for c in self.cells)

    def step(self, x: Float[Array, " d"], state: tuple[Array, ...]) -> tuple[Float[Array, " d"], tuple[Array, ...]]:
        """One token through the sublayers (inference): (its output, the new state)."""
        new = []  # each sublayer's shifted window, appended as its branch runs
        for i, (cell, buffer) in enumerate(zip(self.cells, state, strict=True)):

            def rnn(h, cell=cell, buffer=buffer):
                y, shifted = _window_step(self._last(cell), h, buffer)
                new.append(shifted)
                return y.astype(h.dtype)

            x = self._sublayer(i, x, rnn, None, True)
        return x, tuple(new)


class LocalState(eqx.Module):
    """A block's decoding state when it has sublayers before its attention (LocalRNN's,
    or Mask Attention Networks' DMAN): theirs (`windows`: the LocalRNN windows, the
    DMAN's key/value cache) and the self-attention's own state (`inner`)."""

    windows: Any
    inner: Any
