"""Cloud TPU slice types as GKE and Pathways name them: how many chips a slice has,
how many of them each host (Kubernetes node, one pod) holds, and the labels a pod
selects them by.

Names follow Cloud TPU: `v4-N` and `v5p-N` count TensorCores (two per chip, so
N / 2 chips); `v5litepod-N` (also written `v5e-N`) and `v6e-N` count chips. Only
the standard shapes GKE provisions as one node pool are listed (TPU_TYPES); a
name outside them is a ValueError listing them all.

Hosts: v4 and v5p hosts hold 4 chips. v5e and v6e slices of up to 8 chips fit on one
host (machine types ct5lp-hightpu-1t/4t/8t, ct6e-standard-1t/4t/8t), so those have
1, 4 or 8 chips per host; larger v5e/v6e slices are built of 4-chip hosts.

One JAX device is one chip: every generation here shows one device per chip
(megacore on v4 / v5p), so a config's `mesh.total_devices` is the chips it needs.
No JAX here.
"""

from __future__ import annotations

import dataclasses
import re

# GKE's node label values (cloud.google.com/gke-tpu-accelerator) and the Pathways
# resource manager's instance types, per generation.
ACCELERATORS = {"v4": "tpu-v4-podslice", "v5p": "tpu-v5p-slice",
                "v5e": "tpu-v5-lite-podslice", "v6e": "tpu-v6e-slice"}
PATHWAYS_TYPES = {"v4": "tpuv4", "v5p": "tpuv5", "v5e": "tpuv5e", "v6e": "tpuv6e"}
CHIPS_PER_HOST = 4

# The standard topologies, by chips per slice. v4 / v5p: a 3D torus of chips;
# v5e / v6e: a 2D one.
_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4",
                  128: "4x4x8", 256: "4x8x8", 512: "8x8x8", 1024: "8x8x16",
                  2048: "8x16x16", 4096: "16x16x16", 6144: "16x16x24"}
_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                  128: "8x16", 256: "16x16"}
_LARGEST_CHIPS = {"v4": 2048, "v5p": 6144, "v5e": 256, "v6e": 256}
_SINGLE_HOST_2D = 8  # v5e / v6e slices up to this many chips are one host


@dataclasses.dataclass(frozen=True)
class TpuType:
    """One slice type: `name` as the user writes it (`v5p-128`), its generation."""

    name: str
    generation: str
    chips: int  # per slice
    chips_per_host: int
    accelerator: str  # GKE node label cloud.google.com/gke-tpu-accelerator
    topology: str  # GKE node label cloud.google.com/gke-tpu-topology

    @property
    def hosts(self) -> int:
        """Hosts (pods) per slice."""
        return self.chips // self.chips_per_host

    @property
    def pathways_instance_type(self) -> str:
        """The resource manager's `--instance_type`, e.g. `tpuv5:4x4x4`."""
        return f"{PATHWAYS_TYPES[self.generation]}:{self.topology}"


def _table() -> dict[str, TpuType]:
    out = {}
    for gen in ("v4", "v5p"):
        for chips, topo in _TOPOLOGIES_3D.items():
            if chips <= _LARGEST_CHIPS[gen]:
                name = f"{gen}-{2 * chips}"  # named by TensorCores
                out[name] = TpuType(name, gen, chips, CHIPS_PER_HOST, ACCELERATORS[gen], topo)
    for gen in ("v5e", "v6e"):
        for chips, topo in _TOPOLOGIES_2D.items():
            per_host = chips if chips <= _SINGLE_HOST_2D else CHIPS_PER_HOST
            name = f"{gen}-{chips}"
            out[name] = TpuType(name, gen, chips, per_host, ACCELERATORS[gen], topo)
    return out


TPU_TYPES: dict[str, TpuType] = _table()
_ALIASES = {"v5litepod": "v5e"}


def supported() -> str:
    """The supported names, one generation per clause (for error messages)."""
    by_gen: dict[str, list[str]] = {}
    for t in TPU_TYPES.values():
        by_gen.setdefault(t.generation, []).append(t.name.split("-")[1])
    return "; ".join(f"{g}-{{{','.join(ns)}}}" for g, ns in by_gen.items()) + \
        " (v5litepod-N is v5e-N)"


def parse(name: str) -> TpuType:
    """The slice type `name` names (`v5p-128`, `v5litepod-16`, `v6e-8`); ValueError
    naming the supported ones otherwise."""
    m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip().lower())
    if m:
        canonical = f"{_ALIASES.get(m[1], m[1])}-{int(m[2])}"
        if canonical in TPU_TYPES:
            return TPU_TYPES[canonical]
    raise ValueError(f"unknown TPU type {name!r}; supported: {supported()}")


def fitting(devices: int, generation: str | None = None) -> list[TpuType]:
    """The types whose slices tile `devices` chips exactly (chips per slice divide
    it), smallest slice first; of one generation when given."""
    return [t for t in sorted(TPU_TYPES.values(), key=lambda t: (t.chips, t.generation))
            if devices % t.chips == 0 and generation in (None, t.generation)]


def largest_fitting(devices: int, generation: str | None = None) -> TpuType:
    """The type with the largest slice that tiles `devices` chips exactly (fewest
    slices, so the least traffic over the data-centre network)."""
    found = fitting(devices, generation)
    if not found:
        raise ValueError(f"no {generation or 'TPU'} slice type tiles {devices} chips")
    return max(found, key=lambda t: t.chips)


def num_slices(devices: int, tpu: TpuType) -> int:
    """How many `tpu` slices give exactly `devices` chips; ValueError naming both
    numbers and suggesting types that fit."""
    if devices < 1:
        raise ValueError(f"the config needs {devices} devices")
    if devices % tpu.chips == 0:
        return devices // tpu.chips
    # Fewest slices first: the least traffic over the data-centre network.
    options = sorted(fitting(devices, tpu.generation), key=lambda t: -t.chips)[:2]
    if not options and fitting(devices):  # no size of this generation fits
        options = [largest_fitting(devices)]
    hint = " or ".join(f"{t.name} ({devices // t.chips} slice"
                       f"{'s' if devices // t.chips > 1 else ''})" for t in options)
    raise ValueError(f"the config needs {devices} devices (one per chip), but {tpu.name} has "
                     f"{tpu.chips} chips per slice, which does not divide {devices}"
                     + (f"; try {hint}" if hint else ""))
