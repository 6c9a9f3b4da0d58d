"""Batches from a task source with grain: an index sampler that shuffles with a seed,
repeats for ever and shards by JAX process; records made in `workers` grain worker
processes (0: in this one) and stacked into batches here.

With several JAX processes (`jxformers.train.distributed`), process p of P reads rows
[p * b, (p + 1) * b) of each global batch of P * b rows (`batch_size` is b, this
process's rows), and the global batches are those of one process reading P * b rows:
assembled in process order (`jax.make_array_from_process_local_data`), a run on P
processes sees exactly the batches of a run on one.

Batching happens after the workers, on the record stream grain delivers in sampler
order whatever the worker count, so every worker count gives the same batches. The
iterator's state (grain's: where it is in the index stream) is saved with every
checkpoint; it is rewritten for this loader's worker count on restore, so a run may
resume with another `data.workers`, and a resumed run sees exactly the batches it
would have seen.

A source that draws records faster together (with `__getitems__`, as Pathfinder) is read
ahead by sampler position, READ_AT_ONCE records in one call (`_ReadAhead`): the same
records, so none of the above changes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading

import grain
import jax
import numpy as np
from absl import flags


def stack(records: list[dict[str, np.ndarray | np.generic]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in records]) for k in records[0]}


def records_consumed(state: dict, *, shard_index: int = 0, shard_count: int = 1) -> int:
    """How many records of its shard a grain DataLoader state (decoded) has delivered.
    grain hands records to its workers round robin and delivers them in sampler order,
    so the newest index any worker read gives the count (grain stores the last index
    each worker read)."""
    return (max(state["last_seen_indices"].values()) - shard_index) // shard_count + 1


def state_for_workers(state: dict, workers: int, *, shard_index: int = 0, shard_count: int = 1) -> dict:
    """A grain DataLoader state (decoded) rewritten for `workers` worker processes: a
    state is given by how many records this shard has consumed (`records_consumed`), and
    grain refuses a state of another worker count."""
    consumed = records_consumed(state, shard_index=shard_index, shard_count=shard_count)
    slots = max(workers, 1)
    per_worker = [(consumed - i + slots - 1) // slots for i in range(slots)]
    return state | {
        "worker_count": workers,
        "last_seen_indices": {
            str(i): shard_index + shard_count * (i + (n - 1) * slots) for i, n in enumerate(per_worker)
        },
        "last_worker_index": consumed % slots - 1,
    }


class ProcessRows:
    """A sampler's positions for process `index` of `count`, which reads `rows` rows of
    every global batch of `rows * count`: its position i is the global position
    (i // rows) * rows * count + index * rows + i % rows."""

    def __init__(self, sampler, rows: int, index: int, count: int):
        self.sampler, self.rows, self.index, self.count = sampler, rows, index, count
        self._shard_options = grain.sharding.NoSharding()  # grain's DataLoader reads every position of this one

    def __repr__(self) -> str:  # grain saves it with the iterator state and compares it on restore
        return f"ProcessRows({self.sampler!r}, rows={self.rows}, index={self.index}, count={self.count})"

    def __len__(self) -> int:
        total = len(self.sampler)
        return total if total == sys.maxsize else total // (self.rows * self.count) * self.rows

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"position {i} is out of bounds [0, {len(self)})")
        batch, row = divmod(i, self.rows)
        record = self.sampler[batch * self.rows * self.count + self.index * self.rows + row]
        return dataclasses.replace(record, index=i)


READ_AT_ONCE = 64  # records asked for at once from a source that draws them faster together


class _Positions:
    """A sampler whose records are keyed by their position in it (the source below maps
    a position to its record), so that the source sees where in the stream it is read."""

    def __init__(self, sampler):
        self.sampler = sampler
        self._shard_options = sampler._shard_options  # noqa: SLF001 - where grain's DataLoader looks for it

    def __repr__(self) -> str:  # the same record stream as the sampler's: checkpoints stay interchangeable
        return repr(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getitem__(self, i: int):
        return dataclasses.replace(self.sampler[i], record_key=i)


class _ReadAhead:
    """A source with `__getitems__` read by sampler position: a position not made yet is
    made with the rest of its block, the READ_AT_ONCE positions the same reader asks for
    (every `stride`-th: grain's workers take positions round robin) that start at a
    multiple of READ_AT_ONCE of them, in one `__getitems__` call. Each record is still
    the source's record at that position, so batches, resumes and worker counts are as
    without it; only the cost changes. Blocks are fixed, so reads out of order (several
    read threads, two iterators) find what another read made; the few newest are kept."""

    _KEPT_BLOCKS = 4

    def __init__(self, source, sampler, stride: int):
        self.source, self.sampler, self.stride = source, sampler, stride
        self._blocks, self._lock = {}, threading.Lock()  # (first position: {position: record}), oldest first

    def __repr__(self) -> str:
        return repr(self.source)

    def __getstate__(self):  # worker processes get their own empty store and lock
        return {"source": self.source, "sampler": self.sampler, "stride": self.stride}

    def __setstate__(self, state):
        self.__init__(**state)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getitem__(self, position: int):
        span = READ_AT_ONCE * self.stride
        first = position - (position % span) + position % self.stride
        with self._lock:
            if first not in self._blocks:
                positions = [p for p in range(first, first + span, self.stride) if p < len(self.sampler)]
                keys = [self.sampler[p].record_key for p in positions]
                self._blocks[first] = dict(zip(positions, self.source.__getitems__(keys), strict=True))
                while len(self._blocks) > self._KEPT_BLOCKS:
                    del self._blocks[next(iter(self._blocks))]
            block = self._blocks[first]
            record = block.pop(position)
            if not block:
                del self._blocks[first]
            return record


class BatchIterator:
    """Batches of `batch_size` records from a grain DataLoader of single records, with
    grain's iterator state (bytes, as `grain.checkpoint` saves it)."""

    def __init__(self, loader: grain.DataLoader, batch_size: int):
        self.loader, self.batch_size = loader, batch_size
        self.records = iter(loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        records = [next(self.records) for _ in range(self.batch_size)]  # a partial batch ends the epoch
        return stack(records)

    def get_state(self) -> bytes:
        return self.records.get_state()

    def set_state(self, state: bytes) -> None:
        values = state_for_workers(
            json.loads(state.decode()), self.loader.multiprocessing_options.num_workers, **self._shard()
        )
        self.records.set_state(json.dumps(values).encode())

    def records_consumed(self) -> int:
        """How many records this iterator has delivered (from its position)."""
        return records_consumed(json.loads(self.get_state().decode()), **self._shard())

    def _shard(self) -> dict[str, int]:
        shard = self.loader._shard_options  # noqa: SLF001 - grain keeps the resolved sharding here
        if shard is None:  # not sharded
            return {"shard_index": 0, "shard_count": 1}
        return {"shard_index": shard.shard_index, "shard_count": shard.shard_count}

    def start_prefetch(self) -> None:
        self.records.start_prefetch()

    def close(self) -> None:
        close = getattr(self.records._iterator, "close", None)  # noqa: SLF001 - stops worker processes
        if close is not None:
            close()


class Loader:
    """Iterable of batches (see `make_loader`); each `iter` starts a fresh iterator."""

    def __init__(self, loader: grain.DataLoader, batch_size: int):
        self.loader, self.batch_size = loader, batch_size

    def __iter__(self) -> BatchIterator:
        return BatchIterator(self.loader, self.batch_size)


def make_loader(
    source,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    workers: int = 0,
    read_threads: int = 1,
) -> Loader:
    """Batches of `source` as dicts of `[batch_size, ...]` numpy arrays (iterate it).

    Arguments:
        source: a random-access source (`__len__`, `__getitem__`, and `__getitems__` if it
            draws records faster together), e.g. from `make_source`.
        batch_size: examples per batch on this process (the last partial batch is dropped);
            with several processes each reads its own rows of global batches of
            batch_size x process count.
        seed: shuffling seed. shuffle: shuffle each epoch. num_epochs: None repeats for ever.
        workers: grain worker processes making records (0: in this process); the batches
            are the same for every value.
        read_threads: threads making records ahead of the consumer in each process (0:
            none). One, not grain's default of 16: our sources are Python and numpy that
            hold the GIL, and 16 threads contending for it made every source about 3x
            slower (docs/data.md, "Read-ahead threads").
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    if workers < 0:
        raise ValueError(f"workers must be >= 0 (0: records are made in this process); got {workers}")
    if read_threads < 0:
        raise ValueError(f"read_threads must be >= 0 (0: no read-ahead thread); got {read_threads}")
    if len(source) < batch_size:
        raise ValueError(f"the source holds {len(source)} records, fewer than one batch of {batch_size}")
    count = jax.process_count()
    sampler = grain.samplers.IndexSampler(
        num_records=len(source),
        shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True)
        if count == 1
        else grain.sharding.NoSharding(),
        shuffle=shuffle,
        num_epochs=num_epochs,
        seed=seed,
    )
    if count > 1:  # this process's rows of every global batch (see the module docstring)
        sampler = ProcessRows(sampler, batch_size, jax.process_index(), count)
    if workers and not flags.FLAGS.is_parsed():
        # grain <= 0.2.18 reads an absl flag in its worker start-up and fails unless flags
        # were parsed (google/grain#1355, fixed after 0.2.18); scripts without absl.app
        # never parse them, and the flags' defaults are what they get.
        flags.FLAGS.mark_as_parsed()
    if hasattr(source, "__getitems__"):  # it draws records faster together (Pathfinder)
        source = _ReadAhead(source, sampler, stride=max(workers, 1) * sampler._shard_options.shard_count)  # noqa: SLF001 - grain keeps it
        sampler = _Positions(sampler)
    # Records leave the workers one by one (batching there would give each worker's
    # batches its own records, and change them with the worker count).
    return Loader(
        grain.DataLoader(
            data_source=source,
            sampler=sampler,
            worker_count=workers,
            worker_buffer_size=batch_size,
            read_options=grain.ReadOptions(num_threads=read_threads),
        ),
        batch_size,
    )
