"""Lost work: a slice that failed, a running sample whose progress is gone.

Both put the samples back to pending under their group's version (C1), to be
regenerated from scratch, so a failure never mixes versions within a trajectory.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from .types import PENDING, RUNNING

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState


def slice_failed(sched: SchedulerState, slice_id: int) -> None:
    sl = sched.slices[slice_id]
    for gid, k in sorted(sl.running):
        sample_lost(sched, gid, k)
    sl.version, sl.loading, sl.interrupted, sl.kv_free = None, None, False, None
    sl.held, sl.adding = set(), set()
    sched.settled = False  # until decide() gives its versions a slice again


def sample_lost(sched: SchedulerState, group_id: int, sample: int) -> None:
    g = sched.groups[group_id]
    smp = g.samples[sample]
    if smp.status != RUNNING:
        raise ValueError(f"sample_lost: ({group_id}, {sample}) is {smp.status}")
    sched._leave(sched.slices[smp.slice_id], (group_id, sample))
    smp.status, smp.slice_id, smp.versions, smp.slices = PENDING, None, [], []
    g.n_running -= 1
    g.n_pending += 1
    sched._pending_v[g.version] += 1
    q = sched._pending_q.setdefault(g.version, deque())
    q.appendleft((group_id, sample))  # regenerated first: it is the oldest work
