"""The sandbox bench's side of the host: its tripwires and what a call left behind.

`Host` holds AF_UNIX (path and abstract), TCP and FIFO endpoints, SIGWINCH/SIGURG
handlers and a watched file; any contact creates the running case's sentinel and
nothing received is acted on. The scanners list processes, entries under /tmp,
/dev/shm and /var/tmp, and mounts, to compare before and after a call.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import tempfile
import threading
import time
import uuid

REPO = pathlib.Path(__file__).resolve().parents[2]
SANDBOX_UID = 65534
_SCANNED = ("/tmp", "/dev/shm", "/var/tmp")
_SIGNALS = (signal.SIGWINCH, signal.SIGURG)  # ignored by default: harmless if they leak


class Host:
    """The bench's tripwires. Whatever reaches one creates the current sentinel."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="dora_bench_sandbox_")
        os.chmod(self.dir, 0o755)  # readable by the sandbox's uid: only layers stop it
        self.marker = "dbsx" + uuid.uuid4().hex[:12]
        self.abstract = self.marker + "-abstract"
        self.unix = os.path.join(self.dir, "ipc.sock")
        self.fifo = os.path.join(self.dir, "pipe")
        self.target = os.path.join(self.dir, "target")
        self._lock, self._current, self._stop = threading.Lock(), None, threading.Event()
        self._listeners, self._threads, self._old = [], [], {}
        self._index = 0

    def __enter__(self):
        for family, address in ((socket.AF_UNIX, self.unix), (socket.AF_UNIX, "\0" + self.abstract),
                                (socket.AF_INET, ("127.0.0.1", 0))):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.bind(address)
            s.listen(16)
            s.settimeout(0.1)
            self._listeners.append(s)
            self._spawn(self._accept, s, str(address))
        self.port = self._listeners[-1].getsockname()[1]
        os.chmod(self.unix, 0o777)
        os.mkfifo(self.fifo, 0o666)
        self._spawn(self._watch_fifo)
        with open(self.target, "w") as f:
            f.write("target\n")
        self._reset_target()
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._old[sig] = signal.signal(sig, lambda n, _: self.trip(f"signal {n}"))
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join()
        for s in self._listeners:
            s.close()
        for sig, old in self._old.items():
            signal.signal(sig, old)
        for root, dirs, files in os.walk(self.dir, topdown=False):
            for name in files:
                os.unlink(os.path.join(root, name))
            for name in dirs:
                os.rmdir(os.path.join(root, name))
        os.rmdir(self.dir)

    def _spawn(self, target, *args):
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self, listener, name):
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            self.trip(f"connection to {name}")  # never unpickled: contact is enough
            conn.close()

    def _watch_fifo(self):
        while not self._stop.wait(0.01):
            try:  # succeeds only while a reader has the FIFO open
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))
                self.trip("reader on the host FIFO")
            except OSError:
                pass

    def _reset_target(self):
        os.chmod(self.target, 0o600)
        os.utime(self.target, (1_000_000_000, 1_000_000_000))
        self._target_stat = os.stat(self.target)

    def trip(self, why: str):
        with self._lock:
            path = self._current or os.path.join(self.dir, "stray")
            with open(path, "a") as f:
                f.write(why + "\n")

    def begin(self) -> dict:
        self._index += 1
        sentinel = os.path.join(self.dir, f"case-{self._index}")
        with self._lock:
            self._current = sentinel
        return {"sentinel": sentinel, "mark": f"{self.marker}-{self._index}",
                "pid": str(os.getpid()), "pgid": str(os.getpgrp()), "unix": self.unix,
                "abstract": self.abstract, "port": str(self.port), "fifo": self.fifo,
                "target": self.target, "repo": str(REPO), "home": os.path.expanduser("~")}

    def end(self, fill: dict, linger: float) -> list[str]:
        """What the case tripped, after `linger` seconds for anything it left running."""
        time.sleep(linger)
        st = os.stat(self.target)
        if (st.st_mode, st.st_mtime_ns, st.st_uid) != (self._target_stat.st_mode,
                                                       self._target_stat.st_mtime_ns,
                                                       self._target_stat.st_uid):
            self.trip(f"host file changed: mode {st.st_mode:o}, mtime {st.st_mtime}")
            os.chown(self.target, 0, 0) if os.geteuid() == 0 else None
            self._reset_target()
        for where in _SCANNED + (str(REPO), fill["home"], "/"):
            with contextlib.suppress(OSError):
                for name in os.listdir(where):
                    if fill["mark"] in name:
                        self.trip(f"file {where}/{name}")
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(where, name))
        with self._lock:
            self._current = None
        try:
            with open(fill["sentinel"]) as f:
                return [line for line in f.read().splitlines() if line] or ["sentinel"]
        except FileNotFoundError:
            return []


def processes() -> dict[int, tuple[int, int, bytes]]:
    """pid: (uid, ppid, cmdline + environ) of every process visible here."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            text = b""
            for part in ("cmdline", "environ"):
                with contextlib.suppress(OSError), open(f"/proc/{entry}/{part}", "rb") as f:
                    text += f.read()
            found[int(entry)] = (int(fields["Uid"].split()[0]), int(fields["PPid"]), text)
        except (OSError, KeyError, ValueError):
            continue
    return found


def stray_processes(before: set, marker: str) -> list[str]:
    """Processes of a call that outlived it: marked ones, and new ones that look like
    a sandbox's (its uid or its bootstrap) whose parent is gone (orphans). Other
    users' live sandboxes keep a parent, so they are not counted."""
    procs, stray = processes(), []
    for pid, (uid, ppid, text) in procs.items():
        if pid == os.getpid():
            continue
        if marker.encode() in text:
            stray.append(f"pid {pid} (marked)")
        elif pid not in before and (uid == SANDBOX_UID or b"_sandbox_child" in text) and (
                ppid in (0, 1) or ppid not in procs):
            stray.append(f"pid {pid} uid {uid} (orphan)")
    return stray


def tmp_entries() -> dict[str, int]:
    out = {}
    for where in _SCANNED:
        with contextlib.suppress(OSError):
            for name in os.listdir(where):
                with contextlib.suppress(OSError):
                    out[os.path.join(where, name)] = os.lstat(os.path.join(where, name)).st_uid
    return out


def mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {" ".join(line.split()[3:5]) for line in f}
