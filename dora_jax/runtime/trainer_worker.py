"""The trainer's own loop: one thread, beside the slices' (worker.py).

It owns the trainer and the trajectory stream that feeds it: the coordinator hands
it a step's scored groups (`submit`) and never waits on it; the loop trains on each
batch the stream forms, copies the published params (the next step donates the
trainer's own buffers), reads the step's metrics (its only host sync) and posts
`StepDone`, or `Failed(TRAINER, error)` if anything raises.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import jax

from dora_jax.base.timeline import Timeline
from dora_jax.runtime.events import TRAINER, Failed, StepDone
from dora_jax.runtime.faults import NO_FAULTS, Faults
from dora_jax.runtime.stream import GroupQueue, train_batches

if TYPE_CHECKING:
    from dora_jax.config import Config
    from dora_jax.rl.trainer import Trainer
    from dora_jax.rollout.trajectory import Trajectory
    from dora_jax.runtime.saves import BackgroundSaves


class SentBatch(NamedTuple):
    """What the coordinator keeps of a step handed to the trainer until it is done."""

    group_ids: tuple
    wait: float  # seconds the trainer was idle before this batch
    wait_split: dict  # of them, by cause (report.WaitClock)
    episodes: dict | None  # the batch's multi-turn episode figures (report.episode_record)


class TrainerWorker:
    """Runs the trainer's steps in its own thread; see the module docstring.

    Args:
      trainer: an `rl.trainer.Trainer`.
      cfg: the run's validated config (batch shape and length buckets).
      events: the coordinator's event queue.
      timeline: where train spans go (row `trainer`).
      clock: seconds since the run started.
      saves: the run's BackgroundSaves or None; a step waits for the last save's copy
        of the train state before donating it.
      faults: where a drill fails the run on purpose at the `train` point (faults.py).
    """

    def __init__(self, trainer: Trainer, cfg: Config, events: queue.Queue, timeline: Timeline,
                 clock: Callable[[], float], *, saves: BackgroundSaves | None = None,
                 faults: Faults = NO_FAULTS) -> None:
        self.trainer, self.cfg, self._events = trainer, cfg, events
        self.timeline, self.clock, self._saves, self._faults = timeline, clock, saves, faults
        self._adapters_only = cfg.model.lora.enabled  # a LoRA publish: the adapters
        self._stream = GroupQueue()
        self.doing: tuple[str, float] = ("starting", 0.0)
        self._thread = threading.Thread(target=self._loop, name="trainer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, step: int, trajectories: list[Trajectory]) -> None:
        """Hands over step `step`'s trajectories (every group scored)."""
        self._stream.put(step, trajectories)

    def close(self) -> None:
        """Ends the stream: the loop stops once a step under way has finished."""
        self._stream.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        c = self.cfg
        stream = train_batches(self._stream, group_size=c.coordinator.group_size,
                               num_groups=c.coordinator.train_batch_size,
                               length_buckets=c.trainer.length_buckets,
                               pad_id=c.rollout.pad_id)
        try:
            self.doing = ("waiting for a batch", self.clock())
            for step, batch in stream:
                # A checkpoint of the last step may still be copying its buffers.
                copy_wait = 0.0 if self._saves is None else self._saves.wait_copied()
                start = self.clock()
                self.doing = (f"training step {step}", start)
                self._faults.run_reached("train")
                metrics = self.trainer.train_step(batch)
                # A copy: the next step donates them.
                params = self.trainer.published_params(self._adapters_only)
                metrics = jax.device_get(metrics)  # the step's only host sync
                end = self.clock()
                self.timeline.add("trainer", "train", start, end, step)
                self._events.put(StepDone(step, batch, metrics, params, start, end,
                                          copy_wait))
                self.doing = ("waiting for a batch", end)
        except BaseException as e:  # noqa: BLE001 - surfaced by the coordinator
            self._events.put(Failed(TRAINER, e))
