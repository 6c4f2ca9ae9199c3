"""A decode slice's multi-turn episodes between their turns (`DecodeSlice.turns`).

A turn's end keeps the slot's KV (`engine.extract`), frees the slot and sends the
turn to the environment (episodes.EpisodeRunner, off the slice's thread); the answer
either ends the episode or appends the observation to the response, and the slice
queues the episode first, to be prefilled on top of the kept KV when it gets a slot
again. The slot serves other requests meanwhile: with `rollout.max_episodes_per_slice`
the slice holds more episodes than slots, so slow environments do not idle it. The
kept KV waits on the device (outside the page pool) or, with `rollout.episode_kv =
"host"`, in host memory, copied out at the turn's end and back when the answer is in.
Migration moves an episode between turns with its kept KV and its pending
call; a preempted or re-prefilled one runs its whole sequence again, observations
included. The slice owns the slots and the held requests; this component owns the
episodes at their environments.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from dora_jax.base import versions as versions_lib
from dora_jax.rollout.episodes import Episode, EpisodeRunner
from dora_jax.rollout.trajectory import InFlight

if TYPE_CHECKING:
    from dora_jax.envs.base import StepResult
    from dora_jax.rollout.engine import Engine
    from dora_jax.rollout.state import Prefix
    from dora_jax.rollout.trajectory import SliceStats


class EpisodeTurns:
    """The episodes waiting for their environment's answer.

    Args:
      runner: runs the environments (None: a single-turn slice, no episodes).
      engine: the slice's (its stop tokens, response budget, where kept KV waits).
      stats: the slice's SliceStats (host copies of kept KV are counted there).
    """

    def __init__(self, runner: EpisodeRunner | None, engine: Engine, stats: SliceStats
                 ) -> None:
        self.runner, self._engine, self._stats = runner, engine, stats
        self._stop_ids, self._max_decode_len = engine.stop_ids, engine.max_decode_len
        self._to_host = engine.rollout_cfg.episode_kv == "host"
        # request id -> (InFlight, the KV kept (None: run the whole sequence again),
        # its environment call: episodes.EnvCall)
        self._at_env: dict = {}

    def __len__(self) -> int:
        return len(self._at_env)

    def begin(self, seq: InFlight) -> None:
        """Makes a submitted request an episode if it carries a task record."""
        if seq.request.record is not None and self.runner is not None:
            # The runtime seeds every sample with an int (`request_seed`).
            seq.episode = self.runner.begin(seq.request.record, cast(int, seq.request.seed))

    def turn_ended(self, seq: InFlight) -> bool:
        """Records a model turn that ended (its tokens flushed); True if the episode
        now goes to its environment (`send`), False if it ends here (its token budget
        is spent)."""
        episode = _episode(seq)
        episode.turns.append(["model", episode.next_start, len(seq.response_tokens)])
        if seq.response_tokens[-1] not in self._stop_ids:  # cut at the budget
            episode.end = "budget"
            return False
        return True

    @property
    def capacity(self) -> int:
        """Requests the slice may hold: one per slot, or with episodes
        `rollout.max_episodes_per_slice`."""
        r = self._engine.rollout_cfg
        return r.samples_per_slice if self.runner is not None else r.slots_per_slice

    def send(self, seq: InFlight, kept: Any) -> None:
        """Sends the turn that just ended, its slot already freed with `kept` its KV."""
        episode = _episode(seq)
        start = episode.turns[-1][1]
        call = self._episode_runner.step(episode, seq.response_tokens[start:])
        if self._to_host:
            kept = self._move(kept, None)
        self._at_env[seq.request.request_id] = (seq, kept, call)

    @property
    def _episode_runner(self) -> EpisodeRunner:
        """The runner, where there are episodes (a slice without one has none)."""
        assert self.runner is not None
        return self.runner

    def _move(self, kept: Prefix, dst: Prefix | None) -> Prefix:
        """The kept KV copied to host memory (dst None) or back onto the slice's mesh;
        counted in the slice's stats."""
        t = time.perf_counter()
        if dst is None:
            moved = jax.device_get(kept)
        else:
            moved = jax.block_until_ready(jax.device_put(kept, dst))
        self._stats.kv_host_copies += 1
        self._stats.kv_host_bytes += sum(np.asarray(x).nbytes if dst is None else x.nbytes
                                         for x in jax.tree.leaves(moved))
        self._stats.kv_host_seconds += time.perf_counter() - t
        return moved

    def collect(self) -> list:
        """The answers that are in, as (episode's InFlight, why it ended or None). None:
        the observation was appended and the KV kept; the slice queues it first."""
        if not self._at_env:  # every step asks: a single-turn slice pays nothing
            return []
        now, out = time.perf_counter(), []
        for rid, (seq, kept, call) in list(self._at_env.items()):
            if call.future.done():
                result, seconds, error = call.future.result()
            elif call.timed_out(now, self._episode_runner.timeout):
                call.future.cancel()
                result, seconds, error = None, now - call.started, "env_timeout"
            else:
                continue
            del self._at_env[rid]
            out.append((seq, self._answer(seq, kept, result, seconds, error)))
        return out

    def _answer(self, seq: InFlight, kept: Prefix | None, result: StepResult | None,
                seconds: float, error: str | None) -> str | None:
        episode = _episode(seq)
        episode.env_seconds += seconds
        if result is None or error is not None:
            episode.error = error
            return "env_timeout" if result is None else "env_error"
        episode.reward += float(result.reward)
        episode.info.update({k: v for k, v in result.info.items()
                             if isinstance(v, (int, float))})
        if result.done:
            return "done"
        if episode.model_turns >= self._episode_runner.max_turns:
            return "max_turns"
        obs = self._episode_runner.observation_tokens(result.observation)
        limit = min(seq.request.max_new_tokens or self._max_decode_len, self._max_decode_len)
        if len(seq.response_tokens) + len(obs) + 1 > limit:  # no room for a model token
            return "budget"
        start = len(seq.response_tokens)
        seq.response_tokens.extend(obs)
        seq.behaviour_logprobs.extend([0.0] * len(obs))
        versions_lib.extend(seq.versions, seq.version, len(obs))
        episode.turns.append(["env", start, len(seq.response_tokens), round(seconds, 6)])
        if self._to_host and kept is not None:
            kept = self._move(kept, self._engine.get_prefix_destination_sharding())
        seq.kept, seq.unwritten = kept, len(obs) + 1
        return None

    def wait(self, timeout: float) -> None:
        """Blocks until an environment answers or `timeout` (nothing else to do)."""
        concurrent.futures.wait([call.future for _, _, call in self._at_env.values()],
                                timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def take(self, request_id: tuple) -> tuple | None:
        """Removes an episode at its environment (migration): (InFlight, kept KV,
        EnvCall), or None if it is not there."""
        return self._at_env.pop(request_id, None)

    def put(self, seq: InFlight, kept: Any, env_call: Any) -> None:
        """Takes over an episode whose environment call (EnvCall) is pending,
        its kept KV (from another slice) placed where this slice keeps it."""
        if kept is not None:
            kept = (self._move(kept, None) if self._to_host else
                    jax.device_put(kept, self._engine.get_prefix_destination_sharding()))
        self._at_env[seq.request.request_id] = (seq, kept, env_call)

    def drop_kept(self) -> None:
        """Forgets the kept KV (computed under params being replaced)."""
        for rid, (seq, _, call) in self._at_env.items():
            self._at_env[rid] = (seq, None, call)

    def clear(self) -> None:
        self._at_env.clear()


def _episode(seq: InFlight) -> Episode:
    """The episode of a request the caller knows to be one."""
    assert seq.episode is not None
    return seq.episode
