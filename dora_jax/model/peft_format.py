"""LoRA adapters in PEFT's format, out and in: an adapter directory that
`peft.PeftModel.from_pretrained(base, dir)` loads on the Hugging Face base.

A directory holds adapter_config.json (PEFT's LoraConfig: r, lora_alpha,
target_modules by HF module name, peft_type LORA, task_type CAUSAL_LM, ...) and
adapter_model.safetensors, one pair of tensors per adapted projection of each layer,
named as PEFT writes them (linear layouts [out, in], as torch's nn.Linear):

  base_model.model.model.layers.i.self_attn.q_proj.lora_A.weight [r, D]
      ours: blocks...attn.lora_q.lora_a [D, r]
  base_model.model.model.layers.i.self_attn.q_proj.lora_B.weight [H*Dh, r]
      ours: blocks...attn.lora_q.lora_b [r, H, Dh]
  ...k_proj / v_proj / o_proj, mlp.gate_proj / up_proj / down_proj (targets k v o
  gate up down; o_proj's lora_A [r, H*Dh] is our lora_o.lora_a [H, Dh, r])

Ours are A [*in, r], B [r, *out] with the weight's heads split out; the flat HF axes
are ours flattened in order, as model/hf.py lays out the base weights (o_proj's input
[H*Dh] is wo's [H, Dh]), and a scanned model's layer i is index i // p of blocks[i % p]
(hf._leaf gives each unit's name). PEFT's scaling is lora_alpha / r, ours alpha /
rank: the two models compute the same function.

MoE experts' adapters (`model.lora.experts`) have no PEFT form here: transformers
fuses each layer's experts into 3-D gate_up_proj / down_proj parameters, on which a
PEFT adapter is one A for gate and up together, not our two. Export refuses them.

Reading treats the directory as untrusted (untrusted_files, safetensors_check) and
takes exactly the tensors we need, each with its exact shape and a float dtype.
Options that change what PEFT computes (DoRA, rsLoRA, per-module ranks, biases,
modules_to_save, ...) are refused by name; rank, alpha and targets must equal
`model.lora`'s (`check_config`: the error names the config field).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from dora_jax.base import untrusted_files
from dora_jax.model.hf_config import CheckpointError

if TYPE_CHECKING:
    from flax import nnx

    from dora_jax.config import LoRAConfig, ModelConfig
    from dora_jax.model.safetensors_file import TensorSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
HF_MODULE = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
             "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_TARGET_OF = {v: k for k, v in HF_MODULE.items()}
_PREFIX = "base_model.model."
_FLOATS = (np.float32, np.float16, "bfloat16")
# adapter_config.json fields that change what PEFT computes, with the value under
# which it computes ours (None stands for any empty value: null, [], {}, "").
_MUST_BE = {"use_dora": False, "use_rslora": False, "lora_bias": False,
            "fan_in_fan_out": False, "bias": "none", "rank_pattern": None,
            "alpha_pattern": None, "modules_to_save": None, "layers_to_transform": None,
            "layer_replication": None, "target_parameters": None,
            "trainable_token_indices": None, "exclude_modules": None, "use_qalora": False,
            "alora_invocation_tokens": None, "use_bdlora": None, "arrow_config": None}


class PeftFormatError(CheckpointError):
    """An adapter directory we cannot read (or adapters we cannot write) as PEFT's;
    `field` names the config field it contradicts (model.lora.rank, ...) when that is
    what is wrong."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


# ------------------------------------------------------------------ adapter_config.json

def adapter_config(lora_cfg: LoRAConfig, base_model_name_or_path: str = "") -> dict:
    """PEFT's LoraConfig fields for adapters of `lora_cfg` (model.lora)."""
    alpha = lora_cfg.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or None, "revision": None,
        "r": lora_cfg.rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": [HF_MODULE[t] for t in lora_cfg.targets],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "lora_bias": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "exclude_modules": None, "target_parameters": None,
    }


def _empty(value: object) -> bool:
    return value is None or value == [] or value == {} or value == ""


def read_config(directory: str) -> dict:
    """adapter_config.json of `directory` (capped, inside it), checked to describe
    adapters we compute exactly; `target_modules` comes back as our target names."""
    if not os.path.isdir(directory):
        raise PeftFormatError(f"{directory}: no such adapter directory")
    path = os.path.join(directory, ADAPTER_CONFIG)
    try:
        c = untrusted_files.read_json(path, untrusted_files.CONFIG_JSON_CAP, within=directory,
                                      error=PeftFormatError)
    except FileNotFoundError:
        raise PeftFormatError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter "
                              "directory)") from None
    if c.get("peft_type") != "LORA":
        raise PeftFormatError(f"{path}: peft_type {c.get('peft_type')!r}, only 'LORA' is read")
    if c.get("task_type") not in (None, "CAUSAL_LM"):
        raise PeftFormatError(f"{path}: task_type {c['task_type']!r}, only 'CAUSAL_LM' is read")
    for name, want in _MUST_BE.items():
        value = c.get(name, want)
        if not (_empty(value) if want is None else value == want or (
                want is False and value is None)):
            raise PeftFormatError(f"{path}: {name} = {value!r} changes what the adapter "
                                  f"computes; only {'unset' if want is None else repr(want)} "
                                  "is read")
    r, alpha = c.get("r"), c.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise PeftFormatError(f"{path}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise PeftFormatError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    modules = c.get("target_modules")
    if modules == "all-linear":
        modules = list(HF_MODULE.values())
    if not isinstance(modules, list) or not modules or not all(
            isinstance(m, str) for m in modules):
        raise PeftFormatError(f"{path}: target_modules must be a list of module names "
                              f"(a regular expression is not read), got {modules!r}")
    unknown = [m for m in modules if m.split(".")[-1] not in _TARGET_OF]
    if unknown:
        raise PeftFormatError(f"{path}: target_modules {unknown} have no adapter here; "
                              f"known: {sorted(_TARGET_OF)}", field="model.lora.targets")
    targets = {_TARGET_OF[m.split(".")[-1]] for m in modules}
    return dict(c, target_modules=tuple(t for t in HF_MODULE if t in targets))


def check_config(peft_cfg: dict, lora_cfg: LoRAConfig, where: str) -> None:
    """Fails, naming the model.lora field, unless `peft_cfg` (read_config's) has the
    rank, alpha and targets of `lora_cfg`."""
    if peft_cfg["r"] != lora_cfg.rank:
        raise PeftFormatError(f"{lora_cfg.rank}, but adapter {where} has r {peft_cfg['r']}",
                              field="model.lora.rank")
    if float(peft_cfg["lora_alpha"]) != float(lora_cfg.alpha):
        raise PeftFormatError(f"{lora_cfg.alpha}, but adapter {where} has lora_alpha "
                              f"{peft_cfg['lora_alpha']}", field="model.lora.alpha")
    if set(peft_cfg["target_modules"]) != set(lora_cfg.targets):
        raise PeftFormatError(f"{tuple(lora_cfg.targets)}, but adapter {where} targets "
                              f"{peft_cfg['target_modules']}", field="model.lora.targets")


# ------------------------------------------------------------------ tensor names and layouts

# Per adapter leaf: (its path, its keys, the leaf, its units' PEFT names, stacked on a
# layers axis, is A).
_Unit = tuple[Any, tuple, Any, list[str], bool, bool]


def _units(cfg: ModelConfig, abstract_adapters: nnx.State) -> list[_Unit]:
    """Per adapter leaf (path, A or B): its keys, the PEFT names of its layers' units
    (one per index along a scanned layer axis, else one) and whether it is A."""
    import jax

    from dora_jax.model import hf

    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(abstract_adapters):
        names = hf._path_names(path)
        *module, adapter, which = names
        target = adapter[len("lora_"):]
        weight = (*module, _weight_of(target))
        if module[-1] == "mlp" and cfg.is_moe_layer(module[1]):
            raise PeftFormatError("MoE experts' adapters have no PEFT form here (transformers "
                                  "fuses the experts' gate and up)", field="model.lora.experts")
        try:
            leaf = hf._leaf(cfg, tuple(weight))
        except hf.CheckpointError as e:
            raise PeftFormatError(f"adapter {'.'.join(map(str, names))}: {e}") from None
        layers = leaf.layers if leaf.layers is not None else [None]
        tag = "lora_A" if which == "lora_a" else "lora_B"
        unit_names = [_PREFIX + leaf.name(layer, None)[:-len(".weight")] + f".{tag}.weight"
                      for layer in layers]
        out.append((path, names, x, unit_names, leaf.layers is not None, which == "lora_a"))
    return out


def _weight_of(target: str) -> str:
    from dora_jax.model.lora import WEIGHT_OF

    return WEIGHT_OF[target]


def _peft_shape(unit_shape: tuple, is_a: bool) -> tuple:
    """A unit [*in, r] is stored [r, in]; B [r, *out] as [out, r]."""
    if is_a:
        return (unit_shape[-1], int(np.prod(unit_shape[:-1])))
    return (int(np.prod(unit_shape[1:])), unit_shape[0])


def _to_peft(unit: np.ndarray, is_a: bool) -> np.ndarray:
    return unit.reshape(-1, unit.shape[-1]).T if is_a else unit.reshape(unit.shape[0], -1).T


def _to_ours(tensor: np.ndarray, unit_shape: tuple) -> np.ndarray:
    return np.ascontiguousarray(tensor.T).reshape(unit_shape)


# ------------------------------------------------------------------ out

def save_adapters(cfg: ModelConfig, params: nnx.State, directory: str, *,
                  base_model_name_or_path: str = "", dtype: str | None = None) -> list[str]:
    """Writes the adapters of `params` (of ModelConfig `cfg`, LoRA on) to `directory`
    as a PEFT adapter: adapter_config.json and adapter_model.safetensors (`dtype`:
    stored dtype, default model.lora.dtype). Returns the files written."""
    import jax.numpy as jnp

    from dora_jax.model import lora, safetensors_file

    if not cfg.lora.enabled or not lora.has_adapters(params):
        raise PeftFormatError("no adapters to export (model.lora.rank is 0)",
                              field="model.lora.rank")
    if cfg.lora.experts:
        raise PeftFormatError("MoE experts' adapters have no PEFT form here (transformers "
                              "fuses the experts' gate and up): export merged weights",
                              field="model.lora.experts")
    np_dtype = np.dtype(jnp.dtype(dtype or cfg.lora.dtype))
    _, adapters = lora.split(params)
    specs = []
    for _, _, x, unit_names, stacked, is_a in _units(cfg, adapters):
        unit_shape = tuple(x.shape[1:] if stacked else x.shape)
        for j, name in enumerate(unit_names):
            def produce(x: Any = x, j: int = j, stacked: bool = stacked,
                        is_a: bool = is_a) -> np.ndarray:
                return _to_peft(np.asarray(x[j] if stacked else x), is_a)

            specs.append(safetensors_file.TensorSpec(name, _peft_shape(unit_shape, is_a),
                                                     np_dtype, produce))

    def order(spec: TensorSpec) -> tuple[int, str]:  # layer by layer, as PEFT's files read
        return int(spec.name[len(_PREFIX):].split(".")[2]), spec.name

    specs.sort(key=order)
    os.makedirs(directory, exist_ok=True)
    safetensors_file.write(os.path.join(directory, ADAPTER_WEIGHTS), specs, {"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config(cfg.lora, base_model_name_or_path), f, indent=2)
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


# ------------------------------------------------------------------ in

def load_adapters(directory: str, cfg: ModelConfig) -> nnx.State:
    """The adapters (the `lora.split(params)[1]` tree of ModelConfig `cfg`) held by the
    PEFT adapter `directory`, in model.lora.dtype on the default device. Rank, alpha
    and targets must be `cfg.lora`'s; every tensor must be one of ours, with its shape."""
    import jax
    import jax.numpy as jnp

    from dora_jax.model import hf, lora, safetensors_check, safetensors_file, transformer

    peft_cfg = read_config(directory)
    try:
        check_config(peft_cfg, cfg.lora, directory)
    except PeftFormatError as e:
        raise PeftFormatError(f"config.{e.field}: {e}", field=e.field) from None
    if os.path.exists(os.path.join(directory, ADAPTER_WEIGHTS)):
        path = safetensors_check.confined(directory, ADAPTER_WEIGHTS, directory, "file")
    elif os.path.exists(os.path.join(directory, "adapter_model.bin")):
        raise PeftFormatError(f"{directory}: adapter_model.bin is a pickle, which is never "
                              f"read; save the adapter as {ADAPTER_WEIGHTS}")
    else:
        raise PeftFormatError(f"{directory}: no {ADAPTER_WEIGHTS}")
    f = safetensors_file.SafetensorsFile(path)
    _, adapters = lora.split(transformer.abstract_params(cfg)[1])
    want = np.dtype(jnp.dtype(cfg.lora.dtype))
    used = set()

    def read(name: str, unit_shape: tuple, is_a: bool) -> np.ndarray:
        if name not in f.names:
            raise PeftFormatError(f"{path}: missing tensor {name!r}")
        info = f.info(name)
        shape = _peft_shape(unit_shape, is_a)
        if tuple(info.shape) != shape:
            raise PeftFormatError(f"{path}: tensor {name!r} has shape {tuple(info.shape)}, "
                                  f"the config needs {shape}")
        if not any(info.dtype == np.dtype(jnp.dtype(d)) for d in _FLOATS):
            raise PeftFormatError(f"{path}: tensor {name!r} is {info.dtype}, not float32, "
                                  "float16 or bfloat16")
        used.add(name)
        unit = _to_ours(np.asarray(f.get(name)).astype(np.float32), unit_shape)
        if not np.isfinite(unit).all():
            raise PeftFormatError(f"{path}: tensor {name!r} holds non-finite values")
        return unit.astype(want)

    filled = {}
    for _, names, x, unit_names, stacked, is_a in _units(cfg, adapters):
        unit_shape = tuple(x.shape[1:] if stacked else x.shape)
        units = [read(n, unit_shape, is_a) for n in unit_names]
        filled[names] = jnp.asarray(np.stack(units) if stacked else units[0])
    unused = sorted(set(f.names) - used)
    if unused:
        shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
        raise PeftFormatError(f"{path}: {len(unused)} tensors the model has no adapter "
                              f"for: {shown}")
    return jax.tree_util.tree_map_with_path(lambda p, _: filled[hf._path_names(p)], adapters)
