"""The model and device-layout sections of the config: what is trained (ModelConfig,
MoEConfig) and on which devices (MeshConfig, the logical-axis rules). Validated like
every section (schema.py); no JAX. `dora_jax.config` re-exports everything here."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import ClassVar

from .schema import Section, check, fail, field

MOE_DISPATCH = ("dropless", "capacity")
DTYPES = ("float32", "bfloat16")
ROPE_SCALINGS = ("none", "llama3")  # model/layers.py: rope_frequencies
ATTENTION_IMPLS = ("auto", "dense", "blockwise", "cudnn", "splash")  # model/attention.py
REMAT_POLICIES = ("none", "full", "dots", "offload_dots")  # model/transformer.py
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # model/lora.py

TRAINER_MESH_AXES = ("data", "fsdp", "tensor", "expert")
SLICE_MESH_AXES = ("tensor", "expert")

# Logical axis names of the model code -> mesh axes (None: replicated); the defaults.
TRAINER_RULES = (
    ("batch", ("data", "fsdp", "expert")), ("length", None), ("embed", "fsdp"),
    ("vocab", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"), ("head_dim", None),
    ("mlp", "tensor"), ("expert", "expert"), ("expert_mlp", "tensor"), ("cache_length", None),
    ("layers", None), ("lora_rank", None),
)


def _axes_of(target) -> tuple:
    """A rule's mesh axes as a tuple (a rule names None, one axis or several)."""
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def _rule_target(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def decode_rules_from(trainer_rules) -> tuple:
    """Decode slices hold a full copy of the params per slice: the trainer's rules
    without the data and FSDP axes, and an unsharded batch (the slots)."""
    return tuple((name, None if name == "batch" else _rule_target(
        tuple(a for a in _axes_of(target) if a in SLICE_MESH_AXES)))
        for name, target in trainer_rules)


DECODE_RULES = decode_rules_from(TRAINER_RULES)


@dataclasses.dataclass(frozen=True)
class MoEConfig(Section):
    PATH: ClassVar[str] = "model.moe"
    num_experts: int = field(0, min=0)  # 0: dense MLP everywhere
    top_k: int = 2
    expert_hidden: int = 0
    # Training's dispatch (decoding is always dropless): "capacity" drops what an
    # expert cannot take, ceil(capacity_factor * tokens * top_k / E); its log-probs
    # then differ from the engine's, so it is only used when asked for (a
    # capacity_factor alone changes nothing).
    dispatch: str = field("dropless", choices=MOE_DISPATCH)
    capacity_factor: float | None = field(None, gt=0)
    num_shared_experts: int = field(0, min=0)
    shared_expert_hidden: int = 0
    moe_every: int = 1  # layer i is MoE iff i % moe_every == moe_every - 1
    normalize_topk: bool = True  # renormalise the top-k router weights to sum to 1
    aux_loss_coef: float = field(0.0, ge=0)
    z_loss_coef: float = field(0.0, ge=0)

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self):
        super().__post_init__()
        if not self.enabled:
            return
        for name in ("top_k", "expert_hidden", "moe_every") + (
                ("shared_expert_hidden",) if self.num_shared_experts else ()):
            check(self._f(name), getattr(self, name), min=1)
        if self.top_k > self.num_experts:
            fail(self._f("top_k"), f"must be <= model.moe.num_experts ({self.num_experts}), "
                                    f"got {self.top_k}")
        if self.dispatch == "capacity" and self.capacity_factor is None:
            fail(self._f("capacity_factor"), "model.moe.dispatch 'capacity' needs a capacity "
                                              "factor")


@dataclasses.dataclass(frozen=True)
class LoRAConfig(Section):
    """Low-rank adapters on the projections (model/lora.py): y = W x + alpha / rank *
    B A x, only A and B trained. rank 0: full fine-tuning, no adapter anywhere."""

    PATH: ClassVar[str] = "model.lora"
    rank: int = field(0, min=0)
    alpha: float = 32.0  # scale = alpha / rank
    targets: tuple = LORA_TARGETS  # attention q, k, v, o; MLP gate, up, down
    experts: bool = False  # also each MoE expert's gate / up / down (when targeted)
    dtype: str = field("float32", choices=DTYPES)  # of the adapters, whatever the base's
    # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, e.g.
    # peft's save_pretrained or `dora_jax.export --format=peft`) the adapters start
    # from instead of fresh ones; its r, lora_alpha and target_modules must be the
    # rank, alpha and targets above. See model/peft_format.py.
    checkpoint: str = ""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    def __post_init__(self):
        super().__post_init__()
        if not self.enabled:
            if self.checkpoint:
                fail(self._f("checkpoint"), "starts adapters from a PEFT adapter: set "
                                            "model.lora.rank (its r) too")
            return
        if not self.alpha > 0:
            fail(self._f("alpha"), f"must be > 0 with model.lora.rank > 0, got {self.alpha}")
        if not self.targets:
            fail(self._f("targets"), f"must name at least one of {LORA_TARGETS} with "
                                     f"model.lora.rank > 0")
        for t in self.targets:
            if t not in LORA_TARGETS:
                fail(self._f("targets"), f"unknown target {t!r}; known: {LORA_TARGETS}")
        if len(set(self.targets)) != len(self.targets):
            fail(self._f("targets"), f"names a target twice: {tuple(self.targets)}")
        if self.experts and not set(self.targets) & {"gate", "up", "down"}:
            fail(self._f("experts"), "adapts the experts' gate / up / down: name one of "
                                     f"them in model.lora.targets, got {tuple(self.targets)}")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Section):
    PATH: ClassVar[str] = "model"
    vocab_size: int = field(min=1)
    d_model: int = field(min=1)
    num_layers: int = field(min=1)
    num_heads: int = field(min=1)
    num_kv_heads: int = field(min=1)
    head_dim: int = field(min=1)
    mlp_hidden: int = field(min=1)
    # Tied: logits = hidden . embed^T, as the Qwen / Llama families compute them.
    tie_embeddings: bool = False
    qk_norm: bool = True
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2 / Qwen2.5)
    rope_theta: float = field(10_000.0, gt=0)
    # "llama3": Llama 3.1's frequency scaling of RoPE (low frequencies divided by
    # rope_factor, a smooth blend between the two wavelength bounds).
    rope_scaling: str = field("none", choices=ROPE_SCALINGS)
    rope_factor: float = field(8.0, gt=0)
    rope_low_freq_factor: float = field(1.0, gt=0)
    rope_high_freq_factor: float = field(4.0, gt=0)
    rope_original_max_len: int = field(8192, min=1)
    # A Hugging Face checkpoint directory (config.json + safetensors): the
    # architecture fields above come from it (a field set otherwise is an error),
    # and training starts from its weights. See model/hf.py.
    checkpoint: str = ""
    norm_eps: float = field(1e-6, gt=0)
    dtype: str = field("float32", choices=DTYPES)  # activations / compute
    param_dtype: str = field("float32", choices=DTYPES)
    # Full-sequence attention (auto: splash on TPU, cudnn on GPU, blockwise otherwise)
    # and its block size; what each layer saves for the backward pass.
    attention: str = field("auto", choices=ATTENTION_IMPLS)
    attention_block: int = field(512, min=1)
    remat: str = field("none", choices=REMAT_POLICIES)
    # The trainer's layout (and its checkpoints'): one compiled layer period, scanned
    # over the depth. Decode slices always hold every layer's params apart
    # (model/layer_layout.py) and run their layers unrolled, prefill included.
    scan_layers: bool = True
    # Full forwards of the trainer unroll the layer scan over the stacked params:
    # no per-layer residual is stacked (XLA's CPU backend zero-fills such stacks, then
    # writes them layer by layer), at a compile time that grows with depth. On a CPU,
    # unrolled, a train step of 8 layers at d_model 256 took ~9% less time, and
    # configs/tiny.py's default ran a median 8% more tokens/s (docs/benchmarks.md).
    unroll_forward: bool = False
    moe: MoEConfig = MoEConfig()
    lora: LoRAConfig = LoRAConfig()

    def is_moe_layer(self, layer: int) -> bool:
        m = self.moe
        return m.enabled and layer % m.moe_every == m.moe_every - 1

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def layer_period(self) -> int:
        """Layers per repeating unit (dense/MoE interleave); the scan's step."""
        return self.moe.moe_every if self.moe.enabled else 1

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.num_heads:
            fail(self._f("num_heads"),
                  f"must divide model.d_model ({self.d_model}), got {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            fail(self._f("num_kv_heads"),
                  f"must divide model.num_heads ({self.num_heads}), got {self.num_kv_heads}")
        if self.rope_scaling == "llama3" and not (
                self.rope_high_freq_factor > self.rope_low_freq_factor):
            fail(self._f("rope_high_freq_factor"), f"must be > model.rope_low_freq_factor "
                  f"({self.rope_low_freq_factor}), got {self.rope_high_freq_factor}")
        if self.head_dim % 2:
            fail(self._f("head_dim"), f"must be even for rotary embeddings, got {self.head_dim}")
        if self.moe.enabled and self.moe.moe_every > self.num_layers:
            fail("model.moe.moe_every", f"must be <= model.num_layers ({self.num_layers}) or "
                                         f"no layer is MoE, got {self.moe.moe_every}")
        if self.lora.enabled and self.lora.experts and not self.moe.enabled:
            fail("model.lora.experts", "adapts MoE experts, but the model is dense "
                                       "(model.moe.num_experts = 0)")
        if self.scan_layers and self.num_layers % self.layer_period:
            fail(self._f("scan_layers"), f"scanning needs num_layers ({self.num_layers}) to "
                  f"be a multiple of the dense/MoE period ({self.layer_period})")


def _mesh_shape(axes):
    return dataclasses.field(default_factory=lambda: {a: 1 for a in axes})


@dataclasses.dataclass(frozen=True)
class MeshConfig(Section):
    """Device layout: a trainer mesh and `num_slices` decode-slice meshes, on disjoint
    devices, or with `colocated` all on the trainer's devices (rollout and training
    then take turns: a mode whose policy `allows_colocation`, i.e. sync)."""

    PATH: ClassVar[str] = "mesh"
    trainer: Mapping[str, int] = _mesh_shape(TRAINER_MESH_AXES)
    slice: Mapping[str, int] = _mesh_shape(SLICE_MESH_AXES)
    num_slices: int = field(1, min=1)
    colocated: bool = False
    trainer_rules: tuple = TRAINER_RULES
    decode_rules: tuple = DECODE_RULES

    trainer_devices = property(lambda self: math.prod(self.trainer.values()))
    slice_devices = property(lambda self: math.prod(self.slice.values()))
    total_devices = property(lambda self: self.trainer_devices + (
        0 if self.colocated else self.num_slices * self.slice_devices))

    def __post_init__(self):
        super().__post_init__()
        for name, axes in (("trainer", TRAINER_MESH_AXES), ("slice", SLICE_MESH_AXES)):
            shape = dict(getattr(self, name))
            if set(shape) != set(axes):
                fail(self._f(name), f"must give a size for each of {axes}, got {sorted(shape)}")
            for axis in axes:
                check(f"mesh.{name}.{axis}", shape[axis], min=1)
            object.__setattr__(self, name, {a: shape[a] for a in axes})
        for name, axes in (("trainer_rules", TRAINER_MESH_AXES), ("decode_rules", SLICE_MESH_AXES)):
            rules = _normalise_rules(self._f(name), getattr(self, name), axes)
            object.__setattr__(self, name, rules)
        if self.colocated and self.num_slices * self.slice_devices != self.trainer_devices:
            fail(self._f("num_slices"), f"colocated: {self.num_slices} slices x "
                  f"{self.slice_devices} devices must cover the trainer's {self.trainer_devices}")


def colocate(mesh: Mapping) -> dict:
    """The colocated layout on the same devices as disaggregated `mesh` (a dict): the
    trainer's data axis grows to span every device and slices of the same shape
    cover them all, so sync on it is compared on the same device count (bench.runs'
    `colocated_sync` runs)."""
    m = MeshConfig.from_dict(mesh)
    if m.colocated:
        return dict(mesh)
    n, k = m.total_devices, m.slice_devices
    if n % m.trainer_devices or n % k:
        fail("mesh.trainer", f"colocation spreads trainer ({m.trainer_devices} devices) "
              f"and slices ({k} each) over all {n}: both must divide {n}")
    trainer = dict(m.trainer, data=m.trainer["data"] * n // m.trainer_devices)
    return dict(mesh, trainer=trainer, num_slices=n // k, colocated=True)


def _normalise_rules(field: str, rules, axes) -> tuple:
    out = []
    for entry in rules:
        if len(entry) != 2:
            fail(field, f"each rule is (logical_name, mesh_axes), got {entry!r}")
        bad = [a for a in _axes_of(entry[1]) if a not in axes]
        if bad:
            fail(field, f"rule for {entry[0]!r} names mesh axis {bad[0]!r}, not one of {axes}")
        out.append((entry[0], _rule_target(_axes_of(entry[1]))))
    return tuple(out)
