"""Hugging Face `config.json` <-> the model section of our config, without JAX.

Families: Qwen3 (`qwen3`), Qwen3-MoE (`qwen3_moe`), Qwen2 / Qwen2.5 (`qwen2`) and
Llama 3 (`llama`). Both generations of field names are read: hub checkpoints written
before transformers 5 say `rope_theta` / `rope_scaling` / `num_experts`, newer ones
`rope_parameters` / `num_local_experts`. What our model cannot compute exactly
(sliding windows, output-projection biases, other activations or RoPE scalings) is
refused by name rather than loaded approximately.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from dora_jax.base import untrusted_files

if TYPE_CHECKING:
    from dora_jax.config import ModelConfig

FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}

# Fields of `model` that a checkpoint determines (the rest: how to compute).
ARCH_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "mlp_hidden", "tie_embeddings", "qk_norm", "qkv_bias", "rope_theta",
               "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_len", "norm_eps")
MOE_ARCH_FIELDS = ("num_experts", "top_k", "expert_hidden", "moe_every", "normalize_topk",
                   "num_shared_experts", "shared_expert_hidden")


# Bounds on what config.json may say: far above any released model (Llama 3 405B:
# 126 layers, hidden 16384, MLP 53248; vocabularies up to ~260k), far below what
# would make building the model exhaust a host. A value outside is a corrupt file.
MAX_LAYERS = 1024
MAX_HIDDEN = 2 ** 20  # hidden_size, head_dim
MAX_MLP = 2 ** 22  # intermediate_size, moe_intermediate_size
MAX_HEADS = 2 ** 14  # attention and KV heads, experts
MAX_VOCAB = 2 ** 24
MAX_POSITIONS = 2 ** 24


class CheckpointError(ValueError):
    """A checkpoint directory cannot be read as a model we compute exactly."""


def read(directory: str) -> dict:
    """config.json of a checkpoint directory, as a JSON object."""
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    try:
        # A regular file inside the checkpoint, capped (untrusted_files: a FIFO, a
        # link to /dev/zero or nesting 100k deep is one line, not a hang or a crash).
        hf = untrusted_files.loads(
            untrusted_files.read_bytes(path, untrusted_files.CONFIG_JSON_CAP, within=directory,
                                       error=CheckpointError), path, CheckpointError)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no config.json") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(hf).__name__}")
    return hf


# ------------------------------------------------------------------ typed fields

def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(d: dict, name: str, where: str, hi: int, *, lo: int = 1, default: int | None = None,
         label: str | None = None) -> int:
    """An int field in [lo, hi]; absent or null gives `default` (None: required)."""
    label = label or name
    value = d.get(name)
    if value is None:
        if default is None:
            raise CheckpointError(f"{where}: {label} is missing")
        return default
    if not _is_int(value):
        raise CheckpointError(f"{where}: {label} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise CheckpointError(f"{where}: {label} {value} is out of range [{lo}, {hi}]")
    return value


def _number(d: dict, name: str, where: str, *, default: float | None = None,
            label: str | None = None,
            below: float = float("inf")) -> float:
    """A finite number field in (0, below)."""
    label = label or name
    value = d.get(name)
    if value is None:
        if default is None:
            raise CheckpointError(f"{where}: {label} is missing")
        return float(default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise CheckpointError(f"{where}: {label} must be a number, got {value!r}")
    if not 0 < value < below or value != value:
        raise CheckpointError(f"{where}: {label} {value!r} is out of range (0, {below:g})")
    return float(value)


def _bool(d: dict, name: str, where: str, default: bool = False) -> bool:
    # Only a JSON bool: the string "false" is true to Python and must not be read so.
    value = d.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def _typed(d: dict, name: str, where: str, kind: type, label: str | None = None) -> Any:
    """A field that is null or a `kind` (dict, list, str)."""
    value = d.get(name)
    if value is not None and not isinstance(value, kind):
        raise CheckpointError(f"{where}: {label or name} must be "
                              f"{'an object' if kind is dict else 'a ' + kind.__name__}, "
                              f"got {value!r}")
    return value


def stored_dtype(hf: dict, where: str = "config.json") -> str | None:
    """The checkpoint's dtype name (`torch_dtype`, or transformers 5's `dtype`)."""
    return _typed(hf, "torch_dtype", where, str) or _typed(hf, "dtype", where, str)


def _rope(hf: dict, where: str) -> tuple[float, dict | None, str]:
    """(theta, the scaling dict or None, the scaling's field name for errors)."""
    params = _typed(hf, "rope_parameters", where, dict)
    if params:  # transformers 5: theta and scaling in one dict
        theta = _number(params, "rope_theta", where, label="rope_parameters.rope_theta",
                        default=_number(hf, "rope_theta", where, default=10_000.0))
        kind = _typed(params, "rope_type", where, str, "rope_parameters.rope_type")
        return theta, None if kind in (None, "default") else params, "rope_parameters"
    theta = _number(hf, "rope_theta", where, default=10_000.0)
    return theta, _typed(hf, "rope_scaling", where, dict), "rope_scaling"


def _moe_fields(hf: dict, where: str, num_layers: int) -> dict:
    name = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    experts = _int(hf, name, where, MAX_HEADS)
    return dict(num_experts=experts,
                top_k=_int(hf, "num_experts_per_tok", where, experts),
                expert_hidden=_int(hf, "moe_intermediate_size", where, MAX_MLP),
                moe_every=_int(hf, "decoder_sparse_step", where, num_layers, default=1),
                normalize_topk=_bool(hf, "norm_topk_prob", where),
                num_shared_experts=0, shared_expert_hidden=0)


def model_fields(hf: dict, where: str = "config.json") -> dict:
    """Our `model` fields (with a nested `moe` dict) for a Hugging Face config.
    Every field read is type- and range-checked: a bad one raises a CheckpointError
    naming `where` and the field."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(hf).__name__}")
    family = hf.get("model_type")
    if not isinstance(family, str) or family not in FAMILIES:
        raise CheckpointError(f"{where}: model_type {family!r} is not supported; "
                              f"supported: {FAMILIES}")

    def refuse(condition: object, what: str) -> None:
        if condition:
            raise CheckpointError(f"{where}: {what} is not supported")

    act = _typed(hf, "hidden_act", where, str) or "silu"
    refuse(act != "silu", f"hidden_act {act!r}")
    refuse(_bool(hf, "use_sliding_window", where), "use_sliding_window")
    refuse(_bool(hf, "mlp_bias", where), "mlp_bias")
    # Qwen3 and Llama's attention_bias also biases the output projection.
    refuse(family != "qwen2" and _bool(hf, "attention_bias", where),
           "attention_bias (output bias)")
    refuse(_typed(hf, "mlp_only_layers", where, list), "mlp_only_layers")
    refuse(_int(hf, "shared_expert_intermediate_size", where, MAX_MLP, lo=0, default=0),
           "a shared expert with a gate")
    d = _int(hf, "hidden_size", where, MAX_HIDDEN)
    heads = _int(hf, "num_attention_heads", where, MAX_HEADS)
    kv_heads = _int(hf, "num_key_value_heads", where, heads, default=heads)
    if heads % kv_heads:
        raise CheckpointError(f"{where}: num_key_value_heads {kv_heads} does not divide "
                              f"num_attention_heads {heads}")
    if d % heads:
        raise CheckpointError(f"{where}: num_attention_heads {heads} does not divide "
                              f"hidden_size {d}")
    head_dim = _int(hf, "head_dim", where, MAX_HIDDEN, default=d // heads)
    if head_dim % 2:
        raise CheckpointError(f"{where}: head_dim {head_dim} is odd (rotary embeddings "
                              "rotate pairs)")
    num_layers = _int(hf, "num_hidden_layers", where, MAX_LAYERS)
    theta, scaling, scaling_name = _rope(hf, where)
    out = dict(vocab_size=_int(hf, "vocab_size", where, MAX_VOCAB), d_model=d,
               num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads,
               head_dim=head_dim, mlp_hidden=_int(hf, "intermediate_size", where, MAX_MLP),
               tie_embeddings=_bool(hf, "tie_word_embeddings", where),
               qk_norm=family in ("qwen3", "qwen3_moe"), qkv_bias=family == "qwen2",
               rope_theta=theta,
               norm_eps=_number(hf, "rms_norm_eps", where, default=1e-6, below=1.0),
               rope_scaling="none")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        refuse(kind != "llama3", f"rope scaling {kind!r}")

        def field(name: str) -> float:
            return _number(scaling, name, where, label=f"{scaling_name}.{name}")

        out.update(rope_scaling="llama3", rope_factor=field("factor"),
                   rope_low_freq_factor=field("low_freq_factor"),
                   rope_high_freq_factor=field("high_freq_factor"),
                   rope_original_max_len=_int(
                       scaling, "original_max_position_embeddings", where, MAX_POSITIONS,
                       label=f"{scaling_name}.original_max_position_embeddings"))
    out["moe"] = (_moe_fields(hf, where, num_layers) if family == "qwen3_moe"
                  else dict(num_experts=0))
    return out


def family_of(model: ModelConfig) -> str:
    """The family a model section is saved as."""
    if model.moe.enabled:
        if model.moe.num_shared_experts or not model.qk_norm or model.qkv_bias:
            raise CheckpointError("only Qwen3-MoE (QK-norm, no shared experts, no qkv "
                                  "bias) MoE models can be saved in Hugging Face format")
        return "qwen3_moe"
    if model.qkv_bias:
        if model.qk_norm:
            raise CheckpointError("no supported family has both qkv biases and QK-norm")
        return "qwen2"
    return "qwen3" if model.qk_norm else "llama"


def to_hf(model: ModelConfig, *, dtype: str, eos_id: int | None = None, bos_id: int | None = None,
          pad_id: int | None = None) -> dict:
    """A config.json for a model section, in the names every reader knows (those
    of hub checkpoints)."""
    family = family_of(model)
    hf = {"architectures": [ARCHITECTURES[family]], "model_type": family,
          "vocab_size": model.vocab_size, "hidden_size": model.d_model,
          "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
          "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim,
          "intermediate_size": model.mlp_hidden, "hidden_act": "silu",
          "rms_norm_eps": model.norm_eps, "rope_theta": model.rope_theta,
          "rope_scaling": None, "tie_word_embeddings": model.tie_embeddings,
          "max_position_embeddings": 32_768, "attention_dropout": 0.0,
          "torch_dtype": dtype, "use_cache": True,
          "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    if family == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif family != "qwen2":
        hf.update(attention_bias=False, use_sliding_window=False)
    else:
        hf.update(use_sliding_window=False)
    if model.rope_scaling == "llama3":
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": model.rope_factor,
                              "low_freq_factor": model.rope_low_freq_factor,
                              "high_freq_factor": model.rope_high_freq_factor,
                              "original_max_position_embeddings": model.rope_original_max_len}
        hf["max_position_embeddings"] = int(model.rope_original_max_len * model.rope_factor)
    if family == "qwen3_moe":
        m = model.moe
        hf.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                  moe_intermediate_size=m.expert_hidden, decoder_sparse_step=m.moe_every,
                  norm_topk_prob=m.normalize_topk, mlp_only_layers=[],
                  router_aux_loss_coef=m.aux_loss_coef, output_router_logits=False)
    return hf
