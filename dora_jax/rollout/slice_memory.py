"""The KV-memory side of a decode slice (mixed into `DecodeSlice`).

- The group prompt cache: the prefix of each group's prompt under the resident
  params (its later samples start from it, resumed ones extend it) and, with a
  paged cache, the prompt's whole pages, which every sample of the group maps.
  Forgotten when the group leaves the slice or the params change.
- Admission by free pages: a waiting request starts only when the pool holds its
  first call and the next call of every running request.
- Preemption: when the running requests' next call does not fit, the prompt pages
  are let go first, then the most recently started request goes back to the head
  of the queue with its tokens (resumed later under the same version: C1).
- What the scheduler is told: `kv_free_tokens`.
"""

from __future__ import annotations

import numpy as np

from dora_jax.rollout.trajectory import RolloutError


class SliceMemory:
    """Mixin: needs the slice's `engine`, `_held`, `_waiting`, `_slots`, `_owned`,
    `_order`, `_prompt_prefixes`, `_prompt_pages`, `stats`, `_sync`, `_flush`,
    `_free`."""

    @property
    def kv_free_tokens(self):
        """Paged cache: KV positions free beyond what the running requests' next call
        and the waiting requests' start need (may be negative); None if dense."""
        pool = self.engine.pages
        if pool is None:
            return None
        n, cap = self.engine.decode_steps, self.engine.cache_length
        waiting = sum(pool.pages_for(min(len(s.request.prompt_tokens) + len(s.tokens) + n, cap))
                      for s in self._waiting)
        return (pool.num_free - pool.shortfall(n) - waiting) * pool.page_size

    def _forget_gone_groups(self):
        """Drops the prompt prefixes (and pages) of groups no longer held here."""
        if self._prompt_prefixes:
            live = {rid[0] for rid in self._held}
            self._forget_prompts([k for k in self._prompt_prefixes if k[0] not in live])

    def _forget_prompts(self, keys):
        for key in keys:
            del self._prompt_prefixes[key]
            pages = self._prompt_pages.pop(key, ())
            if pages:
                self.engine.pages.release_pages(pages)

    def _has_pages_for(self, seq) -> bool:
        """Paged cache: the pool has pages for this request's first generate call and
        for the next call of every running slot."""
        pool = self.engine.pages
        if pool is None:
            return True
        n = self.engine.decode_steps
        r = seq.request
        shared = 0 if seq.tokens else len(self._prompt_pages.get(
            (r.group_id, tuple(r.prompt_tokens)), ()))
        need = pool.pages_for(min(len(r.prompt_tokens) + len(seq.tokens) + n,
                                  self.engine.cache_length)) - shared
        return need + pool.shortfall(n) <= pool.num_free

    def _reserve_pages(self, n: int):
        """Makes room in the pool for a call of n steps of every running slot: drops
        the shared-prompt references, then preempts, while it is short."""
        pool = self.engine.pages
        if pool.shortfall(n) > pool.num_free:
            self._sync()  # finished requests give their pages back
        while pool.shortfall(n) > pool.num_free:
            if self._prompt_pages:
                for key in list(self._prompt_pages):
                    pool.release_pages(self._prompt_pages.pop(key))
                continue
            running = np.flatnonzero(self._owned)
            if len(running) <= 1:
                raise RolloutError(f"slice {self.slice_id}: KV pool of {pool.num_pages} "
                                   f"pages cannot hold one request")
            victim = self._slots[running[np.argmax(self._order[running])]]
            self._flush(victim)
            self._free(victim)
            self._waiting.appendleft(victim)
            self.stats.preempted += 1
