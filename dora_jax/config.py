"""Typed, validated configuration.

Configs are written as code (`configs/*.py` return an `ml_collections.ConfigDict`);
`validate` turns that ConfigDict into frozen dataclasses at the boundary and rejects
bad values before any compute, with a message naming the offending field. Nothing
past this module reads a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import ml_collections

from dora_jax.coordinator.types import MODES

TRAINER_MESH_AXES = ("data", "fsdp", "tensor", "expert")
SLICE_MESH_AXES = ("tensor", "expert")

# Logical axis names used by the model code. A rule set maps each to a mesh axis
# (or None: replicated). Rules live in configs; these are the defaults.
TRAINER_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("cache_length", None),
)
# Decode slices hold a full copy of the params per slice: no FSDP, no data axis.
DECODE_RULES = (
    ("batch", None),
    ("length", None),
    ("embed", None),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("expert", "expert"),
    ("expert_mlp", "tensor"),
    ("cache_length", None),
)


class ConfigError(ValueError):
    """A config value is invalid; the message names the field."""


def _fail(field: str, message: str):
    raise ConfigError(f"config.{field}: {message}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0  # 0: dense MLP everywhere
    top_k: int = 2
    expert_hidden: int = 0
    # None: dropless (exact). A float: each expert takes at most
    # ceil(capacity_factor * tokens * top_k / num_experts) assignments; the rest drop.
    capacity_factor: float | None = None
    num_shared_experts: int = 0
    shared_expert_hidden: int = 0
    moe_every: int = 1  # layer i is MoE iff i % moe_every == moe_every - 1
    normalize_topk: bool = True  # renormalise the top-k router weights to sum to 1
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_hidden: int
    tie_embeddings: bool = False
    qk_norm: bool = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"  # activations / compute
    param_dtype: str = "float32"
    moe: MoEConfig = MoEConfig()

    def is_moe_layer(self, layer: int) -> bool:
        m = self.moe
        return m.enabled and layer % m.moe_every == m.moe_every - 1


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device layout: a trainer mesh and `num_slices` disjoint decode-slice meshes."""

    trainer: Mapping[str, int]  # over TRAINER_MESH_AXES
    slice: Mapping[str, int]  # over SLICE_MESH_AXES, the same for every slice
    num_slices: int = 1
    trainer_rules: tuple = TRAINER_RULES
    decode_rules: tuple = DECODE_RULES

    @property
    def trainer_devices(self) -> int:
        return math.prod(self.trainer.values())

    @property
    def slice_devices(self) -> int:
        return math.prod(self.slice.values())

    @property
    def total_devices(self) -> int:
        return self.trainer_devices + self.num_slices * self.slice_devices


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Decode engine and slice settings."""

    slots_per_slice: int = 4
    max_prefill_length: int = 32
    max_decode_len: int = 32
    # Padded prompt lengths for prefill; the largest must be >= max_prefill_length.
    prefill_buckets: tuple = (16, 32)
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    eos_id: int = 1
    pad_id: int = 0

    @property
    def cache_length(self) -> int:
        return self.max_prefill_length + self.max_decode_len


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Optimiser, RL objective and batching of the train step."""

    learning_rate: float = 1e-3
    warmup_steps: int = 0
    schedule: str = "constant"  # or "cosine"
    decay_steps: int = 1000  # cosine horizon in optimizer updates
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    micro_batches: int = 1  # gradient accumulation inside one optimizer update
    num_minibatches: int = 1  # optimizer updates per train step
    advantage: str = "grpo"  # "grpo" | "drgrpo" | "rloo"
    loss_agg_mode: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    tis_cap: float | None = None
    # Padded response lengths (plus the prompt bucket) for the train step.
    length_buckets: tuple = (32, 64)


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    """Scheduling: which mode, batch sizes in groups, staleness bound, run length."""

    mode: str = "dora"  # "sync" | "one_step_off" | "partial_rollout" | "dora"
    group_size: int = 4  # G samples per prompt
    train_batch_size: int = 4  # TBS groups per train step
    rollout_batch_size: int = 8  # RBS admitted-but-unconsumed groups (>= TBS)
    max_staleness: int = 2  # K
    num_steps: int = 20
    checkpoint_every: int = 0  # train steps; 0: only at the end
    reward_threads: int = 4


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are scored."""

    # "residue" (synthetic) | "jsonl". TFDS prompts: experiment.run(records=TfdsSource(..)).
    source: str = "residue"
    reward: str = "residue"
    path: str = ""  # jsonl file
    num_prompts: int = 512  # synthetic tasks
    prompt_len: int = 6
    modulus: int = 4
    num_epochs: int | None = None  # None: repeat forever
    shuffle: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    mesh: MeshConfig
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    data: DataConfig = DataConfig()
    seed: int = 0


def _positive(field: str, value, allow_zero: bool = False):
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(field, f"must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        _fail(field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate_model(m: ml_collections.ConfigDict) -> ModelConfig:
    """Checks the model section and returns it typed."""
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_hidden"):
        _positive(f"model.{name}", m[name])
    if m.d_model % m.num_heads:
        _fail("model.num_heads", f"must divide model.d_model ({m.d_model}), got {m.num_heads}")
    if m.num_heads % m.num_kv_heads:
        _fail("model.num_kv_heads",
              f"must divide model.num_heads ({m.num_heads}), got {m.num_kv_heads}")
    if m.head_dim % 2:
        _fail("model.head_dim", f"must be even for rotary embeddings, got {m.head_dim}")
    for name in ("dtype", "param_dtype"):
        if m[name] not in ("float32", "bfloat16"):
            _fail(f"model.{name}", f"must be 'float32' or 'bfloat16', got {m[name]!r}")
    if m.rope_theta <= 0:
        _fail("model.rope_theta", f"must be > 0, got {m.rope_theta}")
    if m.norm_eps <= 0:
        _fail("model.norm_eps", f"must be > 0, got {m.norm_eps}")

    moe_cd = m.get("moe", ml_collections.ConfigDict())
    moe = MoEConfig(**moe_cd.to_dict()) if moe_cd else MoEConfig()
    if moe.num_experts:
        _positive("model.moe.num_experts", moe.num_experts)
        _positive("model.moe.top_k", moe.top_k)
        _positive("model.moe.expert_hidden", moe.expert_hidden)
        _positive("model.moe.moe_every", moe.moe_every)
        _positive("model.moe.num_shared_experts", moe.num_shared_experts, allow_zero=True)
        if moe.top_k > moe.num_experts:
            _fail("model.moe.top_k",
                  f"must be <= model.moe.num_experts ({moe.num_experts}), got {moe.top_k}")
        if moe.moe_every > m.num_layers:
            _fail("model.moe.moe_every",
                  f"must be <= model.num_layers ({m.num_layers}) or no layer is MoE, "
                  f"got {moe.moe_every}")
        if moe.capacity_factor is not None and not moe.capacity_factor > 0:
            _fail("model.moe.capacity_factor",
                  f"must be > 0 or None (dropless), got {moe.capacity_factor}")
        if moe.num_shared_experts:
            _positive("model.moe.shared_expert_hidden", moe.shared_expert_hidden)
        if moe.aux_loss_coef < 0 or moe.z_loss_coef < 0:
            _fail("model.moe.aux_loss_coef", "loss coefficients must be >= 0")
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"moe"}
    unknown = set(m.keys()) - fields - {"moe"}
    if unknown:
        _fail("model", f"unknown field(s) {sorted(unknown)}")
    return ModelConfig(moe=moe, **{k: m[k] for k in fields if k in m})


def _validate_rules(field: str, rules, axes) -> tuple:
    out = []
    for entry in rules:
        if len(entry) != 2:
            _fail(field, f"each rule is (logical_name, mesh_axes), got {entry!r}")
        logical, target = entry
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        for t in targets:
            if t not in axes:
                _fail(field, f"rule for {logical!r} names mesh axis {t!r}, not one of {axes}")
        out.append((logical, None if target is None else (target if isinstance(target, str) else tuple(target))))
    return tuple(out)


def validate_mesh(c: ml_collections.ConfigDict, num_devices: int | None) -> MeshConfig:
    """Checks mesh shapes (and, given `num_devices`, that they fit the devices)."""
    trainer = dict(c.trainer)
    slice_ = dict(c.slice)
    for name, shape, axes in (("trainer", trainer, TRAINER_MESH_AXES),
                              ("slice", slice_, SLICE_MESH_AXES)):
        if set(shape) != set(axes):
            _fail(f"mesh.{name}", f"must give a size for each of {axes}, got {sorted(shape)}")
        for axis, size in shape.items():
            _positive(f"mesh.{name}.{axis}", size)
    _positive("mesh.num_slices", c.num_slices)
    mesh = MeshConfig(
        trainer={a: trainer[a] for a in TRAINER_MESH_AXES},
        slice={a: slice_[a] for a in SLICE_MESH_AXES},
        num_slices=c.num_slices,
        trainer_rules=_validate_rules("mesh.trainer_rules", c.get("trainer_rules", TRAINER_RULES),
                                      TRAINER_MESH_AXES),
        decode_rules=_validate_rules("mesh.decode_rules", c.get("decode_rules", DECODE_RULES),
                                     SLICE_MESH_AXES),
    )
    if num_devices is not None and mesh.total_devices > num_devices:
        _fail("mesh", f"trainer ({mesh.trainer_devices}) + {mesh.num_slices} slices x "
                      f"{mesh.slice_devices} devices = {mesh.total_devices}, but only "
                      f"{num_devices} devices are available (on a CPU, fake them with "
                      f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh.total_devices})")
    return mesh


def _check_divides(field: str, size: int, dim_name: str, dim: int):
    if size > 1 and dim % size:
        _fail(field, f"mesh axis size {size} must divide {dim_name} ({dim})")


def _typed(cls, field: str, cd: ml_collections.ConfigDict):
    """Builds a section dataclass, rejecting unknown fields by name."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = cd.to_dict() if cd is not None else {}
    unknown = set(values) - names
    if unknown:
        _fail(field, f"unknown field(s) {sorted(unknown)}; known: {sorted(names)}")
    for k, v in values.items():
        if isinstance(v, list):
            values[k] = tuple(v)
    return cls(**values)


def validate_rollout(cd, model: ModelConfig) -> RolloutConfig:
    r = _typed(RolloutConfig, "rollout", cd)
    for name in ("slots_per_slice", "max_prefill_length", "max_decode_len"):
        _positive(f"rollout.{name}", getattr(r, name))
    if not r.prefill_buckets or sorted(r.prefill_buckets) != list(r.prefill_buckets):
        _fail("rollout.prefill_buckets", f"must be a non-empty ascending list, got {r.prefill_buckets}")
    if r.prefill_buckets[-1] < r.max_prefill_length:
        _fail("rollout.prefill_buckets", f"largest bucket {r.prefill_buckets[-1]} < "
                                         f"rollout.max_prefill_length {r.max_prefill_length}")
    if not r.temperature > 0:
        _fail("rollout.temperature", f"must be > 0, got {r.temperature}")
    if r.top_k < 0 or r.top_k > model.vocab_size:
        _fail("rollout.top_k", f"must be in [0, vocab_size={model.vocab_size}], got {r.top_k}")
    if not 0 < r.top_p <= 1:
        _fail("rollout.top_p", f"must be in (0, 1], got {r.top_p}")
    for name in ("eos_id", "pad_id"):
        if not 0 <= getattr(r, name) < model.vocab_size:
            _fail(f"rollout.{name}", f"must be a token id < vocab_size ({model.vocab_size})")
    return r


ADVANTAGES = ("grpo", "drgrpo", "rloo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-scale")


def validate_trainer(cd) -> TrainerConfig:
    t = _typed(TrainerConfig, "trainer", cd)
    if not t.learning_rate > 0:
        _fail("trainer.learning_rate", f"must be > 0, got {t.learning_rate}")
    _positive("trainer.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive("trainer.micro_batches", t.micro_batches)
    _positive("trainer.num_minibatches", t.num_minibatches)
    if t.schedule not in ("constant", "cosine"):
        _fail("trainer.schedule", f"must be 'constant' or 'cosine', got {t.schedule!r}")
    if t.advantage not in ADVANTAGES:
        _fail("trainer.advantage", f"must be one of {ADVANTAGES}, got {t.advantage!r}")
    if t.loss_agg_mode not in LOSS_AGG_MODES:
        _fail("trainer.loss_agg_mode", f"must be one of {LOSS_AGG_MODES}, got {t.loss_agg_mode!r}")
    if t.kl_kind not in ("k1", "k2", "k3"):
        _fail("trainer.kl_kind", f"must be 'k1', 'k2' or 'k3', got {t.kl_kind!r}")
    if t.clip_low < 0 or t.clip_high < 0 or t.clip_low >= 1:
        _fail("trainer.clip_low", "clip ranges must satisfy 0 <= clip_low < 1, clip_high >= 0")
    if t.dual_clip is not None and not t.dual_clip > 1:
        _fail("trainer.dual_clip", f"must be > 1 or None, got {t.dual_clip}")
    if t.tis_cap is not None and not t.tis_cap > 0:
        _fail("trainer.tis_cap", f"must be > 0 or None, got {t.tis_cap}")
    if t.kl_coef < 0:
        _fail("trainer.kl_coef", f"must be >= 0, got {t.kl_coef}")
    if not t.length_buckets or sorted(t.length_buckets) != list(t.length_buckets):
        _fail("trainer.length_buckets", f"must be a non-empty ascending list, got {t.length_buckets}")
    return t


def validate_coordinator(cd, mesh: MeshConfig, rollout: RolloutConfig,
                         trainer: TrainerConfig) -> CoordinatorConfig:
    c = _typed(CoordinatorConfig, "coordinator", cd)
    if c.mode not in MODES:
        _fail("coordinator.mode", f"must be one of {MODES}, got {c.mode!r}")
    for name in ("group_size", "train_batch_size", "rollout_batch_size", "num_steps",
                 "reward_threads"):
        _positive(f"coordinator.{name}", getattr(c, name))
    _positive("coordinator.max_staleness", c.max_staleness, allow_zero=True)
    _positive("coordinator.checkpoint_every", c.checkpoint_every, allow_zero=True)
    if c.rollout_batch_size < c.train_batch_size:
        _fail("coordinator.rollout_batch_size",
              f"must be >= coordinator.train_batch_size ({c.train_batch_size}), "
              f"got {c.rollout_batch_size}")
    slots = mesh.num_slices * rollout.slots_per_slice
    if c.group_size > slots:
        _fail("coordinator.group_size",
              f"{c.group_size} samples per group do not fit in {slots} slots "
              f"(mesh.num_slices x rollout.slots_per_slice)")
    samples = c.train_batch_size * c.group_size
    split = trainer.micro_batches * trainer.num_minibatches
    if samples % split:
        _fail("coordinator.train_batch_size",
              f"TBS x group_size = {samples} samples must divide evenly into "
              f"trainer.num_minibatches x trainer.micro_batches = {split}")
    return c


def validate_data(cd, model: ModelConfig, rollout: RolloutConfig) -> DataConfig:
    d = _typed(DataConfig, "data", cd)
    if d.source not in ("residue", "jsonl", "tfds"):
        _fail("data.source", f"must be 'residue', 'jsonl' or 'tfds', got {d.source!r}")
    if d.source == "jsonl" and not d.path:
        _fail("data.path", "data.source='jsonl' needs a path")
    if d.source == "tfds":
        # Turning a TFDS example into prompt tokens is task-specific (which feature,
        # which tokenizer): that mapping is code, not config.
        _fail("data.source", "'tfds' prompts need an example->record mapping: build "
                             "data.prompts.TfdsSource(name, split, to_record) and pass it "
                             "to experiment.run(records=...)")
    if d.source == "residue":
        _positive("data.num_prompts", d.num_prompts)
        if not 2 <= d.prompt_len <= rollout.max_prefill_length:
            _fail("data.prompt_len", f"must be in [2, rollout.max_prefill_length="
                                     f"{rollout.max_prefill_length}], got {d.prompt_len}")
        if not 2 <= d.modulus <= model.vocab_size - 3:
            _fail("data.modulus", f"must be in [2, vocab_size - 3], got {d.modulus}")
    if d.num_epochs is not None:
        _positive("data.num_epochs", d.num_epochs)
    return d


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> Config:
    """Validates a whole ConfigDict; `num_devices` is checked when given."""
    model = validate_model(config.model)
    mesh = validate_mesh(config.mesh, num_devices)
    _check_divides("mesh.slice.tensor", mesh.slice["tensor"], "model.num_kv_heads",
                   model.num_kv_heads)
    _check_divides("mesh.trainer.tensor", mesh.trainer["tensor"], "model.num_kv_heads",
                   model.num_kv_heads)
    if model.moe.enabled:
        _check_divides("mesh.trainer.expert", mesh.trainer["expert"], "model.moe.num_experts",
                       model.moe.num_experts)
        _check_divides("mesh.slice.expert", mesh.slice["expert"], "model.moe.num_experts",
                       model.moe.num_experts)
    rollout = validate_rollout(config.get("rollout"), model)
    trainer = validate_trainer(config.get("trainer"))
    if trainer.length_buckets[-1] < rollout.cache_length:
        _fail("trainer.length_buckets",
              f"largest bucket {trainer.length_buckets[-1]} must hold a whole trajectory "
              f"(rollout.max_prefill_length + rollout.max_decode_len = {rollout.cache_length})")
    coordinator = validate_coordinator(config.get("coordinator"), mesh, rollout, trainer)
    data = validate_data(config.get("data"), model, rollout)
    known = {"model", "mesh", "rollout", "trainer", "coordinator", "data", "seed"}
    unknown = set(config.keys()) - known
    if unknown:
        _fail(sorted(unknown)[0], f"unknown section; known: {sorted(known)}")
    return Config(model=model, mesh=mesh, rollout=rollout, trainer=trainer,
                  coordinator=coordinator, data=data, seed=config.get("seed", 0))


# Fields whose default is None, with the type an override must have: typed
# placeholders let `--config.trainer.dual_clip=3` parse on the command line.
_OPTIONAL_TYPES = {"capacity_factor": float, "dual_clip": float, "tis_cap": float,
                   "num_epochs": int}


def _section(obj) -> ml_collections.ConfigDict:
    def convert(d):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out[k] = convert(v)
            elif v is None and k in _OPTIONAL_TYPES:
                out[k] = ml_collections.config_dict.placeholder(_OPTIONAL_TYPES[k])
            else:
                out[k] = v
        return out

    return ml_collections.ConfigDict(convert(dataclasses.asdict(obj)))


def base() -> ml_collections.ConfigDict:
    """Every field with its default; configs/*.py start here and override."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.model = _section(ModelConfig(vocab_size=1, d_model=1, num_layers=1, num_heads=1,
                                   num_kv_heads=1, head_dim=2, mlp_hidden=1))
    c.mesh = ml_collections.ConfigDict(dict(
        trainer={a: 1 for a in TRAINER_MESH_AXES}, slice={a: 1 for a in SLICE_MESH_AXES},
        num_slices=1, trainer_rules=TRAINER_RULES, decode_rules=DECODE_RULES))
    c.rollout = _section(RolloutConfig())
    c.trainer = _section(TrainerConfig())
    c.coordinator = _section(CoordinatorConfig())
    c.data = _section(DataConfig())
    return c


def load(spec: str) -> ml_collections.ConfigDict:
    """Loads `path/to/config.py[:variant]` the way `--config=` does."""
    import importlib.util

    path, _, variant = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_dora_config", path)
    if module_spec is None:
        raise FileNotFoundError(f"no config file at {path!r}")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)
