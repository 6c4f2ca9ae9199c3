"""Token sampling with per-request RNG and exact behaviour log-probs.

The distribution a token is drawn from is `softmax(logits / temperature)`, truncated
to the top-k tokens (if `top_k > 0`) and then to the smallest top-p nucleus (if
`top_p < 1`), renormalised. The log-prob returned with each token is under exactly
that distribution — it is what an importance-sampling correction in the trainer
needs as the behaviour policy.

Randomness is per request, not per slot or per batch: token n of a response is drawn
with `fold_in(request_key, n)`, so a request's samples do not depend on which slot,
slice or batch composition it ran in, nor on being migrated or re-prefilled.

A token is drawn by inverting the distribution's CDF at one uniform number per row,
in two levels (which block of the vocabulary, then which token in it), so a step
draws one random number per slot rather than one per vocabulary entry (Gumbel-max
does the latter: on a CPU that noise was a fifth of a 256-slot step's memory traffic
at a 32,768-token vocabulary).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.config import RolloutConfig
from dora_jax.model.threefry import threefry2x32, unit_floats


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings (part of the compiled decode step), as validated
    by `config.RolloutConfig` (`from_rollout`).

    greedy: take the argmax of the logits instead of sampling (evaluation and
      tests); the reported log-prob is that of the argmax under the truncated
      tempered distribution above.
    """

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    greedy: bool = False

    @classmethod
    def from_rollout(cls, rollout: RolloutConfig, greedy: bool = False) -> SamplingParams:
        return cls(temperature=float(rollout.temperature), top_k=int(rollout.top_k),
                   top_p=float(rollout.top_p), greedy=greedy)


# A request's RNG: an int seed, or uint32[2] key data.
Seed = int | np.integer | Sequence[int] | np.ndarray


def key_data_from_seed(seed: Seed) -> np.ndarray:
    """uint32[2] threefry key data for an int seed in [0, 2**64), or passes key data
    through. Computed on the host (no device op), equal to
    `jax.random.key_data(jax.random.PRNGKey(seed))` for seeds below 2**32."""
    if isinstance(seed, (int, np.integer)):
        seed = int(seed)
        if not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed must be in [0, 2**64), got {seed}")
        return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    data = np.asarray(seed)
    if data.shape != (2,) or not (np.issubdtype(data.dtype, np.integer)):
        raise ValueError(f"RNG key data must be 2 unsigned 32-bit ints, got {seed!r}")
    return data.astype(np.uint32)


def request_seed(run_seed: int, group_id: int, sample: int) -> np.ndarray:
    """Key data for one request, a function of (run seed, group, sample) only: a sample
    does not depend on which slot or slice generates it."""
    return np.random.SeedSequence([run_seed, group_id, sample]).generate_state(2)


def step_uniforms(key_data_B2: jax.Array, steps_B: jax.Array) -> jax.Array:
    """A uniform f32 in [0, 1) for each row's response index n: the one draw of
    `jax.random.uniform(jax.random.fold_in(request_key, n))` (threefry keys,
    partitionable bits), computed as two fused threefry blocks."""
    zero_B = jnp.zeros_like(steps_B, jnp.uint32)
    k0_B, k1_B = threefry2x32(key_data_B2[:, 0], key_data_B2[:, 1], zero_B,
                              steps_B.astype(jnp.uint32))  # fold_in(key, n)
    return unit_floats(functools.reduce(jnp.bitwise_xor,
                                        threefry2x32(k0_B, k1_B, zero_B, zero_B)))


def kept_logits(logits_BV: jax.Array, sp: SamplingParams) -> jax.Array:
    """Tempered logits [B,V] f32 of the sampling distribution (unnormalised); -inf
    outside the kept set."""
    x_BV = logits_BV.astype(jnp.float32) / sp.temperature
    V = x_BV.shape[-1]
    if 0 < sp.top_k < V:
        kth_B1 = jax.lax.top_k(x_BV, sp.top_k)[0][:, -1:]
        x_BV = jnp.where(x_BV < kth_B1, -jnp.inf, x_BV)
    if sp.top_p < 1.0:
        sorted_BV = -jnp.sort(-x_BV, axis=-1)
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
        # Keep the smallest prefix whose mass reaches top_p (the first always stays).
        keep_BV = mass_before_BV < sp.top_p
        thresh_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
        x_BV = jnp.where(x_BV < thresh_B1, -jnp.inf, x_BV)
    return x_BV


def truncated_logprobs(logits_BV: jax.Array, sp: SamplingParams) -> jax.Array:
    """log-probs [B,V] f32 of the sampling distribution; -inf outside the kept set."""
    return jax.nn.log_softmax(kept_logits(logits_BV, sp), axis=-1)


BLOCK = 128  # vocabulary entries per block of the two-level inversion


def _cumsum(x_BN: jax.Array) -> jax.Array:
    """Inclusive cumulative sum along the last axis as one matmul with a triangular
    matrix, at full f32 precision (accelerators' default matmul rounds to bf16/TF32).
    The matrix is a constant of the program, not built by each step."""
    n = x_BN.shape[-1]
    upper_NN = np.triu(np.ones((n, n), np.float32))
    return jnp.dot(x_BN, upper_NN, precision=jax.lax.Precision.HIGHEST)


def _last_positive(x_BN: jax.Array) -> jax.Array:
    """Index of each row's last positive entry."""
    return jnp.max(jnp.where(x_BN > 0, jnp.arange(x_BN.shape[-1]), 0), axis=-1)


def inverse_cdf(weights_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """For each row the token whose interval of the cumulated `weights_BV` (>= 0, not
    normalised) holds u (in [0, 1)) of the row's total: first the block of BLOCK
    tokens, then the token within it. Rounding can put u past the last interval;
    such a draw takes the last token of positive weight, so a token outside the kept
    set is never drawn."""
    B, V = weights_BV.shape
    n = -(-V // BLOCK)
    w_BNb = jnp.pad(weights_BV, ((0, 0), (0, n * BLOCK - V))).reshape(B, n, BLOCK)
    mass_BN = w_BNb.sum(axis=-1)
    cum_BN = _cumsum(mass_BN)
    target_B = u_B * cum_BN[:, -1]
    block_B = jnp.minimum(jnp.sum(cum_BN <= target_B[:, None], axis=-1),
                          _last_positive(mass_BN))
    before_B = jnp.where(block_B > 0, jnp.take_along_axis(
        cum_BN, jnp.maximum(block_B - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    w_Bb = jnp.take_along_axis(w_BNb, block_B[:, None, None], axis=1)[:, 0]
    within_B = jnp.minimum(
        jnp.sum(_cumsum(w_Bb) <= (target_B - before_B)[:, None], axis=-1),
        _last_positive(w_Bb))
    return block_B * BLOCK + within_B


def sample(logits_BV: jax.Array, u_B: jax.Array, sp: SamplingParams
           ) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. Returns (tokens_B int32, logprobs_B f32).

    u_B: one uniform number in [0, 1) per row (see `step_uniforms`).
    """
    x_BV = kept_logits(logits_BV, sp)
    max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    w_BV = jnp.exp(x_BV - max_B1)  # the distribution, unnormalised
    if sp.greedy:
        # argmax of the raw logits: the same choice a full-forward argmax makes.
        tokens_B = jnp.argmax(logits_BV, axis=-1)
    else:
        tokens_B = inverse_cdf(w_BV, u_B)
    tokens_B = tokens_B.astype(jnp.int32)
    x_B = jnp.take_along_axis(x_BV, tokens_B[:, None], axis=-1)[:, 0]
    logprobs_B = x_B - max_B1[:, 0] - jnp.log(jnp.sum(w_BV, axis=-1))
    return tokens_B, logprobs_B


def stop_ids(rollout_cfg: RolloutConfig, tokenizer_path: str | None,
             explicit: Iterable[int] | None) -> tuple[int, ...]:
    """The ids that end a sample: `explicit` ones; else none if `eos_id < 0`; else
    eos_id and, with a tokenizer, every stop id it carries (read from its directory)."""
    if explicit is not None:
        ids = [int(i) for i in explicit]
    elif rollout_cfg.eos_id < 0:
        ids = []
    else:
        ids = [rollout_cfg.eos_id]
        if tokenizer_path is not None:
            from dora_jax.text.tokenizer import Tokenizer
            ids += Tokenizer.from_pretrained(tokenizer_path).stop_ids
    return tuple(dict.fromkeys(ids))


def read_stop_ids(rollout_cfg: RolloutConfig, tokenizer: object | None
                  ) -> tuple[int, ...] | None:
    """`stop_ids`' explicit ids from a tokenizer already read (its `stop_ids` after
    eos_id), so no engine reads it again; None without one or with `eos_id < 0`."""
    if tokenizer is None or rollout_cfg.eos_id < 0:
        return None
    return (rollout_cfg.eos_id, *getattr(tokenizer, "stop_ids", ()))


def refuse_sampler(sampler: object) -> None:
    # Behaviour log-probs must be those of the distribution sampled from: the engine
    # samples with its own SamplingParams, fixed when it is built.
    if sampler is not None:
        raise NotImplementedError("a per-call sampler is not supported: the engine samples "
                                  "with the SamplingParams it was built with")
