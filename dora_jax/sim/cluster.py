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
- Weight loads share the transfer bandwidth with the loads in progress.
- The trainer trains a batch in `train_seconds(tokens)`; colocated sync pays its
  reshard, and the slices cannot decode while it trains.

Outputs are those of a real run: ledger.jsonl (audited by the same auditor),
metrics.jsonl, summary.json and the timeline.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Optional

import numpy as np

from dora_jax.runtime.report import WaitClock
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.driver import Driver, admit_record, consume_record, sample_entry
from dora_jax.scheduler.ledger import unconsumed_records
from dora_jax.scheduler.types import (Admit, Assign, InterruptReload, LoadVersion, Migrate,
                                      SchedulerConfig, TrainStep)
from dora_jax.sim.cost import CostModel
from dora_jax.sim.slice import Request, Slice
from dora_jax.sim.slots import SLOT_REASONS, SlotTime, idle_reason
from dora_jax.timeline import Timeline

__all__ = ["SLOT_REASONS", "ClusterSim"]


class ClusterSim(Driver):
    """Drives `Scheduler(config)` with simulated slices and trainer.

    Args:
      config: the scheduler's config (mode, slices, slots, G, TBS, RBS, K).
      cost: the cost model.
      length: response length of (group_id, sample).
      prompt_len: prompt tokens of every group.
      colocated: slices and trainer share the devices (colocated sync).
      max_chunk: most decode steps a slice runs before looking at its commands.
    """

    def __init__(self, config: SchedulerConfig, cost: CostModel,
                 length: Callable[[int, int], int], *, prompt_len: int = 256,
                 colocated: bool = False, max_chunk: int = 64):
        self.config, self.cost, self.length = config, cost, length
        self.prompt_len, self.colocated, self.max_chunk = prompt_len, colocated, max_chunk
        self.sched = Scheduler(config)
        self.slices = [Slice(i, config.slots_per_slice) for i in range(config.num_slices)]
        self.now = 0.0
        self._events: list = []
        self._seq = itertools.count()
        self.timeline = Timeline()
        self.ledger: list = []
        self.metrics: list = []
        self.group_version: dict = {}
        self.done: dict = {}
        self.trainer_busy_until: Optional[float] = None
        self.stats = dict(busy_slot_seconds=0.0, migrations=0, loads=0, interrupts=0,
                          preemptions=0)
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

    def _span(self, row, kind, start, end, version):
        """Timeline span; a decode span that continues the row's last one extends it."""
        last = self._open.get(row)
        if last and last[0] == kind == "decode" and last[3] == version and start <= last[2]:
            last[2] = max(last[2], end)
            return
        if last:
            self.timeline.add(row, *last)
        self._open[row] = [kind, start, end, version]

    def _flush_spans(self):
        for row, last in self._open.items():
            self.timeline.add(row, *last)
        self._open = {}

    def _at(self, t, kind, *data):
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def _decide(self):
        self._changed = False
        self.execute(self.sched.decide())
        for sl in self.slices:
            if sl.chunk is None:
                self._begin_chunk(sl)
        self._note_decision()  # marks every slice

    def _note_decision(self):
        """Marks the state a decision left: the trainer's wait cause (the runtime's
        `_wait_kind`) and every slice's slot state; gives each newly finished step's
        record its wait and its slot-seconds since the previous step."""
        s = self.sched
        self.waits.mark(self.now, None if s.trainer_busy else "fill" if s.next_step == 0
                        else "guard" if s.num_finished_groups >= self.config.train_batch_size
                        else "starvation")
        self._pending_versions = {v for v, n in s.pending_by_version().items() if n > 0}
        self._rbs_full = not s.policy.admission_room(s)
        for sl in self.slices:
            self._mark(sl)
        while self._noted < len(self.metrics):
            rec = self.metrics[self._noted]
            self._noted += 1
            wait, split = self._step_waits.pop(rec["step"])
            rec.update(trainer_wait=round(wait, 4), trainer_wait_split=split,
                       slot_idle=self.slot_time.since_last_step())

    def _mark(self, sl: Slice):
        """Books the slice's slot time up to now and takes its state now (every change
        of a slice's state is followed by a mark at the same time: the end of
        `_start_chunk`, of `_decide`)."""
        s = self.sched
        reason = idle_reason(sl, colocated_training=(self.colocated
                                                     and self.trainer_busy_until is not None),
                             pending_versions=self._pending_versions, rbs_full=self._rbs_full,
                             keeps_c1=s.policy.keeps_c1)
        self.slot_time.book(sl, self.now, reason)

    # ------------------------------------------------------------------ actions

    def admit(self, a: Admit):
        self.group_version[a.group_id] = a.version
        self.ledger.append(admit_record(a, a.group_id, self.now))

    def assign(self, a: Assign):
        sl = self.slices[a.slice_id]
        sl.waiting.append(Request(a.group_id, a.sample,
                                  max(1, int(self.length(a.group_id, a.sample))),
                                  sl.version, a.slice_id))

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

    def train(self, a: TrainStep):
        idle_since = self.metrics[-1]["time"] if self.metrics else 0.0
        self._step_waits[a.step] = (self.now - idle_since, self.waits.take(self.now))
        tokens = 0
        for gid in a.group_ids:
            tokens += self._consume(gid, a.step)
        seconds = (self.cost.train_seconds(tokens) * self.cost.contention(self._busy() + 1)
                   + (self.cost.reshard if self.colocated else 0.0))
        self.trainer_busy_until = self.now + seconds
        self._span("trainer", "train", self.now, self.now + seconds, a.step)
        self._at(self.now + seconds, "trained", a.step, tokens)

    def _consume(self, gid, step) -> int:
        samples, tokens = [], 0
        for k in range(self.config.group_size):
            r = self.done.pop((gid, k))
            samples.append(sample_entry(k, r.runs(), r.slices, r.length, "eos"))
            tokens += r.length + self.prompt_len
        self.ledger.append(consume_record(gid, gid, self.group_version[gid], step, self.now,
                                          samples))
        return tokens

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
        keep, exports, sl.exports = [], sl.exports, []  # re-entered via a destination
        for key, dst in exports:
            if key in sl.where:
                r = sl.remove(key)
            else:
                r = next((w for w in sl.waiting if (w.gid, w.k) == key), None)
                if r is None:
                    if key not in self.done:
                        keep.append((key, dst))
                    continue
                sl.waiting.remove(r)
            d = self.slices[dst]
            r.slices.append(dst)
            r.ready_at = self.now + self.cost.migrate_seconds(self.prompt_len + r.produced)
            self._span(f"slice {sl.i}", "migrate", self.now, r.ready_at, sl.version)
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
        sl.version, sl.loading = version, None
        sl.prompts = set()
        if interrupt:  # partial rollout: everything held continues under the new params
            for j in sl.where.values():
                r = sl.reqs[j]
                r.produced = int(sl.produced[j])
                r.segments.append((version, r.produced))
                r.reprefill = r.produced
                sl.fresh.append(r)
            for r in sl.waiting:
                r.segments.append((version, r.produced))
        self.sched.version_loaded(i, version)
        self._changed = True

    def _on_trained(self, step, tokens):
        self.trainer_busy_until = None
        self.metrics.append(dict(step=step, time=self.now, trained_tokens=tokens))
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
        used = P * len(sl.groups) + int(sl.produced[sl.active].sum())
        while sl.waiting:  # admit what the KV memory holds
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
        batch = sl.num_running
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
        seconds = extra + slow * (cost.steps_seconds(steps, batch, used)
                                  + cost.calls_seconds(steps, batch >= self.config.slots_per_slice))
        sl.chunk = (self.now + extra, self.now + seconds, steps)
        sl.rates = (self.now + extra, float(np.minimum(left, steps).sum()) / steps, batch)
        sl.kv_blocked = bool(sl.waiting)
        self.stats["busy_slot_seconds"] += batch * (seconds - extra)
        self._span(f"slice {sl.i}", "decode", self.now, self.now + seconds, sl.version)
        self._at(self.now + seconds, "chunk", sl.i)

    # ------------------------------------------------------------------ results

    def unconsumed_records(self) -> list:
        return unconsumed_records(self.sched.groups, self.sched.readmit_queue)
