"""What the runtime's threads tell the coordinator: one typed event per happening.

The decode slices' loops (worker.py), the trainer thread and the reward pool post these
on the coordinator's queue; the coordinator (loop.py) alone turns them into the
scheduler's events. They are the runtime's counterpart of the scheduler's typed
actions (scheduler/types.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SamplesFinished:
    """A slice's generate call ended these samples (`Trajectory`s); `kv_free` is the
    slice's free KV positions after them (paged cache; None: dense)."""

    slice_id: int
    trajectories: list
    kv_free: int | None = None


@dataclasses.dataclass(frozen=True)
class VersionLoaded:
    """A slice made `version` resident."""

    slice_id: int
    version: int


@dataclasses.dataclass(frozen=True)
class StepDone:
    """The trainer finished step `step` on `batch` (a TrainBatch): its host
    `metrics`, the published `params` of version step + 1 (a copy on the trainer
    mesh), the step's start and end on the run clock, and the seconds it waited
    before starting for a checkpoint's copy of the previous state (saves.py)."""

    step: int
    batch: Any
    metrics: dict
    params: Any
    start: float
    end: float
    copy_wait: float = 0.0


@dataclasses.dataclass(frozen=True)
class GroupScored:
    """Every reward of finished group `group_id` is in."""

    group_id: int


@dataclasses.dataclass(frozen=True)
class EvalGenerated:
    """A slice generated an evaluation of `version` (EvalDecoder.generate's result)
    between `start` and `end` on the run clock."""

    slice_id: int
    version: int
    greedy: list
    sampled: list
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class EvalScored:
    """Every reward of the evaluation of `version` is in."""

    version: int


TRAINER = "trainer"


@dataclasses.dataclass(frozen=True)
class Failed:
    """`source` (a slice id, or `TRAINER`) raised `error`; the coordinator decides
    whether the run survives it."""

    source: int | str
    error: BaseException


Event = (SamplesFinished | VersionLoaded | StepDone | GroupScored | EvalGenerated
         | EvalScored | Failed)
