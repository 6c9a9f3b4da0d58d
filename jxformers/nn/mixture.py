"""The discretized mixture of logistics output head (Salimans et al. 2017, PixelCNN++),
the output of the image-generation experiment of Katharopoulos et al. 2020 ("Transformers
are RNNs", arXiv 2006.16236, section 4.2): each pixel's value in 0..255 is
modelled by a mixture of `K` logistic distributions over [-1, 1], each integrated over
the value's bin of width 2/255 (the end bins take the tails).

The head returns the mixture's log-probability of every pixel value as the language
model's logits (ids past the 256 values, e.g. a start token, get `UNREACHABLE`), so the
cross-entropy loss is exactly the mixture's negative log-likelihood, and sampling from
those logits is exact sampling from the discretized mixture: training, evaluation
(bits/dim = loss / ln 2) and generation need nothing of their own.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from jxformers.nn.layers import Linear

PIXEL_VALUES = 256
UNREACHABLE = -1e30  # the log-probability of ids that are not pixel values (finite: no inf * 0 in gradients)
_MIN_LOG_SCALE = -7.0  # PixelCNN++'s floor: bins stay resolvable, gradients finite


def discretized_logistic_log_probs(
    weight_logits: Float[Array, "*n k"], means: Float[Array, "*n k"], log_scales: Float[Array, "*n k"]
) -> Float[Array, "*n 256"]:
    """log P(value) for every value 0..255 under a discretized logistic mixture.

    A value v sits at c = 2v/255 - 1 with bin [c - 1/255, c + 1/255]; its probability
    under one component is sigma(a) - sigma(b) with a, b the bin's edges standardised
    (a = +inf for 255, b = -inf for 0). Computed as log sigma(a) + log sigma(-b) +
    log(-expm1(b - a)), an identity that never subtracts two close probabilities.

    Arguments:
        weight_logits, means, log_scales: `[..., k]` the mixture's unnormalised
            log-weights, the components' locations (in [-1, 1] pixel units) and log-scales.

    Returns:
        `[..., 256]` float32 log-probabilities; they sum (in probability) to 1.
    """
    weight_logits, means, log_scales = (x.astype(jnp.float32)[..., None, :] for x in (weight_logits, means, log_scales))
    values = jnp.arange(PIXEL_VALUES).reshape((1,) * (means.ndim - 2) + (PIXEL_VALUES, 1))  # [1.., 256, 1]
    centres = 2.0 * values / (PIXEL_VALUES - 1) - 1.0
    inv_scale = jnp.exp(-jnp.maximum(log_scales, _MIN_LOG_SCALE))
    a = (centres + 1.0 / (PIXEL_VALUES - 1) - means) * inv_scale  # upper edge
    b = (centres - 1.0 / (PIXEL_VALUES - 1) - means) * inv_scale  # lower edge
    upper, lower = jax.nn.log_sigmoid(a), jax.nn.log_sigmoid(-b)  # log CDF(upper), log (1 - CDF(lower))
    middle = upper + lower + jnp.log(-jnp.expm1(b - a))
    first, last = values == 0, values == PIXEL_VALUES - 1
    per_component = jnp.where(first, upper, jnp.where(last, lower, middle))  # [..., 256, k]
    return jax.nn.logsumexp(per_component + jax.nn.log_softmax(weight_logits, axis=-1), axis=-1)


class MixtureOfLogistics(eqx.Module):
    """Output head: hidden state -> log-probabilities of the 256 pixel values under a
    `components`-way discretized logistic mixture, padded to `vocab_size` ids.

    Shapes: `[..., d_model]` -> `[..., vocab_size]` (float32). Cost: one
    d_model x 3K projection plus 256 K sigmoids per position.
    """

    project: Linear
    components: int = eqx.field(static=True)
    vocab_size: int = eqx.field(static=True)

    def __init__(self, d_model: int, vocab_size: int, components: int, *, key: PRNGKeyArray):
        if vocab_size < PIXEL_VALUES:
            raise ValueError(f"{vocab_size=} must be >= {PIXEL_VALUES} (ids 0..255 are the pixel values)")
        if components < 1:
            raise ValueError(f"{components=} must be >= 1")
        self.project = Linear(d_model, 3 * components, key=key)
        self.components, self.vocab_size = components, vocab_size

    def __call__(self, x: Float[Array, "*n d_model"]) -> Float[Array, "*n vocab"]:
        weight_logits, means, log_scales = jnp.split(self.project(x).astype(jnp.float32), 3, axis=-1)
        log_probs = discretized_logistic_log_probs(weight_logits, means, log_scales)
        pad = jnp.full((*log_probs.shape[:-1], self.vocab_size - PIXEL_VALUES), UNREACHABLE, jnp.float32)
        return jnp.concatenate([log_probs, pad], axis=-1)
