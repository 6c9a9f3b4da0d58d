"""Generation: sampling a continuation from a language model with `lax.scan`, one token
at a time through the model's incremental decoding state (or, as the baseline, by
rerunning the parallel forward at every step); `transduce` writes an encoder-decoder's
target for a source the same way, through its decoder bound to the source."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from jxformers.nn.layers import check_ids


def sample_logits(
    logits: Float[Array, " vocab"], key: PRNGKeyArray, *, temperature: float, top_k: int | None
) -> Int[Array, ""]:
    """One token from `logits`: greedy when temperature == 0, else softmax(logits / T)
    restricted to the `top_k` largest logits when given."""
    if temperature == 0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        if top_k > logits.shape[-1]:
            raise ValueError(f"top_k must be <= the vocabulary ({logits.shape[-1]} logits); got {top_k}")
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(
    model,
    prompt: Int[Array, " prompt_len"],
    steps: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
) -> Int[Array, " total"]:
    """Continue `prompt` by `steps` tokens sampled from a language model.

    The prompt is fed through `model.decode_step` one token at a time, then each sampled
    token is fed back; both loops are `lax.scan`s over a state of fixed shape, so the
    whole call compiles once. With `use_cache=False` every step instead reruns the
    parallel forward on the whole (padded) sequence and reads one row: the recompute
    baseline of Katharopoulos et al. 2020 ("Transformers are RNNs", arXiv 2006.16236),
    Table 1, which works for any causal attention.

    Arguments:
        model: a `jxformers.nn.LanguageModel` (anything with `init_decode_state(max_len)`,
            `decode_step(token, state)` and `max_len`; and `__call__` for use_cache=False).
        prompt: `[prompt_len]` token ids, at least one.
        steps: tokens to generate (>= 0).
        key: PRNG key for sampling.
        temperature: 0 for greedy decoding; > 0 to sample.
        top_k: sample among the k most likely tokens (None: all).
        use_cache: decode incrementally (True) or recompute (False).

    Returns:
        `[prompt_len + steps]`: the prompt followed by the generated tokens.
    """
    n_prompt = prompt.shape[0]
    total = n_prompt + steps
    if n_prompt < 1:
        raise ValueError("prompt must hold at least one token")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0; got {steps!r}")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0; got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
    if total > model.max_len:
        raise ValueError(f"prompt_len + steps = {total} exceeds the model's max_len {model.max_len}")
    if getattr(model, "vocab_size", None) is not None:  # the decode loops below would only see NaN
        check_ids(prompt, model.vocab_size, "prompt token ids")
    prompt = prompt.astype(jnp.int32)
    sample = lambda logits, k: sample_logits(logits, k, temperature=temperature, top_k=top_k)  # noqa: E731
    keys = jax.random.split(key, max(steps, 1))

    if not use_cache:
        buffer = jnp.zeros((total,), jnp.int32).at[:n_prompt].set(prompt)

        def recompute(buffer, xs):
            pos, k = xs
            token = sample(model(buffer)[pos - 1], k)
            return buffer.at[pos].set(token), None

        buffer, _ = jax.lax.scan(recompute, buffer, (jnp.arange(n_prompt, total), keys[:steps]))
        return buffer

    def feed(state, token):
        logits, state = model.decode_step(token, state)
        return state, logits

    state, logits = jax.lax.scan(feed, model.init_decode_state(total), prompt)

    def step(carry, k):
        logits, state = carry
        token = sample(logits, k)
        logits, state = model.decode_step(token, state)
        return (logits, state), token

    _, new = jax.lax.scan(step, (logits[-1], state), keys[:steps])
    return jnp.concatenate([prompt, new])


def transduce(
    model,
    source: Int[Array, " src"],
    source_mask: Bool[Array, " src"] | None = None,
    *,
    steps: int,
    bos: int,
    eos: int,
    key: PRNGKeyArray | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    use_cache: bool = True,
) -> Int[Array, " total"]:
    """The target an encoder-decoder (`jxformers.nn.EncoderDecoder`, task seq2seq) writes
    for `source`: its decoder bound to the encoded source (`model.conditioned`) continues
    `[bos]` by `steps` tokens through `generate` (greedy by default; cached decoding, or
    the parallel decoder rerun with `use_cache=False`), and every token after the first
    `eos` is set to 0 (padding): the shape stays fixed, so a batch of sources vmaps.

    Arguments:
        model: an `EncoderDecoder`.
        source: `[src]` token ids; source_mask: `[src]` True for real tokens (None: all).
        steps: target tokens to write after the BOS (1 + steps <= the model's max_len).
        bos, eos: the target's first and last token (`jxformers.data.tasks.BOS`, `EOS`).
        key: PRNG key for sampling (None: a fixed one; greedy decoding does not read it).
        temperature, top_k, use_cache: as `generate`'s.

    Returns:
        `[1 + steps]`: `bos`, the target, `eos` (if written), then zeros.
    """
    decoder = model.conditioned(source, source_mask)
    key = jax.random.key(0) if key is None else key
    out = generate(
        decoder, jnp.array([bos], jnp.int32), steps, key=key, temperature=temperature, top_k=top_k, use_cache=use_cache
    )
    is_eos = (out == eos).at[0].set(False)  # the BOS slot never ends the target (even where bos == eos)
    after = (jnp.cumsum(is_eos) - is_eos) > 0
    return jnp.where(after, 0, out)
