"""Padded-length buckets, shared by the decode engine (prefill) and the trainer
(train batches): each jitted function compiles once per bucket, not once per length.
"""

from __future__ import annotations

from collections.abc import Sequence


class BucketError(ValueError):
    """A sequence is longer than the largest bucket."""


def pick_bucket(length: int, buckets: Sequence[int], what: str = "buckets") -> int:
    """The smallest of `buckets` >= `length`; BucketError naming `what` if none is."""
    for b in sorted(buckets):
        if b >= length:
            return b
    raise BucketError(f"length {length} exceeds the largest bucket {max(buckets)} "
                      f"({what}={tuple(buckets)})")


def doubling_buckets(buckets: Sequence[int], limit: int) -> tuple:
    """`buckets` (capped at `limit`) extended by doubling up to `limit`: the prompt
    buckets plus room for re-prefilling prompt + tokens so far."""
    out = [min(b, limit) for b in buckets]
    while out[-1] < limit:
        out.append(min(2 * out[-1], limit))
    return tuple(sorted(set(out)))


def prefill_buckets(rollout) -> tuple:
    """A decode engine's padded prefill lengths (`rollout`: a RolloutConfig): the prompt
    buckets, then doubling buckets up to cache_length for re-prefilling prompt +
    tokens so far."""
    return doubling_buckets(rollout.prefill_buckets, rollout.cache_length)
