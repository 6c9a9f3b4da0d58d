"""Data: generated tasks as grain sources with deterministic records, and the loader.

listops.py  the LRA ListOps generator (`sample(seed, index) -> (text, label)`)
pathfinder.py  the Pathfinder image generator (`render(seed, index) -> (image, label)`)
pathfinder_check.py  Pathfinder's shortcut baselines (features a model should not need)
real.py     Fashion-MNIST (idx files) and Shakespeare (texts) readers; Shakespeare as row streams
genre.py    Shakespeare's speeches, and windows of a scene's speeches (documents), labelled by
            their play's genre (comedy, tragedy, history)
lra_text.py  LRA Text and Retrieval stand-ins from Shakespeare's plays (genre of an excerpt;
            are two excerpts from one play), split by play
tasks.py    sources: ListOps, Pathfinder, Copy, AssociativeRecall, Documents, Transduction
            (seq2seq), FashionMNIST, ShakespeareBytes, ShakespeareStream
loader.py   grain DataLoader: seeded shuffle, per-process sharding, worker processes, batching
baselines.py  what an accuracy means: majority class, ListOps' root operator, Pathfinder's shortcut
cache.py    built splits: records written once to ArrayRecord files and read back
"""

from jxformers.data.loader import make_loader
from jxformers.data.tasks import (
    TASKS,
    AssociativeRecall,
    Copy,
    ListOps,
    Pathfinder,
    Transduction,
    make_source,
)

__all__ = ["TASKS", "AssociativeRecall", "Copy", "ListOps", "Pathfinder", "Transduction", "make_loader", "make_source"]
