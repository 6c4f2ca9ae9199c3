"""The device side of a slice: its decode state, and the calls dispatched but not read.

Every program that changes the decode state donates it, so the state has one owner:
`DecodeCalls._run` runs such a program and stores its result, and the slice's other
parts insert and generate through `DecodeCalls`, never holding a state of their own.

With lookahead a generate call is read only after the next one is dispatched, so the
device never waits for the host; the slice's host view then lags one call behind,
and `sync` reads everything outstanding where it needs the exact state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

from dora_jax.rollout.engine import Engine
from dora_jax.rollout.slots import SlotTable
from dora_jax.rollout.state import DecodeState, EngineParams, Prefix, ResultTokens
from dora_jax.rollout.trajectory import InFlight, RolloutError, SliceStats

T = TypeVar("T")


class DecodeCalls:
    """Prefill results and generate calls in flight, read into the slot table; a slot
    that finished is handed to `on_finished`."""

    # Assigned by `_run` alone: a state passed to a donating program is deleted, so
    # a second place holding or storing one could hand a deleted buffer to the next.
    _state: Any = None

    def __init__(self, slice_id: int, engine: Engine, slots: SlotTable, stats: SliceStats,
                 on_finished: Callable[[InFlight], None], *, lookahead: bool) -> None:
        self.slice_id, self.engine, self.slots, self.stats = slice_id, engine, slots, stats
        self.on_finished, self.lookahead = on_finished, lookahead
        self.reset()

    def reset(self) -> None:
        """A fresh decode state; whatever was in flight is dropped."""
        self._run(lambda _: (self.engine.init_decode_state(), None))
        pages = self.engine.pages
        self._pool_epoch = None if pages is None else pages.epoch
        # (seq, prefill ResultTokens on device, the seq's row in it), not yet read
        self._prefills: list = []
        self._inflight = None  # (prefills, generate ResultTokens, steps), not yet read

    @property
    def state(self) -> DecodeState:
        """The decode state, to read (e.g. `engine.extract`), not to pass to a program
        that donates it: `insert`, `bulk_insert` and `generate` do that."""
        return self._state

    def insert(self, prefix: Prefix, slot: int, **kwargs: Any) -> None:
        """`engine.insert` of `prefix` into `slot` (kwargs: length, shared_pages)."""
        self._run(lambda state: (self.engine.insert(prefix, state, slot, **kwargs), None))

    def bulk_insert(self, prefix: Prefix, slots: list[int], **kwargs: Any) -> None:
        """`engine.bulk_insert` of `prefix`'s samples into `slots` (kwargs: length)."""
        self._run(lambda state: (self.engine.bulk_insert(prefix, state, slots, **kwargs),
                                 None))

    def _run(self, program: Callable[[DecodeState], tuple[DecodeState, T]]) -> T:
        """Runs `program` on the decode state, which it donates, and keeps the state
        it returns: the one place the state is replaced. Returns its other output."""
        self._state, out = program(self._state)
        return out

    @property
    def outstanding(self) -> bool:
        return bool(self._prefills) or self._inflight is not None

    @property
    def generate_in_flight(self) -> bool:
        return self._inflight is not None

    def check_pool(self) -> None:
        pages = self.engine.pages
        if pages is not None and pages.epoch != self._pool_epoch:
            raise RolloutError(f"slice {self.slice_id}: its engine's KV page pool was reset "
                               f"by another decode state; give each slice its own Engine")

    def prefilled(self, seq: InFlight, result: ResultTokens, row: int = 0) -> None:
        """`seq`'s prefill was dispatched (its first token in `row` of `result`); the
        token is read with the next call."""
        self._prefills.append((seq, result, row))

    def generate(self, params: EngineParams | None, n: int) -> None:
        """Dispatches a call of `n` steps (none if 0: `params` may be None) and reads
        the previous call, or this one without lookahead."""
        result = None
        if n:
            assert params is not None  # a call of n > 0 steps runs under params
            result = self._run(lambda state: self.engine.generate_steps(params, state, n))
            if self.engine.pages is not None:
                self.stats.peak_pages = max(self.stats.peak_pages, self.engine.pages.num_used)
            self.stats.generate_calls += 1
        record = (self._prefills, result, n) if self._prefills or result is not None else None
        self._prefills = []
        if self.lookahead:
            record, self._inflight = self._inflight, record
        if record is not None:
            self._read(*record)

    def sync(self) -> None:
        """Reads everything dispatched: afterwards the host view equals the device's."""
        if self._inflight is not None:
            record, self._inflight = self._inflight, None
            self._read(*record)
        prefills, self._prefills = self._prefills, []
        self._read(prefills, None)

    def _read(self, prefills: list[tuple[InFlight, ResultTokens, int]],
              result: ResultTokens | None, n: int = 0) -> None:
        # Prefill results first: they precede any generate result of the same slot.
        if prefills:
            # A group's samples share one prefill's result: each is read once.
            results = {id(r): r for _, r, _ in prefills}
            on_host = dict(zip(results, jax.device_get(list(results.values()))))
            for seq, r, row in prefills:
                h = on_host[id(r)]
                assert seq.slot is not None  # placed when its prefill was dispatched
                self.slots.record(seq.slot, int(h.steps[row]), h.tokens[row], h.logprobs[row])
                if h.finished[row]:
                    self.on_finished(seq)
        if result is None:
            return
        host = result.convert_to_numpy()  # the one host sync per call
        steps_run, busy, finished = self.slots.record_call(host)
        self.stats.generate_steps += steps_run
        self.stats.total_slot_steps += len(self.slots) * steps_run
        self.stats.busy_slot_steps += busy
        for s in finished:
            owner = self.slots.owner(s)
            assert owner is not None  # a finished row is a held slot's
            self.on_finished(owner)
        if self.engine.pages is not None:
            # What the call still in flight (if any) may write comes on top.
            ahead = self._inflight[2] if self._inflight is not None else 0
            owned, written = self.slots.written()
            self.engine.pages.tighten(owned, written + ahead)
