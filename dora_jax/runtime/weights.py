"""Published weights: the one path from the trainer to a decode slice.

After step t the trainer thread publishes a copy of its params as version t+1
(`published_copy`: the next step donates the originals). The coordinator keeps
each version while the scheduler may still place it on a slice — the newest, and any
older one a slice holds or loads, or that has samples to (re)generate — and hands a
slice told to load version v the params of v as published, on the trainer's mesh.
The slice's own loop places them on its devices (`DecodeSlice.load_version`), once,
so a transfer never holds the coordinator or another slice.

A slice told to load the version still in training (partial_rollout_rounds) gets a
future instead, filled with the params when they are published: that slice's loop
pauses on it, nothing else does.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable

import jax

from dora_jax.model.sharding import copy_tree


def published_copy(params: Any) -> Any:
    """A copy of the trainer's params that outlives the next step (which donates
    them), dispatched without waiting. On accelerators it stays on the trainer's
    devices and each slice pulls its shards device to device. On the CPU backend every
    "device" is host memory: one host copy lets each slice place it with a plain copy,
    where resharding device to device runs a cross-device program per slice (about 4x
    the weight-transfer time on the tiny default, contended by the decoding slices)."""
    if all(d.platform == "cpu" for x in jax.tree.leaves(params) for d in x.devices()):
        return jax.device_get(params)
    return copy_tree(params)


class WeightBook:
    """Params by version, from publication until no slice can want them."""

    def __init__(self, version: int, params: Any):
        """`params`: version `version`'s params, a copy the trainer will not donate."""
        self._by_version = {version: params}
        self._awaited: dict[int, list[concurrent.futures.Future]] = {}

    @property
    def versions(self) -> list[int]:
        return sorted(self._by_version)

    def publish(self, version: int, params: Any, keep: Iterable[int]) -> None:
        """Adds `version` and forgets every version not in `keep`; fills the futures
        handed out for it."""
        keep = set(keep)
        self._by_version = {v: p for v, p in self._by_version.items() if v in keep}
        self._by_version[version] = params
        for box in self._awaited.pop(version, []):
            if not box.done():  # cancelled: its slice failed and restarted since
                box.set_result(params)

    def for_load(self, version: int, in_training: int | None = None):
        """The params a slice loads for `version`: published ones, or a future of
        them if `version` is `in_training` (the step the trainer runs now)."""
        params = self._by_version.get(version)
        if params is not None:
            return params
        if version == in_training:
            box: concurrent.futures.Future = concurrent.futures.Future()
            self._awaited.setdefault(version, []).append(box)
            return box
        raise RuntimeError(f"version {version} is not published (have {self.versions})")
