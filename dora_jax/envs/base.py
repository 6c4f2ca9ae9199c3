"""The environment interface of multi-turn episodes, and environments by name.

An episode alternates model turns and environment observations in one sequence:

    prompt (the first observation) -> model turn 1 -> observation 1 -> model turn 2 ...

`reset(record)` starts an episode on a prompt record and returns its first
observation, the text the prompt is built from; `step(action_text)` takes one model
turn's text (decoded, special tokens dropped) and returns a `StepResult`: the next
observation, the turn's reward, whether the episode is over, and numeric `info`
(summed over the episode into the ledger, e.g. tool calls made and correct).

Environments see untrusted text: a step reads it in bounded time and memory and runs
none of it in this process (tools that execute code do it in `sandbox.py`'s separate
process). They are called off the decode slice's thread (rollout/episodes.py), one
instance per episode; `step` may be a coroutine function (run to completion there).

An environment class also gives the task's prompt records (`records`) and, for a
supervised warm start, a demonstration of a good episode (`demonstration`).
Registered by name with `@register("name")`; a run picks one with `data.env`. This
module imports none of the environments: each registers itself on import, and the
package (envs/__init__.py) imports the built-in ones, so any import of dora_jax.envs
finds them registered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment answers to one model turn."""

    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


class Environment:
    """Base class of environments (see the module docstring). Subclasses set
    `max_turns` (the most model turns an episode may take) and implement `reset`,
    `step`, `records` and, for a warm start, `demonstration`."""

    max_turns: int = 4
    # Environments that run the model's code in envs/sandbox.py set this to the
    # isolation level (data.env_isolation sets it per run; the run checks the host
    # offers it before any compute, and each episode's ledger line records it).
    sandbox_isolation: str | None = None

    def reset(self, record: dict) -> str:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    @classmethod
    def records(cls, num: int, seed: int) -> list[dict]:
        """`num` task records (JSON values, a stable `prompt_id` each)."""
        raise NotImplementedError

    @classmethod
    def demonstration(cls, record: dict) -> list[tuple[str, str]]:
        """A good episode on `record`: [("model", text), ("env", text), ...], the
        model's turns and the observations between them, as `step` would answer."""
        raise NotImplementedError(f"{cls.__name__} has no demonstrations")


_ENVIRONMENTS: dict[str, type[Environment]] = {}
_Env = TypeVar("_Env", bound=Environment)


def register(name: str) -> Callable[[type[_Env]], type[_Env]]:
    """Class decorator: the environment is `data.env=name`."""
    def add(cls: type[_Env]) -> type[_Env]:
        if name in _ENVIRONMENTS and _ENVIRONMENTS[name] is not cls:
            raise ValueError(f"environment {name!r} is registered twice")
        _ENVIRONMENTS[name] = cls
        return cls
    return add


def names() -> tuple:
    """Every registered environment's name."""
    return tuple(sorted(_ENVIRONMENTS))


def get(name: str) -> type[Environment]:
    """The environment class registered as `name` (ValueError naming the choices)."""
    if name not in _ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; registered: {sorted(_ENVIRONMENTS)}")
    return _ENVIRONMENTS[name]


def record_rng(seed: int, task: str) -> np.random.Generator:
    """A generator of a task's records that depends on the seed and the task only."""
    return np.random.default_rng([seed, sum(map(ord, task))])
