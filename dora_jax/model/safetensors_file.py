"""The safetensors format, read lazily and written streaming, with bfloat16.

A file is an 8-byte little-endian header length, a JSON header mapping each tensor's
name to its dtype, shape and byte range (after the header), then the raw
little-endian bytes. Reading memory-maps the file, so taking one tensor (or one
slice of it) reads only those bytes: a checkpoint far larger than host memory loads
tensor by tensor. Writing takes the tensors as (name, shape, dtype, producer) and
calls each producer only when its bytes are due, so the trained policy never sits
whole in host memory either. bfloat16 is `ml_dtypes.bfloat16` (numpy has none).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from typing import NamedTuple

import ml_dtypes
import numpy as np

from dora_jax.base import untrusted_files
from dora_jax.model import safetensors_check

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_ITEMSIZES = {k: np.dtype(v).itemsize for k, v in _DTYPES.items()}


class TensorInfo(NamedTuple):
    dtype: np.dtype
    shape: tuple
    start: int  # byte offset in the file
    end: int


class SafetensorsFile:
    """Lazy reader of one .safetensors file: `names`, `info(name)`, `get(name)`."""

    def __init__(self, path: str) -> None:
        """Reads and checks the header (safetensors_check: every rule of the format);
        a bad file raises one SafetensorsError line naming it and the tensor."""
        self.path = path
        error = safetensors_check.SafetensorsError
        try:
            # A regular file (a FIFO would block, a device read forever): untrusted_files.
            fd = untrusted_files.open_regular(path, error=error)
        except FileNotFoundError:
            raise error(f"{path}: no such file") from None
        with os.fdopen(fd, "rb") as f:
            n, self.metadata, entries = safetensors_check.parse(
                path, f, os.fstat(f.fileno()).st_size, _ITEMSIZES)
        self._info = {e.name: TensorInfo(np.dtype(_DTYPES[e.dtype]), e.shape,
                                         8 + n + e.begin, 8 + n + e.end) for e in entries}
        self._map: np.memmap | None = None

    @property
    def names(self) -> list[str]:
        return list(self._info)

    def info(self, name: str) -> TensorInfo:
        return self._info[name]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the memory-mapped file (no copy until
        used): slicing it reads only the bytes of the slice."""
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        i = self._info[name]
        flat = self._map[i.start:i.end].view(i.dtype.newbyteorder("<"))
        return flat.reshape(i.shape)


class TensorSpec(NamedTuple):
    name: str
    shape: tuple
    dtype: np.dtype
    produce: Callable[[], np.ndarray]  # called once, when the tensor is written


def write(path: str, tensors: Iterable[TensorSpec], metadata: dict | None = None) -> int:
    """Writes `tensors` to `path` in order, producing each when due; returns bytes
    written. A produced array must have the declared shape (checked)."""
    tensors = list(tensors)
    header, offset = {}, 0
    for t in tensors:
        dtype = np.dtype(t.dtype)
        nbytes = dtype.itemsize * int(np.prod(t.shape))
        header[t.name] = {"dtype": _NAMES[dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensor data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            array = np.ascontiguousarray(np.asarray(t.produce(), dtype=t.dtype))
            if array.shape != tuple(t.shape):
                raise ValueError(f"tensor {t.name!r}: produced shape {array.shape}, "
                                 f"declared {tuple(t.shape)}")
            f.write(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    os.replace(tmp, path)  # a crash mid-write leaves no half-written file behind
    return 8 + len(blob) + offset


class Checkpoint:
    """Every tensor of a Hugging Face checkpoint directory: one model.safetensors,
    or shards named by model.safetensors.index.json."""

    def __init__(self, directory: str) -> None:
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            weight_map = safetensors_check.read_index(index)
            files = {fn: SafetensorsFile(safetensors_check.confined(directory, fn, index))
                     for fn in sorted(set(weight_map.values()))}
            for name, fn in weight_map.items():
                if name not in files[fn]._info:
                    raise safetensors_check.SafetensorsError(
                        f"{index}: weight_map puts tensor {name!r} in {fn}, which has no "
                        "such tensor")
            self._where = {name: files[fn] for name, fn in weight_map.items()}
        elif os.path.exists(single):
            f = SafetensorsFile(safetensors_check.confined(directory, "model.safetensors",
                                                           directory, "file"))
            self._where = {name: f for name in f.names}
        else:
            raise FileNotFoundError(f"{directory}: no model.safetensors or "
                                    f"model.safetensors.index.json")

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple:
        return self._where[name].info(name).shape

    def dtype(self, name: str) -> np.dtype:
        return self._where[name].info(name).dtype

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return self._where[name].get(name)


def write_sharded(directory: str, tensors: list[TensorSpec], max_shard_bytes: int,
                  metadata: dict | None = None) -> list[str]:
    """Writes `tensors` as model.safetensors, or, past `max_shard_bytes`, as
    model-0000i-of-0000n.safetensors shards with their index. Returns the files."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for t in tensors:
        nbytes = np.dtype(t.dtype).itemsize * int(np.prod(t.shape))
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        write(os.path.join(directory, "model.safetensors"), shards[0], metadata)
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = 0
    for fn, shard in zip(names, shards):
        total += write(os.path.join(directory, fn), shard, metadata)
    index = {"metadata": {"total_size": sum(
        np.dtype(t.dtype).itemsize * int(np.prod(t.shape)) for t in tensors)},
        "weight_map": {t.name: fn for fn, shard in zip(names, shards) for t in shard}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    return names
