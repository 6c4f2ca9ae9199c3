"""What a decode slice runs before a sample decodes in a slot (`DecodeSlice.prefills`).

The group's prompt runs once under the resident params: a fresh sample draws its first
token from the prompt's prefix, a resumed one (preempted, or re-prefilled under new
params) runs only its own tokens on top of it, and on a paged cache they all map the
prompt's pages (slice_memory.py). An episode between turns runs only its unwritten
tokens (the last turn's end and the observation) on top of the KV it kept.
"""

from __future__ import annotations

from dora_jax.rollout.slice_memory import prompt_key
from dora_jax.rollout.trajectory import InFlight


class Prefills:
    """Prefills into the slots of one engine's decode state, sharing the slice's
    prompt cache (`memory`) and counting into its `stats`."""

    def __init__(self, engine, memory, stats):
        self._engine, self._memory, self._stats = engine, memory, stats

    def into_slot(self, seq: InFlight, state, slot: int, params):
        """Prefills `seq` (prompt + response so far) into `slot` of `state` under
        `params`; returns (the new state, the prefill's ResultTokens, to be read)."""
        if seq.kept is not None:
            return self._continue_episode(seq, state, slot, params)
        r, engine, memory, stats = seq.request, self._engine, self._memory, self._stats
        P, key, done = len(r.prompt_tokens), prompt_key(r), seq.response_tokens
        base = memory.prefixes.get(key)
        if base is None and done:  # the group's prompt, once
            padded, _ = engine.pad_tokens(r.prompt_tokens)
            base, _ = engine.prefill(params=params, padded_tokens=padded,
                                     true_length=P, rng=r.key_data())
            memory.prefixes[key] = base
            stats.prefills += 1
            stats.prefill_tokens += P
        # Without a prefix the whole sequence runs; with it, only the response so far.
        padded, t = engine.pad_tokens((list(r.prompt_tokens) if base is None else []) + done)
        prefix, result = engine.prefill(params=params, padded_tokens=padded, true_length=t,
                                        rng=r.key_data(), num_generated=len(done),
                                        existing_prefix=base, max_new_tokens=r.max_new_tokens)
        state = engine.insert(prefix, state, slot, length=seq.length,
                              shared_pages=memory.pages.get(key, ()))
        stats.reprefill_tokens += len(done)
        if base is not None:
            stats.prefills_shared += 1
        else:
            stats.prefills += 1
            stats.prefill_tokens += P
        memory.remember(key, prefix if base is None else base, slot, P)
        return state, result

    def _continue_episode(self, seq: InFlight, state, slot: int, params):
        r, engine, done = seq.request, self._engine, seq.response_tokens
        padded, t = engine.pad_tokens(done[len(done) - seq.unwritten:])
        prefix, result = engine.prefill(params=params, existing_prefix=seq.kept,
                                        padded_tokens=padded, true_length=t,
                                        rng=r.key_data(), num_generated=len(done),
                                        max_new_tokens=r.max_new_tokens)
        seq.kept, seq.unwritten = None, 0
        self._stats.observation_tokens += t - 1
        return engine.insert(prefix, state, slot, length=seq.length), result
