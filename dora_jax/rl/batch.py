"""Train-batch format: finished trajectories -> padded numpy arrays for the train step.

A batch is B = num_groups * group_size samples, group-contiguous (samples of one
group are consecutive rows, groups in first-appearance order). Every row is
`prompt + response` right-padded to one of a few length buckets, so the jitted step
compiles once per bucket, not once per length. Right padding needs no attention
mask: attention is causal, real tokens never see the padding after them.

Alignment follows `transformer.token_logprobs`: column t holds the log-prob of token
t given tokens < t, so a response occupying columns [P, P+R) has its behaviour
log-probs in exactly those columns and `loss_mask_BT` is 1 there, except on a
multi-turn episode's observation tokens (`episode["turns"]`): the environment wrote
them, so they carry no loss and no log-prob ratio, in every objective and layout.
Column 0 can never be a response token (no context), so every prompt has at least
one token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from dora_jax.base import versions
from dora_jax.base.buckets import BucketError, pick_bucket
from dora_jax.base.turns import model_token_mask

# Behaviour log-probs come from the decode engine in float32; allow rounding above 0.
_LOGP_SLACK = 1e-4


class BatchError(ValueError):
    """A train batch (or the trajectories it is built from) is malformed."""


# What a batch reads of each finished sample (`rollout.Trajectory`, or a Mapping
# with these keys). `version` is the group's version: all samples of a group share it.
# Optional: `versions` (per-token versions, run-length encoded; default: every token
# the group's version), `finish_reason` ("length": cut at max_decode_len) and
# `episode` (a multi-turn episode: its observation tokens get no loss).
_TRAJ_FIELDS = ("prompt_tokens", "response_tokens", "behaviour_logprobs", "reward",
                "group_id", "version")
_MISSING = object()


def _get(traj: Any, name: str, default: Any = _MISSING) -> Any:
    """Reads a trajectory field from a Mapping or an object with attributes."""
    if isinstance(traj, Mapping):
        if name in traj:
            return traj[name]
    elif hasattr(traj, name):
        return getattr(traj, name)
    if default is not _MISSING:
        return default
    raise BatchError(f"trajectory {type(traj).__name__} has no field {name!r}; "
                     f"needs {_TRAJ_FIELDS}")


def _token_versions(runs: Sequence[Sequence[int]] | None, version: int, n: int) -> np.ndarray:
    """Run-length encoded [[version, count], ...] -> one version per token."""
    if runs is None:
        return np.full(n, version, np.int32)
    out = np.asarray(versions.expand(runs), np.int32)
    if out.size != n:
        raise BatchError(f"per-token versions cover {out.size} tokens, the response has {n}")
    return out


@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """Padded train batch; every array's leading dimension is B (samples).

    tokens_BT: int32, prompt + response, right-padded with pad_id.
    loss_mask_BT: float32, 1.0 on response tokens, 0.0 on prompt and padding.
    behaviour_logp_BT: float32, decode-engine log-prob of token t at column t (0 off-mask).
    rewards_B: float32 scalar reward per sample.
    versions_B: int32 policy version of each sample's group (its admission version).
    seq_lens_B: int32 prompt + response length (the unpadded row length).
    token_versions_BT: int32 version that sampled token t at column t (the group's
      version for every token under C1; several after a partial-rollout reload);
      0 off the loss mask. None: every token the row's version.
    truncated_B: bool, the response was cut at max_decode_len (no EOS). None: none.
    group_size: samples per group; rows [g*G, (g+1)*G) form group g.
    group_ids: one id per group, in row order (for the ledger; the step ignores it).
    routing_BTLK: an MoE rollout's experts of the token at column t [B, T, MoE layers,
      k] (rollout/routing.py; unrecorded on prompts and padding). None: none recorded.
    """

    tokens_BT: np.ndarray
    loss_mask_BT: np.ndarray
    behaviour_logp_BT: np.ndarray
    rewards_B: np.ndarray
    versions_B: np.ndarray
    seq_lens_B: np.ndarray
    group_size: int
    group_ids: tuple = ()
    token_versions_BT: Any = None
    truncated_B: Any = None
    routing_BTLK: Any = None

    def __post_init__(self) -> None:
        if self.token_versions_BT is None:
            object.__setattr__(self, "token_versions_BT", (
                np.asarray(self.versions_B, np.int32)[:, None]
                * (np.asarray(self.loss_mask_BT) != 0)).astype(np.int32))
        if self.truncated_B is None:
            object.__setattr__(self, "truncated_B", np.zeros(len(self.rewards_B), bool))
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]

    @property
    def length(self) -> int:
        return self.tokens_BT.shape[1]

    @property
    def num_groups(self) -> int:
        return self.batch_size // self.group_size

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask_BT.sum())

    def validate(self) -> None:
        """Checks shapes, dtypes and values; raises BatchError naming the problem."""
        if self.tokens_BT.ndim != 2:
            raise BatchError(f"tokens_BT must be [B, T], got shape {self.tokens_BT.shape}")
        B, T = self.tokens_BT.shape
        if B == 0:
            raise BatchError("empty batch")
        for name in ("loss_mask_BT", "behaviour_logp_BT", "token_versions_BT"):
            if getattr(self, name).shape != (B, T):
                raise BatchError(f"{name} must have shape {(B, T)} like tokens_BT, "
                                 f"got {getattr(self, name).shape}")
        if self.routing_BTLK is not None and self.routing_BTLK.shape[:2] != (B, T):
            raise BatchError(f"routing_BTLK must start with {(B, T)} like tokens_BT, got "
                             f"{self.routing_BTLK.shape}")
        for name in ("rewards_B", "versions_B", "seq_lens_B", "truncated_B"):
            if getattr(self, name).shape != (B,):
                raise BatchError(f"{name} must have shape {(B,)}, got {getattr(self, name).shape}")
        if not np.issubdtype(self.tokens_BT.dtype, np.integer):
            raise BatchError(f"tokens_BT must be integer, got {self.tokens_BT.dtype}")
        if not isinstance(self.group_size, (int, np.integer)) or self.group_size <= 0:
            raise BatchError(f"group_size must be a positive integer, got {self.group_size!r}")
        if B % self.group_size:
            raise BatchError(f"batch size B={B} is not a multiple of group_size={self.group_size}")
        if self.group_ids and len(self.group_ids) != B // self.group_size:
            raise BatchError(f"group_ids has {len(self.group_ids)} entries for "
                             f"{B // self.group_size} groups")
        mask = self.loss_mask_BT
        if not np.all((mask == 0) | (mask == 1)):
            raise BatchError("loss_mask_BT must be 0/1")
        if mask[:, 0].any():
            raise BatchError("loss_mask_BT[:, 0] must be 0: the first token has no context, "
                             "so every prompt needs at least one token")
        if np.any(self.seq_lens_B < 1) or np.any(self.seq_lens_B > T):
            raise BatchError(f"seq_lens_B must lie in [1, T={T}]")
        beyond = np.arange(T)[None, :] >= self.seq_lens_B[:, None]
        if (mask * beyond).any():
            raise BatchError("loss_mask_BT marks padding positions (beyond seq_lens_B)")
        logp = self.behaviour_logp_BT[mask != 0]
        if not np.all(np.isfinite(logp)):
            raise BatchError("behaviour_logp_BT is not finite on response tokens")
        if np.any(logp > _LOGP_SLACK):
            raise BatchError(f"behaviour_logp_BT must be log-probabilities (<= 0); "
                             f"max on response tokens is {logp.max():.4g}")
        if not np.all(np.isfinite(self.rewards_B)):
            raise BatchError("rewards_B must be finite")
        if np.any(self.token_versions_BT[mask != 0]
                  < np.broadcast_to(self.versions_B[:, None], (B, T))[mask != 0]):
            raise BatchError("token_versions_BT holds a token older than its group's version")
        versions_GK = self.versions_B.reshape(-1, self.group_size)
        mixed = np.nonzero(np.any(versions_GK != versions_GK[:, :1], axis=1))[0]
        if mixed.size:
            raise BatchError(f"group {int(mixed[0])} mixes policy versions "
                             f"{sorted(set(versions_GK[mixed[0]].tolist()))}: all samples of a "
                             "group must come from one version (C1)")

    @classmethod
    def from_trajectories(cls, trajectories: Iterable[Any], *, group_size: int,
                          length_buckets: Sequence[int], pad_id: int = 0) -> TrainBatch:
        """Builds a batch from finished trajectories (Trajectory, dict or similar).

        Trajectories are grouped by `group_id` (groups in first-appearance order,
        samples in the given order); every group must have exactly `group_size`
        samples of one version. T is the smallest of `length_buckets` that holds the
        longest prompt + response.
        """
        trajs = list(trajectories)
        if not trajs:
            raise BatchError("no trajectories")
        groups: dict[Hashable, list] = {}
        for t in trajs:
            groups.setdefault(_get(t, "group_id"), []).append(t)
        for gid, members in groups.items():
            if len(members) != group_size:
                raise BatchError(f"group {gid!r} has {len(members)} trajectories, "
                                 f"expected group_size={group_size}")
        ordered = [t for members in groups.values() for t in members]
        rows = []
        for i, t in enumerate(ordered):
            prompt = np.asarray(_get(t, "prompt_tokens"), np.int64).reshape(-1)
            response = np.asarray(_get(t, "response_tokens"), np.int64).reshape(-1)
            logp = np.asarray(_get(t, "behaviour_logprobs"), np.float32).reshape(-1)
            if prompt.size == 0:
                raise BatchError(f"trajectory {i} (group {_get(t, 'group_id')!r}) has an empty "
                                 "prompt; the first token needs no log-prob but must exist")
            if logp.size != response.size:
                raise BatchError(f"trajectory {i} (group {_get(t, 'group_id')!r}) has "
                                 f"{response.size} response tokens but {logp.size} behaviour "
                                 "log-probs")
            version = int(_get(t, "version"))
            try:
                tv = _token_versions(_get(t, "versions", None), version, response.size)
            except BatchError as e:
                raise BatchError(f"trajectory {i} (group {_get(t, 'group_id')!r}): {e}") from None
            model = np.asarray(model_token_mask(_get(t, "episode", None), response.size),
                               np.float32)
            rows.append((prompt, response, logp, float(_get(t, "reward")), version, tv,
                         _get(t, "finish_reason", "eos") == "length", model,
                         _get(t, "routing", None)))
        B = len(rows)
        longest = max(p.size + r.size for p, r, *_ in rows)
        try:
            T = pick_bucket(longest, length_buckets, "trainer.length_buckets")
        except BucketError as e:
            raise BatchError(f"a trajectory (prompt + response): {e}") from None
        tokens = np.full((B, T), pad_id, np.int32)
        mask = np.zeros((B, T), np.float32)
        logp_BT = np.zeros((B, T), np.float32)
        seq_lens = np.zeros((B,), np.int32)
        token_versions = np.zeros((B, T), np.int32)
        routing = _routing(rows, T, i_first=next(
            (i for i, r in enumerate(rows) if r[8] is not None), None))
        for i, (prompt, response, logp, _, _, tv, _, model, recorded) in enumerate(rows):
            P, R = prompt.size, response.size
            if recorded is not None:
                assert routing is not None  # shaped like the first record
                if recorded.shape[0] != R or recorded.shape[1:] != routing.shape[2:]:
                    raise BatchError(f"trajectory {i}: routing of shape {recorded.shape} for "
                                     f"{R} response tokens, others {routing.shape[2:]}")
                routing[i, P:P + R] = recorded
            tokens[i, :P] = prompt
            tokens[i, P:P + R] = response
            mask[i, P:P + R] = model
            logp_BT[i, P:P + R] = logp * model
            token_versions[i, P:P + R] = tv * model.astype(np.int32)
            seq_lens[i] = P + R
        return cls(tokens_BT=tokens, loss_mask_BT=mask, behaviour_logp_BT=logp_BT,
                   rewards_B=np.array([r[3] for r in rows], np.float32),
                   versions_B=np.array([r[4] for r in rows], np.int32),
                   seq_lens_B=seq_lens, group_size=group_size, group_ids=tuple(groups),
                   token_versions_BT=token_versions,
                   truncated_B=np.array([r[6] for r in rows], bool), routing_BTLK=routing)


def _routing(rows: Sequence[tuple[Any, ...]], T: int, i_first: int | None) -> np.ndarray | None:
    """An unrecorded [B, T, MoE layers, k] array shaped like the first record, or None
    if no trajectory has one."""
    if i_first is None:
        return None
    first = np.asarray(rows[i_first][8])
    # rollout/routing.py's convention, kept here so the batch format imports no JAX
    return np.full((len(rows), T, *first.shape[1:]), np.iinfo(first.dtype).max, first.dtype)
