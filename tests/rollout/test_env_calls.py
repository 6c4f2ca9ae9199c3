"""Environment calls of multi-turn episodes (rollout/episodes.py): many at once on one
event loop, bounded by `workers`; plain steps on threads; a deterministic latency;
timeouts counted from a call's start."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

from dora_jax.envs import base
from dora_jax.rollout.episodes import EnvCall, EpisodeRunner, Latency


class Words:
    special_tokens = ()

    def encode(self, text):
        return [int(x) for x in text.split()]

    def decode(self, ids, *, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


class Counting:
    """Counts the calls inside `step` at once and holds them until released."""

    def __init__(self):
        self.lock, self.now, self.most = threading.Lock(), 0, 0
        self.release = threading.Event()

    def enter(self):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self):
        with self.lock:
            self.now -= 1


COUNT = Counting()


@base.register("test_held_async")
class HeldAsync(base.Environment):
    def reset(self, record):
        return "go"

    async def step(self, action):
        COUNT.enter()
        try:
            while not COUNT.release.is_set():
                await asyncio.sleep(0.005)
        finally:
            COUNT.leave()
        return base.StepResult(action, 1.0, False)


@base.register("test_held_sync")
class HeldSync(HeldAsync):
    def step(self, action):
        COUNT.enter()
        try:
            COUNT.release.wait(30)
        finally:
            COUNT.leave()
        return base.StepResult(action, 1.0, False)


@pytest.mark.parametrize("env,calls,workers", [("test_held_async", 300, 200),
                                               ("test_held_sync", 40, 16)])
def test_calls_run_at_once_up_to_the_workers_bound(env, calls, workers):
    global COUNT
    COUNT = Counting()
    runner = EpisodeRunner(env, Words(), workers=workers, frame=([], []))
    try:
        episodes = [runner.begin({}, seed=i) for i in range(calls)]
        pending = [runner.step(e, [i]) for i, e in enumerate(episodes)]
        deadline = time.monotonic() + 30
        while COUNT.now < workers and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # had the bound leaked, more would have entered by now
        assert COUNT.most == workers
        started = sum(c.started is not None for c in pending)
        assert started == workers  # the others queue (back-pressure), not started
        COUNT.release.set()
        results = [c.future.result(timeout=30) for c in pending]
    finally:
        COUNT.release.set()
        runner.close()
    assert [r[0].observation for r in results] == [str(i) for i in range(calls)]
    assert all(r[2] is None for r in results)


@base.register("test_instant")
class Instant(base.Environment):
    def reset(self, record):
        return "go"

    def step(self, action):
        return base.StepResult("ok", 0.0, False)


def test_latency_is_drawn_per_episode_and_call_and_waited_without_a_thread():
    lat = Latency(median=0.05, sigma=0.5, most=0.2)
    draws = [lat.draw(7, k) for k in range(400)]
    assert draws == [lat.draw(7, k) for k in range(400)]  # a rerun waits as long
    assert draws != [lat.draw(8, k) for k in range(400)]
    assert max(draws) <= 0.2 and np.median(draws) == pytest.approx(0.05, rel=0.15)
    runner = EpisodeRunner("test_instant", Words(), workers=64, frame=([], []), latency=lat)
    try:
        threads = threading.active_count()
        episodes = [runner.begin({}, seed=s) for s in range(64)]
        calls = [runner.step(e, [1]) for e in episodes]
        results = [c.future.result(timeout=30) for c in calls]
        # Plain steps took a thread each for an instant; the waits held none.
        assert threading.active_count() <= threads + 2
    finally:
        runner.close()
    for s, (_, seconds, error) in enumerate(results):
        assert error is None and seconds >= lat.draw(s, 0)


def test_a_call_times_out_from_its_start_not_while_queued():
    call = EnvCall()
    assert not call.timed_out(time.perf_counter() + 1e6, 1.0)  # queued: never
    call.started = time.perf_counter()
    assert not call.timed_out(call.started + 0.5, 1.0)
    assert call.timed_out(call.started + 1.5, 1.0)


@pytest.mark.parametrize("env", ["test_held_async", "test_held_sync"])
def test_closing_a_runner_drops_its_running_calls_cleanly(env, caplog):
    """Calls still at their environments when the runner closes are cancelled: the
    loop ends without a task destroyed pending, and a plain step returning after the
    close finds the loop gone without raising."""
    global COUNT
    COUNT = Counting()
    runner = EpisodeRunner(env, Words(), workers=8, frame=([], []))
    unraised = []
    hook, threading.excepthook = threading.excepthook, unraised.append
    try:
        calls = [runner.step(runner.begin({}, seed=i), [i]) for i in range(4)]
        deadline = time.monotonic() + 30
        while COUNT.now < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        loops = [t for t in threading.enumerate() if t.name == f"env {env}"]
        assert len(loops) == 1
        with caplog.at_level("ERROR", logger="asyncio"):
            runner.close()
            for t in loops:
                t.join(10)
            COUNT.release.set()  # the plain steps' threads return into a closed loop
            deadline = time.monotonic() + 10
            while COUNT.now and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.05)
            gc.collect()  # a task destroyed pending says so when collected
    finally:
        COUNT.release.set()
        threading.excepthook = hook
    assert not any(t.is_alive() for t in loops)
    assert not [r.message for r in caplog.records if "destroyed" in r.message]
    assert not unraised
    assert all(c.future.cancelled() or not c.future.done() for c in calls)
