"""A decode slice: a sub-mesh, an engine, its resident version(s) and S slots.

Continuous batching: `step()` prefills waiting requests into free slots, runs one
`generate_steps` call (up to `rollout.decode_steps` tokens per slot) and returns the
trajectories that finished, at one host read per call (`calls`, slice_decode.py, which
reads call k-1 after dispatching call k).

The other parts it owns: `versions` (slice_versions.py), `memory` (prompt cache and
pages, slice_memory.py), `prefills` (slice_prefill.py), `slots` (slots.py) and `turns`
(multi-turn episodes between turns, slice_episodes.py).

C1 is enforced here: nothing is served under a version other than its request's, except
by `interrupt_and_reload` (partial rollout), which records the version of every token.
One thread drives a slice.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any

import jax

from dora_jax.base import versions as versions_lib
from dora_jax.rollout.engine import Engine
from dora_jax.rollout.episodes import EpisodeRunner
from dora_jax.rollout.slice_decode import DecodeCalls
from dora_jax.rollout.slice_episodes import EpisodeTurns
from dora_jax.rollout.slice_memory import SliceMemory
from dora_jax.rollout.slice_prefill import Prefills
from dora_jax.rollout.slice_versions import ResidentVersions
from dora_jax.rollout.slots import ROUTING_WINDOW, SlotTable
from dora_jax.rollout.trajectory import (
    InFlight,
    Request,
    RolloutError,
    SliceStats,
    SlotOverflowError,
    VersionMismatchError,
)

if TYPE_CHECKING:
    from flax import nnx
    from jax.sharding import Mesh

    from dora_jax.config import ModelConfig, RolloutConfig
    from dora_jax.rollout.state import EngineParams


class DecodeSlice:
    """S slots of continuous batching on one engine (see `create`), serving its
    resident versions (up to `engine.versions`); `episodes` runs the environments of
    multi-turn requests, `lookahead` reads call k-1 only after dispatching call k."""

    def __init__(self, slice_id: int, engine: Engine, *, lookahead: bool = True,
                 clock: Callable[[], float] = time.time,
                 episodes: EpisodeRunner | None = None) -> None:
        self.slice_id, self.engine, self.clock = slice_id, engine, clock
        self.stats = SliceStats()
        self.turns = EpisodeTurns(episodes, engine, self.stats)
        self.slots = SlotTable(engine.max_concurrent_decodes, engine.max_decode_len,
                               routing_window=max(ROUTING_WINDOW, engine.decode_steps))
        self.calls = DecodeCalls(slice_id, engine, self.slots, self.stats, self._finish,
                                 lookahead=lookahead)
        self.memory = SliceMemory(engine)
        self.versions = ResidentVersions(
            slice_id, engine, self._held_versions,
            lambda: self.memory.forget(list(self.memory.prefixes)), self.stats)
        self.prefills = Prefills(engine, self.memory, self.stats, self.slots, self.versions,
                                 self.calls, clock)
        self._held: dict = {}  # request_id -> InFlight (waiting and running)
        self._waiting: collections.deque = collections.deque()
        self._done: list = []  # finished Trajectories not yet returned by step()

    @classmethod
    def create(cls, slice_id: int, mesh: Mesh, model_cfg: ModelConfig,
               rollout_cfg: RolloutConfig, *, lookahead: bool = True,
               episodes: EpisodeRunner | None = None, **engine_kwargs: Any) -> DecodeSlice:
        """A slice with its own Engine (engine kwargs: rules, sampling_params, greedy,
        tokenizer_path, stop_ids, versions, prefill_samples)."""
        return cls(slice_id, Engine(model_cfg, rollout_cfg, mesh, **engine_kwargs),
                   lookahead=lookahead, episodes=episodes)

    # ------------------------------------------------------------ queries

    @property
    def version(self) -> int | None:
        """The one resident version (several resident: the last loaded)."""
        return self.versions.version

    @property
    def params(self) -> EngineParams | None:
        return self.versions.params

    @property
    def resident_versions(self) -> list:
        return self.versions.resident

    def running_by_version(self) -> dict:
        """{version: slots decoding under it} (what the next generate call serves)."""
        return dict(collections.Counter(seq.version for seq in self.slots.holders()))

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_requests(self) -> int:
        """Waiting + running requests held."""
        return len(self._held)

    @property
    def num_free_slots(self) -> int:
        """How many more requests `submit`/`import_requests` accept now (beyond the
        slots, with episodes that give theirs up at their environment)."""
        return self.turns.capacity - len(self._held)

    @property
    def num_running(self) -> int:
        return len(self._held) - len(self._waiting) - len(self.turns)

    @property
    def num_at_environment(self) -> int:
        """Episodes waiting for their environment's answer."""
        return len(self.turns)

    @property
    def idle(self) -> bool:
        """Nothing held, in flight or finished and not yet returned by `step`."""
        return not (self._held or self._done or self.calls.outstanding)

    @property
    def kv_free_tokens(self) -> int | None:
        """Paged cache: KV positions free beyond what the running requests' next call
        and the waiting requests' start need (may be negative); None if dense."""
        return self.memory.kv_free_tokens(self._waiting)

    def holds(self, request_id: Iterable[Hashable]) -> bool:
        """The request is waiting or running here (not finished, not exported)."""
        return tuple(request_id) in self._held

    @property
    def held_versions(self) -> set:
        """Versions of the requests held (C1: a one-version slice's, or none)."""
        return {seq.version for seq in self._held.values()}

    def abandon(self) -> None:
        """Drops every request and the resident params: after a failure the slice
        starts again empty, to be told which version to load."""
        self._held.clear()
        self._waiting.clear()
        self.turns.clear()
        self._done = []
        self.slots.clear()
        self.versions.clear()
        self.calls.reset()
        self.memory.reset()

    def reset_decode_state(self) -> None:
        """A fresh decode state (the slice must hold nothing): after the engine served
        another decode state, e.g. a warm-up's, whose use reset its page pool."""
        if self._held or self.calls.generate_in_flight:
            raise RolloutError(f"slice {self.slice_id}: reset_decode_state while holding "
                               f"{self.num_requests} request(s)")
        self.calls.reset()
        self.memory.reset()

    # ------------------------------------------------------------ requests

    def submit(self, request: Request) -> None:
        """Queues a request for the next `step()`; raises, changing nothing, on a version
        not resident (C1), a bad prompt, a duplicate id or no free slot."""
        self._check_accepts([request.request_id], [request.version])
        request.check(self.engine.max_prefill_length, self.engine.model_cfg.vocab_size)
        seq = InFlight.submitted(request, self.slice_id, self.clock())
        self.turns.begin(seq)
        self._held[request.request_id] = seq
        self._waiting.append(seq)

    def step(self) -> list:
        """Prefills waiting requests into free slots, runs one generate call and
        returns the trajectories that finished (list of Trajectory)."""
        self.calls.check_pool()
        for seq, why in self.turns.collect():
            if why is None:  # the observation is in: the next turn goes first
                self._waiting.appendleft(seq)
            else:
                self._end_episode(seq, why)
        while (self._waiting and not self.slots.full
               and self.memory.room_for(self._waiting[0])):
            if (self._waiting[0].kept is not None  # observations in: prefilled together
                    and self.engine.rollout_cfg.batch_observations):
                self.prefills.continue_waiting(self._waiting)
            elif self.prefills.fresh(self._waiting[0]):  # a group's samples together
                self.prefills.start_group(self._waiting)
            else:
                self.prefills.start(self._waiting.popleft(), self.slots.lowest_free())
        n = 0
        if self.slots.busy:
            # A whole call even with a free slot: it ends after the first step in which
            # a slot finishes, and the worker applies the coordinator's answer to a
            # finish before the next call, so new work waits at most one call, while
            # one-token calls would pay a dispatch and a host read for every token.
            n = self.engine.decode_steps
            if self.engine.pages is not None:
                self._reserve_pages(n)
        self.calls.generate(self.versions.generate_params() if n else None, n)
        done, self._done = self._done, []
        self.memory.forget_groups_except({rid[0] for rid in self._held})
        if (not done and len(self.turns) and not self.slots.busy and not self._waiting
                and not self.calls.generate_in_flight):
            self.turns.wait(0.02)  # only environments are working: wait, not spin
        return done

    def drain(self, max_steps: int | None = None) -> list:
        """Steps until no request is held (or `max_steps`); returns all finished."""
        out, n = [], 0
        while ((self._held or self._done or self.calls.generate_in_flight)
               and (max_steps is None or n < max_steps)):
            out.extend(self.step())
            n += 1
        return out

    # ------------------------------------------------------------ versions (C1)

    def load_version(self, version: int, params: nnx.State | EngineParams) -> float:
        """`versions.load_only`: refuses while holding requests of another version."""
        return self.versions.load_only(version, params)

    def add_version(self, version: int, params: nnx.State | EngineParams) -> float:
        return self.versions.add(version, params)

    def evict_version(self, version: int) -> None:
        """`versions.evict`: refuses while holding a request of that version."""
        self.versions.evict(version)

    def _held_versions(self) -> collections.Counter:
        self.calls.sync()  # requests that finished in flight no longer count
        return collections.Counter(seq.version for seq in self._held.values())

    def interrupt_and_reload(self, version: int, params: nnx.State | EngineParams) -> float:
        """partial_rollout: loads `version` with requests in flight, re-prefills each
        running one (prompt + tokens so far) under the new params and continues it;
        waiting ones will start under the new version. Returns the seconds waited."""
        if self.engine.versions > 1:
            raise RolloutError(f"slice {self.slice_id}: interrupt_and_reload is the "
                               f"one-version baseline; this slice holds several")
        self.calls.sync()
        running = self.slots.holders()
        for seq in running:
            self._flush(seq)
        seconds = self.versions.load_only(version, params, check=False)
        self.stats.interrupts += 1
        for seq in self._held.values():
            seq.version = version
            seq.kept, seq.unwritten = None, 0  # KV kept between turns: the old version's
        self.turns.drop_kept()
        for seq in running:  # freed first: the engine pairs each free with an insert
            self.engine.free_resource(seq.slot)
            self.prefills.start(seq, seq.slot)
        return seconds

    # ------------------------------------------------------------ migration

    def export_requests(self, request_ids: Iterable | None = None) -> list:
        """Removes requests (all held if None) from this slice and returns them as
        InFlight records (KV cache, tokens so far, RNG state, behaviour log-probs)
        for `import_requests` on a slice holding the same version."""
        self.calls.sync()
        ids = list(self._held) if request_ids is None else list(
            dict.fromkeys(tuple(r) for r in request_ids))
        missing = [r for r in ids if r not in self._held]
        if missing:
            raise KeyError(f"slice {self.slice_id} does not hold request(s) {missing}")
        out = []
        for rid in ids:
            seq = self._held.pop(rid)
            prefix = None
            at_env = self.turns.take(rid)
            if at_env is not None:  # moves with its kept KV and its pending call
                _, seq.kept, env_call = at_env
                seq.env_call = env_call
                out.append(seq)
                continue
            if seq.slot is None:
                self._waiting.remove(seq)
            else:
                self._flush(seq)
                prefix = self.engine.extract(  # only the positions written so far
                    self.calls.state, seq.slot, used=seq.length)
                self._free(seq)
            seq.prefix = prefix
            out.append(seq)
        self.stats.migrated_out += len(out)
        self.memory.forget_groups_except({rid[0] for rid in self._held})
        return out

    def import_requests(self, inflights: Iterable[InFlight]) -> None:
        """Takes over exported requests, each KV cache into a free slot of this mesh;
        refuses, changing nothing, a version not resident (C1) or too many."""
        inflights = list(inflights)
        self._check_accepts([f.request.request_id for f in inflights],
                            [f.version for f in inflights])
        for f in inflights:
            if f.prefix is not None and f.prefix.cache.length > self.engine.cache_length:
                raise RolloutError(f"slice {self.slice_id}: imported KV cache has length "
                                   f"{f.prefix.cache.length}, more than this slice's "
                                   f"{self.engine.cache_length}")
        dst = self.engine.get_prefix_destination_sharding()
        for f in inflights:
            seq = f.taken_over(self.slice_id)
            self._held[f.request.request_id] = seq
            if f.prefix is None:
                if f.env_call is not None:  # still at its environment
                    self.turns.put(seq, seq.kept, f.env_call)
                    seq.kept = None
                else:
                    if seq.kept is not None:
                        seq.kept = jax.device_put(seq.kept, dst)
                    self._waiting.append(seq)
                continue
            if self.slots.full:  # more held than slots: it waits, its KV kept and its
                # last token to run again (as an observation would) when it gets a slot
                seq.kept, seq.unwritten = jax.device_put(f.prefix, dst), 1
                self._waiting.appendleft(seq)
                continue
            slot = self.slots.lowest_free()
            self.versions.set_slot(slot, f.version)
            self.calls.insert(jax.device_put(f.prefix, dst), slot, length=f.length)
            self.prefills.place(seq, slot, f.length)
        self.stats.migrated_in += len(inflights)

    # ------------------------------------------------------------ internals

    def _check_accepts(self, ids: list[tuple], versions: list[int]) -> None:
        resident = self.resident_versions
        if not resident:
            raise RolloutError(f"slice {self.slice_id} has no params loaded (load_version)")
        bad = sorted({v for v in versions if v not in resident})
        if bad:
            held = (f"version {self.version}" if len(resident) == 1
                    else f"versions {resident}")
            raise VersionMismatchError(
                f"slice {self.slice_id} holds {held}; refusing request(s) "
                f"of version(s) {bad} (C1)")
        dup = [r for r in ids if r in self._held]
        if dup or len(set(ids)) != len(ids):
            raise RolloutError(f"slice {self.slice_id}: duplicate request id(s) {dup or ids}")
        if len(ids) > self.num_free_slots:
            raise SlotOverflowError(
                f"slice {self.slice_id}: {len(ids)} request(s) but only "
                f"{self.num_free_slots} free slot(s) of {self.num_slots}")

    def _end_episode(self, seq: InFlight, why: str) -> None:
        """Ends an episode between turns. Its finish reason says how its last model
        turn ended (at a stop id: "eos"); `episode.end` says why the episode did."""
        assert seq.episode is not None
        seq.episode.end = why
        del self._held[seq.request.request_id]
        self._done.append(seq.to_trajectory("eos", self.clock()))
        self.stats.finished += 1

    def _free(self, seq: InFlight) -> None:
        assert seq.slot is not None  # it holds one until this frees it
        self.engine.free_resource(seq.slot)
        self.slots.free(seq.slot)

    def _flush(self, seq: InFlight) -> None:
        """Copies the slot's new tokens into the seq, tagged with its version."""
        assert seq.slot is not None
        tokens, logprobs = self.slots.new_tokens(seq.slot, len(seq.response_tokens))
        seq.response_tokens.extend(tokens)
        seq.behaviour_logprobs.extend(logprobs)
        versions_lib.extend(seq.versions, seq.version, len(tokens))

    def _reserve_pages(self, n: int) -> None:
        """Room in the pool for a call of n steps of every running slot (`memory.
        make_room`): a request preempted goes back to the head of the queue with its
        tokens (resumed under the same version: C1)."""
        def preempt(victim: InFlight) -> None:
            self._flush(victim)
            self._free(victim)
            self._waiting.appendleft(victim)
            self.stats.preempted += 1
        self.memory.make_room(n, self.slots, self.calls.sync, preempt, self.slice_id)

    def _finish(self, seq: InFlight) -> None:
        self._flush(seq)
        if seq.episode is not None and self.turns.turn_ended(seq):
            assert seq.slot is not None  # it is freed below
            kept = self.engine.extract(self.calls.state, seq.slot,
                                       used=seq.length)
            self._free(seq)
            self.turns.send(seq, kept)
            return
        self._free(seq)
        del self._held[seq.request.request_id]
        reason = "eos" if seq.response_tokens[-1] in self.engine.stop_ids else "length"
        self._done.append(seq.to_trajectory(reason, self.clock()))
        self.stats.finished += 1
