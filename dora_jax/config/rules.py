"""The rules on a schedule's shape that span sections (a group fits the slots, V <= K
+ 1, several versions per slice, a field's declared constraint). They take plain
values, so that a whole `Config` (run.py's rules) and the scheduler's own config
(scheduler/types.py) check themselves by the same rules."""

from __future__ import annotations

import dataclasses

from .modes import CAPABILITIES, modes_with
from .schema import check, fail
from .sections import RolloutConfig


def check_declared(section, name: str, value) -> None:
    """Checks `value` against the constraint `section` declares for its field `name`
    (schema.field), naming the field as the section's own validation does."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    check(f"{section.PATH}.{name}", value, **f.metadata)


def check_group_fits(group_size: int, num_slices: int, slots_per_slice: int):
    """A group's samples must fit in the slots at once (a group starts as a whole)."""
    if group_size > num_slices * slots_per_slice:
        fail("coordinator.group_size",
              f"{group_size} samples per group do not fit in {num_slices * slots_per_slice} "
              f"slots (mesh.num_slices x rollout.slots_per_slice)")


def check_versions(versions_per_slice: int, max_staleness: int) -> None:
    """V <= K + 1: the staleness window [P - K, P] holds K + 1 versions, so a slice
    never has a use for more places than that."""
    check_declared(RolloutConfig, "versions_per_slice", versions_per_slice)
    if versions_per_slice > max_staleness + 1:
        fail("rollout.versions_per_slice", f"must be <= coordinator.max_staleness + 1 "
             f"({max_staleness + 1}: the versions the staleness window holds), got "
             f"{versions_per_slice}")


def check_multi_version(versions_per_slice: int, mode: str, model) -> None:
    """V > 1 on real slices: a mode that schedules by residency, and versions that
    differ by LoRA adapters on one shared base (V full-weight copies run only in the
    simulator, whose presets know the device memory they need)."""
    got = f"got {versions_per_slice}"
    if not CAPABILITIES[mode].multi_version:
        fail("rollout.versions_per_slice", f"several versions per slice are scheduled "
             f"only in {modes_with('multi_version')}, not in {mode!r}: use 1, {got}")
    if not model.lora.enabled:
        fail("rollout.versions_per_slice", "several versions per slice share one base and "
             "differ by their adapters: set model.lora.rank > 0 (V full-weight copies per "
             "slice run only in the simulator: python -m dora_jax.sim "
             f"--versions_per_slice=V), {got}")
    if model.lora.experts and model.moe.num_experts:
        fail("model.lora.experts", "per-expert adapters cannot be selected per slot: "
             "several versions per slice (rollout.versions_per_slice > 1) need "
             "model.lora.experts=False")
