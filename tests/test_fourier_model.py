"""The shortening encoder against hand-built references: where the Fourier Transformer's
filter sits (He et al. 2023, arXiv 2305.15099: before the first layer's attention for LRA), its cost, the
encoder-decoder's upsampled sum over blocks, positions after a filter, the FFT path for
unpadded input, and Funnel's pooled queries over unpooled keys and values."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from conftest import JittedOps, assert_close

from jxformers import build_model
from jxformers.xla_cost import compile_with_cost

ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

TINY = dict(vocab_size=29, num_layers=2, d_model=16, num_heads=4, d_ff=24, max_len=64)


def tokens(seed, n):
    return jax.random.randint(jax.random.key(seed), (n,), 0, TINY["vocab_size"])


def embed(encoder, x):
    """The encoder's input stream: embeddings (positions from 1 after a CLS token)."""
    start = 0 if encoder.cls is None else 1
    h = encoder.embedding(x, jnp.arange(start, x.shape[0] + start))
    return h if encoder.cls is None else jnp.concatenate([encoder.cls[None], h])


def fourier_body(h, ratio, rescale=False):
    """The paper's filter on the tokens after the CLS token."""
    return jnp.concatenate([h[:1], ops.fourier_downsample(h[1:], ratio, rescale=rescale)])


@pytest.mark.parametrize("downsample", ["fourier", "fourier_rescaled"])
def test_a_filter_sits_before_its_blocks_attention(downsample):
    rescale = downsample == "fourier_rescaled"
    x = tokens(1, 12)

    def encoder(filters):
        return build_model(dict(TINY, filters=filters, downsample=downsample), key=jax.random.key(0)).encoder

    @eqx.filter_jit
    def before_block_0(e, x):  # {0: r}: block 0 already runs at the shorter length (the paper's LRA placement)
        h = fourier_body(embed(e, x), 0.5, rescale)
        for block in e.blocks:
            h = block(h)
        return e.norm(h)

    @eqx.filter_jit
    def before_block_1(e, x):  # {1: r}: block 0 at full length, then the filter, then block 1
        h = fourier_body(e.blocks[0](embed(e, x)), 0.5, rescale)
        return e.norm(e.blocks[1](h))

    first, second = encoder({0: 0.5}), encoder({1: 0.5})
    out, mask = eqx.filter_jit(first)(x)
    assert out.shape == (1 + 6, 16) and bool(mask.all())
    assert_close(out, before_block_0(first, x), atol=2e-5)
    assert_close(eqx.filter_jit(second)(x)[0], before_block_1(second, x), atol=2e-5)


def test_the_papers_placement_runs_every_block_at_the_reduced_length():
    # XLA's FLOP count: with the filter before block 0, the encoder costs about a plain
    # encoder on the shortened input (plus the embedding and the filter), well below
    # the same filter after block 0.
    n, cfg = 256, dict(TINY, d_model=32, max_len=512)

    def flops(filters, length):
        model = build_model(dict(cfg, filters=filters), key=jax.random.key(0))
        return compile_with_cost(lambda t: model.encoder(t)[0], jax.ShapeDtypeStruct((length,), jnp.int32))[1].flops

    before, after, plain_short = flops({0: 0.25}, n), flops({1: 0.25}, n), flops({}, n // 4)
    assert before < 0.6 * after
    assert before < 1.5 * plain_short


def test_unpadded_input_takes_the_plain_fft_and_padded_input_agrees():
    model = build_model(dict(TINY, filters={0: 0.4}), key=jax.random.key(0)).encoder
    x = tokens(2, 15)
    run = eqx.filter_jit(lambda e, x, m=None: e(x, m)[0])
    # Without a mask, the filter is fourier_downsample (FFTs of length 15); with one, the
    # per-example chirp transform (FFTs of a power-of-two length).
    assert "fft_lengths=(15,)" in str(jax.make_jaxpr(model)(x))
    assert "fft_lengths=(15,)" not in str(jax.make_jaxpr(model)(x, jnp.ones(15, bool)))
    assert_close(run(model, x), run(model, x, jnp.ones(15, bool)), atol=2e-5)


def test_seq2seq_sums_each_blocks_output_upsampled():
    # Filters {1: 0.5} on 2 layers make two blocks: layer 0 at full length, layer 1 at
    # half length; the memory is norm(block_1_out + upsample(block_2_out)) (He et al.
    # 2023, section 4.1: sum the upsampled sequences of all blocks, then renormalise).
    cfg = dict(TINY, task="seq2seq", decoder_layers=1, filters={1: 0.5})
    encoder = build_model(cfg, key=jax.random.key(0)).encoder
    encode = eqx.filter_jit(lambda e, x, m: e(x, m, upsample_sum=True))

    @eqx.filter_jit
    def reference(e, x):
        full = e.blocks[0](embed(e, x))
        short = e.blocks[1](ops.fourier_downsample(full, 0.5))
        return e.norm(full + ops.nearest_upsample(short, x.shape[0]))

    x = tokens(3, 12)
    memory, mask = encode(encoder, x, jnp.ones(12, bool))
    assert_close(memory, reference(encoder, x), atol=2e-5)
    assert bool(mask.all())
    # Padding: the real prefix is encoded as the unpadded sequence, the rest is masked.
    padded, pad_mask = jnp.concatenate([x[:9], tokens(4, 3)]), jnp.arange(12) < 9
    memory, mask = encode(encoder, padded, pad_mask)
    assert_close(memory[:9], reference(encoder, x[:9]), atol=2e-5)
    assert mask.tolist() == pad_mask.tolist()


@pytest.mark.parametrize("position", ["rope", "alibi", "t5"])
def test_relative_positions_follow_the_resampled_grid(position):
    # After a filter that keeps 6 of 12 tokens, token j sits at 1 + 2j (CLS at 0).
    model = build_model(dict(TINY, position=position, filters={0: 0.5}), key=jax.random.key(0)).encoder

    @eqx.filter_jit
    def reference(e, x):
        pos = jnp.concatenate([jnp.zeros(1), 1.0 + 2.0 * jnp.arange(6)])
        h, bias = fourier_body(embed(e, x), 0.5), e.embedding.positions.bias(pos, pos)
        for block in e.blocks:
            h = block(h, bias=bias, positions=pos)
        return e.norm(h)

    x = tokens(5, 12)
    assert_close(eqx.filter_jit(model)(x)[0], reference(model, x), atol=2e-5)


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_funnel_queries_sit_at_the_pooled_grid_and_keys_at_the_unpooled_one(position):
    # Stride 2 before block 0: pooled token j at 1 + 2j (CLS at 0), keys at 0..n.
    cfg = dict(TINY, position=position, filters={0: 0.5}, downsample="funnel")
    model = build_model(cfg, key=jax.random.key(0)).encoder

    @eqx.filter_jit
    def reference(e, x):
        full = embed(e, x)
        pooled = jnp.concatenate([full[:1], ops.funnel_pool(full[1:], 2)[0]])
        q_pos = jnp.concatenate([jnp.zeros(1), 1.0 + 2.0 * jnp.arange(pooled.shape[0] - 1)])
        kv_pos = jnp.arange(full.shape[0], dtype=jnp.float32)
        bias = e.embedding.positions.bias
        h = e.blocks[0](pooled, bias=bias(q_pos, kv_pos), positions=q_pos, source=full, source_positions=kv_pos)
        return e.norm(e.blocks[1](h, bias=bias(q_pos, q_pos), positions=q_pos))

    x = tokens(7, 12)
    assert_close(eqx.filter_jit(model)(x)[0], reference(model, x), atol=2e-5)


def test_funnel_pools_the_queries_and_attends_to_the_unpooled_keys_and_values():
    # Dai et al. 2020 (post-norm): h' = LayerNorm(pool(h) + Attention(Q = pool(h), KV = h)).
    # Mean pooling commutes with the query projection, so ops.funnel_attention on the
    # projections of h is that attention.
    cfg = dict(TINY, pooling="mean", norm_placement="post", filters={1: 0.5}, downsample="funnel")
    encoder = build_model(cfg, key=jax.random.key(0)).encoder

    @eqx.filter_jit
    def reference(e, x, mask):
        block, attn = e.blocks[1], e.blocks[1].attention
        heads = lambda proj, h: proj(h).reshape(h.shape[0], attn.num_heads, attn.d_head)  # noqa: E731
        h = e.blocks[0](embed(e, x), kv_mask=mask)
        pooled, pooled_mask = ops.funnel_pool(h, 2, mask)
        core = ops.funnel_attention(
            heads(attn.q_proj, h), heads(attn.k_proj, h), heads(attn.v_proj, h), stride=2, kv_mask=mask
        )
        h = block.norms[0](pooled + attn.o_proj(core.reshape(pooled.shape[0], -1)))
        h = block.norms[1](h + block.ffn(h))
        return e.norm(h), pooled_mask

    run = eqx.filter_jit(lambda e, x, m: e(x, m))
    x = tokens(6, 11)
    for mask in (jnp.ones(11, bool), jnp.arange(11) < 7):
        out, out_mask = run(encoder, x, mask)
        ref, ref_mask = reference(encoder, x, mask)
        real = int(ref_mask.sum())
        assert out.shape == (6, 16) and out_mask.tolist() == ref_mask.tolist()
        assert_close(out[:real], ref[:real], atol=2e-5)


def test_funnel_needs_an_attention_that_takes_separate_keys():
    with pytest.raises(ValueError, match="funnel.*block 0"):
        build_model(
            dict(TINY, attention="local", attention_kwargs={"window": 2}, filters={0: 0.5}, downsample="funnel"),
            key=jax.random.key(0),
        )
