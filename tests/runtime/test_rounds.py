"""partial_rollout_rounds, the round-synchronous partial rollout: the core's actions
by hand, the fake driver's runs (the slices pause while the trainer trains, unfinished
samples carry over with per-token versions, staleness within K, the ledger audits
clean) and the slice worker's deferred load (fake slices, no JAX)."""

import concurrent.futures
import queue
import time

import pytest
from _fake_run import FakeRun

from dora_jax.base.timeline import Timeline
from dora_jax.runtime.events import Failed, VersionLoaded
from dora_jax.runtime.worker import SliceWorker
from dora_jax.scheduler import (
    Admit,
    Assign,
    InterruptReload,
    LoadVersion,
    Scheduler,
    SchedulerConfig,
    TrainStep,
)

MODE = "partial_rollout_rounds"


def config(mode=MODE, **kw):
    base = dict(mode=mode, num_slices=4, slots_per_slice=4, group_size=4,
                train_batch_size=4, rollout_batch_size=12, max_staleness=2)
    return SchedulerConfig(**{**base, **kw})


def long_tail(g, k):
    # One straggler per group of four: it outlives the round it started in.
    return 120 if (g % 4 == 0 and k == 0) else 6


def test_rounds_by_hand():
    """The round ends with a batch: the busy slice is interrupted for version 1 (in
    training, not published) and nothing is admitted or assigned until the publish;
    then the next round admits at version 1, and the carried-over sample continues
    under version 1 once its slice has loaded it."""
    s = Scheduler(config(num_slices=1, slots_per_slice=2, group_size=1,
                         train_batch_size=1, rollout_batch_size=2, max_staleness=1))
    assert s.decide() == [Admit(0, 0), Admit(1, 0), Assign(0, 0, 0, 0), Assign(1, 0, 0, 0)]
    s.sample_finished(0, 0)
    # Streaming partial_rollout would admit group 2 at version 0 here and keep decoding.
    assert s.decide() == [TrainStep(0, (0,)), InterruptReload(0, 1)]
    s.check_invariants()
    assert s.decide() == []
    with pytest.raises(ValueError, match="not published"):
        s.version_loaded(0, 1)  # a driver that did not wait for the publish
    s.step_finished(0)
    assert s.decide() == [Admit(2, 1)]  # the slice is still loading: no assignment
    s.version_loaded(0, 1)
    assert s.decide() == [Assign(2, 0, 0, 1)]
    assert s.groups[1].samples[0].versions == [0, 1]
    s.check_invariants()


def test_an_empty_slice_loads_the_version_in_training():
    s = Scheduler(config(num_slices=2, slots_per_slice=1, group_size=1,
                         train_batch_size=1, rollout_batch_size=2, max_staleness=1))
    s.decide()
    s.sample_finished(0, 0)  # slice 0 is empty, slice 1 still runs group 1
    assert s.decide() == [TrainStep(0, (0,)), LoadVersion(0, 1), InterruptReload(1, 1)]
    s.check_invariants()


def test_loads_of_unpublished_versions_only_while_training():
    s = Scheduler(config())
    s.decide()
    with pytest.raises(AssertionError):
        s.do_load(0, 1)  # version 1 is neither published nor in training


class TracedRun(FakeRun):
    """A FakeRun that records, for every interval between events, whether the trainer
    was training and how many tokens the slices produced, and every decision."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.intervals, self.decisions = [], []
        decide = self.sched.decide

        def traced():
            busy = self.sched.trainer_busy
            acts = decide()
            self.decisions.append((busy, acts))
            return acts

        self.sched.decide = traced

    def tokens(self):
        return (sum(r.produced for sl in self.slices for r in sl.requests.values())
                + sum(r.produced for r in self.done.values()))

    def advance(self, max_ticks=10**7):
        self.start()
        training, tokens, tick = self.trainer is not None, self.tokens(), self.tick
        super().advance(max_ticks)
        self.intervals.append((training, self.tick - tick, self.tokens() - tokens))


def _run(mode, k=2, steps=12):
    run = TracedRun(config(mode, max_staleness=k), long_tail, load_ticks=2, train_ticks=15)
    run.run(steps)
    return run


def test_slices_do_not_decode_while_the_trainer_trains():
    rounds = _run(MODE)
    training = [(dt, n) for busy, dt, n in rounds.intervals if busy]
    assert sum(dt for dt, _ in training) >= 12 * 15 - 15  # the steps' ticks are there
    assert all(n == 0 for _, n in training), training
    # Nothing is admitted or assigned from a TrainStep until the publish.
    for busy, acts in rounds.decisions:
        kinds = [type(a) for a in acts]
        if TrainStep in kinds:
            kinds = kinds[kinds.index(TrainStep):]
        elif not busy:
            continue
        assert Admit not in kinds and Assign not in kinds, acts
    # Streaming partial_rollout, on the same workload, decodes during training.
    streaming = _run("partial_rollout")
    assert sum(n for busy, _, n in streaming.intervals if busy) > 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rounds_audit_clean_carry_over_and_bound_staleness(k):
    run = _run(MODE, k=k)
    assert run.audit().ok, run.audit().summary()
    consumed = [r for r in run.ledger if r["event"] == "consume"]
    assert len(consumed) == 12 * 4
    assert max(r["step"] - r["version"] for r in consumed) <= k
    carried = []
    for rec in consumed:
        for smp in rec["samples"]:
            vs = [v for v, _ in smp["versions"]]
            assert sum(n for _, n in smp["versions"]) == smp["response_len"]
            # Per-token versions: from the admission version on, rising, never past
            # the version trained by the consuming step.
            assert vs == sorted(set(vs)) and rec["version"] <= vs[0] and vs[-1] <= rec["step"]
            if len(vs) > 1:
                carried.append(smp)
    # The stragglers outlive their round and continue under the next versions.
    assert carried and run.stats["interrupt_reloads"] > 0


def test_the_trainer_idles_more_than_with_streaming_partial_rollout():
    rounds, streaming = _run(MODE).summary(), _run("partial_rollout").summary()
    assert rounds["trainer_wait_ticks"] > streaming["trainer_wait_ticks"]
    assert rounds["ticks"] > streaming["ticks"]


def test_zero_tick_deferred_loads_and_k0():
    """Loads that take no ticks complete at the publish itself; with K = 0 a round is
    a sync step (every group of the batch's version is in the batch)."""
    for k in (0, 2):
        run = FakeRun(config(max_staleness=k), long_tail, load_ticks=0, train_ticks=3)
        run.run(6)
        assert run.audit().ok
        if k == 0:
            assert run.summary()["max_staleness"] == 0


# ---------------------------------------------------------------- the slice worker


class PausableSlice:
    """Enough of DecodeSlice for a worker: holds one request, each step takes 5 ms."""

    def __init__(self):
        self.slice_id, self.version, self.steps = 0, 0, 0
        self.reloads = []

    num_requests = property(lambda self: 1)
    idle = False
    kv_free_tokens = None

    def running_by_version(self):
        return {self.version: 1}

    def step(self):
        time.sleep(0.005)
        self.steps += 1
        return []

    def interrupt_and_reload(self, version, params):
        self.reloads.append((version, params))
        self.version = version


def test_worker_pauses_on_a_deferred_load_until_the_params_arrive():
    events = queue.Queue()
    sl = PausableSlice()
    w = SliceWorker(sl, events, Timeline())
    w.start()
    time.sleep(0.05)
    box = concurrent.futures.Future()
    w.load(1, box, interrupt=True)
    time.sleep(0.1)  # the command is applied by now: the slice waits
    paused_at = sl.steps
    time.sleep(0.2)
    assert sl.steps == paused_at and sl.version == 0 and events.empty()
    box.set_result("params of v1")
    deadline = time.time() + 5
    while sl.steps <= paused_at + 2 and time.time() < deadline:
        time.sleep(0.01)
    w.stop(timeout=5)
    assert sl.reloads == [(1, "params of v1")] and sl.steps > paused_at
    ev = events.get_nowait()
    assert ev == VersionLoaded(sl.slice_id, 1)


def test_a_stopping_worker_does_not_wait_for_a_deferred_load():
    events = queue.Queue()
    sl = PausableSlice()
    w = SliceWorker(sl, events, Timeline())
    w.start()
    w.load(1, concurrent.futures.Future(), interrupt=True)  # never filled
    time.sleep(0.05)
    start = time.time()
    w.stop(timeout=5)
    assert time.time() - start < 2 and not w._thread.is_alive()
    assert sl.reloads == [] and all(not isinstance(e, Failed) for e in list(events.queue))
