"""Reading files that someone else handed over, so that none can hang or exhaust a run.

A checkpoint or tokenizer directory, a prompt file or a resumed workdir comes from
someone else, and a file in it need not be what its name says: a FIFO blocks `open`
forever, a symlink to /dev/zero reads until memory runs out, a symlink may point out
of the directory it was handed in, and `[[[[...]]]]` 100k deep or an integer of
100k digits makes `json.loads` raise a RecursionError or a bare ValueError. So every
handed-over read goes through here: opened non-blocking and checked regular (and
inside its directory, or a hub snapshot's blobs/), read up to a cap whatever its size
claims, JSON depth- and digit-checked. A failure raises the caller's `error` (a
ValueError, so its own entry point reports it), one line starting with the path.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator

import numpy as np

# Caps far above any real file and far below what would hurt a host.
# The largest real vocabularies are ~20 MiB.
TOKENIZER_JSON_CAP = 64 * 2 ** 20
# Any other config / metadata JSON: config.json and tokenizer_config.json are KBs,
# a chat template some 10 KB.
CONFIG_JSON_CAP = 8 * 2 ** 20
# Shard indexes: ~100k tensor names.
INDEX_JSON_CAP = 64 * 2 ** 20
# Per line of a streamed prompt file.
LINE_CAP = 16 * 2 ** 20
# A checkpoint's coordinator state: the finished groups it holds, tokens included.
STATE_JSON_CAP = 2 ** 30
# A workdir's ledger: some hundred bytes per event, millions of events in a long run.
LEDGER_CAP = 16 * 2 ** 30
# Real files nest a handful of levels (a tokenizer's normalizer sequences ~6, a
# prompt's tool arguments ~10); Python's parser overflows its stack near 1000.
MAX_JSON_DEPTH = 128
# Token ids and sizes are far below 2**64 (20 digits); an id of thousands of digits
# is corrupt or hostile and would trip Python's int-from-string limit or overflow
# numpy later, far from its file and line.
MAX_INT_DIGITS = 64


class UntrustedFileError(ValueError):
    """A handed-over file that is not a regular file, too large, or not parseable;
    one line naming it."""


def _roots(directory: str) -> list[str]:
    """Where the files of `directory` may really live: the directory itself, and for
    a Hugging Face hub cache snapshot (<repo>/snapshots/<rev>, whose files are
    symlinks into <repo>/blobs) that blobs folder."""
    real = os.path.realpath(directory)
    roots = [real]
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots


def outside(path: str, directory: str) -> str | None:
    """The real location of `path` if it is outside `directory` (see `_roots`),
    else None."""
    real = os.path.realpath(path)
    if any(os.path.commonpath([real, root]) == root for root in _roots(directory)):
        return None
    return real


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, *, within: str | None = None,
                 error: type[ValueError] = UntrustedFileError) -> int:
    """A read-only descriptor of `path`, checked to be a regular file (and, with
    `within`, to lie inside that directory). FileNotFoundError passes through, for
    callers whose file is optional."""
    if within is not None:
        real = outside(path, within)
        if real is not None:
            raise error(f"{path}: a link to {real}, outside {within}")
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{path}: {_kind(mode)}, not a regular file")
    return fd


def _read_fd(fd: int, path: str, cap: int, error) -> bytes:
    # The first read asks for the whole file (one buffer, no copy in the join); the
    # size is only a hint, the cap is what bounds the loop.
    want = min(os.fstat(fd).st_size + 1, cap + 1)
    chunks, size = [], 0
    while size <= cap:
        chunk = os.read(fd, max(min(cap + 1 - size, want), 1))
        want = 2 ** 24
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > cap:
        raise error(f"{path}: larger than the {cap}-byte limit for this file")
    return b"".join(chunks)


def read_bytes(path: str, cap: int, *, within: str | None = None,
               error: type[ValueError] = UntrustedFileError) -> bytes:
    """The bytes of the regular file `path`, refused past `cap` bytes (at most
    `cap + 1` are read)."""
    fd = open_regular(path, within=within, error=error)
    try:
        return _read_fd(fd, path, cap, error)
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)


def decode(data: bytes, where: str, error: type[ValueError] = UntrustedFileError) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not valid UTF-8 (byte {e.start})") from None


def read_text(path: str, cap: int, *, within: str | None = None,
              error: type[ValueError] = UntrustedFileError) -> str:
    """`read_bytes` decoded as UTF-8."""
    return decode(read_bytes(path, cap, within=within, error=error), path, error)


# A JSON string, escapes included. Possessive, and ending at the end of the data
# when unterminated, so that no input makes the scan backtrack (linear time).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def check_depth(data: bytes, where: str, limit: int = MAX_JSON_DEPTH,
                error: type[ValueError] = UntrustedFileError) -> None:
    """Refuses JSON text nesting deeper than `limit`, brackets inside strings not
    counted; in C-speed steps (a 64 MiB file takes well under a second)."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return  # the common case, e.g. a prompt line: cannot nest past the limit
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth, at = 0, 0
    while at < len(brackets):  # in blocks, so the running depth stays small in memory
        steps = _STEP[np.frombuffer(brackets, np.uint8, min(2 ** 22, len(brackets) - at), at)]
        running = depth + np.cumsum(steps, dtype=np.int64)
        if running.max() > limit:
            raise error(f"{where}: JSON nests deeper than {limit} levels")
        depth, at = int(running[-1]), at + len(steps)


class _HugeInt(Exception):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _HugeInt(len(text.lstrip("-")))
    return int(text)


def loads(data: bytes | str, where: str, error: type[ValueError] = UntrustedFileError):
    """The JSON value of `data` (already capped), one `error` line naming `where`
    when it is not UTF-8, not JSON, nests too deeply or holds a huge integer."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    check_depth(raw, where, error=error)
    text = decode(raw, where, error) if isinstance(data, bytes) else data
    try:
        return json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        # A JSONL line is one line: its `where` already says which.
        at = f", line {e.lineno}" if "\n" in text.strip() else ""
        raise error(f"{where}: not valid JSON ({e.msg}{at})") from None
    except _HugeInt as e:
        raise error(f"{where}: an integer of {e.args[0]} digits (more than "
                    f"{MAX_INT_DIGITS})") from None
    except RecursionError:  # not reached after check_depth; kept as a last guard
        raise error(f"{where}: JSON nests too deeply") from None


def read_json(path: str, cap: int = CONFIG_JSON_CAP, *, within: str | None = None,
              error: type[ValueError] = UntrustedFileError) -> dict:
    """The JSON object in the regular file `path` (see `read_bytes`, `loads`)."""
    value = loads(read_bytes(path, cap, within=within, error=error), path, error)
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def lines(path: str, *, line_cap: int = LINE_CAP, within: str | None = None,
          error: type[ValueError] = UntrustedFileError) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of the regular file `path`, streamed; a line longer
    than `line_cap` bytes is refused naming `path:line` (only `line_cap + 1` bytes
    of it are read)."""
    fd = open_regular(path, within=within, error=error)
    with os.fdopen(fd, "rb") as f:
        lineno = 0
        while True:
            lineno += 1
            try:
                raw = f.readline(line_cap + 1)
            except OSError as e:
                raise error(f"{path}:{lineno}: cannot read ({e.strerror})") from None
            if not raw:
                return
            if len(raw) > line_cap and not raw.endswith(b"\n"):
                raise error(f"{path}:{lineno}: longer than the {line_cap}-byte line limit")
            yield lineno, raw
