"""Loading and validating a run config: `load` runs a config file (or a shipped config
by name) into an `ml_collections.ConfigDict`, `base` gives every field's default,
`validate` turns a ConfigDict into the frozen `Config`, `check_devices` holds its
meshes to the devices there are."""

from __future__ import annotations

import importlib.util

import ml_collections

from .run import Config
from .schema import fail, schema


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
