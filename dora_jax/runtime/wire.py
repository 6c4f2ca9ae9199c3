"""Commands and events between processes: messages as JSON over an authenticated
socket.

A message is a kind and a dict of fields. Its values may be JSON values, tuples,
dicts with non-string keys, numpy arrays and the dataclasses registered here
(requests, finished samples, slice counters); nothing is unpickled, so a peer can
send data but never code. The connection is `multiprocessing.connection`'s, whose
handshake proves that both ends hold the run's key (HMAC) before a message passes.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import secrets
import socket
import threading
from multiprocessing import connection
from typing import Any

import numpy as np

from dora_jax.rollout.trajectory import InFlight, Request, SliceStats, Trajectory

# What may cross the wire as a dataclass: by name, never by a path a peer chooses.
_CLASSES = {cls.__name__: cls for cls in (Request, Trajectory, SliceStats, InFlight)}
# A message larger than this is refused unread (a finished batch is kilobytes).
MAX_MESSAGE_BYTES = 256 << 20
AUTHKEY_ENV = "DORA_AUTHKEY"


class WireError(RuntimeError):
    """A message that does not decode, or a peer that went away."""


def _encode(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = type(x).__name__
        if _CLASSES.get(name) is not type(x):
            raise TypeError(f"{name} does not cross the wire")
        return {"__dc__": name, "f": {f.name: _encode(getattr(x, f.name))
                                      for f in dataclasses.fields(x)}}
    if isinstance(x, np.ndarray):
        return {"__nd__": [x.dtype.str, list(x.shape),
                           base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()]}
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v) for k, v in x.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"{type(x).__name__} does not cross the wire")


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__dc__" in x:
        cls = _CLASSES.get(x["__dc__"])
        if cls is None:
            raise WireError(f"unknown record type {x['__dc__']!r}")
        fields = {k: _decode(v) for k, v in x["f"].items()}
        known = {f.name for f in dataclasses.fields(cls)}
        if set(fields) - known:
            raise WireError(f"{cls.__name__} has no field(s) {sorted(set(fields) - known)}")
        return cls(**fields)
    if "__nd__" in x:
        dtype, shape, data = x["__nd__"]
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise WireError("object arrays do not cross the wire")
        return np.frombuffer(base64.b64decode(data), dtype=dt).reshape(shape).copy()
    if "__tuple__" in x:
        return tuple(_decode(v) for v in x["__tuple__"])
    if "__items__" in x:
        return {_as_key(_decode(k)): _decode(v) for k, v in x["__items__"]}
    return {k: _decode(v) for k, v in x.items()}


def _as_key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, "fields": _encode(fields)}).encode()


def decode(data: bytes) -> tuple[str, dict]:
    try:
        msg = json.loads(data)
        return msg["kind"], _decode(msg["fields"])
    except (ValueError, KeyError, TypeError) as e:
        raise WireError(f"undecodable message: {type(e).__name__}: {e}") from None


def new_authkey() -> str:
    return secrets.token_hex(16)


def authkey() -> bytes:
    key = os.environ.get(AUTHKEY_ENV)
    if not key:
        raise WireError(f"{AUTHKEY_ENV} is not set: every process of a run needs the run's "
                        "key (the launcher sets it)")
    return key.encode()


class Link:
    """One end of a connection: `send` from any thread, `recv` from one."""

    def __init__(self, conn: connection.Connection) -> None:
        self._conn = conn
        self._send_lock = threading.Lock()

    def send(self, kind: str, **fields: Any) -> None:
        data = encode(kind, **fields)
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as e:
                raise WireError(f"the peer went away: {e}") from None

    def recv(self) -> tuple[str, dict]:
        try:
            return decode(self._conn.recv_bytes(MAX_MESSAGE_BYTES))
        except (EOFError, OSError) as e:
            raise WireError(f"the peer went away: {type(e).__name__}: {e}") from None

    def local_host(self) -> str:
        """This end's address on the connection: one the peer reaches."""
        with socket.socket(fileno=os.dup(self._conn.fileno())) as s:
            return s.getsockname()[0]

    def poll(self, timeout: float) -> bool:
        return self._conn.poll(timeout)

    def close(self) -> None:
        self._conn.close()


def listen(address: tuple[str, int]) -> connection.Listener:
    return connection.Listener(address, authkey=authkey())


def accept(listener: connection.Listener) -> Link:
    return Link(listener.accept())


def connect(address: tuple[str, int]) -> Link:
    return Link(connection.Client(address, authkey=authkey()))


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
