"""Faults on purpose, by count, never by timing: the drills that prove recovery.

The runtime reaches them through one seam, a `Faults` object given at construction,
which it calls at every point a drill may name; the default does nothing, so the
production code holds no test values. `Drills` fails where the config says:
`FaultPlan` makes a decode slice raise at a chosen point of its loop (the runtime
restarts it: runtime/loop.py); `KillPlan` kills the whole process with SIGKILL at a
chosen point of the run (the same command then resumes it: runtime/recovery.py).
Both come from `coordinator.fail_*` / `coordinator.kill_*` (config/sections.py),
read by `Drills.from_config` alone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Literal

from dora_jax.config.sections import FAIL_ANY_SLICE, FAIL_NO_SLICE, KILL_NEVER

if TYPE_CHECKING:
    from dora_jax.config.sections import CoordinatorConfig

# Where a drill can fail a slice (config.sections.FAIL_POINTS) or kill the run
# (KILL_POINTS): typed, so a call site cannot name a point no drill knows.
SlicePoint = Literal["generate", "load", "export", "import"]
RunPoint = Literal["train", "save", "finished_waiting", "at_environment"]


class Faults:
    """The seam the runtime fails through on purpose: it calls `slice_reached` and
    `run_reached` at each point a drill may name. This one never fails (a run
    without drills); `Drills`, or a test's own subclass, does."""

    def slice_reached(self, point: SlicePoint, slice_id: int) -> None:
        """Decode slice `slice_id`'s loop is at `point`; raising fails the slice."""

    def run_reached(self, point: RunPoint) -> None:
        """The run is at `point`."""


NO_FAULTS = Faults()


class InjectedFault(RuntimeError):
    """The failure `coordinator.fail_slice` asks for."""


class FaultPlan:
    """One injected failure, by count: the (`after` + 1)-th time slice `slice_id`
    (None: any slice, the first to get there) reaches `point` of its loop."""

    def __init__(self, point: str, after: int = 0, slice_id: int | None = None) -> None:
        self.point, self.slice_id = point, slice_id
        self._left, self._fired = after, False
        self._lock = threading.Lock()

    def reached(self, point: str, slice_id: int) -> None:
        """Raises InjectedFault if this is the planned moment."""
        with self._lock:
            if self._fired or point != self.point or self.slice_id not in (None, slice_id):
                return
            if self._left:
                self._left -= 1
                return
            self._fired = True
        raise InjectedFault(f"slice {slice_id}: injected failure at {point}")


class KillPlan:
    """SIGKILL to this process the (`after` + 1)-th time the run reaches `point`:
    "train" (a train step begun, not published), "save" (a checkpoint's files being
    written in the background), "finished_waiting" (finished groups waiting for the
    trainer, which is busy), "at_environment" (samples finished while episodes wait
    for their environments)."""

    def __init__(self, point: str, after: int = 0) -> None:
        self.point, self._left = point, after
        self._lock = threading.Lock()

    def reached(self, point: str) -> None:
        with self._lock:
            if point != self.point:
                return
            if self._left:
                self._left -= 1
                return
        sys.stderr.write(f"killing the run at {point} (coordinator.kill_point)\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


class Drills(Faults):
    """The faults a run's config plans: a slice failure and/or a kill, each once."""

    def __init__(self, fail: FaultPlan | None = None, kill: KillPlan | None = None) -> None:
        self.fail, self.kill = fail, kill

    @classmethod
    def from_config(cls, coordinator: CoordinatorConfig) -> Faults:
        """The drills `coordinator` (config.sections.Coordinator) asks for, or
        NO_FAULTS: the one reader of its fail_* / kill_* fields and their values
        for "no slice", "any slice" and "never"."""
        c = coordinator
        fail = None if c.fail_slice == FAIL_NO_SLICE else FaultPlan(
            c.fail_point, c.fail_after, None if c.fail_slice == FAIL_ANY_SLICE else c.fail_slice)
        kill = None if c.kill_point == KILL_NEVER else KillPlan(c.kill_point, c.kill_after)
        return NO_FAULTS if fail is None and kill is None else cls(fail, kill)

    def slice_reached(self, point: SlicePoint, slice_id: int) -> None:
        if self.fail is not None:
            self.fail.reached(point, slice_id)

    def run_reached(self, point: RunPoint) -> None:
        if self.kill is not None:
            self.kill.reached(point)
