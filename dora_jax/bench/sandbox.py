"""Sandbox escape benchmark: hostile code against envs/sandbox.py, from outside.

    python -m dora_jax.bench.sandbox [--cases=SUBSTRING] [--calls=50]

Runs every case of bench/sandbox_corpus.py (or those whose name holds SUBSTRING) at
its isolation level, on this host and on weaker hosts simulated with `_missing`, a
few through `PythonArithmetic.step` (the path the model reaches). The bench's own
process holds the tripwires: AF_UNIX listeners under /tmp and in the abstract
namespace, a TCP listener on 127.0.0.1, a FIFO, handlers for SIGWINCH and SIGURG and a
host file whose mode and times it watches; each creates the running case's sentinel
on any contact and never acts on what it receives. One line per case (name, class,
isolation, missing, outcome, escaped, seconds), then the cost of a call (`print(6*7)`,
`--calls` times, direct and through the environment), then what is left behind: a
process of a call still alive, a marked file, new entries in /tmp, /dev/shm, /var/tmp
owned by the sandbox's uid or named like its files, new mounts in this process's
mountinfo. The last line is

    attempts: N, escaped: E, refused at start: R, left behind: L,
    cost per call ms: median M (p10 A, p90 B)

(on one line). Exit status 1 if anything escaped or was left behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import statistics
import tempfile
import threading
import time
import uuid

from absl import app, flags

from dora_jax.bench import sandbox_corpus as corpus
from dora_jax.bench import sandbox_verdicts as verdicts

_CASES = flags.DEFINE_string("cases", "", "run only cases whose name holds this")
_CALLS = flags.DEFINE_integer("calls", 50, "calls measured for the cost per call")

REPO = pathlib.Path(__file__).resolve().parents[2]
_SANDBOX_UID = 65534
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


def _processes() -> dict[int, tuple[int, int, bytes]]:
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
    procs, stray = _processes(), []
    for pid, (uid, ppid, text) in procs.items():
        if pid == os.getpid():
            continue
        if marker.encode() in text:
            stray.append(f"pid {pid} (marked)")
        elif pid not in before and (uid == _SANDBOX_UID or b"_sandbox_child" in text) and (
                ppid in (0, 1) or ppid not in procs):
            stray.append(f"pid {pid} uid {uid} (orphan)")
    return stray


def _tmp_entries() -> dict[str, int]:
    out = {}
    for where in _SCANNED:
        with contextlib.suppress(OSError):
            for name in os.listdir(where):
                with contextlib.suppress(OSError):
                    out[os.path.join(where, name)] = os.lstat(os.path.join(where, name)).st_uid
    return out


def _mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {" ".join(line.split()[3:5]) for line in f}


def _spans(results) -> int:
    """The most calls whose code ran at the same moment (from the stamps they printed)."""
    events = []
    for r in results:
        for line in r.stdout.splitlines():
            if line.startswith("span "):
                t0, t1 = (float(x) for x in line.split()[1:3])
                events += [(t0, 1), (t1, -1)]
    now = most = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        most = max(most, now)
    return most


def _call(case: corpus.Case, code: str, limits):
    from dora_jax.envs import arithmetic, sandbox

    if not case.via_env:
        return sandbox.run_python(code, limits, isolation=case.isolation, _missing=case.missing)
    env = arithmetic.PythonArithmetic()
    env.reset({"expression": "6*7", "answer": "42"})
    start = time.monotonic()
    text = env.step(f"<python>{code}</python>").observation
    last = text.rsplit("\n", 1)[-1]  # the environment appends the error as a last line
    error = last[len("error: "):] if last.startswith("error: ") else None
    return sandbox.SandboxResult(ok=error is None, stdout=text, error=error,
                                 seconds=time.monotonic() - start,
                                 isolation=(None if (error or "").startswith("refused")
                                            else "namespaces"))


def run_case(case: corpus.Case, host: Host, probes: dict) -> dict:
    """Runs `case` once and decides whether it escaped; a row of the report."""
    from dora_jax.bench.adversarial import StallMeter
    from dora_jax.envs import sandbox

    limits = dataclasses.replace(sandbox.SandboxLimits(), **dict(case.limits))
    key = (case.isolation, case.missing)
    if key not in probes:
        probes[key] = sandbox.run_python("pass", isolation=case.isolation, _missing=case.missing)
    probe = probes[key]
    fill = host.begin()
    code = case.code
    for name, value in fill.items():
        code = code.replace("{" + name + "}", value)
    before = set(_processes())
    start = time.monotonic()
    with StallMeter() as meter:
        if case.parallel == 1:
            results = [_call(case, code, limits)]
        else:
            results = [None] * case.parallel
            threads = [threading.Thread(
                target=lambda i=i: results.__setitem__(i, _call(case, code, limits)))
                for i in range(case.parallel)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    elapsed = (time.monotonic() - start) / (1 if case.parallel == 1 else 1e9)
    result = results[0]
    if case.via_env and result.isolation:  # the environment shows only the output
        result = dataclasses.replace(result, protections=probe.protections)
    tripped = host.end(fill, case.linger)
    left = stray_processes(before, fill["mark"])
    obs = verdicts.Observation(result, tripped, probe, limits, elapsed, meter.worst,
                             {"overlap": _spans(results)})
    why = case.check(obs)
    refused = (result.error or "").startswith("refused") and result.isolation is None
    return {"name": case.name, "kind": case.kind, "isolation": case.isolation,
            "missing": "+".join(case.missing) or "-", "expect": case.expect,
            "outcome": corpus.REFUSED if refused else corpus.RAN, "escaped": why,
            "left": left, "seconds": time.monotonic() - start, "error": result.error}


def control(case: corpus.Case, host: Host) -> bool:
    """Fires `case`'s tripwire from the bench itself; True if its check then calls it
    an escape (a check that cannot fail would say False)."""
    from dora_jax.envs import sandbox

    fill = host.begin()
    if case.trigger == "write":
        open(fill["sentinel"], "w").close()
    elif case.trigger in ("unix", "abstract", "tcp"):
        family, address = {"unix": (socket.AF_UNIX, host.unix),
                           "abstract": (socket.AF_UNIX, "\0" + host.abstract),
                           "tcp": (socket.AF_INET, ("127.0.0.1", host.port))}[case.trigger]
        with socket.socket(family) as s:
            s.connect(address)
            try:  # the listener may trip on the connection and close before the data
                s.sendall(b"cos\nsystem\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
    elif case.trigger == "fifo":
        fd = os.open(host.fifo, os.O_RDONLY | os.O_NONBLOCK)
        time.sleep(0.1)
        os.close(fd)
    elif case.trigger == "signal":
        os.kill(os.getpid(), signal.SIGWINCH)
    elif case.trigger == "mode":
        os.chmod(host.target, 0o777)
    deadline = time.monotonic() + 2.0  # the listener threads and the handler get to run
    while not os.path.exists(fill["sentinel"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    tripped = host.end(fill, 0.0)
    limits = sandbox.SandboxLimits()
    quiet = sandbox.SandboxResult(ok=True, stdout="", error=None, seconds=0.1)
    return bool(tripped) and case.check(
        verdicts.Observation(quiet, tripped, quiet, limits, 0.1)) is not None


def run_corpus(substring: str = "", cases: list | None = None) -> tuple[list[dict], list[str]]:
    """Every case (whose name holds `substring`); the rows, and what the whole run
    left on the host (new mounts here, new sandbox-owned or sandbox-named entries in
    /tmp, /dev/shm, /var/tmp, tripwires fired between cases)."""
    chosen = [c for c in (cases if cases is not None else corpus.cases()) if substring in c.name]
    tmp_before, mounts_before = _tmp_entries(), _mounts()
    probes, rows = {}, []
    with Host() as host:
        for case in chosen:
            rows.append(run_case(case, host, probes))
        stray = os.path.join(host.dir, "stray")
        left = ([f"tripped outside a case: {open(stray).read().strip()}"]
                if os.path.exists(stray) else [])
    for path, uid in _tmp_entries().items():
        if path not in tmp_before and (uid == _SANDBOX_UID or "sandbox-root" in path):
            left.append(f"new entry {path}")
    left += [f"new mount {m}" for m in sorted(_mounts() - mounts_before)]
    return rows, left


def cost_per_call(calls: int) -> dict[str, list[float]]:
    """Milliseconds per call of `print(6*7)`, direct and through the environment."""
    from dora_jax.envs import arithmetic, sandbox

    direct, env_ms = [], []
    env = arithmetic.PythonArithmetic()
    for _ in range(calls):
        start = time.perf_counter()
        assert sandbox.run_python("print(6*7)").stdout == "42\n"
        direct.append((time.perf_counter() - start) * 1e3)
        env.reset({"expression": "6*7", "answer": "42"})
        start = time.perf_counter()
        assert env.step("<python>print(6*7)</python>").observation == "42"
        env_ms.append((time.perf_counter() - start) * 1e3)
    return {"direct": direct, "env": env_ms}


def _quantiles(ms: list[float]) -> tuple[float, float, float]:
    if len(ms) < 2:
        return (ms[0],) * 3 if ms else (0.0,) * 3
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return statistics.median(ms), q[0], q[-1]


def summary_line(rows: list[dict], left: list[str], ms: list[float]) -> str:
    median, p10, p90 = _quantiles(ms)
    return (f"attempts: {len(rows)}, escaped: {sum(bool(r['escaped']) for r in rows)}, "
            f"refused at start: {sum(r['outcome'] == corpus.REFUSED for r in rows)}, "
            f"left behind: {sum(bool(r['left']) for r in rows) + len(left)}, "
            f"cost per call ms: median {median:.1f} (p10 {p10:.1f}, p90 {p90:.1f})")


def main(argv):
    del argv
    rows, left = run_corpus(_CASES.value)
    print(f"{'case':48s} {'class':13s} {'isolation':10s} {'missing':26s} {'outcome':16s} "
          f"{'escaped':7s} {'s':>5s}")
    for r in rows:
        print(f"{r['name']:48s} {r['kind']:13s} {r['isolation']:10s} {r['missing']:26s} "
              f"{r['outcome']:16s} {'yes' if r['escaped'] else 'no':7s} {r['seconds']:5.2f}")
    for r in rows:
        if r["escaped"] or r["left"] or r["outcome"] != r["expect"]:
            print(f"  {r['name']}: escaped={r['escaped']} left={r['left']} "
                  f"outcome={r['outcome']} (expected {r['expect']}) error={r['error']}")
    for what in left:
        print(f"  left behind: {what}")
    cost = cost_per_call(_CALLS.value)
    for path, ms in cost.items():
        median, p10, p90 = _quantiles(ms)
        print(f"cost per call ({path}, {len(ms)} calls) ms: median {median:.1f} "
              f"(p10 {p10:.1f}, p90 {p90:.1f})")
    print(summary_line(rows, left, cost["direct"]))
    bad = any(r["escaped"] or r["left"] for r in rows) or left
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    app.run(main)
