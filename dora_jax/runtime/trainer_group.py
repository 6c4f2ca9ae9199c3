"""The trainer over several processes: one SPMD program on one `jax.distributed`
world of trainer processes (one per host), driven by the lead.

The lead (process 0) runs the coordinator and calls its trainer as one process does.
Every call that runs a program over the trainer's mesh (a step, the warm-up, the
gather behind a publish or a checkpoint save) is first sent to the other trainer
processes (`LeadTrainer`, `LeadCheckpointer`), which make the same call on their own
trainer (trainer_process.py). So every process enters every program once, in the
lead's order, and holds its own shards of the train state. Commands travel over the
run's wire (runtime/wire.py); the only arrays in them are a step's batch.

A trainer process that dies ends the `jax.distributed` world, and with it the run;
the same command resumes from the last checkpoint, as after a kill of the lead
(launch/local.py starts the whole run again).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import SingleDeviceSharding

from dora_jax.model.checkpointing import Checkpointer, Restored
from dora_jax.model.sharding import published_copy
from dora_jax.rl.trainer import Trainer
from dora_jax.runtime import wire

if TYPE_CHECKING:
    from dora_jax.config import Config
    from dora_jax.rl.batch import TrainBatch


class TrainerProcessLost(RuntimeError):
    """A trainer process did not connect or went away."""


class TrainerGroup:
    """The lead's links to trainer processes 1..count-1, which connect to `address`."""

    def __init__(self, address: tuple[str, int], count: int, timeout: float) -> None:
        self._listener = wire.listen(address)
        self._expected = set(range(1, count))
        self._links: dict[int, wire.Link] = {}
        self._timeout = timeout
        self._connected = threading.Event()
        self._lock = threading.Lock()  # one command at a time, to every process alike
        self._closed = False
        threading.Thread(target=self._accept, name="trainer processes", daemon=True).start()

    def _accept(self) -> None:
        while set(self._links) != self._expected and not self._closed:
            try:
                link = wire.accept(self._listener)
                kind, hello = link.recv()
            except (OSError, wire.WireError):
                continue
            pid = hello.get("process_id") if kind == "hello" else None
            if pid not in self._expected or pid in self._links:
                link.send("refused", reason=f"no trainer slot for process {pid}")
                link.close()
                continue
            self._links[pid] = link
        self._connected.set()

    def send(self, kind: str, **fields: Any) -> None:
        """Sends one command to every other trainer process (after they connect)."""
        if not self._connected.wait(self._timeout):
            missing = sorted(self._expected - set(self._links))
            raise TrainerProcessLost(f"trainer process(es) {missing} did not connect "
                                     f"within {self._timeout:g} s")
        with self._lock:
            for pid, link in sorted(self._links.items()):
                try:
                    link.send(kind, **fields)
                except wire.WireError as e:
                    raise TrainerProcessLost(f"trainer process {pid}: {e}") from None

    def close(self) -> None:
        """Tells the other trainer processes to stop."""
        if self._closed:
            return
        self._closed = True
        if self._connected.is_set():
            for link in self._links.values():
                try:
                    link.send("stop")
                except wire.WireError:
                    pass
        self._listener.close()


class LeadTrainer(Trainer):
    """The lead's trainer: each program over the mesh is sent to the group first."""

    def __init__(self, cfg: Config, mesh: Any = None, *, group: TrainerGroup,
                 **kwargs: Any) -> None:
        super().__init__(cfg, mesh, **kwargs)
        self._group = group

    def train_step(self, batch: TrainBatch) -> dict:
        self._group.send("train_step", batch={f.name: getattr(batch, f.name)
                                              for f in dataclasses.fields(batch)})
        return super().train_step(batch)

    def warmup(self, batch_size: int, group_size: int) -> None:
        self._group.send("warmup", batch_size=batch_size, group_size=group_size)
        super().warmup(batch_size, group_size)

    def published_params(self, adapters_only: bool = False) -> Any:
        self._group.send("published_params", adapters_only=adapters_only)
        return super().published_params(adapters_only)


class LeadCheckpointer(Checkpointer):
    """The lead's checkpointer. The lead saves alone: every trainer process joins the
    gather of the state onto the lead, which writes it whole. A restore is read by
    each process on its own from the same files (the step the lead chose), and each
    then places its shards."""

    def __init__(self, directory: str, *, group: TrainerGroup, **kwargs: Any) -> None:
        super().__init__(directory, this_process_only=True, **kwargs)
        self._group = group

    def save(self, step: int, state: Any, extra_json: dict | None = None, *,
             force: bool = False) -> bool:
        self._group.send("gather_state")
        return super().save(step, published_copy(state), extra_json, force=force)

    def restore_newest_intact(self, target: Any) -> Restored | None:
        restored = super().restore_newest_intact(held_whole(target))
        if restored is None:
            return None
        self._group.send("restore", step=restored.step)
        return dataclasses.replace(restored, state=jax.device_get(restored.state))

    def close(self) -> None:
        super().close()
        self._group.close()


def held_whole(target: Any) -> Any:
    """`target`'s shapes and dtypes on this process's first device: what one process
    restores before placing its shards."""
    device = SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        target)
