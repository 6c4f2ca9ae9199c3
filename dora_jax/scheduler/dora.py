"""DORA: multi-version streaming rollout as a scheduling policy.

Notation: P = newest published version, t = `Scheduler.next_step` (the next train
step to run), K = max_staleness, U(<=w) = unconsumed groups of version <= w.

The whole mode rests on one invariant, FEASIBILITY, kept at admission and at batch
formation (feasibility.py, shared with the multi-version and partial modes).

Choices made where the design leaves room:
* A freed slice loads the newest published version P, unless P has nothing for it
  (no pending samples beyond its slices' free slots and no admission room) while
  an older version in the window has pending samples its slices cannot take: then
  it loads that version, the one with the most such samples (without it, slices
  sit idle at P while an old version's backlog queues on the few slices it kept).
  The runtime keeps the params of every version a slice holds, for this. A version
  with unfinished samples always keeps at least one serving slice (liveness: its
  work is never stranded); one that lost its last slice (a slice failed) gets the
  next freed slice.
* Drain lazily. A version's slices beyond its target are released only as far as
  other work needs them: the slices' worth of pending samples (and admission room
  at P) that no serving or loading slice can take. Consolidating stragglers for its
  own sake costs twice: each remaining step of a straggler runs beside more
  sequences and more context (slower), and the freed slice has nothing to run.
  The deadline version (w + K <= t: the next step must train all of it) keeps
  every slice that holds its requests: the trainer waits on its slowest straggler.
* The staleness guard is applied in its general form: a batch (TBS oldest finished
  groups) is formed only if what stays unconsumed still satisfies FEASIBILITY for
  step t+1. For version t-K this is exactly the plain guard (every unconsumed
  group of version t-K is in the batch); for newer versions it stops the trainer
  from eating young groups while old ones would then miss their deadline.
* Admission is by what the rollout holds, not by what the trainer has yet to eat:
  the rollout batch is RBS x G samples in flight (admitted, not finished), so
  finished groups waiting for the trainer never stop the rollout (with RBS = TBS
  counted in unconsumed groups the next batch could only start when the last one
  was consumed: a pipeline of one). Staleness is bounded by FEASIBILITY instead,
  checked at admission with one step of K in reserve when K >= 2 (as if K were
  K - 1): the longest responses outlast a train step, and a group admitted with
  no slack makes the trainer wait for it at its deadline. A group is admitted only
  for a free slot of its version (held or being loaded): queued samples would take
  the version of their admission and wait, older and older, for a slot.
* Admission at a version older than P (newest resident version not yet P, or a
  top-up) also needs w + K > t: a group that the very next step would be forced to
  wait for is not worth starting.
* Top-up needs G idle slots at that version (a whole group starts at once).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from . import dora_multi
from .feasibility import (
    admission_feasible,
    admission_reserve,
    check_feasible,
    form_guarded_batch,
    in_flight_room,
)
from .policies import Policy, assign_pending

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState


def apportion(total: int, demand: dict, newest: int, cap: dict) -> dict:
    """Split `total` slices over versions in proportion to `demand` (largest remainder,
    integer arithmetic so it is exact and deterministic).

    Floors first: one slice per older version with demand (oldest first, nearest
    deadline), then one for `newest`. An older version never gets more than
    `cap[w]` (the slices its work can fill); whatever is left goes to `newest`."""
    tgt = dict.fromkeys(demand, 0)
    order = sorted(w for w in demand if w != newest and demand[w] > 0) + [newest]
    left = total
    for w in order:
        if left:
            tgt[w], left = 1, left - 1
    tot = sum(demand.values())
    if tot and left:
        limit = {w: cap.get(w, total) for w in order}
        for w in order:  # integer part of each proportional share
            add = min(total * demand[w] // tot - tgt[w], limit[w] - tgt[w], left)
            if add > 0:
                tgt[w], left = tgt[w] + add, left - add
        for w in sorted(order, key=lambda w: (-(total * demand[w] % tot), w)):
            if left and tgt[w] < limit[w] and tgt[w] <= total * demand[w] // tot:
                tgt[w], left = tgt[w] + 1, left - 1
    tgt[newest] += left
    return tgt


class DoraPolicy(Policy):
    """Multi-version streaming rollout with bounded staleness and slice rebalancing."""

    name = "dora"

    def plan(self, sched: SchedulerState) -> list:
        if sched.multi:  # several versions per slice: dora_multi.py
            return dora_multi.plan(sched)
        acts = form_guarded_batch(sched)
        # Groups P could still admit: demand for slices while the balance runs.
        room_p = self._room_at_newest(sched)
        balance, kept = self._balance(sched, room_p)
        acts += balance
        acts += self._admit(sched, kept)
        acts += assign_pending(sched, lambda sl: sl.slice_id in kept)
        return acts

    # -- slice versions: consolidate old versions (lazy drain), move freed slices on
    def _balance(self, sched, room_p: int):
        """Return (actions, kept): kept = serving slices that may take new requests.

        Serving slices of an old version w beyond its target, as far as unserved
        work needs them (lazy drain, module docstring), are drained: if their
        requests all fit in free slots of the kept w-slices they migrate there and
        the slice loads at once (P, or an older version with an unserved backlog:
        see the module docstring); otherwise it goes on serving its version."""
        cfg = sched.config
        p, slots = sched.published, cfg.samples_per_slice
        unfinished = sched.unfinished_by_version()
        demand = {w: n for w, n in unfinished.items() if n > 0}
        # The newest version also stands for the groups still to be admitted.
        demand[p] = demand.get(p, 0) + room_p * cfg.group_size
        cap = {w: -(-n // slots) for w, n in demand.items() if w != p}
        target = apportion(cfg.num_slices, demand, p, cap)

        acts, kept, loads = [], set(), []
        by_version = defaultdict(list)
        for sl in sched.slices:
            if sl.loading is not None:
                # A load that fell out of the window [P-K, P] is re-targeted at P.
                if sl.loading < p - cfg.max_staleness:
                    acts.append(sched.do_load(sl.slice_id, p))
            elif sl.version == p:
                kept.add(sl.slice_id)
            else:
                by_version[sl.version].append(sl)
        # Lazy drain: an old slice is released only for work that needs it, the
        # slices' worth of samples that no serving or loading slice can take.
        needed = 0
        if by_version:
            holders = kept | {sl.slice_id for sls in by_version.values() for sl in sls
                              if sl.version is not None}
            needed = sum(-(-n // slots) for n in self._unserved(sched, holders, room_p).values()
                         if n > 0)
        for w in sorted(by_version, key=lambda v: -1 if v is None else v):
            sls = by_version[w]
            n_keep = 0
            if w is not None and unfinished[w] > 0:
                n_keep = max(1, min(len(sls), target.get(w, 0)))
                n_keep = max(n_keep, len(sls) - needed)
                if w + cfg.max_staleness <= sched.next_step:
                    # The deadline version: the trainer waits for its stragglers, so
                    # they keep their slices (consolidating them would slow each one).
                    n_keep = max(n_keep, sum(bool(sl.running) for sl in sls))
            # Keep the fullest slices; the emptiest are the cheapest to drain.
            order = sorted(sls, key=lambda sl: (-len(sl.running), sl.slice_id))
            keep, drain = order[:n_keep], order[n_keep:]
            needed -= len(drain)
            kept.update(sl.slice_id for sl in keep)
            free = {sl.slice_id: sched.free_slots(sl) for sl in keep}
            drain.sort(key=lambda sl: (len(sl.running), sl.slice_id))
            for j, sl in enumerate(drain):
                reqs = sorted(sl.running)
                if len(reqs) > sum(free.values()):
                    # It cannot be emptied now, nor any fuller one: they go on serving
                    # (a slice that stops taking work to wait for its last straggler
                    # would idle for as long as that straggler runs).
                    kept.update(x.slice_id for x in drain[j:])
                    break
                for gid, k in reqs:
                    dst = max(free, key=lambda i: (free[i], -i))
                    acts.append(sched.do_migrate(gid, k, dst))
                    free[dst] -= 1
                loads.append(sl.slice_id)
        if not loads:
            return acts, kept
        unserved = self._unserved(sched, kept, room_p)
        # Slices each version holds or is loading: an old version gets a freed slice
        # only below its target, so that the next pass keeps it rather than drains it.
        count = Counter(sched.slices[i].version for i in kept)
        count.update(sl.loading for sl in sched.slices if sl.loading is not None)
        pending = sched.pending_by_version()
        for i in loads:
            # A version whose work lost its last slice (a slice failed) comes first.
            orphans = [w for w in unserved if w != p and pending[w] > 0 and not count[w]]
            behind = [w for w, n in unserved.items()
                      if w != p and n > 0 and count[w] < target.get(w, 0)]
            if orphans:
                w = min(orphans)
            else:
                w = p if unserved.get(p, 0) > 0 or not behind else max(
                    behind, key=lambda v: (unserved[v], v))
            acts.append(sched.do_load(i, w))
            unserved[w] = unserved.get(w, 0) - slots
            count[w] += 1
        return acts, kept

    @staticmethod
    def _unserved(sched, kept, room_p: int) -> dict:
        """Pending samples per version (P: with the groups it may still admit) beyond
        the free slots of its kept slices and of the slices loading it."""
        cfg = sched.config
        p, t, k = sched.published, sched.next_step, cfg.max_staleness
        need = sched.pending_by_version()  # a copy
        need[p] += room_p * cfg.group_size
        for sl in sched.slices:
            if sl.slice_id in kept:
                need[sl.version] -= sched.free_slots(sl)
            elif sl.loading is not None:
                need[sl.loading] -= cfg.samples_per_slice
        return {w: n for w, n in need.items() if w == p or w + k >= t}

    # -- admission by in-flight samples, and the staleness-aware top-up
    def _admit(self, sched, kept):
        cfg = sched.config
        p, t, k = sched.published, sched.next_step, cfg.max_staleness
        tbs, G = cfg.train_batch_size, cfg.group_size
        room = self.admission_room(sched)
        if not room:
            return []
        free: Counter[int | None] = Counter()
        for i in kept:
            free[sched.slices[i].version] += sched.free_slots(sched.slices[i])
        # Slices loading P are P's capacity already: admitting at an older resident
        # version instead would leave them idle when they come up.
        loading_p = sum(sl.loading == p for sl in sched.slices)
        free[p] += loading_p * cfg.samples_per_slice
        versions = sorted({sched.slices[i].version for i in kept} | ({p} if loading_p else set()))
        if not versions:
            return []
        counts, pend = sched.unconsumed_by_version(), sched.pending_by_version()
        reserve = admission_reserve(k)

        def ok(w):
            return (w == p or w + k > t) and admission_feasible(counts, w, t, reserve, tbs)

        def pick():
            newest = versions[-1]  # newest resident version
            if ok(newest) and free[newest] - pend[newest] > 0:
                return newest
            for w in reversed(versions[:-1]):  # top-up idle old-version slots
                if free[w] - pend[w] >= G and ok(w):
                    return w
            return None

        acts = []
        for _ in range(room):
            w = pick()
            if w is None:
                break
            acts.append(sched.do_admit(w))
            counts[w] += 1
            pend[w] += G
        return acts

    def admission_room(self, sched) -> int:
        return in_flight_room(sched)

    def _room_at_newest(self, sched) -> int:
        """Groups that could be admitted at P now: the rollout batch's room, cut to
        what FEASIBILITY (with the reserve, `_admit`) allows at the newest version."""
        cfg = sched.config
        tbs, reserve = cfg.train_batch_size, admission_reserve(cfg.max_staleness)
        feasible = tbs * (sched.published + reserve - sched.next_step + 1) - len(sched.groups)
        return max(0, min(self.admission_room(sched), feasible))

    def check(self, sched, req):
        cfg = sched.config
        k, p = cfg.max_staleness, sched.published
        req(sched.num_unfinished_samples <= cfg.rollout_batch_size * cfg.group_size,
            "dora: more than RBS x G samples in flight")
        check_feasible(sched, req)
        if sched.multi:
            return dora_multi.check(sched, req)
        lo = p - k - (0 if sched.settled else 1)  # just after a publish, before decide()
        for sl in sched.slices:
            v = sl.effective_version
            req(v is None or lo <= v <= p,
                f"dora: slice {sl.slice_id} on v{v} outside window [{lo}, {p}]")
        # A slice loading a version will serve it (a load is re-targeted only when it
        # falls out of the window, to P).
        serving = {sl.version for sl in sched.slices if sl.serving} | {
            sl.loading for sl in sched.slices if sl.loading is not None}
        for w, n in sched.unfinished_by_version().items():
            req(n <= 0 or w in serving or not sched.settled,
                f"dora: version {w} has work but no slice")
