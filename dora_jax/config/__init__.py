"""Typed, validated configuration: `configs/*.py` return an `ml_collections.ConfigDict`
built from `base()`; `validate` turns it into the frozen dataclasses of this package,
the schema written once: `base()` is generated from them, each field declares its
constraint (`field`, schema.py), each section checks its own rules in `__post_init__`,
`Config` runs every rule that spans sections (run.py). Errors name the field
(`config.rollout.temperature: must be > 0, got 0.0`) before any compute.

The package is the lowest of the core and imports nothing else of dora_jax: the schema
(schema.py), the modes and what each can do (modes.py, which the scheduler's policies
read), the sections (sections.py; model.py: model and mesh; data.py; report.py: eval and
logging), the schedule's shape rules on plain values (rules.py), the whole config and
the rules that span its sections (run.py) and its loading (loading.py). No JAX; a
Hugging Face checkpoint or tokenizer named by the config is read before validation, by
model/hf_checks.py; `validate` itself reads no file. devices.py (fake CPU devices,
Pathways, the meshes; JAX only inside its functions) is imported on its own, never
by this package."""

from .data import (
    SHIPPED_TASKS,
    TASKS,
    TEXT_REWARDS,
    TOKEN_REWARDS,
    DataConfig,
    TaskFacts,
    declare_task,
    forget_task,
)
from .loading import base, check_devices, load, validate
from .model import (
    ATTENTION_IMPLS,
    DECODE_RULES,
    DTYPES,
    LORA_TARGETS,
    MOE_DISPATCH,
    REMAT_POLICIES,
    ROPE_SCALINGS,
    SLICE_MESH_AXES,
    TRAINER_MESH_AXES,
    TRAINER_RULES,
    LoRAConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    colocate,
    decode_rules_from,
)
from .modes import CAPABILITIES, MODES, RETIRED_MODES, Capabilities, check_not_retired, modes_with
from .report import EvalConfig, LoggingConfig
from .rules import check_declared, check_group_fits, check_multi_version, check_versions
from .run import Config
from .schema import ConfigError, Section, check, fail, field
from .sections import (
    ADVANTAGES,
    FAIL_POINTS,
    IS_MODES,
    KILL_POINTS,
    KL_KINDS,
    KV_CACHES,
    LOSS_AGG_MODES,
    MOE_ROUTING,
    OBJECTIVES,
    PAGED_ATTENTION_IMPLS,
    SCHEDULES,
    CoordinatorConfig,
    RolloutConfig,
    TrainerConfig,
    check_rollout_batch,
    gpu_paged_blocks,
)

__all__ = [
    "ADVANTAGES", "ATTENTION_IMPLS", "CAPABILITIES",
    "DECODE_RULES", "DTYPES", "FAIL_POINTS", "IS_MODES", "KILL_POINTS", "KL_KINDS",
    "KV_CACHES", "LORA_TARGETS", "LOSS_AGG_MODES", "MODES", "MOE_DISPATCH", "MOE_ROUTING",
    "OBJECTIVES",
    "PAGED_ATTENTION_IMPLS", "REMAT_POLICIES", "RETIRED_MODES", "ROPE_SCALINGS",
    "SCHEDULES", "SHIPPED_TASKS", "SLICE_MESH_AXES", "TASKS", "TEXT_REWARDS", "TOKEN_REWARDS",
    "TRAINER_MESH_AXES", "TRAINER_RULES", "Capabilities", "Config", "ConfigError",
    "CoordinatorConfig", "DataConfig", "EvalConfig", "LoRAConfig", "LoggingConfig",
    "MeshConfig", "ModelConfig", "MoEConfig", "RolloutConfig", "Section", "TaskFacts",
    "TrainerConfig", "declare_task", "forget_task",
    "base", "check", "check_declared", "check_devices", "check_group_fits",
    "check_multi_version", "check_not_retired", "check_rollout_batch", "check_versions",
    "colocate", "decode_rules_from", "fail", "field", "gpu_paged_blocks", "load",
    "modes_with", "validate",
]
