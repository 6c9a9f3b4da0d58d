"""Pure attention functions, one file per family; no parameters are created here.

Per-example shapes (batch with `jax.vmap`): `q [q_len, heads, d_k]`,
`k [kv_len, kv_heads, d_k]`, `v [kv_len, kv_heads, d_v]` -> `[q_len, heads, d_v]`.

    softmax.py     softmax_attention (the reference), chunked_attention
    local.py       local_attention, block_local_attention, dilated_attention
    sparse.py      sparse_transformer_attention, longformer_attention, bigbird_attention
    axial.py       axial_attention
    compressed.py  memory_compressed_attention
"""

from jxformers.ops.axial import axial_attention
from jxformers.ops.compressed import compress_memory, memory_compressed_attention
from jxformers.ops.local import block_local_attention, dilated_attention, local_attention
from jxformers.ops.softmax import causal_mask, chunked_attention, softmax_attention
from jxformers.ops.sparse import (
    bigbird_attention,
    bigbird_global_blocks,
    bigbird_random_blocks,
    longformer_attention,
    sparse_transformer_attention,
)

__all__ = [
    "axial_attention",
    "bigbird_attention",
    "bigbird_global_blocks",
    "bigbird_random_blocks",
    "block_local_attention",
    "causal_mask",
    "chunked_attention",
    "compress_memory",
    "dilated_attention",
    "local_attention",
    "longformer_attention",
    "memory_compressed_attention",
    "softmax_attention",
    "sparse_transformer_attention",
]
