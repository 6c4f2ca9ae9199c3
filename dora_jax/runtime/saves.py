"""Checkpoint saves off the coordinator's thread.

A save has two parts: the device-to-host copy of the train state, which must end
before the trainer's next step donates those buffers, and everything else (Orbax's
bookkeeping, then the files, written in Orbax's own background thread). The
coordinator only hands a save over (`submit`); the saver thread runs it; the trainer
waits, before its next step, for the copy alone (`wait_copied`). So the slices keep
getting answers while a checkpoint is taken, and the trainer loses at most the copy.

One save runs at a time, in step order. A save that fails is raised by the next
`submit` or by `close` (the run stops: its checkpoints would otherwise silently end).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from dora_jax.model.checkpointing import Checkpointer
    from dora_jax.rl.trainer import TrainState

_STOP = object()


def _copied_to_host(state: Any) -> Any:
    """On the CPU backend, `state` as host arrays (a plain copy; Orbax's own copy
    costs ~0.1 s of bookkeeping per save on the tiny config, longer than a step);
    elsewhere `state` itself: Orbax copies each shard to the host in `save`, so that
    sharded states are never gathered on one host (a trainer over several processes
    gathers its state in `trainer_group.LeadCheckpointer.save`)."""
    leaves = jax.tree.leaves(state)
    if all(x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices())
           for x in leaves):
        return jax.device_get(state)
    return state


class SaveCadence:
    """When the periodic saves fall: after every `every` steps (0: none), each
    skipped while fewer than `min_seconds` have passed since the last save began
    (the run's start counts as one)."""

    def __init__(self, every: int, min_seconds: float, now: float) -> None:
        self.every, self.min_seconds = every, min_seconds
        self._last = now

    def due(self, steps_done: int, now: float) -> bool:
        """Whether a save is due once `steps_done` steps are trained, at time `now`."""
        return (bool(self.every) and steps_done % self.every == 0
                and now - self._last >= self.min_seconds)

    def saved(self, now: float) -> None:
        """A save began at `now`."""
        self._last = now


class BackgroundSaves:
    """Runs `checkpointer.save` calls on a thread of their own.

    Args:
      checkpointer: a `checkpointing.Checkpointer` (asynchronous: its `save` returns
        once the state is copied to the host, the files being written after).
      after_copy: called on the saver thread once a save's copy is done (the kill
        drill "save": the files are being written then).
    """

    def __init__(self, checkpointer: Checkpointer,
                 after_copy: Callable[[], None] = lambda: None) -> None:
        self._checkpointer, self._after_copy = checkpointer, after_copy
        self._queue: queue.Queue = queue.Queue()
        self._copied = threading.Event()  # of the save handed over last
        self._copied.set()  # nothing to copy yet
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="checkpoint saves",
                                        daemon=True)
        self._thread.start()

    def submit(self, step: int, state: TrainState, extra: dict) -> None:
        """Hands over the save of `state` (not donated until its copy is done: the
        trainer calls `wait_copied` first) as checkpoint `step`."""
        self._raise_if_failed()
        self._copied = threading.Event()
        self._queue.put((step, state, extra, self._copied))

    def wait_copied(self) -> float:
        """Blocks until the save handed over last (if any) has copied the state to
        the host; returns the seconds waited."""
        copied = self._copied
        if copied.is_set():
            return 0.0
        start = time.perf_counter()
        copied.wait()
        return time.perf_counter() - start

    def close(self) -> None:
        """Waits for the saves handed over to be under way (their files may still be
        being written: `Checkpointer.close` waits for those) and raises the first
        that failed."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"a checkpoint save failed: {type(error).__name__}: "
                               f"{error}") from error

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            step, state, extra, copied = item
            del item
            try:
                host = _copied_to_host(state)
                if host is not state:
                    copied.set()  # the trainer may donate the device buffers now
                del state
                self._checkpointer.save(step, host, extra, force=True)
            except BaseException as e:  # noqa: BLE001 - raised on the coordinator's side
                self._error = e
                continue
            finally:
                copied.set()  # Orbax's own copy is done once `save` returns
            self._after_copy()
