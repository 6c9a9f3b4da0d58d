"""Adding an attention takes three places: its op, its registration, one row of test
facts. This file is all three for a toy (a dense band mask) and proves the rest follows:
the whole generic suite runs for it and `jxformers list` shows it.
docs/adding_an_attention.md walks through the same steps."""

import jax.numpy as jnp
import masks
from attention_facts import FACTS, Facts, Growth
from jaxtyping import Array, Bool, Float
from suites import AttentionSuite, ModelSuite, jit_variants

from jxformers import decoding, ops, registry
from jxformers.tools import cli


# 1. The op: a pure function of one example, hyper-parameters keyword-only with defaults.
def toy_band_attention(
    q: Float[Array, "n heads d_k"],
    k: Float[Array, "n kv_heads d_k"],
    v: Float[Array, "n kv_heads d_v"],
    *,
    causal: bool = False,
    kv_mask: Bool[Array, " n"] | None = None,
    window: int = 2,
) -> Float[Array, "n heads d_v"]:
    """Softmax attention to the keys at most `window` positions away (a dense mask:
    O(N^2), a toy)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0; got {window!r}")
    n = q.shape[0]
    if k.shape[0] != n:
        raise ValueError(f"toy_band is self-attention only: q_len={n} must equal kv_len={k.shape[0]}")
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    return ops.softmax_attention(q, k, v, mask=jnp.abs(i - j) <= window, causal=causal, kv_mask=kv_mask)


# 2. The registration: what the signature cannot say (family, paper, decoder, docs).
registry.register(
    "toy_band", toy_band_attention, family="fixed pattern", paper="a test's toy", complexity="O(N^2)",
    decoder=decoding.ring_buffer(ops.softmax_attention, slots=lambda hp: hp["window"] + 1),
    docs={"window": "keys at most this far away"},
)

# 3. The row of test facts: small variants, the dense reference mask (the band is local
# attention's), an error case, the cost class.
FACTS["toy_band"] = Facts(
    variants=({"window": 3}, {"window": 0}), mask=masks.local, errors=(({"window": -1}, "window"),),
    growth=Growth("quadratic", lambda n: {"window": 32}),
)


class TestToyAttention(AttentionSuite):
    attention_names = ("toy_band",)


class TestToyModels(ModelSuite):
    attention_names = ("toy_band",)


TestToyJitVmapGrad = jit_variants(("toy_band",))


def test_jxformers_list_shows_it(capsys):
    assert cli.main(["list"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "toy_band" in rows
    assert "fixed pattern" in rows["toy_band"] and "ring buffer" in rows["toy_band"] and "window=2" in rows["toy_band"]
