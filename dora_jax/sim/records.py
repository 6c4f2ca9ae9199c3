"""What a simulated run records, as a real run does: ledger lines, the trainer's
wait and the slots' time per step, and timeline spans.

`RunRecords` is the recording half of `cluster.ClusterSim` (which it is mixed into
and whose state it reads: the scheduler, the slices, the clock); the simulation
itself stays in cluster.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora_jax.scheduler.driver import consume_record, sample_entry
from dora_jax.scheduler.ledger import unconsumed_records
from dora_jax.sim.slice import Slice
from dora_jax.sim.slots import idle_reason

if TYPE_CHECKING:  # pragma: no cover
    from dora_jax.base.timeline import Timeline
    from dora_jax.runtime.report import WaitClock
    from dora_jax.scheduler.core import Scheduler
    from dora_jax.scheduler.types import SchedulerConfig
    from dora_jax.sim.slots import SlotTime


class RunRecords:
    """Ledger, per-step waits and slot time, and timeline spans of a `ClusterSim`."""

    if TYPE_CHECKING:  # the ClusterSim state it reads and writes (cluster.py sets it)
        config: SchedulerConfig
        sched: Scheduler
        slices: list[Slice]
        now: float
        colocated: bool
        prompt_len: int
        trainer_busy_until: float | None
        timeline: Timeline
        ledger: list
        metrics: list
        group_version: dict
        done: dict
        waits: WaitClock
        slot_time: SlotTime
        _open: dict
        _step_waits: dict
        _noted: int
        _pending_versions: set
        _rbs_full: bool

    def _span(self, row, kind, start, end, version, slots=None):
        """Timeline span; a decode span that continues the row's last one with the
        same versions extends it (`slots`, busy slots per version, then averaged
        over the joined stretch)."""
        slot_seconds = {v: n * (end - start) for v, n in (slots or {}).items()}
        last = self._open.get(row)
        if (last and last[0] == kind == "decode" and last[3] == version
                and last[4].keys() == slot_seconds.keys() and start <= last[2]):
            last[2] = max(last[2], end)
            for v, x in slot_seconds.items():
                last[4][v] += x
            return
        if last:
            self._add_span(row, *last)
        self._open[row] = [kind, start, end, version, slot_seconds]

    def _add_span(self, row, kind, start, end, version, slot_seconds):
        slots = {v: x / (end - start) for v, x in slot_seconds.items()} if end > start else None
        self.timeline.add(row, kind, start, end, version, slots)

    def _flush_spans(self):
        for row, last in self._open.items():
            self._add_span(row, *last)
        self._open = {}

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
                             keeps_c1=s.policy.keeps_c1, multi=s.multi)
        self.slot_time.book(sl, self.now, reason)

    def _consume(self, gid, step) -> tuple:
        """Writes the group's consume record; returns its trained tokens (prompt and
        response, observations included: the trainer reads them) and its generated
        ones (model turns only)."""
        samples, tokens, generated = [], 0, 0
        for k in range(self.config.group_size):
            r = self.done.pop((gid, k))
            ep = r.episode
            samples.append(sample_entry(k, r.runs(), r.slices, r.length, "eos",
                                        turns=ep.turn_ranges() if len(ep.model) > 1 else None,
                                        observation_tokens=sum(ep.observations)))
            tokens += r.length + self.prompt_len
            generated += sum(ep.model)
        self.ledger.append(consume_record(gid, gid, self.group_version[gid], step, self.now,
                                          samples))
        return tokens, generated

    def unconsumed_records(self) -> list:
        """The ledger's lines for groups admitted and not consumed when the run ended."""
        return unconsumed_records(self.sched.groups, self.sched.readmit_queue)
