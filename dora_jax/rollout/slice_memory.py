"""The KV-memory side of a decode slice, owned by the slice (`DecodeSlice.memory`).

- The group prompt cache: the prefix of each group's prompt under the resident
  params (its later samples start from it, resumed ones extend it) and, with a
  paged cache, the prompt's whole pages, which every sample of the group maps.
  Forgotten when the group leaves the slice or the params change.
- Admission by free pages: a waiting request starts only when the pool holds its
  first call and the next call of every running request, other groups' prompt pages
  let go first if that makes room.
- Room for a call: when the running requests' next call does not fit, the prompt
  pages are let go first; the slice then preempts (its most recently started
  request goes back to the head of its queue).
- What the scheduler is told: `kv_free_tokens`.

Requests are read through `request` (prompt, group), `response_tokens` and `length`
(so far) only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING

from dora_jax.rollout.trajectory import RolloutError

if TYPE_CHECKING:
    from dora_jax.rollout.engine import Engine
    from dora_jax.rollout.pages import PagePool
    from dora_jax.rollout.slots import SlotTable
    from dora_jax.rollout.state import Prefix
    from dora_jax.rollout.trajectory import InFlight, Request

# The prompt cache's key: (group id, prompt tokens).
PromptKey = tuple[int, tuple[int, ...]]


def prompt_key(request: Request) -> PromptKey:
    """The prompt cache's key: samples of one group share their prompt."""
    return (request.group_id, tuple(request.prompt_tokens))


class SliceMemory:
    """Prompt cache and page accounting of one slice on `engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prefixes: dict = {}  # prompt_key -> Prefix of the prompt
        self.pages: dict = {}  # prompt_key -> its whole prompt pages (paged cache)

    @property
    def _pool(self) -> PagePool:
        """The paged cache's pool, on the paths only a paged cache takes."""
        assert self.engine.pages is not None, "a dense cache has no page pool"
        return self.engine.pages

    def remember(self, key: PromptKey, prefix: Prefix, slot: int, prompt_len: int) -> None:
        """The prompt's prefix, and (paged) its whole pages as `slot` maps them."""
        self.prefixes.setdefault(key, prefix)
        pool = self.engine.pages
        if pool is not None and key not in self.pages:
            self.pages[key] = pool.share(slot, prompt_len)

    def forget(self, keys: Iterable[PromptKey]) -> None:
        for key in list(keys):
            del self.prefixes[key]
            pages = self.pages.pop(key, ())
            if pages:
                self._pool.release_pages(pages)

    def forget_groups_except(self, live_groups: Collection[int]) -> None:
        """Drops the prompts (and pages) of groups no longer held."""
        if self.prefixes:
            self.forget([k for k in self.prefixes if k[0] not in live_groups])

    def reset(self) -> None:
        """Forgets everything without releasing: the page pool was reset."""
        self.prefixes.clear()
        self.pages.clear()

    def kv_free_tokens(self, waiting: Iterable[InFlight]) -> int | None:
        """Paged cache: KV positions free beyond what the running requests' next call
        and the `waiting` requests' start need (may be negative); None if dense."""
        pool = self.engine.pages
        if pool is None:
            return None
        n, cap = self.engine.decode_steps, self.engine.cache_length
        need = sum(pool.pages_for(min(s.length + n, cap))
                   for s in waiting)
        return (pool.num_free - pool.shortfall(n) - need) * pool.page_size

    def pages_needed(self, seq: InFlight) -> int:
        """Paged cache: pages this request's start and first generate call take."""
        pool = self.engine.pages
        if pool is None:
            return 0
        n, r = self.engine.decode_steps, seq.request
        shared = 0 if seq.response_tokens else len(self.pages.get(prompt_key(r), ()))
        return pool.pages_for(min(seq.length + n, self.engine.cache_length)) - shared

    def has_pages_for(self, seq: InFlight, also: int = 0) -> bool:
        """Paged cache: the pool has pages for this request's first generate call, for
        `also` more pages (others starting with it) and for the next call of every
        running slot."""
        pool = self.engine.pages
        if pool is None:
            return True
        need = self.pages_needed(seq) + also
        return need + pool.shortfall(self.engine.decode_steps) <= pool.num_free

    def room_for(self, seq: InFlight, also: int = 0) -> bool:
        """`has_pages_for`, after letting go of other groups' prompt pages if the pool
        is short: a group's pages stay cached while any sample of it is held, e.g.
        episodes at their environments, and would hold up the work ready to decode
        (their samples keep their mappings; later ones copy the prompt's prefix)."""
        if self.has_pages_for(seq, also):
            return True
        mine = prompt_key(seq.request)
        others = [key for key in self.pages if key != mine]
        for key in others:
            self._pool.release_pages(self.pages.pop(key))
        return bool(others) and self.has_pages_for(seq, also)

    def short(self, n: int) -> bool:
        """Paged cache: a call of n steps of every running slot does not fit."""
        pool = self._pool
        return pool.shortfall(n) > pool.num_free

    def make_room(self, n: int, slots: SlotTable, sync: Callable[[], object],
                  preempt: Callable[[InFlight], object], slice_id: int) -> None:
        """Paged cache: room for a call of n steps of every running slot: what finished
        in flight is read (`sync`), the prompt pages let go, then the most recently
        started request of `slots` is preempted (`preempt(seq)`), as often as needed."""
        if self.short(n):
            sync()  # finished requests give their pages back
        while self.short(n):
            if self.drop_prompt_pages():
                continue
            if slots.owned.sum() <= 1:
                raise RolloutError(f"slice {slice_id}: KV pool of "
                                   f"{self._pool.num_pages} pages cannot hold one "
                                   f"request")
            latest = slots.owner(slots.latest_started())
            assert latest is not None  # latest_started is an owned slot
            preempt(latest)

    def drop_prompt_pages(self) -> bool:
        """Lets go of the shared prompt pages (their samples keep their mappings);
        False if none were held."""
        if not self.pages:
            return False
        for key in list(self.pages):
            self._pool.release_pages(self.pages.pop(key))
        return True
