"""What the process runs on: fake CPU devices on a host without an accelerator,
Pathways when the job runs under it, one controller, and the meshes built from
the devices (the trainer's and each decode slice's).

A run is one process that sees every device (under Pathways at pod scale,
`JAX_PLATFORMS=proxy`, set by the launchers in dora_jax/launch), or several
processes (docs/processes.md): the trainer as one SPMD program over one
`jax.distributed` world of trainer processes (one per host; `join_trainer_processes`),
and slice processes each with a JAX runtime of its own. The decode slices of one
process never span a `jax.distributed` world (`require_single_controller`).

Imports no JAX at module level: `fake_cpu_devices_if_needed` must run before JAX is
imported.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Sequence

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


def join_trainer_processes(address: tuple[str, int], num_processes: int,
                           process_id: int, heartbeat_timeout: float) -> None:
    """Joins this trainer process to the others' `jax.distributed` world (the lead,
    process 0, serves it at `address`). A process silent for `heartbeat_timeout`
    seconds (dead or hung) ends the world: JAX's coordination service then stops
    every process in it. On the CPU backend the collectives between processes run
    over gloo."""
    import jax

    if not accelerator_present():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    seconds = max(1, round(heartbeat_timeout))
    jax.distributed.initialize(f"{address[0]}:{address[1]}", num_processes=num_processes,
                               process_id=process_id, heartbeat_timeout_seconds=seconds,
                               shutdown_timeout_seconds=seconds)


def require_single_controller(process_count: int) -> None:
    """Refuses decode slices in a multi-controller JAX world (see module docstring)."""
    if process_count > 1:
        raise RuntimeError(
            f"this JAX runtime has {process_count} controller processes (jax.distributed), "
            "but decode slices run in a process with a JAX runtime of its own: run the "
            "slices as slice processes (docs/processes.md, python -m dora_jax.launch.local "
            "--processes=N --trainer_processes=T), or everything as one process under "
            "Pathways (python -m dora_jax.launch.gke renders the job).")


def tpu_slices(devices: Sequence) -> list[int] | None:
    """The TPU slice of each device (its `slice_index`), or None when the devices
    carry no slice index (CPU, GPU, one TPU slice on an older runtime) or all lie in
    one slice: then every link is the fast in-slice network."""
    indices = [getattr(d, "slice_index", None) for d in devices]
    if any(i is None for i in indices) or len(set(indices)) < 2:
        return None
    return [i for i in indices if i is not None]


def order_by_slice(devices: Sequence) -> list:
    """`devices` grouped by TPU slice (slice order, each slice's devices in their
    given order), so that consecutive blocks (the trainer's, each decode slice's)
    take whole slices rather than a few devices of each."""
    indices = tpu_slices(devices)
    if indices is None:
        return list(devices)
    order = sorted(range(len(devices)), key=lambda j: indices[j])  # stable: keeps ids' order
    return [devices[j] for j in order]


def device_grid(devices: Sequence, shape: tuple, axes: tuple, dcn_axis: str | None,
                what: str):
    """The devices of one mesh as an array of `shape` (named `axes`).

    Within one TPU slice this is the devices in order (reshaped). Across slices the
    data-centre network is much slower than the links inside a slice, so only
    `dcn_axis` may cross it: the mesh is JAX's hybrid mesh
    (`mesh_utils.create_hybrid_device_mesh`) with that axis split over the slices
    and every other axis (fsdp, tensor, expert: the ones that gather or all-to-all
    every layer) inside one slice. ValueError, naming `what`, when the devices cannot
    be laid out so (unequal slices, or `dcn_axis` not a multiple of the slices)."""
    import numpy as np

    indices = tpu_slices(devices)
    if indices is None:
        return np.array(list(devices), dtype=object).reshape(shape)
    counts = {i: indices.count(i) for i in indices}
    n = len(counts)
    if dcn_axis is None:
        raise ValueError(f"{what} spans {n} TPU slices; its devices must lie in one slice")
    if len(set(counts.values())) != 1:
        raise ValueError(f"{what} takes unequal parts of {n} TPU slices "
                         f"({sorted(counts.values())} devices): give it whole slices")
    k = axes.index(dcn_axis)
    if shape[k] % n:
        raise ValueError(f"{what} spans {n} TPU slices, so its {dcn_axis} axis "
                         f"({shape[k]}) must be a multiple of {n}: only that axis "
                         "crosses the data-centre network")
    from jax.experimental import mesh_utils

    inner = tuple(s // n if a == dcn_axis else s for a, s in zip(axes, shape))
    dcn = tuple(n if a == dcn_axis else 1 for a in axes)
    return mesh_utils.create_hybrid_device_mesh(inner, dcn, list(devices))


def mesh_grids(mesh_cfg, devices: Sequence):
    """The device arrays of the trainer's mesh and of each decode slice's, from
    `mesh_cfg` (a config.MeshConfig) over `devices`: `(trainer_grid, [slice_grid,
    ...])`, shaped as the config's axes (TRAINER_MESH_AXES, SLICE_MESH_AXES).

    The trainer takes the first devices; each slice the next block, or with
    `mesh_cfg.colocated` a block of the trainer's own devices. Devices are taken
    TPU slice by TPU slice (`order_by_slice`); a trainer over several TPU slices
    crosses them on its `data` axis only (`device_grid`), and a decode slice lies in
    one TPU slice. Pure: no JAX device is touched but through `devices`."""
    from dora_jax.config import SLICE_MESH_AXES, TRAINER_MESH_AXES

    devices = order_by_slice(devices)
    if mesh_cfg.total_devices > len(devices):
        raise ValueError(f"mesh needs {mesh_cfg.total_devices} devices, have {len(devices)}")
    n = mesh_cfg.trainer_devices
    shape = tuple(mesh_cfg.trainer[a] for a in TRAINER_MESH_AXES)
    trainer = device_grid(devices[:n], shape, TRAINER_MESH_AXES, "data",
                          "the trainer mesh (mesh.trainer)")
    slices = []
    k = mesh_cfg.slice_devices
    sshape = tuple(mesh_cfg.slice[a] for a in SLICE_MESH_AXES)
    for i in range(mesh_cfg.num_slices):
        start = (0 if mesh_cfg.colocated else n) + i * k
        slices.append(device_grid(devices[start: start + k], sshape, SLICE_MESH_AXES, None,
                                  f"decode slice {i} (mesh.slice)"))
    return trainer, slices


def make_meshes(mesh_cfg, devices: Sequence | None = None):
    """Builds the trainer mesh and the decode-slice meshes (`mesh_grids`) over
    `devices` (default: every device JAX sees). Returns
    `(trainer_mesh, [slice_mesh, ...])`."""
    import jax
    from jax.sharding import Mesh

    from dora_jax.config import SLICE_MESH_AXES, TRAINER_MESH_AXES

    require_single_controller(jax.process_count())
    trainer, slices = mesh_grids(mesh_cfg, list(jax.devices() if devices is None else devices))
    return (Mesh(trainer, TRAINER_MESH_AXES),
            [Mesh(grid, SLICE_MESH_AXES) for grid in slices])


def make_trainer_mesh(mesh_cfg, devices: Sequence | None = None):
    """The trainer's mesh alone, over the first of `devices` (default: this process's,
    or every trainer process's in a `jax.distributed` world): the trainer of a run
    whose slices live in other processes (runtime/remote.py)."""
    import jax
    from jax.sharding import Mesh

    from dora_jax.config import TRAINER_MESH_AXES

    if devices is None:
        devices = jax.devices() if jax.process_count() > 1 else jax.local_devices()
    devices = order_by_slice(list(devices))
    n = mesh_cfg.trainer_devices
    if n > len(devices):
        raise ValueError(f"the trainer mesh needs {n} devices, have {len(devices)}")
    shape = tuple(mesh_cfg.trainer[a] for a in TRAINER_MESH_AXES)
    return Mesh(device_grid(devices[:n], shape, TRAINER_MESH_AXES, "data",
                            "the trainer mesh (mesh.trainer)"), TRAINER_MESH_AXES)
