"""The registry of scheduling modes: each mode name in `dora_jax.config.MODES`
maps to its policy class here, and nowhere else. A new mode is a `Policy`
subclass (policies.py) registered below, plus its row of capabilities in
dora_jax/config/modes.py."""

from __future__ import annotations

from dora_jax.config.modes import MODES

from .dora import DoraPolicy
from .partial import PartialRolloutPolicy, RoundPartialRolloutPolicy
from .policies import OneStepOffPolicy, Policy, SyncPolicy

# Capabilities are class attributes (Policy, from config.modes.CAPABILITIES): read
# them here, with no instance, e.g. `POLICIES[mode].keeps_c1`.
POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (SyncPolicy, OneStepOffPolicy, PartialRolloutPolicy,
                        RoundPartialRolloutPolicy, DoraPolicy)}

if tuple(POLICIES) != MODES:  # pragma: no cover - caught by any import in the tests
    raise ImportError(f"policy registry {tuple(POLICIES)} != config.MODES {MODES}")


def policy_for(mode: str) -> Policy:
    """A fresh policy for `mode` (policies are stateless)."""
    if mode not in POLICIES:
        raise ValueError(f"unknown mode {mode!r}; known: {tuple(POLICIES)}")
    return POLICIES[mode]()
