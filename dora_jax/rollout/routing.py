"""The experts a rollout's MoE layers chose, per response token: [tokens, MoE layers, k]
in the smallest unsigned type that holds the ids (`routing_dtype`), its maximum
marking a token with none recorded (`not_routed`).

A token's experts are those of the decode step that took it as input: the step that
sampled the token after it. So the last token of a response (its last turn's, in an
episode) has none, nor have observation tokens, nor a token whose next was sampled by
a prefill (a resumed sample's last token before its re-prefill), and the first
record of a token stands (a re-prefill does not record again). Training recomputes
what has no record (rl/trainer.py, `trainer.moe_routing`).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

# An expert-id array's element type: a NumPy dtype, or the scalar type `routing_dtype` gives.
IdType = np.dtype[Any] | type[np.unsignedinteger[Any]]


def routing_dtype(num_experts: int) -> type[np.unsignedinteger[Any]]:
    """The smallest unsigned type holding every expert id and, at its maximum,
    `not_routed`."""
    return np.uint8 if num_experts < 255 else np.uint16


def not_routed(num_experts: int) -> int:
    """The id that marks a token with no recorded experts (>= num_experts)."""
    return int(np.iinfo(routing_dtype(num_experts)).max)


def unrecorded(shape: tuple[int, ...], dtype: IdType) -> np.ndarray:
    """An array of `shape` with no token recorded."""
    return np.full(shape, np.iinfo(dtype).max, dtype)


def put(buf: np.ndarray | None, start: int, rows: np.ndarray) -> np.ndarray:
    """`buf` with `rows` [M, layers, k] at response indices start..start+M-1 (grown,
    new entries unrecorded); entries already recorded are kept."""
    end = start + len(rows)
    if buf is None or buf.shape[0] < end:
        size = max(end, 2 * (0 if buf is None else buf.shape[0]), 16)
        grown = unrecorded((size, *rows.shape[1:]), rows.dtype)
        if buf is not None:
            grown[:buf.shape[0]] = buf
        buf = grown
    span = buf[start:end]
    fresh = span[:, 0, 0] == np.iinfo(buf.dtype).max
    if fresh.all():
        span[...] = rows
    else:
        span[fresh] = rows[fresh]
    return buf


def cut(buf: np.ndarray | None, length: int) -> np.ndarray | None:
    """The first `length` tokens' records (unrecorded beyond what `buf` holds)."""
    if buf is None:
        return None
    if buf.shape[0] >= length:
        return buf[:length].copy()
    out = unrecorded((length, *buf.shape[1:]), buf.dtype)
    out[:buf.shape[0]] = buf
    return out


def recorded(routing: np.ndarray) -> np.ndarray:
    """bool [tokens]: the token has a record."""
    return routing[:, 0, 0] != np.iinfo(routing.dtype).max


def to_json(routing: np.ndarray | None) -> dict | None:
    if routing is None:
        return None
    return {"dtype": routing.dtype.name, "shape": list(routing.shape),
            "data": base64.b64encode(np.ascontiguousarray(routing).tobytes()).decode("ascii")}


def from_json(d: dict | None) -> np.ndarray | None:
    """Reads `to_json`'s form back; ValueError if it is not one."""
    if d is None:
        return None
    dtype = np.dtype(d["dtype"])
    if dtype not in (np.uint8, np.uint16):
        raise ValueError(f"routing dtype must be uint8 or uint16, got {dtype}")
    shape = tuple(int(n) for n in d["shape"])
    data = base64.b64decode(d["data"], validate=True)
    if len(shape) != 3 or len(data) != dtype.itemsize * int(np.prod(shape)):
        raise ValueError(f"routing of shape {shape} does not match its {len(data)} bytes")
    return np.frombuffer(data, dtype).reshape(shape).copy()
