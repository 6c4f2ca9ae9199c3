"""A slice process: the decode slices one process of a multi-process run owns.

It connects to the coordinator in the trainer's lead process (remote.py), builds its
slices on its own devices, pulls their params device to device
(weight_transfer.py), compiles, and then runs each slice's `SliceWorker` as the
one-process runtime does: commands come in over the wire, the worker's events go
out, and so do its timeline spans. A heartbeat says it is alive while it compiles
or idles. It exits when the coordinator says stop or goes away.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dora_jax.config import SLICE_MESH_AXES, Config
from dora_jax.rollout.sampling import read_stop_ids
from dora_jax.rollout.trajectory import InFlight
from dora_jax.runtime import wire
from dora_jax.runtime.events import Failed, SamplesFinished, VersionLoaded
from dora_jax.runtime.experiment import new_slice, warm_slices
from dora_jax.runtime.weight_transfer import WeightPuller, start_server
from dora_jax.runtime.worker import SliceWorker

HEARTBEAT_S = 2.0


def slice_meshes(cfg: Config, count: int, devices: list | None = None) -> list[Mesh]:
    """`count` decode-slice meshes (shape `mesh.slice`) over this process's devices."""
    devices = list(jax.local_devices() if devices is None else devices)
    shape = tuple(cfg.mesh.slice[a] for a in SLICE_MESH_AXES)
    k = int(np.prod(shape))
    if count * k > len(devices):
        raise RuntimeError(f"{count} slices of {k} devices need {count * k} devices; this "
                           f"process has {len(devices)}")
    return [Mesh(np.array(devices[j * k:(j + 1) * k], dtype=object).reshape(shape),
                 SLICE_MESH_AXES) for j in range(count)]


class _Forwarder:
    """The worker's timeline: each span goes to the coordinator."""

    def __init__(self, link: wire.Link, slice_id: int) -> None:
        self._link, self._slice_id = link, slice_id

    def add(self, row: str, kind: str, start: float, end: float, version: int,
            slots: dict | None = None) -> None:
        del row
        if end > start:
            self._link.send("span", slice=self._slice_id, what=kind, start=start, end=end,
                            version=version, slots=slots)


def serve(cfg: Config, process_id: int, coordinator: tuple[str, int], tokenizer: Any = None,
          log: Callable[[str], None] = print) -> None:
    """Runs this process's slices until the coordinator says stop or goes away."""
    link = _connect(coordinator)
    link.send("hello", process_id=process_id)
    kind, init = link.recv()
    if kind != "init":
        raise RuntimeError(f"the coordinator refused slice process {process_id}: "
                           f"{init.get('reason', kind)}")
    ids = list(init["slice_ids"])
    host = link.local_host()  # where the coordinator's host reaches this one
    stop_ids = read_stop_ids(cfg.rollout, tokenizer)
    slices = {i: new_slice(i, mesh, cfg, stop_ids)
              for i, mesh in zip(ids, slice_meshes(cfg, len(ids)))}
    server = start_server(host)
    pullers = {i: WeightPuller(sl.engine.placement, server, init["weights"])
               for i, sl in slices.items()}
    commands = _Commands(link, slices, pullers)
    threading.Thread(target=_heartbeat, args=(link, commands.stop, commands.workers),
                     daemon=True).start()
    for i, sl in slices.items():
        number, leaves = init["offers"][i]
        sl.load_version(init["version"], pullers[i].pull(number, leaves))
    warm_slices(list(slices.values()), cfg)
    if not init["keep"]:  # a replacement: the coordinator says what to load
        for sl in slices.values():
            sl.abandon()
    log(f"slice process {process_id}: slices {ids} ready")
    link.send("ready")
    commands.run()


def _connect(coordinator: tuple[str, int], timeout: float = 300.0) -> wire.Link:
    """The coordinator's link; the lead may still be starting."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return wire.connect(coordinator)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def without_kv(moving: list[InFlight]) -> list[InFlight]:
    """Exported samples as they leave for another process: the KV cache stays, and the
    destination prefills prompt and tokens so far again under the same version (C1);
    the RNG continues from the request's seed and position."""
    return [dataclasses.replace(f, prefix=None, kept=None, unwritten=0, slot=None)
            for f in moving]


def _heartbeat(link: wire.Link, stop: threading.Event, workers: dict) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            link.send("heartbeat")
            for i, w in list(workers.items()):
                link.send("doing", slice=i, what=w.doing[0], since=w.doing[1])
        except wire.WireError:
            return


class _Commands:
    """Applies the coordinator's commands to this process's workers."""

    def __init__(self, link: wire.Link, slices: dict, pullers: dict) -> None:
        self.link, self.slices, self.pullers = link, slices, pullers
        self.stop = threading.Event()
        self.workers: dict[int, SliceWorker] = {}
        self.events: queue.Queue = queue.Queue()
        # One puller thread a slice: its pulls arrive in command order.
        self.pulls = {i: concurrent.futures.ThreadPoolExecutor(1) for i in slices}
        self.epoch = time.time()

    def clock(self) -> float:
        return time.time() - self.epoch

    def run(self) -> None:
        threading.Thread(target=self._forward, daemon=True).start()
        try:
            while True:
                kind, m = self.link.recv()
                if kind == "stop":
                    return
                self._apply(kind, m)
        except wire.WireError:
            return  # the coordinator went away: nothing left to serve
        finally:
            self.stop.set()
            for w in self.workers.values():
                w.stop(timeout=5.0)
            self.events.put(None)

    def _apply(self, kind: str, m: dict) -> None:
        i = m["slice"]
        if kind == "start":
            self.epoch = m["epoch"]
            old = self.workers.get(i)
            if old is not None:  # the slice failed and restarts: it starts empty
                old.stop(timeout=5.0)
                self.slices[i].abandon()
            w = SliceWorker(self.slices[i], self.events, _Forwarder(self.link, i),  # type: ignore[arg-type]
                            self.clock)
            self.workers[i] = w
            w.start()
            return
        w = self.workers[i]
        if kind == "submit":
            w.submit(m["request"])
        elif kind in ("load", "reload", "add"):
            params = self.pulls[i].submit(self.pullers[i].pull, m["number"], m["leaves"])
            if kind == "add":
                w.add(m["version"], params)
            else:
                w.load(m["version"], params, interrupt=kind == "reload")
        elif kind == "evict":
            w.evict(m["version"])
        elif kind == "ack":
            w.ack()
        elif kind == "migrate":
            w.migrate(m["request_ids"], self.workers[m["dst"]])
        elif kind == "export":
            box = w.export(m["request_ids"])
            threading.Thread(target=self._send_export, args=(box, m["handover"]),
                             daemon=True).start()
        elif kind == "import":
            w.take(m["records"])
        elif kind == "stop_slice":
            w.stop(timeout=5.0)
        else:
            raise wire.WireError(f"unknown command {kind!r}")

    def _send_export(self, box: queue.Queue, handover: int) -> None:
        self.link.send("exported", handover=handover, records=without_kv(box.get()))

    def _forward(self) -> None:
        while True:
            ev: Any = self.events.get()
            if ev is None:
                return
            i = ev.slice_id if not isinstance(ev, Failed) else ev.source
            stats = dataclasses.replace(self.slices[i].stats)
            try:
                if isinstance(ev, SamplesFinished):
                    self.link.send("finished", slice=i, trajectories=ev.trajectories,
                                   kv_free=ev.kv_free, stats=stats)
                elif isinstance(ev, VersionLoaded):
                    self.link.send("loaded", slice=i, version=ev.version, stats=stats)
                elif isinstance(ev, Failed):
                    self.link.send("failed", slice=i, stats=stats,
                                   error=f"{type(ev.error).__name__}: {ev.error}")
            except wire.WireError:
                return
