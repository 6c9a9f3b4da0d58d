"""Training: experiment configs, the train state, the steps, orbax checkpointing, the loop.

experiment.py  load_experiment; Experiment with typed sections DataConfig,
               TrainConfig, CheckpointConfig, MeshConfig (validated by jxformers.validate)
optim.py       make_optimizer (AdamW / RAdam, warmup + cosine / inverse-sqrt, clipping)
state.py       TrainState (params, drawn, opt_state, step, rng, and a recurrent model's
               memory) and its one constructor init_train_state; state_dict /
               load_state_dict (leaves by tree path)
step.py        losses, the one jitted train step (state -> state) for every model, the
               eval step, evaluate
sharding.py    the device mesh (MeshConfig) and the rules sharding the state and the
               batch over data / fsdp / tensor / expert (docs/distributed.md)
distributed.py several processes: jax.distributed from flags or a detected cluster
supervise.py   the parent of each process of a multi-process run: JAX's abort when the
               coordinator dies becomes one line
checkpoint.py  Checkpointer (orbax manager + grain iterator state, path/shape check
               before restore, damaged fallback, old list-layout checkpoints refused)
checksums.py   checksums of a checkpoint's arrays and data position, verified on restore
workdir.py     the work directory: its saved config (read by eval / generate, checked
               on a rerun), its lock, checks for missing or odd directories
loop.py        train (setup, step, periodic hooks), evaluate_checkpoint, restore_model
batch_wait.py  the wait for a batch from data workers: bounded (data.batch_timeout), signals honoured
tensorboard.py TensorBoard scalars without TensorFlow
"""

from jxformers.train.experiment import (
    CheckpointConfig,
    DataConfig,
    Experiment,
    MeshConfig,
    TrainConfig,
    load_experiment,
)
from jxformers.train.loop import (
    NonFiniteError,
    evaluate_checkpoint,
    restore_model,
    restore_train_state,
    train,
)
from jxformers.train.optim import make_optimizer
from jxformers.train.state import TrainState, init_train_state

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "Experiment",
    "MeshConfig",
    "NonFiniteError",
    "TrainConfig",
    "TrainState",
    "evaluate_checkpoint",
    "init_train_state",
    "load_experiment",
    "make_optimizer",
    "restore_model",
    "restore_train_state",
    "train",
]
