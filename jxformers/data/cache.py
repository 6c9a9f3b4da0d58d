"""Built splits: a task's records generated once and written to disk in grain's
random-access format (ArrayRecord), read back as a source that gives the same records.

    build_split(source, DIR/train, processes=8)   # `jxformers data build` does this
    read_split(DIR, "train", source)              # the records of `source`, from disk

A built split is a directory:

    spec.json      what it holds: the source (class, fields and generator version), the
                   record layout (each array's name, dtype and shape, in order) and the
                   shard files
    shard-00000-of-00012.array_record  ...   RECORDS_PER_SHARD records each, in index order

A record is its arrays' raw bytes, one after the other in the layout's order (every
task's records have fixed shapes), compressed by ArrayRecord (zstd). Shards are written
in parallel processes, each to a temporary name renamed when complete: an interrupted
build resumes with the shards it lacks, and the same source gives the same bytes
whatever the number of processes. `read_split` refuses a split built from another
source (another seed, size or setting), naming the differences.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import pathlib
import sys
from typing import Any

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from tqdm import tqdm

from jxformers._terminal import stderr_is_terminal
from jxformers.data.loader import READ_AT_ONCE

RECORDS_PER_SHARD = 1000
# group_size:1 makes every record readable alone (grain's random access needs it).
WRITER_OPTIONS = "group_size:1,zstd:3"
SPEC = "spec.json"


def describe(source) -> dict[str, Any]:
    """A source's identity: its class, its fields and, for a source that has one, the
    version of its generator (what decides its records)."""
    identity = {"class": type(source).__name__, "fields": dataclasses.asdict(source)}
    if hasattr(source, "generator_version"):  # absent from splits built before it was raised
        identity["generator_version"] = source.generator_version
    return identity


def layout_of(record: dict[str, np.ndarray]) -> list[list]:
    return [[name, np.asarray(a).dtype.str, list(np.shape(a))] for name, a in record.items()]


def encode(record: dict[str, np.ndarray], layout: list[list]) -> bytes:
    """A record's bytes; a ValueError if it does not fit the split's layout."""
    if layout_of(record) != layout:
        raise ValueError(f"a record's arrays {layout_of(record)} differ from the split's layout {layout}")
    return b"".join(np.ascontiguousarray(record[name]).tobytes() for name, _, _ in layout)


def decode(data: bytes, layout: list[list]) -> dict[str, np.ndarray]:
    out, offset = {}, 0
    for name, dtype, shape in layout:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        out[name] = np.frombuffer(data, dtype, count, offset).reshape(shape).copy()
        offset += count * dtype.itemsize
    return out


def shard_names(size: int, per_shard: int) -> list[str]:
    count = -(-size // per_shard)
    return [f"shard-{k:05d}-of-{count:05d}.array_record" for k in range(count)]


def _write_shard(source, path: pathlib.Path, start: int, stop: int, layout: list[list]) -> int:
    """Records [start, stop) of `source` into `path` (via a temporary name)."""
    partial = path.with_name(path.name + ".partial")
    writer = ArrayRecordWriter(str(partial), WRITER_OPTIONS)
    try:
        # a source that draws records faster together (Pathfinder) has __getitems__
        read = getattr(source, "__getitems__", None) or (lambda indices: map(source.__getitem__, indices))
        for first in range(start, stop, READ_AT_ONCE):
            for record in read(range(first, min(first + READ_AT_ONCE, stop))):
                writer.write(encode(record, layout))
    finally:
        writer.close()
    os.replace(partial, path)
    return stop - start


def build_split(
    source,
    directory: str | os.PathLike,
    *,
    processes: int | None = None,
    records_per_shard: int = RECORDS_PER_SHARD,
    progress: bool = True,
) -> pathlib.Path:
    """Write every record of `source` to `directory` (see the module docstring) with
    `processes` processes (default: the CPU count), resuming a build interrupted there.
    A ValueError when `directory` holds a build of another source."""
    if processes is not None and processes < 1:
        raise ValueError(f"processes must be >= 1; got {processes}")
    if records_per_shard < 1:
        raise ValueError(f"records_per_shard must be >= 1; got {records_per_shard}")
    directory = pathlib.Path(directory)
    spec = {
        "source": describe(source),
        "size": len(source),
        "layout": layout_of(source[0]),
        "records_per_shard": records_per_shard,
        "shards": shard_names(len(source), records_per_shard),
        "writer_options": WRITER_OPTIONS,
    }
    if (directory / SPEC).exists():
        found = json.loads((directory / SPEC).read_text())
        if found != spec:
            raise ValueError(
                f"{directory} holds a build of another source ({_differences(found, spec)}); "
                f"remove it or build elsewhere"
            )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SPEC).write_text(json.dumps(spec, indent=1))
    for stale in directory.glob("*.partial"):  # from an interrupted build: rewritten below
        stale.unlink()
    todo = [(k, name) for k, name in enumerate(spec["shards"]) if not (directory / name).exists()]
    size, per = len(source), records_per_shard
    done = size - sum(min(per, size - k * per) for k, _ in todo)
    # A bar on a terminal only: redrawn into a log file it would fill it.
    bar = tqdm(
        total=size,
        initial=done,
        unit="rec",
        desc=f"build {directory}",
        disable=not (progress and stderr_is_terminal()),
        file=sys.stderr,
    )
    workers = min(processes or os.cpu_count() or 1, len(todo))
    jobs = [(source, directory / name, k * per, min((k + 1) * per, size), spec["layout"]) for k, name in todo]
    with bar:
        if workers <= 1:
            for job in jobs:
                bar.update(_write_shard(*job))
            return directory
        # spawn: the parent may hold JAX's threads, which fork would copy half-way.
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for done_job in concurrent.futures.as_completed([pool.submit(_write_shard, *job) for job in jobs]):
                bar.update(done_job.result())
    return directory


def _differences(found: dict, expected: dict) -> str:
    def flat(tree, prefix=""):
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out |= flat(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value
        return out

    a, b = flat(found), flat(expected)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return "; ".join(f"{k}: {a.get(k)!r} built, {b.get(k)!r} wanted" for k in keys)


class BuiltSplit:
    """The records of `spec` (a task source) read from the split built in `directory`.
    It answers for `spec` otherwise (vocab_size, max_len, ...)."""

    def __init__(self, spec, directory: str | os.PathLike):
        self.spec, self.directory = spec, pathlib.Path(directory)
        path = self.directory / SPEC
        if not path.exists():
            raise ValueError(
                f"no built split in {self.directory} (no {SPEC}); build it with `jxformers data build CONFIG --out DIR`"
            )
        built = json.loads(path.read_text())
        expected = {"source": describe(spec), "size": len(spec)}
        if {k: built.get(k) for k in expected} != expected:
            raise ValueError(
                f"{self.directory} was built from another source than the config's "
                f"({_differences({k: built.get(k) for k in expected}, expected)}); rebuild it"
            )
        missing = [name for name in built["shards"] if not (self.directory / name).exists()]
        if missing:
            raise ValueError(
                f"the build in {self.directory} is incomplete ({len(missing)} of "
                f"{len(built['shards'])} shards missing); rerun `jxformers data build` to finish it"
            )
        self.layout, self.paths = built["layout"], [str(self.directory / name) for name in built["shards"]]
        self._reader = None

    def _records(self) -> grain.sources.ArrayRecordDataSource:
        if self._reader is None:  # opened lazily: in each grain worker, after unpickling
            self._reader = grain.sources.ArrayRecordDataSource(self.paths)
        return self._reader

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_reader"} | {"_reader": None}

    def __getattr__(self, name: str):
        if name == "spec" or name.startswith("__"):  # while unpickling, before __dict__ is set
            raise AttributeError(name)
        return getattr(self.spec, name)

    def __len__(self) -> int:
        return len(self.spec)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return decode(self._records()[int(index)], self.layout)

    def __repr__(self) -> str:
        # The same records as `spec`, so the same identity in grain's iterator state: a
        # run may switch between generating and reading its records (data.path).
        return repr(self.spec)


def read_split(root: str | os.PathLike, split: str, spec) -> BuiltSplit:
    """The split `split` ("train" or "eval") built under `root` for the source `spec`."""
    return BuiltSplit(spec, pathlib.Path(root) / split)
