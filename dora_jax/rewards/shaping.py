"""What is added to a sample's reward before training (host-side, numpy).

DAPO's soft overlong punishment (`trainer.overlong_buffer`, `overlong_penalty`).
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
