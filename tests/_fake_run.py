"""`FakeRun`: the tests' deterministic, tick-based driver of the Scheduler with a fake engine.

Each busy slot produces one token per tick; a sample of length L finishes after L
ticks of decoding; LoadVersion / InterruptReload take `load_ticks` (a slice being
reloaded decodes nothing; a load of the version in training waits, without decoding,
until that version is published, then takes its ticks); a train step takes
`train_ticks`; Migrate moves the request with its progress. The driver executes
actions, feeds events back, checks engine-level C1 and writes a ledger of admit /
consume records in the format of `dora_jax.scheduler.ledger` (time = tick, prompt id
= group id); `audit()` checks it with the project's auditor.

Time advances event to event (jumping over ticks in which nothing finishes), which
gives exactly the tick-by-tick result at a fraction of the cost.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dora_jax.base import versions
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.driver import (
    Driver,
    admit_record,
    consume_record,
    filter_record,
    sample_entry,
)
from dora_jax.scheduler.ledger import AuditReport, audit_run, unconsumed_records
from dora_jax.scheduler.types import (
    AddVersion,
    Admit,
    Assign,
    Evict,
    InterruptReload,
    LoadVersion,
    Migrate,
    SchedulerConfig,
    TrainStep,
)


class LivenessError(RuntimeError):
    """The run cannot progress (deadlock) or exceeded its tick budget."""


@dataclass
class _Request:
    group_id: int
    sample: int
    length: int
    produced: int = 0
    segments: list = field(default_factory=list)  # [[version, tokens], ...]
    slices: list = field(default_factory=list)


@dataclass
class _Slice:
    version: int | None = 0
    loading: int | None = None
    load_left: int = 0
    deferred: bool = False  # loading the version in training: waits for its publish
    requests: dict = field(default_factory=dict)  # (gid, k) -> _Request
    # Several versions per slice: versions held besides `version`'s role, and the
    # AddVersion loads in flight (version -> ticks left); decoding goes on meanwhile.
    held: set = field(default_factory=lambda: {0})
    adds: dict = field(default_factory=dict)


def lengths_from_seed(seed: int, kind: str = "long_tail", max_len: int = 64) -> Callable:
    """Sample lengths as a pure function of (seed, group, sample), for tests and demos.

    kinds: "const" (always max_len), "uniform" (1..max_len), "long_tail" (mostly
    short, a few near max_len: Pareto-like)."""
    def length(gid: int, k: int) -> int:
        rng = random.Random(f"{seed}:{gid}:{k}")
        if kind == "const":
            return max_len
        if kind == "uniform":
            return rng.randint(1, max_len)
        if kind == "long_tail":
            return max(1, min(max_len, int(rng.paretovariate(1.2) * max_len / 20)))
        raise ValueError(f"kind must be const, uniform or long_tail, got {kind!r}")
    return length


class FakeRun(Driver):
    """Drive a `Scheduler` with a fake engine and trainer.

    Args:
      config: the scheduler config.
      lengths: sample length in tokens (>= 1), as `f(group_id, sample)` or a nested
        sequence `lengths[group_id][sample]`.
      load_ticks: ticks per LoadVersion / InterruptReload (>= 0).
      train_ticks: ticks per train step (>= 1).
      check: call `Scheduler.check_invariants()` after every event and decide().
      kv_capacity: KV positions per slice, as a paged cache reports them: after each
        finished sample the slice reports capacity minus, per running request,
        `config.admit_tokens` + its tokens so far (`Scheduler.kv_reported`). None:
        no reports.
      keep: with `config.score_groups`, whether a finished group is kept (else it
        is filtered, with a ledger `filter` event), as `keep(group_id)`; scoring is
        instant. Default: keep every group.
    """

    def __init__(self, config: SchedulerConfig,
                 lengths: Callable[[int, int], int] | Sequence,
                 load_ticks: int = 1, train_ticks: int = 1, check: bool = True,
                 kv_capacity: int | None = None,
                 keep: Callable[[int], bool] = lambda gid: True):
        if load_ticks < 0 or train_ticks < 1:
            raise ValueError("load_ticks must be >= 0 and train_ticks >= 1")
        self.config = config
        self.sched = Scheduler(config)
        self._length = lengths if callable(lengths) else (lambda g, k: lengths[g][k])
        self.load_ticks, self.train_ticks, self.check = load_ticks, train_ticks, check
        self.kv_capacity, self.keep = kv_capacity, keep
        self.tick = 0
        self._started = False
        self.slices = [_Slice() for _ in range(config.num_slices)]
        self.group_version: dict[int, int] = {}
        self.done: dict[tuple, _Request] = {}  # finished samples, for provenance
        self.trainer: list | None = None  # [step, ticks left]
        self.steps_done = 0
        self.ledger: list[dict] = []
        self._released: list = []  # events an action completes at once (zero-tick loads)
        self.stats = dict(trainer_wait_ticks=0, busy_slot_ticks=0, migrations=0,
                          loads=0, interrupt_reloads=0, max_resident_versions=0)

    # ------------------------------------------------------------------ running

    def run(self, num_steps: int, max_ticks: int = 10**7) -> dict:
        """Run until `num_steps` train steps have finished; return `summary()`.

        Raises LivenessError on deadlock or when the run passes tick `max_ticks`."""
        self.start()
        while self.steps_done < num_steps:
            self.advance(max_ticks)
        return self.summary()

    def start(self):
        """Take the decisions of tick 0 (idempotent)."""
        if not self._started:
            self._started = True
            self._settle([])

    def advance(self, max_ticks: int = 10**7):
        """Jump to the next tick at which something completes and handle it."""
        self.start()
        active = [r for sl in self.slices if sl.loading is None for r in sl.requests.values()]
        waits = [r.length - r.produced for r in active]
        waits += [sl.load_left for sl in self.slices
                  if sl.loading is not None and not sl.deferred]
        waits += [t for sl in self.slices for t in sl.adds.values()]
        if self.trainer is not None:
            waits.append(self.trainer[1])
        if not waits:
            raise LivenessError(f"deadlock at tick {self.tick}: nothing in progress")
        dt = min(waits)
        if self.tick + dt > max_ticks:
            raise LivenessError(f"tick budget {max_ticks} exceeded")
        self.tick += dt
        if self.trainer is None:
            self.stats["trainer_wait_ticks"] += dt
        self.stats["busy_slot_ticks"] += dt * len(active)
        events = []
        for i, sl in enumerate(self.slices):
            for v in sorted(sl.adds):
                sl.adds[v] -= dt
                if sl.adds[v] == 0:
                    del sl.adds[v]
                    events.append(("added", i, v))
            if sl.loading is not None:
                if sl.deferred:
                    continue
                sl.load_left -= dt
                if sl.load_left == 0:
                    events.append(("loaded", i, sl.loading))
                continue
            done = []
            for key, r in sl.requests.items():
                r.produced += dt
                r.segments[-1][1] += dt
                if r.produced == r.length:
                    done.append(key)
            events += [("finished", i, key) for key in sorted(done)]
        if self.trainer is not None:
            self.trainer[1] -= dt
            if self.trainer[1] == 0:
                events.append(("step", self.trainer[0]))
        self._settle(events)

    def fail_slice(self, i: int):
        """Model a slice failure: it loses its requests and its params
        (`Scheduler.slice_failed`), and the run goes on."""
        sl = self.slices[i]
        sl.requests.clear()
        sl.version, sl.loading, sl.load_left, sl.deferred = None, None, 0, False
        sl.held, sl.adds = set(), {}
        self.sched.slice_failed(i)
        self.stats["slice_failures"] = self.stats.get("slice_failures", 0) + 1
        self._settle([])

    def _settle(self, events: list):
        """Deliver events, then decide and execute until nothing more happens now
        (zero-tick loads complete immediately)."""
        while True:
            for ev in events:  # a publish may release deferred loads: their events follow
                events += self._deliver(ev)
            acts = self.sched.decide()
            if self.check:
                self.sched.check_invariants()
            self._released = []  # zero-tick loads that complete at once
            self.execute(acts)
            events = self._released
            self._observe()
            if not events:
                return

    def _deliver(self, ev) -> list:
        """Feed one event to the scheduler; return the events it causes at once (a
        deferred zero-tick load completing on publish)."""
        kind = ev[0]
        released = []
        if kind == "loaded":
            _, i, v = ev
            sl = self.slices[i]
            sl.version, sl.loading, sl.held = v, None, {v}
            for r in sl.requests.values():  # only after an InterruptReload
                r.segments.append([v, 0])
            self.sched.version_loaded(i, v)
        elif kind == "added":
            _, i, v = ev
            self.slices[i].held.add(v)
            self.slices[i].version = max(self.slices[i].held)
            self.sched.version_loaded(i, v)
        elif kind == "finished":
            _, i, (gid, k) = ev
            r = self.slices[i].requests.pop((gid, k))
            self.done[(gid, k)] = r
            self.sched.sample_finished(gid, k, num_tokens=r.length)
            if self.config.score_groups and self.sched.groups[gid].finished:
                kept = bool(self.keep(gid))
                self.sched.group_scored(gid, kept)
                if not kept:
                    self.ledger.append(filter_record(gid, gid, self.group_version[gid],
                                                     self.tick))
            if self.kv_capacity is not None:
                used = sum(self.config.admit_tokens + q.produced
                           for q in self.slices[i].requests.values())
                self.sched.kv_reported(i, self.kv_capacity - used)
        else:
            self.trainer = None
            self.steps_done += 1
            self.sched.step_finished(ev[1])
            for i, sl in enumerate(self.slices):  # deferred loads of this version start
                if sl.deferred and sl.loading <= self.sched.published:
                    sl.deferred, sl.load_left = False, self.load_ticks
                    if self.load_ticks == 0:
                        released.append(("loaded", i, sl.loading))
        if self.check:
            self.sched.check_invariants()
        return released

    # ------------------------------------------------------------------ actions

    def admit(self, a: Admit):
        self.group_version[a.group_id] = a.version
        self.ledger.append(admit_record(a, a.group_id, self.tick))

    def assign(self, a: Assign):
        sl = self.slices[a.slice_id]
        assert sl.loading is None and len(sl.requests) < self.config.samples_per_slice
        v = a.version if self.sched.multi else sl.version
        assert v in sl.held, f"C1: {a} on a slice holding {sl.held}"
        if self.sched.policy.keeps_c1:  # engine-level C1
            assert v == self.group_version[a.group_id], a
        length = int(self._length(a.group_id, a.sample))
        assert length >= 1, "sample lengths must be >= 1"
        sl.requests[(a.group_id, a.sample)] = _Request(
            a.group_id, a.sample, length, segments=[[v, 0]], slices=[a.slice_id])

    def migrate(self, a: Migrate):
        src, dst = self.slices[a.src_slice], self.slices[a.dst_slice]
        assert src.loading is None and dst.loading is None, a
        if self.sched.multi:
            assert self.group_version[a.group_id] in dst.held, f"C1: {a} to {dst.held}"
        else:
            assert src.version == dst.version, f"C1: migrate across versions {a}"
        assert len(dst.requests) < self.config.samples_per_slice, a
        r = src.requests.pop((a.group_id, a.sample))
        r.slices.append(a.dst_slice)
        dst.requests[(a.group_id, a.sample)] = r
        self.stats["migrations"] += 1

    def load(self, a: LoadVersion | InterruptReload, *, interrupt: bool):
        sl = self.slices[a.slice_id]
        if not interrupt:
            assert not sl.requests, f"C1: params changed under running requests {a}"
            self.stats["loads"] += 1
        else:
            assert not self.sched.policy.keeps_c1, a
            self.stats["interrupt_reloads"] += 1
        sl.loading, sl.load_left = a.version, self.load_ticks
        # The version in training: the load waits for its publish (core.py).
        sl.deferred = a.version > self.sched.published
        if self.load_ticks == 0 and not sl.deferred:
            self._released.append(("loaded", a.slice_id, a.version))

    def add_version(self, a: AddVersion):
        sl = self.slices[a.slice_id]
        assert a.version <= self.sched.published and a.version not in sl.held | set(sl.adds)
        assert len(sl.held) + len(sl.adds) < self.config.versions_per_slice, a
        self.stats["adds"] = self.stats.get("adds", 0) + 1
        if self.load_ticks == 0:
            self._released.append(("added", a.slice_id, a.version))
        else:
            sl.adds[a.version] = self.load_ticks

    def evict(self, a: Evict):
        sl = self.slices[a.slice_id]
        assert all(self.group_version[r.group_id] != a.version for r in sl.requests.values()), \
            f"C1: {a} while requests of it run there"
        sl.held.remove(a.version)
        sl.version = max(sl.held) if sl.held else None
        self.stats["evictions"] = self.stats.get("evictions", 0) + 1

    def train(self, a: TrainStep):
        assert self.trainer is None and len(a.group_ids) == self.config.train_batch_size
        self.trainer = [a.step, self.train_ticks]
        for gid in a.group_ids:
            self._record_consume(gid, a.step)

    def _record_consume(self, gid: int, step: int):
        samples = []
        for k in range(self.config.group_size):
            r = self.done[(gid, k)]  # KeyError = an unfinished sample was trained (C2)
            assert r.produced == r.length, "C2: incomplete trajectory trained"
            samples.append(sample_entry(k, versions.encode(r.segments), list(r.slices),
                                        r.length, "eos"))
        self.ledger.append(consume_record(gid, gid, self.group_version[gid], step, self.tick,
                                          samples))

    def _observe(self):
        vs = {sl.loading if sl.loading is not None else sl.version for sl in self.slices}
        if self.sched.multi:
            vs = {v for sl in self.slices for v in sl.held | set(sl.adds)}
            per_slice = max(len(sl.held) + len(sl.adds) for sl in self.slices)
            self.stats["max_versions_per_slice"] = max(
                self.stats.get("max_versions_per_slice", 0), per_slice)
        self.stats["max_resident_versions"] = max(self.stats["max_resident_versions"],
                                                  len(vs - {None}))

    # ------------------------------------------------------------------ results

    def unconsumed_records(self) -> list[dict]:
        """Ledger records for the groups still in flight (written at exit)."""
        return unconsumed_records(self.sched.groups, self.sched.readmit_queue)

    def consumed(self) -> dict:
        """step -> list of group ids consumed by that step, in batch order."""
        out: dict[int, list] = {}
        for rec in self.ledger:
            if rec["event"] == "consume":
                out.setdefault(rec["step"], []).append(rec["group_id"])
        return out

    def audit(self) -> AuditReport:
        """The project's auditor over this run's ledger (plus the unconsumed
        records an exit would write), with the mode's own C1 and staleness bound."""
        return audit_run(self.ledger + self.unconsumed_records(), self.config)

    def summary(self) -> dict:
        """Run statistics: ticks, steps, trainer wait, slot utilisation, counts."""
        slot_ticks = self.tick * self.config.total_slots
        cons = [r for r in self.ledger if r["event"] == "consume"]
        return dict(
            self.stats, ticks=self.tick, steps=self.steps_done,
            slot_utilisation=self.stats["busy_slot_ticks"] / slot_ticks if slot_ticks else 0.0,
            admitted=sum(r["event"] == "admit" for r in self.ledger),
            consumed=len(cons),
            max_staleness=max((r["step"] - r["version"] for r in cons), default=0))
