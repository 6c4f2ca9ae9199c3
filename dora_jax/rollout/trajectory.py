"""Rollout data: requests going into a decode slice, trajectories coming out, and
the records a scheduler reads (slice counters, exported in-flight requests).

Host-side records. A `Trajectory` is one ledger row's rollout part: `to_dict()`
gives plain JSON types and `from_dict` reads it back. A sample is one `InFlight`
record from its submission to its end, on a slice or between two (exported), and
becomes a Trajectory when it finishes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from dora_jax.base import versions as versions_lib
from dora_jax.rollout import routing as routing_lib
from dora_jax.rollout.sampling import Seed, key_data_from_seed


class RolloutError(RuntimeError):
    """Base class of the slice's refusals; the slice is unchanged when one is raised."""


class VersionMismatchError(RolloutError):
    """An operation would mix policy versions on a slice (constraint C1)."""


class SlotOverflowError(RolloutError):
    """More requests than the slice has free slots."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One sample to generate.

    group_id, sample_index: identify the request (`request_id`); prompt_id: the
    prompt's id in the data source. seed: the request's RNG, an int in [0, 2**64)
    or uint32[2] key data; token n of the response is drawn with fold_in(key, n).
    version: the policy version it must run under (the slice refuses any other).
    group_version: the version of its group, when the request runs under another
      (partial_rollout); None means `version`.
    max_new_tokens: response-length limit of this request; None: the engine's
      max_decode_len (the smaller of the two applies).
    record: the prompt record, for a multi-turn episode (its environment's `reset`
      reads it); None for a single-turn sample.
    """

    group_id: int
    prompt_id: int | str
    sample_index: int
    prompt_tokens: tuple
    seed: Seed
    version: int
    group_version: int | None = None
    max_new_tokens: int | None = None
    record: dict | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in self.prompt_tokens))

    @property
    def request_id(self) -> tuple:
        return (self.group_id, self.sample_index)

    def key_data(self) -> np.ndarray:
        return key_data_from_seed(self.seed)

    def check(self, max_prefill_length: int, vocab_size: int) -> None:
        """Raises ValueError on an empty or too long prompt, a prompt id outside the
        vocabulary, or a bad seed."""
        n, rid = len(self.prompt_tokens), self.request_id
        if n == 0:
            raise ValueError(f"request {rid}: empty prompt")
        if n > max_prefill_length:
            raise ValueError(f"request {rid}: prompt of {n} tokens exceeds "
                             f"max_prefill_length {max_prefill_length}")
        if min(self.prompt_tokens) < 0 or max(self.prompt_tokens) >= vocab_size:
            raise ValueError(f"request {rid}: prompt token ids must be in [0, {vocab_size})")
        self.key_data()


@dataclasses.dataclass
class Trajectory:
    """A finished sample with its provenance: what the reward function scores, the
    train batch reads (`rl.batch.TrainBatch.from_trajectories`) and the ledger
    records.

    version: the group's version, the one the sample was submitted under (C1: every
      token's, unless a partial-rollout reload happened; see `versions`).
    versions: run-length encoded behaviour versions, [[version, n_tokens], ...] in
      token order (one run unless a partial-rollout reload happened mid-sequence).
    behaviour_logprobs: log-prob of each response token under the distribution it
      was sampled from (tempered, truncated), from the version that sampled it.
    slice_ids: slices that held the request, in order (more than one after migration).
    t_submit, t_start, t_finish: wall-clock seconds (submit, first prefill, last token).
    reward: None from the slice; the runtime fills it in after scoring.
    episode: a multi-turn episode's record (rollout/episodes.py `Episode.summary`):
      its turns as response-token ranges [role, start, end, env seconds], the
      environment's reward and info, why it ended; None for a single-turn sample.
    routing: an MoE policy's experts per response token (rollout/routing.py), None
      for a dense one.
    """

    group_id: int
    prompt_id: int | str
    sample_index: int
    version: int
    prompt_tokens: list
    response_tokens: list
    behaviour_logprobs: list
    versions: list
    slice_ids: list
    finish_reason: str
    t_submit: float
    t_start: float
    t_finish: float
    reward: float | None = None
    episode: dict | None = None
    routing: np.ndarray | None = dataclasses.field(default=None, compare=False)

    @property
    def request_id(self) -> tuple:
        return (self.group_id, self.sample_index)

    def token_versions(self) -> list:
        return versions_lib.expand(self.versions)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["prompt_tokens"] = [int(t) for t in self.prompt_tokens]
        d["response_tokens"] = [int(t) for t in self.response_tokens]
        d["behaviour_logprobs"] = [float(x) for x in self.behaviour_logprobs]
        d["versions"] = [[int(v), int(n)] for v, n in self.versions]
        d["slice_ids"] = [int(s) for s in self.slice_ids]
        d["routing"] = routing_lib.to_json(self.routing)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        t = cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
        t.routing = routing_lib.from_json(d.get("routing"))
        return t


@dataclasses.dataclass
class SliceStats:
    """Per-slice counters (monotonic over the slice's life)."""

    generate_calls: int = 0  # dispatched
    generate_steps: int = 0  # decode steps run (read back), up to decode_steps per call
    busy_slot_steps: int = 0  # slots that produced a token, summed over steps read
    total_slot_steps: int = 0  # S per decode step run
    prefills: int = 0  # forward passes over a prompt (+ tokens so far)
    prefills_shared: int = 0  # samples started from their group's prompt prefix
    prefill_tokens: int = 0  # prompt positions run through a prefill
    reprefill_tokens: int = 0  # response tokens run again (resumed, re-prefilled, moved)
    finished: int = 0
    weight_loads: int = 0
    weight_transfer_seconds: float = 0.0
    weight_bytes: int = 0  # placed by weight loads (LoRA: a base held is not moved)
    interrupts: int = 0
    migrated_in: int = 0
    migrated_out: int = 0
    preempted: int = 0  # running requests sent back to waiting: the KV pool was full
    observation_tokens: int = 0  # episodes' observation tokens prefilled on kept KV
    observation_batches: int = 0  # prefill calls that ran several episodes' observations
    observations_batched: int = 0  # the observations they ran
    kv_host_copies: int = 0  # episodes' kept KV moved to host memory or back
    kv_host_bytes: int = 0
    kv_host_seconds: float = 0.0
    peak_pages: int = 0  # most KV pages in use at once (paged cache)

    @property
    def utilisation(self) -> float:
        return self.busy_slot_steps / self.total_slot_steps if self.total_slot_steps else 0.0


@dataclasses.dataclass(slots=True)
class InFlight:
    """A sample in flight: held by a slice (waiting, in a slot, or at its environment)
    or exported from one for another (`DecodeSlice.export_requests`). Its fields are
    Trajectory's where they mean the same; a running sample's newest tokens live in
    the slice's SlotTable until flushed here.

    prefix: an exported running sample's decode state (KV cache, next input token,
      position, RNG key data and step) on the source slice's devices; else None.
    kept, unwritten: a multi-turn episode between turns: the KV of all but its last
      `unwritten` tokens (the turn's end and the observation, prefilled on top).
    env_call: exported while its environment works on its turn: its
      episodes.EnvCall; the destination waits for it as the source would.
    slot: the slot it holds (None: waiting, at its environment, or exported).
    """

    request: Request
    version: int
    response_tokens: list
    behaviour_logprobs: list
    versions: list  # run-length encoded, as in Trajectory
    slice_ids: list
    t_submit: float
    t_start: float | None
    prefix: Any | None = None  # engine.Prefix
    kept: Any | None = None
    unwritten: int = 0
    episode: Any | None = None  # rollout.episodes.Episode of a multi-turn request
    env_call: Any = None
    slot: int | None = None
    routing: np.ndarray | None = None  # rollout/routing.py's buffer, grown as recorded

    @property
    def length(self) -> int:
        """Prompt and response tokens so far."""
        return len(self.request.prompt_tokens) + len(self.response_tokens)

    @classmethod
    def submitted(cls, request: Request, slice_id: int, t_submit: float) -> InFlight:
        return cls(request, request.version, [], [], [], [slice_id], t_submit, None)

    def taken_over(self, slice_id: int) -> InFlight:
        """The record a slice importing this one holds: lists of its own, its id
        appended to `slice_ids`, nothing of the hand-over (prefix, env_call)."""
        return dataclasses.replace(
            self, response_tokens=list(self.response_tokens),
            behaviour_logprobs=list(self.behaviour_logprobs),
            versions=[list(r) for r in self.versions],
            slice_ids=list(self.slice_ids) + [slice_id], prefix=None, env_call=None,
            slot=None, routing=None if self.routing is None else self.routing.copy())

    def to_trajectory(self, finish_reason: str, t_finish: float) -> Trajectory:
        r = self.request
        assert self.t_start is not None  # set by its first prefill: only then can it finish
        return Trajectory(
            group_id=r.group_id, prompt_id=r.prompt_id, sample_index=r.sample_index,
            version=r.version if r.group_version is None else r.group_version,
            prompt_tokens=list(r.prompt_tokens), response_tokens=self.response_tokens,
            behaviour_logprobs=self.behaviour_logprobs, versions=self.versions,
            slice_ids=self.slice_ids, finish_reason=finish_reason, t_submit=self.t_submit,
            t_start=self.t_start, t_finish=t_finish,
            episode=None if self.episode is None else self.episode.summary(),
            routing=routing_lib.cut(self.routing, len(self.response_tokens)))
