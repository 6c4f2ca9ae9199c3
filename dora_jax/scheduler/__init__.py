"""The pure-Python scheduling core (no JAX): deterministic and event-driven.

`Scheduler` (core.py) holds the state and the event API; the modes are
policies (policies.py, dora.py) behind one registry (modes.py); the ledger format and
its auditor are in ledger.py; driver.py gives every driver of the core one shape.
The JAX runtime (`dora_jax.runtime`), the simulator (`dora_jax.sim`) and the tests'
fake engine drive the same `Scheduler`.
"""

from dora_jax.config.modes import MODES

from .core import Scheduler
from .invariants import InvariantError
from .modes import POLICIES, policy_for
from .types import (
                    Action,
                    AddVersion,
                    Admit,
                    Assign,
                    Evict,
                    InterruptReload,
                    LoadVersion,
                    Migrate,
                    SchedulerConfig,
                    TrainStep,
)

__all__ = [
    "MODES", "POLICIES", "Action", "AddVersion", "Admit", "Assign", "Evict", "InterruptReload",
    "InvariantError",
    "LoadVersion", "Migrate", "Scheduler", "SchedulerConfig", "TrainStep", "policy_for",
]
