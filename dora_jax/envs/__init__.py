"""Multi-turn environments and the tools they call.

The registry is base.py's; importing the package registers the built-in environments
(each module registers itself and imports base, never this package), so `get` and
`names`, here or in base, see them all."""

from dora_jax.envs import arithmetic, guess  # noqa: F401 - they register themselves
from dora_jax.envs.base import Environment, StepResult, get, names, register

__all__ = ["Environment", "StepResult", "get", "names", "register"]
