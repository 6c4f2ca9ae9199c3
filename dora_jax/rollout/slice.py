"""A decode slice: a sub-mesh, an engine, its resident version(s) and S slots.

Continuous batching: `step()` prefills waiting requests into free slots, runs one
`generate_steps` call (up to `rollout.decode_steps` tokens per slot) and returns the
trajectories that finished. The only host syncs per call are one read of its packed
results and one for the prefill results of its inserts, if any.

Lookahead (default): `step()` dispatches call k and only then reads call k-1, so the
device never waits for the host; a trajectory comes back one `step()` after its last
token. Methods that need the exact state (`load_version`, `export_requests`,
`interrupt_and_reload`) first read what is in flight; the counts are the host's view.

Components: `versions` (the resident versions' params, slice_versions.py), `memory`
(the group prompt cache and pages, slice_memory.py; a call that does not fit preempts
the most recently started request), `prefills` (what runs before a sample decodes,
slice_prefill.py), `slots` (slots.py) and `turns` (multi-turn episodes between their
turns, slice_episodes.py).

C1 is enforced here: `submit`, `import_requests`, `load_version` and `evict_version`
refuse anything that would serve a request under a version other than its own;
`interrupt_and_reload` (the partial_rollout baseline) is the deliberate exception,
its trajectories recording which version produced which tokens. One thread drives a
slice; its methods are not thread-safe.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

import jax

from dora_jax import versions as versions_lib
from dora_jax.rollout.engine import Engine
from dora_jax.rollout.episodes import EpisodeRunner
from dora_jax.rollout.slice_episodes import EpisodeTurns
from dora_jax.rollout.slice_memory import SliceMemory
from dora_jax.rollout.slice_prefill import Prefills
from dora_jax.rollout.slice_versions import ResidentVersions
from dora_jax.rollout.slots import SlotTable
from dora_jax.rollout.trajectory import (
    InFlight,
    Request,
    RolloutError,
    SliceStats,
    SlotOverflowError,
    VersionMismatchError,
)


class DecodeSlice:
    """S slots of continuous batching on one engine, serving its resident versions
    (one, or up to `engine.versions` on a multi-version engine).

    Args:
      slice_id: this slice's id (recorded in trajectories).
      engine: an `Engine` on the slice's mesh (see `create`).
      lookahead: overlap generate step k with reading step k-1 (module docstring).
      clock: wall-clock source for trajectory timestamps.
      episodes: runs the environments of multi-turn requests (None: single-turn).
    """

    def __init__(self, slice_id: int, engine: Engine, *, lookahead: bool = True,
                 clock: Callable[[], float] = time.time,
                 episodes: EpisodeRunner | None = None):
        self.slice_id, self.engine, self.clock = slice_id, engine, clock
        self.turns = EpisodeTurns(episodes, engine.stop_ids, engine.max_decode_len)
        self.lookahead = lookahead
        self.stats = SliceStats()
        self.state = engine.init_decode_state()
        self._pool_epoch = None if engine.pages is None else engine.pages.epoch
        self.slots = SlotTable(engine.max_concurrent_decodes, engine.max_decode_len)
        self.memory = SliceMemory(engine)
        self.prefills = Prefills(engine, self.memory, self.stats)
        self.versions = ResidentVersions(
            slice_id, engine, self._held_versions,
            lambda: self.memory.forget(list(self.memory.prefixes)), self.stats)
        self._held: dict = {}  # request_id -> InFlight (waiting and running)
        self._waiting: collections.deque = collections.deque()
        self._pending: list = []  # (seq, prefill ResultTokens on device) not yet dispatched
        # (pending prefills, generate ResultTokens, its step count) not yet read
        self._inflight = None
        self._done: list = []  # finished Trajectories not yet returned by step()

    @classmethod
    def create(cls, slice_id, mesh, model_cfg, rollout_cfg, *, lookahead: bool = True,
               episodes: EpisodeRunner | None = None, **engine_kwargs) -> DecodeSlice:
        """A slice with its own Engine (engine kwargs: rules, sampling_params, greedy,
        tokenizer_path, stop_ids, versions)."""
        return cls(slice_id, Engine(model_cfg, rollout_cfg, mesh, **engine_kwargs),
                   lookahead=lookahead, episodes=episodes)

    # ------------------------------------------------------------ queries

    @property
    def version(self) -> int | None:
        """The one resident version (several resident: the last loaded)."""
        return self.versions.version

    @property
    def params(self):
        return self.versions.params

    @property
    def resident_versions(self) -> list:
        return self.versions.resident

    def running_by_version(self) -> dict:
        """{version: slots decoding under it} (what the next generate call serves)."""
        counts: dict = {}
        for seq in self.slots.holders():
            counts[seq.version] = counts.get(seq.version, 0) + 1
        return counts

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    @property
    def num_requests(self) -> int:
        """Waiting + running requests held."""
        return len(self._held)

    @property
    def num_free_slots(self) -> int:
        """How many more requests `submit`/`import_requests` accept now."""
        return self.num_slots - len(self._held)

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
        return not (self._held or self._done or self._pending or self._inflight is not None)

    @property
    def kv_free_tokens(self):
        """Paged cache: KV positions free beyond what the running requests' next call
        and the waiting requests' start need (may be negative); None if dense."""
        return self.memory.kv_free_tokens(self._waiting)

    def holds(self, request_id) -> bool:
        """The request is waiting or running here (not finished, not exported)."""
        return tuple(request_id) in self._held

    @property
    def held_versions(self) -> set:
        """Versions of the requests held (one-version slice: empty or
        {self.version}; C1)."""
        return {seq.version for seq in self._held.values()}

    def abandon(self) -> None:
        """Drops every request and the resident params: after a failure the slice
        starts again empty, to be told which version to load."""
        self._held.clear()
        self._waiting.clear()
        self.turns.clear()
        self._pending, self._inflight, self._done = [], None, []
        self.slots.clear()
        self.versions.clear()
        self.reset_decode_state()

    def reset_decode_state(self) -> None:
        """A fresh decode state (the slice must hold nothing): after the engine served
        another decode state, e.g. a warm-up's, whose use reset its page pool."""
        if self._held or self._inflight is not None:
            raise RolloutError(f"slice {self.slice_id}: reset_decode_state while holding "
                               f"{self.num_requests} request(s)")
        self.state = self.engine.init_decode_state()
        self._pool_epoch = None if self.engine.pages is None else self.engine.pages.epoch
        self.memory.reset()

    # ------------------------------------------------------------ requests

    def submit(self, request: Request) -> None:
        """Queues a request; it is prefilled at the next `step()`. Raises (slice
        unchanged) on a version not resident (C1), a bad prompt, a duplicate id or no
        free slot."""
        self._check_accepts([request.request_id], [request.version])
        request.check(self.engine.max_prefill_length, self.engine.model_cfg.vocab_size)
        seq = InFlight.submitted(request, self.slice_id, self.clock())
        self.turns.begin(seq)
        self._held[request.request_id] = seq
        self._waiting.append(seq)

    def step(self) -> list:
        """Prefills waiting requests into free slots, runs one generate call and
        returns the trajectories that finished (list of Trajectory)."""
        if self._pool_epoch is not None and self.engine.pages.epoch != self._pool_epoch:
            raise RolloutError(f"slice {self.slice_id}: its engine's KV page pool was reset "
                               f"by another decode state; give each slice its own Engine")
        for seq, why in self.turns.collect():
            if why is None:  # the observation is in: the next turn goes first
                self._waiting.appendleft(seq)
            else:
                self._end_episode(seq, why)
        while (self._waiting and not self.slots.full
               and self.memory.has_pages_for(self._waiting[0])):
            self._start(self._waiting.popleft(), self.slots.lowest_free())
        result, n = None, 0
        if self.slots.busy:
            # A whole call even with a free slot: it ends after the first step in which
            # a slot finishes, and the worker applies the coordinator's answer to a
            # finish before the next call, so new work waits at most one call, while
            # one-token calls would pay a dispatch and a host read for every token.
            n = self.engine.decode_steps
            if self.engine.pages is not None:
                self._reserve_pages(n)
            self.state, result = self.engine.generate_steps(self.versions.generate_params(),
                                                            self.state, n)
            if self.engine.pages is not None:
                self.stats.peak_pages = max(self.stats.peak_pages, self.engine.pages.num_used)
            self.stats.generate_calls += 1
        record = (self._pending, result, n) if self._pending or result is not None else None
        self._pending = []
        if self.lookahead:
            record, self._inflight = self._inflight, record
        if record is not None:
            self._read(*record)
        done, self._done = self._done, []
        self.memory.forget_groups_except({rid[0] for rid in self._held})
        if (not done and len(self.turns) and not self.slots.busy and not self._waiting
                and self._inflight is None):
            self.turns.wait(0.02)  # only environments are working: wait, not spin
        return done

    def drain(self, max_steps: int | None = None) -> list:
        """Steps until no request is held (or `max_steps`); returns all finished."""
        out, n = [], 0
        while ((self._held or self._done or self._inflight is not None)
               and (max_steps is None or n < max_steps)):
            out.extend(self.step())
            n += 1
        return out

    # ------------------------------------------------------------ versions (C1)

    def load_version(self, version: int, params) -> float:
        """`versions.load_only`: refuses while holding requests of another version."""
        return self.versions.load_only(version, params)

    def add_version(self, version: int, params) -> float:
        return self.versions.add(version, params)

    def evict_version(self, version: int) -> None:
        """`versions.evict`: refuses while holding a request of that version."""
        self.versions.evict(version)

    def _held_versions(self) -> collections.Counter:
        self._sync()  # requests that finished in flight no longer count
        return collections.Counter(seq.version for seq in self._held.values())

    def interrupt_and_reload(self, version: int, params) -> float:
        """partial_rollout: loads `version` with requests in flight, re-prefills each
        running one (prompt + tokens so far) under the new params and continues it;
        waiting ones will start under the new version. Returns the seconds waited."""
        if self.engine.versions > 1:
            raise RolloutError(f"slice {self.slice_id}: interrupt_and_reload is the "
                               f"one-version baseline; this slice holds several")
        self._sync()
        running = self.slots.holders()
        for seq in running:
            self._flush(seq)
        seconds = self.versions.load_only(version, params, check=False)
        self.stats.interrupts += 1
        for seq in self._held.values():
            seq.version = version
            seq.kept, seq.unwritten = None, 0  # KV kept between turns: the old version's
        self.turns.drop_kept()
        for seq in running:
            self._start(seq, seq.slot)
        return seconds

    # ------------------------------------------------------------ migration

    def export_requests(self, request_ids: Iterable | None = None) -> list:
        """Removes requests (all held if None) from this slice and returns them as
        InFlight records (KV cache, tokens so far, RNG state, behaviour log-probs)
        for `import_requests` on a slice holding the same version."""
        self._sync()
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
                    self.state, seq.slot, used=seq.length)
                self._free(seq)
            seq.prefix = prefix
            out.append(seq)
        self.stats.migrated_out += len(out)
        self.memory.forget_groups_except({rid[0] for rid in self._held})
        return out

    def import_requests(self, inflights: Iterable[InFlight]) -> None:
        """Takes over exported requests: moves each KV cache onto this slice's mesh
        and inserts it into a free slot (not-started ones are queued). Refuses (slice
        unchanged) requests of a version not resident (C1) or more than the free
        slots."""
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
                if seq.kept is not None:
                    seq.kept = jax.device_put(seq.kept, dst)
                if f.env_call is not None:  # still at its environment
                    self.turns.put(seq, seq.kept, f.env_call)
                    seq.kept = None
                else:
                    self._waiting.append(seq)
                continue
            slot = self.slots.lowest_free()
            self.versions.set_slot(slot, f.version)
            used = f.length
            self.state = self.engine.insert(jax.device_put(f.prefix, dst), self.state, slot,
                                            length=used)
            self._place(seq, slot, used)
        self.stats.migrated_in += len(inflights)

    # ------------------------------------------------------------ internals

    def _check_accepts(self, ids, versions):
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

    def _start(self, seq: InFlight, slot: int):
        """Prefills `seq` into `slot` (slice_prefill.py); the result is read at the
        next sync."""
        self.versions.set_slot(slot, seq.version)
        self.state, result = self.prefills.into_slot(
            seq, self.state, slot, self.versions.prefill_params(seq.version))
        if seq.t_start is None:
            seq.t_start = self.clock()
        self._place(seq, slot, seq.length)
        self._pending.append((seq, result))

    def _end_episode(self, seq: InFlight, why: str):
        """Ends an episode between turns. Its finish reason says how its last model
        turn ended (at a stop id: "eos"); `episode.end` says why the episode did."""
        seq.episode.end = why
        del self._held[seq.request.request_id]
        self._done.append(seq.to_trajectory("eos", self.clock()))
        self.stats.finished += 1

    def _place(self, seq: InFlight, slot: int, written: int):
        self.slots.place(seq, slot, len(seq.request.prompt_tokens), written)
        if self.engine.pages is not None:
            self.stats.peak_pages = max(self.stats.peak_pages, self.engine.pages.num_used)

    def _free(self, seq: InFlight):
        self.engine.free_resource(seq.slot)
        self.slots.free(seq.slot)

    def _flush(self, seq: InFlight):
        """Copies the slot's new tokens into the seq, tagged with its version."""
        tokens, logprobs = self.slots.new_tokens(seq.slot, len(seq.response_tokens))
        seq.response_tokens.extend(tokens)
        seq.behaviour_logprobs.extend(logprobs)
        versions_lib.extend(seq.versions, seq.version, len(tokens))

    def _reserve_pages(self, n: int):
        """Makes room in the pool for a call of n steps of every running slot: lets the
        prompt pages go, then sends the most recently started request back to the head
        of the queue with its tokens (resumed under the same version: C1)."""
        if self.memory.short(n):
            self._sync()  # finished requests give their pages back
        while self.memory.short(n):
            if self.memory.drop_prompt_pages():
                continue
            if self.slots.owned.sum() <= 1:
                raise RolloutError(f"slice {self.slice_id}: KV pool of "
                                   f"{self.engine.pages.num_pages} pages cannot hold one "
                                   f"request")
            victim = self.slots.owner(self.slots.latest_started())
            self._flush(victim)
            self._free(victim)
            self._waiting.appendleft(victim)
            self.stats.preempted += 1

    def _read(self, pending, result, n=0):
        """Records prefill results (first, they precede any generate result of the
        same slot) and one generate call's results; finishes what finished."""
        if pending:
            for (seq, _), r in zip(pending, jax.device_get([r for _, r in pending])):
                self.slots.record(seq.slot, int(r.steps[0]), r.tokens[0], r.logprobs[0])
                if r.finished[0]:
                    self._finish(seq)
        if result is None:
            return
        host = result.convert_to_numpy()  # the one host sync per call
        steps_run, busy, finished = self.slots.record_call(host)
        self.stats.generate_steps += steps_run
        self.stats.total_slot_steps += self.num_slots * steps_run
        self.stats.busy_slot_steps += busy
        for s in finished:
            self._finish(self.slots.owner(s))
        if self.engine.pages is not None:
            # What the call still in flight (if any) may write comes on top.
            ahead = self._inflight[2] if self._inflight is not None else 0
            owned, written = self.slots.written()
            self.engine.pages.tighten(owned, written + ahead)

    def _sync(self):
        """Reads everything dispatched but not yet read: afterwards the host view
        equals the device state."""
        if self._inflight is not None:
            record, self._inflight = self._inflight, None
            self._read(*record)
        pending, self._pending = self._pending, []
        self._read(pending, None)

    def _finish(self, seq: InFlight):
        self._flush(seq)
        if seq.episode is not None and self.turns.turn_ended(seq):
            kept = self.engine.extract(self.state, seq.slot,
                                       used=seq.length)
            self._free(seq)
            self.turns.send(seq, kept)
            return
        self._free(seq)
        del self._held[seq.request.request_id]
        reason = "eos" if seq.response_tokens[-1] in self.engine.stop_ids else "length"
        self._done.append(seq.to_trajectory(reason, self.clock()))
        self.stats.finished += 1
