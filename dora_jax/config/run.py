"""The whole run config: every section, checked together by the rules that span them
(rules.py) once each section has checked its own."""

from __future__ import annotations

import dataclasses

from .data import DataConfig
from .model import MeshConfig, ModelConfig
from .report import EvalConfig, LoggingConfig
from .rules import RULES
from .schema import Section
from .sections import CoordinatorConfig, RolloutConfig, TrainerConfig


@dataclasses.dataclass(frozen=True)
class Config(Section):
    model: ModelConfig
    mesh: MeshConfig
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    seed: int = 0
    init_checkpoint: str = ""  # params to start from (e.g. dora_jax.sft's checkpoints/)

    def __post_init__(self):
        """Every check that spans sections (rules.RULES), in order."""
        for rule in RULES:
            rule(self)
