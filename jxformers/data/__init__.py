"""Data: generated tasks as grain sources with deterministic records, and the loader.

    listops.py  the LRA ListOps generator (`sample(seed, index) -> (text, label)`)
    tasks.py    sources: ListOps, Copy, AssociativeRecall (padded, explicit masks)
    loader.py   grain DataLoader: seeded shuffle, per-process sharding, batching
"""

from jxformers.data.loader import make_loader
from jxformers.data.tasks import TASKS, AssociativeRecall, Copy, ListOps, make_source

__all__ = ["TASKS", "AssociativeRecall", "Copy", "ListOps", "make_loader", "make_source"]
