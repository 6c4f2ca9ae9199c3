"""Multi-version decode slices: which versions each slice holds, and the rules for
changing that (config.versions_per_slice V > 1, for a policy with `multi_version`).

A slice holds a *set* of at most V versions (`SliceState.held`), plus those being
loaded into free places (`adding`); each of its slots decodes under its own
request's version in the same generate call (with LoRA: adapter sets on one shared
base). So, unlike LoadVersion, which replaces a slice's one version once it is
empty:

* `AddVersion(slice, v)` loads v into a free place (held + adding < V) while the
  slice goes on decoding its other versions; `version_loaded(slice, v)` reports it
  resident.
* `Evict(slice, v)` drops a resident version, only when no request of v runs on
  the slice (`in_use`: running requests per group version, migrations included,
  since the core moves a migrated request's slot at once).
* A sample is assigned (or a request migrated) to a slice only if its group's
  version is resident there (`SliceState.serves`; C1 is per trajectory, never per
  slice).

`SliceState.version` stays the newest resident version (None: nothing resident), for
the timeline and the one-version code paths. With V = 1 nothing here is used:
`held` is just {version}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .policies import fullest_fitting
from .types import AddVersion, Evict, SliceState

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState


def places_free(sched: SchedulerState, sl: SliceState) -> int:
    """Versions the slice could still take without evicting one."""
    return sched.config.versions_per_slice - len(sl.held) - len(sl.adding)


def evictable(sl: SliceState, version: int) -> bool:
    """Resident and unused on the slice: nothing of it runs or migrates there."""
    return version in sl.held and not sl.in_use.get(version)


def add_version(sched: SchedulerState, slice_id: int, version: int) -> AddVersion:
    sl = sched.slices[slice_id]
    assert sched.multi and sl.loading is None, "AddVersion needs a multi-version slice"
    assert version not in sl.held and version not in sl.adding
    assert places_free(sched, sl) > 0, f"slice {slice_id} has no free place"
    assert version <= sched.published, "AddVersion loads a published version"
    sl.adding.add(version)
    return AddVersion(slice_id, version)


def evict(sched: SchedulerState, slice_id: int, version: int) -> Evict:
    sl = sched.slices[slice_id]
    assert evictable(sl, version), f"slice {slice_id} still uses v{version}"
    sl.held.discard(version)
    sl.version = max(sl.held) if sl.held else None
    return Evict(slice_id, version)


def assign_resident(sched: SchedulerState,
                    slice_ok: Callable[[SliceState], bool] = lambda sl: True) -> list:
    """`policies.assign_pending` for multi-version slices: pending samples, oldest
    version then oldest group first, each to a slice holding its group's version,
    a group's samples to one slice where they all fit (`policies.fullest_fitting`),
    else as many as fit on the emptiest, the rest to the next. Free slots are shared
    by a slice's versions, so they are counted per slice."""
    if not sched.has_pending():
        return []
    free = {}
    for sl in sched.slices:
        n = sched.free_slots(sl)
        if n > 0 and sl.loading is None and sl.held and slice_ok(sl):
            free[sl.slice_id] = n
    acts = []
    for v in sched.pending_versions():
        cands = [i for i in free if free[i] > 0 and v in sched.slices[i].held]
        cur = None  # (group id, slice id)
        for g, k in sched.pending_of_version(v):
            if cur is None or cur[0] != g.group_id or free[cur[1]] == 0:
                cands = [i for i in cands if free[i] > 0]
                if not cands:
                    break
                order = sorted((free[i], i) for i in cands)
                cur = (g.group_id, order[fullest_fitting(order, g.n_pending)][1])
            acts.append(sched.do_assign(g.group_id, k, cur[1]))
            free[cur[1]] -= 1
    return acts


def check(sched: SchedulerState, req) -> None:
    """The residency invariants: at most V versions held or being added per slice,
    none twice; `version` the newest held; `in_use` agrees with the running requests;
    every running request's group version resident on its slice (C1 modes); with
    V = 1 `held` is {version}."""
    V = sched.config.versions_per_slice
    for sl in sched.slices:
        i = sl.slice_id
        if not sched.multi:
            req(sl.held == ({sl.version} if sl.version is not None else set())
                and not sl.adding, f"slice {i}: one version per slice, holds {sl.held}")
        req(len(sl.held) + len(sl.adding) <= V and not sl.held & sl.adding,
            f"slice {i} holds {sorted(sl.held)} and adds {sorted(sl.adding)}: over V={V}")
        req(sl.version == (max(sl.held) if sl.held else None),
            f"slice {i}: version {sl.version} is not its newest of {sorted(sl.held)}")
        counts: dict[int, int] = {}
        for gid, _ in sl.running:
            v = sched.groups[gid].version
            counts[v] = counts.get(v, 0) + 1
        req(counts == {v: n for v, n in sl.in_use.items() if n},
            f"slice {i}: in-use counts drifted")
        if sched.multi and sched.caps.keeps_c1:
            req(set(counts) <= sl.held and sl.loading is None,
                f"C1: slice {i} holds {sorted(sl.held)} but runs versions {sorted(counts)}")
