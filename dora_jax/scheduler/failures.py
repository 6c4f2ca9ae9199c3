"""Lost work: a slice that failed.

Its samples go back to pending under their group's version (C1) through the
state's own `sample_lost` (state.py), to be regenerated from scratch, so a failure
never mixes versions within a trajectory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState


def slice_failed(sched: SchedulerState, slice_id: int) -> None:
    sl = sched.slices[slice_id]
    for gid, k in sorted(sl.running):
        sched.sample_lost(gid, k)
    sl.version, sl.loading, sl.interrupted, sl.kv_free = None, None, False, None
    sl.held, sl.adding = set(), set()
    sched.settled = False  # until decide() gives its versions a slice again
