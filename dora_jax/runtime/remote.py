"""Decode slices in other processes, as the coordinator sees them.

The trainer's lead process listens for the slice processes (slice_process.py); each
says which slices it runs. For each remote slice the runtime gets a `RemoteSlice` (the
counters the reports read, mirrored from the slice process) and a `RemoteSliceWorker`
(the `SliceWorker` interface, its commands sent over the wire). A version's params go
device to device (weight_transfer.py); a migration between two processes carries the
sample (tokens so far, log-probs, versions) through the coordinator and the
destination prefills it again under the same version (C1), while one inside a process
moves its KV cache as in one process.

A slice process that dies or goes silent fails each of its slices (`Failed`): the
runtime regenerates their samples (C2) and the slices wait, their commands queued,
for a replacement process, which the launcher starts and which says `hello` with the
same process id.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dora_jax.base.timeline import Timeline
from dora_jax.rollout.trajectory import Request, SliceStats
from dora_jax.runtime import wire
from dora_jax.runtime.events import Failed, SamplesFinished, VersionLoaded
from dora_jax.runtime.weight_transfer import WeightOffers


class SliceProcessLost(RuntimeError):
    """A slice process died, closed its connection or stopped answering."""


@dataclasses.dataclass
class RemoteSlice:
    """What the coordinator's reports read of a slice run by another process."""

    slice_id: int
    process_id: int
    stats: SliceStats = dataclasses.field(default_factory=SliceStats)
    num_at_environment: int = 0

    def abandon(self) -> None:
        """Its process starts the slice again empty (slice_process.py)."""


class _Process:
    """One slice process's connection and the slices it runs."""

    def __init__(self, process_id: int, slice_ids: list[int]) -> None:
        self.process_id, self.slice_ids = process_id, slice_ids
        self.link: wire.Link | None = None
        self.ready = threading.Event()
        self.generation = 0  # replacements so far


class SliceProcesses:
    """The coordinator's side of every slice process (module docstring).

    `slice_ids_by_process`: {process id: slice ids}; `offers`: the staged weights;
    `current()`: (version, params) a starting process compiles with (and, at the
    run's start, keeps); `heartbeat_timeout`: seconds without a message before a
    process counts as hung.
    """

    def __init__(self, address: tuple[str, int], slice_ids_by_process: dict[int, list[int]],
                 offers: WeightOffers, current: Callable[[], tuple[int, Any]],
                 heartbeat_timeout: float = 60.0) -> None:
        self.offers, self.current = offers, current
        self._listener = wire.listen(address)
        self.address = self._listener.address
        self._procs = {p: _Process(p, ids) for p, ids in slice_ids_by_process.items()}
        self._proc_of = {i: self._procs[p] for p, ids in slice_ids_by_process.items()
                         for i in ids}
        self.slices = {i: RemoteSlice(i, p.process_id) for i, p in self._proc_of.items()}
        self._workers: dict[int, RemoteSliceWorker] = {}
        self._handovers: dict[int, tuple] = {}  # id -> (request ids, source, destination)
        self._numbers = itertools.count(1)
        self._base_sent: set = set()  # slices that hold the frozen LoRA base
        self._heartbeat_timeout = heartbeat_timeout
        self._closing = False
        self.replacements: list = []  # (process id, seconds from loss to ready)
        self._lost_at: dict[int, float] = {}
        # Slices of a lost process whose loss no worker has reported yet (lost before
        # the runtime made their workers): the next worker made reports it.
        self._unreported: dict[int, BaseException] = {}
        self._lock = threading.Lock()  # workers made against losses reported
        threading.Thread(target=self._accept, name="slice processes", daemon=True).start()

    # ----------------------------------------------------------- connections
    def _accept(self) -> None:
        while not self._closing:
            try:
                link = wire.accept(self._listener)
                kind, hello = link.recv()
            except (OSError, wire.WireError):
                continue
            proc = self._procs.get(int(hello.get("process_id", -1))) if kind == "hello" else None
            if proc is None or proc.link is not None:
                link.send("refused", reason=f"no slot for process {hello.get('process_id')}")
                link.close()
                continue
            proc.link = link
            version, params = self.current()
            link.send("init", slice_ids=proc.slice_ids, weights=self.offers.address,
                      version=version, keep=proc.generation == 0,
                      offers={i: self.offer(i, version, params) for i in proc.slice_ids})
            threading.Thread(target=self._read, args=(proc, link), daemon=True,
                             name=f"slice process {proc.process_id}").start()

    def wait_ready(self, timeout: float) -> None:
        """Blocks until every slice process has built and compiled its slices."""
        deadline = time.monotonic() + timeout
        for proc in self._procs.values():
            if not proc.ready.wait(max(0.0, deadline - time.monotonic())):
                raise SliceProcessLost(f"slice process {proc.process_id} (slices "
                                       f"{proc.slice_ids}) was not ready within {timeout:g} s")

    def _read(self, proc: _Process, link: wire.Link) -> None:
        try:
            while True:
                if not link.poll(self._heartbeat_timeout):
                    raise SliceProcessLost(f"slice process {proc.process_id} sent nothing "
                                           f"for {self._heartbeat_timeout:g} s")
                kind, m = link.recv()
                self._on_message(proc, kind, m)
        except (wire.WireError, SliceProcessLost) as e:
            if not self._closing:
                self._lose(proc, e)

    def _on_message(self, proc: _Process, kind: str, m: dict) -> None:
        if kind == "heartbeat":
            return
        if kind == "ready":
            if proc.process_id in self._lost_at:
                self.replacements.append(
                    (proc.process_id, time.monotonic() - self._lost_at.pop(proc.process_id)))
            proc.ready.set()
            return
        if kind == "exported":
            moving = self._handovers.pop(m["handover"], None)
            if moving is not None:
                _, src, dst = moving
                src.unfilled.pop(m["handover"], None)
                if m["records"]:  # the destination takes them after its earlier commands
                    dst._outbox.put(("import", dict(records=m["records"])))
            return
        i = m["slice"]
        worker = self._workers.get(i)
        if worker is not None and worker.generation != proc.generation:
            worker = None  # a retired worker's slice: the runtime has not restarted it yet
        if "stats" in m:
            self.slices[i].stats = m["stats"]
        if kind == "span":
            if worker is not None:
                worker.timeline.add(f"process {proc.process_id} slice {i}", m["what"],
                                    m["start"], m["end"], m["version"], m["slots"])
        elif kind == "doing":
            if worker is not None:
                worker.doing = (m["what"], m["since"])
        elif worker is None:
            return
        elif kind == "finished":
            worker.events.put(SamplesFinished(i, m["trajectories"], m["kv_free"]))
        elif kind == "loaded":
            worker.events.put(VersionLoaded(i, m["version"]))
        elif kind == "failed":
            worker.events.put(Failed(i, RuntimeError(m["error"])))

    def _lose(self, proc: _Process, error: BaseException) -> None:
        """Fails the process's slices; its replacement may connect from now on."""
        link, proc.link = proc.link, None
        if link is not None:
            link.close()
        proc.ready.clear()
        proc.generation += 1
        self._lost_at[proc.process_id] = time.monotonic()
        for i in proc.slice_ids:
            self._base_sent.discard(i)
            # A hand-over out of a lost process never arrives: its destination is told
            # through the source's release_hand_overs.
            lost = SliceProcessLost(f"slice process {proc.process_id}: {error}")
            with self._lock:
                w = self._workers.get(i)
                if w is not None:
                    w.events.put(Failed(i, lost))
                else:
                    self._unreported[i] = lost

    # ----------------------------------------------------------- commands
    def _send(self, worker: RemoteSliceWorker, kind: str, **fields: Any) -> bool:
        """Sends if the worker's process generation is connected and ready."""
        proc = self._proc_of[worker.slice_id]
        link = proc.link
        if link is None or not proc.ready.is_set() or proc.generation != worker.generation:
            return False
        try:
            link.send(kind, slice=worker.slice_id, **fields)
            return True
        except wire.WireError:
            return False  # the reader notices and fails the slices

    def offer(self, slice_id: int, version: int, params: Any) -> tuple[int, list[int]]:
        number, leaves = self.offers.offer(version, params,
                                           base_held=slice_id in self._base_sent)
        self._base_sent.add(slice_id)
        return number, leaves

    def new_handover(self, request_ids: list, src: RemoteSliceWorker,
                     dst: RemoteSliceWorker) -> int:
        handover = next(self._numbers)
        self._handovers[handover] = (request_ids, src, dst)
        return handover

    def drop_handover(self, handover: int) -> None:
        self._handovers.pop(handover, None)

    def worker(self, sl: RemoteSlice, events: queue.Queue, timeline: Timeline,
               clock: Callable[[], float], faults: Any = None) -> RemoteSliceWorker:
        """The runtime's worker for remote slice `sl` (`Runtime`'s make_worker); it
        replaces the slice's earlier one, whose unsent commands are dropped."""
        del faults  # drills run in one process
        with self._lock:
            old = self._workers.get(sl.slice_id)
            if old is not None:
                old.retire()
            w = RemoteSliceWorker(self, sl.slice_id, events, timeline, clock,
                                  self._proc_of[sl.slice_id].generation)
            self._workers[sl.slice_id] = w
            lost = self._unreported.pop(sl.slice_id, None)
            if lost is not None:
                events.put(Failed(sl.slice_id, lost))
        return w

    def process_of(self, slice_id: int) -> int:
        return self._proc_of[slice_id].process_id

    def close(self) -> None:
        self._closing = True
        for proc in self._procs.values():
            if proc.link is not None:
                try:
                    proc.link.send("stop")
                except wire.WireError:
                    pass
        self._listener.close()


class RemoteSliceWorker:
    """`SliceWorker`'s interface for a slice in another process. Commands go out in
    order from a thread of its own, so the coordinator never waits: not for a version
    in training to be published, nor for a replacement process. A worker serves one
    generation of its slice's process; the runtime's restart after a loss makes a new
    one, and what the old one had not sent is dropped (the scheduler regenerated it)."""

    def __init__(self, procs: SliceProcesses, slice_id: int, events: queue.Queue,
                 timeline: Timeline, clock: Callable[[], float], generation: int) -> None:
        self._procs, self.slice_id = procs, slice_id
        self.events, self.timeline, self._clock = events, timeline, clock
        self.generation = generation
        self.doing: tuple[str, float] = ("starting", clock())
        self.unfilled: dict = {}  # handover id -> (request ids, destination worker)
        self._outbox: queue.Queue = queue.Queue()
        self._retired = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"commands to slice {slice_id}")

    def _run(self) -> None:
        while True:
            kind, fields = self._outbox.get()
            if kind is None or self._retired.is_set():
                return
            if "offer" in fields:
                fields = self._offer(*fields["offer"])
            while not self._procs._send(self, kind, **fields):
                if self._retired.wait(0.05):
                    return

    def _offer(self, version: int, params: Any) -> dict:
        if hasattr(params, "result"):  # the version in training: offered once published
            params = params.result()
        number, leaves = self._procs.offer(self.slice_id, version, params)
        return dict(version=version, number=number, leaves=leaves)

    def retire(self) -> None:
        self._retired.set()
        self._outbox.put((None, {}))

    def start(self) -> None:
        self._thread.start()
        self._outbox.put(("start", dict(epoch=time.time() - self._clock())))

    def submit(self, request: Request) -> None:
        self._outbox.put(("submit", dict(request=request)))

    def load(self, version: int, params: Any, *, interrupt: bool = False) -> None:
        self._outbox.put(("reload" if interrupt else "load", dict(offer=(version, params))))

    def add(self, version: int, params: Any) -> None:
        self._outbox.put(("add", dict(offer=(version, params))))

    def evict(self, version: int) -> None:
        self._outbox.put(("evict", dict(version=version)))

    def ack(self) -> None:
        self._outbox.put(("ack", {}))

    def migrate(self, request_ids: list, dst: RemoteSliceWorker) -> None:
        procs = self._procs
        if procs.process_of(self.slice_id) == procs.process_of(dst.slice_id):
            self._outbox.put(("migrate", dict(request_ids=request_ids, dst=dst.slice_id)))
            return
        handover = procs.new_handover(request_ids, self, dst)
        self.unfilled[handover] = (request_ids, dst)
        self._outbox.put(("export", dict(request_ids=request_ids, handover=handover)))

    def release_hand_overs(self) -> list:
        """After this slice failed: (request id, destination slice) of each sample
        whose hand-over never left it."""
        awaited = []
        for handover, (request_ids, dst) in list(self.unfilled.items()):
            self._procs.drop_handover(handover)
            awaited += [(tuple(rid), dst.slice_id) for rid in request_ids]
        self.unfilled.clear()
        return awaited

    def evaluate(self, *args: Any) -> None:
        raise NotImplementedError("evaluation runs on a slice of the trainer's process")

    def stop(self, timeout: float = 600.0) -> None:
        self._outbox.put(("stop_slice", {}))
        self._outbox.put((None, {}))
        self._thread.join(min(timeout, 5.0))


def start(cfg: Any, role: Any, trainer_mesh: Any, current: Callable[[], tuple[int, Any]],
          timeout: float) -> SliceProcesses:
    """Listens at the role's coordinator address for the slice processes and stages
    weights on the trainer's devices shaped as a slice (`cfg`: the run's Config; `role`:
    roles.Role of the lead). `wait_ready` then waits for them to compile."""
    import jax

    from dora_jax.config import SLICE_MESH_AXES
    from dora_jax.rollout.placement import ParamPlacement
    from dora_jax.runtime.weight_transfer import staging_mesh

    shape = tuple(cfg.mesh.slice[a] for a in SLICE_MESH_AXES)
    # This process's own devices: a trainer over several processes gathers each
    # published version here (sharding.published_copy).
    mine = [d for d in trainer_mesh.devices.flat if d.process_index == jax.process_index()]
    stage = staging_mesh(mine, shape)
    placement = ParamPlacement(cfg.model, stage, cfg.mesh.decode_rules)
    host = role.coordinator[0]
    offers = WeightOffers(placement, host)
    return SliceProcesses(role.coordinator, role.slice_ids_by_process(cfg.mesh.num_slices),
                          offers, current, heartbeat_timeout=max(30.0, timeout / 10))
