"""Benchmark the mixture-of-experts layer (jxformers/nn/moe.py) against a dense FFN with
the same active FLOPs per token, and the grouped matmul it is built on against a dense
matmul of the same total size, side by side in one run; with `--simulate-devices N` (on
CPU), also expert parallelism (jxformers/nn/moe_sharded.py) over N simulated devices.

FLOPs counted: an FFN of width f on T tokens costs 2 T d f per matrix (2 matrices for
relu/gelu, 3 for the gated kinds) forward and twice that backward. The MoE's active
count is T k experts' worth (k = top_k; expert choice: cf experts per token on average),
the dense FFN's width is k f so its count is the same; "computed" adds what the
dispatch really multiplies: capacity buffers E C slots (cf times the active count, empty
slots included), dropless ragged exactly T k rows, dropless padded E seq slots per
example (E / k times the active count). The router (2 T d E) is not counted.

    python scripts/bench_moe.py --simulate-devices 8 --out docs/moe_runs/cpu.md   # CPU
    python scripts/bench_moe.py --dtype bfloat16 --out docs/moe_runs/gpu.md        # GPU
"""

from __future__ import annotations

import argparse
import os
import sys

from jxformers.tools.bench import simulate_cpu_devices

if __name__ == "__main__":
    simulate_cpu_devices(sys.argv[1:])

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import timed, write_markdown

from jxformers.nn.layers import FeedForward
from jxformers.nn.moe import MoE, grouped_matmul
from jxformers.nn.moe_sharded import expert_parallel_moe

GATED = ("geglu", "swiglu")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8, help="examples per call (each one routing group)")
    p.add_argument("--seq", type=int, default=256, help="tokens per example")
    p.add_argument("--d-model", type=int, default=256, help="model width d")
    p.add_argument("--d-ff", type=int, default=512, help="hidden width f of one expert")
    p.add_argument("--experts", type=int, default=8, help="number of experts E")
    p.add_argument("--top-k", type=int, default=2, help="experts per token k (token choice)")
    p.add_argument("--ffn", default="gelu", help="expert FFN kind (relu, gelu, geglu, swiglu)")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="capacity factor of the capacity dispatch")
    p.add_argument(
        "--gmm",
        default="64,8",
        help="E,k of the grouped-matmul comparison (the issue's target is stated at E = 64, k = 8)",
    )
    p.add_argument("--dtype", default="float32", help="activations and weights (bfloat16 on a GPU)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per row (median)")
    p.add_argument(
        "--simulate-devices",
        type=int,
        default=0,
        help="on CPU: N simulated devices (set before jax starts) and the expert-parallel rows",
    )
    p.add_argument("--out", help="write the markdown tables here")
    return p


def _matrices(kind: str) -> int:
    return 3 if kind in GATED else 2


def _fwd_bwd(layer_fn, x):
    """jit(grad) of sum(layer(x)) w.r.t. the layer's arrays and x: one forward+backward."""

    def loss(layer, x):
        y = layer_fn(layer, x)
        return jnp.sum(y.astype(jnp.float32))

    return eqx.filter_jit(eqx.filter_grad(loss))


def layer_rows(a, dtype):
    """(name, computed GFLOP, ms) for the dense FFN and each dispatch, forward+backward."""
    t, d, f, e, k = a.batch * a.seq, a.d_model, a.d_ff, a.experts, a.top_k
    x = jax.random.normal(jax.random.key(0), (a.batch, a.seq, d), dtype)
    per_matrix = 2 * t * d * f * _matrices(a.ffn) * 3 / 1e9  # forward + backward (x3), per expert-width f
    cast = lambda m: jax.tree.map(lambda w: w.astype(dtype) if eqx.is_inexact_array(w) else w, m)  # noqa: E731
    dense = cast(FeedForward(d, k * f, a.ffn, key=jax.random.key(1)))
    rows = [
        (
            "dense FFN, width k f",
            per_matrix * k,
            timed(_fwd_bwd(lambda m, x: jax.vmap(m)(x), x), dense, x, repeat=a.repeat),
        )
    ]
    variants = [
        (
            f"MoE top-{k}, capacity cf={a.capacity_factor}",
            dict(top_k=k, capacity_factor=a.capacity_factor),
            a.capacity_factor * k,
        ),
        (f"MoE top-{k}, dropless, ragged (ragged_dot)", dict(top_k=k, dropless=True, dropless_method="ragged"), k),
        (f"MoE top-{k}, dropless, padded (C = seq)", dict(top_k=k, dropless=True, dropless_method="padded"), e),
        (f"MoE expert choice, cf={k}", dict(router="expert_choice", capacity_factor=float(k)), k),
    ]
    for name, settings, slots_per_token in variants:
        moe = cast(MoE(d, f, e, ffn=a.ffn, min_capacity=1, key=jax.random.key(2), **settings))
        fn = _fwd_bwd(lambda m, x: jax.vmap(lambda xi: m(xi)[0])(x), x)
        rows.append((name, per_matrix * slots_per_token, timed(fn, moe, x, repeat=a.repeat)))
    return rows, per_matrix * k


def gmm_rows(a, dtype):
    """The grouped matmul of a dropless layer (rows sorted by expert, balanced groups)
    against one dense matmul of the same [T k, d] x [d, f] size, forward only."""
    e, k = (int(v) for v in a.gmm.split(","))
    rows_n, d, f = a.batch * a.seq * k, a.d_model, a.d_ff
    x = jax.random.normal(jax.random.key(3), (rows_n, d), dtype)
    w = jax.random.normal(jax.random.key(4), (e, d, f), dtype) / np.sqrt(d)
    sizes = jnp.full((e,), rows_n // e, jnp.int32).at[0].add(rows_n % e)
    gflop = 2 * rows_n * d * f / 1e9
    ms_g = timed(jax.jit(grouped_matmul), x, w, sizes, repeat=a.repeat)
    ms_d = timed(jax.jit(lambda x, w: x @ w), x, w[0], repeat=a.repeat)
    return e, k, rows_n, gflop, ms_g, ms_d


def sharded_rows(a, dtype):
    """Expert parallelism over every device against the same layer on one device (the
    same routing groups: one per device), forward+backward, capacity dispatch."""
    n = len(jax.devices())
    if a.batch % n or a.experts % n:
        raise SystemExit(f"--batch ({a.batch}) and --experts ({a.experts}) must be multiples of the {n} devices")
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    per = a.batch // n
    x = jax.random.normal(jax.random.key(0), (a.batch, a.seq, a.d_model), dtype)
    moe = MoE(
        a.d_model,
        a.d_ff,
        a.experts,
        top_k=a.top_k,
        ffn=a.ffn,
        capacity_factor=a.capacity_factor,
        min_capacity=1,
        key=jax.random.key(2),
    )
    moe = jax.tree.map(lambda w: w.astype(dtype) if eqx.is_inexact_array(w) else w, moe)

    def one_device(m, x):
        groups = x.reshape(n, per * a.seq, a.d_model)
        return jax.vmap(lambda g: m(g)[0])(groups).reshape(x.shape)

    def parallel(m, x):
        return expert_parallel_moe(m, x, mesh=mesh)[0]

    return n, [
        ("one device, groups vmapped", timed(_fwd_bwd(one_device, x), moe, x, repeat=a.repeat)),
        (f"expert parallel over {n} devices", timed(_fwd_bwd(parallel, x), moe, x, repeat=a.repeat)),
    ]


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    setting = (
        f"{a.dtype}, T = {a.batch} x {a.seq} tokens, d = {a.d_model}, expert width f = {a.d_ff}, "
        f"E = {a.experts}, k = {a.top_k}, ffn {a.ffn}; forward+backward, median of {a.repeat}"
    )
    rows, active = layer_rows(a, dtype)
    base = rows[0][2]
    table = [
        [name, f"{gf:.2f}", f"{gf / active:.2f}", f"{ms:.2f}", f"{ms / base:.2f}", f"{1e3 * gf / ms:.1f}"]
        for name, gf, ms in rows
    ]
    header = ["layer", "computed GFLOP", "computed / active", "ms", "time vs dense", "computed GFLOP/s"]
    e, k, rows_n, gflop, ms_g, ms_d = gmm_rows(a, dtype)
    footer = (
        f"\nGrouped matmul (`grouped_matmul`, jax.lax.ragged_dot) at E = {e}, k = {k}: [{rows_n}, "
        f"{a.d_model}] rows in {e} balanced groups times [{e}, {a.d_model}, {a.d_ff}], forward: "
        f"{ms_g:.2f} ms ({1e3 * gflop / ms_g:.1f} GFLOP/s) against {ms_d:.2f} ms "
        f"({1e3 * gflop / ms_d:.1f} GFLOP/s) for "
        f"one dense matmul of the same size: {ms_d / ms_g:.0%} of dense (target on a GPU: at least 50%).\n"
    )
    if a.simulate_devices > 1 or len(jax.devices()) > 1:
        n, srows = sharded_rows(a, dtype)
        footer += (
            f"\nExpert parallelism ({n} devices, mesh axis 'expert', capacity dispatch, forward+backward): "
            + "; ".join(f"{name} {ms:.2f} ms" for name, ms in srows)
            + f"; ratio {srows[1][1] / srows[0][1]:.2f}."
        )
        if jax.devices()[0].platform == "cpu":
            footer += (
                " Simulated CPU devices share this machine's cores: the ratio weighs the shard_map and its "
                "two all_to_alls against the same work on one device (below 1 where XLA runs the devices' "
                "programs in parallel threads); it predicts nothing about a real cluster."
            )
        footer += "\n"
    for row in table:
        print(" | ".join(row))
    print(footer)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        write_markdown(a.out, "bench_moe.py", argv, setting, header, table, footer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
