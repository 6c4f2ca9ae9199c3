"""Validation of safetensors files and shard indexes that someone else wrote.

A checkpoint is untrusted input: its header decides which bytes of the file become
which tensor, and its index decides which files are opened. Everything is checked
before a byte of tensor data is read, and each failure is one `CheckpointError`
line naming the file and the tensor or field, e.g.

    /ckpt/model.safetensors: tensor 'lm_head.weight': data_offsets [8, 4] are reversed

The rules are the format's own (https://huggingface.co/docs/safetensors, and what
the reference Rust reader enforces): the header is a JSON object of at most 100 MB;
every entry has a known `dtype`, a `shape` of non-negative ints and `data_offsets`
[begin, end] relative to the data section; the entries, sorted by offset, cover the
data section exactly, without holes or overlaps (no bytes hide between tensors, so a
file cannot be two things at once); `end - begin` is the dtype's itemsize times the
number of elements. `__metadata__` maps strings to strings.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, BinaryIO, NamedTuple

from dora_jax.base import untrusted_files
from dora_jax.model.hf_config import CheckpointError

MAX_HEADER = 100 * 2 ** 20  # the reference reader's limit
# No tensor a host can hold has more bytes than this (1 PiB); a larger declared size
# is a corrupt or hostile header, refused before numpy multiplies it in int64.
MAX_TENSOR_BYTES = 2 ** 50


class SafetensorsError(CheckpointError):
    """A safetensors file or its shard index breaks the format."""


class Entry(NamedTuple):
    name: str
    dtype: str  # the format's name, e.g. "BF16"
    shape: tuple
    begin: int  # relative to the start of the data section
    end: int


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _unique_object(path: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise SafetensorsError(f"{path}: header names {key!r} twice")
            seen.add(key)
        return dict(pairs)
    return hook


def read_header(path: str, f: BinaryIO, file_size: int) -> tuple[int, dict]:
    """(header length, header object) of the open file `f`, checked to be a JSON
    object lying within the file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
    n = int.from_bytes(raw, "little")
    if n > MAX_HEADER:
        raise SafetensorsError(f"{path}: header length {n} is over the format's limit "
                               f"of {MAX_HEADER} bytes (not a safetensors file?)")
    if 8 + n > file_size:
        raise SafetensorsError(f"{path}: header length {n} runs past the end of the "
                               f"{file_size}-byte file (truncated?)")
    blob = f.read(n)
    untrusted_files.check_depth(blob, f"{path}: header", error=SafetensorsError)
    try:
        header = json.loads(blob.decode("utf-8"), object_pairs_hook=_unique_object(path))
    except UnicodeDecodeError:
        raise SafetensorsError(f"{path}: header is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e.msg} at byte "
                               f"{e.pos})") from None
    except RecursionError:
        raise SafetensorsError(f"{path}: header nests too deeply") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, "
                               "not an object")
    return n, header


def check_metadata(path: str, metadata: object) -> dict:
    """`__metadata__`: absent, or a dict of str -> str."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of strings, got "
                               f"{type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise SafetensorsError(f"{path}: __metadata__ {key!r} must be a string, got "
                                   f"{type(value).__name__}")
    return metadata


def check_entry(path: str, name: str, entry: object, itemsizes: dict) -> Entry:
    """One header entry, its fields typed and its byte length agreeing with its
    dtype and shape."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where}: entry must be an object, got {type(entry).__name__}")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise SafetensorsError(f"{where}: no {field}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in itemsizes:
        raise SafetensorsError(f"{where}: dtype {dtype!r} is not supported; supported: "
                               f"{sorted(itemsizes)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)):
        raise SafetensorsError(f"{where}: data_offsets {offsets!r} is not two non-negative ints")
    begin, end = offsets
    if begin > end:
        raise SafetensorsError(f"{where}: data_offsets {offsets} are reversed")
    # Python ints: no product overflows, however large the declared dims.
    elements, footprint = 1, itemsizes[dtype]
    for d in shape:
        elements *= d
        footprint *= max(d, 1)  # a zero dim still has numpy multiply the others
    if footprint > MAX_TENSOR_BYTES:
        raise SafetensorsError(f"{where}: shape {shape} is absurdly large")
    if end - begin != elements * itemsizes[dtype]:
        raise SafetensorsError(f"{where}: data_offsets {offsets} hold {end - begin} bytes, "
                               f"but {dtype} {shape} needs {elements * itemsizes[dtype]}")
    return Entry(name, dtype, tuple(shape), begin, end)


def check_layout(path: str, entries: list[Entry], data_size: int) -> None:
    """The entries, by offset, tile the data section [0, data_size) exactly."""
    at, previous = 0, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.end > data_size:
            raise SafetensorsError(f"{path}: tensor {e.name!r}: data_offsets "
                                   f"[{e.begin}, {e.end}] run past the data section's "
                                   f"{data_size} bytes (truncated?)")
        if e.begin < at:
            raise SafetensorsError(f"{path}: tensor {e.name!r}: data_offsets "
                                   f"[{e.begin}, {e.end}] overlap tensor {previous!r}")
        if e.begin > at:
            raise SafetensorsError(f"{path}: tensor {e.name!r}: data_offsets "
                                   f"[{e.begin}, {e.end}] leave a hole of {e.begin - at} "
                                   f"bytes before it")
        at, previous = e.end, e.name
    if at != data_size:
        raise SafetensorsError(f"{path}: {data_size - at} bytes after the last tensor "
                               "belong to none")


def parse(path: str, f: BinaryIO, file_size: int, itemsizes: dict) -> tuple[int, dict, list[Entry]]:
    """(header length, metadata, entries) of an open safetensors file, every rule of
    the format checked."""
    n, header = read_header(path, f, file_size)
    metadata = check_metadata(path, header.pop("__metadata__", None))
    entries = [check_entry(path, name, entry, itemsizes) for name, entry in header.items()]
    check_layout(path, entries, file_size - 8 - n)
    return n, metadata, entries


# ------------------------------------------------------------------ shard index

def confined(directory: str, filename: str, where: str, what: str = "shard") -> str:
    """The path of `filename` inside `directory`; a name that is absolute, climbs out
    with `..`, or is a symlink to a file outside the directory is refused (`where`:
    the file that names it, `what`: what it is, for the error)."""
    if not filename or os.path.isabs(filename) or filename.startswith(("/", "\\")):
        raise SafetensorsError(f"{where}: {what} {filename!r} is not a relative file name")
    parts = filename.replace("\\", "/").split("/")
    if ".." in parts:
        raise SafetensorsError(f"{where}: {what} {filename!r} climbs out of the checkpoint "
                               "directory")
    path = os.path.join(directory, filename)
    real = untrusted_files.outside(path, directory)
    if real is not None:
        raise SafetensorsError(f"{where}: {what} {filename!r} is a link to {real}, outside "
                               "the checkpoint directory")
    if not os.path.exists(path):
        raise SafetensorsError(f"{where}: {what} {filename!r} does not exist")
    return path


def read_index(path: str) -> dict[str, str]:
    """The `weight_map` of a model.safetensors.index.json: tensor name -> shard file."""
    index = untrusted_files.loads(untrusted_files.read_bytes(
        path, untrusted_files.INDEX_JSON_CAP, within=os.path.dirname(path),
        error=SafetensorsError), path, SafetensorsError)
    if not isinstance(index, dict):
        raise SafetensorsError(f"{path}: expected a JSON object, got {type(index).__name__}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise SafetensorsError(f"{path}: weight_map must be a non-empty object of tensor "
                               "name -> shard file")
    for name, filename in weight_map.items():
        if not isinstance(filename, str):
            raise SafetensorsError(f"{path}: weight_map {name!r} must be a file name, got "
                                   f"{filename!r}")
    return weight_map
