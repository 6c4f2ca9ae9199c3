"""Arithmetic with a tool: exact answers a small policy reaches by calling it.

Task: "a*b+c" with two-digit a, b and c (a 3-4 digit answer, which a small model
rarely multiplies out right by itself). The model may call a tool, then answers:

    model: <calc>37*41+12</calc>      env: 1529
    model: <answer>1529</answer>      (done: reward 1 if the number is right)

`calculator` answers `<calc>expression</calc>` with envs/calculator.py (an `ast`
whitelist, no eval); `python` answers `<python>code</python>` with what the code
prints, run in envs/sandbox.py's separate process. A turn with an answer ends the
episode; a turn with neither a call nor an answer ends it with reward 0. `info`
counts `tool_calls`, `tool_correct` (calls whose result is the answer) and
`answered`. `no_tool` is the same task without a tool (a single answering turn),
the baseline that measures what the tool gives.
"""

from __future__ import annotations

import re

from dora_jax.envs import base

_ANSWER = re.compile(r"<answer>\s*(-?\d{1,12})\s*</answer>")
_MAX_OBSERVATION = 200  # characters of a tool's output shown to the model


def _tagged(text: str, tag: str) -> str | None:
    """The text inside the first <tag>...</tag>, or None."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    start += len(tag) + 2
    end = text.find(f"</{tag}>", start)
    return None if end < 0 else text[start:end]


class _ToolArithmetic(base.Environment):
    max_turns = 3
    tool = ""  # the call's tag

    def reset(self, record: dict) -> str:
        self.answer = str(record["answer"])
        return (f"{record['expression']} = ? Call <{self.tool}></{self.tool}> if you need "
                f"to; answer as <answer></answer>.")

    def run_tool(self, text: str) -> str:
        raise NotImplementedError

    def step(self, action: str) -> base.StepResult:
        answered = _ANSWER.search(action)
        if answered:
            right = answered.group(1) == self.answer
            return base.StepResult("", float(right), True, {"answered": 1})
        call = _tagged(action, self.tool)
        if call is None:
            return base.StepResult("", 0.0, True, {"malformed": 1})
        result = self.run_tool(call)[:_MAX_OBSERVATION]
        return base.StepResult(result, 0.0, False,
                               {"tool_calls": 1, "tool_correct": int(result == self.answer)})

    @classmethod
    def records(cls, num: int, seed: int) -> list[dict]:
        rng = base.record_rng(seed, "arithmetic")
        out = []
        for i in range(num):
            a, b, c = (int(x) for x in rng.integers(10, 100, size=3))
            out.append({"prompt_id": f"arith-{seed}-{i}", "expression": f"{a}*{b}+{c}",
                        "answer": str(a * b + c)})
        return out

    @classmethod
    def demonstration(cls, record: dict) -> list[tuple[str, str]]:
        return [("model", cls.call_text(record)), ("env", str(record["answer"])),
                ("model", f"<answer>{record['answer']}</answer>")]

    @classmethod
    def call_text(cls, record: dict) -> str:
        raise NotImplementedError


@base.register("calculator")
class CalculatorArithmetic(_ToolArithmetic):
    """The arithmetic task with `<calc>expression</calc>`."""

    tool = "calc"

    def run_tool(self, text: str) -> str:
        from dora_jax.envs import calculator

        try:
            return calculator.evaluate(text)
        except calculator.CalculatorError as e:
            return f"error: {e}"

    @classmethod
    def call_text(cls, record: dict) -> str:
        return f"<calc>{record['expression']}</calc>"


@base.register("python")
class PythonArithmetic(_ToolArithmetic):
    """The arithmetic task with `<python>code</python>`: what the code prints, run in
    envs/sandbox.py at `sandbox_isolation`. A failed call shows its output (a
    traceback, say) and then the sandbox's own line on how it ended."""

    tool = "python"
    sandbox_isolation = "namespaces"

    def run_tool(self, text: str) -> str:
        from dora_jax.envs import sandbox

        result = sandbox.run_python(text, isolation=self.sandbox_isolation)
        if result.ok:
            return result.stdout.strip()
        # The output's last line explains the failure (a traceback's); the error is ours.
        last = (result.stdout.strip().splitlines() or [""])[-1][:_MAX_OBSERVATION // 2]
        return f"{last}\nerror: {result.error}".strip()

    @classmethod
    def call_text(cls, record: dict) -> str:
        return f"<python>print({record['expression']})</python>"


@base.register("no_tool")
class NoToolArithmetic(_ToolArithmetic):
    """The same task and records with no tool, one turn: the baseline that measures
    what the tool is worth (configs/multiturn.py:no_tool)."""

    max_turns = 1

    def reset(self, record: dict) -> str:
        self.answer = str(record["answer"])
        return f"{record['expression']} = ? Answer as <answer></answer>."

    def step(self, action: str) -> base.StepResult:
        answered = _ANSWER.search(action)
        if not answered:
            return base.StepResult("", 0.0, True, {"malformed": 1})
        return base.StepResult("", float(answered.group(1) == self.answer), True,
                               {"answered": 1})

    @classmethod
    def demonstration(cls, record: dict) -> list[tuple[str, str]]:
        return [("model", f"<answer>{record['answer']}</answer>")]
