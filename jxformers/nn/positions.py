"""Position information (Lin et al. 2021, "A Survey of Transformers", arXiv 2106.04554,
section 5.1), one module per model:

* "sinusoidal" (Vaswani et al.) and "learned" absolute embeddings, added to the tokens;
  "scaled_sinusoidal" (Hua et al. 2022, FLASH): the sinusoids times one learned scalar;
* "rope" (rotary, Su et al.): q and k rotated by position inside every attention, before
  any feature map, so it composes with linear attention and Performer; `Rotary` holds
  how: its base, and a context extension by position interpolation (Chen et al. 2023) or
  NTK-aware scaling (bloc97 2023);
* "xpos" (Sun et al. 2022): rope with an exponential decay, q scaled up and k down by
  position (causal models only);
* "alibi" (Press et al.) and "t5" (Raffel et al. relative buckets): an additive bias on
  the attention logits, for attentions that take a bias (softmax);
* "tupe" (Ke et al. 2021, TUPE-A, optionally TUPE-R): the untied positional correlation of
  absolute positions, a logit bias computed once per forward (`UntiedPositions`), the
  content logits scaled by 1/sqrt(2d) inside each attention;
* "shaw" (Shaw et al. 2018), "transformer_xl" (Dai et al. 2019), "deberta" (He et al.
  2021): relative score terms each attention computes from its own queries (and keys),
  `jxformers.nn.relative`; what their layers share (`SharedTerms`) lives here;
* "floater" (Liu et al. 2020, FLOATER): each block's own position p^(n)(t_i) from one
  neural ODE (`jxformers.nn.floater.Floater`), solved once per forward and added to each
  block's attention input (`SharedTerms.flow`); the sinusoids are added to the tokens too,
  as the authors' code keeps fairseq's;
* "complex" (Wang et al. 2020, complex word embeddings): the token's embedding turned by
  position, r_j e^{i(ω_j pos + θ_j)} per complex feature (`complex_order`);
* "none".

Beside any of them (or alone, with "none"), conditional positional encodings (Chu et al.
2021, CPE): `Positions` holds the PEGs (`jxformers.nn.local.PEG`) that sit after the
blocks it names, and the models call `condition` there.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Real

from jxformers._arrays import rotate_pairs
from jxformers.kernels.alibi import Alibi
from jxformers.nn.floater import FLOATER_DELTA, FLOATER_STEPS, Floater
from jxformers.nn.layers import Linear, lookup
from jxformers.nn.local import PEG
from jxformers.nn.relative import INPUT_KINDS, RELATIVE_KINDS, SharedTerms

POSITION_KINDS = (
    "sinusoidal", "scaled_sinusoidal", "learned", "rope", "xpos", "alibi", "t5", "tupe", *RELATIVE_KINDS,
    *INPUT_KINDS, "complex", "none",
)  # fmt: skip
# Added once to the token embeddings (absolute), rotating q and k in every attention, or a
# logit bias computed from the positions alone (once per forward, shared by the layers);
# RELATIVE_KINDS: score terms each attention computes from its own queries and keys.
ADDED_KINDS = ("sinusoidal", "scaled_sinusoidal", "learned", "complex")  # complex: the token embedding turned
ROTARY_KINDS = ("rope", "xpos")
BIAS_KINDS = ("alibi", "t5", "tupe")
# TUPE-R's T5 buckets (Ke et al. 2021's code: 32 bins up to a distance of 128, T5's defaults).
T5_BUCKETS = 32
# How RoPE is stretched to a longer context (`Rotary.scaling`).
ROPE_SCALINGS = ("none", "linear", "ntk")


def sinusoidal(positions: Int[Array, " n"], dim: int) -> Float[Array, "n dim"]:
    """sin/cos embeddings: PE[p, 2i] = sin(p / 10000^(2i/dim)), PE[p, 2i+1] = cos(...)."""
    half = dim // 2
    freq = jnp.exp(-math.log(10000.0) * jnp.arange(half) / max(half, 1))
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]
    out = jnp.stack([jnp.sin(angle), jnp.cos(angle)], axis=-1).reshape(positions.shape[0], 2 * half)
    return jnp.pad(out, ((0, 0), (0, dim - 2 * half)))


def rotary(
    x: Float[Array, "n heads d"], positions: Real[Array, " n"], base: float = 10000.0
) -> Float[Array, "n heads d"]:
    """Rotate feature pairs (i, i + d/2) of each head by angle p * base^(-2i/d)
    (RoFormer, eq. 34, "rotate half" layout), so q_m . k_n depends on m - n only.
    Positions may be fractional (a shortened encoder's resampled grid)."""
    return _rotate(x, positions, base)


def _rotate(x, positions, base, scale=None):
    """`rotary`, each rotated pair then multiplied by `scale` `[n, d/2]` (xPos) if given."""
    return rotate_pairs(x, _rotation_table(positions, x.shape[-1], base, scale)).astype(x.dtype)


def _rotation_table(positions, d, base, scale=None):
    """(cos, sin) `[n, 2, d/2]` of the angles p * base^(-2i/d), times `scale` if given."""
    if d % 2:
        raise ValueError(f"rope needs an even head size; got d_head = {d}")
    freq = base ** (-jnp.arange(d // 2, dtype=jnp.float32) * 2 / d)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]  # [n, d/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if scale is not None:  # scaling cos and sin scales the rotated pair (torchscale's apply_rotary_pos_emb)
        cos, sin = cos * scale, sin * scale
    return jnp.stack([cos, sin], axis=1)


def xpos_zeta(d: int, gamma: float = 0.4) -> Float[Array, " half"]:
    """xPos's per-pair decay ζ_i = (i / (d/2) + γ) / (1 + γ), i < d/2 (Sun et al. 2022,
    section 3.2; torchscale's `(arange(0, d, 2) + 0.4 d) / (1.4 d)` with γ = 0.4): from
    γ/(1+γ) for the fastest-turning pair up to nearly 1 for the slowest."""
    return (jnp.arange(d // 2, dtype=jnp.float32) / (d / 2) + gamma) / (1 + gamma)


def xpos(
    x: Float[Array, "n heads d"],
    positions: Real[Array, " n"],
    *,
    downscale: bool,
    base: float = 10000.0,
    gamma: float = 0.4,
    scale_base: float = 512.0,
) -> Float[Array, "n heads d"]:
    """xPos (Sun et al. 2022, "A Length-Extrapolatable Transformer", arXiv 2212.10554,
    section 3.2): RoPE whose pair i is also scaled by ζ_i^(p/B) (queries) or ζ_i^(-p/B)
    (keys, `downscale`), ζ_i from `xpos_zeta`, B = `scale_base` (512). Then
    q_m . k_n = Σ_i Re[q̃_i k̃_i* e^{i(m-n)θ_i}] ζ_i^((m-n)/B): relative, and decaying
    with the distance m - n >= 0, which is what a causal attention sees.

    Positions are taken as they are (the paper's formula): the scales reach
    ζ_0^(∓p/B), e^(±1.25 p/512) at γ = 0.4, which ModelConfig bounds against the compute
    dtype (`xpos_max_len`). torchscale centres p on the middle of the sequence instead, the
    same logits for a whole sequence at once; a decoding cache needs one fixed origin.
    Layout: pairs (i, i + d/2) as `rotary` (torchscale pairs adjacent features, a fixed
    permutation of head features that the learned projections absorb)."""
    return _rotate(x, positions, base, _xpos_scale(x.shape[-1], positions, downscale, gamma, scale_base))


def _xpos_scale(d, positions, downscale, gamma, scale_base):
    """ζ_i^(±p/B) `[n, d/2]` (keys: `downscale`, the minus sign)."""
    sign = -1.0 if downscale else 1.0
    power = sign * positions.astype(jnp.float32) / scale_base  # [n]
    return jnp.exp(power[:, None] * jnp.log(xpos_zeta(d, gamma))[None, :])  # ζ^power, [n, d/2]


def xpos_max_len(dtype, *, gamma: float = 0.4, scale_base: float = 512.0) -> int:
    """The longest sequence whose xPos scales ζ_0^(∓p/B) stay within half the exponent
    range of `dtype` (e^(±44) in float32 and bfloat16, e^(±5.5) in float16), so that
    neither a key scaled up nor a query scaled down leaves the representable numbers."""
    half_range = math.log(float(jnp.finfo(dtype).max)) / 2
    return int(half_range * scale_base / math.log((1 + gamma) / gamma))


def ntk_base(base: float, factor: float, d: int) -> float:
    """NTK-aware scaled RoPE (bloc97 2023, "NTK-Aware Scaled RoPE allows LLaMA models to
    have extended (8k+) context size without any fine-tuning"): base' = base * s^(d/(d-2)).
    The slowest pair (i = d/2 - 1) then turns s times slower, as position interpolation
    would make it, while the fastest (i = 0) keeps its speed."""
    if d <= 2:
        raise ValueError(f"NTK-aware scaling changes the base by s^(d/(d-2)): it needs a head size d > 2; got {d=}")
    return base * factor ** (d / (d - 2))


@dataclasses.dataclass(frozen=True)
class Rotary:
    """How an attention turns q and k by position (hashable: a static setting of
    `Attention`). `kind` "rope" (Su et al., `rotary`) or "xpos" (Sun et al. 2022, `xpos`);
    `base` θ (each pair i turns by p θ^(-2i/d)).

    `scaling` stretches RoPE to a context s = `factor` times the one it was trained on:
    "linear", position interpolation (Chen et al. 2023, "Extending Context Window of Large
    Language Models via Positional Interpolation", arXiv 2306.15595, eq. 4: f'(x, m) =
    f(x, m L / L'), positions divided by s); "ntk", NTK-aware scaling (bloc97 2023,
    `ntk_base`: θ' = θ s^(d/(d-2)), positions unchanged). Both are the static forms, as
    Hugging Face transformers' rope_type "linear" and the NTK-aware proposal; its
    "dynamic" NTK recomputes θ from the current length, so keys cached at one length
    would meet queries turned by another base, and decoding would not equal the parallel
    forward: not offered. Scaling is for "rope" only (the papers scale RoPE; xPos's decay
    has no such rule).

    `xpos_gamma` γ and `xpos_scale_base` B: xPos's ζ_i = (i/(d/2) + γ)/(1 + γ) and the
    exponent p/B (the paper's 0.4 and 512). xPos is for causal attention only
    (`Attention` refuses it otherwise): with keys after the query, n > m, the factor
    ζ^((m-n)/B) grows with the distance instead of decaying.

    Shapes: `queries(x, positions)` and `keys(x, positions)` map `x [n, heads, d]` and
    `positions [n]` (fractional allowed) to `[n, heads, d]`; d must be even.
    """

    kind: str = "rope"
    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    xpos_gamma: float = 0.4
    xpos_scale_base: float = 512.0

    def __post_init__(self):
        if self.kind not in ROTARY_KINDS:
            raise ValueError(f"Rotary kind must be one of {ROTARY_KINDS}; got {self.kind!r}")
        if self.scaling not in ROPE_SCALINGS:
            raise ValueError(f"Rotary scaling must be one of {ROPE_SCALINGS}; got {self.scaling!r}")
        if not self.base > 1:
            raise ValueError(f"Rotary base θ must be > 1 (pair i turns by p θ^(-2i/d)); got base={self.base}")
        if (self.scaling == "none") != (self.factor == 1):
            raise ValueError(
                f"Rotary: a factor s > 1 goes with scaling 'linear' or 'ntk', and scaling 'none' with "
                f"factor 1; got scaling={self.scaling!r}, factor={self.factor}"
            )
        if not self.factor >= 1:
            raise ValueError(f"Rotary factor s = L'/L extends the context: it must be >= 1; got factor={self.factor}")
        if self.kind == "xpos" and self.scaling != "none":
            raise ValueError(f"Rotary scaling {self.scaling!r} stretches RoPE; xPos is not scaled: use kind 'rope'")
        if not (self.xpos_gamma > 0 and self.xpos_scale_base > 0):
            raise ValueError(
                f"Rotary xpos_gamma and xpos_scale_base must be > 0; got {self.xpos_gamma=}, {self.xpos_scale_base=}"
            )

    def _base(self, d: int) -> float:
        return ntk_base(self.base, self.factor, d) if self.scaling == "ntk" else self.base

    def _positions(self, positions):
        return positions / self.factor if self.scaling == "linear" else positions

    def _turn(self, x, positions, downscale: bool):
        return rotate_pairs(x, self.table(positions, x.shape[-1], keys=downscale)).astype(x.dtype)

    def table(self, positions: Real[Array, " n"], d: int, *, keys: bool) -> Float[Array, "n 2 half"]:
        """The (cos, sin) table `[n, 2, d/2]` that `queries` (or `keys`) turns features of
        size d with (`jxformers._arrays.rotate_pairs`), xPos's scale included: what a
        kernelized op takes to turn its features after the feature map (RoFormer eq. 19)."""
        if self.kind == "xpos":
            scale = _xpos_scale(d, positions, keys, self.xpos_gamma, self.xpos_scale_base)
            return _rotation_table(positions, d, self.base, scale)
        return _rotation_table(self._positions(positions), d, self._base(d))

    def queries(self, x: Float[Array, "n heads d"], positions: Real[Array, " n"]) -> Float[Array, "n heads d"]:
        """Queries turned (and, for xPos, scaled by ζ^(p/B))."""
        return self._turn(x, positions, downscale=False)

    def keys(self, x: Float[Array, "n heads d"], positions: Real[Array, " n"]) -> Float[Array, "n heads d"]:
        """Keys turned (and, for xPos, scaled by ζ^(-p/B))."""
        return self._turn(x, positions, downscale=True)


def alibi_slopes(heads: int) -> Float[Array, " heads"]:
    """ALiBi's head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for the
    nearest power of two n <= heads, interleaved with the 2n sequence for the rest."""

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(heads))
    slopes = power_of_two(n) + power_of_two(2 * n)[0::2][: heads - n]
    return jnp.asarray(slopes, jnp.float32)


def t5_buckets(relative: Int[Array, " ..."], *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128):
    """T5's bucket of relative position (key - query): exact buckets for small
    distances, logarithmic ones up to `max_distance`; separate buckets for the future
    when bidirectional."""
    n = -relative
    bucket = jnp.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (n < 0) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    exact = num_buckets // 2
    large = exact + (
        jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    ).astype(n.dtype)
    return bucket + jnp.where(n < exact, n, jnp.minimum(large, num_buckets - 1))


def complex_order(
    z: Float[Array, "n dim"], frequency: Float[Array, "n half"], positions: Real[Array, " n"]
) -> Float[Array, "n dim"]:
    """Wang et al. 2020 ("Encoding word order in complex embeddings", ICLR, eq. 5):
    f(j, pos) = r_j e^{i(ω_j pos + θ_j)} per complex feature k < D = dim / 2, its real
    parts in features k and its imaginary parts in features k + D (the layout `rotary`
    turns). `z` holds each token's r_j e^{iθ_j} the same way (the real part in feature k,
    the imaginary in k + D: the embedding at position 0), `frequency` its ω_j; the result
    is z times e^{i ω_j pos}, computed in float32."""
    half = z.shape[-1] // 2
    angle = frequency.astype(jnp.float32) * positions.astype(jnp.float32)[:, None]
    re, im = z[:, :half].astype(jnp.float32), z[:, half:].astype(jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    return jnp.concatenate([re * cos - im * sin, re * sin + im * cos], -1).astype(z.dtype)


def complex_frequencies(vocab_size: int, dim: int) -> Float[Array, "vocab half"]:
    """The start of "complex"'s ω: every word's feature k turns at 10000^(-k/D), D = dim / 2,
    the sinusoids' frequencies (the authors' code starts ω from the sinusoid table)."""
    half = dim // 2
    return jnp.broadcast_to(10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half), (vocab_size, half))


def scaled_sinusoidal_gain(dim: int) -> Float[Array, ""]:
    """The start of "scaled_sinusoidal"'s learned scalar g: 1/sqrt(d_model) (Hua et al. 2022,
    "Transformer Quality in Linear Time" (FLASH), arXiv 2202.10447, its position embedding
    ScaledSin: the sinusoids times one learned scalar). The start 1/sqrt(d) is the one of
    x-transformers' `ScaledSinusoidalEmbedding`; lucidrains' FLASH-pytorch starts g at 1."""
    return jnp.asarray(1 / math.sqrt(dim), jnp.float32)


class UntiedPositions(eqx.Module):
    """TUPE's positional correlation (Ke, He & Liu 2021, "Rethinking Positional Encoding in
    Language Pre-training", arXiv 2006.15595, eq. 7, 9-11): per head h,

        b_h[i, j] = reset_θ((p_i U^Q_h)(p_j U^K_h)^T / sqrt(2d) [+ T5's b_{j-i}], i, j)

    with p `[max_len, d_model]` learned absolute embeddings shared by the heads (never
    added to the tokens), U^Q, U^K (d_model -> heads * d, d = d_model / heads) shared by
    every layer, as the paper's section 3.3 shares them: the correlation is computed once
    per forward and added to each layer's content logits, which those scale by 1/sqrt(2d)
    (`jxformers.nn.relative`). With a [CLS] token at position `cls_position`, reset_θ puts θ1_h on
    its row (CLS to every token, itself included) and θ2_h on its column (every other token
    to CLS), eq. 9; θ per head, started at 0. `relative`: TUPE-R's per-head T5 bias
    `[32, heads]` (eq. 11; 32 buckets up to 128, bidirectional unless `causal`), added
    before the reset; None: TUPE-A.

    Not as the authors' code: it normalises p by a LayerNorm before U^Q and U^K and draws
    θ1, θ2 as p_0 U^Q . p_0 U^K and p_1 U^Q . p_1 U^K of two extra positions; we follow
    the paper's formula (no norm, θ its own parameters). Memory: `[heads, q, kv]`,
    O(h n^2), once per forward (not per layer)."""

    table: Float[Array, "max_len d_model"]
    u_q: Linear
    u_k: Linear
    theta: Float[Array, "2 heads"]
    relative: Float[Array, "buckets heads"] | None
    heads: int = eqx.field(static=True)
    cls_position: int | None = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(
        self,
        *,
        dim: int,
        heads: int,
        max_len: int,
        causal: bool,
        cls_position: int | None,
        relative: bool,
        key: PRNGKeyArray,
    ):
        if dim % heads:
            raise ValueError(f"tupe splits U^Q, U^K into heads of d_model / heads: {dim=} must divide by {heads=}")
        kp, kq, kk, kr = jax.random.split(key, 4)
        self.table = 0.02 * jax.random.normal(kp, (max_len, dim))
        self.u_q = Linear(dim, dim, use_bias=False, key=kq)
        self.u_k = Linear(dim, dim, use_bias=False, key=kk)
        self.theta = jnp.zeros((2, heads), jnp.float32)
        self.relative = 0.02 * jax.random.normal(kr, (T5_BUCKETS, heads)) if relative else None
        self.heads, self.cls_position, self.causal = heads, cls_position, causal

    def __call__(self, q_pos: Real[Array, " q"], kv_pos: Real[Array, " kv"]) -> Float[Array, "heads q kv"]:
        qi, ki = jnp.round(q_pos).astype(jnp.int32), jnp.round(kv_pos).astype(jnp.int32)
        d = self.table.shape[1] // self.heads
        pq = self.u_q(self.table[qi]).reshape(qi.shape[0], self.heads, d)
        pk = self.u_k(self.table[ki]).reshape(ki.shape[0], self.heads, d)
        corr = jnp.einsum("qhd,khd->hqk", pq, pk) / math.sqrt(2 * d)
        if self.relative is not None:  # TUPE-R: T5's b_{j-i}, before the reset (eq. 11)
            buckets = t5_buckets(ki[None, :] - qi[:, None], bidirectional=not self.causal)
            corr = corr + jnp.moveaxis(self.relative[buckets], -1, 0)
        if self.cls_position is None:
            return corr
        from_cls, to_cls = qi == self.cls_position, ki == self.cls_position  # eq. 9: the CLS row first, then its column
        corr = jnp.where(to_cls[None, None, :], self.theta[1][:, None, None], corr)
        return jnp.where(from_cls[None, :, None], self.theta[0][:, None, None], corr)


class Positions(eqx.Module):
    """The model's position scheme: absolute embeddings to add, and/or a logit bias.
    (Rotary kinds, "rope" and "xpos", act inside the attentions: `Rotary`.)

    Fields: `kind` (one of POSITION_KINDS), `table` (learned embeddings `[max_len,
    d_model]`, T5's bucket table `[num_buckets, heads]`, or "complex"'s frequencies ω
    `[vocab, d_model / 2]`), `gain` ("scaled_sinusoidal"'s
    learned scalar g: PE[p] g), `untied` (TUPE's positional correlation), `shared` (what
    the layers of a relative kind share: Transformer-XL's u and v, DeBERTa's P), `floater`
    (FLOATER's dynamics and every block's start), `causal`.
    "xpos" needs `causal` (see `Rotary`).

    Arguments beyond the fields' own: `d_head` (the attentions' head size: Transformer-XL's
    u and v; default dim // heads), `max_distance` (k of "deberta"'s 2k buckets), `cls_position`
    (the [CLS] token's position, for TUPE's reset; None: no CLS token), `tupe_relative`
    (TUPE-R), `position_buckets` (b > 0: "deberta" with v2's log buckets, P of 2b rows),
    `layers`, `floater_delta`, `floater_steps` ("floater": the blocks, Δ and the RK4 steps
    per Δ), `vocab_size` ("complex": a frequency row per word), `cpe_kernel` and
    `cpe_after`: conditional positional encodings, a `PEG` of kernel size `cpe_kernel`
    after each block index of `cpe_after` (-1: on the embeddings, before block 0; Chu et
    al. 2021 put one after the first block, 0), causal with `causal` (`pegs`, in that
    order; none by default).
    """

    kind: str = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    table: Float[Array, "rows cols"] | None
    gain: Float[Array, ""] | None
    untied: UntiedPositions | None
    shared: SharedTerms | None
    floater: Floater | None
    pegs: tuple[PEG, ...]
    peg_after: tuple[int, ...] = eqx.field(static=True)

    def __init__(
        self,
        kind: str,
        *,
        dim: int,
        heads: int,
        max_len: int,
        causal: bool,
        key: PRNGKeyArray,
        d_head: int | None = None,
        max_distance: int = 0,
        cls_position: int | None = None,
        tupe_relative: bool = False,
        position_buckets: int = 0,
        layers: int = 0,
        floater_delta: float = FLOATER_DELTA,
        floater_steps: int = FLOATER_STEPS,
        vocab_size: int = 0,
        cpe_kernel: int | None = None,
        cpe_after: tuple[int, ...] = (),
    ):
        if kind not in POSITION_KINDS:
            raise ValueError(f"position must be one of {POSITION_KINDS}; got {kind!r}")
        if kind == "xpos" and not causal:
            raise ValueError(
                "position 'xpos' decays q.k by ζ^((m-n)/B) for keys n before the query m: it needs causal "
                "attention (keys after the query would be scaled up with the distance); got causal=False"
            )
        self.kind, self.causal, self.dim, self.heads = kind, causal, dim, heads
        if kind == "complex" and (dim % 2 or vocab_size < 1):
            raise ValueError(
                f"position 'complex' turns D = d_model / 2 complex features of each word: it needs an even d_model "
                f"and vocab_size >= 1; got d_model={dim}, {vocab_size=}"
            )
        if kind == "learned":
            self.table = 0.02 * jax.random.normal(key, (max_len, dim))
        elif kind == "t5":
            self.table = 0.02 * jax.random.normal(key, (T5_BUCKETS, heads))
        elif kind == "complex":
            self.table = complex_frequencies(vocab_size, dim)
        else:
            self.table = None
        self.gain = scaled_sinusoidal_gain(dim) if kind == "scaled_sinusoidal" else None
        self.untied = None
        if kind == "tupe":
            self.untied = UntiedPositions(
                dim=dim,
                heads=heads,
                max_len=max_len,
                causal=causal,
                cls_position=cls_position,
                relative=tupe_relative,
                key=key,
            )
        elif tupe_relative or cls_position is not None:
            raise ValueError(
                f"tupe_relative and cls_position (TUPE's [CLS] reset) go with position 'tupe'; got {kind!r}"
            )
        if kind == "deberta" and max_distance < 1:
            raise ValueError(f"position 'deberta' needs max_distance k >= 1 (its 2k buckets); got {max_distance}")
        self.shared = SharedTerms.make(
            kind, heads=heads, d_head=dim // heads if d_head is None else d_head, d_model=dim,
            max_distance=max_distance, position_buckets=position_buckets, key=key,
        )  # fmt: skip
        self.floater = None
        if kind in INPUT_KINDS:
            self.floater = Floater(layers=layers, dim=dim, delta=floater_delta, steps=floater_steps, key=key)
        if (cpe_kernel is None) != (not cpe_after) or len(set(cpe_after)) != len(cpe_after):
            raise ValueError(
                f"conditional positions take a kernel size and distinct block indices together; got {cpe_kernel=}, "
                f"{cpe_after=}"
            )
        self.pegs = tuple(
            PEG(dim, cpe_kernel or 1, causal=causal, key=jax.random.fold_in(key, 100 + i))
            for i in range(len(cpe_after))
        )
        self.peg_after = tuple(cpe_after)

    @property
    def rope(self) -> bool:
        """Whether the attentions turn q and k by position (rope, xpos)."""
        return self.kind in ROTARY_KINDS

    def embed(self, positions: Int[Array, " n"]) -> Float[Array, "n dim"] | None:
        """What to add to the token embeddings (None: nothing). FLOATER's: the sinusoids
        (the authors' code keeps fairseq's sinusoidal embedding beside the ODE)."""
        if self.kind in ("sinusoidal", *INPUT_KINDS):
            return sinusoidal(positions, self.dim)
        if self.kind == "scaled_sinusoidal":
            assert self.gain is not None
            return sinusoidal(positions, self.dim) * self.gain
        if self.kind == "learned":
            assert self.table is not None
            return self.table[positions]
        return None

    def modulate(
        self, x: Float[Array, "n dim"], tokens: Int[Array, " n"], positions: Real[Array, " n"]
    ) -> Float[Array, "n dim"]:
        """The token embeddings as position turns them: "complex" (`complex_order`, each
        token's ω), x itself for the other kinds."""
        if self.kind != "complex":
            return x
        assert self.table is not None
        return complex_order(x, lookup(self.table, tokens), positions)

    def grid_bias(self, n: int) -> Float[Array, "heads n n"] | Alibi | SharedTerms | None:
        """The bias of self-attention over positions 0..n-1: ALiBi as an `Alibi` (slopes
        only: the flash kernel computes it per tile, the XLA op materialises it), T5 and
        TUPE as an array, the shared part of a relative kind (`SharedTerms`, which each
        attention completes), else None."""
        if self.kind in RELATIVE_KINDS:
            return self.shared
        if self.floater is not None:  # every block's p^(n)(t_i), i < n: solved once per forward
            return SharedTerms(flow=self.floater.grid(n))
        if self.kind == "alibi":
            return Alibi(alibi_slopes(self.heads))
        if self.kind not in BIAS_KINDS:
            return None
        pos = jnp.arange(n)
        return self.bias(pos, pos)

    def bias(
        self, q_pos: Real[Array, " q"], kv_pos: Real[Array, " kv"]
    ) -> Float[Array, "heads q kv"] | SharedTerms | None:
        """The additive logit bias for these query and key positions (None: none; the
        shared part of a relative kind, which each attention completes with its own q, k
        and these positions). Positions may be fractional (a shortened encoder's resampled
        grid): ALiBi takes the distance as it is, T5 its nearest integer (its buckets are
        of integers)."""
        if self.kind in RELATIVE_KINDS:
            return self.shared
        if self.kind in INPUT_KINDS:
            raise ValueError(
                f"position {self.kind!r} is solved on the integer grid 0..n-1 (grid_bias); these positions "
                "are not on it (ModelConfig refuses filters with it)"
            )
        if self.kind == "tupe":
            assert self.untied is not None
            return self.untied(q_pos, kv_pos)
        rel = kv_pos[None, :] - q_pos[:, None]
        if self.kind == "alibi":
            return -alibi_slopes(self.heads)[:, None, None] * jnp.abs(rel)[None].astype(jnp.float32)
        if self.kind == "t5":
            assert self.table is not None
            rel = jnp.round(rel).astype(jnp.int32)
            return jnp.moveaxis(self.table[t5_buckets(rel, bidirectional=not self.causal)], -1, 0)
        return None

    def condition(
        self, after: int, x: Float[Array, "n dim"], mask: Bool[Array, " n"] | None, *, skip: int = 0
    ) -> Float[Array, "n dim"]:
        """x after block `after` (-1: the embeddings) through its PEG, if one sits there;
        the first `skip` rows (a CLS token, memory tokens, registers) pass by, as CPVT
        keeps its class token out of the convolution."""
        if after not in self.peg_after:
            return x
        peg = self.pegs[self.peg_after.index(after)]
        body = peg(x[skip:], None if mask is None else mask[skip:])
        return jnp.concatenate([x[:skip], body]) if skip else body

    def init_peg_states(self, dtype) -> tuple[Array, ...]:
        """Each PEG's decoding state (its last k - 1 inputs, zeros at the start)."""
        return tuple(peg.init_state(dtype) for peg in self.pegs)

    def condition_step(
        self, after: int, x: Float[Array, " dim"], states: tuple[Array, ...]
    ) -> tuple[Float[Array, " dim"], tuple[Array, ...]]:
        """`condition` for one token of a causal model: (x, the PEGs' states)."""
        if after not in self.peg_after:
            return x, states
        i = self.peg_after.index(after)
        y, state = self.pegs[i].step(x, states[i])
        return y, states[:i] + (state,) + states[i + 1 :]
