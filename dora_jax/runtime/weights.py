"""Published weights: the one path from the trainer to a decode slice.

After step t the trainer thread publishes a copy of its params as version t+1
(`Trainer.published_params`: the next step donates the originals). The coordinator keeps
each version while the scheduler may still place it on a slice — the newest, and any
older one a slice holds or loads, or that has samples to (re)generate — and hands a
slice told to load version v the params of v as published, on the trainer's mesh.
The slice's own loop places them on its devices (`DecodeSlice.load_version`), once,
so a transfer never holds the coordinator or another slice.

A slice told to load the version still in training (partial_rollout_rounds) gets a
future instead, filled with the params when they are published: that slice's loop
pauses on it, nothing else does.

With LoRA (`model.lora.rank` > 0) a publish carries the adapters alone: the book keeps
the frozen base once, from version 0, and hands a slice the base and the version's
adapters together. The base leaves are the same arrays for every version, so an
engine places them once (rollout/placement.py) and a load moves the adapters.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from dora_jax.model import lora

if TYPE_CHECKING:
    from flax import nnx


class WeightBook:
    """Params by version, from publication until no slice can want them."""

    def __init__(self, version: int, params: Any, adapters_only: bool = False) -> None:
        """`params`: version `version`'s params, a copy the trainer will not donate.
        `adapters_only`: later publishes carry adapters (LoRA); the base is kept
        from these params."""
        self._base = None
        if adapters_only:
            self._base, params = lora.split(params)
        self._by_version = {version: params}
        self._awaited: dict[int, list[concurrent.futures.Future]] = {}
        # Every publish has these shapes: counted once, not on each step.
        self.publish_bytes = lora.tree_bytes(params)

    @property
    def versions(self) -> list[int]:
        return sorted(self._by_version)

    def publish(self, version: int, params: Any, keep: Iterable[int]) -> None:
        """Adds `version` and forgets every version not in `keep`; fills the futures
        handed out for it."""
        keep = set(keep)
        by_version = {v: p for v, p in self._by_version.items() if v in keep}
        by_version[version] = params
        self._by_version = by_version
        for box in self._awaited.pop(version, []):
            if not box.done():  # cancelled: its slice failed and restarted since
                box.set_result(self._whole(params))

    def _whole(self, published: nnx.State) -> nnx.State:
        return published if self._base is None else lora.merge(self._base, published)

    def newest(self) -> tuple[int, nnx.State]:
        """The newest published version and its params (any thread)."""
        by_version = self._by_version  # replaced whole on publish, never edited
        version = max(by_version)
        return version, self._whole(by_version[version])

    def for_load(self, version: int,
                 in_training: int | None = None) -> nnx.State | concurrent.futures.Future:
        """The params a slice loads for `version`: published ones, or a future of
        them if `version` is `in_training` (the step the trainer runs now)."""
        params = self._by_version.get(version)
        if params is not None:
            return self._whole(params)
        if version == in_training:
            box: concurrent.futures.Future = concurrent.futures.Future()
            self._awaited.setdefault(version, []).append(box)
            return box
        raise RuntimeError(f"version {version} is not published (have {self.versions})")
