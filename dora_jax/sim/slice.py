"""A simulated decode slice's requests (cluster.py drives them).

The decoding requests sit in fixed slots of numpy arrays (tokens produced and left),
so a chunk of decode steps advances them all at once; the requests waiting for KV
memory, the prompts already prefilled and the commands held until the chunk in
flight ends are kept beside them.

A multi-turn episode (episodes.py) whose model turn ended is `parked` in its slot
while its environment answers: it keeps the slot and its KV but does not decode.
When the observation arrives it waits for the chunk in flight to end (`observed`),
then its observation's tokens join its KV (a prefill of those tokens, or of the
whole sequence if the slice reloaded weights meanwhile) and its next turn decodes.
`produced` counts the response's positions, observations included.

A slice that releases slots (`episodes_per_slice`, release.py) holds such an episode
`away` from the slots instead, its KV kept (`away_kv` counts the positions kept on
device), and seats it again from `ready` once its observation arrived: before any
request still waiting for a slot.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from dora_jax.base import versions
from dora_jax.sim.episodes import Episode, single_turn


class Request:
    """One sample being generated: its length, its progress, the versions it ran
    under and the slices it ran on; for an episode, its turns and where it is in
    them."""

    __slots__ = ("gid", "k", "length", "produced", "segments", "slices", "reprefill",
                 "ready_at", "episode", "turn", "env_until", "observed", "kv_on_device",
                 "kv_copy")

    def __init__(self, gid, k, length, version, slice_id, episode: Episode | None = None):
        self.episode = episode or single_turn(length)
        self.gid, self.k, self.length, self.produced = gid, k, self.episode.response_len, 0
        self.segments = [(version, 0)]  # (version, tokens produced when it began)
        self.slices = [slice_id]
        self.reprefill = 0  # tokens so far to prefill again before decoding on
        self.ready_at = 0.0  # a migrated request decodes once its KV has arrived
        self.turn = 0  # the model turn it decodes, or the next one while its env runs
        self.env_until: float | None = None  # when the observation it waits for arrives
        self.observed = False  # that observation arrived, its tokens not yet in the KV
        # Away from a slot (release.py): its kept KV counts in the slice's `away_kv`;
        # `kv_copy` numbers its host copies (an event of an older one is void).
        self.kv_on_device, self.kv_copy = False, 0

    @property
    def last_turn(self) -> bool:
        return self.turn == len(self.episode.model) - 1

    def turn_left(self) -> int:
        """Tokens left to decode in its current model turn."""
        ep, t = self.episode, self.turn
        return sum(ep.model[:t + 1]) + sum(ep.observations[:t]) - self.produced

    def take_observation(self) -> None:
        """The arrived observation joins the sequence: its tokens are prefilled on
        the kept KV, or the whole sequence is if the KV must be recomputed (a reload
        while it waited set `reprefill`, or it resumes from nothing)."""
        tokens = self.episode.observations[self.turn - 1]
        self.produced += tokens
        self.reprefill = self.produced if self.reprefill else tokens
        self.observed = False

    def runs(self) -> list:
        """Per-token versions, run-length encoded."""
        ends = [p for _, p in self.segments[1:]] + [self.length]
        return versions.encode((v, e - p) for (v, p), e in zip(self.segments, ends))


class Slice:
    """A slice's requests: the decoding ones in fixed slots of numpy arrays (tokens
    produced and left), so a chunk advances them all at once."""

    def __init__(self, i, slots, release: bool = False):
        self.i, self.release = i, release
        self.version: int | None = 0
        self.loading: int | None = None
        # Several versions per slice: those resident and those being added (the
        # slice decodes on while an AddVersion transfers); `version` is the newest.
        self.held: set = {0}
        self.adding: set = set()
        self.reqs: list = [None] * slots
        self.active = np.zeros(slots, bool)
        self.produced = np.zeros(slots, np.int64)
        self.left = np.zeros(slots, np.int64)
        self.parked = np.zeros(slots, bool)  # episodes waiting for their environment
        self.observed: list = []  # parked requests whose observation arrived
        # Release: episodes at their environment out of the slots (key -> request), the
        # device positions of their kept KV, those whose observation arrived (and KV
        # is on device) in arrival order, and when the host link is free each way.
        self.away: dict = {}
        self.away_kv = 0
        self.ready: list = []
        self.host_out_free = self.host_in_free = 0.0
        self.free = list(range(slots - 1, -1, -1))
        self.where: dict = {}  # request key -> slot
        self.groups: Counter = Counter()  # running requests per group (prompt KV shared)
        self.waiting: list = []
        self.prompts: set = set()  # groups whose prompt this slice has prefilled
        self.fresh: list = []  # running requests owed a re-prefill or a KV arrival
        self.chunk: tuple | None = None  # (start, end, steps) of the chunk in flight
        self.exports: list = []  # (request key, destination) once the chunk ends
        self.pending: list = []  # load / reload commands once the chunk ends
        # Slot-time accounting (slots.SlotTime.book): booked up to `booked_to` by
        # `acct`, (reason of the free slots, how many of them hold a request waiting
        # for the chunk's end, the chunk's `rates` or None, slots waiting for an
        # environment); `rates` of the chunk in
        # flight: (end of its prefill part, busy slots, running slots); `kv_blocked`:
        # requests were left waiting for KV memory when it began.
        self.booked_to, self.kv_blocked = 0.0, False
        self.acct: tuple = (0, 0, None, 0)
        self.rates: tuple | None = None

    @property
    def num_running(self) -> int:
        """Requests holding a slot (decoding or waiting for their environment)."""
        return len(self.where)

    @property
    def num_held(self) -> int:
        """Requests the slice holds: in slots, or away from them (release)."""
        return len(self.where) + len(self.away) + len(self.ready)

    @property
    def num_env_waiting(self) -> int:
        """Slots held by episodes whose environment has not answered yet."""
        return int(self.parked.sum()) - len(self.observed)

    def add(self, r: Request):
        """Gives `r` a free slot (parked if its environment has not answered); with
        release, an episode between its turns is held away from the slots instead."""
        self.groups[r.gid] += 1  # its group's prompt KV is kept while it is here
        if self.release and (r.env_until is not None or r.observed):
            self.hold(r)
            return
        j = self.free.pop()
        self.reqs[j] = r
        self.where[(r.gid, r.k)] = j
        if r.env_until is not None:
            self.produced[j], self.parked[j] = r.produced, True
            return
        if r.observed:
            r.take_observation()
        self.active[j] = True
        self.produced[j], self.left[j] = r.produced, r.turn_left()
        if r.reprefill or r.ready_at:
            self.fresh.append(r)

    def hold(self, r: Request):
        """Keeps episode `r` away from the slots, its KV on device: at its environment,
        or (observation arrived) ready for a slot."""
        r.kv_on_device = True
        self.away_kv += r.produced
        if r.observed:
            self.ready.append(r)
        else:
            self.away[(r.gid, r.k)] = r

    def release_slot(self, j: int, until: float) -> Request:
        """The request in slot j ended a model turn: it leaves the slot, its KV kept on
        device, and waits for its environment until `until`."""
        r = self.reqs[j]
        r.produced, r.turn, r.env_until = int(self.produced[j]), r.turn + 1, until
        self._free_slot(j)
        self.groups[r.gid] += 1  # still held here (_free_slot let it go)
        self.hold(r)
        return r

    def kv_off_device(self, r: Request):
        """Its kept KV left device memory (copied to host)."""
        r.kv_on_device = False
        self.away_kv -= r.produced

    def kv_on(self, r: Request):
        """Its kept KV takes device memory again (copied back, or being)."""
        r.kv_on_device = True
        self.away_kv += r.produced

    def seat_ready(self) -> int:
        """Seats the ready episodes in free slots, oldest observation first; returns
        the observation tokens prefilled on their kept KV (one call for them all: they
        enter together). One whose KV must be recomputed (a reload while it waited)
        or is still arriving (migrated) goes to `fresh` as a re-prefill."""
        tokens = 0
        while self.ready and self.free:
            r = self.ready.pop(0)
            if r.kv_on_device:
                r.kv_on_device = False
                self.away_kv -= r.produced
            kept = not r.reprefill
            j = self.free.pop()
            self.reqs[j] = r
            self.where[(r.gid, r.k)] = j
            r.take_observation()
            if kept:
                tokens += r.reprefill
                r.reprefill = 0
            self.active[j] = True
            self.produced[j], self.left[j] = r.produced, r.turn_left()
            if r.reprefill or r.ready_at:
                self.fresh.append(r)
        return tokens

    def park(self, j: int, until: float):
        """The request in slot j ended a model turn: it waits for its environment
        until `until`, keeping the slot and its KV."""
        r = self.reqs[j]
        r.produced, r.turn, r.env_until = int(self.produced[j]), r.turn + 1, until
        self.active[j], self.parked[j] = False, True

    def unpark_observed(self):
        """Requests whose observation arrived decode their next turn from the next
        chunk on, after prefilling it (`fresh`)."""
        for r in self.observed:
            j = self.where[(r.gid, r.k)]
            r.take_observation()
            self.parked[j], self.active[j] = False, True
            self.produced[j], self.left[j] = r.produced, r.turn_left()
            self.fresh.append(r)
        self.observed = []

    def holds(self, key) -> bool:
        return key in self.where or key in self.away or any(
            (r.gid, r.k) == key for r in self.ready)

    def remove(self, key) -> Request:
        """Takes the request `key` out of the slice (its slot, or away from the slots),
        its progress saved on it; a host copy of its KV in flight is void."""
        if key in self.where:
            return self._free_slot(self.where[key])
        r = self.away.pop(key, None)
        if r is None:
            r = next(x for x in self.ready if (x.gid, x.k) == key)
            self.ready.remove(r)
        if r.kv_on_device:
            self.kv_off_device(r)
        r.kv_copy += 1
        self._let_go(r)
        return r

    def _free_slot(self, j: int) -> Request:
        r = self.reqs[j]
        del self.where[(r.gid, r.k)]
        r.produced = int(self.produced[j])
        if r in self.observed:
            self.observed.remove(r)
        self.reqs[j], self.active[j], self.parked[j], self.left[j] = None, False, False, 0
        self.free.append(j)
        self._let_go(r)
        return r

    def _let_go(self, r: Request):
        self.groups[r.gid] -= 1
        if not self.groups[r.gid]:
            del self.groups[r.gid]

    def newest(self):
        """The key of the decoding request that took a slot last (preempted first)."""
        return next(k for k in reversed(self.where) if self.active[self.where[k]])
