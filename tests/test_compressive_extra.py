"""The Compressive Transformer's other compression functions and its auto-encoding loss
(Rae, Potapenko, Jayakumar & Lillicrap 2020, "Compressive Transformers for Long-Range
Sequence Modelling", sections 3.1-3.2; `jxformers.nn.transformer_xl`): the dilated
convolution and the most-used compression against numpy references, the most-used
memory followed by hand through segments (layer 0's attention recomputed in numpy), and
the lossless auto-encoding loss (its value against numpy, its gradient reaching only f_c
and g). tests/test_train_streams.py trains the stack through the config. The attention-reconstruction loss and the
conv/mean/max functions are tests/test_transformer_xl.py's.

Mutations the tests were seen to fail (by hand, once): the dilated windows taken
consecutive; most-used keeping the least used, or the used ones out of order; the usage
not summed over segments; the auto-encoding loss averaged over invalid states too.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

from jxformers import build_model
from jxformers.nn.transformer_xl import Compressor, relative_sinusoid

D = 8
SMALL = dict(task="lm", vocab_size=40, num_layers=1, d_model=D, num_heads=2, ffn={"d_ff": 16}, max_len=16)
SMALL |= {"embedding": {"position": "none"}}


def compressive(compression, loss="attention", mem_len=4, cmem_len=4, rate=2):
    stack = dict(kind="compressive", mem_len=mem_len, cmem_len=cmem_len, compression=compression,
                 compression_rate=rate, compression_loss=loss)  # fmt: skip
    return build_model(SMALL | {"stack": stack}, key=jax.random.key(5))


@eqx.filter_jit
def fwd(model, tokens, memory):
    return model.forward(tokens, memory)


def _np(x):
    return np.asarray(x, np.float64)


def test_dilated_convolution_reads_states_n_over_c_apart():
    n, c = 6, 3
    comp = Compressor("dilated_conv", c, D, key=jax.random.key(0))
    x = _np(jax.random.normal(jax.random.key(1), (n, D)))
    w, b = _np(comp.conv.weight), _np(comp.conv.bias)  # [d, c * d]: tap i acts on columns i*d .. (i+1)*d
    want = np.stack([sum(w[:, i * D : (i + 1) * D] @ x[j + i * (n // c)] for i in range(c)) + b for j in range(n // c)])
    assert_close(comp(jnp.asarray(x, jnp.float32)), want, atol=1e-5)


def test_most_used_keeps_the_most_attended_states_in_order():
    n, c = 8, 2
    comp = Compressor("most_used", c, D, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (n, D))
    usage = np.array([0.5, 0.1, 0.9, 0.3, 0.7, 0.2, 0.8, 0.05])
    assert_close(comp(x, jnp.asarray(usage, jnp.float32)), _np(x)[[0, 2, 4, 6]], atol=0)
    # two to keep among the valid last four (the first four are not states): 4 (0.7), 6 (0.8), right-aligned
    masked = np.where(np.arange(n) >= 4, usage, -np.inf)
    got = comp(x, jnp.asarray(masked, jnp.float32), jnp.asarray(2))
    assert_close(got[2:], _np(x)[[4, 6]], atol=0)


def _received(layer, u, vb, keys, queries):
    """numpy: the attention each key receives from the queries (the last len(queries) of
    the keys' positions), averaged over heads and queries; Transformer-XL's scores."""
    m, n, heads = len(keys), len(queries), u.shape[0]
    dh = D // heads
    q = (queries @ _np(layer.q_proj.weight).T).reshape(n, heads, dh)
    k = (keys @ _np(layer.k_proj.weight).T).reshape(m, heads, dh)
    table = (_np(relative_sinusoid(jnp.arange(m), D)) @ _np(layer.r_proj.weight).T).reshape(m, heads, dh)
    got = np.zeros(m)
    for i in range(n):
        for h in range(heads):
            seen = m - n + i + 1
            s = np.array([
                (q[i, h] + u[h]) @ k[j, h] + (q[i, h] + vb[h]) @ table[m - n + i - j, h] for j in range(seen)
            ]) / math.sqrt(dh)  # fmt: skip
            p = np.exp(s - s.max())
            got[:seen] += p / p.sum()
    return got / (n * heads)


def test_most_used_memory_by_hand_across_segments():
    """Layer 0 reads the scaled embeddings, so its memories and their usage can be followed
    in numpy: each state's usage sums the attention it received over the segments while
    remembered; the evicted n keep their n / c most used, in order."""
    mem_len, cmem_len, rate, n, segments = 4, 4, 2, 4, 4
    model = compressive("most_used")
    layer, u, vb = model.layers[0], _np(model.u), _np(model.v)
    tokens = jax.random.randint(jax.random.key(6), (segments * n,), 0, 40)
    states = _np(model.table[tokens]) * math.sqrt(D)
    memory, mem, use, cmem = model.init_memory(), np.zeros((0, D)), np.zeros(0), np.zeros((0, D))
    for s in range(segments):
        _, memory, _ = fwd(model, tokens[s * n : (s + 1) * n], memory)
        x = states[s * n : (s + 1) * n]
        received = _received(layer, u, vb, np.concatenate([cmem, mem, x]), x)[len(cmem) :]
        mem, use = np.concatenate([mem, x]), np.concatenate([use, np.zeros(n)]) + received
        gone = max(len(mem) - mem_len, 0)
        if gone:
            top = np.sort(np.argsort(-use[:gone], kind="stable")[: gone // rate])
            cmem = np.concatenate([cmem, mem[:gone][top]])[-cmem_len:]
        mem, use = mem[gone:], use[gone:]
        assert_close(memory["usage"][0][mem_len - len(use) :], use, atol=1e-5)
        assert int(memory["compressed_length"]) == len(cmem)
        assert_close(memory["compressed"][0][cmem_len - len(cmem) :], cmem, atol=1e-5)
    assert len(cmem) == cmem_len


@pytest.fixture(scope="module")
def autoencoding():
    return compressive("conv", loss="autoencoding")


def test_the_autoencoding_loss_is_the_reconstruction_of_the_evicted_states(autoencoding):
    model = autoencoding
    tokens = jax.random.randint(jax.random.key(8), (12,), 0, 40)
    _, memory, first = fwd(model, tokens[:4], model.init_memory())
    assert float(first) == 0.0  # nothing evicted yet
    _, after, loss = fwd(model, tokens[4:8], memory)
    # numpy: per layer, the evicted 4 states (the memory's, full) through f_c and g
    want = []
    for i, layer in enumerate(model.layers):
        old = _np(memory["hidden"][i])
        conv, g = layer.compressor.conv, layer.compressor.decoder
        made = old.reshape(2, 2 * D) @ _np(conv.weight).T + _np(conv.bias)
        back = (made @ _np(g.weight).T + _np(g.bias)).reshape(4, D)
        want.append(np.mean((old - back) ** 2))
    assert_close(loss, np.mean(want), atol=1e-5)

    def objective(m):
        return m.forward(tokens[4:8], memory)[2]

    grads = eqx.filter_jit(eqx.filter_grad(objective))(model)
    learns = {id(x) for layer in grads.layers for x in jax.tree.leaves(layer.compressor)}
    flat = jax.tree.leaves(grads)
    assert all(float(jnp.abs(g).max()) > 0 for g in flat if id(g) in learns)  # f_c and g
    assert all(float(jnp.abs(g).max()) == 0 for g in flat if id(g) not in learns)  # nothing else
