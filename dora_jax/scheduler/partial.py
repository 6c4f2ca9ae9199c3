"""partial_rollout (AReaL / slime style) as a scheduling policy, under the same
staleness bound K as DORA.

On every publish each slice interrupts, reloads the newest version and continues
its requests under it: C1 deliberately broken, recorded per token. Every slice holds
the newest version, so a pending sample of an older group starts on it too. The
staleness of a group is counted from its admission version, at or below every one
of its tokens' versions; it is bounded in the manner of AReaL's admission control
by DORA's own rules (dora.py): admission only while the backlog stays FEASIBLE for
K, and the TBS oldest finished groups are trained unless a deadline needs the
trainer to wait for an older group. So the comparison with `dora` at the same K is
like for like: both bound staleness, and this mode pays its re-prefills.
"""

from __future__ import annotations

from .dora import admission_feasible, check_feasible, form_guarded_batch
from .policies import Policy, assign_pending


class PartialRolloutPolicy(Policy):
    """Interrupt-and-reload rollout at the newest version, staleness bounded by K."""

    name = "partial_rollout"
    keeps_c1 = False

    def plan(self, sched):
        cfg = sched.config
        acts = form_guarded_batch(sched)
        for sl in sched.slices:
            if sl.loading is None and sl.version != sched.published:
                if sl.running:
                    acts.append(sched.do_interrupt_reload(sl.slice_id, sched.published))
                else:
                    acts.append(sched.do_load(sl.slice_id, sched.published))
        counts = sched.unconsumed_by_version()
        p, t = sched.published, sched.next_step
        for _ in range(sched.admission_room(cfg.rollout_batch_size)):
            if not admission_feasible(counts, p, t, cfg.max_staleness, cfg.train_batch_size):
                break
            acts.append(sched.do_admit(p))
            counts[p] += 1
        acts += assign_pending(sched, match_version=False)
        return acts

    def check(self, sched, req):
        req(len(sched.groups) <= sched.config.rollout_batch_size, "partial: more than RBS in flight")
        check_feasible(sched, req)
