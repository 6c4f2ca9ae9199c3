"""bench.cpu_split: a thread's CPU time is charged to its part; the per-step figures
are the differences between two snapshots, worked by hand."""

import os
import threading
import time

import pytest

from dora_jax.bench import cpu_split, peer


def test_parts_follow_thread_names():
    assert cpu_split.part_of("slice 3", "python") == "slices"
    assert cpu_split.part_of("MainThread", "python") == "coordinator"
    assert cpu_split.part_of("trainer", "python") == "trainer"
    assert cpu_split.part_of("metrics writer", "python") == "writers"
    assert cpu_split.part_of("Thread-3 (task_scheduler_loop)", "python") == "rewards"
    assert cpu_split.part_of(None, "tf_XLAEigen") == "xla"
    assert cpu_split.part_of(None, "python") == "other"
    assert cpu_split.part_of("checkpoint saves", "python") == "other"
    assert cpu_split.part_of("QueueFeederThread", "python") == "other"  # not pebble's


def test_per_step_differences_by_hand():
    start = {("thread", "1"): ("xla", 1.0), ("thread", "2"): ("slices", 0.5),
             ("process", 9): ("rewards", 2.0), ("thread", "3"): ("other", 4.0)}
    # Thread 3 ended between the snapshots (not counted); thread 4 and process 10
    # started between them (counted from zero).
    end = {("thread", "1"): ("xla", 3.0), ("thread", "2"): ("slices", 0.9),
           ("process", 9): ("rewards", 2.2), ("process", 10): ("rewards", 0.2),
           ("thread", "4"): ("coordinator", 0.4)}
    got = cpu_split.per_step(start, end, steps=4)
    assert got == pytest.approx({"xla": 500.0, "slices": 100.0, "rewards": 100.0,
                                 "coordinator": 100.0, "trainer": 0.0, "writers": 0.0,
                                 "other": 0.0, "total": 800.0})
    assert cpu_split.per_step(None, end, 4) is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux /proc")
def test_a_busy_slice_thread_is_charged_to_the_slices():
    ready, stop = threading.Event(), threading.Event()

    def spin():
        ready.wait()
        while not stop.is_set():
            pass

    worker = threading.Thread(target=spin, name="slice 7")
    worker.start()
    start = cpu_split.snapshot()
    ready.set()
    deadline = time.monotonic() + 30
    while _cpu_seconds(worker) < 0.3 and time.monotonic() < deadline:
        time.sleep(0.01)
    end = cpu_split.snapshot()
    stop.set()
    worker.join()
    got = cpu_split.per_step(start, end, steps=1)
    assert got["slices"] >= 300  # ms: what /proc said the thread had used
    assert got["slices"] > 2 * got["coordinator"]


def _cpu_seconds(thread) -> float:
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_steady_cpu_hook_snapshots_at_the_warmup_and_last_steps(monkeypatch):
    snaps = iter([{("thread", "1"): ("xla", 1.0)}, {("thread", "1"): ("xla", 1.6)}])
    monkeypatch.setattr(cpu_split, "snapshot", lambda: next(snaps))
    hook = peer.SteadyCPU(warmup=2, steps=5)
    for step in range(5):
        hook({"step": step})
    assert hook.per_step()["xla"] == pytest.approx(300.0)  # 0.6 s over steps 3 and 4
