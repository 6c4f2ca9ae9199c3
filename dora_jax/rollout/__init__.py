"""Rollout: a JetStream-style decode Engine and DecodeSlice (continuous batching,
resident policy version, migration, interrupt-and-reload)."""

from dora_jax.base.buckets import prefill_buckets
from dora_jax.rollout.engine import Engine
from dora_jax.rollout.sampling import SamplingParams, key_data_from_seed
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.rollout.state import DecodeState, EngineParams, Prefix, ResultTokens, SlotData
from dora_jax.rollout.trajectory import (
                                     InFlight,
                                     Request,
                                     RolloutError,
                                     SliceStats,
                                     SlotOverflowError,
                                     Trajectory,
                                     VersionMismatchError,
)

__all__ = [
    "DecodeSlice", "DecodeState", "Engine", "EngineParams", "InFlight", "Prefix", "Request",
    "ResultTokens", "RolloutError", "SamplingParams", "SliceStats", "SlotData",
    "SlotOverflowError",
    "Trajectory", "VersionMismatchError", "key_data_from_seed", "prefill_buckets",
]
