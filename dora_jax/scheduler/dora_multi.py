"""DORA with several versions per slice (config.versions_per_slice V > 1;
residency.py has the slices' bookkeeping).

Batch formation, the staleness guard, FEASIBILITY and the in-flight admission bound
are dora.py's, unchanged; what changes is how slices follow versions. A slice no
longer switches version: it adds one into a free place and evicts one that nothing
on it uses, so no request ever migrates or waits for a slice to drain.

One pass, in order:

* Eviction. A held version that fell out of the window [P - K, P] is evicted at once
  (C3: nothing of it is left unconsumed once P is published).
* The newest version everywhere. As soon as P is published, every slice that does
  not hold it adds it: into a free place, else in the place of its oldest version
  that nothing on the slice uses and that no pending sample waits for (or another
  slice also holds). With V = K + 1 a place is always there (the window holds K + 1
  versions, the one that left it is evicted first), so every slot can decode every
  live version. With V <= K a slice whose places all hold requests adds P once one
  of its versions drains.
* Orphans. A version with pending samples and no slice holding or adding it (its
  holders failed) is added to the slice with the most free slots that has a place.
* Admission at P for the free slots of the slices holding or adding P, less every
  pending sample (they start first, on the same slots), while FEASIBILITY (with
  feasibility.py's reserve) allows; a slice that cannot take P yet (V <= K) may be topped
  up at its newest version w if w + K > t and G of its slots idle, as in dora.py.
* Assignment: oldest version first, to slices holding the group's version.

Eviction is otherwise lazy: an unused version stays resident (a lost sample of it
may come back) until its place is wanted or it leaves the window.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from . import residency
from .feasibility import (
    admission_feasible,
    admission_reserve,
    form_guarded_batch,
    in_flight_room,
)

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState
    from .types import Admit


def plan(sched: SchedulerState) -> list:
    acts = form_guarded_batch(sched)
    acts += _residency(sched)
    acts += _admit(sched)
    acts += residency.assign_resident(sched)
    return acts


def _residency(sched) -> list:
    cfg = sched.config
    p, lo = sched.published, sched.published - cfg.max_staleness
    pending = sched.pending_by_version()
    holders = Counter(v for sl in sched.slices for v in sl.held | sl.adding)
    acts: list = []

    def make_room(sl) -> bool:
        """A free place on the slice, evicting one version if it must."""
        if residency.places_free(sched, sl) > 0:
            return True
        for w in sorted(sl.held):
            if w != p and residency.evictable(sl, w) and (not pending[w] or holders[w] > 1):
                acts.append(residency.evict(sched, sl.slice_id, w))
                holders[w] -= 1
                return True
        return False

    for sl in sched.slices:
        if sl.loading is not None:
            continue  # a LoadVersion in flight (none is issued with V > 1)
        for w in sorted(sl.held):
            if w < lo:  # out of the window: nothing of it is left (C3)
                acts.append(residency.evict(sched, sl.slice_id, w))
                holders[w] -= 1
        if p not in sl.held and p not in sl.adding and make_room(sl):
            acts.append(residency.add_version(sched, sl.slice_id, p))
            holders[p] += 1
    for w in sorted(v for v, n in pending.items() if n > 0 and not holders[v]):
        order = sorted((sl for sl in sched.slices if sl.loading is None),
                       key=lambda sl: (-sched.free_slots(sl), sl.slice_id))
        for sl in order:
            if make_room(sl):
                acts.append(residency.add_version(sched, sl.slice_id, w))
                holders[w] += 1
                break
    return acts


def _admit(sched) -> list:
    cfg = sched.config
    p, t, k = sched.published, sched.next_step, cfg.max_staleness
    tbs, G = cfg.train_batch_size, cfg.group_size
    room = in_flight_room(sched)
    if not room:
        return []
    counts, pend = sched.unconsumed_by_version(), sched.pending_by_version()
    reserve = admission_reserve(k)
    free_p = 0
    free_old: Counter[int] = Counter()
    for sl in sched.slices:
        if sl.loading is not None:
            continue
        if p in sl.held or p in sl.adding:
            free_p += sched.free_slots(sl)
        elif sl.held:  # cannot take P yet (V <= K): a top-up at its newest version
            assert sl.version is not None  # the newest it holds (residency.check)
            free_old[sl.version] += sched.free_slots(sl)
    free_p -= sum(n for n in pend.values() if n > 0)

    def ok(w):
        return (w == p or w + k > t) and admission_feasible(counts, w, t, reserve, tbs)

    acts: list[Admit] = []
    while len(acts) < room and free_p > 0 and ok(p):
        acts.append(sched.do_admit(p))
        counts[p] += 1
        free_p -= G
    for w in sorted(free_old, reverse=True):
        free = free_old[w] - pend[w]
        while len(acts) < room and free >= G and ok(w):
            acts.append(sched.do_admit(w))
            counts[w] += 1
            free -= G
    return acts


def check(sched: SchedulerState, req) -> None:
    """dora's version rules with several versions per slice: every held or added
    version is in the window [P - K, P] (one older just after a publish, before
    decide()), and a version with unfinished samples has a slice holding or adding
    it, unless no slice has a place it could free (V <= K, every place in use)."""
    cfg = sched.config
    p = sched.published
    lo = p - cfg.max_staleness - (0 if sched.settled else 1)
    present = set()
    for sl in sched.slices:
        for v in sl.held | sl.adding:
            req(lo <= v <= p, f"dora: slice {sl.slice_id} holds v{v} outside window [{lo}, {p}]")
            present.add(v)
    blocked = all(sl.loading is not None or (residency.places_free(sched, sl) <= 0 and not any(
        w != p and residency.evictable(sl, w) for w in sl.held)) for sl in sched.slices)
    for w, n in sched.unfinished_by_version().items():
        req(n <= 0 or w in present or not sched.settled or blocked,
            f"dora: version {w} has work but no slice")
