"""Pure attention functions, one file per family; no parameters are created here.

Each attention registers itself (`jxformers.registry.register`) right after its op, so
the import order below is the registry's order.

Per-example shapes (batch with `jax.vmap`): `q [q_len, heads, d_k]`,
`k [kv_len, kv_heads, d_k]`, `v [kv_len, kv_heads, d_v]` -> `[q_len, heads, d_v]`.

    softmax.py     exact: softmax_attention (the reference), chunked_attention
    local.py       fixed windows: local_attention, block_local_attention, dilated_attention,
                   image_local_2d_attention (Image Transformer's 2-D blocks, block_raster_order)
    sparse.py      fixed patterns: sparse_transformer_attention, longformer_attention, bigbird_attention
    global_local.py  etc_attention (ETC's g2g, g2l, l2g, l2l with relative position labels)
    axial.py       axial_attention
    compressed.py  memory_compressed_attention
    kernelized.py  linear_attention, performer_attention, rfa_attention (and their features)
    lowrank.py     linformer_attention, synthesizer_attention, nystrom_attention
    memory.py      induced_attention, latent_attention, luna_causal_pack (Luna's causal pack),
                   funnel_pool and funnel_attention
    learnable.py   lsh_attention (Reformer), routing_attention, sinkhorn_attention, clusterformer_attention,
                   and their pieces (lsh_buckets, kmeans_update, sinkhorn_balance)
    entmax.py      adaptive_sparse_attention and its normalisers (entmax, sparsemax)
    local_lowrank.py  long_short_attention (Long-Short Transformer: window + dynamic projection)
    local_pooling.py  poolingformer_attention (window, then pooled keys of a larger window)
    fourier.py     dct, idct, fourier_downsample(_padded), nearest_upsample, fnet_mixing, fnet_attention
"""

# isort: off  (the order below is the registry's order)
from jxformers.ops.axial import axial_attention
from jxformers.ops.compressed import compress_memory, memory_compressed_attention
from jxformers.ops.entmax import adaptive_sparse_arrays, adaptive_sparse_attention, entmax, head_alpha, sparsemax
from jxformers.ops.fourier import (
    dct,
    fnet_attention,
    fnet_mixing,
    fourier_downsample,
    fourier_downsample_padded,
    idct,
    nearest_upsample,
)
from jxformers.ops.global_local import etc_arrays, etc_attention, etc_relative_labels
from jxformers.ops.kernelized import (
    kernel_attention,
    linear_attention,
    performer_attention,
    performer_features,
    performer_projection,
    rfa_attention,
    rfa_features,
)
from jxformers.ops.learnable import (
    clusterformer_attention,
    kmeans_centroids,
    kmeans_update,
    lsh_arrays,
    lsh_attention,
    lsh_buckets,
    routing_attention,
    sinkhorn_arrays,
    sinkhorn_attention,
    sinkhorn_balance,
)
from jxformers.ops.local import (
    block_local_attention,
    block_raster_coordinates,
    block_raster_order,
    dilated_attention,
    image_local_2d_attention,
    local_attention,
)
from jxformers.ops.local_lowrank import dual_layer_norm, dynamic_projection, long_short_arrays, long_short_attention
from jxformers.ops.local_pooling import pool_keys, poolingformer_arrays, poolingformer_attention
from jxformers.ops.lowrank import (
    iterative_pinv,
    linformer_attention,
    nystrom_attention,
    segment_means,
    synthesizer_attention,
    synthesizer_logits,
)
from jxformers.ops.memory import (
    funnel_attention,
    funnel_pool,
    induced_attention,
    latent_attention,
    luna_causal_pack,
)
from jxformers.ops.softmax import causal_mask, chunked_attention, softmax_attention
from jxformers.ops.sparse import (
    bigbird_attention,
    bigbird_global_blocks,
    bigbird_random_blocks,
    longformer_attention,
    sparse_transformer_attention,
)

# isort: on

__all__ = [
    "adaptive_sparse_arrays",
    "adaptive_sparse_attention",
    "dual_layer_norm",
    "dynamic_projection",
    "entmax",
    "head_alpha",
    "long_short_arrays",
    "long_short_attention",
    "pool_keys",
    "poolingformer_arrays",
    "poolingformer_attention",
    "sparsemax",
    "sinkhorn_balance",
    "sinkhorn_attention",
    "sinkhorn_arrays",
    "routing_attention",
    "lsh_buckets",
    "lsh_attention",
    "lsh_arrays",
    "kmeans_update",
    "kmeans_centroids",
    "clusterformer_attention",
    "axial_attention",
    "bigbird_attention",
    "bigbird_global_blocks",
    "bigbird_random_blocks",
    "block_local_attention",
    "block_raster_coordinates",
    "block_raster_order",
    "causal_mask",
    "chunked_attention",
    "compress_memory",
    "dct",
    "dilated_attention",
    "etc_arrays",
    "etc_attention",
    "etc_relative_labels",
    "fnet_attention",
    "fnet_mixing",
    "fourier_downsample",
    "fourier_downsample_padded",
    "funnel_attention",
    "funnel_pool",
    "idct",
    "image_local_2d_attention",
    "induced_attention",
    "iterative_pinv",
    "kernel_attention",
    "latent_attention",
    "linear_attention",
    "linformer_attention",
    "local_attention",
    "luna_causal_pack",
    "longformer_attention",
    "memory_compressed_attention",
    "nearest_upsample",
    "nystrom_attention",
    "performer_attention",
    "performer_features",
    "performer_projection",
    "rfa_attention",
    "rfa_features",
    "segment_means",
    "softmax_attention",
    "sparse_transformer_attention",
    "synthesizer_attention",
    "synthesizer_logits",
]
