"""partial_rollout (AReaL / slime style) as a scheduling policy, under the same
staleness bound K as DORA.

On every publish each slice interrupts, reloads the newest version and continues
its requests under it: C1 deliberately broken, recorded per token. Every slice holds
the newest version, so a pending sample of an older group starts on it too. The
staleness of a group is counted from its admission version, at or below every one
of its tokens' versions; it is bounded in the manner of AReaL's admission control
by DORA's own rules (dora.py): RBS x G samples in flight, a group admitted only
for free slots and only while the backlog stays FEASIBLE for K (with DORA's step
in reserve), and the TBS oldest finished groups are trained unless a deadline
needs the trainer to wait for an older group. So the comparison with `dora` at the
same K is like for like: both bound staleness, and this mode pays its re-prefills.

partial_rollout_rounds is the round-synchronous kind, the baseline users meet in
the paper's figures (its trainer idles about half the step): trainer and rollout
alternate. A round runs while the trainer is idle: every slice holds the published
version P, groups are admitted at P as above but up to RBS unconsumed, and pending
samples go to any slice. The round ends when a batch can be formed (the same guarded
batch); while that step trains the rollout pauses: each slice is told to load P+1,
the version in training, which the driver defers until it is published (a slice
with requests is interrupted and re-prefills them under P+1 then; core.py). Nothing
is admitted or assigned meanwhile, and unfinished samples carry over to the next
round with their per-token versions. Staleness is bounded exactly as above.
"""

from __future__ import annotations

from .feasibility import (
    admission_feasible,
    admission_reserve,
    check_feasible,
    form_guarded_batch,
    in_flight_room,
)
from .policies import Policy, assign_pending


def admit_at_published(sched, room: int) -> list:
    """Admissions at P, at most `room`, each for G free slots of any slice (versions
    do not matter here), while the backlog stays FEASIBLE with DORA's reserve."""
    cfg = sched.config
    counts = sched.unconsumed_by_version()
    p, t = sched.published, sched.next_step
    reserve = admission_reserve(cfg.max_staleness)
    free = sum(sched.free_slots(sl) for sl in sched.slices if sl.version is not None) \
        - sum(sched.pending_by_version().values())
    acts = []
    for _ in range(room):
        if free <= 0 or not admission_feasible(counts, p, t, reserve, cfg.train_batch_size):
            break
        acts.append(sched.do_admit(p))
        counts[p] += 1
        free -= cfg.group_size
    return acts


def move_slices_to(sched, version: int) -> list:
    """Every slice not holding `version` loads it, an occupied one keeping its
    requests to re-prefill under it; a slice loading (an earlier target) finishes
    first and moves on in a later pass."""
    acts = []
    for sl in sched.slices:
        if sl.loading is None and sl.version != version:
            if sl.running:
                acts.append(sched.do_interrupt_reload(sl.slice_id, version))
            else:
                acts.append(sched.do_load(sl.slice_id, version))
    return acts


class PartialRolloutPolicy(Policy):
    """Interrupt-and-reload rollout at the newest version, staleness bounded by K."""

    name = "partial_rollout"

    def plan(self, sched):
        acts = form_guarded_batch(sched)
        acts += move_slices_to(sched, sched.published)
        acts += admit_at_published(sched, self.admission_room(sched))
        acts += assign_pending(sched, match_version=False)
        return acts

    def admission_room(self, sched) -> int:
        return in_flight_room(sched)

    def check(self, sched, req):
        check_feasible(sched, req)


class RoundPartialRolloutPolicy(Policy):
    """Round-synchronous partial rollout (see the module docstring): rounds at the
    published version alternate with train steps, during which every slice pauses
    to load the version in training; staleness bounded by K."""

    name = "partial_rollout_rounds"

    def plan(self, sched):
        acts = form_guarded_batch(sched)
        # Idle trainer: the round runs at P. Busy trainer: the slices pause for P+1.
        acts += move_slices_to(sched, sched.published + sched.trainer_busy)
        if sched.trainer_busy:
            return acts  # no admission and no assignment while the trainer trains
        acts += admit_at_published(sched, self.admission_room(sched))
        acts += assign_pending(sched, match_version=False)
        return acts

    def check(self, sched, req):
        req(len(sched.groups) <= sched.config.rollout_batch_size, "rounds: more than RBS in flight")
        check_feasible(sched, req)
