"""The fault seam (runtime/faults.py): the runtime fails on purpose only through a
`Faults` object it is given, a no-op by default, and the config's fail_* / kill_*
values are read in one place (fake slices, no JAX)."""

import ast
import pathlib
import queue
import time

import pytest

from dora_jax.base.timeline import Timeline
from dora_jax.config.sections import FAIL_POINTS, KILL_POINTS, CoordinatorConfig
from dora_jax.runtime import faults as faults_lib
from dora_jax.runtime.events import Failed, VersionLoaded
from dora_jax.runtime.faults import NO_FAULTS, Drills, Faults, InjectedFault
from dora_jax.runtime.worker import SliceWorker

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLAN_FIELDS = {"fail_slice", "fail_point", "fail_after", "kill_point", "kill_after"}


def test_the_typed_points_are_the_config_s():
    assert set(faults_lib.SlicePoint.__args__) == set(FAIL_POINTS)
    assert set(faults_lib.RunPoint.__args__) == set(KILL_POINTS) - {""}


def test_a_config_without_drills_gives_the_no_op_seam():
    assert Drills.from_config(CoordinatorConfig()) is NO_FAULTS
    NO_FAULTS.slice_reached("generate", 0)
    NO_FAULTS.run_reached("train")


@pytest.mark.parametrize("fail_slice,fires", [(1, [False, False, False, True]),
                                               (-2, [False, True, False, False])])
def test_a_planned_slice_failure_fires_once_at_its_point_and_count(fail_slice, fires):
    """fail_slice names the slice (or -2: any), fail_after the visits to its point
    that pass first; it fires once."""
    f = Drills.from_config(CoordinatorConfig(fail_slice=fail_slice, fail_point="load",
                                             fail_after=1))
    f.slice_reached("generate", 1)  # another point: not counted
    got = []
    for slice_id in (0, 1, 0, 1):
        try:
            f.slice_reached("load", slice_id)
            got.append(False)
        except InjectedFault:
            got.append(True)
    assert got == fires


def test_the_runtime_reads_the_fault_fields_nowhere_but_the_seam():
    """The production code holds no drill values: coordinator.fail_* / kill_* are
    read by faults.py alone (recovery.py lists them by name as fields a resume may
    change; the config declares and checks them)."""
    found = []
    for path in (ROOT / "dora_jax").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("dora_jax/config/") or rel == "dora_jax/runtime/faults.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PLAN_FIELDS:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


class Recorded(Faults):
    """Records every point a worker reaches; raises at `fail_at`."""

    def __init__(self, fail_at=None):
        self.points, self.fail_at = [], fail_at

    def slice_reached(self, point, slice_id):
        self.points.append((point, slice_id))
        if point == self.fail_at:
            raise InjectedFault(f"slice {slice_id}: at {point}")


class FakeSlice:
    """Enough of DecodeSlice for a worker: one held request, steps finish nothing."""

    def __init__(self, slice_id):
        self.slice_id, self.version, self.held = slice_id, 0, {"R"}

    num_requests = property(lambda self: len(self.held))
    idle = property(lambda self: not self.held)

    def running_by_version(self):
        return {self.version: len(self.held)}

    def step(self):
        time.sleep(0.01)
        return []

    def load_version(self, version, params):
        self.version = version


def _events_until(events, kind, timeout=5.0):
    deadline, seen = time.time() + timeout, []
    while time.time() < deadline:
        try:
            seen.append(events.get(timeout=0.05))
        except queue.Empty:
            continue
        if isinstance(seen[-1], kind):
            return seen
    raise AssertionError(f"no {kind.__name__} in {seen}")


def test_a_worker_reaches_each_point_through_the_faults_it_was_given():
    events, recorded = queue.Queue(), Recorded()
    w = SliceWorker(FakeSlice(3), events, Timeline(), faults=recorded)
    w.start()
    w.load(1, params=None)
    _events_until(events, VersionLoaded)
    w.stop(timeout=5)
    assert ("load", 3) in recorded.points and ("generate", 3) in recorded.points


def test_a_fault_raised_through_the_seam_fails_the_slice():
    events = queue.Queue()
    w = SliceWorker(FakeSlice(2), events, Timeline(), faults=Recorded(fail_at="load"))
    w.start()
    w.load(1, params=None)
    failed = _events_until(events, Failed)[-1]
    w.stop(timeout=5)
    assert failed.source == 2 and isinstance(failed.error, InjectedFault)
