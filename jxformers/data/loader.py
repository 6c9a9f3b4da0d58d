"""Batches from a task source with grain: an index sampler that shuffles with a seed,
repeats for ever and shards by JAX process, and a Batch operation. The iterator's state
(a few bytes: where it is in the index stream) is saved with every checkpoint, so a
resumed run sees exactly the batches it would have seen."""

from __future__ import annotations

import grain


def make_loader(source, *, batch_size: int, seed: int, shuffle: bool = True, num_epochs: int | None = None,
                workers: int = 0) -> grain.DataLoader:
    """A grain DataLoader over `source` giving dicts of `[batch_size, ...]` numpy arrays.

    Arguments:
        source: a random-access source (`__len__`, `__getitem__`), e.g. from `make_source`.
        batch_size: examples per batch on this process (the last partial batch is dropped).
        seed: shuffling seed. shuffle: shuffle each epoch. num_epochs: None repeats for ever.
        workers: grain worker processes (0: in the main process).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    if len(source) < batch_size:
        raise ValueError(f"the source holds {len(source)} records, fewer than one batch of {batch_size}")
    sampler = grain.samplers.IndexSampler(
        num_records=len(source), shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True),
        shuffle=shuffle, num_epochs=num_epochs, seed=seed,
    )
    return grain.DataLoader(
        data_source=source, sampler=sampler, operations=[grain.transforms.Batch(batch_size, drop_remainder=True)],
        worker_count=workers,
    )
