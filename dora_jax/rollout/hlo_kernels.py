"""Kernels a compiled program launches per run, counted from its optimised HLO text
(`compiled.as_text()`): every instruction that does work is one kernel (an XLA thunk:
a fusion, a copy, a dot, a scatter, a collective...); a while loop counts its body
once per iteration and its condition once more than that (XLA records the trip count
of the loops it can bound); a call counts what it calls, a conditional its largest
branch. Shape plumbing (parameters, constants, tuples, bitcasts) launches nothing.

What a decode step costs beyond its bytes is mostly these launches, so the engine
reports them per token next to the bytes (Engine.step_cost). Pure text: no JAX.
"""

from __future__ import annotations

import functools
import re

# Instructions that move no data and launch nothing.
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "partition-id", "replica-id", "opt-barrier"})
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_OPCODE = re.compile(r"=\s.*?\s([a-z][a-z0-9\-]*)\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class UnboundedLoop(ValueError):
    """A while loop whose trip count XLA did not record."""


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines}, the entry computation's name)."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None and line.strip():
            comps[current].append(line)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return comps, entry


def count_kernels(hlo_text: str) -> int:
    """Kernels one run of the program launches (module docstring)."""
    comps, entry = computations(hlo_text)

    @functools.cache
    def kernels(name: str) -> int:
        total = 0
        for line in comps[name]:
            opcode = _OPCODE.search(line)
            if opcode is None or opcode.group(1) in FREE:
                continue
            op = opcode.group(1)
            if op == "while":
                trip = _TRIP.search(line)
                if trip is None:
                    raise UnboundedLoop(f"{name}: a while loop without a known trip count")
                n = int(trip.group(1))
                total += n * kernels(_called(line, "body")) + (n + 1) * kernels(
                    _called(line, "condition"))
            elif op == "call":
                total += kernels(_called(line, "to_apply"))
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [] if branches is None else [
                    b.strip().lstrip("%") for b in branches.group(1).split(",")]
                total += max((kernels(b) for b in names), default=0) + 1
            else:
                total += 1
        return total

    return kernels(entry)


def _called(line: str, attribute: str) -> str:
    found = re.search(rf"\b{attribute}=%?([\w.\-]+)", line)
    if found is None:
        raise ValueError(f"no {attribute}= in {line.strip()[:120]!r}")
    return found.group(1)
