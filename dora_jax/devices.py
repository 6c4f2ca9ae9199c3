"""What the process runs on: fake CPU devices on a host without an accelerator,
Pathways when the job runs under it, one controller, and the meshes built from
the devices (the trainer's and each decode slice's).

dora_jax is single-controller: one Python process sees every device and moves
params between the trainer's mesh and each slice's (device_put across meshes). At
pod scale that process runs under Pathways (`JAX_PLATFORMS=proxy`, set by the
launchers in dora_jax/launch), which gives it every slice's devices. Multi-controller
JAX (one process per host, `jax.distributed`) sees only its host's devices, so those
transfers would need an explicit cross-process weight transfer; it is refused with
a message saying so (`require_single_controller`).

Imports no JAX at module level: `fake_cpu_devices_if_needed` must run before JAX is
imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Sequence

_FLAG = "--xla_force_host_platform_device_count"


def accelerator_present() -> bool:
    """True if this host has (or is told to use) a TPU or GPU, or runs under Pathways."""
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    if any(p in platforms for p in ("tpu", "gpu", "cuda", "rocm", "proxy")):
        return True
    if platforms == "cpu":
        return False
    devices = (glob.glob("/dev/accel[0-9]*") + glob.glob("/dev/vfio/[0-9]*")
               + glob.glob("/dev/nvidia[0-9]*"))
    return bool(devices) or importlib.util.find_spec("libtpu") is not None


# The most CPU devices faked for a config: enough for every CPU-sized config (8) with
# room to spare. A mesh beyond it is a pod's, for a model sized to match, which a CPU
# cannot run; the device check then says so in one line (setting XLA_FLAGS yourself
# still fakes any number).
MAX_FAKE_CPU_DEVICES = 64


def fake_cpu_devices_if_needed(count: int) -> str | None:
    """On a host without an accelerator, makes XLA's CPU backend offer `count`
    devices (the config's mesh, up to MAX_FAKE_CPU_DEVICES), unless XLA_FLAGS already
    says how many. Must run before JAX is imported; returns the line to tell the
    user, or None."""
    flags = os.environ.get("XLA_FLAGS", "")
    if _FLAG in flags or accelerator_present() or count > MAX_FAKE_CPU_DEVICES:
        return None
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
    return (f"no accelerator found: running on {count} CPU devices for the config's mesh "
            f"(XLA_FLAGS={_FLAG}={count}; set XLA_FLAGS yourself to choose)")


def start_pathways_if_proxied() -> None:
    """Under Pathways (`JAX_PLATFORMS=proxy`), registers its JAX backend first."""
    if os.environ.get("JAX_PLATFORMS", "").lower() != "proxy":
        return
    try:
        import pathwaysutils
    except ImportError:
        raise RuntimeError("JAX_PLATFORMS=proxy (Pathways) needs the pathwaysutils package: "
                           "pip install pathwaysutils") from None
    pathwaysutils.initialize()


def require_single_controller(process_count: int) -> None:
    """Refuses multi-controller JAX, naming what to do instead (see module docstring)."""
    if process_count > 1:
        raise RuntimeError(
            f"this JAX runtime has {process_count} controller processes, but dora_jax is "
            "single-controller: it moves params between the trainer's and the slices' "
            "meshes from one process that sees every device. Run it under Pathways "
            "(python -m dora_jax.launch.gke renders the job) rather than one process per host.")


def make_meshes(mesh_cfg, devices: Sequence | None = None):
    """Builds the trainer mesh and the decode-slice meshes from `mesh_cfg` (a
    config.MeshConfig) over `devices` (default: every device JAX sees).

    The trainer takes the first devices; each slice the next block, or with
    `mesh_cfg.colocated` a block of the trainer's own devices. Returns
    `(trainer_mesh, [slice_mesh, ...])`.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from dora_jax.config import SLICE_MESH_AXES, TRAINER_MESH_AXES

    require_single_controller(jax.process_count())
    devices = list(jax.devices() if devices is None else devices)
    if mesh_cfg.total_devices > len(devices):
        raise ValueError(f"mesh needs {mesh_cfg.total_devices} devices, have {len(devices)}")
    n = mesh_cfg.trainer_devices
    shape = tuple(mesh_cfg.trainer[a] for a in TRAINER_MESH_AXES)
    trainer = Mesh(np.array(devices[:n]).reshape(shape), TRAINER_MESH_AXES)
    slices = []
    k = mesh_cfg.slice_devices
    sshape = tuple(mesh_cfg.slice[a] for a in SLICE_MESH_AXES)
    for i in range(mesh_cfg.num_slices):
        start = (0 if mesh_cfg.colocated else n) + i * k
        block = devices[start: start + k]
        slices.append(Mesh(np.array(block).reshape(sshape), SLICE_MESH_AXES))
    return trainer, slices
