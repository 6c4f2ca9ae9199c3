"""Faults on purpose, by count, never by timing: the drills that prove recovery.

`FaultPlan` makes a decode slice raise at a chosen point of its loop (the runtime
restarts it: runtime/loop.py); `KillPlan` kills the whole process with SIGKILL at a
chosen point of the run (the same command then resumes it: runtime/recovery.py).
Both come from `coordinator.fail_*` / `coordinator.kill_*` (config/sections.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading


class InjectedFault(RuntimeError):
    """The failure `coordinator.fail_slice` asks for."""


class FaultPlan:
    """One injected failure, by count: the (`after` + 1)-th time slice `slice_id`
    (None: any slice, the first to get there) reaches `point` of its loop."""

    def __init__(self, point: str, after: int = 0, slice_id: int | None = None):
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

    def __init__(self, point: str, after: int = 0):
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
