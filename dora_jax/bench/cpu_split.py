"""Where a run's CPU time goes, by part: the CPU seconds each thread of this process
(and each child process) used between two snapshots, from Linux's /proc.

On a CPU host the decode slices and the trainer are devices that share the cores, so
a run is as fast as its total CPU work allows; this split shows which part pays for
it. Parts: `xla` (XLA's compute threads, which run every device's programs),
`slices` (the slice workers' own threads: dispatch, host reads, bookkeeping),
`coordinator` (the main thread), `trainer` (batches, dispatch, the publish copy),
`writers` (metrics), `rewards` (the reward pool's processes and its threads), `other`.
XLA's CPU client may run a small program on the thread that dispatches it, so
`slices` and `trainer` can hold part of their devices' compute.
"""

from __future__ import annotations

import os
import threading

PARTS = ("xla", "slices", "coordinator", "trainer", "writers", "rewards", "other")


def _ticks(stat_path: str) -> int | None:
    try:
        with open(stat_path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread or process ended
        return None
    return int(fields[11]) + int(fields[12])  # utime + stime


def _comm(task: str) -> str:
    try:
        with open(os.path.join(task, "comm")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def part_of(thread_name: str | None, comm: str) -> str:
    """The part a thread belongs to: by its Python name, else by its OS name."""
    if thread_name is None:
        return "xla" if comm.startswith("tf_XLA") else "other"
    if thread_name.startswith("slice "):
        return "slices"
    if thread_name == "MainThread":
        return "coordinator"
    if thread_name == "trainer":
        return "trainer"
    if thread_name == "metrics writer":
        return "writers"
    if thread_name.endswith("_loop)"):  # the pebble pool's task, pool and message loops
        return "rewards"
    return "other"


def snapshot() -> dict | None:
    """{(kind, id): (part, CPU seconds so far)} of each live thread and child process
    (None where /proc is not there)."""
    if not os.path.isdir("/proc/self/task"):
        return None
    names = {t.native_id: t.name for t in threading.enumerate()}
    hz = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[str, str | int], tuple[str, float]] = {}
    for tid in os.listdir("/proc/self/task"):
        task = f"/proc/self/task/{tid}"
        ticks = _ticks(f"{task}/stat")
        if ticks is not None:
            out[("thread", tid)] = (part_of(names.get(int(tid)), _comm(task)), ticks / hz)
    for child in _children(os.getpid()):
        ticks = _ticks(f"/proc/{child}/stat")
        if ticks is not None:
            out[("process", child)] = ("rewards", ticks / hz)
    return out


def per_step(start: dict | None, end: dict | None, steps: int) -> dict[str, float] | None:
    """CPU milliseconds per step by part between two snapshots, and `total`. What a
    thread or process used before it ended between them is not counted; one started
    between them counts from its start."""
    if start is None or end is None or steps <= 0:
        return None
    out = dict.fromkeys(PARTS, 0.0)
    for key, (part, seconds) in end.items():
        out[part] += 1000 * (seconds - start.get(key, (part, 0.0))[1]) / steps
    out["total"] = sum(out.values())
    return out
