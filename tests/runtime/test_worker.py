"""Slice workers: commands apply in the coordinator's order, migrations included,
whatever the timing of the slices' own loops (fake slices, no JAX)."""

import queue
import threading
import time

from dora_jax.base.timeline import Timeline
from dora_jax.rollout.trajectory import VersionMismatchError
from dora_jax.runtime.events import Failed
from dora_jax.runtime.worker import SliceWorker


class FakeSlice:
    """Holds request ids at one version; a step takes `step_seconds` and finishes
    nothing. Enough of DecodeSlice for a worker."""

    def __init__(self, slice_id, held=(), step_seconds=0.0):
        self.slice_id, self.version = slice_id, 0
        self.held = set(held)
        self.step_seconds = step_seconds
        self.gate = threading.Event()  # the first step blocks until set
        self.gate.set()

    num_requests = property(lambda self: len(self.held))
    idle = property(lambda self: not self.held)

    def holds(self, rid):
        return rid in self.held

    def running_by_version(self):
        return {self.version: len(self.held)} if self.held else {}

    def step(self):
        self.gate.wait()
        time.sleep(self.step_seconds)
        return []

    def export_requests(self, ids):
        self.held -= set(ids)
        return list(ids)

    def import_requests(self, records):
        self.held |= set(records)

    def load_version(self, version, params):
        if self.held:
            raise VersionMismatchError(f"slice {self.slice_id} holds {sorted(self.held)}")
        self.version = version


def test_chained_migration_then_load_applies_in_order():
    """R moves A -> B, then (before A has exported it) B -> C, then B loads a new
    version: B must see R arrive before passing it on, so the load finds B empty and
    R ends on C."""
    events = queue.Queue()
    a, b, c = FakeSlice(0, held={"R", "S"}), FakeSlice(1), FakeSlice(2)
    a.gate.clear()  # A is inside a long generate call: its export comes late
    workers = [SliceWorker(s, events, Timeline()) for s in (a, b, c)]
    for w in workers:
        w.start()
    wa, wb, wc = workers
    wa.migrate(["R"], wb)
    wb.migrate(["R"], wc)
    wb.load(1, params=None)
    time.sleep(0.2)  # B and C are idle and would act now if they did not wait
    a.gate.set()
    deadline = time.time() + 5
    while (c.held != {"R"} or b.version != 1) and time.time() < deadline:
        time.sleep(0.01)
    for w in workers:
        w.stop(timeout=5)
    failures = []
    while not events.empty():
        ev = events.get()
        if isinstance(ev, Failed):
            failures.append(ev.error)
    assert not failures, failures
    assert (a.held, b.held, c.held, b.version) == ({"S"}, set(), {"R"}, 1)


def test_stop_does_not_hang_on_a_hand_over_that_never_comes():
    events = queue.Queue()
    a, b = FakeSlice(0, held={"R"}), FakeSlice(1)
    a.gate.clear()  # A never reaches its export
    wa, wb = (SliceWorker(s, events, Timeline()) for s in (a, b))
    wa.start()
    wb.start()
    wa.migrate(["R"], wb)
    time.sleep(0.05)
    start = time.time()
    wb.stop(timeout=5)
    assert time.time() - start < 2 and not wb._thread.is_alive()
    a.gate.set()
    wa.stop(timeout=5)
