"""Test setup: eight fake CPU devices, set before JAX is first imported, and the one
way tests load the shipped configs (rooted at the repository, not the working
directory)."""

import os
import pathlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from dora_jax import config as config_lib  # noqa: E402  (imports no JAX)

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = {"dense": "configs/tiny.py", "moe": "configs/moe.py:tiny"}


def load_repo_config(spec: str, *, validate: bool = True, num_devices: int | None = None, **overrides):
    """`configs/x.py[:variant]` from the repository root. Overrides are dotted paths
    given with `__` (`model__num_layers=1`). Returns the validated Config, or the
    ConfigDict with `validate=False`."""
    path, _, variant = spec.partition(":")
    c = config_lib.load(str(REPO / path) + (f":{variant}" if variant else ""))
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split("__")
        node = c
        for p in parents:
            node = node[p]
        node[leaf] = value
    return config_lib.validate(c, num_devices) if validate else c


@pytest.fixture(scope="session")
def load_config():
    """The config loader: `load_config("configs/tiny.py", model__num_layers=1)`."""
    return load_repo_config


@pytest.fixture(params=sorted(TINY), scope="session")
def tiny_cfg(request, load_config):
    """Each tiny model config (dense, MoE) in turn, validated."""
    return load_config(TINY[request.param])
