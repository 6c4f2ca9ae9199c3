"""The engine's pytrees: params as it takes them, the decode state of S slots, one
prompt's prefix for N samples (what prefill returns, insert takes and migration
moves), and the packed per-sample results of prefill and generate calls, shaped as
JetStream's `engine_api.ResultTokens`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, dataclass_transform

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dora_jax.model import transformer

if TYPE_CHECKING:
    _T = TypeVar("_T")

    # mypy does not read flax (pyproject.toml); this tells it what struct.dataclass
    # makes: a frozen dataclass (and a pytree, which mypy need not know).
    @dataclass_transform(frozen_default=True)
    def _pytree_dataclass(cls: type[_T]) -> type[_T]: ...
else:
    _pytree_dataclass = struct.dataclass


class EngineParams(NamedTuple):
    """Params as the engine takes them: the leaves of the model's param State, placed
    on the engine mesh. A flat tuple, because flattening an nnx.State on every call
    costs more host time than a small decode step. A multi-version engine's adapter
    leaves hold every place (rollout/adapters.py) and `rows` (int32 [B]) names the
    place each row of the call decodes under; None on a one-version engine."""

    leaves: tuple
    rows: jax.Array | None = None


class DecodeState(NamedTuple):
    """Everything generate needs, for S slots. Donated to (consumed by) each call."""

    # One buffer per layer; dense: [S, kv_heads, cache_length, head_dim] each; paged:
    # the pool, [kv_heads, pages + 1, page_size, head_dim] (page 0: the null page).
    cache: transformer.LayerCaches
    tokens: jax.Array  # int32[S] next decode input: the slot's last sampled token
    positions: jax.Array  # int32[S] position of that token in prompt + response
    steps: jax.Array  # int32[S] response index of the next token to sample
    keys: jax.Array  # uint32[S, 2] request RNG key data
    active: jax.Array  # bool[S] slot holds an unfinished request
    limits: jax.Array  # int32[S] the request's response-length limit


class Prefix(NamedTuple):
    """One prompt's decode state for N samples of it, ready for `insert` (N=1) or
    `bulk_insert` (N slots): from prefill (N=1), prefill_multisampling or extract.
    The samples share the KV cache; each has its own first token and RNG key."""

    cache: transformer.KVCache  # [layers, 1, T, kv_heads, head_dim], T <= cache_length
    token: jax.Array  # int32[N] last sampled token of each sample (next decode input)
    position: jax.Array  # int32[] its position
    step: jax.Array  # int32[] response index of the next token to sample
    key: jax.Array  # uint32[N, 2] each sample's RNG key data
    active: jax.Array  # bool[N] False where the sample has already finished
    limit: jax.Array  # int32[] the request's response-length limit
    # f32[V] logits that sampled `token`: another sample of the same prompt draws its
    # first token from them (`prefill(existing_prefix=...)`); zeros once extracted.
    logits: jax.Array

    @property
    def num_samples(self) -> int:
        return self.token.shape[0]


# Columns of ResultTokens.data: JetStream's three (tokens, valid, lengths) and ours.
TOKEN, LOGPROB, POSITION, LENGTH, VALID, FINISHED = range(6)


@_pytree_dataclass
class SlotData:
    """One slot's rows of a ResultTokens (JetStream's SlotData): tokens and valid
    [samples_per_slot, 1], lengths [samples_per_slot], log_prob [samples_per_slot, 1]
    (f32); a leading step axis for `generate_steps` results."""

    tokens: jax.Array | np.ndarray
    valid: jax.Array | np.ndarray
    lengths: jax.Array | np.ndarray
    log_prob: jax.Array | np.ndarray | None = None


@_pytree_dataclass
class ResultTokens:
    """Per-sample output of a prefill (B = samples) or generate call (B = S slots),
    JetStream's ResultTokens: everything in one int32 array `data` [B, 6], so a host
    read is one transfer, with the column ranges of tokens, validity and lengths
    (response tokens so far, this one included). Our columns beyond JetStream's:
    log-prob (f32 bits), position, finished. `Engine.generate_steps` (extension)
    returns [n, S, 6]: one row block per step. The properties read the columns on
    device arrays or on numpy ones (`convert_to_numpy`)."""

    data: jax.Array | np.ndarray
    tokens_idx: tuple = struct.field(pytree_node=False, default=(TOKEN, TOKEN + 1))
    valid_idx: tuple = struct.field(pytree_node=False, default=(VALID, VALID + 1))
    length_idx: tuple = struct.field(pytree_node=False, default=(LENGTH, LENGTH + 1))
    samples_per_slot: int = struct.field(pytree_node=False, default=1)
    # MoE models (extension, after JetStream's fields): the experts each MoE layer chose
    # for the token this row's step took as input, the one before its sampled token
    # ([B, MoE layers, k], or [n, S, ...] from generate_steps; `routing_dtype`,
    # `not_routed` where none).
    routing: jax.Array | np.ndarray | None = None

    if TYPE_CHECKING:  # added by struct.dataclass

        def replace(self, **changes: Any) -> ResultTokens: ...

    def copy_to_host_async(self) -> None:
        for a in (self.data, self.routing):
            if a is not None and not isinstance(a, np.ndarray):
                a.copy_to_host_async()

    def convert_to_numpy(self) -> ResultTokens:
        return self.replace(data=np.asarray(self.data), routing=None if self.routing is None
                            else np.asarray(self.routing))

    def get_result_at_slot(self, slot: int) -> SlotData:
        """The rows of `slot` (its `samples_per_slot` samples), as JetStream gives them."""
        rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
        block = self.data[..., rows, :]
        return SlotData(tokens=block[..., slice(*self.tokens_idx)],
                        valid=block[..., slice(*self.valid_idx)],
                        lengths=block[..., slice(*self.length_idx)][..., 0],
                        log_prob=_as_f32(block[..., LOGPROB:LOGPROB + 1]))

    def get_result_at_slots(self, slots: tuple) -> SlotData:
        """The rows of several slots, one sample each (JetStream's multi-sampling)."""
        block = self.data[..., list(slots), :]
        return SlotData(tokens=block[..., slice(*self.tokens_idx)],
                        valid=block[..., slice(*self.valid_idx)],
                        lengths=block[..., slice(*self.length_idx)][..., 0],
                        log_prob=_as_f32(block[..., LOGPROB:LOGPROB + 1]))

    @property
    def log_prob(self) -> jax.Array:
        """JetStream's name: `logprobs` with a tokens axis, [B, 1]."""
        return self.logprobs[..., None]

    @property
    def tokens(self) -> jax.Array:
        """Sampled token per row."""
        return self.data[..., TOKEN]

    @property
    def logprobs(self) -> jax.Array:
        """f32 log-prob of the token under the sampling distribution actually used."""
        return _as_f32(self.data[..., LOGPROB])

    @property
    def positions(self) -> jax.Array:
        """Position of the token in prompt + response."""
        return self.data[..., POSITION]

    @property
    def lengths(self) -> jax.Array:
        """Response tokens so far, this one included."""
        return self.data[..., LENGTH]

    @property
    def steps(self) -> jax.Array:
        """Index of the token in the response (0 = first response token)."""
        return self.data[..., LENGTH] - 1

    @property
    def valid(self) -> jax.Array:
        """Row holds a real token (the slot was active); ignore other rows."""
        return self.data[..., VALID] != 0

    @property
    def finished(self) -> jax.Array:
        """The token ends its sequence (a stop id, or the length limit)."""
        return self.data[..., FINISHED] != 0

    @staticmethod
    def pack(tokens_B: jax.Array, logprobs_B: jax.Array, positions_B: jax.Array,
             lengths_B: jax.Array, valid_B: jax.Array, finished_B: jax.Array) -> ResultTokens:
        i32 = jnp.int32
        return ResultTokens(jnp.stack(
            [tokens_B.astype(i32), jax.lax.bitcast_convert_type(logprobs_B, i32),
             positions_B.astype(i32), lengths_B.astype(i32), valid_B.astype(i32),
             finished_B.astype(i32)], axis=-1))


def _as_f32(bits: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    if isinstance(bits, np.ndarray):
        return bits.view(np.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
