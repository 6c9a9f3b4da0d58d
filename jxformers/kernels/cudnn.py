"""cuDNN's fused attention through `jax.nn.dot_product_attention`, for the patterns it
covers: dense, causal (q_len == kv_len) and a causal sliding window, without padding masks.

On an H100 it is 2-3x faster than the Pallas kernel for these (docs/kernels.md), so
`impl="auto"` sends such calls here on GPUs; `impl="cudnn"` asks for it explicitly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jxformers._arrays import poison_keys

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_unsupported(
    q, k, v, *, causal: bool, kv_mask=None, mask=None, bias=None, window: int | None = None
) -> str | None:
    """Why cuDNN's fused attention cannot take this call, or None when it can."""
    if window is not None and not causal:
        return "cuDNN takes a sliding window only with causal=True (no right window; seen on an H100, cuDNN 9)"
    if mask is not None or bias is not None or kv_mask is not None:
        return "cuDNN takes no mask, bias or kv_mask here"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in CUDNN_DTYPES:
        return f"cuDNN's flash attention takes bfloat16 or float16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[2] != v.shape[2] or q.shape[2] > 128 or q.shape[2] % 8:
        return f"cuDNN needs d_k == d_v, a multiple of 8 and <= 128; got d_k={q.shape[2]}, d_v={v.shape[2]}"
    if causal and q.shape[0] != k.shape[0]:
        return f"cuDNN aligns causal masks top-left; q_len={q.shape[0]} != kv_len={k.shape[0]}"
    return None


def cudnn_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    implementation: str = "cudnn",
):
    """`[q_len, heads, d]` attention through `jax.nn.dot_product_attention`: keys with
    j <= i when causal, |i - j| <= window (j >= i - window when causal) when given.
    `implementation="xla"` runs the same call anywhere (tests)."""
    window_size = None if window is None else (window, 0 if causal else window)
    k, v = poison_keys(k, v)  # a non-finite value reaches only the rows that read it (masked slots weigh 0)
    out = jax.nn.dot_product_attention(
        q[None],
        k[None],
        v[None],
        scale=scale,
        is_causal=causal,
        local_window_size=window_size,
        implementation=implementation,
    )
    return out[0]
