"""A multi-turn task with feedback: find a hidden number from "higher" / "lower".

The environment picks a number in [1, 16]; each model turn guesses one (the last
integer in the turn's text) and hears "higher", "lower", or nothing more: a right
guess ends the episode with reward 1. Six turns are enough for a binary search
(four guesses always suffice) and too few for a sweep, so the reward measures
how well the policy uses what it is told. A turn without a number ends the episode
with reward 0. `info` counts `guesses` and `found`.
"""

from __future__ import annotations

import re

from dora_jax.envs import base

LOW, HIGH = 1, 16
_NUMBER = re.compile(r"-?\d{1,6}")


@base.register("guess")
class GuessTheNumber(base.Environment):
    max_turns = 6

    def reset(self, record: dict) -> str:
        self.secret = int(record["secret"])
        return f"I picked a number from {LOW} to {HIGH}. Guess it; I say higher or lower."

    def step(self, action: str) -> base.StepResult:
        numbers = _NUMBER.findall(action[-64:])
        if not numbers:
            return base.StepResult("", 0.0, True, {"malformed": 1})
        guess = int(numbers[-1])
        if guess == self.secret:
            return base.StepResult("", 1.0, True, {"guesses": 1, "found": 1})
        return base.StepResult("higher" if guess < self.secret else "lower", 0.0, False,
                               {"guesses": 1})

    @classmethod
    def records(cls, num: int, seed: int) -> list[dict]:
        rng = base.record_rng(seed, "guess")
        return [{"prompt_id": f"guess-{seed}-{i}", "secret": int(s), "answer": str(int(s))}
                for i, s in enumerate(rng.integers(LOW, HIGH + 1, size=num))]

    @classmethod
    def demonstration(cls, record: dict) -> list[tuple[str, str]]:
        """A binary search to the secret."""
        lo, hi, secret, turns = LOW, HIGH, int(record["secret"]), []
        while True:
            mid = (lo + hi) // 2
            turns.append(("model", str(mid)))
            if mid == secret:
                return turns
            turns.append(("env", "higher" if mid < secret else "lower"))
            lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)
