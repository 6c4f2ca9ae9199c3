"""A decode slice's resident versions and their params (`DecodeSlice.versions`).

One resident (version, params) on an engine of one version. On a multi-version
engine (LoRA, `Engine(versions=V)`, rollout/adapters.py) up to V versions' adapters
on one base, stacked by place: `add` loads a version into a free place while the
other versions' slots keep decoding (one compiled write, fixed shapes), `evict` frees
a place, and every prefill and generate call names the place of each row
(`AdapterPlaces.with_rows`), kept per slot on the host. Bytes placed per load are
counted (`stats.weight_bytes`): with LoRA a later version's base leaves are the
arrays placed before and do not move.

C1: `load_only` and `evict` refuse (VersionMismatchError, nothing changed) while the
slice holds requests of another version, resp. of the evicted one; the slice says
what it holds through `held`, a narrow query (its requests' versions, after it has
read what was in flight).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import numpy as np

from dora_jax.rollout.trajectory import RolloutError, VersionMismatchError

if TYPE_CHECKING:
    from flax import nnx

    from dora_jax.rollout.adapters import AdapterPlaces
    from dora_jax.rollout.engine import Engine
    from dora_jax.rollout.state import EngineParams
    from dora_jax.rollout.trajectory import SliceStats


class ResidentVersions:
    """The params of the versions an engine serves, and each slot's place.

    Args:
      slice_id: for error messages.
      engine: the slice's `Engine`.
      held: () -> Counter of the versions of the requests the slice holds.
      forget_prefixes: called when a one-version load replaces the params (prompt
        prefixes computed under the old ones must not be reused).
      stats: the slice's `SliceStats`, whose weight-load counters this updates.
    """

    def __init__(self, slice_id: int, engine: Engine, held: Callable[[], Counter[int]],
                 forget_prefixes: Callable[[], object], stats: SliceStats) -> None:
        self.slice_id, self._engine, self._held = slice_id, engine, held
        self._forget_prefixes, self._stats = forget_prefixes, stats
        self.version: int | None = None  # the one resident (V > 1: the last loaded)
        # V > 1: every place's adapters, no rows
        self.params: EngineParams | None = None
        self.load_log: list = []  # (version, seconds) per weight load
        self._place_versions: list[int | None] = [None] * engine.versions
        self._slot_places = np.zeros(engine.max_concurrent_decodes, np.int32)

    @property
    def resident(self) -> list:
        """Versions whose params are here (sorted)."""
        if self._engine.versions > 1:
            return sorted(v for v in self._place_versions if v is not None)
        return [] if self.version is None else [self.version]

    @property
    def free_places(self) -> int:
        """How many more versions `add` takes now."""
        return self._engine.versions - len(self.resident)

    def load_only(self, version: int, params: nnx.State | EngineParams, *, check: bool = True
                  ) -> float:
        """Makes `(version, params)` the only resident version: params on any devices
        (an nnx.State or its pure dict, or EngineParams of this engine), placed by one
        transfer, waited for; returns the seconds waited. `check=False`: with
        requests of another version held (partial_rollout's interrupt)."""
        held = self._held() if check else {}
        other = sorted(set(held) - {version})
        if other:
            raise VersionMismatchError(
                f"slice {self.slice_id}: cannot load version {version} while holding "
                f"{sum(held.values())} request(s) of version(s) {other} (C1); drain or "
                f"migrate them first")
        if self._engine.versions > 1:
            for v in self.resident:
                self.evict(v, check=False)
        return self._load(version, params)

    def add(self, version: int, params: nnx.State | EngineParams) -> float:
        """Multi-version engine: loads `version` into a free place without touching the
        other versions' slots or recompiling (a LoRA version's base leaves, the arrays
        already placed, do not move); returns the seconds waited."""
        if version in self.resident:
            raise RolloutError(f"slice {self.slice_id}: version {version} is resident")
        if not self.free_places:
            raise RolloutError(f"slice {self.slice_id}: no free place for version "
                               f"{version}; all {self._engine.versions} hold "
                               f"{self.resident} (evict_version first)")
        return self._load(version, params)

    def evict(self, version: int, *, check: bool = True) -> None:
        """Frees `version`'s place (none of its requests held, not even one at its
        environment)."""
        if version not in self.resident:
            raise RolloutError(f"slice {self.slice_id}: version {version} is not resident "
                               f"(have {self.resident})")
        n = self._held()[version] if check else 0
        if n:
            raise VersionMismatchError(f"slice {self.slice_id}: cannot evict version "
                                       f"{version} while holding {n} request(s) of it")
        if self._engine.versions == 1:
            self.params = self.version = None
            return
        self._place_versions[self._place_of(version)] = None
        if self.version == version:
            self.version = max(self.resident, default=None)

    def clear(self) -> None:
        self.params = self.version = None
        self._place_versions = [None] * self._engine.versions

    def set_slot(self, slot: int, version: int) -> None:
        """`slot` decodes under `version` from its next call."""
        if self._engine.versions > 1:
            self._slot_places[slot] = self._place_of(version)

    def prefill_params(self, version: int) -> EngineParams:
        """What a prefill of a request of `version` takes."""
        if self._engine.versions == 1:
            return self._loaded
        return self._places.with_rows(self._loaded, [self._place_of(version)])

    def generate_params(self) -> EngineParams:
        """What a generate call takes: each slot's row under its version's place."""
        if self._engine.versions == 1:
            return self._loaded
        return self._places.with_rows(self._loaded, self._slot_places)

    @property
    def _loaded(self) -> EngineParams:
        """The resident params: a slice runs requests of resident versions only."""
        assert self.params is not None, f"slice {self.slice_id}: no version loaded"
        return self.params

    @property
    def _places(self) -> AdapterPlaces:
        """A multi-version engine's places (the paths only V > 1 takes)."""
        assert self._engine.places is not None, "a one-version engine has no places"
        return self._engine.places

    def _place_of(self, version: int) -> int:
        return self._place_versions.index(version)

    def _load(self, version: int, params: nnx.State | EngineParams) -> float:
        t0 = time.perf_counter()
        eng = self._engine
        loaded = jax.block_until_ready(eng.load_params(params))
        moved = eng.placement.last_bytes
        if eng.versions > 1:
            place = self._place_versions.index(None)
            if self.params is None:  # zero adapters in every place, the base once
                self.params = self._places.empty(loaded)
            self.params = jax.block_until_ready(self._places.put(self.params, place, loaded))
            self._place_versions[place] = version
        else:
            self.params = loaded
            self._forget_prefixes()
        self.version = version
        seconds = time.perf_counter() - t0
        self._stats.weight_loads += 1
        self._stats.weight_transfer_seconds += seconds
        self._stats.weight_bytes += moved
        self.load_log.append((version, seconds))
        return seconds
