"""What one run of a compiled program costs, counted from its optimised HLO text
(`compiled.as_text()`): the kernels it launches and the bytes they access.

Kernels: every instruction that does work is one (an XLA thunk: a fusion, a copy, a
dot, a scatter, a collective...). Bytes: what each such instruction reads and
writes, as XLA's cost analysis counts them (its operands and its result; of an
operand that a fusion or an instruction only slices or gathers from, the part it
takes), except that an update in place (a dynamic-update-slice or a scatter, alone
or at a fusion's root, into an operand whose buffer it reuses) accesses its update
and not the whole buffer. Either way, a while loop counts its body once per
iteration and its condition once more than that (XLA records the trip count of the
loops it can bound); a call counts what it calls, a conditional its largest branch.
Shape plumbing (parameters, constants, tuples, bitcasts) costs nothing.

Why not XLA's own cost analysis alone (`compiled.cost_analysis()`): it counts a while
loop's body once, whatever its trip count (a scan over 16 layers is charged one
layer's weights), and a scatter its whole operand even in place. Pure text: no JAX.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import NamedTuple

# Instructions that move no data and launch nothing.
FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                  "after-all", "partition-id", "replica-id", "opt-barrier"})
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(([^)]*)\)")
# XLA numbers long operand lists with comments: `f(%a, ..., /*index=5*/%f, ...)`.
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}
# Instructions that read only part of their first operand: what they take.
_TAKES_PART = frozenset({"slice", "dynamic-slice", "gather"})
# Updates in place: (the updated operand, the update) of each.
_IN_PLACE = {"dynamic-update-slice": (0, 1), "scatter": (0, 2)}
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


class _Instruction(NamedTuple):
    name: str
    shape: str  # the result's type, e.g. f32[8,64]{1,0} or a tuple of them
    op: str
    operands: tuple[str, ...]
    line: str


def _parse(line: str) -> _Instruction | None:
    found = _INSTRUCTION.match(line)
    if found is None:
        return None
    name, shape, op, operands = found.groups()
    return _Instruction(name, shape, op, tuple(_COMMENT.sub("", o).strip().lstrip("%")
                                               for o in operands.split(",")), line)


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = _BITS.get(dtype) or int(re.sub(r"\D.*", "", dtype[1:]) or 8)
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def count_kernels(hlo_text: str) -> int:
    """Kernels one run of the program launches (module docstring)."""
    return _walk(hlo_text, lambda instruction, program: 1)


def count_bytes(hlo_text: str) -> int:
    """Bytes one run of the program accesses (module docstring)."""
    return _walk(hlo_text, lambda instruction, program: program.bytes_of(instruction))


def bounded_counts(hlo_text: str) -> tuple[int, int] | tuple[None, None]:
    """(count_bytes, count_kernels), or (None, None) for a program with a loop of
    unknown trip count (a Pallas kernel run in its interpreter)."""
    try:
        return count_bytes(hlo_text), count_kernels(hlo_text)
    except UnboundedLoop:
        return None, None


class _Program:
    """A module's instructions by computation, and their result types by name."""

    def __init__(self, hlo_text: str) -> None:
        comps, self.entry = computations(hlo_text)
        self.instructions = {name: [i for i in map(_parse, lines) if i is not None]
                             for name, lines in comps.items()}
        self.shapes = {i.name: i.shape for instrs in self.instructions.values() for i in instrs}

    def operand_bytes(self, name: str) -> int:
        return _nbytes(self.shapes.get(name, ""))

    def bytes_of(self, instruction: _Instruction) -> int:
        """What one instruction (not a loop, call or branch) reads and writes."""
        ops, op = instruction.operands, instruction.op
        if op == "conditional":  # its branches are counted apart; it reads its predicate
            return self.operand_bytes(ops[0])
        if op == "fusion":
            return self._fusion_bytes(instruction)
        if op in _IN_PLACE:
            buffer = _IN_PLACE[op][0]
            return (sum(self.operand_bytes(o) for k, o in enumerate(ops) if k != buffer)
                    + _nbytes(self.written(instruction)))
        read = [self.operand_bytes(o) for o in ops]
        if op in _TAKES_PART:
            read[0] = min(read[0], _nbytes(instruction.shape))
        return sum(read) + _nbytes(instruction.shape)

    def written(self, instruction: _Instruction) -> str:
        """The type of what an instruction writes: its result's, or an update in
        place's update's."""
        if instruction.op in _IN_PLACE:
            return self.shapes[instruction.operands[_IN_PLACE[instruction.op][1]]]
        if instruction.op == "fusion":
            in_place = self._fused_update(instruction)
            if in_place is not None:
                return in_place[1]
        return instruction.shape

    def _fused(self, fusion: _Instruction) -> tuple[list[_Instruction], dict[str, int]]:
        """A fusion's instructions, and its parameters' operand indices by name."""
        fused = self.instructions[_called(fusion.line, "calls")]
        return fused, {i.name: int(i.operands[0]) for i in fused if i.op == "parameter"}

    def _fused_update(self, fusion: _Instruction) -> tuple[int, str] | None:
        """(the operand updated in place, the update's type) of a fusion whose root
        updates one of its operands in place; None for any other."""
        fused, params = self._fused(fusion)
        root = next(i for i in fused if i.line.lstrip().startswith("ROOT"))
        if root.op not in _IN_PLACE or root.operands[_IN_PLACE[root.op][0]] not in params:
            return None
        buffer, update = _IN_PLACE[root.op]
        return params[root.operands[buffer]], self.shapes[root.operands[update]]

    def _fusion_bytes(self, fusion: _Instruction) -> int:
        fused, params = self._fused(fusion)
        in_place = self._fused_update(fusion)
        updated, total = ((None, _nbytes(fusion.shape)) if in_place is None
                          else (in_place[0], _nbytes(in_place[1])))
        by_index = {k: name for name, k in params.items()}
        for k, operand in enumerate(fusion.operands):
            if k == updated:
                continue
            full = self.operand_bytes(operand)
            uses = [i for i in fused if by_index.get(k) in i.operands]
            if uses and all(i.op in _TAKES_PART and i.operands[0] == by_index[k] for i in uses):
                full = min(full, sum(_nbytes(i.shape) for i in uses))
            total += full
        return total


def arrays_written(hlo_text: str) -> dict[str, list[tuple[int, ...]]]:
    """The shapes of the arrays each instruction that does work writes, by name: the
    entry's instructions, those of loop bodies and of called computations (not those
    inside a fusion, which write nothing of their own). An update in place writes
    its update."""
    program = _Program(hlo_text)
    fused = {_called(i.line, "calls") for instrs in program.instructions.values()
             for i in instrs if i.op == "fusion"}
    return {i.name: [tuple(int(d) for d in dims.split(",") if d)
                     for _, dims in _ARRAY.findall(program.written(i))]
            for name, instrs in program.instructions.items() if name not in fused
            for i in instrs if i.op not in FREE and i.op not in ("while", "call", "conditional")}


def _walk(hlo_text: str, cost: Callable[[_Instruction, _Program], int]) -> int:
    """cost(instruction) summed over one run: loops by their trip counts, calls into
    what they call, a conditional's largest branch (and itself as one kernel)."""
    program = _Program(hlo_text)

    @functools.cache
    def total(name: str) -> int:
        out = 0
        for instruction in program.instructions[name]:
            op, line = instruction.op, instruction.line
            if op in FREE:
                continue
            if op == "while":
                trip = _TRIP.search(line)
                if trip is None:
                    raise UnboundedLoop(f"{name}: a while loop without a known trip count")
                n = int(trip.group(1))
                out += n * total(_called(line, "body")) + (n + 1) * total(
                    _called(line, "condition"))
            elif op == "call":
                out += total(_called(line, "to_apply"))
            elif op == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                names = [] if branches is None else [
                    b.strip().lstrip("%") for b in branches.group(1).split(",")]
                out += max((total(b) for b in names), default=0) + cost(instruction, program)
            else:
                out += cost(instruction, program)
        return out

    return total(program.entry)


def _called(line: str, attribute: str) -> str:
    found = re.search(rf"\b{attribute}=%?([\w.\-]+)", line)
    if found is None:
        raise ValueError(f"no {attribute}= in {line.strip()[:120]!r}")
    return found.group(1)
