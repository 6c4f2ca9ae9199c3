"""A decode slice's own loop: one thread per slice, on its own clock.

The worker owns its `DecodeSlice` (engine, decode state, resident params): nothing
else touches them. It decodes while it holds work and, between generate calls,
applies the commands the coordinator sent — submit, load a version, interrupt and
reload, add or evict a version (a multi-version slice), export (migration out),
import (migration in), evaluate (evaluation.py) — then posts events to the
coordinator's queue: samples finished, version loaded, an evaluation generated,
failure.
A slice loading weights or receiving a migration never pauses another slice, and
the coordinator never waits on a slice's device work.

Refill: after posting finished samples the worker takes no generate call until the
coordinator's `ack`, which follows every command the coordinator sent in answer, so
slots freed by finished samples are refilled before the next generate call instead
of decoding empty. The coordinator answers every such event in its next decision
pass and never waits on a slice, so only this slice waits, for the coordinator's
reaction time, never for another slice.

Weights: a `load` carries the params as published on the trainer's mesh (or a future
of them, for the version in training); this loop places them on the slice's devices
(`DecodeSlice.load_version`), so a transfer holds neither the coordinator nor another
slice.

A migration goes from worker to worker: the source exports the request (KV cache,
tokens so far, RNG state) into a hand-over box that the coordinator queued, at the
same moment, as an `import` command on the destination. The destination therefore
applies the import in the coordinator's order: a later command for it (load a
version, migrate the request on) sees the request there, even if the source exports
late. It waits for the box when it reaches the import; there is no deadlock, since
the earliest pending export has only earlier hand-overs ahead of it. A request that
finished on the source before the export arrived is simply not exported: its
`finished` event, posted earlier on the same queue, already told the coordinator.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dora_jax.base.timeline import Timeline
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.rollout.trajectory import Request
from dora_jax.runtime.events import EvalGenerated, Failed, SamplesFinished, VersionLoaded
from dora_jax.runtime.faults import NO_FAULTS, Faults

if TYPE_CHECKING:
    from flax import nnx

    from dora_jax.runtime.evaluation import EvalDecoder

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
                 clock: Callable[[], float] = time.perf_counter,
                 faults: Faults = NO_FAULTS) -> None:
        self.slice = slice_
        self._faults = faults

        # Hand-over boxes of migrations out of this slice not yet filled:
        # box -> (request ids, destination worker).
        self.unfilled: dict = {}
        self._events, self._timeline, self._clock = events, timeline, clock
        self._awaiting_ack = False
        # What the loop is doing now and since when (run clock), for a stall report.
        self.doing: tuple[str, float] = ("starting", clock())
        self._commands: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
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

    def load(self, version: int, params: nnx.State | concurrent.futures.Future, *,
             interrupt: bool = False) -> None:
        """Make `version` resident; with `interrupt`, keep and re-prefill in-flight
        requests under it (partial_rollout). `params`: the version's params on any
        devices (this loop places them), or a `concurrent.futures.Future` of them (the
        version in training, partial_rollout_rounds): the slice then pauses, decoding
        nothing, until they are published."""
        self._commands.put(("reload" if interrupt else "load", (version, params)))

    def add(self, version: int, params: nnx.State | concurrent.futures.Future) -> None:
        """Multi-version slice: load `version` (params as for `load`, published) into
        a free place; the other versions' requests decode on meanwhile."""
        self._commands.put(("add", (version, params)))

    def evict(self, version: int) -> None:
        """Multi-version slice: free the place of `version`, which nothing here uses."""
        self._commands.put(("evict", version))

    def ack(self) -> None:
        """The coordinator has answered this worker's last finished event."""
        self._commands.put(("ack", None))

    def migrate(self, request_ids: list, dst: SliceWorker) -> None:
        """Export these requests (those still held) and import them into `dst`, in
        the order of the commands each worker receives (see the module docstring)."""
        box: queue.Queue = queue.Queue(maxsize=1)
        self.unfilled[id(box)] = (box, request_ids, dst)
        self._commands.put(("export", (request_ids, box)))
        dst._commands.put(("import", box))

    def export(self, request_ids: list) -> queue.Queue:
        """Export these requests (those still held) into the returned box, for a
        slice in another process (remote.py); nothing here waits for it."""
        box: queue.Queue = queue.Queue(maxsize=1)
        self._commands.put(("export", (request_ids, box)))
        return box

    def take(self, inflights: list) -> None:
        """Import requests exported by a slice in another process, in command order."""
        box: queue.Queue = queue.Queue(maxsize=1)
        box.put(inflights)
        self._commands.put(("import", box))

    def release_hand_overs(self) -> list:
        """After this worker failed: every destination waiting for one of its hand-overs
        gets nothing. Returns (request id, destination slice id) of what they awaited."""
        awaited = []
        for box, request_ids, dst in list(self.unfilled.values()):
            box.put([])
            awaited += [(rid, dst.slice_id) for rid in request_ids]
        return awaited

    def evaluate(self, decoder: EvalDecoder, version: int,
                 params: nnx.State | concurrent.futures.Future, records: list) -> None:
        """Between two generate calls, generate an evaluation of `version` (`params`
        as published) on `records` with `decoder` (runtime/evaluation.py), then post
        `EvalGenerated`. This slice's own requests wait meanwhile."""
        self._commands.put(("eval", (decoder, version, params, records)))

    def stop(self, timeout: float = 600.0) -> None:
        self._stopping.set()
        self._commands.put((_STOP, None))
        self._thread.join(timeout)

    # ------------------------------------------------------------ the loop (own thread)

    def _loop(self) -> None:
        sl = self.slice
        try:
            while True:
                # Block for a command when there is nothing to decode, or while the
                # coordinator answers finished samples.
                while True:
                    block = sl.idle or self._awaiting_ack
                    if block:
                        self._mark("awaiting the coordinator's answer" if self._awaiting_ack
                                   else "idle")
                    try:
                        kind, arg = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if kind is _STOP:
                        return
                    self._apply(kind, arg)
                start, version, slots = self._clock(), sl.version, sl.running_by_version()
                self._mark(f"decoding {sl.num_requests} request(s) under version(s) "
                           f"{sorted(slots) or [version]}")
                self._faults.slice_reached("generate", self.slice_id)
                finished = sl.step()
                busiest = max(slots, default=version)
                assert busiest is not None  # a slice that decodes holds a version
                self._timeline.add(self._row, "decode", start, self._clock(), busiest, slots)
                if finished:
                    self._awaiting_ack = True
                    self._events.put(SamplesFinished(self.slice_id, finished,
                                                     sl.kv_free_tokens))
        except BaseException as e:  # noqa: BLE001 - reported, the coordinator decides
            self._events.put(Failed(self.slice_id, e))

    def _mark(self, what: str) -> None:
        self.doing = (what, self._clock())

    def _apply(self, kind: str, arg: Any) -> None:  # arg: what the command `kind` takes
        sl = self.slice
        if kind != "ack":
            self._mark(f"applying {kind}")
        if kind == "ack":
            self._awaiting_ack = False
        elif kind == "submit":
            sl.submit(arg)
        elif kind in ("load", "reload", "add"):
            version, params = arg
            if isinstance(params, concurrent.futures.Future):
                self._mark(f"waiting for version {version} to be published")
                params = self._wait_for_params(params)
                if params is None:
                    return  # stopping before the version was published
            start = self._clock()
            self._faults.slice_reached("load", self.slice_id)
            if kind == "reload":
                sl.interrupt_and_reload(version, params)
            elif kind == "add":
                sl.add_version(version, params)
            else:
                sl.load_version(version, params)
            self._timeline.add(self._row, "load", start, self._clock(), version)
            self._events.put(VersionLoaded(self.slice_id, version))
        elif kind == "evict":
            sl.evict_version(arg)
        elif kind == "export":
            request_ids, box = arg
            start = self._clock()
            held = [r for r in request_ids if sl.holds(r)]
            if held:  # a migration leaves
                self._faults.slice_reached("export", self.slice_id)
            # On a failure the box stays unfilled: the coordinator releases it and
            # regenerates the samples it would have carried (`release_hand_overs`),
            # or, past the restart limit, the destination stops waiting at shutdown.
            moving = sl.export_requests(held)
            box.put(moving)
            self.unfilled.pop(id(box), None)
            if moving:
                self._timeline.add(self._row, "migrate", start, self._clock(),
                                   _held_version(sl))
        elif kind == "import":
            moving = self._wait_for(arg)
            if moving:
                self._faults.slice_reached("import", self.slice_id)
                start = self._clock()
                sl.import_requests(moving)
                self._timeline.add(self._row, "migrate", start, self._clock(),
                                   _held_version(sl))
        elif kind == "eval":
            decoder, version, params, records = arg
            if sl.engine.versions == 1 and sl.version == version and sl.params is not None:
                params = sl.params  # resident already: no transfer
            start = self._clock()
            greedy, sampled = decoder.generate(version, params, records)
            end = self._clock()
            self._timeline.add(self._row, "eval", start, end, version)
            self._events.put(EvalGenerated(self.slice_id, version, greedy, sampled, start, end))
        else:  # pragma: no cover - only the methods above enqueue commands
            raise ValueError(f"unknown command {kind!r}")

    def _wait_for_params(self, box: concurrent.futures.Future) -> nnx.State | None:
        """The params the weight book puts in `box` on publication (None if this
        worker stops first)."""
        while not self._stopping.is_set():
            try:
                return box.result(timeout=0.05)
            except concurrent.futures.TimeoutError:
                continue
        return None

    def _wait_for(self, box: queue.Queue) -> list:
        """The requests a source exported into `box` (none if this worker stops first)."""
        while not self._stopping.is_set():
            try:
                return box.get(timeout=0.05)
            except queue.Empty:
                continue
        return []


def _held_version(sl: DecodeSlice) -> int:
    """The version of a slice that holds requests (it always has one loaded)."""
    assert sl.version is not None
    return sl.version
