"""A decode slice's own loop: one thread per slice, on its own clock.

The worker owns its `DecodeSlice` (engine, decode state, resident params): nothing
else touches them. It decodes while it holds work and, between generate calls,
applies the commands the coordinator sent — submit, load a version, interrupt and
reload, export (migration out), import (migration in) — then posts events to the
coordinator's queue: samples finished, version loaded, failure.
A slice loading weights or receiving a migration never pauses another slice, and
the coordinator never waits on a slice's device work.

Refill: after posting finished samples the worker waits (at most `refill_wait`
seconds) for the coordinator's `ack`, which follows every command the coordinator
sent in answer, so slots freed by finished samples are refilled before the next
generate call instead of decoding empty. Only this slice waits, for the
coordinator's reaction time, never for another slice.

A migration goes from worker to worker: the source exports the request (KV cache,
tokens so far, RNG state) and hands it straight to the destination's command queue.
A request that finished on the source before the export arrived is simply not
exported: its `finished` event, posted earlier on the same queue, already told the
coordinator.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Callable

from dora_jax.rollout.slice import DecodeSlice
from dora_jax.rollout.trajectory import Request
from dora_jax.timeline import Timeline


@dataclasses.dataclass(frozen=True)
class Event:
    """What a worker (or the trainer) tells the coordinator.

    kind: "finished" (data: list of Trajectory), "loaded" (data: version),
    "failed" (data: the exception), "step" (the trainer: data is its step record).
    Migrations post nothing: the slices' own counters record them.
    source: the slice id, or "trainer".
    """

    kind: str
    source: Any
    data: Any = None


_STOP = object()


class SliceWorker:
    """Runs one `DecodeSlice` in its own thread; see the module docstring.

    Args:
      slice_: the slice (already holding its initial version).
      events: the coordinator's event queue.
      timeline: where decode, load and migration spans go (row `slice <id>`).
      clock: seconds since the run started.
    """

    def __init__(self, slice_: DecodeSlice, events: queue.Queue, timeline: Timeline,
                 clock: Callable[[], float] = time.perf_counter, refill_wait: float = 0.05):
        self.slice = slice_
        self._events, self._timeline, self._clock = events, timeline, clock
        self._refill_wait = refill_wait
        self._awaiting_ack = False
        self._commands: queue.Queue = queue.Queue()
        self._row = f"slice {slice_.slice_id}"
        self._thread = threading.Thread(target=self._loop, name=self._row, daemon=True)

    @property
    def slice_id(self) -> int:
        return self.slice.slice_id

    # ------------------------------------------------------------ commands (any thread)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        self._commands.put(("submit", request))

    def load(self, version: int, params, *, interrupt: bool = False) -> None:
        """Make `version` resident; with `interrupt`, keep and re-prefill in-flight
        requests under it (partial_rollout)."""
        self._commands.put(("reload" if interrupt else "load", (version, params)))

    def ack(self) -> None:
        """The coordinator has answered this worker's last finished event."""
        self._commands.put(("ack", None))

    def migrate(self, request_ids: list, dst: "SliceWorker") -> None:
        """Export these requests (those still held) and import them into `dst`."""
        self._commands.put(("export", (request_ids, dst)))

    def stop(self, timeout: float = 600.0) -> None:
        self._commands.put((_STOP, None))
        self._thread.join(timeout)

    # ------------------------------------------------------------ the loop (own thread)

    def _loop(self):
        sl = self.slice
        try:
            while True:
                # Block for a command when there is nothing to decode, or (briefly)
                # while the coordinator answers finished samples.
                while True:
                    idle = sl.num_requests == 0
                    try:
                        kind, arg = self._commands.get(
                            block=idle or self._awaiting_ack,
                            timeout=None if idle else self._refill_wait)
                    except queue.Empty:
                        self._awaiting_ack = False
                        break
                    if kind is _STOP:
                        return
                    self._apply(kind, arg)
                start, version = self._clock(), sl.version
                finished = sl.step()
                self._timeline.add(self._row, "decode", start, self._clock(), version)
                if finished:
                    self._awaiting_ack = True
                    self._events.put(Event("finished", self.slice_id, finished))
        except BaseException as e:  # noqa: BLE001 - reported, the coordinator decides
            self._events.put(Event("failed", self.slice_id, e))

    def _apply(self, kind: str, arg):
        sl = self.slice
        if kind == "ack":
            self._awaiting_ack = False
        elif kind == "submit":
            sl.submit(arg)
        elif kind in ("load", "reload"):
            version, params = arg
            start = self._clock()
            if kind == "reload":
                sl.interrupt_and_reload(version, params)
            else:
                sl.load_version(version, params)
            self._timeline.add(self._row, "load", start, self._clock(), version)
            self._events.put(Event("loaded", self.slice_id, version))
        elif kind == "export":
            request_ids, dst = arg
            start = self._clock()
            moving = sl.export_requests([r for r in request_ids if sl.holds(r)])
            if moving:
                self._timeline.add(self._row, "migrate", start, self._clock(), sl.version)
                dst._commands.put(("import", moving))
        elif kind == "import":
            start = self._clock()
            sl.import_requests(arg)
            self._timeline.add(self._row, "migrate", start, self._clock(), sl.version)
        else:  # pragma: no cover - only the methods above enqueue commands
            raise ValueError(f"unknown command {kind!r}")
