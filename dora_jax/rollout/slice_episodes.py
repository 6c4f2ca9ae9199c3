"""A decode slice's multi-turn episodes between their turns (a mixin of
`slice.DecodeSlice`, which holds the state these methods use: its engine, params,
decode state, held / waiting requests and `_env_wait`).

A turn's end keeps the slot's KV (`engine.extract`), frees the slot and sends the
turn to the environment (episodes.EpisodeRunner, off the slice's thread); the answer
either ends the episode or appends the observation to the response and queues the
episode first, to be prefilled on top of the kept KV (`engine.prefill` with
`existing_prefix`) when it gets a slot again.
"""

from __future__ import annotations

import time

from dora_jax import versions as versions_lib
from dora_jax.rollout.trajectory import Held


class EpisodeTurns:
    """What a DecodeSlice does between an episode's turns."""

    def _continue_episode(self, seq: Held, slot: int):
        """Prefills an episode's unwritten tokens (the last turn's end and the
        observation) on top of its kept KV into `slot` and samples the next turn's
        first token."""
        r, engine = seq.request, self.engine
        chunk = seq.tokens[len(seq.tokens) - seq.unwritten:]
        padded, t = engine.pad_tokens(chunk)
        prefix, result = engine.prefill(params=self.prefill_params(seq.version),
                                        existing_prefix=seq.kept,
                                        padded_tokens=padded, true_length=t,
                                        rng=r.key_data(), num_generated=len(seq.tokens),
                                        max_new_tokens=r.max_new_tokens)
        seq.kept, seq.unwritten = None, 0
        n = len(r.prompt_tokens) + len(seq.tokens)
        self.state = engine.insert(prefix, self.state, slot, length=n)
        self.stats.observation_tokens += t - 1
        self._place(seq, slot, n)
        self._pending.append((seq, result))

    def _end_turn(self, seq: Held) -> bool:
        """A model turn of an episode ended (its tokens flushed): keeps the KV,
        frees the slot and sends the turn to the environment. False if the episode
        ends here instead (its token budget is spent)."""
        episode, n = seq.episode, len(seq.tokens)
        start = episode.next_start
        episode.turns.append(["model", start, n])
        if seq.tokens[-1] not in self.engine.stop_ids:  # cut at the budget
            episode.end = "budget"
            return False
        kept = self.engine.extract(self.state, seq.slot,
                                   used=len(seq.request.prompt_tokens) + n)
        self._free(seq)
        future = self.episodes.step(episode, seq.tokens[start:])
        self._env_wait[seq.request.request_id] = (seq, kept, future, time.perf_counter())
        return True

    def _collect_observations(self):
        """Takes the environments' answers that are in: an episode goes on (queued
        first, its observation appended) or ends (its call past the timeout too)."""
        now = time.perf_counter()
        for rid, (seq, kept, future, sent) in list(self._env_wait.items()):
            if future.done():
                result, seconds, error = future.result()
            elif now - sent > self.episodes.timeout:
                result, seconds, error = None, now - sent, "env_timeout"
            else:
                continue
            del self._env_wait[rid]
            episode = seq.episode
            episode.env_seconds += seconds
            if result is None or error is not None:
                episode.error = error
                self._end_episode(seq, "env_timeout" if result is None else "env_error")
                continue
            episode.reward += float(result.reward)
            episode.info.update({k: v for k, v in result.info.items()
                                 if isinstance(v, (int, float))})
            if result.done:
                self._end_episode(seq, "done")
                continue
            if episode.model_turns >= self.episodes.max_turns:
                self._end_episode(seq, "max_turns")
                continue
            obs = self.episodes.observation_tokens(result.observation)
            limit = min(seq.request.max_new_tokens or self.engine.max_decode_len,
                        self.engine.max_decode_len)
            if len(seq.tokens) + len(obs) + 1 > limit:  # no room for a model token
                self._end_episode(seq, "budget")
                continue
            start = len(seq.tokens)
            seq.tokens.extend(obs)
            seq.logprobs.extend([0.0] * len(obs))
            versions_lib.extend(seq.runs, seq.version, len(obs))
            episode.turns.append(["env", start, len(seq.tokens), round(seconds, 6)])
            seq.kept, seq.unwritten = kept, len(obs) + 1
            self._waiting.appendleft(seq)

    def _end_episode(self, seq: Held, why: str):
        """Ends an episode between turns. Its finish reason says how its last model
        turn ended (at a stop id: "eos"); `episode.end` says why the episode did."""
        seq.episode.end = why
        del self._held[seq.request.request_id]
        self._done.append(seq.to_trajectory("eos", self.clock()))
        self.stats.finished += 1
