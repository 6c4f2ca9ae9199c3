"""A discrete-event simulation of the cluster around the real `Scheduler`.

The scheduling core is the one the JAX runtime drives; only the slices and the
trainer are simulated, on a float clock with the costs of `cost.CostModel`:

- A slice decodes in chunks of steps. A chunk ends when the first few of its
  requests finish (1/32 of them, at least one) or after `max_chunk` steps; its
  length comes from the closed-form cost of k steps whose context grows. Commands
  that reach a slice mid-chunk (a load, an export for migration) wait for the chunk
  to end, as commands wait for a generate call in the runtime. Admitted requests pay
  their group's prompt prefill once per slice; resumed or interrupted ones
  re-prefill their tokens so far; migrated ones pay their KV transfer.
- A slice holds at most `kv_tokens` positions (prompts counted once per group):
  requests beyond that wait, and a chunk that would overflow is shortened, or its
  newest request preempted (it resumes by re-prefilling).
- A multi-turn episode (episodes.py) whose model turn ends (at its chunk's end, as
  a finished request) waits for its environment's latency in its slot, not
  decoding; the observation's tokens are then prefilled on its kept KV at the start
  of the slice's next chunk and its next turn decodes (slice.py). A reload while it
  waits (partial rollout) makes that prefill the whole sequence's. The scheduler
  sees a waiting episode as a running request: dora may migrate it, which moves its
  KV at the usual cost but stalls no decoding (it is not decoding), and it keeps a
  slot reserved at its destination until its observation arrives there. With more
  samples than slots per slice (`episodes_per_slice`) it gives up its slot while it
  waits, its KV kept on device or host (release.py).
- Weight loads share the transfer bandwidth with the loads in progress. With
  several versions per slice (dora, versions_per_slice > 1) a version is added to a
  slice while it decodes its others and evicted at once; a chunk's steps pay one
  more weight (or adapter) read per extra distinct version among its requests.
- The trainer trains a batch in `train_seconds(tokens)`; colocated sync pays its
  reshard, and the slices cannot decode while it trains.

Outputs are those of a real run: ledger.jsonl (audited by the same auditor),
metrics.jsonl, summary.json and the timeline.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable

import numpy as np

from dora_jax.base.timeline import Timeline
from dora_jax.runtime.report import WaitClock
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.driver import Driver, admit_record
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
from dora_jax.sim.cost import CostModel
from dora_jax.sim.episodes import Episode
from dora_jax.sim.records import RunRecords
from dora_jax.sim.release import BetweenTurns
from dora_jax.sim.slice import Request, Slice
from dora_jax.sim.slots import SLOT_REASONS, SlotTime

__all__ = ["SLOT_REASONS", "ClusterSim"]


class ClusterSim(RunRecords, BetweenTurns, Driver):
    """Drives `Scheduler(config)` with simulated slices and trainer.

    Args:
      config: the scheduler's config (mode, slices, slots, G, TBS, RBS, K).
      cost: the cost model.
      length: response length of (group_id, sample).
      prompt_len: prompt tokens of every group.
      episode: the episodes.Episode of (group_id, sample), for multi-turn
        requests (replaces `length`); None: every request is one turn.
      colocated: slices and trainer share the devices (colocated sync).
      max_chunk: most decode steps a slice runs before looking at its commands.
      host_kv: with `config.episodes_per_slice`, an episode's KV waits for its
        environment in host memory (release.py), not on device.
    """

    def __init__(self, config: SchedulerConfig, cost: CostModel,
                 length: Callable[[int, int], int], *, prompt_len: int = 256,
                 colocated: bool = False, max_chunk: int = 64,
                 episode: Callable[[int, int], Episode] | None = None,
                 host_kv: bool = False):
        self.config, self.cost, self.length, self.episode = config, cost, length, episode
        self.prompt_len, self.colocated, self.max_chunk = prompt_len, colocated, max_chunk
        self.host_kv = host_kv
        self.sched = Scheduler(config)
        release = config.episodes_per_slice > 0  # an episode at its environment frees its slot
        self.slices = [Slice(i, config.slots_per_slice, release)
                       for i in range(config.num_slices)]
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.timeline = Timeline()
        self.ledger: list = []
        self.metrics: list = []
        self.group_version: dict = {}
        self.done: dict = {}
        self.trainer_busy_until: float | None = None
        self.stats = dict(busy_slot_seconds=0.0, migrations=0, loads=0, interrupts=0,
                          preemptions=0, decode_steps=0, version_steps=0, host_copies=0)
        self._loads_in_progress = 0
        self._changed = True
        self._open: dict = {}  # row -> [kind, start, end, version]: back-to-back spans merge
        # The trainer's idle time by cause, as the runtime splits it (report.WaitClock).
        self.waits = WaitClock()
        self._step_waits: dict = {}  # step -> (idle seconds before it, by cause)
        self.slot_time = SlotTime(config.slots_per_slice)  # slot-seconds by state
        self._noted = 0  # metrics records given their waits and slot-seconds
        self._pending_versions: set = set()  # scheduler state after the last decide
        self._rbs_full = False

    # ------------------------------------------------------------------ running

    def run(self, num_steps: int, max_events: int = 50_000_000) -> None:
        """Simulates until `num_steps` train steps finished (no decision follows the
        last one: the ledger ends with exactly `num_steps` batches consumed)."""
        self._decide()
        for _ in range(max_events):
            if not self._events:
                raise RuntimeError(f"simulation stalled at t={self.now:.1f}s with "
                                   f"{len(self.metrics)} of {num_steps} steps")
            self.now, _, kind, data = heapq.heappop(self._events)
            getattr(self, "_on_" + kind)(*data)
            if len(self.metrics) >= num_steps:
                self._note_decision()  # books the last step's waits and slot time
                self._flush_spans()
                return
            if self._changed:  # the scheduler saw an event: it may act
                self._decide()
            else:  # only this slice's chunk ended: it goes on
                self._start_chunk(self.slices[data[0]])
        raise RuntimeError(f"more than {max_events} events")

    def _busy(self) -> int:
        """Slices decoding and the trainer training now (for `cost.cores`)."""
        if not self.cost.cores:
            return 0
        return (sum(sl.chunk is not None for sl in self.slices)
                + (self.trainer_busy_until is not None))

    def _at(self, t, kind, *data):
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def _decide(self):
        self._changed = False
        self.execute(self.sched.decide())
        for sl in self.slices:
            if sl.chunk is None:
                self._begin_chunk(sl)
        self._note_decision()  # marks every slice

    # ------------------------------------------------------------------ actions

    def admit(self, a: Admit):
        self.group_version[a.group_id] = a.version
        self.ledger.append(admit_record(a, a.group_id, self.now))

    def assign(self, a: Assign):
        sl = self.slices[a.slice_id]
        if self.episode is not None:
            r = Request(a.group_id, a.sample, 0, a.version, a.slice_id,
                        self.episode(a.group_id, a.sample))
        else:
            r = Request(a.group_id, a.sample, max(1, int(self.length(a.group_id, a.sample))),
                        a.version, a.slice_id)
        sl.waiting.append(r)

    def migrate(self, a: Migrate):
        src = self.slices[a.src_slice]
        src.exports.append(((a.group_id, a.sample), a.dst_slice))
        if src.chunk is None:
            self._apply_commands(src)

    def load(self, a: LoadVersion | InterruptReload, *, interrupt: bool):
        sl = self.slices[a.slice_id]
        sl.pending.append(a)
        if sl.chunk is None:
            self._apply_commands(sl)

    def add_version(self, a: AddVersion):
        """The slice decodes on while the version's weights (or adapters) arrive."""
        sl = self.slices[a.slice_id]
        sl.adding.add(a.version)
        self._loads_in_progress += 1
        seconds = self.cost.load_seconds(self._loads_in_progress)
        self.stats["loads"] += 1
        self._at(self.now + seconds, "added", sl.i, a.version)

    def evict(self, a: Evict):
        sl = self.slices[a.slice_id]
        sl.held.discard(a.version)
        sl.version = max(sl.held) if sl.held else None

    def train(self, a: TrainStep):
        idle_since = self.metrics[-1]["time"] if self.metrics else 0.0
        self._step_waits[a.step] = (self.now - idle_since, self.waits.take(self.now))
        tokens = generated = 0
        for gid in a.group_ids:
            trained, decoded = self._consume(gid, a.step)
            tokens, generated = tokens + trained, generated + decoded
        seconds = (self.cost.train_seconds(tokens) * self.cost.contention(self._busy() + 1)
                   + (self.cost.reshard if self.colocated else 0.0))
        self.trainer_busy_until = self.now + seconds
        self._span("trainer", "train", self.now, self.now + seconds, a.step)
        self._at(self.now + seconds, "trained", a.step, tokens, generated)

    def _apply_commands(self, sl: Slice):
        """Exports and loads sent while a chunk ran (C1: a load finds no requests)."""
        self._apply_exports(sl)
        deferred = []
        for a in sl.pending:
            sl.loading = a.version
            # The version in training: the slice pauses, its transfer starts once the
            # step publishes it (_on_trained). A later load supersedes it.
            deferred = [a] if a.version > self.sched.published else []
            if deferred:
                continue
            self._loads_in_progress += 1
            seconds = self.cost.load_seconds(self._loads_in_progress)
            self.stats["loads"] += 1
            if isinstance(a, InterruptReload):
                self.stats["interrupts"] += 1
            self._span(f"slice {sl.i}", "load", self.now, self.now + seconds, a.version)
            self._at(self.now + seconds, "loaded", sl.i, a.version,
                     isinstance(a, InterruptReload))
        sl.pending = deferred

    def _apply_exports(self, sl: Slice):
        """Moves the requests the scheduler migrated away. One still on its way here
        (migrated twice before it arrived) keeps its export until it arrives; one
        that finished first is gone (its event already told the scheduler)."""
        keep: list = []
        exports, sl.exports = sl.exports, []  # re-entered via a destination
        for key, dst in exports:
            if sl.holds(key):
                r = sl.remove(key)
            else:
                waiting = next((w for w in sl.waiting if (w.gid, w.k) == key), None)
                if waiting is None:
                    if key not in self.done:
                        keep.append((key, dst))
                    continue
                sl.waiting.remove(waiting)
                r = waiting
            d = self.slices[dst]
            r.slices.append(dst)
            r.ready_at = self.now + self.cost.migrate_seconds(self.prompt_len + r.produced)
            self._span(f"slice {sl.i}", "migrate", self.now, r.ready_at, sl.version)
            if d.release and (r.env_until is not None or r.observed):
                d.add(r)  # between turns: held away from the slots, its KV arriving
            else:
                d.waiting.append(r)
            self.stats["migrations"] += 1
            if d.exports or d.chunk is None:
                self._start_chunk(d)
        sl.exports = keep + sl.exports

    # ------------------------------------------------------------------ events

    def _on_loaded(self, i, version, interrupt):
        sl = self.slices[i]
        self._loads_in_progress -= 1
        if sl.loading != version:
            self._changed = True
            return  # superseded (a later load was sent)
        sl.version, sl.loading, sl.held = version, None, {version}
        sl.prompts = set()
        if interrupt:  # partial rollout: everything held continues under the new params
            for j in sl.where.values():
                r = sl.reqs[j]
                r.produced = int(sl.produced[j])
                r.segments.append((version, r.produced))
                r.reprefill = r.produced
                if not sl.parked[j]:  # a parked one re-prefills when its observation does
                    sl.fresh.append(r)
            self._reload_away(sl, version)
            for r in sl.waiting:
                r.segments.append((version, r.produced))
        self.sched.version_loaded(i, version)
        self._changed = True

    def _on_added(self, i, version):
        sl = self.slices[i]
        self._loads_in_progress -= 1
        sl.adding.discard(version)
        sl.held.add(version)
        sl.version = max(sl.held)
        self.sched.version_loaded(i, version)
        self._changed = True

    def _on_trained(self, step, tokens, generated):
        self.trainer_busy_until = None
        self.metrics.append(dict(step=step, time=self.now, trained_tokens=tokens,
                                 generated_tokens=generated))
        self.sched.step_finished(step)
        for sl in self.slices:  # loads deferred until this version was published
            if sl.pending and sl.chunk is None:
                self._apply_commands(sl)
        self._changed = True

    def _on_chunk(self, i):
        sl = self.slices[i]
        steps = sl.chunk[2]
        sl.chunk = None
        n = np.minimum(sl.left, steps)  # one that finishes mid-chunk idles to its end
        sl.produced += n
        sl.left -= n
        for j in np.flatnonzero(sl.active & (sl.left == 0)).tolist():
            r = sl.reqs[j]
            if not r.last_turn:  # its environment answers, then its next turn decodes
                self._end_turn(sl, j)
                continue
            sl.remove((r.gid, r.k))
            self.done[(r.gid, r.k)] = r
            self.sched.sample_finished(r.gid, r.k, r.length)
            self._changed = True
        self._apply_commands(sl)

    # ------------------------------------------------------------------ decoding

    def _start_chunk(self, sl: Slice):
        """Starts the slice's next chunk if it can; marks its state (`_mark`)."""
        self._begin_chunk(sl)
        self._mark(sl)

    def _begin_chunk(self, sl: Slice):
        if sl.loading is not None or (self.colocated and self.trainer_busy_until):
            return
        if sl.exports and sl.chunk is None:
            self._apply_exports(sl)
        if sl.chunk is not None:
            return
        cost, extra, P = self.cost, 0.0, self.prompt_len
        sl.unpark_observed()
        # Observations of the episodes seated now: one prefill call on their kept KV.
        extra += cost.prefill_seconds(sl.seat_ready())
        # KV held, not read by decoding: parked slots', or kept away from the slots.
        parked_kv = int(sl.produced[sl.parked].sum()) + sl.away_kv
        used = P * len(sl.groups) + int(sl.produced[sl.active].sum()) + parked_kv
        while sl.waiting and sl.free:  # admit what the slots and the KV memory hold
            r = sl.waiting[0]
            need = r.produced + (0 if r.gid in sl.groups else P)
            if sl.where and used + need + sl.num_running + 1 > cost.kv_tokens:
                break
            sl.waiting.pop(0)
            if r.gid not in sl.prompts:
                sl.prompts.add(r.gid)
                extra += cost.prefill_seconds(P)
            if r.produced and not r.ready_at:  # resumed here: its tokens so far again
                r.reprefill = r.produced
            sl.add(r)
            used += need
        for r in sl.fresh:
            extra += cost.prefill_seconds(r.reprefill)
            r.reprefill = 0
            extra = max(extra, r.ready_at - self.now)
        sl.fresh = []
        batch = int(sl.active.sum())
        if not batch:
            return
        left = sl.left[sl.active]
        m = max(batch // 32, 1)
        steps = min(int(np.partition(left, m - 1)[m - 1]), self.max_chunk)
        if used + batch * steps > cost.kv_tokens:
            steps = max(1, (cost.kv_tokens - used) // batch)
            if used + batch * steps > cost.kv_tokens and batch > 1:  # preempt the newest
                r = sl.remove(sl.newest())
                r.ready_at = 0.0
                sl.waiting.insert(0, r)
                self.stats["preemptions"] += 1
                return self._begin_chunk(sl)
        slow = cost.contention(self._busy() + 1)
        extra *= slow
        by_version = None if not self.sched.multi else collections.Counter(
            sl.reqs[j].segments[-1][0] for j in np.flatnonzero(sl.active).tolist())
        versions = len(by_version) if by_version else 1
        self.stats["decode_steps"] += steps
        self.stats["version_steps"] += versions * steps
        seconds = extra + slow * (cost.steps_seconds(steps, batch, used - parked_kv, versions)
                                  + cost.calls_seconds(steps, batch >= self.config.slots_per_slice))
        sl.chunk = (self.now + extra, self.now + seconds, steps)
        sl.rates = (self.now + extra, float(np.minimum(left, steps).sum()) / steps, batch)
        sl.kv_blocked = bool(sl.waiting)
        self.stats["busy_slot_seconds"] += batch * (seconds - extra)
        self._span(f"slice {sl.i}", "decode", self.now, self.now + seconds, sl.version,
                   by_version)
        self._at(self.now + seconds, "chunk", sl.i)
