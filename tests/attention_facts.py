"""One table of per-attention test facts, read by every generic suite (tests/suites.py).

A registered attention needs one row here and nothing else in the tests: the generic
suites then check it for shapes, jit/vmap/grad, causality, padding, its dense reference
mask, bf16, decoding, cross lengths, its error cases, its cost class and tiny models.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import masks


@dataclasses.dataclass(frozen=True)
class Growth:
    """How XLA-counted FLOPs grow with the sequence length N (no timing).

    kind: "linear", "n sqrt n" or "quadratic" (see GROWTH_CHECKS).
    at_length: hyper-parameters at length N (a fixed window, or a stride of sqrt(N)).
    causal: XLA's cost analysis counts a loop's body once, so a form that scans over the
        length (chunked softmax, causal chunked linear attention) cannot be measured.
    """

    kind: str
    at_length: Callable[[int], Mapping[str, Any]] = lambda n: {}
    causal: tuple[bool, ...] = (False, True)  # the modes checked (those the attention supports)


# kind -> (shorter N, longer N, lowest and highest allowed FLOP ratio between them)
GROWTH_CHECKS = {
    "linear": (2048, 4096, 1.7, 2.3),
    "n sqrt n": (1024, 4096, 6.5, 10.0),  # 4x length: n^1.5 gives 8x, n^2 would give 16x
    "quadratic": (2048, 4096, 3.6, math.inf),
}


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the generic suites need to know about one attention.

    variants: small hyper-parameters that make its pattern non-trivial at the test
        lengths (24 and 37 tokens); every suite runs each.
    mask: for exact attentions, a dense reference mask builder written from the paper
        (tests/masks.py): `mask(n, hyper_parameters, arrays, causal) -> [masks]`.
    errors: `(hyper-parameters, word)`: binding or calling with these (over the first
        variant) raises ValueError whose message names `word`.
    growth: how its FLOPs grow with N, or None when not checked.
    model: extra ModelConfig fields for the tiny classifier of the model suite.
    """

    variants: tuple[Mapping[str, Any], ...] = ({},)
    mask: Callable | None = None
    errors: tuple[tuple[Mapping[str, Any], str], ...] = ()
    growth: Growth | None = None
    model: Mapping[str, Any] = dataclasses.field(default_factory=dict)


FACTS: dict[str, Facts] = {
    # The score options ride along (tests/test_score_options.py checks their formulas; top-k
    # there too: its selection flips between bf16 and float32 at near-ties).
    "softmax": Facts(
        variants=({}, {"softcap": 2.0, "sinks": "learned"}), mask=masks.softmax, growth=Growth("quadratic")
    ),
    "chunked": Facts(
        # The priors ride along too (tests/test_priors.py checks their formulas): at 37
        # tokens the span's reach (6 + 2) lets each query chunk skip key chunks.
        variants=(
            {"chunk_size": 8},
            {"chunk_size": 8, "softcap": 2.0, "sinks": "zero"},
            {"chunk_size": 8, "localness": True, "gaussian_prior": True, "adaptive_span": 6, "span_ramp": 2},
        ),
        mask=masks.softmax,
        errors=(({"chunk_size": 0}, "chunk_size"),),
    ),  # a scan over chunks: no FLOP count (see Growth); tests/test_complexity.py checks its memory
    "local": Facts(
        variants=({"window": 3},),
        mask=masks.local,
        errors=(({"window": -1}, "window"),),
        growth=Growth("linear", lambda n: {"window": 32}),
    ),
    "block_local": Facts(
        variants=({"block_size": 5},),
        mask=masks.block_local,
        errors=(({"block_size": 0}, "block_size"),),
        growth=Growth("linear", lambda n: {"block_size": 64}),
    ),
    "dilated": Facts(
        variants=({"window": 2, "dilation": 3},),
        mask=masks.dilated,
        errors=(({"window": -2}, "window"), ({"dilation": 0}, "dilation")),
        growth=Growth("linear", lambda n: {"window": 16, "dilation": 4}),
    ),
    "sparse_transformer": Facts(
        variants=({"stride": 5}, {"stride": 5, "pattern": "fixed", "num_summary": 2}),
        mask=masks.sparse_transformer,
        errors=(
            ({"stride": 0}, "stride"),
            ({"pattern": "dense"}, "pattern"),
            ({"stride": 4, "pattern": "fixed", "num_summary": 5}, "num_summary"),
        ),
        growth=Growth("n sqrt n", lambda n: {"stride": math.isqrt(n)}),
    ),
    "longformer": Facts(
        variants=({"window": 2, "global_indices": (0, 11)}, {"window": 2, "dilation": 3, "global_indices": (0, 11)}),
        mask=masks.longformer,
        errors=(
            ({"global_indices": (0, 99)}, "global_indices"),
            ({"window": -1}, "window"),
            ({"dilation": 0}, "dilation"),
        ),
        growth=Growth("linear", lambda n: {"window": 32, "global_indices": (0, 5)}),
    ),
    "bigbird": Facts(
        variants=({"block_size": 4, "num_random_blocks": 2},),
        mask=masks.bigbird,
        errors=(({"block_size": 0}, "block_size"), ({"num_window_blocks": 2}, "num_window_blocks")),
        growth=Growth("linear", lambda n: {"block_size": 32}),
    ),
    # One draw shared by the heads (a dense mask is one for every head); the per-head
    # draw: tests/test_structured_attentions.py.
    "random": Facts(
        variants=(
            {"block_size": 4, "num_random_blocks": 2, "per_head": False},
            {
                "block_size": 4,
                "num_random_blocks": 2,
                "num_window_blocks": 3,
                "num_global_blocks": 2,
                "per_head": False,
            },
        ),
        mask=masks.random,
        errors=(({"block_size": 0}, "block_size"), ({"num_window_blocks": 2}, "num_window_blocks")),
        growth=Growth("linear", lambda n: {"block_size": 32, "num_random_blocks": 2, "per_head": False}),
    ),
    "axial": Facts(
        variants=({"width": 6}, {"width": 5, "order": "column"}),
        mask=masks.axial,
        errors=(({"width": 0}, "width"), ({"order": "diagonal"}, "order")),
        growth=Growth("n sqrt n", lambda n: {"width": math.isqrt(n)}),
    ),
    "criss_cross": Facts(
        # recurrence=2 cannot be causal, so it is not a variant here: tests/test_structured_attentions.py
        variants=({"width": 6}, {"width": 5}),
        mask=masks.criss_cross,
        errors=(({"width": 0}, "width"), ({"recurrence": 0}, "recurrence")),
        growth=Growth("n sqrt n", lambda n: {"width": math.isqrt(n)}),
    ),
    # The attended relay has no causal form: tests/test_structured_attentions.py checks it.
    "star": Facts(
        variants=({"relay": "mean"},),
        errors=(({"relay": "max"}, "relay"),),
        growth=Growth("linear", lambda n: {"relay": "mean"}),
    ),
    "bp": Facts(
        variants=({"neighbours": 2}, {"neighbours": 1}),
        errors=(({"neighbours": 0}, "neighbours"),),
        growth=Growth("linear", lambda n: {"neighbours": 2}),  # N log N: 2.2x from 2048 to 4096
    ),
    "memory_compressed": Facts(
        variants=({"stride": 3},),
        errors=(({"stride": 0}, "stride"),),
        growth=Growth("quadratic", lambda n: {"stride": 4}),
    ),
    "linear": Facts(
        variants=({"chunk_size": 8}, {"form": "scan", "feature_map": "relu"}),
        errors=(
            ({"feature_map": "tanh"}, "feature_map"),
            ({"form": "fast"}, "form"),
            ({"chunk_size": 0}, "chunk_size"),
        ),
        growth=Growth("linear", causal=(False,)),
    ),
    "performer": Facts(
        # kernel="trig": its normaliser can near zero, where bf16 inputs move the output
        # far (the estimator, not the code): tests/test_kernelized_extra.py checks it
        variants=({"num_features": 32, "chunk_size": 8}, {"num_features": 16, "kernel": "relu", "form": "quadratic"}),
        errors=(({"kernel": "gelu"}, "kernel"), ({"num_features": 0}, "num_features")),
        growth=Growth("linear", lambda n: {"num_features": 64}),
    ),
    "efficient": Facts(growth=Growth("linear")),  # tests/test_kernelized_extra.py: eq. 2
    "rfa": Facts(
        variants=({"num_features": 16, "chunk_size": 5},),
        errors=(({"num_features": 0}, "num_features"), ({"sigma": 0.0}, "sigma")),
        growth=Growth("linear", lambda n: {"num_features": 64}),
    ),
    # Causal only, and their causal forms scan over chunks: no FLOP count (see Growth).
    # tests/test_delta.py checks the recurrences, the forms and the token inputs.
    "delta": Facts(
        variants=({"chunk_size": 5, "feature_map": "dpfp"},),
        errors=(
            ({"chunk_size": 0}, "chunk_size"),
            ({"dpfp_nu": 0}, "dpfp_nu"),
            ({"feature_map": "elu", "dpfp_nu": 3}, "feature_map='dpfp'"),
        ),
    ),
    "gated_delta": Facts(variants=({"chunk_size": 5},), errors=(({"chunk_size": 0}, "chunk_size"),)),
    "linformer": Facts(
        variants=({"proj_len": 8, "max_len": 64},),
        errors=(({"max_len": 8}, "max_len"), ({"proj_len": 0}, "proj_len"), ({"sharing": "per_layer"}, "sharing")),
        growth=Growth("linear", lambda n: {"proj_len": 32, "max_len": n}),
    ),
    "synthesizer": Facts(
        # The dense kinds read the layer input, not q: tests/test_nn.py checks them in the module.
        variants=(
            {"max_len": 40},
            {"max_len": 40, "trainable_random": False, "mixture": True},
            {"kind": "factorized_random", "max_len": 40, "rank": 3},
        ),
        errors=(({"max_len": 8}, "max_len"), ({"kind": "learned"}, "kind")),
    ),
    "nystrom": Facts(  # the first variant serves cross-attention, which takes no convolution skip
        variants=({"num_landmarks": 5, "conv_kernel_size": 0}, {"num_landmarks": 5, "conv_kernel_size": 3}),
        errors=(({"num_landmarks": 0}, "num_landmarks"), ({"conv_kernel_size": 4}, "conv_kernel_size")),
        growth=Growth("linear", lambda n: {"num_landmarks": 32}),
    ),
    "induced": Facts(
        variants=({"num_inducing": 4},),
        errors=(({"num_inducing": 0}, "num_inducing"),),
        growth=Growth("linear", lambda n: {"num_inducing": 32}),
    ),
    "lsh": Facts(
        variants=({"n_buckets": 4, "n_hashes": 2, "chunk_size": 5},),
        errors=(({"n_buckets": 3}, "n_buckets"), ({"n_hashes": 0}, "n_hashes"), ({"chunk_size": 0}, "chunk_size")),
        growth=Growth("linear", lambda n: {"n_buckets": 16, "chunk_size": 32}),
    ),
    "routing": Facts(
        # 2 local and 2 routing query heads; a causal window of ceil(40 / 3) keys
        variants=({"n_clusters": 3, "local_heads": 2, "local_window": 3, "max_len": 40},),
        errors=(
            ({"max_len": 0}, "max_len"),
            ({"local_heads": 1}, "local_heads"),
            ({"n_clusters": 0}, "n_clusters"),
            ({"local_window": -1}, "local_window"),
        ),
        growth=Growth("n sqrt n", lambda n: {"n_clusters": math.isqrt(n), "local_heads": 0, "max_len": n}),
    ),
    "sinkhorn": Facts(  # SortCut cannot be causal: tests/test_learnable.py checks it
        variants=({"block_size": 5, "max_len": 40, "sinkhorn_iters": 4},),
        errors=(
            ({"block_size": 0}, "block_size"),
            ({"temperature": 0.0}, "temperature"),
            ({"max_len": 8}, "max_len"),
            ({"sinkhorn_iters": 0}, "sinkhorn_iters"),
        ),
        # Sorting N/b key blocks by a soft permutation costs (N/b)^2 b d: N^1.5 at b = sqrt(N).
        growth=Growth("n sqrt n", lambda n: {"block_size": math.isqrt(n), "max_len": n}),
    ),
    "clusterformer": Facts(
        variants=({"n_clusters": 3, "chunk_size": 5},),
        errors=(({"n_clusters": 0}, "n_clusters"), ({"chunk_size": 0}, "chunk_size")),
        growth=Growth("linear", lambda n: {"n_clusters": 8, "chunk_size": 32}),
    ),
    "adaptive_sparse": Facts(
        variants=({"alpha": 1.5}, {"alpha": 2.0, "learned": False}),  # a fixed alpha < 2: tests/test_entmax.py
        errors=(({"alpha": 2.5}, "alpha"), ({"alpha": 1.0}, "alpha"), ({"alpha": 2.0}, "alpha")),
        growth=Growth("quadratic"),
    ),
    "long_short": Facts(
        variants=({"window": 4, "rank": 3, "segment_size": 5}, {"window": 7, "rank": 2, "segment_size": 8}),
        errors=(({"window": 0}, "window"), ({"segment_size": 0}, "segment_size"), ({"rank": 0}, "rank")),
        # Causal: every query attends the projections of all earlier segments, O(N^2 r / l).
        growth=Growth("linear", lambda n: {"window": 32, "rank": 16}, causal=(False,)),
    ),
    "poolingformer": Facts(  # not causal: tests/test_local_pooling.py checks the refusal and mean pooling
        variants=(
            {"window": 2, "pool_window": 8, "pool_size": 3, "pool_stride": 2, "pooling": "dynamic"},
            {"window": 1, "pool_window": 5, "pool_size": 2, "pool_stride": 2, "pooling": "max"},
        ),
        errors=(
            ({"window": -1}, "window"),
            ({"pool_size": 0}, "pool_size"),
            ({"pool_stride": 0}, "pool_stride"),
            ({"pool_window": 2}, "pool_window"),
            ({"pooling": "conv"}, "pooling"),
        ),
        growth=Growth("linear", lambda n: {"window": 16, "pool_window": 64, "pool_size": 5, "pool_stride": 4}),
    ),
    "hard_gaussian": Facts(
        variants=({}, {"offsets": (-1, 0, 2), "std": 2.0}),
        errors=(({"std": 0.0}, "std"), ({"offsets": ()}, "offsets")),
        growth=Growth("quadratic"),
    ),
    "average": Facts(growth=Growth("linear")),  # tests/test_average_attention.py checks eq. 1-4
    # tests/test_mixers.py checks their formulas against numpy
    "mixer": Facts(
        variants=({"hidden": 8, "max_len": 40},),
        errors=(({"max_len": 8}, "max_len"), ({"hidden": 0}, "hidden")),
        growth=Growth("linear", lambda n: {"hidden": 16, "max_len": n}, causal=(False,)),
        model={"pooling": "mean", "kv_heads": None},  # no heads (mixes_input); the paper pools by the mean
    ),
    "gmlp": Facts(
        variants=({"max_len": 40},),
        errors=(({"max_len": 8}, "max_len"), ({"max_len": 0}, "max_len")),
        growth=Growth("quadratic", lambda n: {"max_len": n}),
    ),
    # no [CLS] token can gather what FNet mixes; a parameter-free sublayer has no heads to group
    "fnet": Facts(model={"pooling": "mean", "kv_heads": None}),
    "image_local_2d": Facts(
        variants=(
            {"width": 6, "query_height": 2, "query_width": 3, "memory_height": 2, "memory_width": 1},
            {"width": 8, "query_height": 2, "query_width": 2, "memory_height": 3, "memory_width": 3},
        ),
        mask=masks.image_local_2d,
        errors=(
            ({"query_width": 4}, "query_width"),
            ({"memory_height": -1}, "memory_height"),
            ({"width": 0}, "width"),
            ({"query_height": 0}, "query_height"),
        ),
        growth=Growth(
            "linear",
            lambda n: {"width": 64, "query_height": 8, "query_width": 16, "memory_height": 8, "memory_width": 16},
        ),
    ),
    # a softmax with relative-position logits: tests/test_global_local.py checks it against the dense form
    "etc": Facts(
        variants=(
            {"num_global": 3, "local_radius": 2, "global_every": 5, "max_distance": 3},
            {
                "num_global": 2,
                "local_radius": 4,
                "global_every": 6,
                "max_distance": 0,
                "hard_g2l": True,
                "hard_l2g": True,
            },
        ),
        mask=masks.etc,
        errors=(
            ({"num_global": 0}, "num_global"),
            ({"num_global": 99}, "num_global"),
            ({"local_radius": -1}, "local_radius"),
            ({"global_every": 0}, "global_every"),
            ({"max_distance": -1}, "max_distance"),
        ),
        growth=Growth("linear", lambda n: {"num_global": 4, "local_radius": 32, "global_every": 64}),
    ),
    # tests/test_clustered.py checks the formulas against numpy (the clustering reproduced)
    "clustered": Facts(
        variants=({"clusters": 4, "bits": 8, "iterations": 3},),
        errors=(({"clusters": 0}, "clusters"), ({"bits": 64}, "bits"), ({"iterations": 0}, "iterations")),
        growth=Growth("linear", lambda n: {"clusters": 16, "bits": 16, "iterations": 3}),
    ),
    "improved_clustered": Facts(
        variants=({"clusters": 4, "bits": 8, "iterations": 3, "topk": 5},),
        errors=(({"topk": 0}, "topk"), ({"clusters": 0}, "clusters")),
        growth=Growth("linear", lambda n: {"clusters": 16, "bits": 16, "iterations": 3, "topk": 32}),
    ),
    # tests/test_probsparse.py checks the formula against numpy, and why neither form is causal.
    # The query selection is discrete: at a near-tie of the u-th measurement bf16's rounding
    # flips it (factor 2 at test_bf16_close_to_float32's inputs); 3 selects 12 of 37 queries.
    "probsparse": Facts(
        variants=({"factor": 3}, {"factor": 3, "masked": True}),
        errors=(({"factor": 0}, "factor"),),
        growth=Growth("linear", lambda n: {"factor": 2}),  # N ceil(ln N): 2.25x from 2048 to 4096
    ),
}
