"""metrics.jsonl records as TensorBoard scalars (`<workdir>/tensorboard/`).

View them with `tensorboard --logdir=<workdir>/tensorboard` (the `tensorboard` package,
installed apart). Every number of a step's record becomes a scalar at that step,
nested keys joined by "/": `reward_mean`, `trainer/loss`, `slot_utilisation/0`,
`staleness/2`, `trainer_wait_split/guard`; a list is logged by its length
(`resident_versions/count`). A resumed run purges the events of steps it trains
again, as metrics.jsonl drops their lines. `read_scalars` reads the files back.

The files are TFRecords of `tensorflow.Event` protocol buffers, written here: the three
messages and five fields a scalar needs take a few lines, where a writer package would
import its own framework (tensorboardX imports torch where it is installed: a second of
every run's start).
"""

from __future__ import annotations

import glob
import math
import os
import socket
import struct
import time
from collections.abc import Iterator
from numbers import Real


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numbers by tag (see the module docstring); `step` is not one."""
    out = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, Real):  # what JSON numbers load as (no complex)
            if tag != "step":
                out[tag] = float(value)
        elif isinstance(value, dict):
            out.update(flatten(value, tag + "/"))
        elif isinstance(value, (list, tuple)):
            out[tag + "/count"] = float(len(value))
    return out


# CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), masked as TFRecord masks it.
_CRC_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ 0x82F63B78 if _crc & 1 else _crc >> 1
    _CRC_TABLE.append(_crc)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(payload: bytes) -> bytes:
    length = struct.pack("<Q", len(payload))
    return (length + struct.pack("<I", _masked_crc(length)) + payload
            + struct.pack("<I", _masked_crc(payload)))


# Protocol buffer wire format: a field's key is (number << 3) | wire type.
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # wire type 2: length-delimited
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _float32(value: float) -> bytes:
    try:
        return struct.pack("<f", value)
    except OverflowError:  # finite, past float32's range: what a cast to float32 gives
        return struct.pack("<f", math.copysign(math.inf, value))


def _event(step: int, *, summary: dict[str, float] | None = None,
           file_version: str | None = None, session_start: bool = False) -> bytes:
    """An Event: wall_time = 1 (double), step = 2, file_version = 3, summary = 5
    (Summary.value = 1: Value.tag = 1, Value.simple_value = 2, a float), session_log
    = 7 (SessionLog.status = 1, START = 1)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", time.time())
    out += _varint(2 << 3) + _varint(step & 0xFFFFFFFFFFFFFFFF)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if summary is not None:
        out += _field(5, b"".join(
            _field(1, _field(1, tag.encode()) + _varint(2 << 3 | 5) + _float32(value))
            for tag, value in summary.items()))
    if session_start:
        out += _field(7, _varint(1 << 3) + _varint(1))
    return out


class TensorBoardWriter:
    """Writes each step record's scalars as one event, on the caller's thread (the
    metrics writer's); `purge_step`: drop events at or after it (the steps a resumed
    run trains again). Flushed at most every `flush_secs` and on close."""

    def __init__(self, logdir: str, purge_step: int | None = None,
                 flush_secs: float = 10.0) -> None:
        os.makedirs(logdir, exist_ok=True)
        # TensorBoard orders files by name: the nanoseconds order two files opened in
        # the same second (a quick resume) instead of the second overwriting the first.
        ns = time.time_ns()
        name = f"events.out.tfevents.{ns // 10**9:010d}.{socket.gethostname()}.{ns}"
        self._file = open(os.path.join(logdir, name), "wb")
        self._file.write(_record(_event(0, file_version="brain.Event:2")))
        if purge_step is not None:  # TensorBoard drops the earlier files' later steps
            self._file.write(_record(_event(purge_step, session_start=True)))
        self._flush_secs, self._flushed = flush_secs, time.monotonic()

    def write(self, record: dict) -> None:
        self._file.write(_record(_event(int(record["step"]), summary=flatten(record))))
        if time.monotonic() - self._flushed >= self._flush_secs:
            self._file.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()


def _fields(message: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(number, value) of each field: an int for a varint, the bytes otherwise (a
    fixed-size number's or a length-delimited field's)."""
    at = 0
    while at < len(message):
        key, at = _read_varint(message, at)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, at = _read_varint(message, at)
        elif wire in (1, 2, 5):
            if wire == 2:
                size, at = _read_varint(message, at)
            else:
                size = 8 if wire == 1 else 4
            value, at = message[at:at + size], at + size
        else:
            raise ValueError(f"unsupported protocol buffer wire type {wire}")
        yield number, value


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError("truncated protocol buffer")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `logdir`: {tag: [(step, value), ...]} in
    file order, honouring a later file's purge of steps at or after its first step
    (what TensorBoard shows). A file's unfinished last record is left for later, as
    TensorBoard leaves it; a record whose checksum fails raises ValueError."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"),
                                 recursive=True)):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            if offset + 16 + length > len(data):
                break  # a record still being written (or cut short by a kill)
            payload = data[offset + 12:offset + 12 + length]
            (crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
            if crc != _masked_crc(payload):
                raise ValueError(f"{path}: a corrupt record at byte {offset}")
            offset += 16 + length  # length, its CRC, the payload, its CRC
            step, values, start = 0, [], False
            for number, value in _fields(payload):
                if number == 2 and isinstance(value, int):
                    step = value - (1 << 64) if value >= 1 << 63 else value
                elif number == 5 and isinstance(value, bytes):
                    values += [v for n, v in _fields(value) if n == 1]
                elif number == 7 and isinstance(value, bytes):
                    start = (1, 1) in _fields(value)
            if start:  # a purge: later steps are replaced
                for tag in scalars:
                    scalars[tag] = [(s, v) for s, v in scalars[tag] if s < step]
            for entry in values:
                fields = dict(_fields(entry)) if isinstance(entry, bytes) else {}
                name, simple = fields.get(1), fields.get(2)
                if isinstance(name, bytes) and isinstance(simple, bytes) and len(simple) == 4:
                    scalars.setdefault(name.decode(), []).append(
                        (step, struct.unpack("<f", simple)[0]))
    return scalars
