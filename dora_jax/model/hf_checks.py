"""What a Hugging Face checkpoint and tokenizer named by a config determine, read once.

`config.validate` is pure: it reads no file. A config that names a checkpoint
(`model.checkpoint`: its `config.json`, never its weights) or a tokenizer
(`data.tokenizer`, by default the checkpoint's) is read here first, before any
compute: `check_pretrained` reads both once and returns a `Pretrained` that
`validate(config, pretrained=...)` merges (the model's architecture, data.tokenizer,
rollout.eos_id / pad_id); the run reuses its tokenizer. A PEFT adapter
(`model.lora.checkpoint`) has its adapter_config.json held against model.lora. A
bad or missing file fails with a ConfigError naming the field. No JAX: the entry
points call this before JAX starts.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import ml_collections

from dora_jax.config import Config, ModelConfig, RolloutConfig, validate
from dora_jax.config.schema import fail, schema
from dora_jax.model import hf_config


@dataclasses.dataclass(frozen=True)
class Pretrained:
    """The files' contents a run needs: the checkpoint's architecture (model fields,
    with `moe`), the tokenizer's directory and the tokenizer (None: none named)."""

    checkpoint: str = ""
    architecture: dict | None = None  # hf_config.model_fields of its config.json
    tokenizer_path: str = ""
    tokenizer: Any = None  # data.tokenizer.Tokenizer

    def apply(self, d: dict) -> dict:
        """`d` (a config as plain dicts) with what the files determine filled in: a
        field left unset or at its default takes the files' value; one set to
        anything else must agree with it (a ConfigError names it). Pure."""
        model, data = d.setdefault("model", {}), d.setdefault("data", {})
        if self.architecture is not None:
            d["model"] = _merge_architecture(model, schema(ModelConfig).to_dict(),
                                             self.architecture, self.checkpoint)
        if not self.tokenizer_path:
            return d
        data["tokenizer"] = self.tokenizer_path
        tokenizer, vocab = self.tokenizer, d["model"].get("vocab_size")
        if vocab is not None and tokenizer.vocab_size > vocab:
            fail("data.tokenizer", f"{tokenizer.vocab_size} tokens do not fit "
                                   f"model.vocab_size ({vocab})")
        rollout = d.setdefault("rollout", {})
        for name, value in (("eos_id", tokenizer.eos_id), ("pad_id", tokenizer.pad_id)):
            default = getattr(RolloutConfig, name)
            if rollout.get(name, default) not in (default, value):
                fail(f"rollout.{name}", f"{rollout[name]}, but tokenizer {self.tokenizer_path} "
                                        f"has {value} (leave it unset: the tokenizer sets it)")
            rollout[name] = value
        return d


def check_pretrained(config: ml_collections.ConfigDict) -> Pretrained:
    """Reads the checkpoint's config.json and the tokenizer that `config` names, once;
    a missing or damaged file is a ConfigError naming model.checkpoint or
    data.tokenizer."""
    model, data = config.get("model", {}), config.get("data", {})
    checkpoint, path = model.get("checkpoint") or "", data.get("tokenizer") or ""
    architecture = None
    if checkpoint:
        try:
            architecture = hf_config.model_fields(hf_config.read(checkpoint),
                                                  os.path.join(checkpoint, "config.json"))
        except hf_config.CheckpointError as e:
            fail("model.checkpoint", str(e))
        if not path and os.path.exists(os.path.join(checkpoint, "tokenizer.json")):
            path = checkpoint
    _check_adapter(model.get("lora", {}))
    tokenizer = None
    if path:
        from dora_jax.text.tokenizer import Tokenizer  # no JAX

        try:
            tokenizer = Tokenizer.from_pretrained(path)
        except ValueError as e:
            fail("data.tokenizer", str(e))
    return Pretrained(checkpoint, architecture, path, tokenizer)


def _check_adapter(lora_section: ml_collections.ConfigDict | dict[str, Any]) -> None:
    """A PEFT adapter named by model.lora.checkpoint: its adapter_config.json read
    (never its tensors) and its r / lora_alpha / target_modules held against
    model.lora's rank / alpha / targets; a ConfigError names the field."""
    directory = lora_section.get("checkpoint") or ""
    if not directory:
        return
    from dora_jax.config.model import LoRAConfig
    from dora_jax.model import peft_format  # no JAX until its tensors are read

    given = lora_section.to_dict() if hasattr(lora_section, "to_dict") else dict(lora_section)
    lora_cfg = LoRAConfig.from_dict(given)
    try:
        peft_format.check_config(peft_format.read_config(directory), lora_cfg, directory)
    except peft_format.PeftFormatError as e:
        fail(e.field or "model.lora.checkpoint", str(e))


def validated(config: ml_collections.ConfigDict, num_devices: int | None = None) -> Config:
    """`check_pretrained` then `config.validate`: the Config of a ConfigDict that may
    name a checkpoint or tokenizer (its files read once, here)."""
    return validate(config, num_devices, pretrained=check_pretrained(config))


def _merge_architecture(model: dict, defaults: dict, ckpt: dict, directory: str) -> dict:
    """The `model` section (a plain dict) with the checkpoint's architecture: a field
    left unset or at its default takes the checkpoint's value; one set to anything
    else must agree with it (a ConfigError names it)."""
    out, moe = dict(model), dict(model.get("moe") or {})
    for section, given, prefix, names, base in (
            (ckpt, out, "model.", hf_config.ARCH_FIELDS, defaults),
            (ckpt["moe"], moe, "model.moe.", hf_config.MOE_ARCH_FIELDS,
             defaults.get("moe", {}))):
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
