"""The pure-Python scheduling core (no JAX): deterministic and event-driven.

`Scheduler` (core.py) holds the state and the event API; the modes are
policies (policies.py, dora.py) behind one registry (modes.py); the ledger format and
its auditor are in ledger.py; `FakeRun` (fake.py) drives the core with a fake engine.
The real runtime (`dora_jax.runtime`) drives the same `Scheduler`.
"""

from dora_jax.config import MODES

from .core import Scheduler
from .invariants import InvariantError
from .fake import FakeRun, LivenessError, lengths_from_seed
from .modes import POLICIES, policy_for
from .types import (Action, Admit, Assign, InterruptReload, LoadVersion, Migrate,
                    SchedulerConfig, TrainStep)

__all__ = [
    "MODES", "POLICIES", "Action", "Admit", "Assign", "FakeRun", "InterruptReload",
    "InvariantError", "LivenessError", "LoadVersion", "Migrate", "Scheduler",
    "SchedulerConfig", "TrainStep", "lengths_from_seed", "policy_for",
]
