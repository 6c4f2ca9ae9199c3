"""Multi-turn episodes: the turn structure of a simulated request.

An episode is one request whose response alternates model turns and environment
observations: model turn 1, an environment call (a latency in seconds, after which
an observation of some tokens arrives), model turn 2, ... model turn n. The episode
finishes after its last model turn, so it has n model turns and n - 1 observations.
A single-turn request is the episode of one turn with no environment call.

`Turns` draws the structure per request, deterministically per (seed, group):

- the number of model turns is geometric with mean `mean_turns`, clipped to
  [1, max_turns] (most episodes are short, a few run many turns);
- each model turn's tokens follow the workload's per-turn length model (log-normal
  around a per-prompt factor, `cost.Workload`);
- observation tokens are log-normal around `obs_mean` (clipped to [1, max_obs]);
- environment latencies are log-normal with median `env_median` seconds (clipped
  to `max_env`);
- the whole response (model and observation tokens) is cut at `max_response`: the
  turn that reaches it ends there and the episode with it, as a context limit would.

What is counted: an episode's `response_len` (the ledger's, the trained tokens, the
KV and any re-prefill) includes its observations, the tokens the trainer reads; its
generated tokens (decode throughput, `generated_tokens_per_second`) are its model
turns only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np


class Episode(NamedTuple):
    """One request's turn structure: tokens of each model turn, of each observation
    (one fewer) and the environment's latency before each observation (seconds)."""

    model: tuple
    observations: tuple = ()
    latencies: tuple = ()

    @property
    def response_len(self) -> int:
        """Positions of the response: model and observation tokens (the sequence the
        trainer reads and the KV holds)."""
        return sum(self.model) + sum(self.observations)

    def turn_ranges(self) -> list:
        """The ledger's `turns` (dora_jax/base/turns.py): response-token ranges, each
        observation with its environment's latency."""
        out, at = [], 0
        for i, n in enumerate(self.model):
            if i:
                obs = self.observations[i - 1]
                out.append(["env", at, at + obs, round(float(self.latencies[i - 1]), 6)])
                at += obs
            out.append(["model", at, at + n])
            at += n
        return out


def single_turn(length: int) -> Episode:
    """The episode of a single-turn request of `length` tokens."""
    return Episode((length,))


@dataclasses.dataclass(frozen=True)
class Turns:
    """How a workload's requests are split into turns (see the module docstring)."""

    mean_turns: float = 4.0
    max_turns: int = 32
    obs_mean: float = 300.0
    obs_sigma: float = 0.8
    max_obs: int = 4096
    env_median: float = 0.1
    env_sigma: float = 0.8
    max_env: float = 2.0
    max_response: int = 30_720

    def draw(self, rng: np.random.Generator, turn_lengths: Callable[[int], list]) -> Episode:
        """One episode: its turn count from `rng`, its model turns from
        `turn_lengths(n)` (n per-turn lengths), its observations and latencies from
        `rng`, cut at `max_response`."""
        n = int(min(rng.geometric(1.0 / self.mean_turns), self.max_turns))
        model = turn_lengths(n)
        obs_mu = math.log(self.obs_mean) - self.obs_sigma ** 2 / 2
        obs = np.clip(np.exp(rng.normal(obs_mu, self.obs_sigma, n - 1)), 1,
                      self.max_obs).astype(int).tolist()
        env = np.minimum(self.env_median * np.exp(rng.normal(0, self.env_sigma, n - 1)),
                         self.max_env).tolist()
        return self._cut(model, obs, env)

    def _cut(self, model: list, obs: list, env: list) -> Episode:
        """The episode cut where its response reaches `max_response` positions (a
        model turn that reaches it is shortened and is the last; an observation
        that would reach it is not taken, its model turn is the last)."""
        total, kept = 0, []
        for i, m in enumerate(model):
            m = min(m, self.max_response - total)
            kept.append(m)
            total += m
            if i == len(model) - 1 or total + obs[i] >= self.max_response:
                break
            total += obs[i]
        n = len(kept)
        return Episode(tuple(kept), tuple(obs[:n - 1]), tuple(env[:n - 1]))


def episodes(turns: Turns, seed: int, group_size: int,
             turn_lengths: Callable[[np.random.Generator], Callable[[int], list]]
             ) -> Callable[[int, int], Episode]:
    """episode(group_id, sample): the group's episodes drawn once, deterministic per
    (seed, group). `turn_lengths(rng)` is called once per group with the group's
    generator (so it can draw a per-prompt factor) and returns the function that
    gives one sample's n model-turn lengths."""
    cache: dict = {}

    def episode(g: int, k: int) -> Episode:
        if g not in cache:
            rng = np.random.default_rng([seed, g, 1])
            draw = turn_lengths(rng)
            cache[g] = [turns.draw(rng, draw) for _ in range(group_size)]
        return cache[g][k]

    return episode
