"""Checksums of what a checkpoint holds, written beside it and verified on restore, so a
damaged checkpoint (a flipped bit in an array file, an edited data position) is found and
falls back like any other damage instead of restoring silently.

- The state: one 32-bit checksum per array, `sum_i word_i * (2 i + 1) mod 2**32` over the
  array's bits as 32-bit words (16- and 8-bit types widened, 64-bit split). The weights
  are odd, so a single flipped bit always changes it, and a swap of two words almost
  always does. One pass over the state per save: on the devices (jitted; sharded
  arrays of several processes included), or with NumPy when the state is whole on
  this process's CPU.
- The data position: the SHA-256 of each process's iterator state (grain's JSON,
  canonicalised), gathered from every process at save time.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

VERSION = 1


def _words(x, xp):
    """The bits of `x` as a flat uint32 array (`xp`: numpy or jax.numpy)."""
    if x.dtype == bool:
        x = x.astype(xp.uint8)
    size = np.dtype(x.dtype).itemsize
    if xp is np:
        x = np.ascontiguousarray(x)
        words = x.view(np.uint32) if size >= 4 else x.view({1: np.uint8, 2: np.uint16}[size])
    else:  # a 64-bit element becomes two words
        words = jax.lax.bitcast_convert_type(x, jnp.uint32 if size >= 4 else {1: jnp.uint8, 2: jnp.uint16}[size])
    return words.ravel().astype(xp.uint32)


def _checksum(x, xp):
    words = _words(x, xp)
    weights = xp.arange(words.size, dtype=xp.uint32) * xp.uint32(2) + xp.uint32(1)
    return xp.sum(words * weights, dtype=xp.uint32)


_on_devices = jax.jit(lambda tree: {name: _checksum(x, jnp) for name, x in tree.items()})


def state_checksums(state: dict[str, Any], *, on_host: bool | None = None) -> dict[str, int]:
    """{name: checksum} of a flat {name: array} state (see module docstring). Computed
    with NumPy when every array is whole on this process's CPU (no compilation: most
    runs on a CPU, and every test), else jitted on the devices; both give the same
    numbers (tested)."""
    arrays = {
        name: jax.random.key_data(x) if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) else x
        for name, x in state.items()
    }
    if on_host is None:
        on_host = all(
            not isinstance(x, jax.Array) or (x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices()))
            for x in arrays.values()
        )
    if on_host:
        return {name: int(_checksum(np.asarray(x), np)) for name, x in arrays.items()}
    arrays = {name: x if isinstance(x, jax.Array) else jnp.asarray(x) for name, x in arrays.items()}
    return {name: int(value) for name, value in jax.device_get(_on_devices(arrays)).items()}


def data_digest(state: bytes | str | dict[str, Any]) -> str:
    """SHA-256 (hex) of an iterator state, whichever form grain gives it (JSON bytes or a
    dict), with keys sorted so the same position always gives the same digest."""
    if isinstance(state, bytes):
        state = state.decode()
    if isinstance(state, str):
        state = json.loads(state)
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def all_processes(digest: str) -> list[str]:
    """Every process's digest, in process order (each process passes its own)."""
    if jax.process_count() == 1:
        return [digest]
    from jax.experimental import multihost_utils

    words = np.frombuffer(bytes.fromhex(digest), np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(words))
    return [row.astype(np.uint32).tobytes().hex() for row in gathered.reshape(jax.process_count(), -1)]


def checksums(state: dict[str, Any], iterator, run: str | None = None) -> dict[str, Any]:
    """What a checkpoint stores beside `state` and the data `iterator`'s position (and
    the id of the `run` that wrote it)."""
    return {
        "version": VERSION,
        "state": state_checksums(state),
        "data": all_processes(data_digest(iterator.get_state())),
        **({} if run is None else {"run": run}),
    }


def verify(saved: dict[str, Any], state: dict[str, Any], position: bytes | str, run: str | None = None) -> None:
    """Raise ValueError naming the first array (or the data position) whose checksum
    differs from `saved`'s, or the other run that wrote it (both ids known and unequal).
    `position`: this process's data position as the checkpoint holds it (grain's file;
    an iterator's state after restoring need not read back byte for byte)."""
    if saved.get("version") != VERSION:
        raise ValueError(f"checksums of an unknown version {saved.get('version')!r} (this jxformers writes {VERSION})")
    if run is not None and saved.get("run") not in (None, run):
        raise ValueError(f"written by another run (run id {saved['run']}; this run's is {run})")
    read = state_checksums(state)
    for name, want in saved["state"].items():
        if name not in read:
            raise ValueError(f"checksum listed for {name!r}, which the restored state lacks")
        if read[name] != want:
            raise ValueError(f"checksum of {name!r} differs: saved {want:#010x}, read {read[name]:#010x}")
    digests = saved["data"]
    index = jax.process_index()
    if len(digests) != jax.process_count():
        raise ValueError(f"data checksums of {len(digests)} processes; this run has {jax.process_count()}")
    if data_digest(position) != digests[index]:
        raise ValueError(f"checksum of the data position (process {index}) differs: it was edited or damaged")
