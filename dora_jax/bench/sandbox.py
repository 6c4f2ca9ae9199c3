"""Sandbox escape benchmark: hostile code against envs/sandbox.py, from outside.

    python -m dora_jax.bench.sandbox [--cases=SUBSTRING] [--calls=50]

Runs the cases of bench/sandbox_corpus.py at their isolation levels, on this host and
on weaker ones simulated with `_missing`, a few through `PythonArithmetic.step` (the
path the model reaches). This process holds the tripwires (AF_UNIX, abstract and TCP
listeners, a FIFO, SIGWINCH/SIGURG handlers, a watched host file): any contact creates
the case's sentinel, and nothing received is acted on. It prints one line per case,
the cost of a call (`print(6*7)`, `--calls` times, direct and through the
environment), what is left behind (a live process, marked files, new entries in /tmp,
/dev/shm, /var/tmp, new mounts), and last

    attempts: N, escaped: E, refused at start: R, left behind: L,
    cost per call ms: median M (p10 A, p90 B)

(on one line). Exit status 1 if anything escaped or was left behind.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import statistics
import threading
import time

from absl import app, flags

from dora_jax.bench import sandbox_corpus as corpus
from dora_jax.bench import sandbox_verdicts as verdicts
from dora_jax.bench.sandbox_host import (
    SANDBOX_UID,
    Host,
    mounts,
    processes,
    stray_processes,
    tmp_entries,
)

_CASES = flags.DEFINE_string("cases", "", "run only cases whose name holds this")
_CALLS = flags.DEFINE_integer("calls", 50, "calls measured for the cost per call")

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
    before = set(processes())
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
        targets: dict[str, tuple[socket.AddressFamily, str | tuple[str, int]]] = {
            "unix": (socket.AF_UNIX, host.unix),
            "abstract": (socket.AF_UNIX, "\0" + host.abstract),
            "tcp": (socket.AF_INET, ("127.0.0.1", host.port))}
        family, address = targets[case.trigger]
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
    tmp_before, mounts_before = tmp_entries(), mounts()
    probes: dict = {}
    rows: list[dict] = []
    with Host() as host:
        for case in chosen:
            rows.append(run_case(case, host, probes))
        stray = os.path.join(host.dir, "stray")
        left = ([f"tripped outside a case: {open(stray).read().strip()}"]
                if os.path.exists(stray) else [])
    for path, uid in tmp_entries().items():
        if path not in tmp_before and (uid == SANDBOX_UID or "sandbox-root" in path):
            left.append(f"new entry {path}")
    left += [f"new mount {m}" for m in sorted(mounts() - mounts_before)]
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
