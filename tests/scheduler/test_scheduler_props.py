"""Property-based tests of the scheduling core: C1-C3, batch size, staleness window
and liveness, for all four modes over random shapes and sample-length workloads.

Examples are derandomized (a fixed seed): a failure reproduces on every run."""

import math

from _fake_run import FakeRun, lengths_from_seed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora_jax.scheduler import MODES, POLICIES, SchedulerConfig


@st.composite
def scenarios(draw, modes=MODES):
    mode = draw(st.sampled_from(modes))
    S = draw(st.integers(1, 6))
    slots = draw(st.integers(1, 4))
    G = draw(st.integers(1, min(5, S * slots)))
    tbs = draw(st.integers(1, 4))
    cfg = SchedulerConfig(
        mode=mode, num_slices=S, slots_per_slice=slots, group_size=G,
        train_batch_size=tbs, rollout_batch_size=draw(st.integers(tbs, tbs + 4)),
        max_staleness=draw(st.integers(0, 3)), admit_tokens=draw(st.integers(0, 8)),
        # Episodes that give up their slot at their environment: more held than slots.
        episodes_per_slice=draw(st.sampled_from([0, 0, slots, 2 * slots + 1])))
    if draw(st.booleans()):  # seeded distribution, incl. long-tailed
        max_len = draw(st.integers(1, 60))
        lengths = lengths_from_seed(draw(st.integers(0, 2**16)),
                                    draw(st.sampled_from(["const", "uniform", "long_tail"])),
                                    max_len)
    else:  # explicit list, so hypothesis can shrink a failing workload
        table = draw(st.lists(st.integers(1, 60), min_size=1, max_size=16))
        max_len = max(table)
        lengths = lambda g, k: table[(g * G + k) % len(table)]  # noqa: E731
    load, train = draw(st.integers(0, 3)), draw(st.integers(1, 6))
    steps = draw(st.integers(1, 6))
    # Slices that report their KV memory (a paged cache), some of it often exhausted.
    kv = draw(st.one_of(st.none(), st.integers(0, 80))) if cfg.admit_tokens else None
    return cfg, lengths, max_len, load, train, steps, kv


def tick_bound(cfg, max_len, load, train, steps, kv=None):
    # Very loose: every step's groups decoded serially on one slice, plus loads and
    # training; a livelock exceeds any bound, a deadlock is detected directly. A
    # slice short of KV memory may run one request at a time.
    slots = 1 if kv is not None else cfg.slots_per_slice
    per_step = (math.ceil(max(cfg.rollout_batch_size, 2 * cfg.train_batch_size)
                          * cfg.group_size / slots) + 1) * max_len
    return (steps + cfg.max_staleness + 2) * (per_step + 2 * load + train + 2)


def check_run(run: FakeRun, steps: int):
    """Audit a finished FakeRun's ledger with the project's auditor (C1 for the modes
    that keep it, C2, C3 at the mode's bound, TBS groups per step), plus what the
    ledger alone cannot show: batch order and resident versions."""
    cfg = run.config
    report = run.audit()
    assert report.ok, report.summary() + str(report.c1[:3] + report.c2[:3] + report.c3[:3])
    by_step = run.consumed()
    assert set(range(steps)) <= set(by_step)
    admitted = {r["group_id"]: r["version"] for r in run.ledger if r["event"] == "admit"}
    for gids in by_step.values():  # oldest version first
        vs = [admitted[g] for g in gids]
        assert vs == sorted(vs)
    if cfg.mode == "dora":
        assert run.stats["max_resident_versions"] <= cfg.max_staleness + 1
    if cfg.mode in ("sync", "one_step_off"):
        assert run.stats["max_resident_versions"] == 1


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_contract_all_modes(sc):
    cfg, lengths, max_len, load, train, steps, kv = sc
    run = FakeRun(cfg, lengths, load_ticks=load, train_ticks=train, check=True,
                  kv_capacity=kv)
    run.run(steps, max_ticks=tick_bound(cfg, max_len, load, train, steps, kv))
    check_run(run, steps)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_finite_dataset_everything_consumed(sc):
    """With max_groups = steps * TBS every admitted group is trained (nothing left
    in flight), in every mode."""
    cfg, lengths, max_len, load, train, steps, kv = sc
    cfg = SchedulerConfig(**{**cfg.__dict__, "max_groups": steps * cfg.train_batch_size})
    run = FakeRun(cfg, lengths, load_ticks=load, train_ticks=train, kv_capacity=kv)
    run.run(steps, max_ticks=tick_bound(cfg, max_len, load, train, steps, kv))
    check_run(run, steps)
    assert not run.sched.groups
    assert run.summary()["admitted"] == run.summary()["consumed"] == steps * cfg.train_batch_size


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_dora_k0_is_sync(sc):
    """dora with K=0 trains the same groups at the same steps as sync (the
    feasibility invariant admits exactly TBS groups per version)."""
    cfg, lengths, max_len, load, train, steps, _ = sc
    runs = {}
    for mode in ("sync", "dora"):
        c = SchedulerConfig(**{**cfg.__dict__, "mode": mode, "max_staleness": 0})
        runs[mode] = FakeRun(c, lengths, load_ticks=load, train_ticks=train)
        runs[mode].run(steps, max_ticks=tick_bound(c, max_len, load, train, steps))
    assert runs["dora"].consumed() == runs["sync"].consumed()
    assert runs["dora"].stats["migrations"] == 0


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0.0, 1.0, exclude_max=True))
def test_every_slice_failing_at_once_loses_nothing(sc, restart_at):
    """After every slice fails at once (in-flight requests and params lost, the
    samples regenerated) at a point drawn within the run's length, the contract still
    holds and the run completes."""
    cfg, lengths, max_len, load, train, steps, kv = sc
    bound = 2 * tick_bound(cfg, max_len, load, train, steps, kv)
    full = FakeRun(cfg, lengths, load_ticks=load, train_ticks=train, check=False,
                   kv_capacity=kv)
    full.start()
    events = 0
    while full.steps_done < steps:
        full.advance(bound)
        events += 1
    run = FakeRun(cfg, lengths, load_ticks=load, train_ticks=train, kv_capacity=kv)
    run.start()
    for _ in range(int(restart_at * events)):
        run.advance(bound)
    assert run.steps_done < steps  # the restart falls inside the run
    for i in range(cfg.num_slices):
        run.fail_slice(i)
    run.run(steps, max_ticks=bound)
    check_run(run, steps)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(modes=[m for m in MODES if POLICIES[m].replaces_filtered_groups]),
       st.integers(2, 5),
       st.integers(0, 4))
def test_filtered_groups_are_replaced_and_accounted(sc, period, phase):
    """Groups scored before training, every `period`-th one filtered out: each step
    still trains exactly TBS kept groups, and every filtered group is in the ledger
    as `filter` with a reason, never consumed (the auditor checks both)."""
    import dataclasses

    cfg, lengths, max_len, load, train, steps, kv = sc
    cfg = dataclasses.replace(cfg, score_groups=True)
    keep = lambda gid: gid % period != phase % period  # noqa: E731
    run = FakeRun(cfg, lengths, load_ticks=load, train_ticks=train, check=True,
                  kv_capacity=kv, keep=keep)
    run.run(steps, max_ticks=2 * tick_bound(cfg, max_len, load, train, steps, kv))
    check_run(run, steps)
    filtered = {r["group_id"] for r in run.ledger if r["event"] == "filter"}
    assert all(not keep(g) for g in filtered)
    assert all(keep(g) for gids in run.consumed().values() for g in gids)
    assert run.sched.filtered == len(filtered)


def run_with_failures(sc, failures) -> FakeRun:
    """A scenario run to its steps with slice `i mod S` failing after `after` events,
    for each (after, i) in `failures`; the contract checked (check_run)."""
    cfg, lengths, max_len, load, train, steps, kv = sc
    run = FakeRun(cfg, lengths, load_ticks=load, train_ticks=train, check=True,
                  kv_capacity=kv)
    run.start()
    bound = 2 * tick_bound(cfg, max_len, load, train, steps, kv)
    for after, i in failures:
        for _ in range(after):
            if run.steps_done >= steps:
                break
            run.advance(bound)
        run.fail_slice(i % cfg.num_slices)
    while run.steps_done < steps:
        run.advance(bound)
    check_run(run, steps)
    return run


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.lists(st.tuples(st.integers(1, 30), st.integers(0, 5)), min_size=1,
                             max_size=4))
def test_failed_slices_lose_nothing(sc, failures):
    """Slices fail at random points (after some events, slice i mod S): their running
    samples are regenerated under their group's version, the slices reload, and the
    contract holds in every mode."""
    run_with_failures(sc, failures)
