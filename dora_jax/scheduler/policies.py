"""The batch-synchronous baselines (`sync`, `one_step_off`) as policies over the
shared scheduler state (state.py), plus the `Policy` base and the helpers the other
modes reuse (dora.py, partial.py). modes.py maps mode names to policies.

A policy is stateless: everything it needs is in the scheduler's state, so a snapshot
needs no policy state. `plan()` is one decision pass; `Scheduler.decide()` repeats passes
until one returns nothing. Each pass runs, in order: batch formation (consuming
groups frees admission room), slice versions, admission, request assignment.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from dora_jax.config.modes import CAPABILITIES

from .types import SchedulerConfig, SliceState

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState


class Policy:
    """Base class: one decision pass plus the mode's own invariants.

    A policy also says which constraints it keeps and what it can do, as class
    attributes: its mode's row of the config's table (dora_jax/config/modes.py,
    `Capabilities`: `keeps_c1`, `bound`, `replaces_filtered_groups`, `resumable`,
    `allows_colocation`, `multi_version`), set on each subclass by its `name`, so the
    validation of a config and the scheduling of it read the same values.
    """

    name = ""
    keeps_c1: bool
    replaces_filtered_groups: bool
    resumable: bool
    allows_colocation: bool
    multi_version: bool
    bound: int | Literal["K"] | None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        caps = CAPABILITIES[cls.name]
        for f in dataclasses.fields(caps):
            setattr(cls, f.name, getattr(caps, f.name))

    def staleness_bound(self, config: SchedulerConfig) -> int | None:
        """The largest step - version this mode guarantees (None: not bounded)."""
        return CAPABILITIES[self.name].staleness_bound(config.max_staleness)

    def plan(self, sched: SchedulerState) -> list:
        """Return the actions of one decision pass (already applied to `sched`)."""
        raise NotImplementedError

    def admission_room(self, sched: SchedulerState) -> int:
        """Groups the mode's rollout batch leaves room for now (drivers report a slot
        idle for want of it as `rbs_full`): RBS unconsumed groups."""
        return sched.admission_room(sched.config.rollout_batch_size)

    def check(self, sched: SchedulerState, req: Callable[[bool, str], None]) -> None:
        """Check mode-specific invariants; `req(cond, msg)` raises if cond is false."""


def fullest_fitting(free_sorted: list, need: int) -> int:
    """Index in `free_sorted` ((free slots, slice id), ascending) of the slice a group
    with `need` samples to place goes to: the fullest that holds them all, so that
    slices fill and their generate calls run with every slot busy rather than two
    slices each half full; if none holds them, the emptiest (the rest go to the next).
    Lowest id on ties."""
    i = bisect.bisect_left(free_sorted, (need, -1))
    if i == len(free_sorted):
        i = bisect.bisect_left(free_sorted, (free_sorted[-1][0], -1))
    return i


def assign_pending(sched: SchedulerState, slice_ok: Callable[[SliceState], bool] = lambda sl: True,
                   match_version: bool = True) -> list:
    """Give pending samples (oldest version, then oldest group first) a free slot on a
    serving slice accepted by `slice_ok` and, if `match_version` (C1), holding the
    group's version.

    A group's samples go to one slice where they fit (`fullest_fitting`), so the slice
    prefills the group's prompt once; a group too big for any goes to the emptiest,
    as many as fit, the rest to the next. Free-slot lists kept sorted by version make
    it O(pending * log slices) comparisons for large clusters."""
    if not sched.has_pending():
        return []
    free: dict = {}
    for sl in sched.slices:
        n = sched.free_slots(sl)
        if sl.serving and n > 0 and slice_ok(sl):
            free.setdefault(sl.version if match_version else None, []).append(
                (n, sl.slice_id))
    for lst in free.values():
        lst.sort()
    acts, cur = [], None  # cur: [group_id, free list, free slots left, slice id]

    def put_back():
        if cur is not None and cur[2] > 0:
            bisect.insort(cur[1], (cur[2], cur[3]))

    for v in sched.pending_versions():
        lst = free.get(v if match_version else None)
        if not lst:
            continue  # no free slot for this version: its samples are not walked
        for g, k in sched.pending_of_version(v):
            if cur is None or cur[0] != g.group_id or cur[2] == 0:
                put_back()
                cur = None
                if not lst:
                    break  # this version's slices are full
                cur = [g.group_id, lst, *lst.pop(fullest_fitting(lst, g.n_pending))]
            acts.append(sched.do_assign(g.group_id, k, cur[3]))
            cur[2] -= 1
        put_back()
        cur = None
    return acts


def train_when_finished(sched: SchedulerState, group_ids) -> list:
    """A TrainStep on exactly these groups once every one is admitted and trainable
    and the trainer is idle (the batch-synchronous modes)."""
    group_ids = list(group_ids)
    if (not sched.trainer_busy and len(group_ids) == sched.config.train_batch_size
            and all(gid in sched.groups and sched.groups[gid].trainable for gid in group_ids)):
        return [sched.do_train(group_ids)]
    return []


def converge_slices(sched: SchedulerState, target: int) -> list:
    """Uniform-version modes: every empty slice not holding (or loading) `target`
    loads it. Non-empty slices keep their version until they drain (C1)."""
    acts = []
    for sl in sched.slices:
        if sl.effective_version != target and not sl.running:
            acts.append(sched.do_load(sl.slice_id, target))
    return acts


def check_uniform_slices(sched: SchedulerState, req) -> None:
    """All slices hold (or are loading) one and the same version."""
    vs = {sl.effective_version for sl in sched.slices
          if sl.effective_version is not None}  # None: a failed slice
    req(len(vs) <= 1, f"{sched.config.mode}: slices disagree on version {sorted(vs)}")


class SyncPolicy(Policy):
    """Synchronous on-policy RL: admit TBS groups at the published version t, all
    slices on t, train when all are finished, then every slice loads t+1. A group
    filtered out (config.score_groups) is replaced by a new one at t."""

    name = "sync"

    def plan(self, sched):
        tbs = sched.config.train_batch_size
        acts = train_when_finished(sched, sorted(sched.groups))
        acts += converge_slices(sched, sched.published)
        # A new batch (or a filtered group's replacement) only while the trainer is
        # idle: its version is then published.
        room = sched.admission_room(tbs)
        if not sched.trainer_busy and (room == tbs or (sched.groups and room)):
            acts += [sched.do_admit(sched.published) for _ in range(room)]
        acts += assign_pending(sched)
        return acts

    def check(self, sched, req):
        req(len(sched.groups) <= sched.config.train_batch_size, "sync: more than TBS in flight")
        req(all(g.version == sched.published for g in sched.groups.values()),
            "sync: a group is not on the published version")
        check_uniform_slices(sched, req)


class OneStepOffPolicy(Policy):
    """verl's one-step-off pipelining. Batch b (group ids b*TBS .. b*TBS+TBS-1) is
    generated by version max(b-1, 0) and trained by step b, so step t overlaps the
    rollout of batch t+1. Batch b starts once batch b-1 is fully generated and step
    b-2 has published version b-1; only then do the (empty) slices switch version."""

    name = "one_step_off"

    def plan(self, sched):
        tbs, t = sched.config.train_batch_size, sched.next_step
        acts = train_when_finished(sched, range(t * tbs, (t + 1) * tbs))
        b = sched.next_group_id // tbs  # next batch to admit
        prev_done = all(sched.groups[i].finished for i in range((b - 1) * tbs, b * tbs)
                        if i in sched.groups) if b else True
        if prev_done and sched.published >= b - 1 and sched.admission_room(2 * tbs) >= tbs:
            acts += [sched.do_admit(max(b - 1, 0)) for _ in range(tbs)]
        latest = sched.next_group_id // tbs - 1  # newest admitted batch
        acts += converge_slices(sched, max(latest - 1, 0))
        acts += assign_pending(sched)
        return acts

    def check(self, sched, req):
        tbs = sched.config.train_batch_size
        req(len(sched.groups) <= 2 * tbs, "one_step_off: more than two batches in flight")
        for gid, g in sched.groups.items():
            req(g.version == max(gid // tbs - 1, 0),
                f"one_step_off: group {gid} has version {g.version}")
        check_uniform_slices(sched, req)

