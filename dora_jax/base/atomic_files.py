"""Workdir files that a crash or a full disk cannot leave half-written.

A file rewritten in place (open "w", then write) is empty or cut short if the process
dies or the disk fills in between, and the next run trips over it. `write_atomic`
writes a temporary file beside the target, flushes and fsyncs it, then renames it
over the target (`os.replace`, atomic on POSIX): a reader sees the old content or the
new, never a part. `read_json_object` reads such a file back with one line naming it
when it is damaged anyway (an older version's in-place write).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid

from dora_jax.base import untrusted_files


class DamagedFile(ValueError):
    """A workdir file that cannot be read as what it should hold; the message is one
    line starting with the file's path."""


def write_atomic(path: str, text: str) -> None:
    """Replaces `path`'s content by `text` all at once (see the module docstring).
    On failure (e.g. the disk is full) `path` is left as it was and the temporary
    file is removed."""
    directory = os.path.dirname(os.path.abspath(path))
    # Same directory: os.replace is only atomic within one filesystem. Opened with
    # "x" (not mkstemp) so that the file gets the umask's permissions, as `open` would.
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_directory(directory)


def write_json_atomic(path: str, value, **dump_kwargs) -> None:
    """`write_atomic` of `value` as JSON (`json.dumps` keyword arguments apply)."""
    write_atomic(path, json.dumps(value, **dump_kwargs))


def read_json_object(path: str) -> dict:
    """The JSON object in `path`; DamagedFile (one line naming the file) if it is
    empty, not JSON, or not an object. FileNotFoundError if it is missing."""
    # A workdir may be handed over too: a regular file, capped, nesting bounded.
    data = untrusted_files.read_bytes(path, untrusted_files.CONFIG_JSON_CAP, error=DamagedFile)
    untrusted_files.check_depth(data, path, error=DamagedFile)
    if not data.strip():
        raise DamagedFile(f"{path}: empty")
    try:
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise DamagedFile(f"{path}: not JSON ({reason})") from None
    if not isinstance(value, dict):
        raise DamagedFile(f"{path}: not a JSON object (a {type(value).__name__})")
    return value


def _fsync_directory(directory: str) -> None:
    """Makes the rename itself durable; some filesystems cannot fsync a directory,
    and the rename has happened either way."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
