"""What one train step reports: per-micro-batch and per-update stats reduced to the
step's metrics (token means over the step's response tokens, extremes kept, losses
averaged over updates), with the batch's staleness, lengths and rewards."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dora_jax.rl import losses
from dora_jax.rl.objective import MAX_KEYS, MIN_KEYS, STALENESS_BINS, SUM_KEYS, TOKEN_KEYS


def load_imbalance(counts_LE: jax.Array) -> jax.Array:
    """Mean over MoE layers of max / mean assignments per expert (1: even; 0: none)."""
    mean_L = jnp.mean(counts_LE, axis=-1)
    return jnp.mean(jnp.where(mean_L > 0, jnp.max(counts_LE, axis=-1)
                              / jnp.maximum(mean_L, 1e-9), 0.0))


def combine(stats: dict[str, jax.Array], over_updates: bool) -> dict[str, jax.Array]:
    """Reduces stacked per-micro-batch (or per-update) stats along axis 0."""
    out = {}
    for k, v in stats.items():
        if k in MAX_KEYS:
            out[k] = jnp.max(v, axis=0)
        elif k in MIN_KEYS:
            out[k] = jnp.min(v, axis=0)
        elif over_updates and k not in TOKEN_KEYS and k not in SUM_KEYS:
            out[k] = jnp.mean(v, axis=0)  # per-update losses: mean over updates
        else:
            out[k] = jnp.sum(v, axis=0)
    return out


def report(stats_M: dict[str, jax.Array], micro_all: dict[str, jax.Array],
           batch: dict[str, jax.Array], adv_B: jax.Array, version: jax.Array, M: int,
           count: jax.Array) -> dict[str, jax.Array]:
    """The step's metrics from its updates' stacked stats [M] (`version`: the policy
    the step started from; `count`: optimizer updates applied after it)."""
    metrics = combine({k: v for k, v in stats_M.items()
                       if k not in ("grad_norm", "learning_rate", "skipped_updates")},
                      over_updates=True)
    ntok_all = jnp.maximum(metrics.pop("tokens"), 1.0)
    for k in TOKEN_KEYS:
        if k in metrics:
            metrics[k] = metrics[k] / ntok_all
    for k in MAX_KEYS + MIN_KEYS:
        if k in metrics:
            metrics[k] = jnp.where(jnp.isfinite(metrics[k]), metrics[k], 0.0)
    fresh = metrics.pop("mismatch_tokens")
    metrics["logprob_mismatch"] = metrics.pop("mismatch_abs") / jnp.maximum(fresh, 1.0)
    metrics["logprob_mismatch_tokens"] = fresh
    # By staleness: 1, 2, 3 or more versions between the token's sampler and pi_prox.
    abs_S = metrics.pop("mismatch_abs_by_staleness")
    tokens_S = metrics.pop("mismatch_tokens_by_staleness")
    for s in range(1, STALENESS_BINS):
        name = f"logprob_mismatch_staleness_{s}" + ("_plus" if s == STALENESS_BINS - 1 else "")
        metrics[name] = abs_S[s] / jnp.maximum(tokens_S[s], 1.0)
    if "routing_recorded" in metrics:  # MoE with a rollout's routing recorded
        recorded = metrics.pop("routing_recorded")
        metrics["routing_agreement"] = metrics.pop("routing_agreeing") / jnp.maximum(recorded, 1)
        metrics["routing_recorded_tokens"] = recorded
        metrics["expert_load_imbalance_rollout"] = load_imbalance(
            metrics.pop("expert_load_rollout"))
    if "expert_load_train" in metrics:
        metrics["expert_load_imbalance_train"] = load_imbalance(metrics.pop("expert_load_train"))
    mask = micro_all["loss_mask"] != 0
    staleness = (version - micro_all["token_versions"]).astype(jnp.float32)
    metrics.update(
        staleness_mean=losses.masked_mean(staleness, mask),
        staleness_max=jnp.max(jnp.where(mask, staleness, 0.0)),
        truncated_fraction=jnp.mean(batch["truncated"].astype(jnp.float32)),
        skipped_updates=jnp.sum(stats_M["skipped_updates"]),
        grad_norm=jnp.mean(stats_M["grad_norm"]), grad_norm_max=jnp.max(stats_M["grad_norm"]),
        learning_rate=stats_M["learning_rate"][-1],
        response_tokens=jnp.sum(micro_all["loss_mask"]),
        sequence_tokens=jnp.sum(micro_all["segment_ids"] > 0).astype(jnp.float32),
        samples=jnp.asarray(batch["rewards"].size, jnp.float32),
        reward_mean=jnp.mean(batch["rewards"]),
        advantage_abs_mean=jnp.mean(jnp.abs(adv_B)),
        updates_this_step=jnp.asarray(M, jnp.int32), opt_updates=count,
        version=version + 1)
    return metrics
