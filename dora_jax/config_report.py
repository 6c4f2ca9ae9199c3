"""The sections of the run config that say what a run reports beyond training:
where its metric records go (`logging`). Re-exported by config.py; no JAX, reads no
file."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from dora_jax.schema import Section, field


@dataclasses.dataclass(frozen=True)
class LoggingConfig(Section):
    """Metric writers: metrics.jsonl always; TensorBoard and Weights & Biases as set."""

    PATH: ClassVar[str] = "logging"
    tensorboard: bool = True  # <workdir>/tensorboard
    # A W&B project turns the W&B writer on ("": off). It needs the `wandb` package
    # (installed apart) and its usual login; nothing else in a run reaches the network.
    wandb_project: str = ""
    wandb_entity: str = ""  # "": the login's default entity
    wandb_run_name: str = ""  # "": the workdir's name
    wandb_mode: str = field("online", choices=("online", "offline"))
