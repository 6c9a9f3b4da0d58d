"""Check the Pallas kernels against their references on a real accelerator (the CPU
suite runs them in interpret mode only): outputs and gradients for each pattern, float32
and bf16, odd lengths, grouped-query heads and padding. Prints one line per case and
exits non-zero on a mismatch.

    python scripts/gpu_check.py            # on a GPU (or TPU: --backend tpu)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jxformers.kernels import Band, BlockSizes, KeyRange, block_sparse_attention, block_sparse_reference, causal
from jxformers.kernels import intersect, union


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gpu")
    args = parser.parse_args(argv)
    print("devices:", jax.devices(), "jax", jax.__version__)
    failures = 0
    for dtype, tol in ((jnp.float32, 2e-4), (jnp.bfloat16, 2e-2)):
        for n, heads, kv_heads, d in ((509, 4, 2, 64), (1024, 4, 4, 128)):
            if dtype == jnp.float32 and d == 128:
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
                    return (out, *vjp(do.astype(out.dtype)))

                kernel = jax.jit(lambda q, k, v, pattern=pattern: run(lambda q, k, v: block_sparse_attention(
                    q, k, v, pattern, kv_mask=kv_mask, backend=args.backend, block_sizes=BlockSizes(64, 64)), q, k, v))
                ref = jax.jit(lambda q, k, v, pattern=pattern: run(lambda q, k, v: block_sparse_reference(
                    q, k, v, pattern, kv_mask=kv_mask)[0], q, k, v))
                got = kernel(q, k, v)
                with jax.default_matmul_precision("highest"):  # the reference in full float32, not TF32
                    want = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
                errors = [rel(a, b) for a, b in zip(got, want)]
                finite = all(bool(jnp.isfinite(x).all()) for x in got)
                ok = finite and max(errors) < tol
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {jnp.dtype(dtype).name:8s} n={n} h={heads}/{kv_heads} d={d} {name:16s} "
                      f"rel err out/dq/dk/dv = {' '.join(f'{e:.1e}' for e in errors)}")
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
