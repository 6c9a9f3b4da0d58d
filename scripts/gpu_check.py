"""Check the Pallas kernels against their references on a real accelerator (the CPU
suite runs them in interpret mode only): outputs and gradients for each pattern, float32
and bf16, odd lengths, grouped-query heads and padding. Prints one line per case and
exits non-zero on a mismatch.

    python scripts/gpu_check.py            # on a GPU (or TPU: --backend tpu)
    python scripts/gpu_check.py --backend mosaic_gpu   # the Mosaic GPU forward (Hopper; 16-bit only)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jxformers.kernels import (
    Alibi,
    Band,
    BlockSizes,
    KeyRange,
    block_sparse_attention,
    block_sparse_reference,
    causal,
    intersect,
    union,
)
from jxformers.kernels.pattern import dense_mask
from jxformers.nn import alibi_slopes
from jxformers.tools.help_text import description

# The kernel impl the training check compares with XLA ("interpret" runs it on a CPU).
IMPL = "pallas" if jax.default_backend() != "cpu" else "interpret"


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cases(n):
    return {
        "dense": Band(),
        "causal": causal(n, n),
        "window64": Band(-64, 64),
        "causal_window64": intersect(Band(-64, 64), causal(n, n)),
        "dilated": Band(-96, 96, step=3),
        "block_local": Band(0, 0, unit=64),
        "longformer": union(Band(-32, 32), KeyRange(0, 2)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=description(__doc__))
    parser.add_argument("--backend", default="gpu", help="gpu, tpu or mosaic_gpu (its forward; the Triton backward)")
    parser.add_argument(
        "--block",
        type=int,
        nargs=2,
        default=[64, 64],
        metavar=("Q", "K"),
        help="the kernel's forward blocks (Mosaic GPU: block_q 128 runs two consumer warpgroups)",
    )
    parser.add_argument("--training-only", action="store_true", help="only the cuDNN/segment routes and training")
    parser.add_argument("--no-training", action="store_true", help="skip the training curves (the longest part)")
    args = parser.parse_args(argv)
    if args.training_only:
        return 1 if check_routes() + check_training() else 0
    print("devices:", jax.devices(), "jax", jax.__version__)
    failures = 0
    for dtype, tol in ((jnp.float32, 2e-4), (jnp.bfloat16, 2e-2)):
        for n, heads, kv_heads, d in ((509, 4, 2, 64), (1024, 4, 4, 128)):
            # float32 is checked at d = 64 only; the Mosaic GPU forward takes 16-bit inputs only.
            if dtype == jnp.float32 and (d == 128 or args.backend == "mosaic_gpu"):
                continue
            keys = jax.random.split(jax.random.PRNGKey(n + d), 5)
            q = jax.random.normal(keys[0], (n, heads, d), dtype)
            k = jax.random.normal(keys[1], (n, kv_heads, d), dtype)
            v = jax.random.normal(keys[2], (n, kv_heads, d), dtype)
            do = jax.random.normal(keys[3], (n, heads, d), dtype)
            kv_mask = jnp.arange(n) < n - 7
            for name, pattern in cases(n).items():

                def run(fn, q, k, v, pattern=pattern):
                    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v), q, k, v)
                    return (out, *vjp(do.astype(out.dtype)))  # noqa: B023 - called within this iteration

                kernel = jax.jit(
                    lambda q, k, v, pattern=pattern, kv_mask=kv_mask: run(
                        lambda q, k, v: block_sparse_attention(
                            q,
                            k,
                            v,
                            pattern,
                            kv_mask=kv_mask,
                            backend=args.backend,
                            block_sizes=BlockSizes(*args.block),
                        ),
                        q,
                        k,
                        v,
                    )
                )
                ref = jax.jit(
                    lambda q, k, v, pattern=pattern, kv_mask=kv_mask: run(
                        lambda q, k, v: block_sparse_reference(q, k, v, pattern, kv_mask=kv_mask)[0],
                        q,
                        k,
                        v,
                    )
                )
                try:
                    got = kernel(q, k, v)
                except Exception as e:  # noqa: BLE001 - one failing case is reported; the rest still run
                    failures += 1
                    print(
                        f"FAIL {jnp.dtype(dtype).name:8s} n={n} h={heads}/{kv_heads} d={d} {name:16s} "
                        f"raised {type(e).__name__}: {str(e)[:300]}",
                        flush=True,
                    )
                    continue
                with jax.default_matmul_precision("highest"):  # the reference in full float32, not TF32
                    want = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
                errors = [rel(a, b) for a, b in zip(got, want, strict=True)]
                finite = all(bool(jnp.isfinite(x).all()) for x in got)
                ok = finite and max(errors) < tol
                failures += not ok
                print(
                    f"{'ok  ' if ok else 'FAIL'} {jnp.dtype(dtype).name:8s} n={n} h={heads}/{kv_heads} d={d} "
                    f"{name:16s} "
                    f"rel err out/dq/dk/dv = {' '.join(f'{e:.1e}' for e in errors)}"
                )
    failures += check_non_finite(args.backend, BlockSizes(*args.block))
    failures += check_score_options(args.backend, BlockSizes(*args.block))
    if args.backend != "mosaic_gpu":  # the routes and training run the ops' default kernel
        failures += check_routes()
        if not args.no_training:
            failures += check_training()
    print(f"{failures} failure(s)")
    return 1 if failures else 0


# Logit soft-capping and attention sinks (the XLA op's options, in every flash kernel):
# (label, keyword arguments); "learned" sinks also take sink_logits, whose gradient is checked.
SCORE_OPTIONS = (
    ("softcap 30", {"softcap": 30.0}),
    ("sink zero", {"sinks": "zero"}),
    ("sink learned", {"sinks": "learned"}),
    ("softcap+learned", {"softcap": 30.0, "sinks": "learned"}),
)


def check_score_options(backend: str, block_sizes: BlockSizes, n: int = 509) -> int:
    """Soft-capping and sinks on the hardware: outputs and gradients (q, k, v and the sink
    logits) against the float32 reference, causal and a causal window, grouped-query heads,
    padding, an odd length `n`, in bf16 (and float32 on the Triton kernels)."""
    heads, kv_heads, d = 4, 2, 64
    kv_mask = jnp.arange(n) < n - 7

    def kernel_fn(q, k, v, pattern, **kw):
        return block_sparse_attention(q, k, v, pattern, kv_mask=kv_mask, backend=backend, block_sizes=block_sizes, **kw)

    def reference_fn(q, k, v, pattern, **kw):
        return block_sparse_reference(q, k, v, pattern, kv_mask=kv_mask, **kw)[0]

    def run(fn, q, k, v, b, do, pattern, options):
        def attend(q, k, v, b):  # b, the sink logits, is read only by the learned sinks
            return fn(q, k, v, pattern, **options, **({"sink_logits": b} if options.get("sinks") == "learned" else {}))

        out, vjp = jax.vjp(attend, q, k, v, b)
        return (out, *vjp(do.astype(out.dtype)))

    failures = 0
    dtypes = ((jnp.bfloat16, 2e-2),) if backend == "mosaic_gpu" else ((jnp.float32, 2e-4), (jnp.bfloat16, 2e-2))
    patterns = (("causal", causal(n, n)), ("causal_window64", intersect(Band(-64, 64), causal(n, n))))
    for dtype, tol in dtypes:
        keys = jax.random.split(jax.random.PRNGKey(7), 5)
        q = 3 * jax.random.normal(keys[0], (n, heads, d), dtype)  # large logits, so the cap bites
        k = jax.random.normal(keys[1], (n, kv_heads, d), dtype)
        v = jax.random.normal(keys[2], (n, kv_heads, d), dtype)
        do = jax.random.normal(keys[3], (n, heads, d), dtype)
        sink_logits = jax.random.normal(keys[4], (heads,), jnp.float32)
        for name, pattern in patterns:
            for label, options in SCORE_OPTIONS:
                learned = options.get("sinks") == "learned"
                kernel = jax.jit(lambda *a, p=pattern, o=options: run(kernel_fn, *a, p, o))
                reference = jax.jit(lambda *a, p=pattern, o=options: run(reference_fn, *a, p, o))
                try:
                    got = kernel(q, k, v, sink_logits, do)
                except Exception as e:  # noqa: BLE001 - one failing case is reported; the rest still run
                    failures += 1
                    print(f"FAIL {jnp.dtype(dtype).name:8s} {name} {label}: raised {type(e).__name__}: {str(e)[:300]}")
                    continue
                with jax.default_matmul_precision("highest"):
                    want = reference(*(x.astype(jnp.float32) for x in (q, k, v)), sink_logits, do)
                count = 5 if learned else 4  # without learned sinks, sink_logits gets no gradient
                errors = [rel(a, b) for a, b in zip(got[:count], want[:count], strict=True)]
                finite = all(bool(jnp.isfinite(x).all()) for x in got[:count])
                ok = finite and max(errors) < tol
                failures += not ok
                print(
                    f"{'ok  ' if ok else 'FAIL'} {jnp.dtype(dtype).name:8s} n={n} h={heads}/{kv_heads} d={d} "
                    f"{name:16s} {label:16s} rel err out/dq/dk/dv{'/dsink' if learned else ''} = "
                    + " ".join(f"{e:.1e}" for e in errors)
                )
    return failures


def check_non_finite(backend: str, block_sizes: BlockSizes) -> int:
    """Non-finite keys and values on the hardware (the CPU suite sees interpret mode only):
    inf keys and NaN values at padded positions change no real output or gradient, and a
    NaN key at one real position makes NaN exactly the rows whose pattern reads it."""
    from jxformers import ops

    failures = 0
    n, real, j = 509, 502, 200
    keys = jax.random.split(jax.random.PRNGKey(11), 4)
    q = jax.random.normal(keys[0], (n, 4, 64), jnp.bfloat16)
    k = jax.random.normal(keys[1], (n, 2, 64), jnp.bfloat16)
    v = jax.random.normal(keys[2], (n, 2, 64), jnp.bfloat16)
    kv_mask = jnp.arange(n) < real
    dirty_k, dirty_v = k.at[real:].set(jnp.inf), v.at[real:].set(jnp.nan)
    for name, pattern in cases(n).items():

        def loss(k, v, pattern=pattern, mask=kv_mask):
            out = block_sparse_attention(
                q, k, v, pattern, kv_mask=mask, backend=backend, block_sizes=block_sizes, interpret=IMPL == "interpret"
            )
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, clean), clean_grads = grad(k, v)
        (_, dirty), dirty_grads = grad(dirty_k, dirty_v)
        padded_ok = (
            bool(jnp.isfinite(dirty).all())
            and bool(jnp.array_equal(dirty, clean))
            and all(bool(jnp.isfinite(g).all()) for g in dirty_grads)
            and all(bool(jnp.array_equal(a[:real], b[:real])) for a, b in zip(dirty_grads, clean_grads, strict=True))
            and all(float(jnp.abs(g[real:].astype(jnp.float32)).max()) == 0 for g in dirty_grads)
        )
        (_, poisoned), _ = grad(k.at[j].set(jnp.nan), v)
        rows_nan = np.isnan(np.asarray(poisoned, np.float32)).any(axis=(1, 2))
        reads = dense_mask(pattern, n, n)[:, j]
        nan_ok = bool(np.array_equal(rows_nan, reads))
        ok = padded_ok and nan_ok
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} non-finite {name:16s} padded inf/NaN unchanged: {padded_ok}; "
            f"NaN key at {j}: {int(rows_nan.sum())} NaN rows, {int(reads.sum())} read it"
        )
    if backend == "mosaic_gpu":
        return failures
    # Through an op, with a NaN value (the ops keep it to the rows that weigh it).
    poisoned = ops.local_attention(q, k, v.at[j].set(jnp.nan), window=64, kv_mask=kv_mask, impl=IMPL)
    return failures + nan_rows_match(f"non-finite local op NaN value at {j}", poisoned, np.abs(np.arange(n) - j) <= 64)


def nan_rows_match(what: str, out, reads, *, later_rows_from: int | None = None) -> int:
    """Print whether the NaN rows of `out` are exactly `reads` (with `later_rows_from=j`:
    `reads` and any rows from j on, the causal ops' superset); 1 on a mismatch."""
    rows_nan = np.isnan(np.asarray(out, np.float32)).any(axis=(1, 2))
    if later_rows_from is None:
        ok = bool(np.array_equal(rows_nan, reads))
    else:
        ok = bool(np.all(rows_nan[reads]) and not np.any(rows_nan[:later_rows_from]))
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {int(rows_nan.sum())} NaN rows, {int(reads.sum())} read it")
    return int(not ok)


def check_routes() -> int:
    """cuDNN through the ops (impl="cudnn"), segment ids and ALiBi (output and slope
    gradient) in the kernel, against XLA."""
    from jxformers import ops

    failures = 0
    n = 1000
    keys = jax.random.split(jax.random.PRNGKey(5), 3)
    q, k, v = (jax.random.normal(x, (n, 8, 64), jnp.bfloat16) for x in keys)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    segments = (jnp.arange(n) // 300, jnp.arange(n) // 300)
    slopes = alibi_slopes(8)

    def alibi_run(fn, *qkv):
        out, vjp = jax.vjp(lambda s: fn(*qkv, Alibi(s)).astype(jnp.float32), slopes)
        return jnp.concatenate([out.ravel(), *vjp(jnp.ones_like(out))])

    with jax.default_matmul_precision("highest"):
        cases = {
            "cudnn softmax causal": (
                ops.softmax_attention(q, k, v, causal=True, impl="cudnn"),
                ops.softmax_attention(*f32, causal=True, impl="xla"),
            ),
            "cudnn local causal w=100": (
                ops.local_attention(q, k, v, window=100, causal=True, impl="cudnn"),
                ops.local_attention(*f32, window=100, causal=True, impl="xla"),
            ),
            "kernel segment ids": (
                block_sparse_attention(q, k, v, causal(n, n), segment_ids=segments),
                block_sparse_reference(*f32, causal(n, n), segment_ids=segments)[0],
            ),
            "kernel alibi causal": (
                alibi_run(lambda q, k, v, a: block_sparse_attention(q, k, v, causal(n, n), alibi=a), q, k, v),
                alibi_run(lambda q, k, v, a: block_sparse_reference(q, k, v, causal(n, n), alibi=a)[0], *f32),
            ),
        }
    failures += check_cudnn_non_finite(q, k, v)
    for name, (got, want) in cases.items():
        err = rel(got, want)
        ok = err < 2e-2 and bool(jnp.isfinite(got).all())
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:24s} rel err {err:.1e}")
    return failures


def check_cudnn_non_finite(q, k, v, j: int = 400) -> int:
    """cuDNN's fused attention with a NaN at one position: a NaN key straight into
    `jax.nn.dot_product_attention` (does cuDNN's mask keep its score from the rows that
    do not read it?), and a NaN value through the ops' cuDNN route (poisoned keys): the
    rows that read it NaN, no earlier row (causal ops mark every later row)."""
    from jxformers import ops

    n = q.shape[0]
    reads = {"causal": np.arange(n) >= j, "causal window 100": (np.arange(n) >= j) & (np.arange(n) <= j + 100)}
    failures = 0
    for name, read in reads.items():
        window = 100 if "window" in name else None
        raw = jax.nn.dot_product_attention(
            q[None],
            k.at[j].set(jnp.nan)[None],
            v[None],
            is_causal=True,
            local_window_size=None if window is None else (window, 0),
            implementation="cudnn",
        )[0]
        through_op = ops.local_attention if window else ops.softmax_attention
        kwargs = {"window": window} if window else {}
        op = through_op(q, k, v.at[j].set(jnp.nan), causal=True, impl="cudnn", **kwargs)
        failures += nan_rows_match(f"cudnn {name} NaN key, raw call at {j}", raw, read)
        # causal ops mark every row from j on (a superset; ops/_common.py)
        failures += nan_rows_match(f"cudnn {name} NaN value, op at {j}", op, read, later_rows_from=j)
    return failures


def check_training(steps: int = 8) -> int:
    """A small language model trained with impl="pallas" against the same model with
    impl="xla": the loss curves agree (every fixed-pattern attention, bf16 compute)."""
    import equinox as eqx
    import optax

    from jxformers import ModelConfig, build_model

    failures = 0
    cases = {
        "softmax": {},
        "local": {"window": 64},
        "block_local": {"block_size": 64},
        "dilated": {"window": 32},
        "longformer": {"window": 64, "global_indices": (0, 1)},
        "sparse_transformer": {"stride": 32},
    }
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 512), 0, 256)
    for name, hp in cases.items():
        curves = {}
        for impl in ("xla", IMPL):
            config = ModelConfig(
                task="lm",
                vocab_size=256,
                num_layers=2,
                d_model=128,
                num_heads=4,
                max_len=512,
                attention={"name": name, "impl": impl, **hp},
                dtype="bfloat16",
            )
            model = build_model(config, key=jax.random.PRNGKey(1))
            optimizer = optax.adam(1e-3)
            state = optimizer.init(eqx.filter(model, eqx.is_array))

            @eqx.filter_jit
            def step(model, state):
                def loss_fn(model):
                    logits = jax.vmap(model)(tokens[:, :-1])
                    return optax.softmax_cross_entropy_with_integer_labels(
                        logits.astype(jnp.float32), tokens[:, 1:]
                    ).mean()

                loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
                updates, state = optimizer.update(grads, state, eqx.filter(model, eqx.is_array))  # noqa: B023 - called within this iteration
                return eqx.apply_updates(model, updates), state, loss

            losses = []
            for _ in range(steps):
                model, state, loss = step(model, state)
                losses.append(float(loss))
            curves[impl] = losses
        gap = max(abs(a - b) for a, b in zip(curves["xla"], curves[IMPL], strict=True))
        ok = gap < 0.05 and all(np.isfinite(curves[IMPL])) and curves[IMPL][-1] < curves[IMPL][0]
        failures += not ok
        print(
            f"{'ok  ' if ok else 'FAIL'} training {name:18s} loss xla {curves['xla'][0]:.3f}->{curves['xla'][-1]:.3f} "
            f"{IMPL} {curves[IMPL][0]:.3f}->{curves[IMPL][-1]:.3f} max gap {gap:.4f}"
        )
    return failures


if __name__ == "__main__":
    sys.exit(main())
