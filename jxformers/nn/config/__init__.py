"""`ModelConfig` and `build_model`: a model from its components.

    >>> config = ModelConfig(task="lm", vocab_size=256, attention={"name": "performer", "num_features": 64})
    >>> model = build_model(config, key=jax.random.key(0))
    >>> logits = model(tokens)  # [seq, 256]

A config can also be a plain dict or YAML (text or a path). Everything is checked before
any array is made: unknown keys, ill-typed or out-of-range values, an unknown attention
or hyper-parameter, and an attention that cannot do what the task needs (a non-causal
attention in a language model, a bias position scheme with an attention that takes no
bias) are ValueErrors that list the options.

    components.py  the components (attention, embedding, norm, ffn, stack, decoder, head)
    model.py       ModelConfig and the contracts between its components
    binding.py     bind_attention, ShortSequenceWarning
    legacy.py      the flat keys of jxformers before the component configs, converted (FlatConfigWarning)
    build.py       build_model
"""

from jxformers.nn.config.binding import ShortSequenceWarning, bind_attention, warn_if_dense
from jxformers.nn.config.build import build_model
from jxformers.nn.config.components import (
    FFN_COMPONENTS,
    HEAD_COMPONENTS,
    OUTPUT_HEADS,
    STACK_COMPONENTS,
    STACKS,
    AttentionConfig,
    CompressiveStack,
    DecoderConfig,
    EmbeddingConfig,
    ErnieDocStack,
    FeedForwardConfig,
    ISABStack,
    LayerConfig,
    LunaStack,
    MemformerStack,
    MixtureHead,
    NormConfig,
    PerceiverStack,
    PooledHead,
    SoftmaxHead,
    TransformerStack,
    TransformerXLStack,
)
from jxformers.nn.config.legacy import FlatConfigWarning
from jxformers.nn.config.model import DTYPES, TASKS, ModelConfig
from jxformers.nn.moe import MoEConfig
from jxformers.nn.pkm import PKMConfig
from jxformers.nn.tokenlearner import TokenLearnerConfig

ARCHITECTURES = tuple(STACKS)  # the stack kinds


def architectures_table() -> str:
    """The stacks and heads a ModelConfig can name (printed by `jxformers list`)."""
    rows = [f"  {name:<14} {', '.join(tasks):<32} {what}" for name, (_, tasks, what) in STACKS.items()]
    return "\n".join(
        ["stacks (ModelConfig stack kind):", *rows, f"heads (ModelConfig head kind): {', '.join(HEAD_COMPONENTS)}"]
    )


__all__ = [
    "ARCHITECTURES",
    "DTYPES",
    "FFN_COMPONENTS",
    "HEAD_COMPONENTS",
    "OUTPUT_HEADS",
    "STACKS",
    "STACK_COMPONENTS",
    "TASKS",
    "AttentionConfig",
    "CompressiveStack",
    "DecoderConfig",
    "EmbeddingConfig",
    "ErnieDocStack",
    "FeedForwardConfig",
    "FlatConfigWarning",
    "ISABStack",
    "LayerConfig",
    "LunaStack",
    "MemformerStack",
    "MixtureHead",
    "MoEConfig",
    "ModelConfig",
    "NormConfig",
    "PKMConfig",
    "PerceiverStack",
    "PooledHead",
    "ShortSequenceWarning",
    "SoftmaxHead",
    "TokenLearnerConfig",
    "TransformerStack",
    "TransformerXLStack",
    "architectures_table",
    "bind_attention",
    "build_model",
    "warn_if_dense",
]
