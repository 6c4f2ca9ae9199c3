"""Verdicts on a sandbox escape attempt: what the bench saw (Observation) and, per
case, whether that was an escape (a reason) or not (None). Every verdict starts from
the same base: a tripwire fired, the code reported a success, or the call overran."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora_jax.envs.sandbox import SandboxLimits, SandboxResult


@dataclasses.dataclass
class Observation:
    result: SandboxResult  # built from the observation for env cases
    tripped: list  # host-side tripwires fired for the case
    probe: SandboxResult  # a run of "pass" at the same level, for status comparisons
    limits: SandboxLimits  # the limits the call ran under
    elapsed: float  # wall seconds of the call, seen from the bench
    stall: float = 0.0  # longest extra wait of a bench thread during the call
    extra: dict = dataclasses.field(default_factory=dict)


def _refused(r) -> bool:
    return (not r.ok) and (r.error or "").startswith("refused") and r.isolation is None


def _number(text: str, key: str) -> int:
    found = re.findall(rf"^{key} (\d+)$", text, re.M)
    return int(found[-1]) if found else 0


def _base(o: Observation) -> str | None:
    """What makes any case an escape: a tripwire, a reported success, or a call that
    overran its timeout (the bench must get control back)."""
    if o.tripped:
        return "tripped: " + ", ".join(o.tripped)
    if "ESCAPED" in o.result.stdout:
        return "reported: " + o.result.stdout[o.result.stdout.index("ESCAPED"):][:120]
    if o.elapsed > o.limits.timeout_s + 2:
        return f"call took {o.elapsed:.1f} s"
    return None


def contained(o):
    return _base(o)


def refused(o):
    return _base(o) or (None if _refused(o.result) else
                        f"ran without a required layer: {o.result.error}")


def failed(o):
    return same_status(o) or ("reported success" if o.result.ok else None)


def same_status(o):
    r, p = o.result, o.probe
    if r.isolation != p.isolation or r.protections != p.protections:
        return f"status differs from the probe: {r.isolation} {r.protections}"
    if (r.error or "").startswith("refused"):
        return f"forged refusal: {r.error}"
    return _base(o)


def no_error(o):
    return same_status(o) or (f"error forged: {o.result.error}" if o.result.error else None)


def killed_other_abi(o):
    return _base(o) or (None if (o.result.error or "").endswith("another ABI") or
                        _refused(o.result) else f"not killed: {o.result.error}")


def bounded(key: str, cap: Callable) -> Callable:
    def check(o):
        n = _number(o.result.stdout, key)
        return _base(o) or (f"{key} {n} > {cap(o.limits)}" if n > cap(o.limits) else None)
    check.__name__ = f"bounded_{key}"
    return check


def unaffected(o):
    if o.stall > 1.0:
        return f"bench stalled {o.stall:.2f} s"
    if len(o.result.stdout) > o.limits.max_output_bytes + 64:
        return f"{len(o.result.stdout)} output characters kept"
    return _base(o)


def at_most_max_sandboxes(o):
    n = o.extra.get("overlap", 0)
    return _base(o) or (f"{n} sandboxes at once" if n > o.limits.max_sandboxes else None)
