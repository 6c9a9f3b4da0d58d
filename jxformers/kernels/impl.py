"""Which implementation runs an op: the `impl` argument of every kernel-backed op.

    impl="auto"       the Pallas kernel on a backend it was built and tested for, the XLA op elsewhere
    impl="xla"        the pure-JAX op (runs everywhere; the reference the kernels are tested against)
    impl="pallas"     the Pallas kernel; a ValueError naming the backend where it cannot run
    impl="interpret"  the Pallas kernel in interpret mode, on any backend (slow: tests, debugging)
    impl="cudnn"      cuDNN's fused attention (GPU; softmax, local and dilated attention, bf16/fp16,
                      no padding mask); a ValueError for the other ops

Kernels here are written for two Pallas backends: "gpu" (the Triton lowering, which JAX
still ships and which runs on Ampere and Hopper; tested on an H100) and "tpu" (Mosaic
TPU, tested in TPU interpret mode only). "auto" picks the kernel on NVIDIA GPUs of
compute capability >= 9.0 only: the one device class it was measured on, and there
prefers cuDNN where the op has a cuDNN route that fits the call (2-3x faster, measured).
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS = ("auto", "xla", "pallas", "interpret", "cudnn")
# Compute capabilities "auto" sends to the GPU kernels (measured there); "pallas" also
# runs from 8.0 (the Triton lowering's minimum for bf16 dot products).
AUTO_MIN_CAPABILITY = 9.0
PALLAS_MIN_CAPABILITY = 8.0
# Below this many queries "auto" keeps the XLA op: one partly filled tile of work does
# not pay for a kernel launch (decoding steps run q_len = 1).
AUTO_MIN_QUERIES = 128


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Where a Pallas kernel runs: `backend` "gpu" or "tpu" (which kernel variant) and
    `interpret` (run it in interpret mode)."""

    backend: str
    interpret: bool = False


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}; got {impl!r}")
    return impl


def _gpu_capability() -> float | None:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    try:
        return float(device.compute_capability)
    except (AttributeError, TypeError, ValueError):  # ROCm devices report no CUDA capability
        return None


def device_backend() -> str:
    """The default device's platform: "cpu", "gpu" or "tpu"."""
    return jax.default_backend()


def choose_kernel(
    impl: str,
    *,
    unsupported: str | None = None,
    what: str = "this op",
    q_len: int | None = None,
    cudnn: bool | str = False,
) -> KernelChoice | None:
    """The kernel to run for `impl`, or None for the XLA op; `KernelChoice("cudnn")`
    for cuDNN's fused attention.

    `unsupported` is why the kernel cannot take this particular call (a hyper-parameter
    or shape outside what it handles), or None when it can: "auto" then falls back to
    XLA and "pallas"/"interpret" raise it as a ValueError. "auto" also keeps XLA for
    fewer than `AUTO_MIN_QUERIES` queries. `cudnn`: False when the op has no cuDNN
    route, True when the call fits it, else why it does not.
    """
    check_impl(impl)
    if impl == "cudnn":
        if cudnn is False:
            raise ValueError(f"impl='cudnn': {what} has no cuDNN route (softmax and local attention have one)")
        if cudnn is not True:
            raise ValueError(f"impl='cudnn' cannot run this call: {cudnn}")
        if device_backend() != "gpu":
            raise ValueError(f"impl='cudnn' needs an NVIDIA GPU; this backend is {device_backend()!r}")
        return KernelChoice("cudnn")
    if impl == "xla" or (impl == "auto" and q_len is not None and q_len < AUTO_MIN_QUERIES):
        return None
    if unsupported is not None:
        if impl == "auto":
            return None
        raise ValueError(
            f"impl={impl!r}: the Pallas kernel for {what} cannot run this call: {unsupported}; "
            "use impl='xla' (or 'auto', which falls back to it)"
        )
    if impl == "interpret":
        return KernelChoice("gpu", interpret=True)
    platform = device_backend()
    if platform == "tpu":
        return KernelChoice("tpu") if impl == "pallas" else None  # untested on real TPUs: explicit only
    if platform == "gpu":
        capability = _gpu_capability()
        if capability is not None and capability >= (AUTO_MIN_CAPABILITY if impl == "auto" else PALLAS_MIN_CAPABILITY):
            return KernelChoice("cudnn" if impl == "auto" and cudnn is True else "gpu")
        if impl == "auto":
            return None
        raise ValueError(
            f"impl='pallas' needs an NVIDIA GPU of compute capability >= {PALLAS_MIN_CAPABILITY} "
            f"(the Triton lowering); this one reports {capability}. Use impl='xla'"
        )
    if impl == "auto":
        return None
    raise ValueError(
        f"impl='pallas' has no kernel for the {platform!r} backend (kernels: NVIDIA GPU, TPU); "
        "use impl='xla', or impl='interpret' to run the kernel slowly in interpret mode"
    )
