"""Host-side bookkeeping of a decode slice's paged KV cache.

The cache is a pool of fixed-size pages (`rollout.page_size` positions each) shared
by all slots; a slot's page table maps its positions to pages, so a slot holds
memory for the positions it has, not for `cache_length`. Page 0 is the null page:
it is never handed out; unmapped table entries and the writes of idle slots point
at it, and attention counts nothing of it.

Pages are reference-counted so that the samples of a group can map the same
prompt pages (`share` / `release_pages`; a pool read in place shares none): only
pages wholly inside the prompt are shared, because decoding writes the page holding
the first response position — that page is each sample's own copy (copy-on-write,
done at insert).

`view()` gives the device what one decode call needs: the page table and a flat
list of every mapped (page, slot, first position) padded to a bucket, so that
attention reads each slot's own pages and its cost follows the real contexts; or,
for attention that reads the pool in place (`in_place`), the slot and first position
of every page, which then belongs to one slot at most: such a pool shares nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from dora_jax.base.buckets import pick_bucket


class PagesExhausted(RuntimeError):
    """More pages asked for than the pool has free."""


IN_PLACE = ("never", "full", "always")


class PageView(NamedTuple):
    """One decode call's view of the page table (numpy on the host, device arrays
    inside the jitted step)."""

    table: np.ndarray  # int32[S, pages_per_slot]: page of each slot's j-th page
    owned: np.ndarray  # bool[S]: slot has pages (others write to the null page)
    flat_pages: np.ndarray  # int32[N]: every mapped page, slot-major, then null pages
    flat_slots: np.ndarray  # int32[N]: its slot (S for padding entries)
    flat_starts: np.ndarray  # int32[N]: position of its first entry in its slot
    # In place (else empty): each page's slot (S: none) and its first entry's position.
    page_slots: np.ndarray  # int32[num_pages + 1]
    page_starts: np.ndarray  # int32[num_pages + 1]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-int(tokens) // page_size)


class PagePool:
    """Free list, reference counts and per-slot page tables of one slice's pool.

    Each mapped slot also has a bound: how many positions its KV may occupy once
    the decode calls dispatched so far have run. `advance(n)` gives every mapped
    slot pages for n more positions before a call; the caller tightens the bounds
    when it learns how far the slots really got (`tighten`).

    Args:
      num_pages: usable pages (the pool has one more: the null page 0).
      page_size: positions per page.
      slots: number of slots S.
      max_tokens: positions a slot may hold (cache_length).
      in_place: when a view names each page's slot instead of listing the mapped
        pages, for attention that reads every page where it lies
        (`paged_attention.pool_paged_attention`): "never", "always", or "full", when
        the mapped pages need the largest bucket of the flat list (more than the one
        below it). Unless "never", `share` gives nothing: a page has one slot.
    """

    def __init__(self, num_pages: int, page_size: int, slots: int, max_tokens: int,
                 in_place: str = "never") -> None:
        if in_place not in IN_PLACE:
            raise ValueError(f"in_place must be one of {IN_PLACE}, got {in_place!r}")
        self.pages_per_slot = pages_for(max_tokens, page_size)
        if num_pages < self.pages_per_slot:
            raise ValueError(f"a pool of {num_pages} pages cannot hold one full-length "
                             f"request ({self.pages_per_slot} pages)")
        self.num_pages, self.page_size = num_pages, page_size
        self.slots, self.max_tokens, self.in_place = slots, max_tokens, in_place
        self.reset()

    epoch = 0  # bumped by each reset: who holds a decode state can tell it is stale

    def reset(self) -> None:
        """Every page free, every slot empty."""
        self.epoch += 1
        self._free = list(range(self.num_pages, 0, -1))  # pop() hands out low ids first
        self._refs = np.zeros(self.num_pages + 1, np.int32)
        self.table = np.zeros((self.slots, self.pages_per_slot), np.int32)
        self.mapped = np.zeros(self.slots, np.int32)  # pages in each slot's table
        self.bound = np.zeros(self.slots, np.int64)  # positions each slot may occupy
        self._flat_buckets: tuple[int, ...] | None = None

    # ----------------------------------------------------------------- queries

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return pages_for(tokens, self.page_size)

    def missing(self, slot: int, tokens: int) -> int:
        """Pages `slot` still needs to hold `tokens` positions."""
        return max(0, min(self.pages_for(tokens), self.pages_per_slot) - int(self.mapped[slot]))

    def slot_pages(self, slot: int) -> np.ndarray:
        return self.table[slot, :self.mapped[slot]].copy()

    # ----------------------------------------------------------------- changes

    def _take(self, n: int) -> list:
        if n > len(self._free):
            raise PagesExhausted(f"{n} page(s) asked for, {len(self._free)} free of "
                                 f"{self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def _drop(self, pages: Iterable[int] | np.ndarray) -> None:
        for p in np.asarray(pages, np.int64).tolist():
            self._refs[p] -= 1
            assert self._refs[p] >= 0, f"page {p} released more often than taken"
            if self._refs[p] == 0:
                self._free.append(p)

    def assign(self, slot: int, tokens: int, shared: Iterable[int] = ()) -> np.ndarray:
        """Maps `slot` (released first, if it held pages) to hold `tokens` positions:
        its first pages are `shared` (one more reference each), the rest fresh.
        Raises PagesExhausted, changing nothing, if the pool is short. Returns the
        write list, int32[pages for tokens]: the page id where the slot's content
        must be written, 0 where it is shared."""
        shared = [int(p) for p in shared]
        if shared and self.in_place != "never":
            raise ValueError(f"a pool read in place (in_place={self.in_place!r}) shares no pages")
        n = min(self.pages_for(tokens), self.pages_per_slot)
        if len(shared) > n:
            raise ValueError(f"{len(shared)} shared pages for {tokens} positions")
        mine = self.table[slot, :self.mapped[slot]]
        freed = sum(1 for p in mine.tolist() if self._refs[p] == 1 and p not in shared)
        if n - len(shared) > len(self._free) + freed:  # refuse before changing anything
            raise PagesExhausted(f"{n - len(shared)} page(s) asked for, "
                                 f"{len(self._free) + freed} free of {self.num_pages}")
        self._refs[shared] += 1  # first, so that releasing the slot keeps them
        self.release(slot)
        fresh = self._take(n - len(shared))
        self.table[slot, :n] = shared + fresh
        self.mapped[slot] = n
        self.bound[slot] = min(tokens, self.max_tokens)
        return np.asarray([0] * len(shared) + fresh, np.int32)

    def _ahead(self, n: int) -> np.ndarray:
        return np.minimum(self.bound + n, self.max_tokens)

    def shortfall(self, n: int) -> int:
        """Pages the mapped slots lack for n more positions each."""
        want = self._ahead(n)
        return sum(self.missing(int(s), int(want[s])) for s in np.flatnonzero(self.mapped))

    def advance(self, n: int) -> None:
        """Gives every mapped slot pages for n more positions (a decode call of n
        steps); raises PagesExhausted, changing nothing, if the pool is short."""
        short = self.shortfall(n)
        if short > self.num_free:
            raise PagesExhausted(f"a decode call of {n} steps needs {short} more page(s), "
                                 f"{self.num_free} free of {self.num_pages}")
        want = self._ahead(n)
        for s in np.flatnonzero(self.mapped):
            k = self.missing(int(s), int(want[s]))
            if k:
                m = int(self.mapped[s])
                self.table[s, m:m + k] = self._take(k)
                self.mapped[s] = m + k
            self.bound[s] = want[s]

    def tighten(self, slots: np.ndarray | Sequence[int], tokens: np.ndarray | int) -> None:
        """Lowers the bounds of `slots` to `tokens` (their positions known to be
        written, plus what calls still running may add); pages stay mapped."""
        self.bound[slots] = np.minimum(self.bound[slots], tokens)

    def assign_rows(self, slots: Sequence[int], tokens: int, prefix_tokens: int,
                    shared: Iterable[int] = (),
                    share_first: bool = False) -> np.ndarray:
        """`assign` of each slot (all or none: PagesExhausted leaves none mapped), with
        `shared`, or with `share_first` the first slot's whole pages; returns where
        each writes a prefix of `prefix_tokens` positions, int32[slots, its pages]."""
        write_Nn = np.zeros((len(slots), self.pages_for(prefix_tokens)), np.int32)
        mapped, borrowed = [], ()
        try:
            for i, slot in enumerate(slots):
                assigned = self.assign(slot, tokens, shared)
                write_Nn[i, :len(assigned)] = assigned
                mapped.append(slot)
                if i == 0 and share_first:
                    shared = borrowed = self.share(slot, tokens)
        except PagesExhausted:
            for slot in mapped:
                self.release(slot)
            raise
        finally:
            if borrowed:
                self.release_pages(borrowed)
        return write_Nn

    def release(self, slot: int) -> None:
        """Drops the slot's pages (freed when no one else maps them)."""
        self._drop(self.table[slot, :self.mapped[slot]])
        self.table[slot] = 0
        self.mapped[slot] = 0
        self.bound[slot] = 0

    def share(self, slot: int, tokens: int) -> tuple:
        """The slot's pages wholly inside its first `tokens` positions, with one more
        reference each, for another slot to map (`assign(shared=...)`); give them
        back with `release_pages`. In place: none."""
        if self.in_place != "never":
            return ()
        pages = self.table[slot, :min(int(tokens) // self.page_size, int(self.mapped[slot]))]
        self._refs[pages] += 1
        return tuple(int(p) for p in pages)

    def release_pages(self, pages: Iterable[int] | np.ndarray) -> None:
        self._drop(pages)

    # ----------------------------------------------------------------- device view

    def flat_buckets(self) -> tuple[int, ...]:
        """Padded lengths of the flat page list (doubling, up to every slot full; the
        list is empty where the view is always in place)."""
        if self.in_place == "always":
            return (0,)
        if self._flat_buckets is None:
            top, b, out = self.slots * self.pages_per_slot, 8, []
            while b < top:
                out.append(b)
                b *= 2
            self._flat_buckets = tuple(out) + (top,)
        return self._flat_buckets

    def view(self) -> PageView:
        """The page table and the flat list of mapped pages, or in place each page's
        slot and first position (see the module doc)."""
        slots = np.repeat(np.arange(self.slots, dtype=np.int32), self.mapped)
        starts = np.concatenate([np.arange(m, dtype=np.int32) for m in self.mapped]
                                ) * self.page_size if len(slots) else np.zeros(0, np.int32)
        pages = self.table[slots, starts // self.page_size]
        buckets = self.flat_buckets()
        n = buckets[0] if self.in_place == "always" else pick_bucket(
            max(len(slots), 1), buckets, "flat page buckets")
        if self.in_place == "always" or (self.in_place == "full" and n == buckets[-1]):
            page_slots = np.full(self.num_pages + 1, self.slots, np.int32)
            page_starts = np.zeros(self.num_pages + 1, np.int32)
            page_slots[pages], page_starts[pages] = slots, starts
            empty = np.zeros(0, np.int32)
            return PageView(self.table.copy(), self.mapped > 0, empty, empty, empty,
                            page_slots, page_starts)
        pad = n - len(slots)
        return PageView(
            self.table.copy(), self.mapped > 0,
            np.concatenate([pages, np.zeros(pad, np.int32)]).astype(np.int32),
            np.concatenate([slots, np.full(pad, self.slots, np.int32)]).astype(np.int32),
            np.concatenate([starts, np.zeros(pad, np.int32)]).astype(np.int32),
            np.zeros(0, np.int32), np.zeros(0, np.int32))

    def check(self) -> None:
        """Asserts the pool's invariants (tests): reference counts equal the table's
        uses plus outside references, free pages have none, none is lost."""
        uses = np.bincount(np.concatenate([self.slot_pages(s) for s in range(self.slots)]
                                          + [np.zeros(0, np.int64)]).astype(np.int64),
                           minlength=self.num_pages + 1)
        assert uses[0] == 0, "the null page is mapped"
        assert self.in_place == "never" or uses.max() <= 1, "a page read in place has two slots"
        assert np.all(self._refs >= uses), "a mapped page has fewer references than uses"
        free = set(self._free)
        assert len(free) == len(self._free), "a page is free twice"
        assert all(self._refs[p] == 0 for p in free), "a free page is referenced"
        assert len(free) + int(np.count_nonzero(self._refs[1:])) == self.num_pages, "page lost"
