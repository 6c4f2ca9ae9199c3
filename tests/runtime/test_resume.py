"""Resume after a crash, on the pure scheduling core: the ledger contract over any
number of crashes (hand-written ledgers), and a property test that crashes the fake
driver at random points after random checkpoints, resumes it with the runtime's own
restore code (runtime/recovery.py's plan and resumed scheduler, the GroupBook's
checkpoint form of the kept groups, through JSON, and its restore), checks every
trained sample's content and reward, and audits the whole ledger, in every mode."""

import concurrent.futures
import json
import random

import numpy as np
from _fake_run import FakeRun, _Request, lengths_from_seed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora_jax.base import versions
from dora_jax.rollout.trajectory import Trajectory
from dora_jax.runtime import recovery
from dora_jax.runtime.groups import GroupBook
from dora_jax.scheduler import MODES, POLICIES, SchedulerConfig, ledger


def _admit(g, v, **kw):
    return dict(event="admit", group_id=g, prompt_id=f"p{g}", version=v, **kw)


def _consume(g, v, step):
    return dict(event="consume", group_id=g, prompt_id=f"p{g}", version=v, step=step,
                samples=[dict(sample=0, versions=[[v, 3]], response_len=3, finish="eos",
                              slices=[0])])


def _audit(events):
    return ledger.audit(events, train_batch_size=1, group_size=1, max_staleness=1)


def test_resume_voids_lost_training_and_counts_the_latest_admission():
    # Steps 0 and 1 trained; the crash loses step 1 (checkpoint at version 1): its
    # consume is void, group 1 is regenerated at v1 and consumed again by step 1.
    events = [_admit(0, 0), _admit(1, 0), _consume(0, 0, 0), _admit(2, 1), _consume(1, 0, 1),
              dict(event="unconsumed", group_id=2, version=1),
              dict(event="resume", step=1), _admit(1, 1, readmit=True),
              _admit(2, 1, readmit=True), _consume(1, 1, 1), _consume(2, 1, 2)]
    report = _audit(events)
    assert report.ok, report.summary() + str(report.c2)
    assert report.steps == 3
    # Without the resume line, the same file is a double consumption of group 1.
    no_resume = [e for e in events if e["event"] != "resume"]
    assert any("consumed 2 times" in m for m in _audit(no_resume).c2)
    # A group left out of the resumed run is lost, and C3 is checked against the
    # latest admission (group 1 at v0 consumed by step 2 would be too stale).
    lost = events[:-2] + [_consume(1, 1, 1)]
    assert any("group 2 admitted but neither" in m for m in _audit(lost).c2)
    stale = events[:-3] + [_consume(1, 1, 2), _consume(2, 1, 1)]
    assert _audit(stale).ok  # v1 at step 2: staleness 1
    readmit_at_old = events[:7] + [_admit(1, 0, readmit=True), _admit(2, 1, readmit=True),
                                   _consume(2, 1, 1), _consume(1, 0, 2)]
    assert any("group 1" in m for m in _audit(readmit_at_old).c3)


def test_plan_keeps_finished_groups_and_regenerates_the_rest():
    events = [_admit(g, 0) for g in range(4)] + [_consume(0, 0, 0)] + [
        _admit(4, 1), dict(event="filter", group_id=3, reason="zero reward variance"),
        _consume(1, 0, 1), _admit(5, 2)]
    # Checkpoint at version 1 (step 0 trained), taken when groups 1 and 2 were
    # finished and 3 still running; 4 and 5 were admitted after it.
    # A prompt left out before admission (no group) is no group to plan for.
    events.insert(0, dict(event="filter", prompt_id="p9", time=0.0, reason="too long"))
    p = recovery.plan(events, 1, {1: 0, 2: 0}, checkpoint_next_group_id=4)
    assert (p.step, p.kept, p.readmit) == (1, (1, 2), (4, 5))
    assert p.next_group_id == 6 and p.admitted_since_checkpoint == 2
    assert p.prompt_ids == {1: "p1", 2: "p2", 4: "p4", 5: "p5"}
    # The run before: step 0 stands (step 1's consume is voided), group 3 filtered.
    assert [(x["from_step"], x["steps"]) for x in p.segments] == [(0, 1)]
    assert p.filtered == 1
    cfg = SchedulerConfig(mode="dora", num_slices=2, slots_per_slice=2, group_size=1,
                          train_batch_size=1, rollout_batch_size=3, max_staleness=3)
    sched = recovery.scheduler_for(cfg, p, {1: 0, 2: 0})
    assert sched.filtered == 1  # the run's count goes on
    admits = [a for a in sched.decide() if type(a).__name__ == "Admit"]
    # With the 2 kept groups unconsumed, FEASIBILITY at step 1 (admitting with one
    # step of K in reserve: 3 unconsumed) leaves room for one, the first lost group.
    assert [(a.group_id, a.version, a.readmit) for a in admits] == [(4, 1, True)]
    sched.check_invariants()


def _reward(response: list) -> float:
    """The fake reward of a response (never 0: a zeroed restore shows)."""
    return 0.25 * (1 + sum(response) % 5)


def _tokens(gid: int, k: int, n: int) -> list:
    return [(gid + 7 * k + i) % 13 for i in range(n)]


def _routing(gid: int, k: int, n: int) -> np.ndarray:
    """An MoE rollout's record [n, 2 layers, top-2] a function of the sample and the
    token's index, the last token unrecorded (rollout/routing.py)."""
    i = np.arange(n)[:, None, None]
    ids = (gid + 3 * k + i + np.arange(2)[None, :, None] + 5 * np.arange(2)) % 8
    ids = ids.astype(np.uint8)
    ids[-1:] = 255
    return ids


class _CheckpointingRun(FakeRun):
    """Keeps each group's host side in the runtime's own `GroupBook` (finished
    samples as Trajectories, rewards) and records, after every finished step, what a
    checkpoint of that moment holds: the book's `checkpoint_form` of the finished
    groups, through JSON as on disk. Consume lines carry the book's rewards, and
    every consumed sample is checked against what its group and sample produced."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checkpoints = []
        self.book = GroupBook(None, _Rewards(), write=lambda *a, **kw: None, clock=lambda: 0.0)

    def admit(self, a):
        super().admit(a)
        self.book.admit(a, {"prompt_id": a.group_id, "tokens": [1]})

    def _deliver(self, ev):
        released = super()._deliver(ev)
        if ev[0] == "finished":
            gid, k = ev[2]
            r = self.done[(gid, k)]
            self.book.finished([Trajectory(
                group_id=gid, prompt_id=gid, sample_index=k, version=self.group_version[gid],
                prompt_tokens=[1], response_tokens=_tokens(gid, k, r.length),
                behaviour_logprobs=[-0.5 - i / 8 for i in range(r.length)],
                versions=[list(s) for s in r.segments], slice_ids=list(r.slices),
                finish_reason="eos", t_submit=0.0, t_start=0.0, t_finish=float(self.tick),
                routing=_routing(gid, k, r.length))])
        if ev[0] == "step":
            s = self.sched
            finished = [g for g, gs in s.groups.items() if gs.trainable]
            form = json.loads(json.dumps(self.book.checkpoint_form(finished)))
            self.checkpoints.append((ev[1] + 1, form, s.next_group_id))
        return released

    def _record_consume(self, gid, step):
        super()._record_consume(gid, step)
        line, g = self.ledger[-1], self.book.groups.pop(gid)
        for entry, t in zip(line["samples"], g.samples()):
            k, n = t.sample_index, len(t.response_tokens)
            assert (entry["sample"], entry["response_len"]) == (k, n), (gid, k)
            assert t.response_tokens == _tokens(gid, k, n) and t.group_id == gid
            # The MoE record, through a checkpoint and a resume: neither lost nor shifted.
            np.testing.assert_array_equal(t.routing, _routing(gid, k, n), err_msg=f"{gid, k}")
            assert versions.encode(t.versions) == entry["versions"], (gid, k)
            assert t.version == line["version"], (gid, k)
            entry["reward"], error = g.rewards[k].result()
            assert entry["reward"] == _reward(t.response_tokens) and error is None, (gid, k)


class _Rewards:
    """The reward pool's interface (`submit_many`), scoring at once."""

    def submit_many(self, items):
        done = [concurrent.futures.Future() for _ in items]
        for future, (_, response) in zip(done, items):
            future.set_result((_reward(response), None))
        return done


def _resumed_run(old: FakeRun, checkpoint, lengths, **kw) -> FakeRun:
    """The fake driver restarted from `checkpoint` after a crash now, as the runtime
    restarts: `recovery.plan` and `recovery.scheduler_for`, the ledger's resume line,
    and the kept groups taken back by `GroupBook.restore`; the fake engine's record
    of their finished samples is rebuilt from the restored trajectories."""
    step, form, next_id = checkpoint
    cfg = old.config
    kept = {int(g): d for g, d in form.items()}
    finished = {g: d["version"] for g, d in kept.items()}
    p = recovery.plan(old.ledger, step, finished, next_id)
    run = _CheckpointingRun(cfg, lengths, **kw)
    run.checkpoints = list(old.checkpoints)  # still on disk
    run.sched = recovery.scheduler_for(cfg, p, finished)
    for sl in run.slices:
        sl.version, sl.held = step, {step}
    run.ledger = list(old.ledger) + [dict(event="resume", step=step, time=0)]
    run.book.restore({g: kept[g] for g in p.kept})
    for g in p.kept:
        run.group_version[g] = run.book[g].version
        for t in run.book[g].samples():
            n = len(t.response_tokens)
            run.done[(g, t.sample_index)] = _Request(g, t.sample_index, n, produced=n,
                                                     segments=t.versions, slices=t.slice_ids)
    run.steps_done = step
    return run


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([m for m in MODES if POLICIES[m].resumable]), st.integers(1, 4),
       st.integers(1, 3), st.integers(1, 3), st.integers(0, 2), st.integers(0, 2**16),
       st.integers(1, 3))
def test_crashes_at_random_points_lose_and_duplicate_nothing(mode, slices, G, tbs, extra,
                                                              seed, crashes):
    cfg = SchedulerConfig(mode=mode, num_slices=slices, slots_per_slice=3, group_size=G,
                          train_batch_size=tbs, rollout_batch_size=tbs + extra,
                          max_staleness=2)
    if G > slices * 3:
        return
    lengths = lengths_from_seed(seed, "long_tail", 20)
    rng = random.Random(seed)
    steps = 6
    run = _CheckpointingRun(cfg, lengths)
    run.start()
    for _ in range(crashes):
        for _ in range(rng.randint(1, 40)):  # crash after a random number of events
            if run.steps_done >= steps:
                break
            run.advance()
        # The newest checkpoint written before the crash (or the start: version 0).
        checkpoint = run.checkpoints[-1] if run.checkpoints else (0, {}, 0)
        run = _resumed_run(run, checkpoint, lengths)
        run.start()
    while run.steps_done < steps:
        run.advance()
    report = run.audit()
    assert report.ok, report.summary() + str(report.c1[:2] + report.c2[:3] + report.c3[:2])
    assert report.steps >= steps
