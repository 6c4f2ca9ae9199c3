"""A finished group's rewards as the trainer sees them (the reward function's plus
DAPO's overlong punishment), and knowing, without waiting, when they are all in."""

from __future__ import annotations

import threading
from typing import Callable

from dora_jax.rl.losses import overlong_penalty


def penalties(cfg, group) -> list:
    """DAPO's overlong punishment per sample, in sample order (0 unless
    trainer.overlong_buffer). `group` holds `trajectories` by sample index."""
    t, ks = cfg.trainer, sorted(group.trajectories)
    return [float(p) for p in overlong_penalty(
        [len(group.trajectories[k].response_tokens) for k in ks],
        cfg.rollout.max_decode_len, t.overlong_buffer, t.overlong_penalty)]


def when_all_done(futures: list, callback: Callable[[], None]) -> None:
    """Calls `callback` once, in the thread that completes the last of `futures`."""
    left, lock = [len(futures)], threading.Lock()

    def done(_):
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            callback()

    for f in futures:
        f.add_done_callback(done)
