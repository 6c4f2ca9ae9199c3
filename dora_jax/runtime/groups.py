"""The group book: a group's host-side life, from its prompt to its ledger line.

The scheduler knows a group's samples by status; this book holds what the host keeps
for it: the prompt record, the finished trajectories, each sample's reward future (the
reward pool scores samples as they finish), the shaped rewards (computed once, when the
last reward is in), and the forms it leaves in — a `consume` or `filter` ledger line,
a checkpoint entry, an `unconsumed` line at exit.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from dora_jax.rewards import pool, shaping
from dora_jax.rollout.trajectory import Trajectory
from dora_jax.scheduler import driver
from dora_jax.scheduler.types import Admit

if TYPE_CHECKING:
    from dora_jax.config import Config


@dataclasses.dataclass
class Group:
    """One admitted group on the host."""

    record: dict  # the prompt record (prompt_id, tokens, ...)
    version: int  # the policy version it was admitted under
    trajectories: dict = dataclasses.field(default_factory=dict)  # sample -> Trajectory
    rewards: dict = dataclasses.field(default_factory=dict)  # sample -> Future((r, err))
    _penalties: list | None = None
    _shaped: list | None = None

    def shape(self, cfg: Config) -> tuple[list, list]:
        """(rewards the trainer sees, overlong penalties), in sample order; computed
        on the first call, which must come after every reward is in."""
        if self._shaped is None or self._penalties is None:  # set together
            t = cfg.trainer
            self._shaped, self._penalties = shaping.shaped_rewards(
                [self.rewards[k].result()[0] for k in sorted(self.trajectories)],
                [len(x.response_tokens) for x in self.samples()],
                cfg.rollout.max_decode_len, t.overlong_buffer, t.overlong_penalty)
        return self._shaped, self._penalties

    def samples(self) -> list[Trajectory]:
        return [self.trajectories[k] for k in sorted(self.trajectories)]


class GroupBook:
    """Every admitted, not yet consumed or filtered group, by id.

    Args:
      cfg: the validated run config (reward shaping reads it).
      rewards: the reward pool (`submit_many([(record, response)]) -> [Future]`).
      write: writes one ledger line (`LedgerWriter.write`).
      clock: seconds since the run started.
    """

    def __init__(self, cfg: Config, rewards: pool.RewardPool, write: Callable[..., None],
                 clock: Callable[[], float]) -> None:
        self.cfg, self._rewards, self._write, self._clock = cfg, rewards, write, clock
        self.groups: dict[int, Group] = {}

    def __getitem__(self, gid: int) -> Group:
        return self.groups[gid]

    def admit(self, a: Admit, record: dict) -> None:
        """Group `a.group_id` enters at `a.version` with prompt `record`: its `admit` line."""
        self.groups[a.group_id] = Group(record, a.version)
        self._write(**driver.admit_record(a, record["prompt_id"], self._clock()))

    def finished(self, ts: Sequence[Trajectory]) -> None:
        """Keeps samples that finished together and sends them to the reward pool in
        one submission."""
        to_score = []
        for t in ts:
            g = self.groups[t.group_id]
            g.trajectories[t.sample_index] = t
            if t.episode is None:
                to_score.append(t)
            else:  # scored by its environment, turn by turn
                g.rewards[t.sample_index] = _resolved((float(t.episode["reward"]),
                                                       t.episode.get("error")))
        futures = self._rewards.submit_many(
            [(self.groups[t.group_id].record, t.response_tokens) for t in to_score])
        for t, future in zip(to_score, futures, strict=True):
            self.groups[t.group_id].rewards[t.sample_index] = future

    def when_scored(self, gid: int, callback: Callable[[], None]) -> None:
        """Calls `callback` once every reward of the (finished) group is in, in the
        thread that completes the last one: the coordinator never waits."""
        pool.when_all_done(list(self.groups[gid].rewards.values()), callback)

    def keeps_signal(self, gid: int) -> bool:
        """False (and the group leaves with a `filter` line) if every shaped reward is
        equal: every advantage would be 0 (DAPO's dynamic sampling)."""
        g = self.groups[gid]
        shaped, _ = g.shape(self.cfg)
        if shaping.has_signal(shaped):
            return True
        del self.groups[gid]
        self._write(**driver.filter_record(gid, g.record["prompt_id"], g.version,
                                           self._clock(), reward=shaped[0]))
        return False

    def batch(self, group_ids: Iterable[int]) -> list[Trajectory]:
        """The trajectories of a train step's groups, each carrying its shaped reward."""
        out = []
        for gid in group_ids:
            g = self.groups[gid]
            for t, reward in zip(g.samples(), g.shape(self.cfg)[0]):
                t.reward = reward
                out.append(t)
        return out

    def consume(self, group_ids: Iterable[int], step: int, time: float) -> None:
        """The groups were trained by `step`: their `consume` lines, and they leave."""
        for gid in group_ids:
            g = self.groups.pop(gid)
            self._write(**driver.consume_record(gid, g.record["prompt_id"], g.version, step,
                                                time, self._sample_entries(g)))

    def _sample_entries(self, g: Group) -> list:
        shaped, penalties = g.shape(self.cfg)
        entries = []
        for t, penalty in zip(g.samples(), penalties):
            reward, error = g.rewards[t.sample_index].result()
            episode = t.episode or {}
            entries.append(driver.sample_entry(
                t.sample_index, t.versions, t.slice_ids, len(t.response_tokens),
                t.finish_reason, reward, overlong_penalty=penalty, reward_error=error,
                turns=episode.get("turns"), env_s=episode.get("env_s"),
                episode_end=episode.get("end"), env_info=episode.get("info"),
                sandbox=episode.get("sandbox")))
        return entries

    # ------------------------------------------------------------ recovery

    def checkpoint_form(self, group_ids: Iterable[int]) -> dict:
        """The finished (scored) groups a checkpoint keeps, as JSON."""
        out = {}
        for gid in group_ids:
            g = self.groups[gid]
            out[str(gid)] = {"version": g.version, "record": g.record,
                             "samples": [t.to_dict() for t in g.samples()],
                             "rewards": [list(g.rewards[t.sample_index].result())
                                         for t in g.samples()]}
        return out

    def restore(self, kept: dict) -> None:
        """Takes back the finished groups a checkpoint kept (`checkpoint_form`)."""
        for gid, saved in kept.items():
            g = self.groups[gid] = Group(saved["record"], saved["version"])
            for d, (reward, error) in zip(saved["samples"], saved["rewards"]):
                t = Trajectory.from_dict(d)
                g.trajectories[t.sample_index] = t
                g.rewards[t.sample_index] = _resolved((reward, error))

    def write_unconsumed(self, readmit_queue: Iterable[int] = ()) -> None:
        """At exit: an `unconsumed` line for every group still here, and for every
        lost one not admitted again yet (its version: None)."""
        for gid, g in sorted(self.groups.items()):
            self._write("unconsumed", group_id=gid, version=g.version)
        for gid in readmit_queue:
            self._write("unconsumed", group_id=gid, version=None)


def _resolved(result: tuple[float, str | None]) -> concurrent.futures.Future:
    """A future already holding `result`: a reward known without the pool."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(result)
    return done
