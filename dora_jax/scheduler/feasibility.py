"""The staleness invariant that DORA's modes keep at admission and at batch formation.

Notation: P = newest published version, t = `Scheduler.next_step`, K = max_staleness,
U(<=w) = unconsumed groups of version <= w.

    FEASIBILITY: for every version w, U(<=w) <= TBS * (w + K - t + 1).

A group of version w must be consumed by step w + K at the latest (C3), and the
steps t .. w+K can consume only TBS groups each; so without it the staleness guard
would one day need more than TBS groups in one batch. With K = 0 it admits exactly
TBS groups per version, which makes `dora` with K = 0 behave like `sync`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .state import SchedulerState


def admission_feasible(counts: Counter, w: int, t: int, k: int, tbs: int) -> bool:
    """True if one more group of version w keeps FEASIBILITY (module docstring)."""
    cum = 0
    for v in sorted({v for v, c in counts.items() if c > 0} | {w}):
        cum += counts.get(v, 0)
        if v >= w and cum + 1 > tbs * (v + k - t + 1):
            return False
    return True


def admission_reserve(k: int) -> int:
    """The K that admission plans with: one step of K kept in reserve when K >= 2
    (why: dora.py's docstring, on admission)."""
    return k - 1 if k >= 2 else k


def in_flight_room(sched: SchedulerState) -> int:
    """Groups the rollout batch has room for: RBS x G samples in flight (admitted,
    not finished), in whole groups, within `config.max_groups`."""
    cfg = sched.config
    room = (cfg.rollout_batch_size * cfg.group_size - sched.num_unfinished_samples) \
        // cfg.group_size
    return min(max(room, 0), sched.admission_room(10**9))


def form_guarded_batch(sched: SchedulerState) -> list:
    """Streaming batch formation with the staleness guard: a TrainStep on the TBS oldest
    finished groups, unless what would stay unconsumed could then miss a deadline
    (FEASIBILITY for step t+1), in which case the trainer waits."""
    cfg = sched.config
    tbs, k, t = cfg.train_batch_size, cfg.max_staleness, sched.next_step
    if sched.trainer_busy or sched.num_finished_groups < tbs:
        return []
    batch = sched.finished_groups()[:tbs]  # oldest version first
    if len(batch) < tbs:
        return []
    counts = sched.unconsumed_by_version()
    taken = Counter(g.version for g in batch)
    cum = cum_taken = 0
    for v in sorted(v for v, c in counts.items() if c > 0):
        cum, cum_taken = cum + counts[v], cum_taken + taken[v]
        # What stays of versions <= v must fit in steps t+1 .. v+K.
        if cum - cum_taken > tbs * (v + k - t):
            return []  # guard: wait for older groups still generating
    return [sched.do_train([g.group_id for g in batch])]


def check_feasible(sched: SchedulerState, req) -> None:
    """The FEASIBILITY invariant holds."""
    tbs, k, t = sched.config.train_batch_size, sched.config.max_staleness, sched.next_step
    counts, cum = sched.unconsumed_by_version(), 0
    for v in sorted(v for v, c in counts.items() if c > 0):
        cum += counts[v]
        req(cum <= tbs * (v + k - t + 1), f"{sched.config.mode}: infeasible backlog at v{v}")
