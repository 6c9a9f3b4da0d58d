"""TokenLearner and TokenFuser (Ryoo et al. 2021, "TokenLearner: What Can 8 Learned
Tokens Do for Images and Videos?"): modules between transformer blocks, not attentions.

TokenLearner (section 3.1, eq. 1) turns N tokens X into k learned tokens, each a
weighted pooling of X under its own spatial attention map: z_i = rho(X * gamma(alpha_i(X))),
alpha_i a small network of X (here LayerNorm then a two-layer GELU MLP with k outputs,
the MLP form of the authors' code), gamma the sigmoid and rho the average over the
tokens; `maps="softmax"` is the authors' TokenLearner v1.1 instead: a softmax over the
tokens, so each map sums to one and z_i is a weighted average.

TokenFuser (section 3.2) maps the k tokens Y that a block processed back to the N
positions: Y <- (Y^T M)^T, a learned k x k mixing over the tokens, then
X_{j+1} = B_w Y + X_j with B_w = sigmoid(beta(X_j)) `[N, k]`, beta a linear layer of
the block's input (after a LayerNorm, as the authors' code), so TokenLearner can sit in
every block from some depth on.

`TokenLearnerStage` is what `Encoder` holds (ModelConfig's `stack.token_learner`, a `TokenLearnerConfig`): with
`fuse=False` one TokenLearner after block `after_layer` and the later blocks run on the k
tokens (the paper's ViT setting, TokenLearner after a fraction of the layers); with
`fuse=True` every later block runs TokenLearner -> block -> TokenFuser, each with its
own parameters, and the sequence keeps its length.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from jxformers.nn.layers import LayerNorm, Linear
from jxformers.validate import check_fields, defaults, setting

MAP_KINDS = ("sigmoid", "softmax")


class TokenLearner(eqx.Module):
    """N tokens -> k learned tokens (Ryoo et al. 2021, eq. 1).

    `maps(x, mask)` gives the k attention maps `[k, N]` (zero at padded tokens):
    sigmoid values in (0, 1) ("sigmoid", the paper's gamma) or a softmax over the real
    tokens ("softmax", the authors' v1.1). `__call__(x, mask)` -> `[k, d_model]`: the
    maps' average of x over the real tokens (sigmoid) or their weighted sum (softmax).
    Time O(N * (d_model * bottleneck + k * d_model)).
    """

    norm: LayerNorm
    hidden: Linear
    out: Linear
    kind: str = eqx.field(static=True)

    def __init__(
        self, d_model: int, num_tokens: int, *, bottleneck: int = 64, maps: str = "sigmoid", key: PRNGKeyArray
    ):
        if maps not in MAP_KINDS:
            raise ValueError(f"token learner maps must be one of {MAP_KINDS}; got {maps!r}")
        k1, k2 = jax.random.split(key)
        self.norm = LayerNorm(d_model)
        self.hidden, self.out = Linear(d_model, bottleneck, key=k1), Linear(bottleneck, num_tokens, key=k2)
        self.kind = maps

    def maps(self, x: Float[Array, "n d_model"], mask: Bool[Array, " n"] | None = None) -> Float[Array, "k n"]:
        real = jnp.ones(x.shape[:1], bool) if mask is None else mask
        logits = self.out(jax.nn.gelu(self.hidden(self.norm(x)))).astype(jnp.float32).T  # [k, n]
        if self.kind == "sigmoid":
            return jnp.where(real[None, :], jax.nn.sigmoid(logits), 0.0)
        peak = jax.lax.stop_gradient(jnp.max(jnp.where(real[None, :], logits, -jnp.inf), axis=-1, keepdims=True))
        exp = jnp.where(real[None, :], jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0)), 0.0)
        total = exp.sum(-1, keepdims=True)
        return exp / jnp.where(total > 0, total, 1.0)  # every token padded: zero maps

    def __call__(
        self, x: Float[Array, "n d_model"], mask: Bool[Array, " n"] | None = None
    ) -> Float[Array, "k d_model"]:
        weights = self.maps(x, mask)
        if self.kind == "sigmoid":  # rho: the average over the real tokens
            count = x.shape[0] if mask is None else jnp.maximum(mask.sum(), 1)
            weights = weights / count
        return (weights @ x.astype(jnp.float32)).astype(x.dtype)


class TokenFuser(eqx.Module):
    """k processed tokens -> N positions (Ryoo et al. 2021, section 3.2): the tokens
    mixed by a learned k x k matrix, then spread over the positions by
    B_w = sigmoid(beta(LayerNorm(original))) `[N, k]`. Returns B_w Y `[N, d_model]` (the
    caller adds the residual X_j)."""

    mix: Linear
    norm: LayerNorm
    remap: Linear

    def __init__(self, d_model: int, num_tokens: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.mix = Linear(num_tokens, num_tokens, use_bias=False, key=k1)
        self.norm, self.remap = LayerNorm(d_model), Linear(d_model, num_tokens, key=k2)

    def __call__(
        self, tokens: Float[Array, "k d_model"], original: Float[Array, "n d_model"]
    ) -> Float[Array, "n d_model"]:
        mixed = self.mix(tokens.T).T  # over the tokens, not the channels
        spread = jax.nn.sigmoid(self.remap(self.norm(original)).astype(jnp.float32))  # [n, k]
        return (spread @ mixed.astype(jnp.float32)).astype(original.dtype)


@typing.no_type_check  # values come from users' YAML: check_fields names the key instead
@dataclasses.dataclass(frozen=True)
class TokenLearnerConfig:
    """TokenLearner in an encoder stack (`stack: {kind: transformer, token_learner:
    {after_layer: 1, num_tokens: 8}}`): the `TokenLearnerStage` constructor's settings,
    declared once here (its keyword defaults read them)."""

    after_layer: int = setting(doc="the encoder block after which the tokens become learned ones (required)")
    num_tokens: int = setting(doc="k, the learned tokens (required)")
    fuse: bool = setting(False, "a TokenLearner and TokenFuser around every later block instead of one learner")
    maps: str = setting(
        "sigmoid", "the maps: sigmoid (the paper's gamma) or softmax (the authors' v1.1)", choices=MAP_KINDS
    )
    bottleneck: int = setting(64, "hidden width of the map MLP")

    def __post_init__(self):
        check_fields(self, "token_learner.")
        for name in ("num_tokens", "bottleneck"):
            if getattr(self, name) < 1:
                raise ValueError(f"token_learner.{name} must be >= 1; got {getattr(self, name)}")
        if self.after_layer < 0:
            raise ValueError(f"token_learner.after_layer must be a block index >= 0; got {self.after_layer}")

    def check_layers(self, num_layers: int) -> None:
        """At least one block must run on the learned tokens."""
        if not 0 <= self.after_layer < num_layers - 1:
            raise ValueError(
                f"token_learner.after_layer must be a block index in [0, {num_layers - 1}) so that at "
                f"least one block runs on the learned tokens (num_layers = {num_layers}); "
                f"got {self.after_layer}"
            )


# TokenLearnerStage's settings and defaults (None: required), read from TokenLearnerConfig.
SETTINGS: dict[str, Any] = {f.name: None for f in dataclasses.fields(TokenLearnerConfig)} | defaults(TokenLearnerConfig)


def check_settings(settings: Mapping[str, Any], *, num_layers: int, prefix: str = "") -> dict[str, Any]:
    """The token_learner settings with defaults filled in; ValueError naming the bad one."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"{prefix}unknown token_learner setting(s) {unknown}; known: {sorted(SETTINGS)}")
    missing = sorted(n for n, d in SETTINGS.items() if d is None and n not in settings)
    if missing:
        raise ValueError(
            f"{prefix}token_learner needs {missing} (after_layer: the block it follows, num_tokens: k learned tokens)"
        )
    config = TokenLearnerConfig(**settings)
    config.check_layers(num_layers)
    return dataclasses.asdict(config)


class TokenLearnerStage(eqx.Module):
    """Where an `Encoder` learns its tokens: after block `after_layer` (one
    TokenLearner, `fuse=False`), or around every later block (a TokenLearner and a
    TokenFuser per block, `fuse=True`)."""

    learners: tuple[TokenLearner, ...]
    fusers: tuple[TokenFuser, ...]
    after_layer: int = eqx.field(static=True)
    fuse: bool = eqx.field(static=True)

    def __init__(
        self,
        d_model: int,
        *,
        num_layers: int,
        after_layer: int,
        num_tokens: int,
        fuse: bool = SETTINGS["fuse"],
        maps: str = SETTINGS["maps"],
        bottleneck: int = SETTINGS["bottleneck"],
        key: PRNGKeyArray,
    ):
        check_settings(
            dict(after_layer=after_layer, num_tokens=num_tokens, fuse=fuse, maps=maps, bottleneck=bottleneck),
            num_layers=num_layers,
        )
        count = num_layers - 1 - after_layer if fuse else 1
        keys = jax.random.split(key, 2 * count)
        self.learners = tuple(
            TokenLearner(d_model, num_tokens, bottleneck=bottleneck, maps=maps, key=k) for k in keys[:count]
        )
        self.fusers = tuple(TokenFuser(d_model, num_tokens, key=k) for k in keys[count:]) if fuse else ()
        self.after_layer, self.fuse = after_layer, fuse

    def learner(self, block_index: int) -> TokenLearner:
        return self.learners[block_index - self.after_layer - 1] if self.fuse else self.learners[0]

    def fuser(self, block_index: int) -> TokenFuser:
        return self.fusers[block_index - self.after_layer - 1]
