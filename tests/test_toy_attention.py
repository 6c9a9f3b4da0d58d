"""Adding an attention takes three places: (1) its op and its registration (for a shipped
one, in its family's file under jxformers/ops/, named in that file's `__all__`), (2) one
row of test facts with its dense reference mask (tests/attention_facts.py), and (3) one
row of docs/fidelity.md. This file is (1) and (2) for a toy (a dense band mask) and shows
the rest follows from them, no other file touched: the whole generic suite runs for it,
a model config validates its hyper-parameters and warns where it is dense, it renders
in the README's op table, `jxformers list` shows it, and the fidelity check asks for its
row (3) once it ships. docs/adding_an_attention.md walks through the same steps."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import test_fidelity_doc
from attention_facts import FACTS, Facts, Growth
from jaxtyping import Array, Bool, Float
from suites import AttentionSuite, ModelSuite, jit_variants

from jxformers import ModelConfig, ShortSequenceWarning, decoding, ops, registry
from jxformers.tools import cli


# 1a. The op: a pure function of one example, hyper-parameters keyword-only with defaults.
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


# 1b. The registration: what the signature cannot say. `limits` (required for every
# numeric hyper-parameter) makes `bind` refuse what the op would refuse at its first
# call; `summary` and `complexity` are its row of the README's op table; `dense_width`
# is how far one query reaches (a model whose max_len it reaches warns).
registry.register(
    "toy_band",
    toy_band_attention,
    family="fixed pattern",
    paper="a test's toy",
    complexity="O(N^2)",
    decoder=decoding.ring_buffer(ops.softmax_attention, slots=lambda hp: hp["window"] + 1),
    docs={"window": "keys at most this far away"},
    limits={"window": 0},
    summary="|i - j| <= window, by a dense mask (a test's toy)",
    dense_width=("its band (2 window + 1 keys)", lambda hp, n: 2 * hp["window"] + 1),
)


# 2. The row of test facts: small variants, the dense reference mask (written from the
# paper with numpy, never from the op), an error case, the cost class.
def band_mask(n, hp, arrays, causal):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return [(abs(i - j) <= hp["window"]) & ((j <= i) if causal else True)]


FACTS["toy_band"] = Facts(
    variants=({"window": 3}, {"window": 0}),
    mask=band_mask,
    errors=(({"window": -1}, "window"),),
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
    assert cli.main(["list", "toy_band"]) == 0
    assert "window: int, >= 0 = 2  -- keys at most this far away" in capsys.readouterr().out


def test_a_model_config_validates_its_hyper_parameters():
    with pytest.raises(ValueError, match="toy_band: hyper-parameter window must be >= 0; got -1"):
        ModelConfig(attention={"name": "toy_band", "window": -1}, max_len=64, num_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortSequenceWarning)
        config = ModelConfig(attention={"name": "toy_band", "window": 4}, max_len=64, num_layers=1)
    assert config.bound_attention(0).hyper_parameters == {"window": 4}


def test_a_model_config_warns_where_it_is_dense():
    with pytest.warns(
        ShortSequenceWarning,
        match=r"toy_band attention at max_len 8: its band \(2 window \+ 1 keys\) "
        r"spans 9 >= 8",
    ):
        ModelConfig(attention={"name": "toy_band", "window": 4}, max_len=8, num_layers=1)


def test_it_renders_in_the_readme_op_table():
    rows = registry.markdown_table(shipped_only=False).splitlines()
    assert r"| `toy_band_attention` | \|i - j\| <= window, by a dense mask (a test's toy) | yes | O(N^2) |" in rows
    assert "toy_band_attention" not in registry.markdown_table()  # the README's table is of shipped ones


def test_once_shipped_the_fidelity_check_asks_for_its_row():
    assert test_fidelity_doc.missing_rows(["toy_band", "local"]) == ["toy_band"]
