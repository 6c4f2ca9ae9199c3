"""Compiles every jitted function an engine will run, before a run's clock starts, so
throughput and waits measure steady state (and a mode's rarer paths — re-prefill,
chunked prefill, migration — do not compile mid-run)."""

from __future__ import annotations

import jax
import numpy as np

from dora_jax.rollout.engine import Engine

_FILL = 2  # any token id: contents do not matter here


def extension_shapes(engine: Engine) -> list:
    """(held, true_length) pairs, one per (prefix, result, chunk) bucket combination
    that extending a group's prompt prefix (held = prompt length) by a resumed
    request's tokens (true_length = prompt + tokens so far) can reach."""
    buckets = engine.buckets
    lows = dict(zip(buckets, (0,) + buckets[:-1]))  # bucket -> largest length below it

    def span(b, hi):  # lengths that pad to bucket b, at most hi
        return lows[b] + 1, min(b, hi)

    out = set()
    for b0 in buckets:
        lo_h, hi_h = span(b0, engine.max_prefill_length)
        for b in buckets:
            lo_n, hi_n = span(b, engine.cache_length - 1)
            if lo_h > hi_h or lo_n > hi_n or hi_n <= lo_h:
                continue
            # Chunk lengths n - held: response tokens so far, below max_decode_len.
            lo_x, hi_x = max(1, lo_n - hi_h), min(hi_n - lo_h, engine.max_decode_len - 1)
            for c in buckets:
                x = min(c, hi_x)
                if x <= lows[c] or x < lo_x:
                    continue  # no chunk length of this pair pads to c
                held = max(lo_h, lo_n - x)
                if held <= hi_h and held + x <= hi_n:
                    out.add((held, held + x))
    return sorted(out)


def warm_engine(engine: Engine, params, *, reprefills: bool) -> None:
    """Runs every function `engine` compiles on a throwaway decode state (which
    resets a paged engine's pool: the slice then takes a fresh one). `reprefills`:
    the mode re-prefills prompt + tokens so far (partial_rollout)."""
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
            prefix, _ = engine.prefill(params=params, rng=1, padded_tokens=padded,
                                       true_length=length, existing_prefix=prefix)
        state = engine.insert(prefix, state, 0)
    if reprefills:  # resumed requests extend their group's prompt prefix
        for held, n in extension_shapes(engine):
            base, _ = engine.prefill(params=params, rng=0, true_length=held,
                                     padded_tokens=engine.pad_tokens([_FILL] * held)[0])
            padded, _ = engine.pad_tokens([_FILL] * n)
            engine.prefill(params=params, rng=0, padded_tokens=padded, true_length=n,
                           num_generated=n - held, existing_prefix=base,
                           existing_length=held)
    state, _ = engine.generate(params, state)
    # A migrated request moves the bucket holding its positions: every length's
    # extract and insert compile too.
    for used in sorted(set(engine.buckets) | {r.cache_length}):
        state = engine.insert(engine.extract(state, 0, used=used), state, 0)
    pool = engine.pages
    if pool is not None:
        # Paged decode compiles per bucket of mapped pages: map slot after slot (host
        # tables only; the device contents do not matter here).
        for slot in range(1, engine.max_concurrent_decodes):
            if pool.num_free < pool.pages_per_slot:
                break
            pool.assign(slot, r.cache_length)
            state, _ = engine.generate(params, state, 1)
    jax.block_until_ready(state)
