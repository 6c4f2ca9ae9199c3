"""A decode slice's resident versions (a mixin of `slice.DecodeSlice`, which holds
the state these methods use: its engine, params, held requests and stats).

One resident (version, params) on an engine of one version. On a multi-version
engine (LoRA, `Engine(versions=V)`, rollout/adapters.py) the slice holds up to V
versions' adapters on one base, stacked by place: `add_version` loads a version
into a free place while the other versions' slots keep decoding (one compiled
write, fixed shapes), `evict_version` frees its place once nothing of it is held
here (C1 per trajectory), and every prefill and generate call names the place of
each row (`AdapterPlaces.with_rows`), kept per slot on the host. `load_version`
makes one version the only resident one (the rule of a one-version slice).
Bytes placed per load are counted (`stats.weight_bytes`): with LoRA a later
version's base leaves are the arrays placed before and do not move.
"""

from __future__ import annotations

import time

import jax

from dora_jax.rollout.trajectory import RolloutError, VersionMismatchError


class SliceVersions:
    """What a DecodeSlice does with its versions' params."""

    @property
    def resident_versions(self) -> list:
        """Versions whose params are on this slice (sorted)."""
        if self.engine.versions > 1:
            return sorted(v for v in self._place_versions if v is not None)
        return [] if self.version is None else [self.version]

    def running_by_version(self) -> dict:
        """{version: slots decoding under it} (what the next generate call serves)."""
        counts: dict = {}
        for seq in self.slots.holders():
            counts[seq.version] = counts.get(seq.version, 0) + 1
        return counts

    @property
    def free_places(self) -> int:
        """How many more versions `add_version` takes now."""
        return self.engine.versions - len(self.resident_versions)

    def load_version(self, version: int, params) -> float:
        """Makes `(version, params)` the only resident version: params on any devices
        (an nnx.State or its pure dict, e.g. the trainer's published copy, or
        EngineParams of this engine), placed by one transfer, waited for. Refuses
        (VersionMismatchError,
        slice unchanged) while holding requests of another version. Returns the
        seconds waited."""
        self._sync()  # requests that finished in flight no longer count
        other = sorted(self.held_versions - {version})
        if other:
            raise VersionMismatchError(
                f"slice {self.slice_id}: cannot load version {version} while holding "
                f"{self.num_requests} request(s) of version(s) {other} (C1); drain or "
                f"migrate them first")
        if self.engine.versions > 1:
            for v in self.resident_versions:
                self._evict(v)
        return self._load(version, params)

    def add_version(self, version: int, params) -> float:
        """Loads `version` into a free place (params as for `load_version`: a LoRA
        version's whole tree, whose base leaves, the same arrays as the resident
        base, do not move) without touching the slots of the other resident
        versions, and without recompiling. Refuses (RolloutError, slice unchanged)
        a resident version or a slice with no free place. Returns the seconds
        waited for the transfer."""
        if version in self.resident_versions:
            raise RolloutError(f"slice {self.slice_id}: version {version} is resident")
        if not self.free_places:
            raise RolloutError(f"slice {self.slice_id}: no free place for version "
                               f"{version}; all {self.engine.versions} hold "
                               f"{self.resident_versions} (evict_version first)")
        return self._load(version, params)

    def evict_version(self, version: int) -> None:
        """Frees `version`'s place. Refuses (VersionMismatchError, slice unchanged)
        while a slot, a waiting request or an episode at its environment of that
        version is held here."""
        self._sync()
        if version not in self.resident_versions:
            raise RolloutError(f"slice {self.slice_id}: version {version} is not resident "
                               f"(have {self.resident_versions})")
        n = sum(seq.version == version for seq in self._held.values())
        if n:
            raise VersionMismatchError(f"slice {self.slice_id}: cannot evict version "
                                       f"{version} while holding {n} request(s) of it")
        self._evict(version)

    def interrupt_and_reload(self, version: int, params) -> float:
        """partial_rollout: loads `version` (params as for `load_version`) with
        requests in flight, re-prefills each running one (prompt + tokens so far)
        under the new params and continues it; waiting ones will start under the new
        version. Returns the seconds waited for the params."""
        if self.engine.versions > 1:
            raise RolloutError(f"slice {self.slice_id}: interrupt_and_reload is the "
                               f"one-version baseline; this slice holds several")
        self._sync()
        running = self.slots.holders()
        for seq in running:
            self._flush(seq)
        seconds = self._load(version, params)
        self.stats.interrupts += 1
        for seq in self._held.values():
            seq.version = version
            seq.kept, seq.unwritten = None, 0  # KV kept between turns: the old version's
        for rid, (seq, _, future, sent) in self._env_wait.items():
            self._env_wait[rid] = (seq, None, future, sent)
        for seq in running:
            self._start(seq, seq.slot)
        return seconds

    # ------------------------------------------------------------ internals

    def _place_of(self, version):
        """The adapter place a request of `version` runs under (None: one version)."""
        return None if self.engine.versions == 1 else self._place_versions.index(version)

    def _set_slot_place(self, slot: int, version) -> None:
        if self.engine.versions > 1:
            self._slot_places[slot] = self._place_of(version)

    def prefill_params(self, version):
        """What a prefill of a request of `version` takes."""
        if self.engine.versions == 1:
            return self.params
        return self.engine.places.with_rows(self.params, [self._place_of(version)])

    def generate_params(self):
        """What a generate call takes: each slot's row under its version's place."""
        if self.engine.versions == 1:
            return self.params
        return self.engine.places.with_rows(self.params, self._slot_places)

    def _evict(self, version):
        if self.engine.versions == 1:
            self.params = self.version = None
            return
        self._place_versions[self._place_of(version)] = None
        if self.version == version:
            self.version = max(self.resident_versions, default=None)

    def _load(self, version, params) -> float:
        t0 = time.perf_counter()
        eng = self.engine
        loaded = jax.block_until_ready(eng.load_params(params))
        moved = eng.placement.last_bytes
        if eng.versions > 1:
            place = self._place_versions.index(None)
            if self.params is None:  # zero adapters in every place, the base once
                self.params = eng.places.empty(loaded)
            self.params = jax.block_until_ready(eng.places.put(self.params, place, loaded))
            self._place_versions[place] = version
        else:
            self.params = loaded
            self.memory.forget(list(self.memory.prefixes))  # computed under the old params
        self.version = version
        seconds = time.perf_counter() - t0
        self.stats.weight_loads += 1
        self.stats.weight_transfer_seconds += seconds
        self.stats.weight_bytes += moved
        self.load_log.append((version, seconds))
        return seconds
