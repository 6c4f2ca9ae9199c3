"""Pure-Python scheduling core for rollout orchestration (no JAX).

`Scheduler` (core.py) holds the state and the event API; the four modes are
policies (policies.py, dora.py); `FakeRun` (fake.py) drives it with a fake engine.
"""

from .core import InvariantError, Scheduler
from .fake import FakeRun, LivenessError, lengths_from_seed
from .types import (MODES, Action, Admit, Assign, InterruptReload, LoadVersion,
                    Migrate, SchedulerConfig, TrainBatch)

__all__ = [
    "MODES", "Action", "Admit", "Assign", "FakeRun", "InterruptReload",
    "InvariantError", "LivenessError", "LoadVersion", "Migrate", "Scheduler",
    "SchedulerConfig", "TrainBatch", "lengths_from_seed",
]
