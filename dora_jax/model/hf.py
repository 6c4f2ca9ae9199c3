"""Hugging Face checkpoints in and out: Qwen3, Qwen3-MoE, Qwen2 / Qwen2.5, Llama 3.

`load_pretrained(dir)` reads config.json and the safetensors weights (one file or
shards with their index) into our params; `save_pretrained(cfg, params, dir)`
writes them back in the same layout, so transformers and vLLM serve the trained
policy. Names and layouts (HF linear weights are [out, in]; ours [in, out] with
heads split out):

  model.embed_tokens.weight [V, D]              embed [V, D]
  model.layers.i.self_attn.q_proj.weight [H*Dh, D]   blocks...attn.wq [D, H, Dh]
  ...k_proj / v_proj (+ .bias for Qwen2)        attn.wk / wv [D, K, Dh] (bk / bv [K, Dh])
  ...self_attn.o_proj.weight [D, H*Dh]          attn.wo [H, Dh, D]
  ...self_attn.q_norm / k_norm.weight [Dh]      attn.q_norm / k_norm.scale
  ...input_layernorm / post_attention_layernorm attn_norm / mlp_norm.scale
  ...mlp.{gate,up,down}_proj.weight             mlp.w_gate / w_up / w_down (transposed)
  ...mlp.gate.weight [E, D]                     mlp.router [D, E]
  ...mlp.experts.e.{gate,up,down}_proj.weight   mlp.w_gate[e] ... (stacked over experts)
  model.norm.weight, lm_head.weight [V, D]      final_norm.scale, lm_head [D, V]

With `scan_layers`, layer i lives at index i // p of `blocks[i % p]` (p: the layer
period). With a mesh, every array is built shard by shard
(`jax.make_array_from_callback`): a device's shard is assembled on the host from the
memory-mapped tensors of just the layers and experts it holds, so no device ever
holds a whole checkpoint, and the host never more than one tensor beyond a shard.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dora_jax.config import ModelConfig
from dora_jax.model import hf_config, lora, safetensors_file, transformer
from dora_jax.model.hf_config import CheckpointError  # noqa: F401 - callers catch hf.CheckpointError
from dora_jax.model.sharding import Rules, param_shardings

if TYPE_CHECKING:
    from dora_jax.text.tokenizer import Tokenizer

# Tensors some checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DEFAULT_SHARD_BYTES = 5 * 2 ** 30


class _Leaf(NamedTuple):
    """Where one of our params comes from: `name(layer, expert)` is the HF tensor of
    one unit (a layer's, or a layer's expert's, slice of the param); `linear`:
    stored [out, in] (transposed and reshaped into ours), else only reshaped."""

    name: Callable[[int | None, int | None], str]
    linear: bool
    layers: list[int] | None  # the layer of each index along a stacked layer axis
    experts: bool  # a per-expert param: the axis after the layer axis is the expert


_BLOCK = {  # path inside a block -> (HF suffix after model.layers.i., linear)
    ("attn_norm", "scale"): ("input_layernorm.weight", False),
    ("mlp_norm", "scale"): ("post_attention_layernorm.weight", False),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", False),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", False),
    ("attn", "wq"): ("self_attn.q_proj.weight", True),
    ("attn", "wk"): ("self_attn.k_proj.weight", True),
    ("attn", "wv"): ("self_attn.v_proj.weight", True),
    ("attn", "wo"): ("self_attn.o_proj.weight", True),
    ("attn", "bq"): ("self_attn.q_proj.bias", False),
    ("attn", "bk"): ("self_attn.k_proj.bias", False),
    ("attn", "bv"): ("self_attn.v_proj.bias", False),
    ("mlp", "router"): ("mlp.gate.weight", True),
}
_MLP = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def _path_names(path: jax.tree_util.KeyPath) -> tuple:
    names = []
    for k in path:
        key = getattr(k, "key", getattr(k, "idx", getattr(k, "name", None)))
        if key != "value":
            names.append(key)
    return tuple(names)


def _leaf(cfg: ModelConfig, names: tuple) -> _Leaf:
    top = {("embed",): ("model.embed_tokens.weight", False),
           ("final_norm", "scale"): ("model.norm.weight", False),
           ("lm_head",): ("lm_head.weight", True)}
    if names in top:
        top_name, linear = top[names]
        return _Leaf(lambda layer, expert: top_name, linear, None, False)
    if names[0] != "blocks":
        raise CheckpointError(f"no Hugging Face name for param {names}")
    block, inner = names[1], names[2:]
    p = cfg.layer_period if cfg.scan_layers else 1
    layers = list(range(block, cfg.num_layers, p)) if cfg.scan_layers else None
    if inner in _BLOCK:
        suffix, linear = _BLOCK[inner]
        experts = False
    elif inner[0] == "mlp" and inner[1] in _MLP:
        experts = cfg.is_moe_layer(block)
        suffix = (f"mlp.experts.{{e}}.{_MLP[inner[1]]}.weight" if experts
                  else f"mlp.{_MLP[inner[1]]}.weight")
        linear = True
    else:
        raise CheckpointError(f"no Hugging Face name for param {names} (shared experts "
                              f"have none in the supported families)")
    fixed = None if cfg.scan_layers else block

    def name(layer: int | None, expert: int | None) -> str:
        layer = fixed if layer is None else layer
        return f"model.layers.{layer}." + suffix.replace("{e}", str(expert))

    return _Leaf(name, linear, layers, experts)


def _to_ours(hf_array: np.ndarray, unit_shape: tuple, linear: bool) -> np.ndarray:
    return (hf_array.T if linear else hf_array).reshape(unit_shape)


def _to_hf(ours: np.ndarray, hf_shape: tuple, linear: bool) -> np.ndarray:
    return ours.reshape(hf_shape[::-1]).T if linear else ours.reshape(hf_shape)


def _hf_shape(unit_shape: tuple, linear: bool, leaf_names: tuple) -> tuple:
    """The HF tensor shape of one unit of ours (the inverse of `_to_ours`)."""
    if not linear:  # biases [heads, Dh] are stored flat; the rest as they are
        return (int(np.prod(unit_shape)),) if leaf_names[-1] in ("bq", "bk", "bv") else unit_shape
    split = 2 if leaf_names[-1] == "wo" else 1  # wo: [H, Dh | D]; others: [in | out...]
    return (int(np.prod(unit_shape[split:])), int(np.prod(unit_shape[:split])))


def config_from_checkpoint(path: str, *, dtype: str | None = None,
                           **overrides: Any) -> ModelConfig:
    """The ModelConfig of a checkpoint directory; `dtype` sets param and compute
    dtype (default: the checkpoint's, float16 read as float32); `overrides` set
    the fields that say how to compute (attention, remat, scan_layers, moe.dispatch...)."""
    hf = hf_config.read(path)
    where = os.path.join(path, "config.json")
    fields = hf_config.model_fields(hf, where)
    if dtype is None:
        dtype = "bfloat16" if hf_config.stored_dtype(hf, where) == "bfloat16" else "float32"
    moe = {**fields.pop("moe"), **overrides.pop("moe", {})}
    return ModelConfig.from_dict({**fields, "dtype": dtype, "param_dtype": dtype,
                                  **overrides, "moe": moe})


def load_pretrained(path: str, *, dtype: str | None = None, mesh: Mesh | None = None,
                    rules: Rules | None = None,
                    cfg: ModelConfig | None = None) -> tuple[ModelConfig, nnx.State]:
    """Reads a Hugging Face checkpoint directory: returns (ModelConfig, params).

    `cfg`: a ModelConfig of the same architecture to load into (how it computes:
    attention, remat, scan_layers...), default `config_from_checkpoint(path, dtype)`.
    With `mesh` and `rules` (logical-axis rules) every param is placed shard by shard
    under `param_shardings`; otherwise on the default device. Every tensor must be
    used and every param found, with its exact shape; a mismatch names the tensor.
    """
    cfg = cfg or config_from_checkpoint(path, dtype=dtype)
    ckpt = safetensors_file.Checkpoint(path)
    _, abstract = transformer.abstract_params(cfg)
    shardings = None
    if mesh is not None:
        assert rules is not None, "a mesh needs its rules"
        shardings = param_shardings(abstract, mesh, rules)
    used = set()

    def unit(leaf: _Leaf, leaf_names: tuple, unit_shape: tuple, layer: int | None,
             expert: int | None, dtype: np.dtype) -> np.ndarray:
        name = leaf.name(layer, expert)
        if name not in ckpt:
            raise CheckpointError(f"{path}: missing tensor {name!r} (for param "
                                  f"{'.'.join(map(str, leaf_names))})")
        want = _hf_shape(unit_shape, leaf.linear, leaf_names)
        if ckpt.shape(name) != want:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {ckpt.shape(name)}, "
                                  f"the config needs {want}")
        used.add(name)
        return _to_ours(ckpt.get(name), unit_shape, leaf.linear).astype(dtype)

    def read(leaf: _Leaf, leaf_names: tuple, shape: tuple, dtype: np.dtype,
             index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        lead = (leaf.layers is not None) + leaf.experts
        unit_shape = shape[lead:]
        layers = [None] if leaf.layers is None else np.asarray(leaf.layers)[index[0]]
        num_experts = shape[lead - 1] if leaf.experts else 1
        experts = [None] if not leaf.experts else range(num_experts)[index[lead - 1]]
        rest = index[lead:]
        rows = []
        for layer in layers:
            units = [unit(leaf, leaf_names, unit_shape, layer, e, dtype)[rest] for e in experts]
            rows.append(np.stack(units) if leaf.experts else units[0])
        return np.stack(rows) if leaf.layers is not None else rows[0]

    def fill(path_keys: jax.tree_util.KeyPath, x: jax.ShapeDtypeStruct,
             sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        names = _path_names(path_keys)
        leaf = _leaf(cfg, names)
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        if sharding is None:
            return jnp.asarray(read(leaf, names, shape, dtype, ()))
        return jax.make_array_from_callback(
            shape, sharding, lambda index: read(leaf, names, shape, dtype, index))

    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    placements = [None] * len(leaves) if mesh is None else jax.tree.leaves(shardings)
    params = jax.tree_util.tree_unflatten(
        treedef, [fill(keys, x, sh) for (keys, x), sh in zip(leaves, placements)])
    unused = sorted(n for n in ckpt.names - used if not n.endswith(_IGNORED_SUFFIXES))
    if unused:
        shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
        raise CheckpointError(f"{path}: {len(unused)} tensors the model does not use: {shown}")
    return cfg, params


def _hf_tensors(cfg: ModelConfig, params: nnx.State, dtype: np.dtype
                ) -> list[safetensors_file.TensorSpec]:
    """(name, shape, dtype, produce) of every HF tensor, in the checkpoint's order."""
    specs = []
    for path_keys, x in jax.tree_util.tree_leaves_with_path(params):
        names = _path_names(path_keys)
        leaf = _leaf(cfg, names)
        lead = (leaf.layers is not None) + leaf.experts
        unit_shape = tuple(x.shape[lead:])
        hf_shape = _hf_shape(unit_shape, leaf.linear, names)
        layers = leaf.layers if leaf.layers is not None else [None]
        experts = range(x.shape[lead - 1]) if leaf.experts else [None]
        for j, layer in enumerate(layers):
            for e in experts:
                index = tuple(i for i in (j if leaf.layers is not None else None, e)
                              if i is not None)

                def produce(x: jax.Array = x, index: tuple = index, hf_shape: tuple = hf_shape,
                            linear: bool = leaf.linear) -> np.ndarray:
                    return _to_hf(np.asarray(x[index] if index else x), hf_shape, linear)

                specs.append(safetensors_file.TensorSpec(leaf.name(layer, e), hf_shape,
                                                         dtype, produce))

    # embeddings, layers in order, then the head (as HF writes them)
    def order(spec: safetensors_file.TensorSpec) -> tuple[int, int, str]:
        parts = spec.name.split(".")
        if parts[1] == "layers":
            return (1, int(parts[2]), spec.name)
        return (0 if "embed" in spec.name else 2, 0, spec.name)

    return sorted(specs, key=order)


def save_pretrained(cfg: ModelConfig, params: nnx.State, path: str, *, dtype: str | None = None,
                    tokenizer: Tokenizer | None = None,
                    max_shard_bytes: int = _DEFAULT_SHARD_BYTES) -> list[str]:
    """Writes `params` (of `cfg`) as a Hugging Face checkpoint directory: config.json,
    generation_config.json, safetensors (sharded past `max_shard_bytes`, with the
    index) and, given a `data.tokenizer.Tokenizer`, its files. `dtype`: the stored
    dtype (default: the params'). Tensors are fetched from the devices one at a
    time as they are written. Returns the weight files written. LoRA adapters are
    folded into their weights first (`lora.merged_weights`)."""
    if lora.has_adapters(params):
        params, cfg = lora.merged_weights(params, cfg.lora), lora.base_config(cfg)
    dtype = dtype or cfg.param_dtype
    np_dtype = np.dtype(jnp.dtype(dtype))
    os.makedirs(path, exist_ok=True)
    ids = {} if tokenizer is None else dict(eos_id=tokenizer.eos_id, bos_id=tokenizer.bos_id,
                                            pad_id=tokenizer.pad_id)
    hf = hf_config.to_hf(cfg, dtype=dtype, **ids)
    files = safetensors_file.write_sharded(path, _hf_tensors(cfg, params, np_dtype),
                                           max_shard_bytes, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    generation = {"bos_token_id": ids.get("bos_id"), "eos_token_id": (
        list(tokenizer.stop_ids) if tokenizer is not None else None),
        "pad_token_id": ids.get("pad_id")}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in generation.items() if v is not None}, f, indent=2)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return files
