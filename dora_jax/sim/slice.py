"""A simulated decode slice's requests (cluster.py drives them).

The decoding requests sit in fixed slots of numpy arrays (tokens produced and left),
so a chunk of decode steps advances them all at once; the requests waiting for KV
memory, the prompts already prefilled and the commands held until the chunk in
flight ends are kept beside them.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np

from dora_jax import versions


class Request:
    """One sample being generated: its length, its progress, the versions it ran
    under and the slices it ran on."""

    __slots__ = ("gid", "k", "length", "produced", "segments", "slices", "reprefill",
                 "ready_at")

    def __init__(self, gid, k, length, version, slice_id):
        self.gid, self.k, self.length, self.produced = gid, k, length, 0
        self.segments = [(version, 0)]  # (version, tokens produced when it began)
        self.slices = [slice_id]
        self.reprefill = 0  # tokens so far to prefill again before decoding on
        self.ready_at = 0.0  # a migrated request decodes once its KV has arrived

    def runs(self) -> list:
        """Per-token versions, run-length encoded."""
        ends = [p for _, p in self.segments[1:]] + [self.length]
        return versions.encode((v, e - p) for (v, p), e in zip(self.segments, ends))


class Slice:
    """A slice's requests: the decoding ones in fixed slots of numpy arrays (tokens
    produced and left), so a chunk advances them all at once."""

    def __init__(self, i, slots):
        self.i, self.version = i, 0
        self.loading: Optional[int] = None
        self.reqs: list = [None] * slots
        self.active = np.zeros(slots, bool)
        self.produced = np.zeros(slots, np.int64)
        self.left = np.zeros(slots, np.int64)
        self.free = list(range(slots - 1, -1, -1))
        self.where: dict = {}  # request key -> slot
        self.groups: Counter = Counter()  # running requests per group (prompt KV shared)
        self.waiting: list = []
        self.prompts: set = set()  # groups whose prompt this slice has prefilled
        self.fresh: list = []  # running requests owed a re-prefill or a KV arrival
        self.chunk: Optional[tuple] = None  # (start, end, steps) of the chunk in flight
        self.exports: list = []  # (request key, destination) once the chunk ends
        self.pending: list = []  # load / reload commands once the chunk ends
        # Slot-time accounting (slots.SlotTime.book): booked up to `booked_to` by
        # `acct`, (reason of the free slots, how many of them hold a request waiting
        # for the chunk's end, the chunk's `rates` or None); `rates` of the chunk in
        # flight: (end of its prefill part, busy slots, running slots); `kv_blocked`:
        # requests were left waiting for KV memory when it began.
        self.booked_to, self.acct, self.rates, self.kv_blocked = 0.0, (0, 0, None), None, False

    @property
    def num_running(self) -> int:
        return len(self.where)

    def add(self, r: Request):
        """Gives `r` a free slot."""
        j = self.free.pop()
        self.reqs[j], self.active[j] = r, True
        self.produced[j], self.left[j] = r.produced, r.length - r.produced
        self.where[(r.gid, r.k)] = j
        self.groups[r.gid] += 1
        if r.reprefill or r.ready_at:
            self.fresh.append(r)

    def remove(self, key) -> Request:
        """Takes the request `key` out of its slot, its progress saved on it."""
        j = self.where.pop(key)
        r = self.reqs[j]
        r.produced = int(self.produced[j])
        self.reqs[j], self.active[j], self.left[j] = None, False, 0
        self.free.append(j)
        self.groups[r.gid] -= 1
        if not self.groups[r.gid]:
            del self.groups[r.gid]
        return r

    def newest(self):
        """The key of the request that took a slot last (preempted first)."""
        return next(reversed(self.where))
