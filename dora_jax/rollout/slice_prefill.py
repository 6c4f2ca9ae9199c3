"""What a decode slice runs to put a sample in a slot (`DecodeSlice.prefills`).

The group's prompt runs once under the resident params: the samples that start
together draw their first tokens from that one prefill and go into their slots in one
call (`start_group`), a later fresh sample draws its first token from the prompt's
prefix, a resumed one (preempted, or re-prefilled under new
params) runs only its own tokens on top of it, and on a paged cache they all map the
prompt's pages (slice_memory.py). An episode between turns runs only its unwritten
tokens (the last turn's end and the observation) on top of the KV it kept; episodes
whose observations arrived together run in one batched call (`continue_waiting`).
The prefill's first token is read with the slice's next call (`calls.prefilled`).
Inserts go through `calls`, the decode state's one owner (slice_decode.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dora_jax.rollout.slice_memory import prompt_key
from dora_jax.rollout.trajectory import InFlight

if TYPE_CHECKING:
    from dora_jax.rollout.engine import Engine
    from dora_jax.rollout.slice_decode import DecodeCalls
    from dora_jax.rollout.slice_memory import SliceMemory
    from dora_jax.rollout.slice_versions import ResidentVersions
    from dora_jax.rollout.slots import SlotTable
    from dora_jax.rollout.state import EngineParams, ResultTokens
    from dora_jax.rollout.trajectory import SliceStats


class Prefills:
    """Prefills into the slots of one slice's decode state, sharing its prompt cache
    (`memory`), slot table, resident versions and calls, counting into its `stats`."""

    def __init__(self, engine: Engine, memory: SliceMemory, stats: SliceStats,
                 slots: SlotTable, versions: ResidentVersions, calls: DecodeCalls,
                 clock: Callable[[], float]) -> None:
        self._engine, self._memory, self._stats = engine, memory, stats
        self._slots, self._versions, self._calls, self._clock = slots, versions, calls, clock

    def start(self, seq: InFlight, slot: int) -> None:
        """Prefills `seq` into `slot` under its version's params."""
        self._versions.set_slot(slot, seq.version)
        result = self.into_slot(seq, slot, self._versions.prefill_params(seq.version))
        if seq.t_start is None:
            seq.t_start = self._clock()
        self.place(seq, slot, seq.length)
        self._calls.prefilled(seq, result)

    def start_group(self, waiting: collections.deque[InFlight]) -> None:
        """The fresh samples at the head of `waiting` that share its prompt (not cached
        yet), version and limit, into free slots as far as slots and pages go: one
        prefill draws each one's first token, one call inserts them all."""
        free = np.flatnonzero(~self._slots.owned)
        seqs = self.take_group(waiting, len(free))
        if len(seqs) == 1:
            self.start(seqs[0], self._slots.lowest_free())
            return
        slots = [int(s) for s in free[:len(seqs)]]
        for seq, slot in zip(seqs, slots):
            self._versions.set_slot(slot, seq.version)
        r, engine, stats = seqs[0].request, self._engine, self._stats
        P = len(r.prompt_tokens)
        padded, _ = engine.pad_tokens(r.prompt_tokens)
        prefix, result = engine.prefill_multisampling(
            params=self._versions.prefill_params(seqs[0].version), padded_tokens=padded,
            true_length=P, rng=[q.request.key_data() for q in seqs], num_samples=len(seqs),
            max_new_tokens=r.max_new_tokens)
        self._calls.bulk_insert(prefix, slots, length=P)
        stats.prefills += 1
        stats.prefill_tokens += P
        stats.prefills_shared += len(seqs) - 1
        self._memory.remember(prompt_key(r), prefix, slots[0], P)
        now = self._clock()
        for row, (seq, slot) in enumerate(zip(seqs, slots)):
            seq.t_start = now
            self.place(seq, slot, P)
            self._calls.prefilled(seq, result, row)

    def take_group(self, waiting: collections.deque[InFlight], room: int) -> list[InFlight]:
        """Takes from the head of `waiting` the fresh samples of its prompt, version and
        limit, up to `room` and as far as the pool's pages go (at least the head), as
        many as the largest power of two of those: the shapes warm-up compiles."""
        head = waiting[0]
        key, pages = prompt_key(head.request), 0
        out: list[InFlight] = []
        while (waiting and len(out) < room and self.fresh(waiting[0])
               and prompt_key(waiting[0].request) == key
               and waiting[0].version == head.version
               and waiting[0].request.max_new_tokens == head.request.max_new_tokens
               and (not out or self._memory.room_for(waiting[0], also=pages))):
            pages += self._memory.pages_needed(waiting[0])
            out.append(waiting.popleft())
        keep = 1 << (len(out).bit_length() - 1)
        waiting.extendleft(reversed(out[keep:]))
        return out[:keep]

    def fresh(self, seq: InFlight) -> bool:
        """`seq` starts from its prompt, which no sample on this slice has run yet."""
        return (seq.kept is None and not seq.response_tokens and seq.t_start is None
                and prompt_key(seq.request) not in self._memory.prefixes)

    def continue_waiting(self, waiting: collections.deque[InFlight]) -> None:
        """The episodes at the head of `waiting` whose observations are in, into free
        slots, in one prefill (`take_continuations`)."""
        free = np.flatnonzero(~self._slots.owned)
        seqs = self.take_continuations(waiting, len(free))
        slots = [int(s) for s in free[:len(seqs)]]
        for seq, slot in zip(seqs, slots):
            self._versions.set_slot(slot, seq.version)
        results = self.continue_episodes(seqs, slots,
                                         self._versions.prefill_params(seqs[0].version))
        for seq, slot, result in zip(seqs, slots, results):
            self.place(seq, slot, seq.length)
            self._calls.prefilled(seq, result)

    def place(self, seq: InFlight, slot: int, written: int) -> None:
        """`seq` holds `slot`, whose KV has `written` positions."""
        self._slots.place(seq, slot, len(seq.request.prompt_tokens), written)
        if self._engine.pages is not None:
            self._stats.peak_pages = max(self._stats.peak_pages, self._engine.pages.num_used)

    def into_slot(self, seq: InFlight, slot: int, params: EngineParams) -> ResultTokens:
        """Prefills `seq` (prompt + response so far) into `slot` under `params`;
        returns the prefill's ResultTokens, to be read."""
        if seq.kept is not None:
            return self._continue_episode(seq, slot, params)
        r, engine, memory, stats = seq.request, self._engine, self._memory, self._stats
        P, key, done = len(r.prompt_tokens), prompt_key(r), seq.response_tokens
        base = memory.prefixes.get(key)
        if base is None and done:  # the group's prompt, once
            padded, _ = engine.pad_tokens(r.prompt_tokens)
            base, _ = engine.prefill(params=params, padded_tokens=padded,
                                     true_length=P, rng=r.key_data())
            memory.prefixes[key] = base
            stats.prefills += 1
            stats.prefill_tokens += P
        # Without a prefix the whole sequence runs; with it, only the response so far.
        padded, t = engine.pad_tokens((list(r.prompt_tokens) if base is None else []) + done)
        prefix, result = engine.prefill(params=params, padded_tokens=padded, true_length=t,
                                        rng=r.key_data(), num_generated=len(done),
                                        existing_prefix=base, max_new_tokens=r.max_new_tokens)
        self._calls.insert(prefix, slot, length=seq.length,
                           shared_pages=memory.pages.get(key, ()))
        stats.reprefill_tokens += len(done)
        if base is not None:
            stats.prefills_shared += 1
        else:
            stats.prefills += 1
            stats.prefill_tokens += P
        memory.remember(key, prefix if base is None else base, slot, P)
        return result

    def _continue_episode(self, seq: InFlight, slot: int, params: EngineParams
                          ) -> ResultTokens:
        r, engine, done = seq.request, self._engine, seq.response_tokens
        padded, t = engine.pad_tokens(done[len(done) - seq.unwritten:])
        prefix, result = engine.prefill(params=params, existing_prefix=seq.kept,
                                        padded_tokens=padded, true_length=t,
                                        rng=r.key_data(), num_generated=len(done),
                                        max_new_tokens=r.max_new_tokens)
        seq.kept, seq.unwritten = None, 0
        self._stats.observation_tokens += t - 1
        self._calls.insert(prefix, slot, length=seq.length)
        return result

    def take_continuations(self, waiting: collections.deque[InFlight], room: int
                           ) -> list[InFlight]:
        """Takes from the head of `waiting` the episodes whose observations are in
        (their KV kept), of the head's version, up to `room` and as far as the pool's
        pages go: those `continue_episodes` prefills together."""
        head, pages = waiting[0], 0
        out: list[InFlight] = []
        while (waiting and len(out) < room and waiting[0].kept is not None
               and waiting[0].version == head.version
               and self._memory.room_for(waiting[0], also=pages)):
            pages += self._memory.pages_needed(waiting[0])
            out.append(waiting.popleft())
        return out

    def continue_episodes(self, seqs: list[InFlight], slots: list[int], params: EngineParams
                          ) -> list[ResultTokens]:
        """Episodes' observations on their kept KV into `slots`, one prefill call for
        those whose kept KV and new tokens share their shapes; returns each one's
        ResultTokens."""
        engine = self._engine
        rows: dict[tuple, list] = {}
        for i, seq in enumerate(seqs):
            done = seq.response_tokens
            padded, t = engine.pad_tokens(done[len(done) - seq.unwritten:])
            assert seq.kept is not None  # take_continuations takes kept episodes only
            rows.setdefault((seq.kept.cache.length, padded.shape[0]), []).append((i, padded, t))
        results: list = [None] * len(seqs)
        for group in rows.values():
            if len(group) == 1:
                i = group[0][0]
                results[i] = self._continue_episode(seqs[i], slots[i], params)
                continue
            mine = [seqs[i] for i, _, _ in group]
            outs = engine.prefill_continuations(
                params=params, prefixes=[q.kept for q in mine],
                padded_tokens=[p for _, p, _ in group], true_lengths=[t for *_, t in group],
                rngs=[q.request.key_data() for q in mine],
                num_generated=[len(q.response_tokens) for q in mine],
                max_new_tokens=[q.request.max_new_tokens for q in mine])
            self._stats.observation_batches += 1
            self._stats.observations_batched += len(group)
            for (i, _, t), seq, (prefix, result) in zip(group, mine, outs):
                seq.kept, seq.unwritten = None, 0
                self._stats.observation_tokens += t - 1
                self._calls.insert(prefix, slots[i], length=seq.length)
                results[i] = result
        return results
