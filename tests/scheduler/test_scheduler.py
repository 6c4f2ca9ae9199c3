"""Deterministic example tests of the scheduling core (dora_jax.scheduler)."""

import dataclasses

import pytest
from _fake_run import FakeRun, lengths_from_seed

from dora_jax.scheduler import (
    MODES,
    Admit,
    Assign,
    InterruptReload,
    LoadVersion,
    Scheduler,
    SchedulerConfig,
    TrainStep,
    policy_for,
)


def config(mode="dora", **kw):
    base = dict(mode=mode, num_slices=4, slots_per_slice=4, group_size=4,
                train_batch_size=4, rollout_batch_size=8, max_staleness=2)
    return SchedulerConfig(**{**base, **kw})


def long_tail(g, k):
    # One straggler per group of four: what makes synchronous RL wait.
    return 120 if (g % 4 == 0 and k == 0) else 6


@pytest.mark.parametrize("field,value", [
    ("mode", "async"), ("num_slices", 0), ("slots_per_slice", 0), ("group_size", 0),
    ("group_size", 17), ("train_batch_size", 0), ("rollout_batch_size", 3),
    ("max_staleness", -1), ("max_groups", -1), ("episodes_per_slice", 3),
])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        config(**{field: value})


def test_episodes_that_give_up_their_slot_raise_a_slice_s_capacity():
    """With episodes_per_slice, a slice holds that many samples (the slice runs as many
    as it has slots; the others are at their environments or wait for a slot)."""
    for episodes, running, free in ((0, 4, 0), (10, 8, 2)):  # 4 groups of 2 admitted
        sched = Scheduler(config("sync", episodes_per_slice=episodes, rollout_batch_size=4,
                                 train_batch_size=4, group_size=2, num_slices=1))
        sched.decide()
        assert len(sched.slices[0].running) == running
        assert sched.free_slots(sched.slices[0]) == free


def test_the_view_of_a_run_config_is_checked_as_a_config_built_directly(load_config):
    cfg = load_config("configs/tiny.py:spread")
    view = SchedulerConfig.from_config(cfg, max_groups=3)
    assert view == SchedulerConfig(**dataclasses.asdict(view))
    with pytest.raises(ValueError, match="max_groups must be >= 0 or None, got -1"):
        SchedulerConfig.from_config(cfg, max_groups=-1)
    # Values that never passed the run config's validation fail by the same rules.
    object.__setattr__(cfg.coordinator, "rollout_batch_size", cfg.coordinator.train_batch_size - 1)
    with pytest.raises(ValueError, match="config.coordinator.rollout_batch_size: must be >="):
        SchedulerConfig.from_config(cfg)


def test_sync_api_walkthrough():
    """The event/decide protocol on the smallest sync run, action by action."""
    s = Scheduler(config("sync", num_slices=1, slots_per_slice=2, group_size=2,
                         train_batch_size=1, rollout_batch_size=1))
    assert s.decide() == [Admit(0, 0), Assign(0, 0, 0, 0), Assign(0, 1, 0, 0)]
    assert s.decide() == []
    s.sample_finished(0, 0, num_tokens=5)
    assert s.decide() == []
    s.sample_finished(0, 1)
    assert s.decide() == [TrainStep(0, (0,))]
    s.step_finished(0)
    assert s.decide() == [LoadVersion(0, 1), Admit(1, 1)]
    s.version_loaded(0, 1)
    assert s.decide() == [Assign(1, 0, 0, 1), Assign(1, 1, 0, 1)]
    s.check_invariants()


def test_event_validation():
    s = Scheduler(config("sync"))
    s.decide()
    with pytest.raises(ValueError):
        s.sample_finished(99, 0)
    with pytest.raises(ValueError):
        s.step_finished(0)  # no step running
    with pytest.raises(ValueError):
        s.version_loaded(0, 0)  # not loading
    s.sample_finished(0, 0)
    with pytest.raises(ValueError):
        s.sample_finished(0, 0)  # already finished


@pytest.mark.parametrize("mode", MODES)
def test_decide_is_idempotent(mode):
    run = FakeRun(config(mode), lengths_from_seed(3, "long_tail", 80), load_ticks=2,
                  train_ticks=7)
    decide = run.sched.decide
    calls = []

    def twice():
        out = decide()
        calls.append(len(out))
        assert decide() == []
        return out

    run.sched.decide = twice
    run.run(6)
    assert sum(calls) > 0


def test_sync_trains_on_policy_and_one_step_off_one_behind():
    for mode, lag in (("sync", lambda t: t), ("one_step_off", lambda t: max(t - 1, 0))):
        run = FakeRun(config(mode), long_tail, load_ticks=3, train_ticks=10)
        run.run(6)
        for rec in (r for r in run.ledger if r["event"] == "consume"):
            assert rec["version"] == lag(rec["step"]), (mode, rec)
            assert rec["group_id"] // 4 == rec["step"]


@pytest.mark.parametrize("seed", range(4))
def test_dora_k0_equals_sync(seed):
    lengths = lengths_from_seed(seed, "long_tail", 90)
    runs = {m: FakeRun(config(m, max_staleness=0), lengths, load_ticks=2, train_ticks=9)
            for m in ("sync", "dora")}
    for r in runs.values():
        r.run(8)
    assert runs["dora"].consumed() == runs["sync"].consumed()
    assert runs["dora"].consumed()[7] == list(range(28, 32))


def test_dora_waits_less_than_sync_on_long_tail():
    stats = {}
    for mode in ("sync", "one_step_off", "dora"):
        run = FakeRun(config(mode, rollout_batch_size=12), long_tail, load_ticks=2,
                      train_ticks=15)
        stats[mode] = run.run(12)
    assert stats["dora"]["trainer_wait_ticks"] < stats["sync"]["trainer_wait_ticks"]
    assert stats["dora"]["ticks"] < stats["sync"]["ticks"]
    assert stats["dora"]["max_staleness"] <= 2
    assert stats["dora"]["max_resident_versions"] <= 3


def test_partial_rollout_trajectory_crossing_a_publish_mixes_versions():
    # Group 0 finishes at once and is trained while group 1 (50 tokens) is still
    # decoding, so group 1 must continue under version 1 after the interrupt.
    cfg = config("partial_rollout", num_slices=1, slots_per_slice=2, group_size=1,
                 train_batch_size=1, rollout_batch_size=2, max_staleness=1)
    run = FakeRun(cfg, lambda g, k: 1 if g == 0 else 50, load_ticks=1, train_ticks=2)
    run.run(2)
    rec = next(r for r in run.ledger if r["event"] == "consume" and r["group_id"] == 1)
    versions = rec["samples"][0]["versions"]
    assert [v for v, _ in versions][:2] == [0, 1] and sum(n for _, n in versions) == 50
    assert run.stats["interrupt_reloads"] >= 1


def test_interrupt_reload_only_in_partial_rollout():
    for mode in ("sync", "one_step_off", "dora"):
        run = FakeRun(config(mode), long_tail, load_ticks=1, train_ticks=3)
        run.run(5)
        assert run.stats["interrupt_reloads"] == 0


def test_dora_drains_lazily():
    """Old-version stragglers stay where they are unless the newest version has work
    no slice can take: with 120-tick stragglers and K = 2 admission never outgrows
    the newest version's slices, so nothing migrates."""
    run = FakeRun(config("dora", num_slices=8, slots_per_slice=4, rollout_batch_size=12,
                         max_staleness=2), long_tail, load_ticks=2, train_ticks=15)
    run.run(12)
    assert run.stats["migrations"] == 0 and run.audit().ok


def test_dora_migrates_and_keeps_versions_apart():
    """With K = 3 the newest version outgrows its slices while 40-tick stragglers
    hold old ones: they are consolidated to free a slice for it, and every sample
    still has one version."""
    def stragglers(g, k):
        return 40 if (g % 4 == 0 and k == 0) else 6

    run = FakeRun(config("dora", num_slices=4, slots_per_slice=4, rollout_batch_size=12,
                         max_staleness=3), stragglers, load_ticks=2, train_ticks=8)
    run.run(12)
    assert run.stats["migrations"] > 0
    for rec in (r for r in run.ledger if r["event"] == "consume"):
        for smp in rec["samples"]:
            assert smp["versions"] == [[rec["version"], smp["response_len"]]]


def test_every_slice_failing_mid_run_regenerates_in_flight_samples_once():
    run = FakeRun(config("dora"), long_tail, load_ticks=2, train_ticks=5)
    run.start()
    for _ in range(10):
        run.advance()
    in_flight = sum(len(sl.running) for sl in run.sched.slices)
    assert in_flight > 0
    for i in range(len(run.slices)):
        run.fail_slice(i)
    run.run(6)
    ids = [r["group_id"] for r in run.ledger if r["event"] == "consume"]
    assert len(ids) == len(set(ids))


def test_interrupt_reload_action_shape():
    s = Scheduler(config("partial_rollout", num_slices=1, slots_per_slice=2, group_size=1,
                         train_batch_size=1, rollout_batch_size=2, max_staleness=3))
    acts = s.decide()
    assert acts == [Admit(0, 0), Admit(1, 0), Assign(0, 0, 0, 0), Assign(1, 0, 0, 0)]
    s.sample_finished(0, 0)
    assert s.decide() == [TrainStep(0, (0,)), Admit(2, 0), Assign(2, 0, 0, 0)]
    s.step_finished(0)
    assert s.decide() == [InterruptReload(0, 1)]  # RBS groups already in flight
    s.version_loaded(0, 1)
    s.check_invariants()
    assert s.groups[1].samples[0].versions == [0, 1]


@pytest.mark.parametrize("mode", MODES)
def test_fake_ledger_passes_the_project_auditor(mode):
    """FakeRun writes the ledger format of dora_jax.scheduler.ledger, so the same
    external auditor checks it: C2, C3 and batch size hold in every mode; C1 in all
    but the partial rollouts, which break it by design on this long-tailed workload."""
    from dora_jax.scheduler import ledger

    cfg = config(mode, rollout_batch_size=12)
    run = FakeRun(cfg, long_tail, load_ticks=2, train_ticks=15)
    run.run(8)
    rep = ledger.audit(run.ledger + run.unconsumed_records(), train_batch_size=4,
                       group_size=4, max_staleness=policy_for(mode).staleness_bound(cfg))
    assert not (rep.c2 or rep.c3 or rep.batch_size), rep.summary()
    assert run.audit().ok  # the driver's own audit applies the mode's C1 rule
    assert bool(rep.c1) == (not policy_for(mode).keeps_c1), rep.summary()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_partial_rollout_is_bounded_by_max_staleness(k):
    """partial_rollout under DORA's bound: stragglers (120 tokens among 6) make the
    trainer wait rather than consume a group later than step version + K, while the
    reloads still mix versions inside trajectories."""
    cfg = config("partial_rollout", rollout_batch_size=16, max_staleness=k)
    run = FakeRun(cfg, long_tail, load_ticks=2, train_ticks=5)
    summary = run.run(12)
    assert run.audit().ok
    assert summary["max_staleness"] == k  # reached, never exceeded
    mixed = [s for r in run.ledger if r["event"] == "consume" for s in r["samples"]
             if len(s["versions"]) > 1]
    assert mixed and run.stats["interrupt_reloads"] > 0


@pytest.mark.parametrize("mode", ["dora", "partial_rollout"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_staleness_guard_holds_by_the_ledger_alone(mode, k):
    """The staleness guard (batch formation) seen from outside: with the scheduler's
    own invariant checks off, the project's auditor finds every group consumed within
    K steps of its version, and stragglers (120 tokens among 6) make the bound reached."""
    cfg = config(mode, rollout_batch_size=16, max_staleness=k)
    run = FakeRun(cfg, long_tail, load_ticks=2, train_ticks=5, check=False)
    summary = run.run(12)
    report = run.audit()
    assert report.ok, report.summary() + str(report.c3[:2])
    assert max(report.staleness) == summary["max_staleness"] == k


def test_kv_reports_bound_assignments_by_hand():
    """A slice with a paged KV cache takes no more samples than its reported free
    positions allow (admit_tokens each), reserving them as it assigns; a slice that
    holds nothing is bounded by its slots only."""
    sched = Scheduler(config(num_slices=1, group_size=2, train_batch_size=2,
                             rollout_batch_size=4, max_staleness=1, admit_tokens=10))
    first = [a for a in sched.decide() if isinstance(a, Assign)]
    assert len(first) == 4 and sched.free_slots(sched.slices[0]) == 0  # slots full
    g, k = first[0].group_id, first[0].sample
    sched.sample_finished(g, k, 5)
    sched.kv_reported(0, 12)  # room for one more (12 // 10)
    assert sched.free_slots(sched.slices[0]) == 1
    more = [a for a in sched.decide() if isinstance(a, Assign)]
    assert len(more) == 1 and sched.slices[0].kv_free == 2  # 10 reserved
    g, k = first[1].group_id, first[1].sample
    sched.sample_finished(g, k, 5)
    sched.kv_reported(0, 9)  # a slot is free, memory is not
    assert sched.free_slots(sched.slices[0]) == 0
    assert not [a for a in sched.decide() if isinstance(a, Assign)]
    assert sched.has_pending()
    for a in first[2:] + more:
        sched.sample_finished(a.group_id, a.sample, 5)
    sched.kv_reported(0, -40)  # reported by a slice that holds nothing: ignored
    assert sched.slices[0].kv_free is None and sched.free_slots(sched.slices[0]) == 4


def test_dora_admits_for_the_slices_loading_the_new_version():
    """After step 1 is taken, two slices drain and load version 1; the two groups
    the freed room admits go to version 1, for them, not to version 0 (whose two
    remaining slices are full: its samples would queue while the new slices idle).
    K = 3: admission keeps a step in reserve, so it admits as K = 2 would."""
    sched = Scheduler(config(num_slices=4, slots_per_slice=2, group_size=2,
                             train_batch_size=2, rollout_batch_size=4, max_staleness=3))
    sched.decide()
    for g in (0, 1):
        for k in (0, 1):
            sched.sample_finished(g, k, 5)
    sched.decide()
    sched.step_finished(0)
    sched.decide()
    for g in (2, 3):
        for k in (0, 1):
            sched.sample_finished(g, k, 5)
    acts = sched.decide()
    assert [a for a in acts if isinstance(a, LoadVersion)] == [LoadVersion(2, 1),
                                                               LoadVersion(3, 1)]
    assert [a for a in acts if isinstance(a, Admit)] == [Admit(6, 1), Admit(7, 1)]
    assert sched.pending_by_version()[0] == 0


def test_a_group_goes_to_the_fullest_slice_that_holds_it_whole():
    """Two slices of 8 slots, groups of 4: the second group joins the first on slice 0
    (one generate call with every slot busy) rather than half-filling slice 1. Groups
    of 3 on slices of 4 with one slot left: a group that fits nowhere whole goes to
    the emptiest slice, the rest to the next."""
    s = Scheduler(config(num_slices=2, slots_per_slice=8, group_size=4, train_batch_size=1,
                         rollout_batch_size=2))
    placed = {(a.group_id, a.slice_id) for a in s.decide() if isinstance(a, Assign)}
    assert placed == {(0, 0), (1, 0)}
    lists = [(1, 0), (1, 1), (4, 2)]
    from dora_jax.scheduler.policies import fullest_fitting

    assert lists[fullest_fitting(lists, 3)] == (4, 2)
    assert lists[fullest_fitting(lists, 1)] == (1, 0)
    assert lists[fullest_fitting(lists, 5)] == (4, 2)  # none holds 5: the emptiest
    tied = [(2, 3), (2, 5)]
    assert tied[fullest_fitting(tied, 4)] == (2, 3)  # lowest id on ties


def test_a_resumed_scheduler_builds_its_own_state_and_counters():
    """`Scheduler.resumed`: published version on every slice, kept groups finished
    and trainable, lost groups readmitted (in order) before new ones; its counters
    agree with the groups (check_invariants) and the run goes on to train."""
    cfg = config("dora", group_size=2, train_batch_size=2, rollout_batch_size=4)
    sched = Scheduler.resumed(cfg, published=3, next_group_id=9, filtered=2,
                              kept={5: 2, 7: 3}, readmit=(6, 8))
    assert (sched.published, sched.next_step, sched.trainer_step) == (3, 3, None)
    assert [sl.version for sl in sched.slices] == [3] * cfg.num_slices
    assert sched.filtered == 2 and sched.trainable_group_ids() == {5, 7}
    assert sched.unconsumed_by_version() == {2: 1, 3: 1}
    assert not sched.has_pending() and sched.num_unfinished_samples == 0
    acts = sched.decide()
    sched.check_invariants()
    admits = [a for a in acts if isinstance(a, Admit)]
    assert [(a.group_id, a.readmit) for a in admits[:2]] == [(6, True), (8, True)]
    assert all(not a.readmit and a.group_id >= 9 for a in admits[2:])
    assert [a.group_ids for a in acts if isinstance(a, TrainStep)] == [(5, 7)]


@pytest.mark.parametrize("mode", MODES)
def test_the_per_version_counts_hold_only_the_versions_in_flight(mode):
    """A version with nothing left leaves the counts, so that the queries walking them
    (asked at every decision) cost the few versions in flight, not the run's length."""
    run = FakeRun(config(mode), long_tail, load_ticks=2, train_ticks=9)
    run.run(40)
    sched = run.sched
    in_flight = {g.version for g in sched.groups.values()}
    for counts in (sched.unconsumed_by_version(), sched.unfinished_by_version(),
                   sched.pending_by_version()):
        assert set(counts) <= in_flight and all(n > 0 for n in counts.values()), counts
    assert len(in_flight) <= config(mode).max_staleness + 2
    sched.check_invariants()


def test_only_the_core_touches_the_scheduler_s_private_fields():
    """The per-version counters, pending queues and helpers that keep the invariants
    are read and written in the Scheduler's own modules alone: scheduler/state.py
    (the state and its mutators, Scheduler's base class) and scheduler/core.py.
    Elsewhere (package and tests) no object but `self` has them looked up."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    owners = [root / "dora_jax" / "scheduler" / name for name in ("state.py", "core.py")]
    private = set()
    for owner in owners:
        for node in ast.walk(ast.parse(owner.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and ast.unparse(node.value) == "self":
                private.add(node.attr)
            elif isinstance(node, ast.FunctionDef) and node.name.startswith("_") \
                    and not node.name.startswith("__"):
                private.add(node.name)
    assert {"_pending_v", "_pending_q", "_trainable", "_leave", "_recount"} <= private
    found = []
    for path in [*root.glob("dora_jax/**/*.py"), *root.glob("tests/**/*.py")]:
        if path in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in private
                    and ast.unparse(node.value) not in ("self", "cls")):
                found.append(f"{path.relative_to(root)}:{node.lineno} "
                             f"{ast.unparse(node)}")
    assert not found, found
