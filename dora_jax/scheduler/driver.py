"""The one shape every driver of the `Scheduler` has, and the ledger records it writes.

A driver (the JAX runtime, the simulator, the tests' fake engine) turns its world into
the scheduler's events (`Scheduler.sample_finished`, `version_loaded`, ...) and
carries out the actions `Scheduler.decide()` returns. `Driver.execute` is the single
place that dispatches on an action's type; a driver implements one method per action.
The functions below build the ledger's `admit`, `consume` and `filter` lines, so every
driver writes the same format (scheduler/ledger.py defines it and audits it).
"""

from __future__ import annotations

from collections.abc import Iterable

from dora_jax.scheduler.types import (
    Action,
    AddVersion,
    Admit,
    Assign,
    Evict,
    InterruptReload,
    LoadVersion,
    Migrate,
    TrainStep,
)


class Driver:
    """Carries out the scheduler's actions; subclasses implement the handlers."""

    def execute(self, actions: Iterable[Action]) -> None:
        """Carries out `actions` in order (the order `decide()` returned them in)."""
        for a in actions:
            if isinstance(a, Admit):
                self.admit(a)
            elif isinstance(a, Assign):
                self.assign(a)
            elif isinstance(a, Migrate):
                self.migrate(a)
            elif isinstance(a, (LoadVersion, InterruptReload)):
                self.load(a, interrupt=isinstance(a, InterruptReload))
            elif isinstance(a, AddVersion):
                self.add_version(a)
            elif isinstance(a, Evict):
                self.evict(a)
            elif isinstance(a, TrainStep):
                self.train(a)
            else:
                raise TypeError(f"unknown action {a!r}")

    def admit(self, a: Admit) -> None:
        """A new group (or a re-admitted one) enters at `a.version`."""
        raise NotImplementedError

    def assign(self, a: Assign) -> None:
        """Sample `a.sample` of `a.group_id` starts on slice `a.slice_id`."""
        raise NotImplementedError

    def migrate(self, a: Migrate) -> None:
        """A running sample moves, with its KV cache, between two slices of one version."""
        raise NotImplementedError

    def load(self, a: LoadVersion | InterruptReload, *, interrupt: bool) -> None:
        """Slice `a.slice_id` makes `a.version` resident (with `interrupt`, its
        running samples continue under it: partial rollout)."""
        raise NotImplementedError

    def add_version(self, a: AddVersion) -> None:
        """Slice `a.slice_id` loads `a.version` into a free place, decoding on
        (several versions per slice)."""
        raise NotImplementedError

    def evict(self, a: Evict) -> None:
        """Slice `a.slice_id` drops `a.version`, which nothing on it uses."""
        raise NotImplementedError

    def train(self, a: TrainStep) -> None:
        """The trainer trains step `a.step` on groups `a.group_ids`."""
        raise NotImplementedError


def admit_record(a: Admit, prompt_id, time: float) -> dict:
    """The ledger's `admit` line for an `Admit` action."""
    return dict(event="admit", group_id=a.group_id, prompt_id=prompt_id, version=a.version,
                time=time, **({"readmit": True} if a.readmit else {}))


def sample_entry(sample: int, versions: list, slices: list, response_len: int,
                 finish: str, reward: float | None = None, **extra) -> dict:
    """One sample of a `consume` line: its run-length versions, the slices that
    generated it, its length, why it ended, its reward and any extras (e.g. an
    overlong penalty or a reward error), the latter only when set."""
    entry = dict(sample=sample, versions=versions, slices=slices,
                 response_len=response_len, finish=finish)
    if reward is not None:
        entry["reward"] = reward
    entry.update({k: v for k, v in extra.items() if v})
    return entry


def consume_record(group_id: int, prompt_id, version: int, step: int, time: float,
                   samples: list) -> dict:
    """The ledger's `consume` line: the group was trained by `step`."""
    return dict(event="consume", group_id=group_id, prompt_id=prompt_id, version=version,
                step=step, time=time, samples=samples)


def filter_record(group_id: int, prompt_id, version: int, time: float,
                  reward: float | None = None) -> dict:
    """The ledger's `filter` line: a finished group left untrained because its rewards
    are all equal (DAPO's dynamic sampling); the scheduler admits another instead."""
    rec = dict(event="filter", group_id=group_id, prompt_id=prompt_id, version=version,
               time=time, reason="zero reward variance")
    if reward is not None:
        rec["reward"] = reward
    return rec
