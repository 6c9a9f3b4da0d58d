"""Pure attention functions, one file per family; no parameters are created here.

Each attention registers itself (`jxformers.registry.register`) right after its op, so
the import order below is the registry's order. Each family file's `__all__` is what this
package exports from it: a new op is exported by naming it there, a new family file by
one import below.

Per-example shapes (batch with `jax.vmap`): `q [q_len, heads, d_k]`,
`k [kv_len, kv_heads, d_k]`, `v [kv_len, kv_heads, d_v]` -> `[q_len, heads, d_v]`.

    softmax.py     exact: softmax_attention (the reference), chunked_attention
                   and the score options they take (softcap, top_k, sinks, talking_heads;
                   their helpers in the private jxformers.ops._scores)
    local.py       fixed windows: local_attention, block_local_attention, dilated_attention,
                   image_local_2d_attention (Image Transformer's 2-D blocks, block_raster_order)
    sparse.py      fixed patterns: sparse_transformer_attention, longformer_attention, bigbird_attention,
                   random_attention (BigBird's random blocks alone)
    axial.py       axial_attention
    criss_cross.py criss_cross_attention (CCNet: a grid position's row and column in one softmax)
    star.py        star_attention (Star-Transformer: ring neighbours and a relay node)
    bp.py          bp_attention (BP-Transformer: tokens and binary-partition spans, k nodes a level)
    compressed.py  memory_compressed_attention
    kernelized.py  linear_attention, performer_attention, rfa_attention (and their features, DPFP's too)
    delta.py       delta_attention (fast weight programmers), gated_delta_attention, and their
                   shared delta_rule (recurrent and chunked WY forms)
    lowrank.py     linformer_attention, synthesizer_attention, nystrom_attention
    memory.py      induced_attention, latent_attention, luna_causal_pack (Luna's causal pack),
                   funnel_pool and funnel_attention
    fourier.py     dct, idct, fourier_downsample(_padded), nearest_upsample, fnet_mixing, fnet_attention,
                   dct_power, cumulative_energy, energy_share (the spectrum of hidden states)
    mixers.py      mixer_attention (MLP-Mixer's token MLP), gmlp_attention (gMLP's spatial gating unit,
                   spatial_gating)
    learnable.py   lsh_attention (Reformer), routing_attention, sinkhorn_attention, clusterformer_attention,
                   and their pieces (lsh_buckets, kmeans_update, sinkhorn_balance)
    global_local.py  etc_attention (ETC's g2g, g2l, l2g, l2l with relative position labels)
    entmax.py      adaptive_sparse_attention and its normalisers (entmax, sparsemax)
    local_lowrank.py  long_short_attention (Long-Short Transformer: window + dynamic projection)
    local_pooling.py  poolingformer_attention (window, then pooled keys of a larger window)
    prior_only.py  hard_gaussian_attention, average_attention (weights by position alone; the logit priors
                   are score options of softmax.py, helpers in jxformers.ops._priors)
    clustered.py   clustered_attention and improved_clustered_attention (Vyas et al.: queries clustered
                   by K-means on LSH codes; hamming_clusters, clustered_arrays)
    probsparse.py  probsparse_attention (Informer's top-u queries by sparsity measurement; its pieces)
"""

# The order below is the registry's order (and `jxformers list`'s, and the README table's).
# `ops.entmax` is the function: the family modules are imported under private names.
# isort: off
from jxformers.ops import softmax as _softmax
from jxformers.ops import local as _local
from jxformers.ops import sparse as _sparse
from jxformers.ops import axial as _axial
from jxformers.ops import criss_cross as _criss_cross
from jxformers.ops import star as _star
from jxformers.ops import bp as _bp
from jxformers.ops import compressed as _compressed
from jxformers.ops import kernelized as _kernelized
from jxformers.ops import delta as _delta
from jxformers.ops import lowrank as _lowrank
from jxformers.ops import memory as _memory
from jxformers.ops import fourier as _fourier
from jxformers.ops import mixers as _mixers
from jxformers.ops import learnable as _learnable
from jxformers.ops import global_local as _global_local
from jxformers.ops import entmax as _entmax
from jxformers.ops import local_lowrank as _local_lowrank
from jxformers.ops import local_pooling as _local_pooling
from jxformers.ops import prior_only as _prior_only
from jxformers.ops import clustered as _clustered
from jxformers.ops import probsparse as _probsparse
from jxformers.ops.softmax import *  # noqa: F403
from jxformers.ops.local import *  # noqa: F403
from jxformers.ops.sparse import *  # noqa: F403
from jxformers.ops.axial import *  # noqa: F403
from jxformers.ops.criss_cross import *  # noqa: F403
from jxformers.ops.star import *  # noqa: F403
from jxformers.ops.bp import *  # noqa: F403
from jxformers.ops.compressed import *  # noqa: F403
from jxformers.ops.kernelized import *  # noqa: F403
from jxformers.ops.delta import *  # noqa: F403
from jxformers.ops.lowrank import *  # noqa: F403
from jxformers.ops.memory import *  # noqa: F403
from jxformers.ops.fourier import *  # noqa: F403
from jxformers.ops.mixers import *  # noqa: F403
from jxformers.ops.learnable import *  # noqa: F403
from jxformers.ops.global_local import *  # noqa: F403
from jxformers.ops.entmax import *  # noqa: F403
from jxformers.ops.local_lowrank import *  # noqa: F403
from jxformers.ops.local_pooling import *  # noqa: F403
from jxformers.ops.prior_only import *  # noqa: F403
from jxformers.ops.clustered import *  # noqa: F403
from jxformers.ops.probsparse import *  # noqa: F403
# isort: on

__all__ = []
__all__ += _softmax.__all__
__all__ += _local.__all__
__all__ += _sparse.__all__
__all__ += _axial.__all__
__all__ += _criss_cross.__all__
__all__ += _star.__all__
__all__ += _bp.__all__
__all__ += _compressed.__all__
__all__ += _kernelized.__all__
__all__ += _delta.__all__
__all__ += _lowrank.__all__
__all__ += _memory.__all__
__all__ += _fourier.__all__
__all__ += _mixers.__all__
__all__ += _learnable.__all__
__all__ += _global_local.__all__
__all__ += _entmax.__all__
__all__ += _local_lowrank.__all__
__all__ += _local_pooling.__all__
__all__ += _prior_only.__all__
__all__ += _clustered.__all__
__all__ += _probsparse.__all__
