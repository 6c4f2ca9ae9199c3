"""Several policy versions per decode slice (rollout.versions_per_slice V): loading a
version without draining the slice, eviction only when nothing uses it, assignment
only where the group's version is resident, the residency invariants under random
event sequences in every mode, and V = 1 taking exactly the actions it took before
slices could hold several versions."""

import json
import pathlib

import pytest
from _record_v1 import record
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_props import run_with_failures, scenarios

from dora_jax.config import ConfigError
from dora_jax.scheduler import (
    AddVersion,
    Admit,
    Assign,
    Evict,
    InvariantError,
    Scheduler,
    SchedulerConfig,
    TrainStep,
)

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "scheduler_v1_actions.json"


def config(V, K=2, slots=4, S=1, G=2, tbs=1, rbs=2, mode="dora"):
    return SchedulerConfig(mode=mode, num_slices=S, slots_per_slice=slots, group_size=G,
                           train_batch_size=tbs, rollout_batch_size=rbs, max_staleness=K,
                           versions_per_slice=V)


def test_v1_takes_the_actions_it_took_with_one_version_per_slice():
    """Every mode's whole action sequence on three fixed scenarios (count and hash),
    recorded by the scheduler before slices could hold several versions."""
    assert record() == json.loads(FIXTURE.read_text())


def test_a_version_loads_into_a_free_place_without_draining_the_slice():
    s = Scheduler(config(V=2))
    acts = s.decide()
    assert [a for a in acts if isinstance(a, Assign)] == [
        Assign(0, 0, 0, 0), Assign(0, 1, 0, 0), Assign(1, 0, 0, 0), Assign(1, 1, 0, 0)]
    s.sample_finished(0, 0), s.sample_finished(0, 1)
    assert s.decide() == [TrainStep(0, (0,))]
    s.step_finished(0)
    # Group 1 (version 0) still runs on the slice: version 1 is added beside it, and
    # a group of version 1 is admitted for the slice's free slots.
    assert s.decide() == [AddVersion(0, 1), Admit(2, 1)]
    sl = s.slices[0]
    assert sl.held == {0} and sl.adding == {1} and len(sl.running) == 2
    s.check_invariants()
    s.version_loaded(0, 1)
    assert sl.held == {0, 1} and sl.version == 1
    assert s.decide() == [Assign(2, 0, 0, 1), Assign(2, 1, 0, 1)]
    # Both versions decode side by side on the one slice.
    assert sorted(s.groups[g].version for g, _ in sl.running) == [0, 0, 1, 1]
    s.check_invariants()


def test_eviction_waits_until_nothing_uses_the_version():
    """V = 2 under K = 2: a slice holding versions 0 and 1, both running, gets
    version 2 only once one of them drains there; the drained one is evicted."""
    s = Scheduler(config(V=2, K=2, slots=4, G=1, tbs=2, rbs=4))
    s.decide()  # groups 0-3 of version 0 on the slice
    s.sample_finished(0, 0), s.sample_finished(1, 0)
    assert s.decide() == [TrainStep(0, (0, 1))]
    s.step_finished(0)
    assert s.decide() == [AddVersion(0, 1), Admit(4, 1), Admit(5, 1)]
    s.version_loaded(0, 1)
    assert s.decide() == [Assign(4, 0, 0, 1), Assign(5, 0, 0, 1)]
    s.sample_finished(2, 0), s.sample_finished(4, 0)
    assert s.decide() == [TrainStep(1, (2, 4))]
    s.step_finished(1)
    # Version 2 is published, but both places hold running requests (groups 3, 5).
    assert s.decide() == []
    assert s.slices[0].held == {0, 1} and s.slices[0].in_use == {0: 1, 1: 1}
    s.check_invariants()
    with pytest.raises(AssertionError, match="still uses"):
        s.do_evict(0, 0)
    # The last version-0 request ends: version 0 is evicted, version 2 added.
    s.sample_finished(3, 0)
    assert s.decide()[:2] == [Evict(0, 0), AddVersion(0, 2)]
    assert s.slices[0].held == {1} and s.slices[0].adding == {2}
    s.check_invariants()


def test_assignment_refused_for_a_version_not_resident():
    s = Scheduler(config(V=2, S=2, slots=2, G=2, tbs=1, rbs=2))
    s.decide()
    for k in (0, 1):
        s.sample_finished(0, k)
    s.decide()
    s.step_finished(0)
    # Version 1 is added to both slices and a group of it admitted; slice 0 is empty
    # but holds only version 0: the group waits.
    assert s.decide() == [AddVersion(0, 1), AddVersion(1, 1), Admit(2, 1)]
    assert s.free_slots(s.slices[0]) == 2
    with pytest.raises(AssertionError):
        s.do_assign(2, 0, 0)
    s.version_loaded(1, 1)
    assert s.decide() == []  # slice 1 holds version 1 but is full (group 1)
    s.version_loaded(0, 1)
    assert s.decide() == [Assign(2, 0, 0, 1), Assign(2, 1, 0, 1)]
    s.check_invariants()


def test_invariants_catch_a_request_of_a_version_not_resident():
    s = Scheduler(config(V=2))
    s.decide()
    s.slices[0].held, s.slices[0].version = set(), None  # version 0 dropped under its requests
    with pytest.raises(InvariantError, match="C1"):
        s.check_invariants()


def test_versions_per_slice_is_validated_with_its_field_named():
    with pytest.raises(ConfigError, match="rollout.versions_per_slice"):
        config(V=0)
    with pytest.raises(ConfigError, match=r"rollout.versions_per_slice.*max_staleness \+ 1"):
        config(V=4, K=2)


def test_a_run_config_refuses_several_versions_per_slice(load_config):
    with pytest.raises(ConfigError, match="rollout.versions_per_slice.*only in the simulator"):
        load_config("configs/tiny.py:spread", rollout__versions_per_slice=2,
                    coordinator__max_staleness=2)
    assert load_config("configs/tiny.py:spread").rollout.versions_per_slice == 1


@st.composite
def multi_scenarios(draw, modes=None, versions=(1, 4)):
    cfg, *rest = draw(scenarios() if modes is None else scenarios(modes=modes))
    V = draw(st.integers(*versions))
    cfg = SchedulerConfig(**{**cfg.__dict__, "versions_per_slice": V,
                             "max_staleness": max(cfg.max_staleness, V - 1)})
    return (cfg, *rest)


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(multi_scenarios(), multi_scenarios(modes=["dora"], versions=(2, 4))),
       st.lists(st.tuples(st.integers(1, 30), st.integers(0, 5)), max_size=3))
def test_residency_invariants_under_random_events(sc, failures):
    """Every mode, V in 1..4 (K >= V - 1), random shapes and lengths, some slices
    failing: the invariants (at most V versions a slice, every running request's
    version resident, in-use counts exact) hold after every event, the ledger audits
    clean (C1, C2, C3) and the run completes."""
    cfg = sc[0]
    run = run_with_failures(sc, failures)
    if run.sched.multi:
        assert run.stats.get("max_versions_per_slice", 0) <= cfg.versions_per_slice
        assert run.stats["migrations"] == 0
