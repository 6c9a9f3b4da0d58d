"""Training: experiment configs, the optimizer, orbax checkpointing, the train loop.

    experiment.py  load_experiment (YAML, presets, key=value overrides, validation)
    optim.py       make_optimizer (AdamW / RAdam, warmup + cosine / inverse-sqrt, clipping)
    checkpoint.py  Checkpointer (orbax manager + grain iterator state, damaged fallback)
    loop.py        train, evaluate_checkpoint, restore_model
"""

from jxformers.train.experiment import Experiment, load_experiment
from jxformers.train.loop import (
           NonFiniteError,
           evaluate_checkpoint,
           restore_model,
           train,
)
from jxformers.train.optim import make_optimizer

__all__ = ["Experiment", "NonFiniteError", "evaluate_checkpoint", "load_experiment", "make_optimizer",
           "restore_model", "train"]
