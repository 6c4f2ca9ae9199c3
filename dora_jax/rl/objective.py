"""The RL objective of one micro-batch, as the train step (trainer.py) minimises it.

Per response token t of sample i, with mu the behaviour policy (the decode engine's
log-prob of the token, from the version that sampled it) and pi_prox the trainer's
policy at the start of the step (`trainer.objective`):

  behaviour_clip  pg_t = -min(r_t A_i, clip(r_t) A_i),  r_t = pi_theta / mu
  decoupled       pg_t = w_t * -min(r_t A_i, clip(r_t) A_i),  r_t = pi_theta / pi_prox,
                  w_t = pi_prox / mu, truncated at is_cap or masked beyond it (is_mode)
  tis             decoupled with truncation (verl's TIS; pi_old = pi_prox)

  loss = agg(pg) + kl_coef * agg(KL_kind(pi_theta || pi_ref))
         + aux_loss_coef * load_balance + z_loss_coef * router_z   (MoE only)

With the behaviour ratio a token stale enough to start outside the clip range gets no
gradient at all; the decoupled ratio starts at 1 whatever the staleness and moves
the correction into w (trainer.py computes pi_prox once per step).

Every log-prob is under the distribution the engine samples from: tempered by
rollout.temperature and, when rollout.top_k / top_p truncate it, truncated and
renormalised the same way (rollout/sampling.py). So at staleness 0 the trainer's and
the engine's log-probs of a token agree; `logprob_mismatch` (mean |pi_prox - mu| over
tokens sampled by the trainer's current version) measures what is left.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from dora_jax.config import Config
from dora_jax.model import transformer
from dora_jax.rl import losses
from dora_jax.rollout.sampling import SamplingParams, truncated_logprobs

# Token-weighted sums (divided by the response-token count at the end of a step).
TOKEN_KEYS = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean",
              "approx_kl", "entropy", "is_weight_mean", "is_capped_frac")
MAX_KEYS = ("ratio_max", "is_weight_max")
MIN_KEYS = ("ratio_min",)
# Sums over the whole step, whatever the update (each token is in one update); the
# mismatch by staleness and the expert loads are arrays (STALENESS_BINS, [layers, E]).
SUM_KEYS = ("tokens", "mismatch_abs", "mismatch_tokens", "mismatch_abs_by_staleness",
            "mismatch_tokens_by_staleness", "routing_agreeing", "routing_recorded",
            "expert_load_train", "expert_load_rollout")
STALENESS_BINS = 4  # 0, 1, 2, 3 or more


def advantages(rewards_B: jax.Array, group_size: int, kind: str) -> jax.Array:
    """Per-group advantages of group-contiguous rewards [B], over the whole batch:
    grpo (r - mean)/(std + eps), drgrpo r - mean, rloo leave-one-out."""
    if kind == "rloo":
        return losses.rloo_advantages(rewards_B, group_size)
    return losses.group_advantages(rewards_B, group_size, normalize_std=(kind == "grpo"))


def sampled_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array, cfg: Config) -> jax.Array:
    """log p(tokens[:, t] | tokens[:, :t]) under the engine's sampling distribution
    (column 0, without context, is 0): tempered, and truncated to top-k / top-p when
    the rollout truncates (a token outside the kept set has log-prob -inf)."""
    r = cfg.rollout
    if not (r.top_k or r.top_p < 1.0):
        return transformer.token_logprobs(logits_BTV, tokens_BT, r.temperature)
    B, T, V = logits_BTV.shape
    sp = SamplingParams.from_rollout(r)
    logp_NV = truncated_logprobs(logits_BTV[:, :-1].reshape(B * (T - 1), V), sp)
    picked = jnp.take_along_axis(logp_NV, tokens_BT[:, 1:].reshape(-1, 1), axis=-1)
    return jnp.pad(picked.reshape(B, T - 1), ((0, 0), (1, 0)))


def policy_loss(cfg: Config, logp: jax.Array, proximal_logp: jax.Array,
                behaviour_logp: jax.Array, adv: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token policy-gradient loss [B, T] and its metrics for `trainer.objective`."""
    t = cfg.trainer
    if t.objective == "behaviour_clip":
        return losses.ppo_clip_loss(logp, behaviour_logp, adv, mask, clip_low=t.clip_low,
                                    clip_high=t.clip_high, dual_clip=t.dual_clip)
    return losses.decoupled_ppo_loss(
        logp, proximal_logp, behaviour_logp, adv, mask, clip_low=t.clip_low,
        clip_high=t.clip_high, is_cap=t.is_cap, dual_clip=t.dual_clip,
        is_mode="truncate" if t.objective == "tis" else t.is_mode)


def micro_loss(cfg: Config,
               forward: Callable[..., tuple[jax.Array, dict[str, jax.Array] | None]],
               params: nnx.State, ref_params: nnx.State | None, micro: dict[str, jax.Array],
               adv_B: jax.Array, start_logp_bT: jax.Array | None, ntok: jax.Array,
               nseq: jax.Array, num_micro: jax.Array, version: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch, normalised so that summing it over the minibatch's
    micro-batches gives the minibatch objective. Returns (loss, stats).

    micro: the micro-batch's per-token arrays (rl/packing.py: rows padded or packed;
    `sample` maps each token to its sample, -1 on padding); forward(params, micro) ->
    (logits_BTV, moe_aux); adv_B: every sample's advantage; start_logp_bT: the step's
    starting policy on these rows (None: this update starts the step); ntok / nseq:
    the minibatch's response tokens / non-empty sequences; num_micro: its micro-batches
    that hold tokens; version: the trainer's version at the start of the step (for
    the staleness-0 mismatch)."""
    t, moe = cfg.trainer, cfg.model.moe
    tokens, mask, behav = micro["tokens"], micro["loss_mask"], micro["behaviour_logp"]
    sample, B = micro["sample"], adv_B.shape[0]
    logits, aux = forward(params, micro)
    logp = sampled_logprobs(logits, tokens, cfg)
    start = jax.lax.stop_gradient(logp) if start_logp_bT is None else start_logp_bT
    adv_bT = jnp.where(sample >= 0, adv_B[jnp.maximum(sample, 0)], 0.0)
    loss_BT, ppo = policy_loss(cfg, logp, start, behav, adv_bT, mask)
    valid = mask != 0
    n = jnp.sum(mask)
    nseq_micro = jnp.sum(losses.per_sequence_sums(mask, sample, B) > 0)

    def agg(x_BT: jax.Array) -> jax.Array:
        if t.loss_agg_mode == "token-mean":
            return losses.aggregate_loss(x_BT, mask, "token-mean", num_tokens=ntok)
        per_micro = losses.aggregate_loss(x_BT, mask, t.loss_agg_mode,
                                          max_len=cfg.rollout.max_decode_len,
                                          segments=sample, num_segments=B)
        if t.loss_agg_mode == "seq-mean-token-sum-norm":  # a sum: micro-batches add up
            return per_micro
        return per_micro * jnp.where(nseq > 0, nseq_micro / jnp.maximum(nseq, 1), 0.0)

    log_ratio = jax.lax.stop_gradient(losses.clamped_log_ratio(logp, behav, valid))
    fresh = valid & (micro["token_versions"] == version)
    staleness = jnp.minimum(version - micro["token_versions"], STALENESS_BINS - 1)
    by_staleness = jax.nn.one_hot(jnp.where(valid, staleness, -1), STALENESS_BINS)
    stats = {"tokens": n,
             "ratio_max": ppo["ratio_max"], "ratio_min": jnp.where(jnp.any(valid),
                                                                   ppo["ratio_min"], jnp.inf),
             # k3 estimate of KL(behaviour || pi): samples come from behaviour.
             "approx_kl": jnp.sum(jnp.where(valid, jnp.expm1(log_ratio) - log_ratio, 0.0)),
             "mismatch_abs": jnp.sum(jnp.where(fresh, jnp.abs(start - behav), 0.0)),
             "mismatch_tokens": jnp.sum(fresh).astype(jnp.float32),
             "mismatch_abs_by_staleness": jnp.einsum("...s,...->s", by_staleness,
                                                     jnp.abs(start - behav)),
             "mismatch_tokens_by_staleness": jnp.sum(by_staleness, axis=(0, 1))}
    for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean",
              "is_weight_mean", "is_capped_frac"):
        if k in ppo:
            stats[k] = ppo[k] * n
    if "is_weight_max" in ppo:
        stats["is_weight_max"] = ppo["is_weight_max"]
    lp_BTV = jax.nn.log_softmax(
        jax.lax.stop_gradient(logits[:, :-1]) / cfg.rollout.temperature, axis=-1)
    ent_BT = jnp.pad(-jnp.sum(jnp.exp(lp_BTV) * lp_BTV, axis=-1), ((0, 0), (1, 0)))
    stats["entropy"] = jnp.sum(jnp.where(valid, ent_BT, 0.0))

    pg = agg(loss_BT)
    total = pg
    stats["pg_loss"] = pg
    if ref_params is not None:
        ref_logits, _ = forward(ref_params, micro)
        ref_logp = jax.lax.stop_gradient(sampled_logprobs(ref_logits, tokens, cfg))
        kl = agg(losses.kl_divergence(logp, ref_logp, t.kl_kind))
        total = total + t.kl_coef * kl
        stats["kl_ref"] = kl
    if moe.enabled:
        assert aux is not None  # an MoE forward reports its aux losses
        total = total + (moe.aux_loss_coef * aux["load_balance_loss"]
                         + moe.z_loss_coef * aux["router_z_loss"]) / num_micro
        stats.update({k: aux[k] / num_micro for k in transformer.AUX_KEYS})
        stats["expert_load_train"] = aux["expert_load"]
        if "routing" in micro:  # what the rollout recorded: agreement and its load
            stats["routing_agreeing"] = aux["routing_agreeing"]
            stats["routing_recorded"] = aux["routing_recorded"]
            ids = micro["routing"].astype(jnp.int32)  # [b, T, layers, k]; >= E: none
            layers, E = aux["expert_load"].shape
            layer = jnp.broadcast_to(jnp.arange(layers)[:, None], ids.shape)
            stats["expert_load_rollout"] = jnp.zeros((layers, E + 1), jnp.float32).at[
                layer, jnp.minimum(ids, E)].add(1.0)[:, :E]
    stats["loss"] = total
    return total, stats
