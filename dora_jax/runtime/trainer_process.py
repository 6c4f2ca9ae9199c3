"""A trainer process other than the lead (runtime/trainer_group.py): it builds the
same trainer from the same config, then makes each call the lead sends, in order,
until the lead says stop.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import jax

from dora_jax.config import devices
from dora_jax.model.checkpointing import Checkpointer
from dora_jax.model.sharding import published_copy
from dora_jax.rl.batch import TrainBatch
from dora_jax.rl.trainer import Trainer
from dora_jax.runtime import compile_times, wire
from dora_jax.runtime.experiment import initial_params
from dora_jax.runtime.trainer_group import TrainerProcessLost, held_whole

if TYPE_CHECKING:
    from dora_jax.config import Config
    from dora_jax.runtime.roles import Role


def connect(address: tuple[str, int], process_id: int, timeout: float) -> wire.Link:
    """A trainer process's link to the lead, retried until the lead listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            link = wire.connect(address)
            break
        except (ConnectionError, OSError):
            if time.monotonic() > deadline:
                raise TrainerProcessLost(f"the lead did not listen at {address[0]}:"
                                         f"{address[1]} within {timeout:g} s") from None
            time.sleep(0.2)
    link.send("hello", process_id=process_id)
    return link


def follow(cfg: Config, workdir: str, role: Role) -> None:
    """A trainer process other than the lead: builds the same trainer and makes each
    call the lead sends, until it says stop."""
    compile_times.use_persistent_cache(workdir)
    timeout = cfg.coordinator.stall_timeout or 600.0
    mesh = devices.make_trainer_mesh(cfg.mesh)
    graphdef, params = initial_params(cfg, mesh)
    trainer = Trainer(cfg, mesh, params=params, graphdef=graphdef)
    del params
    checkpoints = cfg.coordinator.checkpoint_dir or os.path.join(workdir, "checkpoints")
    link = connect(role.trainer_commands, role.process_id, timeout)
    while True:  # a failure ends this process: the lead's next program then fails
        kind, m = link.recv()
        if kind == "stop":
            return
        _obey(trainer, checkpoints, kind, m)


def _obey(trainer: Trainer, checkpoints: str, kind: str, m: dict) -> None:
    if kind == "train_step":
        trainer.train_step(TrainBatch(**m["batch"]))
    elif kind == "published_params":
        trainer.published_params(m["adapters_only"])
    elif kind == "gather_state":  # the lead saves it
        published_copy(trainer.state)
    elif kind == "warmup":
        trainer.warmup(m["batch_size"], m["group_size"])
    elif kind == "restore":  # the step the lead restored, read here alone
        with Checkpointer(checkpoints, this_process_only=True) as checkpointer:
            state, _ = checkpointer.restore(held_whole(trainer.abstract_state()), m["step"])
        trainer.load_state(jax.device_get(state))
    else:
        raise TrainerProcessLost(f"unknown command {kind!r}")
