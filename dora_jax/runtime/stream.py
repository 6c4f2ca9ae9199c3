"""The trajectory stream: finished groups flow to the trainer through Grain.

The scheduler decides which groups each step consumes; the runtime puts those
groups (with their rewards) on a queue, and the trainer thread iterates a Grain
`IterDataset` over that queue whose `map` pads each batch of exactly TBS groups to a
length bucket. The stream holds no state a resume needs: a checkpoint is taken
between steps, with no batch in it, and the groups it would carry are in the group
book (runtime/groups.py).
"""

from __future__ import annotations

import queue
from collections.abc import Sequence

import grain

from dora_jax.rl.batch import TrainBatch
from dora_jax.rollout.trajectory import Trajectory

_END = object()


class _QueueIterator(grain.DatasetIterator):
    def __init__(self, q: queue.Queue) -> None:
        super().__init__()
        self._queue = q
        self._delivered = 0

    def __next__(self) -> tuple[int, list[Trajectory]]:
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        self._delivered += 1
        return item

    def get_state(self) -> dict:
        return {"delivered": self._delivered}

    def set_state(self, state: dict) -> None:
        self._delivered = state["delivered"]


class GroupQueue(grain.IterDataset):
    """A Grain IterDataset whose elements are `(step, [Trajectory, ...])` put by the
    runtime; iteration blocks until the next batch arrives and ends at `close()`."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: queue.Queue = queue.Queue()

    def put(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        self._queue.put((step, list(trajectories)))

    def close(self) -> None:
        self._queue.put(_END)

    def __iter__(self) -> _QueueIterator:
        return _QueueIterator(self._queue)


def train_batches(groups: GroupQueue, *, group_size: int, num_groups: int,
                  length_buckets: Sequence[int], pad_id: int) -> grain.IterDataset:
    """`(step, TrainBatch)` elements: each exactly `num_groups` groups, padded to the
    smallest length bucket that holds its longest trajectory."""

    def to_batch(item: tuple[int, list[Trajectory]]) -> tuple[int, TrainBatch]:
        step, trajectories = item
        batch = TrainBatch.from_trajectories(trajectories, group_size=group_size,
                                             length_buckets=length_buckets, pad_id=pad_id)
        if batch.num_groups != num_groups:
            raise ValueError(f"step {step}: {batch.num_groups} groups, expected {num_groups}")
        return step, batch

    return groups.map(to_batch)
