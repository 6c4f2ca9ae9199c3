"""The sections of the run config that say what a run reports beyond training:
where its metric records go (`logging`) and the evaluation it runs while it trains
(`eval`). Re-exported by `dora_jax.config`; no JAX, reads no file."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .schema import Section, fail, field


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


@dataclasses.dataclass(frozen=True)
class EvalConfig(Section):
    """Held-out evaluation during training (runtime/evaluation.py)."""

    PATH: ClassVar[str] = "eval"
    # Evaluate every this many train steps, and before the first and after the last
    # (0: never, and no prompts are held out).
    every: int = field(0, min=0)
    # Prompts held out of training for it, drawn from the prompt set by the run seed.
    num_prompts: int = field(16, min=1)
    # Sampled responses per prompt (rollout's sampling settings) for pass@k, with
    # k <= samples; pass@1 is the greedy response's.
    samples: int = field(4, min=1)
    k: int = field(4, min=1)
    # A response counts as correct when its reward is at least this.
    pass_reward: float = 1.0
    # The decode slice that runs it, between its rollouts.
    slice: int = field(0, min=0)

    def __post_init__(self):
        super().__post_init__()
        if self.k > self.samples:
            fail(self._f("k"), f"must be <= eval.samples ({self.samples}), got {self.k}")
