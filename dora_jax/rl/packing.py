"""The rows a train step consumes: one sample per padded row, or samples packed.

A `TrainBatch` (batch.py) holds B samples, each prompt + response right-padded to the
batch's length bucket. The jitted step (trainer.py) consumes a layout of it:

  per token, [M, U, r, T]  (minibatch, micro-batch, row, position):
    tokens, positions (0 at each sample's first token), segment_ids (1, 2, ... for
    the samples of a row in order, 0 on padding), sample (the sample's index in the
    batch, -1 on padding), loss_mask, behaviour_logp, token_versions;
  per sample, [B]: rewards, versions, truncated;
  with an MoE policy, `routing` [M, U, r, T, MoE layers, k]: the experts the rollout
    recorded for each token (rollout/routing.py; none on prompts and padding).

`padded`: row i is sample i, T the batch's bucket, micro-batches cut by row count
(`trainer.micro_batches`): one long response makes every row as long as it.

`packed` (`trainer.tokens_per_microbatch` > 0): each minibatch's samples, whole, go
first-fit by decreasing length into rows of T = the batch's bucket; r ~
tokens_per_microbatch // T rows make a micro-batch, so a micro-batch's size (and the
step's peak memory) follows the token budget, not the longest response. U is the most
micro-batches a minibatch can need (one sample per row), so the step has one shape
per bucket (the trainer's warm-up compiles them) whatever the lengths; micro-batches
left empty are skipped by the step. Samples keep their minibatch (samples
[m B/M, (m+1) B/M), as in the padded layout), so both layouts make the same
optimizer updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dora_jax.rl.batch import BatchError, TrainBatch
from dora_jax.rollout import routing as routing_lib

if TYPE_CHECKING:
    from dora_jax.config.sections import TrainerConfig

TOKEN_ARRAYS = ("tokens", "positions", "segment_ids", "sample", "loss_mask",
                "behaviour_logp", "token_versions")
SAMPLE_ARRAYS = ("rewards", "versions", "truncated")
LAYOUT_KEYS = TOKEN_ARRAYS + SAMPLE_ARRAYS
# An MoE policy's routing records: (MoE layers, k, expert-id type).
RoutingSpec = tuple[int, int, routing_lib.IdType]


def _sample_arrays(batch: TrainBatch) -> dict:
    return dict(rewards=np.asarray(batch.rewards_B, np.float32),
                versions=np.asarray(batch.versions_B, np.int32),
                truncated=np.asarray(batch.truncated_B, bool))


def _routing(batch: TrainBatch, routing: RoutingSpec | None) -> np.ndarray | None:
    """The batch's recorded routing, or an unrecorded one of `routing`'s (MoE layers,
    k, dtype); None for a dense policy."""
    if routing is None:
        return None
    layers, k, dtype = routing
    B, T = batch.tokens_BT.shape
    if batch.routing_BTLK is None:
        return routing_lib.unrecorded((B, T, layers, k), dtype)
    if batch.routing_BTLK.shape[2:] != (layers, k):
        raise BatchError(f"routing_BTLK holds {batch.routing_BTLK.shape[2:]} (MoE layers, k) "
                         f"per token, the policy has {(layers, k)}")
    return batch.routing_BTLK.astype(dtype, copy=False)


def padded(batch: TrainBatch, num_minibatches: int, micro_batches: int,
           routing: RoutingSpec | None = None) -> dict:
    """One sample per row: rows [(m U + u) b, (m U + u + 1) b) form micro-batch (m, u)."""
    M, U = num_minibatches, micro_batches
    B, T = batch.tokens_BT.shape
    if B % (M * U):
        raise BatchError(f"batch size B={B} is not divisible by "
                         f"num_minibatches * micro_batches = {M} * {U}")
    valid_BT = np.arange(T)[None, :] < batch.seq_lens_B[:, None]
    rows = dict(tokens=batch.tokens_BT.astype(np.int32),
                positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)),
                segment_ids=valid_BT.astype(np.int32),
                sample=np.where(valid_BT, np.arange(B, dtype=np.int32)[:, None], -1),
                loss_mask=np.asarray(batch.loss_mask_BT, np.float32),
                behaviour_logp=np.asarray(batch.behaviour_logp_BT, np.float32),
                token_versions=np.asarray(batch.token_versions_BT, np.int32))
    recorded = _routing(batch, routing)
    if recorded is not None:
        rows["routing"] = recorded
    b = B // (M * U)
    out = {k: v.reshape((M, U, b, T) + v.shape[2:]) for k, v in rows.items()}
    out.update(_sample_arrays(batch))
    return out


def micro_batches_needed(batch_size: int, num_minibatches: int, rows_per_micro: int) -> int:
    """U of the packed layout: a minibatch of B/M samples fills at most B/M rows."""
    per_minibatch = batch_size // num_minibatches
    return -(-per_minibatch // rows_per_micro)


def first_fit_rows(lengths: Sequence[int] | np.ndarray, row_length: int) -> list[list[int]]:
    """Indices of `lengths` packed into rows of `row_length`, first fit by decreasing
    length (ties in index order); each row lists its samples in index order."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        if n > row_length:
            raise BatchError(f"a sample of {n} tokens does not fit a packed row of "
                             f"{row_length} (the largest trainer.length_buckets)")
        for j, free in enumerate(room):
            if n <= free:
                rows[j].append(i)
                room[j] -= n
                break
        else:
            rows.append([i])
            room.append(row_length - n)
    return [sorted(r) for r in rows]


def packed(batch: TrainBatch, num_minibatches: int, row_length: int,
           rows_per_micro: int, routing: RoutingSpec | None = None) -> dict:
    """Samples packed whole into rows of `row_length`, `rows_per_micro` rows per
    micro-batch, U = `micro_batches_needed` micro-batches per minibatch."""
    M, T, r = num_minibatches, row_length, rows_per_micro
    B = batch.batch_size
    if B % M:
        raise BatchError(f"batch size B={B} is not divisible by num_minibatches={M}")
    U = micro_batches_needed(B, M, r)
    shape = (M, U * r, T)
    tokens = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    sample = np.full(shape, -1, np.int32)
    loss_mask = np.zeros(shape, np.float32)
    behaviour = np.zeros(shape, np.float32)
    token_versions = np.zeros(shape, np.int32)
    recorded = _routing(batch, routing)
    routed = None if recorded is None else routing_lib.unrecorded(
        shape + recorded.shape[2:], recorded.dtype)
    lens = np.asarray(batch.seq_lens_B)
    per = B // M
    for m in range(M):
        first = m * per
        for row, members in enumerate(first_fit_rows(lens[first:first + per], T)):
            start = 0
            for seg, k in enumerate(members, start=1):
                i, n = first + k, int(lens[first + k])
                at = (m, row, slice(start, start + n))
                tokens[at] = batch.tokens_BT[i, :n]
                positions[at] = np.arange(n)
                segment_ids[at] = seg
                sample[at] = i
                loss_mask[at] = batch.loss_mask_BT[i, :n]
                behaviour[at] = batch.behaviour_logp_BT[i, :n]
                token_versions[at] = batch.token_versions_BT[i, :n]
                if routed is not None and recorded is not None:  # None together
                    routed[at] = recorded[i, :n]
                start += n
    rows = dict(tokens=tokens, positions=positions, segment_ids=segment_ids, sample=sample,
                loss_mask=loss_mask, behaviour_logp=behaviour, token_versions=token_versions)
    if routed is not None:
        rows["routing"] = routed
    out = {k: v.reshape((M, U, r, T) + v.shape[3:]) for k, v in rows.items()}
    out.update(_sample_arrays(batch))
    return out


def for_trainer(batch: TrainBatch, t: TrainerConfig, num_minibatches: int,
                trainer_version: int, batch_axes: tuple, n_shards: int,
                routing: RoutingSpec | None = None) -> dict:
    """Validates `batch` against the trainer's config and version, then lays it out:
    packed with `t.tokens_per_microbatch`, else padded rows [M, U, b, T]; `routing`
    (MoE layers, k, dtype) for an MoE policy."""
    if not isinstance(batch, TrainBatch):
        raise BatchError(f"expected a TrainBatch, got {type(batch).__name__}")
    M = num_minibatches
    buckets = tuple(t.length_buckets)
    if batch.length not in buckets:
        raise BatchError(f"batch length T={batch.length} is not one of "
                         f"trainer.length_buckets={buckets}; build batches with "
                         "TrainBatch.from_trajectories(length_buckets=...)")
    newest = int(batch.versions_B.max())
    if newest > trainer_version:
        raise BatchError(f"batch holds samples of policy version {newest}, newer than the "
                         f"trainer's version {trainer_version}")
    if t.tokens_per_microbatch > 0:
        # Rows as long as the batch's bucket, as many as the token budget holds
        # (a multiple of the batch shards): one shape per bucket, and a batch of
        # short samples is not spread over rows as long as the longest bucket.
        rows = max(n_shards, t.tokens_per_microbatch // batch.length // n_shards * n_shards)
        return packed(batch, M, batch.length, rows, routing)
    U = t.micro_batches
    arrays = padded(batch, M, U, routing)  # checks B % (M * U)
    B, b = batch.batch_size, batch.batch_size // (M * U)
    if b % n_shards:
        raise BatchError(f"micro-batch of {b} rows (B={B} / ({M} * {U})) must be divisible "
                         f"by the {n_shards} batch shards of the trainer mesh {batch_axes}")
    return arrays
