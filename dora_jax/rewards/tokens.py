"""Rewards of response tokens, by name: `reward_fn(name)` (config.TOKEN_REWARDS).

A token reward is `(record, response_tokens) -> float`; the tasks whose records
they read are dora_jax/tasks' residue, countdown and jsonl. Token ids 0, 1, 2 are
PAD, EOS and BOS in every built-in token task; symbols start at 3. They are here,
below the tasks, because the rewards read them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

PAD, EOS, BOS = 0, 1, 2
FIRST_SYMBOL = 3

RewardFn = Callable[[dict, Sequence[int]], float]


def residue_reward(record: dict, response: Sequence[int]) -> float:
    """Fraction of response tokens (EOS excluded) with id % modulus == target."""
    tokens = [t for t in response if t != EOS]
    if not tokens:
        return 0.0
    hits = sum(1 for t in tokens if t % record["modulus"] == record["target"])
    return hits / len(tokens)


def exact_match_reward(record: dict, response: Sequence[int]) -> float:
    """1.0 iff the response (EOS excluded) equals the record's `answer` tokens."""
    tokens = [t for t in response if t != EOS]
    return float(tokens == list(record["answer"]))


def countdown_target(record: dict) -> list[int]:
    """The correct response (EOS included) of a countdown record: n(L-1), ..., n(0),
    where number k is token FIRST_SYMBOL + k."""
    return [FIRST_SYMBOL + k for k in range(record["count"] - 1, -1, -1)] + [EOS]


def countdown_reward(record: dict, response: Sequence[int]) -> float:
    """Positions agreeing with the correct countdown (EOS included), over the longer of
    the two: 1.0 exactly for the countdown; stopping early or running on both cost."""
    target = countdown_target(record)
    hits = sum(a == b for a, b in zip(response, target))
    return hits / max(len(response), len(target))


REWARDS: dict[str, RewardFn] = {"residue": residue_reward, "exact_match": exact_match_reward,
                                "countdown": countdown_reward}


def reward_fn(name: str) -> RewardFn:
    """The token reward named `name`; ValueError naming the known ones."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return REWARDS[name]
