"""A decode slice's multi-turn episodes between their turns (`DecodeSlice.turns`).

A turn's end keeps the slot's KV (`engine.extract`), frees the slot and sends the
turn to the environment (episodes.EpisodeRunner, off the slice's thread); the answer
either ends the episode or appends the observation to the response, and the slice
queues the episode first, to be prefilled on top of the kept KV when it gets a slot
again. Migration moves an episode between turns with its kept KV and its pending
call; a preempted or re-prefilled one runs its whole sequence again, observations
included. The slice owns the slots and the held requests; this component owns the
episodes at their environments.
"""

from __future__ import annotations

import concurrent.futures
import time

from dora_jax import versions as versions_lib
from dora_jax.rollout.episodes import EpisodeRunner
from dora_jax.rollout.trajectory import InFlight


class EpisodeTurns:
    """The episodes waiting for their environment's answer.

    Args:
      runner: runs the environments (None: a single-turn slice, no episodes).
      stop_ids: the engine's stop tokens (a turn that ends without one hit its budget).
      max_decode_len: the engine's, the most tokens an episode's response holds.
    """

    def __init__(self, runner: EpisodeRunner | None, stop_ids, max_decode_len: int):
        self.runner = runner
        self._stop_ids, self._max_decode_len = stop_ids, max_decode_len
        # request id -> (InFlight, the KV kept (None: run the whole sequence again),
        # the environment call's future, when it was sent)
        self._at_env: dict = {}

    def __len__(self) -> int:
        return len(self._at_env)

    def begin(self, seq: InFlight) -> None:
        """Makes a submitted request an episode if it carries a task record."""
        if seq.request.record is not None and self.runner is not None:
            seq.episode = self.runner.begin(seq.request.record)

    def turn_ended(self, seq: InFlight) -> bool:
        """Records a model turn that ended (its tokens flushed); True if the episode
        now goes to its environment (`send`), False if it ends here (its token budget
        is spent)."""
        seq.episode.turns.append(["model", seq.episode.next_start, len(seq.response_tokens)])
        if seq.response_tokens[-1] not in self._stop_ids:  # cut at the budget
            seq.episode.end = "budget"
            return False
        return True

    def send(self, seq: InFlight, kept) -> None:
        """Sends the turn that just ended, its slot already freed with `kept` its KV."""
        start = seq.episode.turns[-1][1]
        future = self.runner.step(seq.episode, seq.response_tokens[start:])
        self._at_env[seq.request.request_id] = (seq, kept, future, time.perf_counter())

    def collect(self) -> list:
        """The answers that are in, as (episode's InFlight, why it ended or None). None:
        the observation was appended and the KV kept; the slice queues it first."""
        if not self._at_env:  # every step asks: a single-turn slice pays nothing
            return []
        now, out = time.perf_counter(), []
        for rid, (seq, kept, future, sent) in list(self._at_env.items()):
            if future.done():
                result, seconds, error = future.result()
            elif now - sent > self.runner.timeout:
                result, seconds, error = None, now - sent, "env_timeout"
            else:
                continue
            del self._at_env[rid]
            out.append((seq, self._answer(seq, kept, result, seconds, error)))
        return out

    def _answer(self, seq: InFlight, kept, result, seconds, error) -> str | None:
        episode = seq.episode
        episode.env_seconds += seconds
        if result is None or error is not None:
            episode.error = error
            return "env_timeout" if result is None else "env_error"
        episode.reward += float(result.reward)
        episode.info.update({k: v for k, v in result.info.items()
                             if isinstance(v, (int, float))})
        if result.done:
            return "done"
        if episode.model_turns >= self.runner.max_turns:
            return "max_turns"
        obs = self.runner.observation_tokens(result.observation)
        limit = min(seq.request.max_new_tokens or self._max_decode_len, self._max_decode_len)
        if len(seq.response_tokens) + len(obs) + 1 > limit:  # no room for a model token
            return "budget"
        start = len(seq.response_tokens)
        seq.response_tokens.extend(obs)
        seq.behaviour_logprobs.extend([0.0] * len(obs))
        versions_lib.extend(seq.versions, seq.version, len(obs))
        episode.turns.append(["env", start, len(seq.response_tokens), round(seconds, 6)])
        seq.kept, seq.unwritten = kept, len(obs) + 1
        return None

    def wait(self, timeout: float) -> None:
        """Blocks until an environment answers or `timeout` (nothing else to do)."""
        concurrent.futures.wait([f for _, _, f, _ in self._at_env.values()],
                                timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def take(self, request_id):
        """Removes an episode at its environment (migration): (InFlight, kept KV,
        (future, sent)), or None if it is not there."""
        if request_id not in self._at_env:
            return None
        seq, kept, future, sent = self._at_env.pop(request_id)
        return seq, kept, (future, sent)

    def put(self, seq: InFlight, kept, env_call) -> None:
        """Takes over an episode whose environment call `(future, sent)` is pending."""
        self._at_env[seq.request.request_id] = (seq, kept, *env_call)

    def drop_kept(self) -> None:
        """Forgets the kept KV (computed under params being replaced)."""
        for rid, (seq, _, future, sent) in self._at_env.items():
            self._at_env[rid] = (seq, None, future, sent)

    def clear(self) -> None:
        self._at_env.clear()
