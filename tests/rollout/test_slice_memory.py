"""The slice's prompt cache against a real page pool: cached prompt pages that no
running slot maps give way to work ready to start, never the starting group's own."""

from __future__ import annotations

from types import SimpleNamespace

from dora_jax.rollout.pages import PagePool
from dora_jax.rollout.slice_memory import SliceMemory, prompt_key


def _seq(group: int, prompt_len: int = 8):
    request = SimpleNamespace(group_id=group, prompt_tokens=list(range(1, prompt_len + 1)))
    return SimpleNamespace(request=request, response_tokens=[], length=prompt_len)


def _memory(num_pages: int = 8):
    # Pages of 4 positions, 2 slots of up to 16 positions; calls of 4 steps.
    pool = PagePool(num_pages=num_pages, page_size=4, slots=2, max_tokens=16)
    return SliceMemory(SimpleNamespace(pages=pool, decode_steps=4, cache_length=16)), pool


def test_an_absent_group_s_prompt_pages_give_way_to_a_waiting_request():
    memory, pool = _memory()
    at_env = _seq(group=0)
    pool.assign(0, 8)  # its first sample prefilled in slot 0...
    memory.remember(prompt_key(at_env.request), "prefix of group 0", 0, 8)
    pool.release(0)  # ...then left the slot for its environment: the cache keeps 2 pages
    pool.assign(1, 13)  # another request runs in slot 1 (4 pages, its next call fits)
    assert pool.num_free == 2
    waiting = _seq(group=1)  # needs 3 pages for its prompt and first call
    assert not memory.has_pages_for(waiting)
    assert memory.room_for(waiting)
    assert pool.num_free == 4 and prompt_key(at_env.request) not in memory.pages
    # The prompt's prefix stays: the group's later samples still start from it.
    assert memory.prefixes[prompt_key(at_env.request)] == "prefix of group 0"


def test_the_starting_group_keeps_its_own_prompt_pages():
    memory, pool = _memory(num_pages=6)
    waiting = _seq(group=1)
    pool.assign(0, 8)
    memory.remember(prompt_key(waiting.request), "prefix of group 1", 0, 8)
    pool.release(0)
    pool.assign(1, 16)
    # No page free: the sample would map its 2 cached prompt pages and take 1 more.
    assert pool.num_free == 0 and memory.pages_needed(waiting) == 1
    assert not memory.room_for(waiting)
    assert prompt_key(waiting.request) in memory.pages


def test_nothing_is_let_go_when_the_pool_has_room():
    memory, pool = _memory()
    absent = _seq(group=0)
    pool.assign(0, 8)
    memory.remember(prompt_key(absent.request), "prefix of group 0", 0, 8)
    pool.release(0)
    assert memory.room_for(_seq(group=1))
    assert prompt_key(absent.request) in memory.pages and pool.num_free == 6
