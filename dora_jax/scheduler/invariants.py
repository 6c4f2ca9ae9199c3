"""The scheduling core's invariants (`Scheduler.check_invariants`): counters that
agree with the groups, C1 at the engine boundary, slots and loads consistent, the
versions each slice holds (residency.check: at most V, every running request's
version resident), the trainer's step accounting, and the mode's own rules
(`Policy.check`)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from . import residency
from .types import FINISHED, PENDING, RUNNING

if TYPE_CHECKING:  # pragma: no cover
    from .policies import Policy
    from .state import SchedulerState


class InvariantError(AssertionError):
    """Raised by `Scheduler.check_invariants()` when the state breaks a rule."""


def check(sched: SchedulerState, policy: Policy) -> None:
    """Raise InvariantError if the state breaks a rule of the core or the mode.

    Cheap enough (linear in in-flight samples) to call after every event."""
    def req(cond, msg):
        if not cond:
            raise InvariantError(msg)

    cfg = sched.config
    c1 = policy.keeps_c1
    uncons: Counter[int] = Counter()
    unfin: Counter[int] = Counter()
    pend: Counter[int] = Counter()
    for gid, g in sched.groups.items():
        req(0 <= gid < sched.next_group_id, f"group id {gid} never admitted")
        req(g.version <= sched.published, f"group {gid} from the future")
        req(len(g.samples) == cfg.group_size, f"group {gid} has wrong size")
        counts = Counter(smp.status for smp in g.samples)
        req((counts[PENDING], counts[RUNNING], counts[FINISHED])
            == (g.n_pending, g.n_running, g.n_finished), f"group {gid} counts")
        uncons[g.version] += 1
        unfin[g.version] += g.n_pending + g.n_running
        pend[g.version] += g.n_pending
        for k, smp in enumerate(g.samples):
            if smp.status == RUNNING:
                req((gid, k) in sched.slices[smp.slice_id].running, f"({gid},{k}) lost")
            else:
                req(smp.slice_id is None, f"({gid},{k}) not running but on a slice")
            req((smp.status == PENDING) == (not smp.versions), f"({gid},{k}) versions")
            if c1:  # C1: one version per trajectory and per group
                req(set(smp.versions) <= {g.version}, f"C1: ({gid},{k}) ran {smp.versions}")
    req(_nonzero(uncons) == _nonzero(sched.unconsumed_by_version())
        and _nonzero(unfin) == _nonzero(sched.unfinished_by_version())
        and _nonzero(pend) == _nonzero(sched.pending_by_version()),
        "per-version counters drifted")
    req(sched.trainable_group_ids() == {gid for gid, g in sched.groups.items() if g.trainable},
        "trainable group set drifted")
    busy = sched.trainer_step is not None
    for sl in sched.slices:
        req(len(sl.running) <= cfg.samples_per_slice, f"slice {sl.slice_id} overfull")
        req(sl.version is None or sl.version <= sched.published,
            f"slice {sl.slice_id} holds unpublished v{sl.version}")
        # A load may name the version in training (deferred until it is published).
        req(sl.loading is None or sl.loading <= sched.published + busy,
            f"slice {sl.slice_id} loads v{sl.loading}, neither published nor in training")
        req(not sl.interrupted or sl.loading is not None, "interrupted but not loading")
        if sl.loading is not None and not sl.interrupted:
            req(not sl.running, f"C1: slice {sl.slice_id} loads while holding requests")
        for gid, k in sl.running:
            owner = sched.groups.get(gid)
            if owner is None or owner.samples[k].slice_id != sl.slice_id:
                raise InvariantError(f"slice {sl.slice_id} holds a stray request ({gid},{k})")
            if c1 and not sched.multi:
                req(sl.version == owner.version and sl.loading is None,
                    f"C1: slice {sl.slice_id} v{sl.version} runs group v{owner.version}")
    residency.check(sched, req)  # versions held per slice (C1 with several versions)
    req(sched.next_step == sched.published + busy, "trainer step accounting")
    req(not busy or sched.trainer_step == sched.next_step - 1, "trainer step index")
    policy.check(sched, req)


def _nonzero(c: Counter) -> dict:
    # Counter's unary + would also drop negative counts and so hide a drift.
    return {k: v for k, v in c.items() if v != 0}
