"""Typed, validated configuration: `configs/*.py` return an `ml_collections.ConfigDict`
built from `base()`; `validate` turns it into the frozen dataclasses below, the schema
written once: `base()` is generated from them, each field declares its constraint
(`field`, schema.py), each section checks its own rules in `__post_init__`,
`Config.__post_init__` holds every check that spans sections. Errors name the field
(`config.rollout.temperature: must be > 0, got 0.0`) before any compute. The model and
mesh sections live in config_model.py, the data section in config_data.py, the eval
and logging sections in config_report.py (all re-exported here). No JAX: the pure
scheduling core depends on this module; a Hugging Face checkpoint or tokenizer named
by the config is read before validation, by model/hf_checks.py; `validate` itself
reads no file."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import ClassVar

import ml_collections

from dora_jax.config_data import (  # noqa: F401 - the config's public names
    AUTO_REWARDS,
    DATA_SOURCES,
    TEXT_REWARDS,
    TEXT_SOURCES,
    TOKEN_REWARDS,
    DataConfig,
)
from dora_jax.config_model import (  # noqa: F401 - the config's public names
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
    _axes_of,
    colocate,
    decode_rules_from,
)
from dora_jax.config_report import EvalConfig, LoggingConfig  # noqa: F401 - public names
from dora_jax.schema import (
    ConfigError,  # noqa: F401 - callers catch config.ConfigError
    Section,
    check,
    fail,
    field,
    schema,
)

# Allowed values: each list has its one owner here.
MODES = ("sync", "one_step_off", "partial_rollout", "partial_rollout_rounds", "dora")
# Mode names of older configs, with what replaces them.
RETIRED_MODES = {"colocated_sync": "colocation is a device layout, not a schedule: use "
                                   "coordinator.mode=sync with mesh.colocated=True"}
FAIL_POINTS = ("generate", "load", "export", "import")  # runtime/faults.py
KILL_POINTS = ("", "train", "save", "finished_waiting")
ADVANTAGES = ("grpo", "drgrpo", "rloo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm", "seq-mean-token-sum-over-max-len")
OBJECTIVES = ("behaviour_clip", "decoupled", "tis")  # rl/objective.py
IS_MODES = ("truncate", "mask")
KL_KINDS = ("k1", "k2", "k3")
SCHEDULES = ("constant", "cosine")
KV_CACHES = ("paged", "dense")  # rollout/engine.py
PAGED_ATTENTION_IMPLS = ("auto", "ragged", "pallas")  # model/paged_attention.py

@dataclasses.dataclass(frozen=True)
class RolloutConfig(Section):
    """Decode engine and slice settings."""

    PATH: ClassVar[str] = "rollout"
    slots_per_slice: int = field(4, min=1)
    max_prefill_length: int = field(32, min=1)
    max_decode_len: int = field(32, min=1)
    # Most tokens per slot per generate call (one dispatch, one host read); see Engine.
    decode_steps: int = field(16, min=1)
    prefill_buckets: tuple = field((16, 32), ascending=True)
    temperature: float = field(1.0, gt=0)
    top_k: int = field(0, min=0)  # 0: off
    top_p: float = field(1.0, gt=0, le=1)  # 1.0: off
    eos_id: int = 1
    pad_id: int = 0
    # KV memory: "paged" (a pool of pages shared by the slots, used as contexts grow)
    # or "dense" (every slot reserves cache_length positions).
    kv_cache: str = field("paged", choices=KV_CACHES)
    page_size: int = field(16, min=1)
    # Pages in a slice's pool; 0: as many as the dense cache would hold
    # (slots_per_slice x pages_per_slot). Fewer bound memory, more slots use it.
    kv_pages: int = field(0, min=0)
    paged_attention: str = field("auto", choices=PAGED_ATTENTION_IMPLS)
    # V: policy versions a slice holds at once, each slot decoding its own request's
    # version (with LoRA: adapter sets on one base). 1: a slice holds one version and
    # switches only once empty. V > 1 is modelled by the scheduler and the simulator;
    # the runtime's slices hold one version (validation refuses V > 1 for a run).
    versions_per_slice: int = field(1, min=1)

    @property
    def cache_length(self) -> int:
        return self.max_prefill_length + self.max_decode_len

    @property
    def pages_per_slot(self) -> int:
        return -(-self.cache_length // self.page_size)

    @property
    def pool_pages(self) -> int:
        """Usable pages of a slice's paged pool."""
        return self.kv_pages or self.slots_per_slice * self.pages_per_slot

    def __post_init__(self):
        super().__post_init__()
        if self.prefill_buckets[-1] < self.max_prefill_length:
            fail(self._f("prefill_buckets"),
                 f"largest bucket {self.prefill_buckets[-1]} < "
                 f"rollout.max_prefill_length {self.max_prefill_length}")
        if self.kv_pages and self.kv_pages < self.pages_per_slot:
            fail(self._f("kv_pages"), f"{self.kv_pages} pages cannot hold one request of "
                                      f"cache_length {self.cache_length} ({self.pages_per_slot} "
                                      f"pages of {self.page_size})")


@dataclasses.dataclass(frozen=True)
class TrainerConfig(Section):
    """Optimiser, RL objective and batching of the train step."""

    PATH: ClassVar[str] = "trainer"
    learning_rate: float = field(1e-3, gt=0)
    warmup_steps: int = field(0, min=0)
    schedule: str = field("constant", choices=SCHEDULES)
    decay_steps: int = 1000  # cosine horizon in optimizer updates
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    grad_clip: float = 1.0
    micro_batches: int = field(1, min=1)  # gradient accumulation inside one update
    num_minibatches: int = field(1, min=1)  # optimizer updates per train step
    advantage: str = field("grpo", choices=ADVANTAGES)
    # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    # (verl's: sum of every sequence's token sum / max_decode_len) |
    # seq-mean-token-sum-over-max-len (Dr. GRPO: mean over sequences of token sum /
    # max_decode_len). See rl/losses.py: aggregate_loss.
    loss_agg_mode: str = field("token-mean", choices=LOSS_AGG_MODES)
    # behaviour_clip: ratio pi/mu clipped (mu: the sampling policy); decoupled: ratio
    # pi/pi_prox clipped, weighted by pi_prox/mu (is_mode: truncate at is_cap or mask
    # beyond it); tis: the same with truncation (verl's TIS). pi_prox: the policy at
    # the start of the step. See rl/objective.py.
    objective: str = field("behaviour_clip", choices=OBJECTIVES)
    is_cap: float | None = field(None, gt=0)
    is_mode: str = field("truncate", choices=IS_MODES)
    clip_low: float = field(0.2, ge=0, lt=1)
    clip_high: float = field(0.2, ge=0)
    dual_clip: float | None = field(None, gt=1)
    kl_coef: float = field(0.0, ge=0)
    kl_kind: str = field("k3", choices=KL_KINDS)
    # DAPO: drop groups whose rewards are all equal (ledger `filter` events; the
    # step still trains train_batch_size groups), the soft overlong punishment
    # (0 up to max_decode_len - overlong_buffer tokens, then down to -overlong_penalty)
    # and overlong filtering (no loss on responses cut at max_decode_len).
    filter_zero_variance: bool = False
    overlong_buffer: int = field(0, min=0)
    overlong_penalty: float = field(1.0, ge=0)
    mask_truncated: bool = False
    # Padded prompt + response lengths of train batches (the largest: a whole one).
    length_buckets: tuple = field((32, 64), ascending=True)
    # > 0: pack samples whole into rows of the batch's length bucket and cut
    # micro-batches by this many tokens (rl/packing.py), so one long response no longer
    # pads every row of its batch; micro_batches must be 1. 0: one padded row per
    # sample, micro-batches by row count.
    tokens_per_microbatch: int = field(0, min=0)

    def __post_init__(self):
        super().__post_init__()
        if self.objective == "behaviour_clip" and self.is_cap is not None:
            fail(self._f("is_cap"), "applies to objective 'decoupled' or 'tis' (behaviour_clip "
                                     "clips pi/mu itself), got objective 'behaviour_clip'")
        if self.objective == "tis" and (self.is_cap is None or self.is_mode != "truncate"):
            fail(self._f("is_cap"), "objective 'tis' truncates the weight: it needs is_cap and "
                                     f"is_mode 'truncate' (got {self.is_cap}, {self.is_mode!r})")


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig(Section):
    """Scheduling: which mode, batch sizes in groups, staleness bound, run length."""

    PATH: ClassVar[str] = "coordinator"
    mode: str = field("dora", choices=MODES)
    group_size: int = field(4, min=1)  # G samples per prompt
    train_batch_size: int = field(4, min=1)  # TBS groups per train step
    # RBS: admitted-but-unconsumed groups; the streaming modes (dora, partial_rollout)
    # count RBS x G samples in flight instead (scheduler/dora.py).
    rollout_batch_size: int = field(8, min=1)
    max_staleness: int = field(2, min=0)  # K
    num_steps: int = field(20, min=1)
    # Train steps between checkpoints (0: only at the end). A crash loses at most
    # this many steps. Orbax writes in the background, but each save holds the
    # coordinator between two steps while it starts (tiny CPU config: ~2 s for the
    # first save in a process, ~0.13 s after); benchmarks turn periodic saves off.
    checkpoint_every: int = field(5, min=0)
    # Where checkpoints go ("": <workdir>/checkpoints). A gs:// location lets Orbax
    # write straight to Cloud Storage (under Pathways, from the TPU hosts) while the
    # workdir's other files stay on a mounted bucket (dora_jax.launch.gke sets it).
    checkpoint_dir: str = field("")
    # A slice that raises is restarted empty (its requests regenerated) up to this
    # many times in a run; one more failure stops the run.
    max_slice_restarts: int = field(3, min=0)
    # Seconds without any event while work is outstanding (a sample running, a load,
    # a train step, rewards pending) after which the run stops with a RunError naming
    # what each slice and the trainer were doing (0: wait forever). Far above any
    # single generate call, load or train step.
    stall_timeout: float = field(600.0, ge=0)
    # Fault injection (tests, drills), by count, not by timing: slice `fail_slice`
    # (-1: none; -2: whichever slice gets there first) raises the (`fail_after` +
    # 1)-th time it reaches `fail_point`:
    # "generate" (a generate call with requests held), "load" (placing a version's
    # params), "export" (a migration out, its hand-over not yet filled) or "import"
    # (a migration in, its requests arrived). The restarted slice does not fail again.
    fail_slice: int = field(-1, min=-2)
    fail_point: str = field("generate", choices=FAIL_POINTS)
    fail_after: int = field(0, min=0)
    # The same for the whole process (runtime/faults.py KillPlan): SIGKILL the
    # (`kill_after` + 1)-th time the run reaches `kill_point` ("": never; "train": a
    # step begun; "save": a checkpoint being written; "finished_waiting": finished
    # groups waiting on a busy trainer). The same command then resumes the run.
    kill_point: str = field("", choices=KILL_POINTS)
    kill_after: int = field(0, min=0)
    # Rewards run in this many worker processes, never in the coordinator's
    # (rewards/pool.py): model text is untrusted input.
    reward_workers: int = field(2, min=1)
    # Seconds a reward call may run (0: no limit); past it the worker is killed and
    # replaced, the sample scores 0 with the reason in the ledger, and the run goes on.
    reward_timeout: float = field(60.0, ge=0)
    # MiB each reward worker may grow beyond its loaded modules (0: no cap); a call
    # past it scores 0 with the reason.
    reward_memory_mb: int = field(2048, min=0)
    # Longest response scored, in characters of text or ids of a token response; a
    # longer one scores 0 with the reason, before any parsing.
    reward_max_response: int = field(1 << 20, min=1)

    def __post_init__(self):
        check_not_retired(self.mode)
        super().__post_init__()
        check_rollout_batch(self.rollout_batch_size, self.train_batch_size)


# The rules on a schedule's shape, as plain functions: the sections above run them on a
# whole config, and `check_schedule` on a scheduler config built without one.

def check_not_retired(mode) -> None:
    """An older config's mode name fails with what replaces it."""
    if mode in RETIRED_MODES:
        fail("coordinator.mode", f"{mode!r} is no longer a mode; {RETIRED_MODES[mode]}")


def check_rollout_batch(rollout_batch_size: int, train_batch_size: int) -> None:
    """RBS >= TBS: the rollout must hold at least one train batch."""
    if rollout_batch_size < train_batch_size:
        fail("coordinator.rollout_batch_size", f"must be >= coordinator.train_batch_size "
              f"({train_batch_size}), got {rollout_batch_size}")


def check_group_fits(group_size: int, num_slices: int, slots_per_slice: int):
    """A group's samples must fit in the slots at once (a group starts as a whole)."""
    if group_size > num_slices * slots_per_slice:
        fail("coordinator.group_size",
              f"{group_size} samples per group do not fit in {num_slices * slots_per_slice} "
              f"slots (mesh.num_slices x rollout.slots_per_slice)")


def check_versions(versions_per_slice: int, max_staleness: int) -> None:
    """V <= K + 1: the staleness window [P - K, P] holds K + 1 versions, so a slice
    never has a use for more places than that."""
    check_declared(RolloutConfig, "versions_per_slice", versions_per_slice)
    if versions_per_slice > max_staleness + 1:
        fail("rollout.versions_per_slice", f"must be <= coordinator.max_staleness + 1 "
             f"({max_staleness + 1}: the versions the staleness window holds), got "
             f"{versions_per_slice}")


def check_multi_version(versions_per_slice: int, policy, mode: str, model) -> None:
    """V > 1 on real slices: a mode that schedules by residency, and versions that
    differ by LoRA adapters on one shared base (V full-weight copies run only in the
    simulator, whose presets know the device memory they need)."""
    from dora_jax.scheduler.modes import POLICIES

    got = f"got {versions_per_slice}"
    if not policy.multi_version:
        fail("rollout.versions_per_slice", f"several versions per slice are scheduled "
             f"only in {_modes_with(POLICIES, 'multi_version')}, not in {mode!r}: use 1, {got}")
    if not model.lora.enabled:
        fail("rollout.versions_per_slice", "several versions per slice share one base and "
             "differ by their adapters: set model.lora.rank > 0 (V full-weight copies per "
             "slice run only in the simulator: python -m dora_jax.sim "
             f"--versions_per_slice=V), {got}")
    if model.lora.experts and model.moe.num_experts:
        fail("model.lora.experts", "per-expert adapters cannot be selected per slot: "
             "several versions per slice (rollout.versions_per_slice > 1) need "
             "model.lora.experts=False")


def check_declared(section, name: str, value) -> None:
    """Checks `value` against the constraint `section` declares for its field `name`
    (schema.field), naming the field as the section's own validation does."""
    f = next(f for f in dataclasses.fields(section) if f.name == name)
    check(f"{section.PATH}.{name}", value, **f.metadata)


def check_schedule(*, mode, num_slices, slots_per_slice, group_size, train_batch_size,
                   rollout_batch_size, max_staleness, versions_per_slice=1) -> None:
    """Every rule a run config places on the scheduler's shape, for a scheduler
    config built directly (the tests, the simulator); one derived from a validated
    `Config` has passed them already (`SchedulerConfig.from_config`)."""
    check_not_retired(mode)
    for name, value in (("mode", mode), ("group_size", group_size),
                        ("train_batch_size", train_batch_size),
                        ("rollout_batch_size", rollout_batch_size),
                        ("max_staleness", max_staleness)):
        check_declared(CoordinatorConfig, name, value)
    check_rollout_batch(rollout_batch_size, train_batch_size)
    check_declared(MeshConfig, "num_slices", num_slices)
    check_declared(RolloutConfig, "slots_per_slice", slots_per_slice)
    check_group_fits(group_size, num_slices, slots_per_slice)
    check_versions(versions_per_slice, max_staleness)


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
        """Every check that spans sections."""
        m, mesh, r, t, c, d = (self.model, self.mesh, self.rollout, self.trainer,
                               self.coordinator, self.data)
        for (name, axis), (what, dim) in [
                (("trainer", "tensor"), ("model.num_kv_heads", m.num_kv_heads)),
                (("slice", "tensor"), ("model.num_kv_heads", m.num_kv_heads)),
                (("trainer", "expert"), ("model.moe.num_experts", m.moe.num_experts)),
                (("slice", "expert"), ("model.moe.num_experts", m.moe.num_experts))]:
            size = getattr(mesh, name)[axis]
            if size > 1 and dim and dim % size:
                fail(f"mesh.{name}.{axis}", f"mesh axis size {size} must divide {what} ({dim})")
        if r.top_k > m.vocab_size:
            fail("rollout.top_k", f"must be in [0, vocab_size={m.vocab_size}], got {r.top_k}")
        for name in ("eos_id", "pad_id"):
            if not 0 <= getattr(r, name) < m.vocab_size:
                fail(f"rollout.{name}", f"must be a token id < vocab_size ({m.vocab_size})")
        # The policies' capabilities (class attributes): the scheduler is pure Python,
        # imported here because it imports this module.
        from dora_jax.scheduler.modes import POLICIES

        policy = POLICIES[c.mode]
        if t.filter_zero_variance and not policy.replaces_filtered_groups:
            fail("trainer.filter_zero_variance", f"{c.mode} trains fixed batches of group "
                  "ids and cannot replace a filtered group; use "
                  + _modes_with(POLICIES, "replaces_filtered_groups"))
        if t.overlong_buffer >= r.max_decode_len:
            fail("trainer.overlong_buffer", f"must be < rollout.max_decode_len "
                  f"({r.max_decode_len}), got {t.overlong_buffer}")
        if t.length_buckets[-1] < r.cache_length:
            fail("trainer.length_buckets",
                  f"largest bucket {t.length_buckets[-1]} must hold a whole trajectory "
                  f"(rollout.max_prefill_length + rollout.max_decode_len = {r.cache_length})")
        if mesh.colocated and not policy.allows_colocation:
            turns = _modes_with(POLICIES, "allows_colocation")
            fail("mesh.colocated", "slices share the trainer's devices only in a mode that "
                  f"takes turns between rollout and training ({turns}), not in {c.mode!r}")
        check_group_fits(c.group_size, mesh.num_slices, r.slots_per_slice)
        check_versions(r.versions_per_slice, c.max_staleness)
        if r.versions_per_slice > 1:
            check_multi_version(r.versions_per_slice, policy, c.mode, m)
        if c.reward_max_response < r.max_decode_len:
            fail("coordinator.reward_max_response", f"must be >= rollout.max_decode_len "
                  f"({r.max_decode_len}): a complete response must be scored, got "
                  f"{c.reward_max_response}")
        if self.eval.every and d.source == "env":
            fail("eval.every", "held-out evaluation runs single-turn prompts; multi-turn "
                 "episodes (data.source='env') report their rewards in the ledger and "
                 "metrics instead: set eval.every=0")
        if self.eval.every and self.eval.slice >= mesh.num_slices:
            fail("eval.slice", f"must name a slice < mesh.num_slices ({mesh.num_slices}), "
                  f"got {self.eval.slice}")
        if c.fail_slice >= mesh.num_slices:
            fail("coordinator.fail_slice", f"must name a slice < mesh.num_slices "
                  f"({mesh.num_slices}), or be -1 (none) or -2 (any), got {c.fail_slice}")
        samples, split = c.train_batch_size * c.group_size, t.micro_batches * t.num_minibatches
        if samples % split:
            fail("coordinator.train_batch_size",
                  f"TBS x group_size = {samples} samples must divide evenly into "
                  f"trainer.num_minibatches x trainer.micro_batches = {split}")
        batch_axes = _axes_of(dict(mesh.trainer_rules).get("batch"))
        shards = math.prod(mesh.trainer[a] for a in batch_axes)
        if t.tokens_per_microbatch:
            row = t.length_buckets[-1]
            if t.micro_batches != 1:
                fail("trainer.micro_batches", "must be 1 with trainer.tokens_per_microbatch "
                      f"(micro-batches are cut by tokens then), got {t.micro_batches}")
            rows = t.tokens_per_microbatch // row
            if rows < 1 or t.tokens_per_microbatch % (row * shards):
                fail("trainer.tokens_per_microbatch", f"must be a positive multiple of the "
                      f"packed row ({row} tokens: the largest trainer.length_buckets) x the "
                      f"trainer mesh's {shards} batch shards {batch_axes} = {row * shards}, "
                      f"got {t.tokens_per_microbatch}")
        elif (samples // split) % shards:
            fail("coordinator.train_batch_size", f"TBS x group_size = {samples} samples in "
                  f"{split} micro-batches must divide by the trainer mesh's {shards} batch "
                  f"shards {batch_axes}")
        if d.source in ("residue", "countdown") and d.tokenizer:
            # Their prompts and rewards are token ids with EOS 1 and PAD 0 (data/tasks.py),
            # which mean nothing to a real tokenizer's model.
            fail("data.source", f"{d.source!r} is a token task (EOS id 1), but data.tokenizer "
                  f"{d.tokenizer} is set (by model.checkpoint or data.tokenizer): use a text "
                  "source, e.g. --config.data.source=gsm8k --config.data.path=FILE")
        if d.source == "residue" and d.prompt_len > r.max_prefill_length:
            fail("data.prompt_len", f"must be <= rollout.max_prefill_length, got {d.prompt_len}")
        if d.source == "residue" and d.modulus > m.vocab_size - 3:
            fail("data.modulus", f"must be in [2, vocab_size - 3], got {d.modulus}")
        if d.source == "countdown" and not d.max_count < min(r.max_decode_len, m.vocab_size - 3):
            fail("data.max_count", f"must be < rollout.max_decode_len and vocab_size - 3 (a "
                  f"countdown is max_count + 1 tokens of numbers 0..), got {d.max_count}")


def _modes_with(policies: dict, capability: str) -> str:
    """'sync, partial_rollout or dora': the modes whose policy has `capability`."""
    names = [m for m in MODES if getattr(policies[m], capability)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None, *,
             pretrained=None) -> Config:
    """Validates a whole ConfigDict into a `Config`; `num_devices` is checked when
    given. Pure: no file is read. What a Hugging Face checkpoint or tokenizer named by
    the config determines comes in `pretrained` (`model.hf_checks.check_pretrained`,
    which reads them once; `hf_checks.validated` does both); a config that names
    them without it fails, naming the field."""
    d = config.to_dict()
    if pretrained is not None:
        d = pretrained.apply(d)
    else:
        for path in ("model.checkpoint", "data.tokenizer"):
            section, name = path.split(".")
            if d.get(section, {}).get(name):
                fail(path, "names files this pure check does not read: validate with "
                           "pretrained=dora_jax.model.hf_checks.check_pretrained(config) "
                           "(or hf_checks.validated(config))")
    if d["model"].get("vocab_size") is None and not d["model"].get("checkpoint"):
        fail("model.checkpoint", "this config takes the model's architecture from a Hugging "
              "Face checkpoint: set --config.model.checkpoint=DIR")
    cfg = Config.from_dict(d)
    if num_devices is not None:
        check_devices(cfg, num_devices)
    return cfg


def check_devices(cfg: Config, num_devices: int) -> None:
    """Fails, naming `mesh`, if the config's meshes need more than `num_devices`
    (entry points validate before JAX starts, then check once it has)."""
    mesh, n = cfg.mesh, cfg.mesh.total_devices
    if n > num_devices:
        fail("mesh", f"trainer ({mesh.trainer_devices}) + {mesh.num_slices} slices x "
                      f"{mesh.slice_devices} devices = {n}, but only {num_devices} devices are "
                      f"available (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})")


def base() -> ml_collections.ConfigDict:
    """Every field with its default; configs/*.py start here and override."""
    return schema(Config)


def load(spec: str) -> ml_collections.ConfigDict:
    """Loads `path/to/config.py[:variant]` (relative to the working directory or
    absolute) or a shipped config by name (`tiny`, `moe:tiny`: dora_jax/configs), the
    way `--config=` does."""
    from dora_jax import configs  # imports nothing

    path, _, variant = configs.resolve(spec).partition(":")
    module_spec = importlib.util.spec_from_file_location("_dora_config", path)
    assert module_spec is not None and module_spec.loader is not None  # a .py path
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(variant or None)
