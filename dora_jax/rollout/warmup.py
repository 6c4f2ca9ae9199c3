"""Compiles every jitted function an engine will run, before a run's clock starts, so
throughput and waits measure steady state (and a mode's rarer paths — re-prefill,
chunked prefill, migration — do not compile mid-run)."""

from __future__ import annotations

import jax
import numpy as np

from dora_jax.rollout.engine import Engine
from dora_jax.rollout.state import EngineParams

_FILL = 2  # any token id: contents do not matter here


def extension_shapes(engine: Engine) -> list:
    """(prompt length, tokens so far) pairs, one per (prefix bucket, chunk bucket)
    that extending a group's prompt prefix by a resumed request's tokens can reach
    (the result's bucket follows from the two)."""
    lows = dict(zip(engine.buckets, (0,) + engine.buckets[:-1]))

    def reachable(limit: int) -> list[int]:  # the largest length <= limit in each bucket
        # that has one
        return [min(b, limit) for b in engine.buckets if lows[b] < limit]

    return [(p, t) for p in reachable(engine.max_prefill_length)
            for t in reachable(engine.max_decode_len - 1)]


def warm_engine(engine: Engine, params: EngineParams, *, reprefills: bool,
                generate_params: EngineParams | None = None, group_size: int = 1) -> None:
    """Runs every function `engine` compiles on a throwaway decode state (which
    resets a paged engine's pool: the slice then takes a fresh one). `reprefills`:
    the mode re-prefills prompt + tokens so far (partial_rollout). A multi-version
    engine's calls name each row's place: `params` those of a prefill (one row),
    `generate_params` those of a generate call (every slot's row). `group_size`: the
    samples of a prompt, which a slice starts together, a power of two of them at a
    time (`Prefills.start_group`)."""
    generate_params = params if generate_params is None else generate_params
    r = engine.rollout_cfg
    buckets = [b for b in engine.buckets if reprefills or b <= r.prefill_buckets[-1]]
    state = engine.init_decode_state()
    for bucket in buckets:
        # Fill the bucket: a re-prefill bucket needs prompt + tokens so far.
        length = min(bucket, r.cache_length - 1)
        prompt_len = min(length, r.max_prefill_length)
        padded = np.full(bucket, _FILL, np.int32)
        prefix, _ = engine.prefill(params=params, rng=0, padded_tokens=padded,
                                   true_length=length, num_generated=length - prompt_len)
        if length == prompt_len:  # a prompt: another sample of its group reuses it
            prefix, _ = engine.prefill(params=params, rng=1, existing_prefix=prefix,
                                       padded_tokens=engine.pad_tokens([])[0], true_length=0)
            group = min(group_size, engine.max_concurrent_decodes,
                        engine.pages.num_pages if engine.pages is not None else group_size)
            for n in (1 << k for k in range(1, group.bit_length())):  # 2, 4, ... <= group
                # What compiles depends on the prefix's shape only: one written position
                # takes a slot one page, so that a small pool holds the group.
                shared, _ = engine.prefill_multisampling(
                    params=params, rng=list(range(n)), num_samples=n,
                    padded_tokens=padded, true_length=length)
                state = engine.bulk_insert(shared, state, list(range(n)), length=1)
                for slot in range(n):
                    engine.free_resource(slot)
        state = engine.insert(prefix, state, 0)
    if reprefills:  # resumed requests extend their group's prompt prefix
        for prompt_len, so_far in extension_shapes(engine):
            base, _ = engine.prefill(params=params, rng=0, true_length=prompt_len,
                                     padded_tokens=engine.pad_tokens([_FILL] * prompt_len)[0])
            padded, _ = engine.pad_tokens([_FILL] * so_far)
            engine.prefill(params=params, rng=0, padded_tokens=padded, true_length=so_far,
                           num_generated=so_far, existing_prefix=base)
    state, _ = engine.generate_steps(generate_params, state)
    # A migrated request moves the bucket holding its positions: every length's
    # extract and insert compile too.
    for used in sorted(set(engine.buckets) | {r.cache_length}):
        state = engine.insert(engine.extract(state, 0, used=used), state, 0)
    pool = engine.pages
    if pool is not None:
        # Paged decode compiles once per bucket of mapped pages: map exactly that
        # many pages, slot after slot (host tables only; device contents do not
        # matter here), for every bucket the pool can reach.
        for bucket in pool.flat_buckets():
            for slot in range(engine.max_concurrent_decodes):
                pool.release(slot)
            left, slot = min(bucket, pool.num_pages), 0
            while left and slot < engine.max_concurrent_decodes:
                n = min(left, pool.pages_per_slot)
                pool.assign(slot, n * pool.page_size - 1)  # the step's token fits too
                left, slot = left - n, slot + 1
            state, _ = engine.generate_steps(generate_params, state, 1)
            if bucket >= pool.num_pages:
                break
    jax.block_until_ready(state)
