"""Which part of a run this process plays: the whole run (one process, the default),
or, in a run of several processes, the trainer's lead (process 0: the trainer, the
coordinator, the ledger), another trainer process (its share of the trainer's mesh,
one per host) or a slice process (the decode slices it is given).

A launcher (launch/local.py, a JobSet, Slurm) sets, for every process:

  DORA_NUM_PROCESSES      processes in the run (1: one process, nothing else is read)
  DORA_PROCESS_ID         this process's number, 0 the trainer's lead
  DORA_COORDINATOR        HOST:PORT of the lead: it listens for the slice processes
                          there, the trainer processes' jax.distributed service at
                          PORT+1 and for their commands at PORT+2
  DORA_TRAINER_PROCESSES  T: processes 0..T-1 run the trainer as one SPMD program
                          (default 1, the lead alone); T..N-1 are slice processes
  DORA_AUTHKEY            the run's shared secret (every connection proves it)

Reads no JAX: the role decides how many devices to fake before JAX starts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dora_jax.config import MeshConfig

NUM_PROCESSES, PROCESS_ID, COORDINATOR = ("DORA_NUM_PROCESSES", "DORA_PROCESS_ID",
                                          "DORA_COORDINATOR")
TRAINER_PROCESSES = "DORA_TRAINER_PROCESSES"


@dataclasses.dataclass(frozen=True)
class Role:
    process_id: int = 0
    num_processes: int = 1
    coordinator: tuple[str, int] | None = None
    trainer_processes: int = 1

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    @property
    def lead(self) -> bool:
        return self.process_id == 0

    @property
    def trains(self) -> bool:
        """Whether this process holds part of the trainer's mesh."""
        return self.process_id < self.trainer_processes

    @property
    def trainer_service(self) -> tuple[str, int]:
        """Where the trainer processes' jax.distributed service listens (the lead)."""
        assert self.coordinator is not None
        return self.coordinator[0], self.coordinator[1] + 1

    @property
    def trainer_commands(self) -> tuple[str, int]:
        """Where the lead listens for the other trainer processes (trainer_group.py)."""
        assert self.coordinator is not None
        return self.coordinator[0], self.coordinator[1] + 2

    def slice_ids_by_process(self, num_slices: int) -> dict[int, list[int]]:
        """Each slice process's slices: consecutive blocks, as even as they come."""
        n, first = self.num_processes - self.trainer_processes, self.trainer_processes
        if num_slices < n:
            raise ValueError(f"{NUM_PROCESSES}={self.num_processes} gives {n} slice "
                             f"processes, more than the config's {num_slices} decode slices")
        bounds = [round(num_slices * p / n) for p in range(n + 1)]
        return {p + first: list(range(bounds[p], bounds[p + 1])) for p in range(n)}

    def devices_needed(self, mesh_cfg: MeshConfig) -> int:
        """Devices this process's part of the run takes (a config.MeshConfig)."""
        if not self.multi:
            return mesh_cfg.total_devices
        if self.trains:
            if mesh_cfg.trainer_devices % self.trainer_processes:
                raise ValueError(f"{TRAINER_PROCESSES}={self.trainer_processes} does not "
                                 f"divide the trainer mesh's {mesh_cfg.trainer_devices} "
                                 "devices (mesh.trainer)")
            return mesh_cfg.trainer_devices // self.trainer_processes
        mine = self.slice_ids_by_process(mesh_cfg.num_slices)[self.process_id]
        return len(mine) * mesh_cfg.slice_devices


def from_env(env: Mapping[str, str] = os.environ) -> Role:
    """The role the launcher gave this process; ValueError naming a bad variable."""
    def integer(name: str, default: str) -> int:
        text = env.get(name, default)
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not an integer") from None

    n = integer(NUM_PROCESSES, "1")
    if n < 1:
        raise ValueError(f"{NUM_PROCESSES}={n}: a run has at least one process")
    if n == 1:
        return Role()
    pid = integer(PROCESS_ID, "")
    if not 0 <= pid < n:
        raise ValueError(f"{PROCESS_ID}={pid} is outside 0..{n - 1}")
    address = env.get(COORDINATOR, "")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{COORDINATOR}={address!r} is not HOST:PORT")
    trainers = integer(TRAINER_PROCESSES, "1")
    if not 1 <= trainers < n:
        raise ValueError(f"{TRAINER_PROCESSES}={trainers} leaves no slice process among "
                         f"{NUM_PROCESSES}={n}: it must be 1..{n - 1} (the decode slices "
                         "run in processes of their own)")
    return Role(pid, n, (host.strip("[]"), int(port)), trainers)
