"""The block-sparse flash-attention kernel, run in Pallas interpret mode (the GPU
variant; the TPU one has tests/test_kernels_tpu.py), against the XLA ops and the dense
reference: block metadata against dense masks, every fixed-pattern op's kernel path
against its XLA path (outputs and gradients, causal, grouped-query heads, padding, odd
lengths), bf16, cross attention, models, and the `impl` choice."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import masks
import numpy as np
import pytest
from conftest import JittedOps, assert_close, cuda_target, jitted_call, qkv

import jxformers.ops
from jxformers import ModelConfig, build_model
from jxformers.kernels import (
    Alibi,
    Band,
    BlockSizes,
    KeyRange,
    QueryRange,
    block_sparse_attention,
    block_sparse_reference,
    causal,
    impl,
    intersect,
    union,
    visited_fraction,
)
from jxformers.kernels.block_mask import EMPTY, FULL, PARTIAL, add_full_blocks, block_kinds, visit_lists
from jxformers.kernels.pattern import KeyResidue, dense_mask, key_set
from jxformers.nn import alibi_slopes
from jxformers.ops.local import block_local_pattern, local_pattern
from jxformers.ops.softmax import softmax_pattern
from jxformers.ops.sparse import (
    bigbird_pattern,
    fixed_parts,
    longformer_pattern,
    residue_order,
    sparse_transformer_pattern,
    strided_parts,
    summary_positions,
)

eager_ops = jxformers.ops  # where a test watches what happens at call time
ops = JittedOps()  # each op compiled whole (eagerly: every primitive compiles on its own)

N = 37  # an odd length: tails of every block size
PRIMITIVES = [
    Band(),
    Band(-5, 5),
    Band(0, None),
    Band(-6, 6, step=3),
    Band(0, 0, unit=8),
    Band(-1, 1, unit=8),
    Band(None, None, step=5),
    Band(1, None, unit=8, key_unit=3),
    Band(-1, 2, unit=5, key_unit=2),
    KeyRange(3, 9),
    KeyRange(30, None),
    QueryRange(0, 4),
    KeyResidue(6, 4),
]
COMBINED = [
    union(Band(-3, 3), KeyRange(0, 2)),
    intersect(Band(-9, 9, step=2), causal(N, N)),
    union(Band(-4, 4), Band(step=7)),
    intersect(union(Band(0, 0, unit=8), KeyResidue(8, 7)), causal(N, N)),
    intersect(Band(-3, 3), causal(20, N)),
]


def _check_blocks(pattern, q_len, kv_len, bq, bk, exact):
    dense = dense_mask(pattern, q_len, kv_len)
    kinds = block_kinds(pattern, q_len, kv_len, bq, bk)
    assert kinds.shape == (-(-q_len // bq), -(-kv_len // bk))
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            tile = dense[a * bq : (a + 1) * bq, b * bk : (b + 1) * bk]
            if kinds[a, b] == EMPTY:
                assert not tile.any(), (pattern, a, b)
            elif kinds[a, b] == FULL:
                assert tile.all(), (pattern, a, b)
            elif exact and tile.shape == (bq, bk):  # whole blocks: a primitive's answer is exact
                assert tile.any() and not tile.all(), (pattern, a, b)


@pytest.mark.parametrize("pattern", PRIMITIVES, ids=repr)
@pytest.mark.parametrize("bq,bk", [(16, 16), (16, 32), (32, 16)])
def test_primitive_blocks_are_exact(pattern, bq, bk):
    _check_blocks(pattern, N, N, bq, bk, exact=True)
    _check_blocks(pattern, 64, 96, bq, bk, exact=True)


@pytest.mark.parametrize("pattern", COMBINED, ids=repr)
def test_combined_blocks_are_safe(pattern):
    for q_len in (N, 20):
        _check_blocks(pattern, q_len, N, 16, 16, exact=False)


def test_padded_key_block_is_never_full():
    kinds = block_kinds(Band(), 20, 20, 16, 16)
    assert list(kinds[:, -1]) == [PARTIAL, PARTIAL] and list(kinds[:, 0]) == [FULL, FULL]


def test_visit_lists_put_full_blocks_first_and_agree_with_jax():
    kinds = block_kinds(union(Band(-20, 20), KeyRange(0, 1)), 128, 128, 16, 16)
    lists = visit_lists(kinds)
    dynamic = visit_lists(jnp.asarray(kinds))
    for row in range(kinds.shape[0]):
        visited = lists.index[row, : lists.count[row]]
        assert sorted(visited) == list(np.flatnonzero(kinds[row]))
        assert all(kinds[row, visited[: lists.full[row]]] == FULL) and all(
            kinds[row, visited[lists.full[row] :]] == PARTIAL
        )
        assert list(np.asarray(dynamic.index[row, : dynamic.count[row]])) == list(visited)
    assert np.array_equal(np.asarray(dynamic.full), lists.full)
    assert visit_lists(block_kinds(Band(-20, 20), 128, 128, 16, 16)).full_contiguous
    assert not visit_lists(add_full_blocks(kinds, jnp.array([[5]] * 8))).full_contiguous


def test_key_set_merges_runs_and_refuses_many():
    assert key_set((3, 0, 1, 2, 9)) == union(KeyRange(0, 4), KeyRange(9, 10))
    assert key_set(range(0, 40, 2)) is None


# ----------------------------------------------------------------------------- op patterns


def _one(mask_list):
    (mask,) = mask_list
    return np.asarray(mask)


@pytest.mark.parametrize("is_causal", [False, True])
def test_op_patterns_equal_the_papers_masks(is_causal):
    n = 50
    cases = [
        (local_pattern(5, causal=is_causal, q_len=n, kv_len=n), masks.local(n, {"window": 5}, {}, is_causal)),
        (
            block_local_pattern(8, causal=is_causal, q_len=n, kv_len=n),
            masks.block_local(n, {"block_size": 8}, {}, is_causal),
        ),
        (softmax_pattern(n, n, causal=is_causal), masks.softmax(n, {}, {}, is_causal)),
        (
            sparse_transformer_pattern(6, "strided", 1, causal=is_causal, n=n),
            masks.sparse_transformer(n, {"stride": 6}, {}, is_causal),
        ),
        (
            sparse_transformer_pattern(6, "fixed", 2, causal=is_causal, n=n),
            masks.sparse_transformer(n, {"stride": 6, "pattern": "fixed", "num_summary": 2}, {}, is_causal),
        ),
    ]
    for d in (1, 3):
        hp = {"window": 4, "dilation": d, "global_indices": (0, 7)}
        want = _one(masks.longformer(n, hp, {}, is_causal))
        got = dense_mask(longformer_pattern(4, d, (0, 7), causal=is_causal, n=n), n, n)
        # The kernel's pattern holds the global keys; the global rows are recomputed densely.
        rows = np.ones(n, bool)
        rows[[0, 7]] = False
        assert np.array_equal(got[rows], want[rows])
    for pattern, want in cases:
        assert np.array_equal(dense_mask(pattern, n, n), _one(want)), pattern


@pytest.mark.parametrize("is_causal", [False, True])
def test_strided_parts_are_disjoint_cover_the_papers_mask_and_visit_few_blocks(is_causal):
    n, s = 50, 6
    band, columns = strided_parts(s, causal=is_causal, n=n)
    order = residue_order(n, s)
    near = dense_mask(band, n, n)
    far = np.zeros((n, n), bool)
    keep = order < n  # the residue order's padding positions
    far_rows = dense_mask(columns, len(order), len(order))[np.ix_(keep, keep)]
    far[np.ix_(order[keep], order[keep])] = far_rows
    assert not (near & far).any()
    assert np.array_equal(near | far, _one(masks.sparse_transformer(n, {"stride": s}, {}, is_causal)))
    # At N = 16K and s = 128 the one-pattern kernel visits every block; the two parts
    # visit about 2 (s + block) / N + 1 / s of them.
    n, s = 16384, 128
    band, columns = strided_parts(s, causal=False, n=n)
    assert visited_fraction(sparse_transformer_pattern(s, "strided", 1, causal=False, n=n), n, n) == 1.0
    assert visited_fraction(band, n, n) + visited_fraction(columns, n, n) < 0.04


@pytest.mark.parametrize("is_causal", [False, True])
def test_fixed_parts_are_disjoint_cover_the_papers_mask_and_visit_few_blocks(is_causal):
    n, s, c = 50, 6, 2
    own, others = fixed_parts(s, c, causal=is_causal, n=n)
    where = summary_positions(n, s, c)
    near = dense_mask(own, n, n)
    far = np.zeros((n, n), bool)
    keep = where < n
    far[:, where[keep]] = dense_mask(others, n, len(where))[:, keep]
    assert not (near & far).any()
    want = _one(masks.sparse_transformer(n, {"stride": s, "pattern": "fixed", "num_summary": c}, {}, is_causal))
    assert np.array_equal(near | far, want)
    # At N = 16K, s = 128, c = 8: the own blocks plus N c / s summary keys, about 7% of
    # the dense blocks, where the one-pattern kernel visits every key block holding a
    # summary key (half of them at 64-key blocks).
    n, s, c = 16384, 128, 8
    own, others = fixed_parts(s, c, causal=False, n=n)
    keys = len(summary_positions(n, s, c))
    assert visited_fraction(sparse_transformer_pattern(s, "fixed", c, causal=False, n=n), n, n) > 0.5
    assert visited_fraction(own, n, n) + visited_fraction(others, n, keys) * keys / n < 0.08


def test_bigbird_blocks_equal_the_papers_mask():
    n, b = 100, 16
    key = jax.random.key(3)
    hp = {"block_size": b, "num_random_blocks": 2, "num_window_blocks": 3, "num_global_blocks": 2}
    want = _one(masks.bigbird(n, hp, {"key": key}, False))
    rnd = ops.bigbird_random_blocks(key, n, block_size=b, num_random_blocks=2)
    kinds = np.asarray(add_full_blocks(block_kinds(bigbird_pattern(n, b, 3, 2), n, n, b, b), rnd))
    got = kinds[np.arange(n)[:, None] // b, np.arange(n)[None, :] // b] != EMPTY
    rows = np.arange(n) // b
    ordinary = (rows > 0) & (rows < rows.max())  # global query blocks are recomputed densely
    assert np.array_equal(got[ordinary], want[ordinary])


# ----------------------------------------------------------------------------- kernel vs XLA


def _value_and_grads(op, q, k, v, **kw):
    """(op's output, the gradients of <output, w> for a fixed random w), in one compiled
    program (interpret-mode kernels run much faster compiled than op by op)."""

    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: op(q, k, v, **kw), q, k, v)
        return out, vjp(jax.random.normal(jax.random.key(9), out.shape, out.dtype))

    return run(q, k, v)


def _assert_same_path(op, q, k, v, **kw):
    """The kernel (interpret mode) equals the XLA path, outputs and gradients."""
    got, got_grads = _value_and_grads(op, q, k, v, impl="interpret", **kw)
    want, want_grads = _value_and_grads(op, q, k, v, impl="xla", **kw)
    assert_close(got, want, atol=2e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b, atol=2e-5)


OPS = {
    "softmax": (ops.softmax_attention, {}),
    "local": (ops.local_attention, {"window": 5}),
    "block_local": (ops.block_local_attention, {"block_size": 16}),
    "dilated": (ops.dilated_attention, {"window": 3, "dilation": 2}),
    # Each Sparse Transformer pattern is two kernel calls merged by their lse: fixed's own
    # block and gathered summary keys; strided's band and its columns in residue order.
    "sparse_transformer": (ops.sparse_transformer_attention, {"stride": 6, "pattern": "fixed", "num_summary": 2}),
    "strided": (ops.sparse_transformer_attention, {"stride": 6, "pattern": "strided"}),
    "longformer": (ops.longformer_attention, {"window": 4, "global_indices": (0, 9)}),
}


# Each pair costs two interpret-mode compilations with their gradients: both directions
# for the ops whose causal kernel differs most, one for the rest.
@pytest.mark.parametrize(
    "name,is_causal",
    [
        ("softmax", False),
        ("softmax", True),
        ("local", False),
        ("local", True),
        ("block_local", True),
        ("dilated", False),
        ("sparse_transformer", False),
        ("sparse_transformer", True),
        ("strided", False),
        ("strided", True),
        ("longformer", False),
    ],
)
def test_kernel_path_equals_xla_path(name, is_causal):
    op, hp = OPS[name]
    q, k, v = qkv(0, N)
    _assert_same_path(op, q, k, v, **dict(hp, causal=is_causal, kv_mask=jnp.arange(N) < N - 4))


def test_bigbird_kernel_path_equals_xla_path():
    q, k, v = qkv(1, 70)
    kw = dict(block_size=16, num_random_blocks=1, key=jax.random.key(4), kv_mask=jnp.arange(70) < 66)
    _assert_same_path(ops.bigbird_attention, q, k, v, **kw)


@pytest.mark.parametrize("is_causal", [False, True])
def test_cross_attention_and_block_sizes(is_causal):
    q, k, v = qkv(2, 20, kv_len=N)
    sizes = BlockSizes(16, 32, block_q_bwd=32, block_k_bwd=16)
    pattern = causal(20, N) if is_causal else Band()
    got = block_sparse_attention(q, k, v, pattern, interpret=True, block_sizes=sizes)
    assert_close(got, ops.softmax_attention(q, k, v, causal=is_causal, impl="xla"), atol=2e-6)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)  # noqa: E731
    got = jax.jit(
        jax.grad(
            loss(lambda q, k, v: block_sparse_attention(q, k, v, pattern, interpret=True, block_sizes=sizes)), (0, 1, 2)
        )
    )(q, k, v)
    want = jax.grad(loss(functools.partial(ops.softmax_attention, causal=is_causal, impl="xla")), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, atol=2e-5)


def test_lse_is_exact_and_differentiable():
    q, k, v = qkv(3, N)
    pattern = union(Band(-3, 3), KeyRange(0, 2))
    out, lse = block_sparse_attention(q, k, v, pattern, interpret=True, return_lse=True)
    ref_out, ref_lse = block_sparse_reference(q, k, v, pattern)
    assert_close(out, ref_out, atol=2e-6)
    assert_close(lse, ref_lse, atol=2e-6)
    f = lambda fn: jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(fn(q)[1]))))(q)  # noqa: E731
    assert_close(
        f(lambda q: block_sparse_attention(q, k, v, pattern, interpret=True, return_lse=True)),
        f(lambda q: block_sparse_reference(q, k, v, pattern)),
        atol=2e-5,
    )


@pytest.mark.parametrize("is_causal,q_len", [(False, N), (True, N), (True, 20)])
def test_alibi_in_the_kernel_equals_the_dense_bias(is_causal, q_len):
    """The kernel computes ALiBi per tile; the XLA op adds `Alibi.dense`: outputs and the
    gradients of q, k, v and the slopes agree (GQA, padding, odd lengths, and queries
    that are the last positions of the keys)."""
    q, k, v = qkv(11, q_len, kv_len=N)
    slopes = alibi_slopes(q.shape[1]) * 4.0  # steep: the bias decides most of each row
    kw = dict(causal=is_causal, kv_mask=jnp.arange(N) < N - 3)

    def run(impl):
        @jax.jit
        def go(q, k, v, slopes):
            f = lambda q, k, v, s: ops.softmax_attention(q, k, v, bias=Alibi(s, N - q_len), impl=impl, **kw)  # noqa: E731
            out, vjp = jax.vjp(f, q, k, v, slopes)
            return out, vjp(jax.random.normal(jax.random.key(9), out.shape, out.dtype))

        return go(q, k, v, slopes)

    got, got_grads = run("interpret")
    want, want_grads = run("xla")
    assert_close(got, want, atol=2e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b, atol=5e-5, rtol=2e-5)
    assert float(jnp.abs(want_grads[3]).min()) > 1e-3  # the slopes' gradient is not trivially zero


# Soft-capping and sinks in the kernel's tiles: each case one compilation of the kernel
# path and one of the XLA op, gradients of q, k, v and the sink logits included.
SINK_LOGITS = jnp.array([1.5, -1.0, 0.0, 0.5])  # one per query head (4 heads on 2 kv heads)
SCORE_CASES = {
    "softcap_dense": dict(softcap=0.8),
    "zero_sink_causal": dict(sinks="zero", causal=True),
    # Rows 0..29 see no key (causal, padding first): zeros, finite gradients.
    "softcap_learned_sink_padded": dict(softcap=0.8, sinks="learned", causal=True, kv_mask=jnp.arange(N) >= 30),
}


def _grads_with_sinks(impl, q, k, v, sink_logits, **kw):
    """The op's output and the gradients of <output, w> w.r.t. q, k, v and the sink logits."""
    learned = kw.get("sinks") == "learned"

    @jax.jit
    def run(q, k, v, sink_logits):
        f = lambda q, k, v, s: eager_ops.softmax_attention(  # noqa: E731
            q, k, v, sink_logits=s if learned else None, impl=impl, **kw
        )
        out, vjp = jax.vjp(f, q, k, v, sink_logits)
        return out, vjp(jax.random.normal(jax.random.key(9), out.shape, out.dtype))

    return run(q, k, v, sink_logits)


@pytest.mark.parametrize("name", SCORE_CASES)
def test_softcap_and_sinks_in_the_kernel_equal_the_xla_op(name):
    q, k, v = qkv(13, N)
    kw = SCORE_CASES[name]
    sinks = {"sink_logits": SINK_LOGITS} if kw.get("sinks") == "learned" else {}
    traced = jax.make_jaxpr(lambda q, k, v: eager_ops.softmax_attention(q, k, v, impl="interpret", **kw, **sinks))
    assert "pallas_call" in str(traced(q, k, v))  # the options run in the kernel, not on a fallback
    got, got_grads = _grads_with_sinks("interpret", q, k, v, SINK_LOGITS, **kw)
    want, want_grads = _grads_with_sinks("xla", q, k, v, SINK_LOGITS, **kw)
    assert_close(got, want, atol=2e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_close(a, b, atol=2e-5)
    if kw.get("sinks") == "learned":
        assert float(jnp.abs(want_grads[3]).min()) > 1e-3  # the sinks' gradient is not trivially zero
    if "kv_mask" in kw:
        assert not jnp.any(got[:30]) and all(bool(jnp.isfinite(g).all()) for g in got_grads)


def test_softcap_and_sinks_on_a_window_equal_the_reference():
    """A sparse pattern (a sliding window, PARTIAL tiles), cross attention of odd lengths,
    softcap with ALiBi and learned sinks: the kernel's out, lse (with the sink) and the
    gradients of q, k, v, the slopes and the sink logits against the dense reference."""
    q, k, v = qkv(14, 20, kv_len=N)
    pattern = Band(-5, 5)
    sizes = BlockSizes(16, 16, block_q_bwd=16, block_k_bwd=16)

    def run(fn):
        @jax.jit
        def go(q, k, v, slopes, sink_logits):
            f = lambda *args: fn(*args[:3], alibi=Alibi(args[3]), softcap=1.0, sinks="learned", sink_logits=args[4])  # noqa: E731
            (out, lse), vjp = jax.vjp(f, q, k, v, slopes, sink_logits)
            w = jax.random.normal(jax.random.key(9), out.shape), jax.random.normal(jax.random.key(8), lse.shape)
            return out, lse, vjp(w)

        return go(q, k, v, jnp.array([0.5, 0.25, 0.1, 0.02]), SINK_LOGITS)

    got = run(
        lambda q, k, v, **kw: block_sparse_attention(
            q, k, v, pattern, interpret=True, block_sizes=sizes, return_lse=True, **kw
        )
    )
    want = run(lambda q, k, v, **kw: block_sparse_reference(q, k, v, pattern, **kw))
    assert_close(got[0], want[0], atol=2e-6)
    assert_close(got[1], want[1], atol=2e-6)
    for a, b in zip(got[2], want[2], strict=True):
        assert_close(a, b, atol=5e-5, rtol=2e-5)
    # The reference is the XLA op with the pattern as a dense mask.
    xla = ops.softmax_attention(
        q,
        k,
        v,
        mask=jnp.asarray(dense_mask(pattern, 20, N)),
        bias=Alibi(jnp.array([0.5, 0.25, 0.1, 0.02])),
        softcap=1.0,
        sinks="learned",
        sink_logits=SINK_LOGITS,
        impl="xla",
    )
    assert_close(want[0], xla, atol=2e-6)


def test_softcap_and_sinks_bf16_track_float32():
    q, k, v = qkv(15, N, d=16, dv=16)
    kw = dict(causal=True, softcap=1.0, sinks="learned", sink_logits=SINK_LOGITS)
    got = jitted_call(ops.softmax_attention, *(x.astype(jnp.bfloat16) for x in (q, k, v)), impl="interpret", **kw)
    assert got.dtype == jnp.bfloat16
    assert_close(got, jitted_call(ops.softmax_attention, q, k, v, impl="xla", **kw), atol=3e-2, rtol=3e-2)


def test_auto_keeps_xla_for_softcap_and_sinks_until_they_run_on_a_gpu(monkeypatch):
    monkeypatch.setattr(impl, "device_backend", lambda: "gpu")
    monkeypatch.setattr(impl, "_gpu_capability", lambda: 9.0)
    q, k, v = qkv(17, 256)

    def kernels(**kw):  # traced, not run: the choice is made while the op traces
        return str(jax.make_jaxpr(lambda q: eager_ops.softmax_attention(q, k, v, causal=True, **kw))(q)).count(
            "pallas_call"
        )

    assert kernels(softcap=30.0) == 0 and kernels(sinks="zero") == 0
    assert kernels(softcap=30.0, impl="pallas") == kernels(impl="auto") == 1


def test_score_options_the_kernels_lack_are_refused_by_name():
    q, k, v = qkv(16, N)
    with pytest.raises(ValueError, match=r"cannot run this call: score options \['top_k'\]"):
        eager_ops.softmax_attention(q, k, v, softcap=1.0, top_k=3, impl="interpret")
    with pytest.raises(ValueError, match="cannot run this call: score options"):
        eager_ops.softmax_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), sinks="zero", impl="cudnn")
    with pytest.raises(ValueError, match=r"sinks='learned' needs sink_logits of shape \(4,\)"):
        block_sparse_attention(q, k, v, Band(), sinks="learned", interpret=True)
    with pytest.raises(ValueError, match="softcap must be a number > 0"):
        block_sparse_attention(q, k, v, Band(), softcap=0.0, interpret=True)


def test_alibi_models_run_the_kernel_without_an_n_by_n_bias():
    n = 256
    tokens = jnp.arange(n) % 50
    base = dict(task="lm", vocab_size=50, num_layers=1, d_model=16, num_heads=2, max_len=n, position="alibi")
    key = jax.random.key(0)
    kernel_model = build_model(ModelConfig(**base, impl="interpret"), key=key)
    forward = eqx.filter_jit(lambda m, x: m(x))  # compiled: op by op, each operation compiles alone
    assert_close(
        forward(kernel_model, tokens), forward(build_model(ModelConfig(**base, impl="xla"), key=key), tokens), atol=2e-5
    )
    jaxpr = jax.make_jaxpr(kernel_model)(tokens)

    def shapes(jaxpr):  # every intermediate, inside jit, scan and the kernels' bodies too
        for eqn in jaxpr.eqns:
            yield from (getattr(var.aval, "shape", ()) for var in eqn.outvars)
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from shapes(inner)

    assert all(int(np.prod(shape)) < n * n for shape in shapes(jaxpr.jaxpr))


def test_alibi_slopes_must_match_the_heads():
    q, k, v = qkv(12, N)
    with pytest.raises(ValueError, match=r"Alibi.slopes must be \[heads=4\]"):
        ops.softmax_attention(q, k, v, bias=Alibi(jnp.ones(3)), impl="interpret")
    with pytest.raises(ValueError, match=r"Alibi.slopes must be \[heads=4\]"):
        ops.softmax_attention(q, k, v, bias=Alibi(jnp.ones(3)), impl="xla")


def test_rows_without_keys_are_zero_with_finite_gradients():
    q, k, v = qkv(4, 24)
    kv_mask = jnp.zeros(24, bool)
    out, grads = _value_and_grads(ops.local_attention, q, k, v, window=3, kv_mask=kv_mask, impl="interpret")
    assert not jnp.any(out)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    # Merged parts (strided: band + columns) where neither part sees a key.
    out, grads = _value_and_grads(
        ops.sparse_transformer_attention, q, k, v, stride=5, kv_mask=kv_mask, impl="interpret"
    )
    assert not jnp.any(out)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_bf16_tracks_float32():
    q, k, v = qkv(5, N, d=16, dv=16)
    got = ops.local_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), window=6, causal=True, impl="interpret")
    assert got.dtype == jnp.bfloat16
    assert_close(got, ops.local_attention(q, k, v, window=6, causal=True, impl="xla"), atol=3e-2, rtol=3e-2)


def test_batched_with_vmap():
    q, k, v = (jnp.stack([x, x[::-1]]) for x in qkv(6, N))
    run = jax.vmap(functools.partial(ops.softmax_attention, causal=True, impl="interpret"))
    want = jax.vmap(functools.partial(ops.softmax_attention, causal=True, impl="xla"))(q, k, v)
    assert_close(run(q, k, v), want, atol=2e-6)


def test_residuals_are_linear_in_length():
    n = 256
    q, k, v = qkv(7, n, d=16, dv=16)
    _, vjp = jax.vjp(lambda q, k, v: block_sparse_attention(q, k, v, causal(n, n), interpret=True), q, k, v)
    biggest = max(x.size for x in jax.tree_util.tree_leaves(vjp) if hasattr(x, "size"))
    assert biggest < n * n, biggest


# ----------------------------------------------------------------------------- impl choice


def test_impl_errors_name_what_is_allowed():
    q, k, v = qkv(8, N)
    with pytest.raises(ValueError, match="impl must be one of"):
        ops.local_attention(q, k, v, impl="cuda")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="'cpu' backend"):
            ops.local_attention(q, k, v, impl="pallas")
    with pytest.raises(ValueError, match="global_indices given as an array"):
        ops.longformer_attention(q, k, v, global_indices=jnp.array([0]), impl="interpret")
    with pytest.raises(ValueError, match="block_size=24 is not a power of two"):
        ops.bigbird_attention(q, k, v, block_size=24, num_random_blocks=0, impl="interpret")
    with pytest.raises(ValueError, match="a dense mask or a dense bias"):
        ops.softmax_attention(q, k, v, mask=jnp.ones((N, N), bool), impl="interpret")


def test_auto_falls_back_where_the_kernel_does_not_fit():
    q, k, v = qkv(9, N)
    out = jitted_call(ops.longformer_attention, q, k, v, global_indices=jnp.array([0]), impl="auto")
    assert_close(out, jitted_call(ops.longformer_attention, q, k, v, global_indices=(0,), impl="xla"), atol=1e-6)
    jaxpr = str(jax.make_jaxpr(functools.partial(ops.local_attention, window=4))(q, k, v))
    assert "pallas_call" not in jaxpr  # auto on this backend (or this short) runs XLA


def test_auto_choice_by_backend(monkeypatch):
    monkeypatch.setattr(impl, "device_backend", lambda: "gpu")
    for capability, auto, pallas in ((9.0, "gpu", "gpu"), (8.0, None, "gpu")):
        monkeypatch.setattr(impl, "_gpu_capability", lambda c=capability: c)
        assert getattr(impl.choose_kernel("auto", q_len=512), "backend", None) == auto
        assert impl.choose_kernel("pallas").backend == pallas
        assert impl.choose_kernel("auto", q_len=8) is None  # too short to pay for a launch
    monkeypatch.setattr(impl, "_gpu_capability", lambda: 7.5)
    with pytest.raises(ValueError, match="compute capability"):
        impl.choose_kernel("pallas")
    monkeypatch.setattr(impl, "device_backend", lambda: "tpu")
    assert impl.choose_kernel("auto", q_len=512) is None and impl.choose_kernel("pallas").backend == "tpu"


def test_model_impl_reaches_every_layer_and_matches_xla():
    tokens = jnp.arange(40) % 50
    base = dict(
        task="lm",
        vocab_size=50,
        num_layers=2,
        d_model=16,
        num_heads=2,
        max_len=40,
        attention="local",
        attention_kwargs={"window": 6},
    )
    config = ModelConfig(**base, impl="interpret", layer_overrides={1: {"impl": "xla"}})
    assert [config.bound_attention(i).hyper_parameters["impl"] for i in range(2)] == ["interpret", "xla"]
    key = jax.random.key(0)
    forward = eqx.filter_jit(lambda m, x: m(x))  # compiled: op by op, each operation compiles alone
    got = forward(build_model(config, key=key), tokens)
    want = forward(build_model(ModelConfig(**base, impl="xla"), key=key), tokens)
    assert_close(got, want, atol=2e-5)
    with pytest.raises(ValueError, match="has no Pallas kernel"):
        ModelConfig(**(base | {"attention": "axial", "attention_kwargs": {"width": 8}}), impl="pallas")


def test_segment_ids_keep_packed_sequences_apart():
    q, k, v = qkv(10, N)
    segments = (jnp.arange(N) // 10, jnp.arange(N) // 10)
    pattern = causal(N, N)
    got = block_sparse_attention(q, k, v, pattern, segment_ids=segments, interpret=True, block_sizes=BlockSizes(16, 16))
    want, _ = block_sparse_reference(q, k, v, pattern, segment_ids=segments)
    assert_close(got, want, atol=2e-6)
    # Each segment alone gives the same rows: nothing crosses a boundary.
    alone = ops.softmax_attention(q[10:20], k[10:20], v[10:20], causal=True, impl="xla")
    assert_close(got[10:20], alone, atol=2e-6)
    with pytest.raises(ValueError, match="key segment ids must be an int array of shape"):
        block_sparse_attention(q, k, v, pattern, segment_ids=(segments[0], segments[1][:5]), interpret=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_cudnn_route_maps_the_patterns(is_causal):
    from jxformers.kernels.cudnn import cudnn_attention, cudnn_unsupported

    q, k, v = qkv(11, N, d=16, dv=16)
    # implementation="xla" runs the very call the cudnn route makes, on any device.
    assert_close(
        cudnn_attention(q, k, v, causal=is_causal, implementation="xla"),
        ops.softmax_attention(q, k, v, causal=is_causal, impl="xla"),
        atol=2e-6,
    )
    assert_close(
        cudnn_attention(q, k, v, causal=is_causal, window=5, implementation="xla"),
        ops.local_attention(q, k, v, causal=is_causal, window=5, impl="xla"),
        atol=2e-6,
    )
    assert "bfloat16 or float16" in cudnn_unsupported(q, k, v, causal=is_causal)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    assert (cudnn_unsupported(*bf16, causal=is_causal, window=5) is None) == is_causal  # no right window in cuDNN
    with pytest.raises(ValueError, match="has no cuDNN route"):
        ops.block_local_attention(q, k, v, impl="cudnn")


@pytest.mark.parametrize("pattern", ["strided", "fixed"])
def test_auto_runs_sparse_transformer_through_the_kernel_on_hopper(monkeypatch, pattern):
    # Measured on an H100 (docs/kernels.md): the two-part kernel beats the XLA op, so
    # "auto" takes it where choose_kernel takes the other fixed patterns' kernel.
    import jxformers.ops.sparse as sparse

    taken = []
    for name in ("_strided_kernel", "_fixed_kernel"):
        monkeypatch.setattr(
            sparse,
            name,
            lambda q, k, v, choice, name=name, **kw: (
                taken.append((name, choice)) or jnp.zeros(q.shape[:2] + v.shape[2:], q.dtype)
            ),
        )
    q, k, v = qkv(0, 256)

    def attend(q, k, v):
        """The op traced, not compiled or run (the choice is made while it traces); a new
        function each time, so that no trace is reused from JAX's cache."""
        return jax.eval_shape(
            lambda q, k, v: eager_ops.sparse_transformer_attention(q, k, v, stride=16, pattern=pattern), q, k, v
        )

    attend(q, k, v)
    assert taken == []  # on this CPU: the XLA op
    monkeypatch.setattr(impl, "device_backend", lambda: "gpu")
    monkeypatch.setattr(impl, "_gpu_capability", lambda: 9.0)
    attend(q[:100], k[:100], v[:100])
    assert taken == []  # too few queries for a kernel launch to pay
    attend(q, k, v)
    assert [(name, choice.backend) for name, choice in taken] == [(f"_{pattern}_kernel", "gpu")]


def test_auto_prefers_cudnn_where_it_fits(monkeypatch):
    monkeypatch.setattr(impl, "device_backend", lambda: "gpu")
    monkeypatch.setattr(impl, "_gpu_capability", lambda: 9.0)
    assert impl.choose_kernel("auto", q_len=512, cudnn=True).backend == "cudnn"
    assert impl.choose_kernel("auto", q_len=512, cudnn="float32 inputs").backend == "gpu"
    assert impl.choose_kernel("cudnn", cudnn=True).backend == "cudnn"
    with pytest.raises(ValueError, match="cannot run this call: float32 inputs"):
        impl.choose_kernel("cudnn", cudnn="float32 inputs")


def test_the_gpu_kernels_lower_for_cuda_through_triton():
    # Lowered from this CPU for a CUDA device (Pallas's Triton lowering runs here; only
    # Triton's compiler needs the GPU): an unsupported primitive or block shape in the
    # forward, dq or dk/dv kernels, with every optional input, fails here first.
    n = 200
    q, k, v = (jnp.ones((n, h, 64), jnp.bfloat16) for h in (4, 2, 2))
    slopes = alibi_slopes(4)
    calls = {
        "segment ids + kv_mask + alibi + softcap + sinks": dict(
            segment_ids=(jnp.arange(n) // 70,) * 2,
            kv_mask=jnp.arange(n) < 190,
            alibi=Alibi(slopes),
            softcap=30.0,
            sinks="zero",
        ),
        "extra blocks": dict(extra_blocks=jnp.zeros((4, 2), jnp.int32), block_sizes=BlockSizes(64, 64, 64, 64)),
    }
    for name, kw in calls.items():

        def loss(q, k, v, slopes):
            kw_ = dict(kw, alibi=Alibi(slopes)) if "alibi" in kw else kw  # noqa: B023 - called within this iteration
            out = block_sparse_attention(q, k, v, union(Band(-40, 40), KeyRange(0, 8)), **kw_)
            return jnp.sum(out.astype(jnp.float32))

        try:
            with cuda_target():
                text = (
                    jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
                    .trace(q, k, v, slopes)
                    .lower(lowering_platforms=("cuda",))
                    .as_text()
                )
        except RuntimeError as e:  # a jaxlib built without the GPU lowering's dialects
            if "triton" in str(e).lower() and "dialect" in str(e).lower():
                pytest.skip(f"no Triton lowering in this jaxlib: {e}")
            raise
        for kernel in ("forward", "dq", "dkv"):
            assert f"block_sparse_flash_{kernel}" in text, (name, kernel)
