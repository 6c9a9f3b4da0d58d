"""TensorBoard scalars without TensorFlow: `Event` protocol buffers encoded by hand in
TFRecord framing (length, masked CRC-32C of the length, payload, masked CRC-32C of the
payload), which is all an `events.out.tfevents.*` file is."""

from __future__ import annotations

import pathlib
import socket
import struct
import time
from typing import Any


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord uses."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def encode_event(
    *, wall_time: float, step: int = 0, scalars: dict[str, float] | None = None, file_version: str | None = None
) -> bytes:
    """An `Event` message: wall_time (1, double), step (2, int64), file_version (3) or a
    Summary (5) of Value{tag (1), simple_value (2, float)}."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", value)))
            for tag, value in scalars.items()
        )
        out += _bytes_field(5, values)
    return out


def frame(record: bytes) -> bytes:
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", masked_crc(length)) + record + struct.pack("<I", masked_crc(record))


class EventWriter:
    """Appends scalar summaries to a new event file in `logdir` (TensorBoard reads every
    file of a directory, so a resumed run simply adds one)."""

    def __init__(self, logdir: str | pathlib.Path):
        logdir = pathlib.Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = logdir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{time.monotonic_ns()}"
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._file.write(frame(encode_event(wall_time=now, file_version="brain.Event:2")))

    def scalars(self, step: int, values: dict[str, Any]) -> None:
        """The numbers among `values` (others, such as strings and dicts, are not scalars)."""
        values = {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if values:
            self._file.write(frame(encode_event(wall_time=time.time(), step=step, scalars=values)))
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: str | pathlib.Path) -> list[bytes]:
    """The payloads of a TFRecord file, checking both CRCs (for tests and inspection)."""
    data, out, i = pathlib.Path(path).read_bytes(), [], 0
    while i < len(data):
        (length,) = struct.unpack_from("<Q", data, i)
        (crc,) = struct.unpack_from("<I", data, i + 8)
        if crc != masked_crc(data[i : i + 8]):
            raise ValueError(f"bad length CRC at byte {i}")
        record = data[i + 12 : i + 12 + length]
        (crc,) = struct.unpack_from("<I", data, i + 12 + length)
        if crc != masked_crc(record):
            raise ValueError(f"bad record CRC at byte {i}")
        out.append(record)
        i += 16 + length
    return out
