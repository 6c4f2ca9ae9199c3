"""Hugging Face `config.json` <-> the model section of our config, without JAX.

Families: Qwen3 (`qwen3`), Qwen3-MoE (`qwen3_moe`), Qwen2 / Qwen2.5 (`qwen2`) and
Llama 3 (`llama`). Both generations of field names are read: hub checkpoints written
before transformers 5 say `rope_theta` / `rope_scaling` / `num_experts`, newer ones
`rope_parameters` / `num_local_experts`. What our model cannot compute exactly
(sliding windows, output-projection biases, other activations or RoPE scalings) is
refused by name rather than loaded approximately.
"""

from __future__ import annotations

import json
import os

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


class CheckpointError(ValueError):
    """A checkpoint directory cannot be read as a model we compute exactly."""


def read(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no config.json") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg})") from None


def _rope(hf: dict) -> tuple[float, dict | None]:
    params = hf.get("rope_parameters")
    if params:  # transformers 5: theta and scaling in one dict
        theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
        scaling = None if params.get("rope_type", "default") == "default" else params
    else:
        theta, scaling = hf.get("rope_theta", 10_000.0), hf.get("rope_scaling")
    return float(theta), scaling


def model_fields(hf: dict, where: str = "config.json") -> dict:
    """Our `model` fields (with a nested `moe` dict) for a Hugging Face config."""
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{where}: model_type {family!r} is not supported; "
                              f"supported: {FAMILIES}")

    def refuse(condition, what):
        if condition:
            raise CheckpointError(f"{where}: {what} is not supported")

    refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
    refuse(hf.get("use_sliding_window"), "use_sliding_window")
    refuse(hf.get("mlp_bias"), "mlp_bias")
    # Qwen3 and Llama's attention_bias also biases the output projection.
    refuse(family != "qwen2" and hf.get("attention_bias"), "attention_bias (output bias)")
    refuse(hf.get("mlp_only_layers"), "mlp_only_layers")
    refuse(hf.get("shared_expert_intermediate_size"), "a shared expert with a gate")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    theta, scaling = _rope(hf)
    out = dict(vocab_size=hf["vocab_size"], d_model=d, num_layers=hf["num_hidden_layers"],
               num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
               head_dim=hf.get("head_dim") or d // heads, mlp_hidden=hf["intermediate_size"],
               tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
               qk_norm=family in ("qwen3", "qwen3_moe"), qkv_bias=family == "qwen2",
               rope_theta=theta, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
               rope_scaling="none")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        refuse(kind != "llama3", f"rope scaling {kind!r}")
        out.update(rope_scaling="llama3", rope_factor=float(scaling["factor"]),
                   rope_low_freq_factor=float(scaling["low_freq_factor"]),
                   rope_high_freq_factor=float(scaling["high_freq_factor"]),
                   rope_original_max_len=int(scaling["original_max_position_embeddings"]))
    if family == "qwen3_moe":
        out["moe"] = dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                          top_k=hf["num_experts_per_tok"],
                          expert_hidden=hf["moe_intermediate_size"],
                          moe_every=hf.get("decoder_sparse_step", 1),
                          normalize_topk=bool(hf.get("norm_topk_prob", False)),
                          num_shared_experts=0, shared_expert_hidden=0)
    else:
        out["moe"] = dict(num_experts=0)
    return out


def family_of(model) -> str:
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


def to_hf(model, *, dtype: str, eos_id: int | None = None, bos_id: int | None = None,
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


def resolve(model: dict, defaults: dict, directory: str) -> dict:
    """The `model` section (a plain dict) with the architecture of the checkpoint in
    `directory`: a field left unset or at its default takes the checkpoint's value;
    one set to anything else must agree with it (a ConfigError names it)."""
    from dora_jax.schema import fail

    try:
        ckpt = model_fields(read(directory), os.path.join(directory, "config.json"))
    except CheckpointError as e:
        fail("model.checkpoint", str(e))
    out, moe = dict(model), dict(model.get("moe") or {})
    for section, given, prefix, names, base in (
            (ckpt, out, "model.", ARCH_FIELDS, defaults),
            (ckpt["moe"], moe, "model.moe.", MOE_ARCH_FIELDS, defaults.get("moe", {}))):
        for name in names:
            if name not in section:
                continue
            value, want = given.get(name), section[name]
            if value is None or value == base.get(name) or value == want:
                given[name] = want
            else:
                fail(prefix + name, f"{value!r}, but checkpoint {directory} has {want!r} "
                                    "(leave it unset: model.checkpoint sets it)")
    out["moe"] = moe
    return out
