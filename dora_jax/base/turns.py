"""The turns of a multi-turn episode's response, and which tokens the model wrote.

An episode's record (`Trajectory.episode`, rollout/episodes.py) lists its turns as
ranges of response-token indices: ["model", start, end] for a model turn and
["env", start, end, seconds] for an observation the environment wrote (and the
seconds its call took). The ranges tile the response in order. Depends on nothing,
so the train batch, the ledger and the decode slices read the same rule.
"""

from __future__ import annotations


def model_token_mask(episode: dict | None, n: int) -> list:
    """1 for each of a response's n tokens the model sampled, 0 for observation
    tokens (a single-turn sample, `episode` None: all 1)."""
    mask = [1] * n
    for role, start, end, *_ in (episode or {}).get("turns", ()):
        if role == "env":
            mask[start:end] = [0] * (end - start)
    return mask


def check_turns(episode: dict, n: int) -> str | None:
    """Why `episode`'s turns do not tile a response of n tokens in order (model
    turns first and last, roles alternating), or None if they do."""
    at, previous = 0, None
    for i, turn in enumerate(episode.get("turns", ())):
        role, start, end = turn[0], turn[1], turn[2]
        if role not in ("model", "env") or role == previous:
            return f"turn {i}: role {role!r} after {previous!r}"
        if start != at or end < start:
            return f"turn {i}: tokens [{start}, {end}) do not follow token {at}"
        at, previous = end, role
    if at != n:
        return f"the turns cover {at} tokens, the response has {n}"
    if previous != "model" and n:
        return "the last turn is not the model's"
    return None
