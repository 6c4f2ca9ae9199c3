"""The engine's pytrees: params as it takes them, the decode state of S slots, one
request's prefix (what prefill returns, insert takes and migration moves), and the
packed per-slot results of prefill and generate calls."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.model import transformer


class EngineParams(NamedTuple):
    """Params as the engine takes them: the leaves of the model's param State, placed
    on the engine mesh. A flat tuple, because flattening an nnx.State on every call
    costs more host time than a small decode step."""

    leaves: tuple


class DecodeState(NamedTuple):
    """Everything generate needs, for S slots. Donated to (consumed by) each call."""

    # dense: [layers, S, cache_length, kv_heads, head_dim] each; paged: the pool,
    # [layers, kv_heads, pages + 1, page_size, head_dim] (page 0: the null page).
    cache: transformer.KVCache
    tokens: jax.Array  # int32[S] next decode input: the slot's last sampled token
    positions: jax.Array  # int32[S] position of that token in prompt + response
    steps: jax.Array  # int32[S] response index of the next token to sample
    keys: jax.Array  # uint32[S, 2] request RNG key data
    active: jax.Array  # bool[S] slot holds an unfinished request
    limits: jax.Array  # int32[S] the request's response-length limit


class Prefix(NamedTuple):
    """One request's decode state, ready for `insert` (from prefill or extract)."""

    cache: transformer.KVCache  # [layers, 1, T, kv_heads, head_dim], T <= cache_length
    token: jax.Array  # int32[] last sampled token (next decode input)
    position: jax.Array  # int32[] its position
    step: jax.Array  # int32[] response index of the next token to sample
    key: jax.Array  # uint32[2] request RNG key data
    active: jax.Array  # bool[] False if the request has already finished
    limit: jax.Array  # int32[] the request's response-length limit
    # f32[V] logits that sampled `token`: another sample of the same prompt draws its
    # first token from them (`prefill(existing_prefix=...)`); zeros once extracted.
    logits: jax.Array


class ResultTokens(NamedTuple):
    """Per-slot output of one prefill (B=1) or generate call (n steps x S slots).

    Packed in one int32[..., B, 6] array (as JetStream packs its ResultTokens) so that
    a host read is one transfer, not six; the properties below give the columns (with
    the leading step axis of a generate call), on device arrays or on the numpy
    arrays `jax.device_get` returns.
    """

    data: jax.Array  # int32[B, 6] or [n, S, 6]: the columns below, log-prob as f32 bits

    @property
    def tokens(self):
        """Sampled token per row."""
        return self.data[..., 0]

    @property
    def logprobs(self):
        """f32 log-prob of the token under the sampling distribution actually used."""
        col = self.data[..., 1]
        if isinstance(col, np.ndarray):
            return col.view(np.float32)
        return jax.lax.bitcast_convert_type(col, jnp.float32)

    @property
    def positions(self):
        """Position of the token in prompt + response."""
        return self.data[..., 2]

    @property
    def steps(self):
        """Index of the token in the response (0 = first response token)."""
        return self.data[..., 3]

    @property
    def valid(self):
        """Row holds a real token (the slot was active); ignore other rows."""
        return self.data[..., 4] != 0

    @property
    def finished(self):
        """The token ends its request (EOS or max_decode_len)."""
        return self.data[..., 5] != 0

    @staticmethod
    def pack(tokens_B, logprobs_B, positions_B, steps_B, valid_B, finished_B) -> "ResultTokens":
        i32 = jnp.int32
        return ResultTokens(jnp.stack(
            [tokens_B.astype(i32), jax.lax.bitcast_convert_type(logprobs_B, i32),
             positions_B.astype(i32), steps_B.astype(i32), valid_B.astype(i32),
             finished_B.astype(i32)], axis=1))
