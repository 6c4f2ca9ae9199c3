"""Token sampling with per-request RNG and exact behaviour log-probs.

The distribution a token is drawn from is `softmax(logits / temperature)`, truncated
to the top-k tokens (if `top_k > 0`) and then to the smallest top-p nucleus (if
`top_p < 1`), renormalised. The log-prob returned with each token is under exactly
that distribution — it is what an importance-sampling correction in the trainer
needs as the behaviour policy.

Randomness is per request, not per slot or per batch: token n of a response is drawn
with `fold_in(request_key, n)`, so a request's samples do not depend on which slot,
slice or batch composition it ran in, nor on being migrated or re-prefilled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dora_jax.config import RolloutConfig

KEY_IMPL = "threefry2x32"  # fixed, so key data means the same whatever JAX's default


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


def step_keys(key_data_B2: jax.Array, steps_B: jax.Array) -> jax.Array:
    """Typed keys fold_in(request_key, n) for each row's response index n."""
    keys_B = jax.random.wrap_key_data(key_data_B2, impl=KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(keys_B, steps_B)


def truncated_logprobs(logits_BV: jax.Array, sp: SamplingParams) -> jax.Array:
    """log-probs [B,V] f32 of the sampling distribution; -inf outside the kept set."""
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
    return jax.nn.log_softmax(x_BV, axis=-1)


def sample(logits_BV: jax.Array, keys_B: jax.Array, sp: SamplingParams
           ) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. Returns (tokens_B int32, logprobs_B f32).

    keys_B: typed keys, one per row (see `step_keys`).
    """
    logp_BV = truncated_logprobs(logits_BV, sp)
    if sp.greedy:
        # argmax of the raw logits: the same choice a full-forward argmax makes.
        tokens_B = jnp.argmax(logits_BV, axis=-1)
    else:
        tokens_B = jax.vmap(jax.random.categorical)(keys_B, logp_BV)
    tokens_B = tokens_B.astype(jnp.int32)
    logprobs_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
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
