"""The simulator's slot-time accounting: every slot-second of a run booked to one state.

States (`SLOT_REASONS`) are exhaustive and exclusive, so over a run they sum to
slots x time. A running slot is `busy` decoding, `chunk_end` (its request finished
mid-chunk; it idles to the chunk's end) or in `prefill` (the chunk's prefill,
re-prefill or KV-arrival part). A free slot, or every slot of a slice between chunks,
is idle because the slice is `loading` weights (has a load waiting for its chunk, or,
in partial_rollout_rounds, for the version in training to be published), the trainer
trains on the same devices (`colocated_training`), requests wait on the slice for KV
memory or were preempted (`kv_full`), only other versions have pending work
(`version_mismatch`: a mode that keeps C1 cannot run it here; with several versions
per slice, none of the slice's resident versions has pending work, and no pending
version is being added to it), work the slice could
run is pending but the scheduler holds the slot (`held`: reserved for a request
migrating in, or the slice drained to switch version), or nothing is pending at all:
the batch's tail, with the mode refusing to admit though fewer than RBS groups are out
(`admission_closed`: the batch rule or the staleness bound) or RBS groups admitted
and unconsumed (`rbs_full`). A slot held by a multi-turn episode waiting for its
environment is `env` (it keeps its slot, not decoding); once the observation arrived
it waits for the chunk in flight as a `chunk_end` slot (or for what holds a slice
between chunks, as its free slots). A slice that releases slots (release.py) has
no `env` slot: its episodes wait for their environment away from the slots; a free
slot that an episode ready for it (or a request waiting for a slot) takes at the
chunk's end is `chunk_end` until then, and one idle while the slice holds all the
samples it may (`episodes_per_slice`) and work is pending is `held`.
"""

from __future__ import annotations

from dora_jax.sim.slice import Slice

SLOT_REASONS = ("busy", "chunk_end", "prefill", "loading", "colocated_training", "kv_full",
                "version_mismatch", "held", "admission_closed", "rbs_full", "env")
(BUSY, CHUNK_END, PREFILL, LOADING, COLOCATED, KV_FULL, MISMATCH, HELD, CLOSED,
 RBS_FULL, ENV) = range(len(SLOT_REASONS))


def idle_reason(sl: Slice, *, colocated_training: bool, pending_versions: set,
                rbs_full: bool, keeps_c1: bool, multi: bool = False) -> int:
    """Why the slice's free slots (all of them between chunks) idle now."""
    if colocated_training:
        return COLOCATED
    if sl.loading is not None or sl.pending:
        return LOADING
    if sl.waiting and (sl.kv_blocked or sl.chunk is None):
        return KV_FULL
    if not pending_versions:
        return RBS_FULL if rbs_full else CLOSED
    if multi:
        if sl.held & pending_versions:
            return HELD
        return LOADING if sl.adding & pending_versions else MISMATCH
    if keeps_c1 and (len(pending_versions) > 1 or sl.version not in pending_versions):
        return MISMATCH
    return HELD


class SlotTime:
    """Slot-seconds by SLOT_REASONS over the run, and the share of each step."""

    def __init__(self, slots_per_slice: int):
        self.slots = slots_per_slice
        self.seconds = [0.0] * len(SLOT_REASONS)
        self._then = [0.0] * len(SLOT_REASONS)  # at the previous step's end

    def book(self, sl: Slice, now: float, reason: int) -> None:
        """Books the slice's slot-seconds since its last booking by the state it then
        left (`sl.acct`), and takes its state now (`reason`, the chunk in flight).
        Every change of a slice's state is followed by a booking at the same time,
        so the slot-time is exact at the costs of a chunk: a chunk's prefill part,
        then its decoding at the mean number of busy slots."""
        since, slots = sl.booked_to, self.slots
        if now > since:
            T, (was, boundary, rates, env) = self.seconds, sl.acct
            T[ENV] += env * (now - since)
            if rates is None:
                T[was] += (slots - env) * (now - since)
            else:
                prefill_end, busy, batch = rates
                T[was] += (slots - batch - boundary - env) * (now - since)
                T[CHUNK_END] += boundary * (now - since)
                if since < prefill_end:
                    T[PREFILL] += batch * (min(now, prefill_end) - since)
                    since = min(now, prefill_end)
                T[BUSY] += busy * (now - since)
                T[CHUNK_END] += (batch - busy) * (now - since)
            sl.booked_to = now
        env = sl.num_env_waiting
        if sl.chunk is None:
            sl.acct = (reason, 0, None, env)
        else:  # requests given to the slice mid-chunk, or observed, wait for its end
            assert sl.rates is not None  # set with the chunk
            free = slots - sl.rates[2] - env - len(sl.observed)
            waits = ((0 if reason <= LOADING else len(sl.ready))
                     + (0 if reason <= KV_FULL else len(sl.waiting)))
            boundary = len(sl.observed) + min(waits, free)
            sl.acct = (reason, boundary, sl.rates, env)

    def since_last_step(self) -> dict:
        """Slot-seconds by state since the previous call (a step's `slot_idle`)."""
        then, self._then = self._then, list(self.seconds)
        return {k: round(a - b, 3) for k, a, b in zip(SLOT_REASONS, self.seconds, then)}
