"""The scheduling modes by name, with what each one guarantees and supports: the one
table that the config's validation and the scheduler's policies both read (a policy's
capabilities are its mode's row: scheduler/policies.py). A new mode is a row here plus
its `Policy`, registered in scheduler/modes.py."""

from __future__ import annotations

import dataclasses
from typing import Literal

from .schema import fail


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a mode guarantees and can do, so that the core, the auditor, the config's
    validation and the runtime need no mode-specific branch.

    keeps_c1: every trajectory comes from one version (a mode that does not may
      interrupt and reload a slice under its requests: InterruptReload).
    bound: the staleness the mode guarantees: "K" (coordinator.max_staleness), a
      fixed number, or None (not bounded by the mode).
    replaces_filtered_groups: a group filtered out after scoring is replaced by a new
      one (trainer.filter_zero_variance works).
    resumable: a crashed run continues from its checkpoint (runtime/recovery.py).
    allows_colocation: rollout and training take turns, so they may share the devices
      (mesh.colocated).
    multi_version: with rollout.versions_per_slice V > 1 its slices hold up to V
      versions at once (scheduler/residency.py); the other modes hold one per slice by
      their definition, whatever V.
    """

    keeps_c1: bool = True
    bound: int | Literal["K"] | None = "K"
    replaces_filtered_groups: bool = True
    resumable: bool = True
    allows_colocation: bool = False
    multi_version: bool = False

    def staleness_bound(self, max_staleness: int | None) -> int | None:
        """The largest step - version the mode guarantees under K = max_staleness
        (None: not bounded)."""
        return max_staleness if self.bound == "K" else self.bound


CAPABILITIES: dict[str, Capabilities] = {
    # The slices decode only while the trainer waits for the batch: on one set of
    # devices (verl's default deployment) the two take turns, and the new weights are
    # resharded in place for the slices.
    "sync": Capabilities(bound=0, allows_colocation=True),
    # Its batches are fixed runs of group ids with fixed versions: a filtered group
    # cannot be replaced, and a crash cannot be resumed by re-admitting groups.
    "one_step_off": Capabilities(bound=1, replaces_filtered_groups=False, resumable=False),
    "partial_rollout": Capabilities(keeps_c1=False),
    "partial_rollout_rounds": Capabilities(keeps_c1=False),
    "dora": Capabilities(multi_version=True),
}
MODES = tuple(CAPABILITIES)
# Mode names of older configs, with what replaces them.
RETIRED_MODES = {"colocated_sync": "colocation is a device layout, not a schedule: use "
                                   "coordinator.mode=sync with mesh.colocated=True"}


def check_not_retired(mode) -> None:
    """An older config's mode name fails with what replaces it."""
    if mode in RETIRED_MODES:
        fail("coordinator.mode", f"{mode!r} is no longer a mode; {RETIRED_MODES[mode]}")


def modes_with(capability: str) -> str:
    """'sync, partial_rollout or dora': the modes that have `capability`."""
    names = [m for m in MODES if getattr(CAPABILITIES[m], capability)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
