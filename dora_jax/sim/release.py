"""A simulated multi-turn episode between its turns: parked in its slot, or released.

With one sample per slot (`episodes_per_slice` 0) an episode whose model turn ended
is parked in its slot while its environment answers (slice.py). With more samples
than slots (`rollout.max_episodes_per_slice`, SchedulerConfig.episodes_per_slice)
it gives its slot up instead, as the runtime's slices do: the slice holds it away
from the slots with its KV kept, a request waiting for a slot takes the slot at the
next chunk's start, and once the observation arrived the episode waits in `ready`
for a free slot, before any request not yet started. The episodes seated at one
chunk's start prefill their observations on their kept KV in one call
(`Slice.seat_ready`).

Where the kept KV waits (`rollout.episode_kv`):

- "device": it stays in device memory and counts against the slice's `kv_tokens`
  (the requests waiting for KV memory wait for it too);
- "host": it is copied to host memory at the turn's end and back once the
  observation arrived, each copy `CostModel.host_seconds` of its response positions
  (the group's prompt KV stays on device while the slice holds any of its samples),
  one copy at a time each way on the slice's host link. Its device memory is
  counted until the copy out ends and again from the copy back's start; it re-enters
  only when the copy back ended. An observation that arrives before the copy out
  ended finds the KV still on device and cancels the copy.

A reload while it waits (partial rollout) makes its next prefill the whole
sequence, which needs no copy back. A migration moves its KV (migrate_seconds, from
device or host alike) to the destination's device memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora_jax.sim.slice import Request, Slice

if TYPE_CHECKING:  # pragma: no cover
    from dora_jax.sim.cost import CostModel


class BetweenTurns:
    """The between-turns half of `cluster.ClusterSim` (mixed into it; it reads the
    slices, the clock and the cost model, and posts events with `_at`)."""

    if TYPE_CHECKING:  # the ClusterSim state it reads and writes (cluster.py sets it)
        slices: list[Slice]
        now: float
        cost: CostModel
        host_kv: bool
        stats: dict

        def _at(self, t, kind, *data) -> None: ...
        def _start_chunk(self, sl: Slice) -> None: ...

    def _end_turn(self, sl: Slice, j: int) -> None:
        """The request in slot j ended a model turn that is not its last: it waits for
        its environment, parked in its slot or released from it."""
        r = sl.reqs[j]
        until = self.now + r.episode.latencies[r.turn]
        if not sl.release:
            sl.park(j, until)
        else:
            sl.release_slot(j, until)
            if self.host_kv:
                r.kv_copy += 1
                start = max(self.now, sl.host_out_free)
                sl.host_out_free = start + self.cost.host_seconds(r.produced)
                self.stats["host_copies"] += 1
                self._at(sl.host_out_free, "offloaded", sl.i, r, r.kv_copy)
        self._at(until, "observed", sl.i, r)

    def _on_observed(self, i, r: Request):
        """An episode's observation arrived. Parked in a slot, it decodes its next
        turn from the slice's next chunk; released, it is ready for a slot once its KV
        is on device; still on its way to a slice (migrated), it takes the
        observation when it gets there."""
        r.env_until, r.observed = None, True
        sl = self.slices[r.slices[-1]]
        key = (r.gid, r.k)
        if key in sl.where:
            sl.observed.append(r)
        elif sl.away.get(key) is r:
            if r.kv_on_device or r.reprefill:  # its KV is there, or is recomputed
                r.kv_copy += 1  # a copy out still in flight is cancelled
                del sl.away[key]
                sl.ready.append(r)
            else:
                self._fetch(sl, r)
        if sl.i != i:  # the run loop starts slice i's chunk
            self._start_chunk(sl)

    def _fetch(self, sl: Slice, r: Request):
        """Copies the episode's KV back from host memory; it is ready once there."""
        sl.kv_on(r)
        r.kv_copy += 1
        start = max(self.now, sl.host_in_free)
        sl.host_in_free = start + self.cost.host_seconds(r.produced)
        self.stats["host_copies"] += 1
        self._at(sl.host_in_free, "fetched", sl.i, r, r.kv_copy)

    def _on_offloaded(self, i, r: Request, copy: int):
        """The copy out ended: the episode's KV leaves device memory."""
        sl = self.slices[i]
        if r.kv_copy == copy and sl.away.get((r.gid, r.k)) is r and r.kv_on_device:
            sl.kv_off_device(r)

    def _on_fetched(self, i, r: Request, copy: int):
        """The copy back ended: the episode is ready for a slot."""
        sl = self.slices[i]
        key = (r.gid, r.k)
        if r.kv_copy == copy and sl.away.get(key) is r:
            del sl.away[key]
            sl.ready.append(r)

    @staticmethod
    def _reload_away(sl: Slice, version: int) -> None:
        """A reload (partial rollout) while episodes are away from the slots: each
        continues under `version` and re-prefills its whole sequence when it is
        seated again (a copy of its old KV back from host is no longer needed)."""
        for r in [*sl.away.values(), *sl.ready]:
            r.segments.append((version, r.produced))
            r.reprefill = r.produced
