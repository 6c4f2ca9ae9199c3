"""The arguments of an engine's prefill, checked, and the bucket of an extended
prefix (rollout/engine.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dora_jax.base.buckets import pick_bucket
from dora_jax.rollout import jetstream_compat

if TYPE_CHECKING:
    from dora_jax.config import RolloutConfig
    from dora_jax.rollout.state import Prefix


class Engine(Protocol):
    """What these checks read of an engine (rollout/engine.py), which calls them."""

    @property
    def buckets(self) -> tuple[int, ...]: ...
    @property
    def rollout_cfg(self) -> RolloutConfig: ...
    @property
    def max_decode_len(self) -> int: ...
    @property
    def max_prefill_length(self) -> int: ...
    @property
    def cache_length(self) -> int: ...


def checked(engine: Engine, padded_tokens: Sequence[int] | np.ndarray, true_length: int,
            num_generated: int, max_new_tokens: int | None,
            continued: bool) -> tuple[np.ndarray, np.int32]:
    """(tokens, the response-length limit) of a prefill's arguments on `engine`,
    checked; `continued`: the tokens extend a prefix (no prompt-length bound)."""
    buckets = engine.buckets
    tokens_T = jetstream_compat.rebucket(np.asarray(padded_tokens, np.int32), true_length,
                                         buckets, engine.rollout_cfg.pad_id, pick_bucket)
    if tokens_T.ndim != 1 or tokens_T.shape[0] not in buckets:
        raise ValueError(f"prefill: padded_tokens must be 1-D with length in "
                         f"{buckets}, got shape {tokens_T.shape}")
    if not 0 <= num_generated < engine.max_decode_len:
        raise ValueError(f"prefill: num_generated must be in [0, max_decode_len="
                         f"{engine.max_decode_len}), got {num_generated}")
    if not 0 <= true_length <= tokens_T.shape[0]:
        raise ValueError(f"prefill: true_length ({true_length}) must be in [0, padded "
                         f"length ({tokens_T.shape[0]})]")
    prompt_len = true_length - num_generated
    if not continued and not 1 <= prompt_len <= engine.max_prefill_length:
        raise ValueError(f"prefill: need 1 <= prompt length ({prompt_len}) <= "
                         f"max_prefill_length ({engine.max_prefill_length})")
    limit = np.int32(min(max_new_tokens or engine.max_decode_len, engine.max_decode_len))
    if limit <= num_generated:
        raise ValueError(f"prefill: max_new_tokens ({max_new_tokens}) must exceed "
                         f"num_generated ({num_generated})")
    return tokens_T, limit


def extended_length(engine: Engine, prefix: Prefix, tokens_T: np.ndarray) -> int:
    """The bucket of a prefix extended by a chunk: room for both padded lengths."""
    room = prefix.cache.length + tokens_T.shape[0]
    return (engine.cache_length if room >= engine.cache_length
            else pick_bucket(room, engine.buckets, "prefill buckets"))
