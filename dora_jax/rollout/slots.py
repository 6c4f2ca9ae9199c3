"""The host side of a decode slice's S slots: which request holds each slot, and
the tokens and log-probs read back for it, by response index, until they are
flushed into the request (so a generate call's results are written with one
vectorised numpy assignment, not per token). An MoE policy's experts wait the same
way, in a window of the last `ROUTING_WINDOW` tokens per slot, and reach the
request's record when its slot is freed or re-placed, or the window is full: one
copy per slot every few calls, not one per slot per call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dora_jax.rollout import routing

if TYPE_CHECKING:
    from dora_jax.rollout.state import ResultTokens
    from dora_jax.rollout.trajectory import InFlight

# Response tokens of routing a slot holds before its holder's record is written.
# [S, W, MoE layers, k] ids: 12.6 MB at 256 slots, 48 layers and top-8.
ROUTING_WINDOW = 128


class SlotTable:
    """S slots of at most D response tokens each.

    Per slot: `seqs` (the holder, or None; the holder's `.slot` is kept in step),
    `owned`, `tokens_SD` / `logprobs_SD` and `count_S` (response tokens known),
    `placed_S` (positions written when placed), `prompt_len_S`, and `order_S`
    (when its request started here: the latest is the first preempted); for MoE
    policies a window of `routing_window` tokens' experts (at least one call's steps;
    `_routing_SW`, from response index `_routing_base_S`, `_routing_len_S` rows).
    """

    def __init__(self, num_slots: int, max_decode_len: int,
                 routing_window: int = ROUTING_WINDOW) -> None:
        S, D = num_slots, max_decode_len
        self.seqs: list = [None] * S
        self.owned = np.zeros(S, bool)
        self.tokens_SD = np.zeros((S, D), np.int32)
        self.logprobs_SD = np.zeros((S, D), np.float32)
        self.count_S = np.zeros(S, np.int64)
        self.placed_S = np.zeros(S, np.int64)
        self.prompt_len_S = np.zeros(S, np.int64)
        self.order_S = np.zeros(S, np.int64)
        self._starts = 0
        self.routing_window = routing_window
        self._routing_SW: np.ndarray | None = None  # allocated at the first record
        self._routing_base_S = np.zeros(S, np.int64)
        self._routing_len_S = np.zeros(S, np.int64)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def full(self) -> bool:
        return bool(self.owned.all())

    @property
    def busy(self) -> bool:
        return bool(self.owned.any())

    def lowest_free(self) -> int:
        return int(np.argmin(self.owned))

    def owner(self, slot: int) -> InFlight | None:
        return self.seqs[slot]

    def holders(self) -> list:
        """The requests in slots, in slot order."""
        return [seq for seq in self.seqs if seq is not None]

    def latest_started(self) -> int:
        """The owned slot whose request started last."""
        owned = np.flatnonzero(self.owned)
        return int(owned[np.argmax(self.order_S[owned])])

    def place(self, seq: InFlight, slot: int, prompt_len: int, written: int) -> None:
        """`seq` (with its tokens and log-probs so far) now holds `slot`, which has
        `written` positions of KV."""
        self._flush_routing(slot)  # a holder re-placed (re-prefilled) keeps what it had
        m = len(seq.response_tokens)
        self.tokens_SD[slot, :m] = seq.response_tokens
        self.logprobs_SD[slot, :m] = seq.behaviour_logprobs
        self.count_S[slot], self.placed_S[slot] = m, written
        self.prompt_len_S[slot] = prompt_len
        self._starts += 1
        self.order_S[slot] = self._starts
        self.seqs[slot], self.owned[slot], seq.slot = seq, True, slot

    def free(self, slot: int) -> None:
        self._flush_routing(slot)
        seq = self.seqs[slot]
        self.seqs[slot], self.owned[slot] = None, False
        if seq is not None:
            seq.slot = None

    def clear(self) -> None:
        for slot in np.flatnonzero(self.owned):
            self.free(int(slot))
        for buf in (self.count_S, self.placed_S, self.prompt_len_S, self.order_S):
            buf[:] = 0

    def record(self, slots: np.ndarray | int, steps: np.ndarray | int,
               tokens: np.ndarray | int, logprobs: np.ndarray | float) -> None:
        """Response token `steps[i]` of `slots[i]` (arrays, or one of each)."""
        self.tokens_SD[slots, steps] = tokens
        self.logprobs_SD[slots, steps] = logprobs
        np.maximum.at(self.count_S, np.atleast_1d(slots), np.atleast_1d(steps) + 1)

    def record_call(self, host: ResultTokens) -> tuple:
        """One generate call's results (ResultTokens as numpy, [n, S]) for the slots
        held when it ran: (decode steps run, slot-steps that produced a token, the
        slots that finished)."""
        ran_NS = host.valid
        steps_run = int(ran_NS.any(axis=1).sum())  # the call may end early
        # Rows of slots that finished earlier (or were never filled) are not valid; a
        # slot refilled since the call was dispatched was inactive in it.
        valid_NS = ran_NS & self.owned
        slots, n_idx = np.nonzero(valid_NS.T)  # slot by slot, each slot's steps in order
        steps = host.steps[n_idx, slots]
        self.record(slots, steps, host.tokens[n_idx, slots], host.logprobs[n_idx, slots])
        if host.routing is not None and len(slots):
            # A row's experts are its input token's: the one before the token it sampled.
            self._record_routing(host.routing, n_idx, slots, steps - 1)
        return steps_run, len(slots), np.flatnonzero((host.finished & valid_NS).any(axis=0))

    def _record_routing(self, routing_NS: np.ndarray, n_idx: np.ndarray, slots: np.ndarray,
                        indices: np.ndarray) -> None:
        """Into the slots' windows: the experts of step n_idx[i] of slots[i], response
        token indices[i] (slot by slot, steps in order). A window that cannot take a
        slot's run is flushed into its holder's record first."""
        rows = routing_NS[n_idx, slots]
        if self._routing_SW is None:
            self._routing_SW = routing.unrecorded(
                (len(self.seqs), self.routing_window, *rows.shape[1:]), rows.dtype)
        new_slot = np.diff(slots, prepend=-1) != 0
        assert (new_slot[1:] | (np.diff(indices) == 1)).all(), "a slot's steps skip a token"
        starts = np.flatnonzero(new_slot)
        run_slots, firsts = slots[starts], indices[starts]
        lasts = indices[np.r_[starts[1:], len(slots)] - 1]
        base, used = self._routing_base_S[run_slots], self._routing_len_S[run_slots]
        moved = (used > 0) & ((firsts < base) | (lasts >= base + self.routing_window))
        for slot in run_slots[moved].tolist():
            self._flush_routing(slot)
        fresh = self._routing_len_S[run_slots] == 0
        self._routing_base_S[run_slots[fresh]] = firsts[fresh]
        self._routing_SW[slots, indices - self._routing_base_S[slots]] = rows
        self._routing_len_S[run_slots] = np.maximum(self._routing_len_S[run_slots],
                                                    lasts - self._routing_base_S[run_slots] + 1)

    def _flush_routing(self, slot: int) -> None:
        """The slot's routing window into its holder's record, then emptied."""
        n = int(self._routing_len_S[slot])
        if not n:
            return
        assert self._routing_SW is not None  # rows were written
        seq, window = self.seqs[slot], self._routing_SW[slot]
        seq.routing = routing.put(seq.routing, int(self._routing_base_S[slot]), window[:n])
        window[:n] = np.iinfo(window.dtype).max
        self._routing_len_S[slot] = 0

    def new_tokens(self, slot: int, known: int) -> tuple:
        """(tokens, log-probs) of `slot` from response index `known` on."""
        n = int(self.count_S[slot])
        return (self.tokens_SD[slot, known:n].tolist(),
                self.logprobs_SD[slot, known:n].tolist())

    def written(self) -> tuple:
        """(owned slots, KV positions written in each): prompt + all but the last
        sampled token, or what was written when placed if no result is read yet."""
        owned = np.flatnonzero(self.owned)
        return owned, np.maximum(self.prompt_len_S[owned] + self.count_S[owned] - 1,
                                 self.placed_S[owned])
