"""From the reward function's numbers to what the trainer sees (host-side, numpy).

DAPO's soft overlong punishment (`trainer.overlong_buffer`, `overlong_penalty`) is
added to each sample's reward; DAPO's dynamic sampling drops a group whose shaped
rewards are all equal (`has_signal`).
"""

from __future__ import annotations

import numpy as np


def overlong_penalty(response_lens, max_len: int, buffer: int, factor: float = 1.0):
    """DAPO's soft overlong punishment, added to a sample's reward.

    0 up to ``max_len - buffer`` tokens, then falling linearly to ``-factor`` at
    ``max_len`` (``factor * ((max_len - buffer) - L) / buffer``); ``buffer = 0``
    switches it off. numpy in, numpy out."""
    lens = np.asarray(response_lens, np.float64)
    if not buffer:
        return np.zeros_like(lens, np.float32)
    over = np.clip(lens - (max_len - buffer), 0, buffer)
    return (-factor * over / buffer).astype(np.float32)


def shaped_rewards(rewards, response_lens, max_len: int, buffer: int,
                   factor: float = 1.0) -> tuple[list, list]:
    """(rewards plus their overlong punishment, the punishments), as float lists."""
    penalties = [float(p) for p in overlong_penalty(response_lens, max_len, buffer, factor)]
    return [float(r) + p for r, p in zip(rewards, penalties)], penalties


def has_signal(shaped) -> bool:
    """False if every shaped reward of a group is equal: every group-relative
    advantage is then 0, and the group teaches nothing (DAPO's dynamic sampling)."""
    return max(shaped) != min(shaped)
