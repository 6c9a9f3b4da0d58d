"""Pallas kernels beside the pure-JAX ops they accelerate.

* `impl`: `IMPLS`, the values of the `impl` argument every kernel-backed op takes (each
  described there), and where each kernel runs.
* `cudnn`: the cuDNN route (`jax.nn.dot_product_attention`) of the ops that have one.
* `pattern`, `block_mask`: static attention patterns as position rules, and the
  block-sparse metadata (visit lists) computed from them at trace time.
* `alibi`: ALiBi as slopes and an offset (`Alibi`), which the flash kernels compute per tile.
* `scores`: logit soft-capping and attention sinks, which the flash kernels compute per
  tile: the formula, the `SINKS` vocabulary and their checks (the XLA ops read them too).
* `flash`: block-sparse flash attention (`block_sparse_attention`) with its custom VJP,
  its dense reference and `merge_attentions` (disjoint key sets merged by their
  log-sum-exps); `flash_gpu` (Triton lowering) and `flash_tpu` (Mosaic TPU) hold the
  kernels, `flash_mgpu` an experimental Mosaic GPU forward (`backend="mosaic_gpu"`).
* `linear`: chunked (gated) linear attention for the kernelized family
  (`chunked_linear_attention`: linear, Performer, RFA) with its custom VJP; `linear_gpu`
  (Triton lowering) and `linear_tpu` (Mosaic TPU) hold the kernels.
* `tpu_interpret`: the TPU kernels under vmap in TPU interpret mode.
"""

from jxformers.kernels.alibi import Alibi
from jxformers.kernels.flash import BlockSizes, block_sparse_attention, block_sparse_reference, visited_fraction
from jxformers.kernels.impl import IMPLS, KernelChoice, check_impl, choose_kernel
from jxformers.kernels.linear import chunked_linear_attention
from jxformers.kernels.pattern import Band, KeyRange, Pattern, QueryRange, causal, intersect, union

__all__ = [
    "IMPLS",
    "Alibi",
    "Band",
    "BlockSizes",
    "KernelChoice",
    "KeyRange",
    "Pattern",
    "QueryRange",
    "block_sparse_attention",
    "block_sparse_reference",
    "causal",
    "chunked_linear_attention",
    "check_impl",
    "choose_kernel",
    "intersect",
    "union",
    "visited_fraction",
]
