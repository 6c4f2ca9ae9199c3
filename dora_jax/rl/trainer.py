"""Sharded RL train step (PPO/GRPO objective, AdamW) on the trainer mesh.

One `Trainer.train_step(batch)` = one published policy version (`version += 1`),
made of `num_minibatches` optimizer updates, each accumulating gradients over
`micro_batches` micro-batches. Everything runs in one jitted call with explicit in/out
shardings on the trainer mesh and the train state donated.

Objective, per response token t of sample i (masked means over response tokens):

  ratio_t   = pi_theta(t) / pi_behaviour(t)
  pg_t      = -min(ratio_t * A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_i)
              (dual-clipped at dual_clip * |A_i| for A_i < 0 when dual_clip is set)
  pg_t     *= w_t = min(pi_old(t) / pi_behaviour(t), tis_cap)   only if tis_cap is set
  loss      = agg(pg) + kl_coef * agg(KL_kind(pi_theta || pi_ref))
              + aux_loss_coef * load_balance + z_loss_coef * router_z   (MoE only)

The PPO ratio is *behaviour-version-aware*: pi_behaviour is the decode engine's
log-prob from the policy version that generated the sample (`behaviour_logp_BT`, all
tokens of a trajectory from one version), not the trainer's params at the start of the
step. A stale sample (version w < t) is therefore importance-weighted and clipped
against the policy that actually produced it. pi_old is the trainer's own log-prob with
the params at the start of this train step (computed in a pre-pass when
num_minibatches > 1; equal to stop_gradient(pi_theta) when there is a single update);
the TIS weight w_t is a stop-gradient constant. Because the ratio already divides by
pi_behaviour, w_t is not the importance weight itself (unlike verl's TIS, whose PPO
ratio is pi_theta / pi_old); it is an extra, capped per-token weight that scales
tokens by how much the trainer's current policy pi_old favours them over the sampler
(engine mismatch + staleness); leave tis_cap None for the plain behaviour-ratio
objective. All log-probs use the sampling temperature (rollout.temperature).

Advantages are computed *inside* the step from `rewards_B`, per group over the whole
batch (before minibatch splitting, so a group may straddle minibatches):
grpo = (r - mean)/(std + eps), drgrpo = r - mean, rloo = leave-one-out.

Aggregation across micro-batches is exact: token-mean divides by the token count of
the whole minibatch; seq-mean-* modes divide by its number of non-empty sequences
(seq-mean-token-scale's constant is rollout.max_decode_len, not the bucket). MoE
aux losses are the mean over micro-batches of each micro-batch's (nonlinear) value.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import Config
from dora_jax.model import transformer
from dora_jax.model.sharding import (activation_rules, copy_tree, logical_to_spec,
                                     make_meshes, param_shardings)
from dora_jax.rl import losses
from dora_jax.rl.batch import BATCH_KEYS, BatchError, TrainBatch
from dora_jax.rl.optimizer import learning_rate_schedule, make_optimizer, opt_state_shardings

_MAX_KEYS = ("ratio_max", "tis_weight_max")
_MIN_KEYS = ("ratio_min",)
# Token-weighted sums, divided by the response-token count at the end.
_TOKEN_KEYS = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean",
               "approx_kl", "entropy", "tis_weight_mean", "tis_capped_frac")


class TrainState(NamedTuple):
    """Everything the train step updates (and a checkpoint stores)."""

    params: Any  # nnx.State of nnx.Param
    opt_state: Any  # optax state
    step: jax.Array  # int32: train steps done
    version: jax.Array  # int32: policy version of `params` (+1 per train step)
    opt_updates: jax.Array  # int32: optimizer updates applied (+num_minibatches per step)


def full_param_shardings(params, mesh: Mesh, rules):
    """NamedShardings with exactly the tree structure of `params` (not a prefix)."""
    prefix = param_shardings(params, mesh, rules)
    leaves = jax.tree.leaves(prefix, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def compute_advantages(rewards_B, group_size: int, kind: str):
    """Per-group advantages for group-contiguous rewards [B] (see module docstring)."""
    if kind == "rloo":
        return losses.rloo_advantages(rewards_B, group_size)
    return losses.group_advantages(rewards_B, group_size, normalize_std=(kind == "grpo"))


def _combine(stats: dict, over_updates: bool):
    """Reduces stacked per-micro-batch (or per-update) stats along axis 0."""
    out = {}
    for k, v in stats.items():
        if k in _MAX_KEYS:
            out[k] = jnp.max(v, axis=0)
        elif k in _MIN_KEYS:
            out[k] = jnp.min(v, axis=0)
        elif over_updates and k not in _TOKEN_KEYS and k != "tokens":
            out[k] = jnp.mean(v, axis=0)  # per-update losses: mean over updates
        else:
            out[k] = jnp.sum(v, axis=0)
    return out


def _scan_or_call(f, carry, xs):
    """lax.scan, but a length-1 scan is a plain call (no loop in the program)."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        carry, y = f(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda x: x[None], y)
    return jax.lax.scan(f, carry, xs)


class Trainer:
    """Owns params, optimizer state, the optional frozen reference, and the step.

    Args:
      cfg: validated `Config`.
      mesh: trainer mesh; default `make_meshes(cfg.mesh)[0]`.
      params: initial policy params (nnx.State); default `transformer.create(cfg.model,
        cfg.seed)`. The Trainer takes ownership: they are donated to the first step.
      graphdef: the model graphdef; default from `transformer.abstract_params`.
      ref_params: frozen reference params for the KL term. None with kl_coef > 0
        means a copy of the initial params; with kl_coef == 0 the KL is only reported.
    """

    def __init__(self, cfg: Config, mesh: Mesh | None = None, *, params=None,
                 graphdef=None, ref_params=None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else make_meshes(cfg.mesh)[0]
        self.rules = cfg.mesh.trainer_rules
        if params is None:
            graphdef, params = transformer.create(cfg.model, cfg.seed)
        elif graphdef is None:
            graphdef, _ = transformer.abstract_params(cfg.model)
        self.graphdef = graphdef
        t = cfg.trainer
        self._tx = make_optimizer(t)
        self._schedule = learning_rate_schedule(t)
        self._param_sh = full_param_shardings(params, self.mesh, self.rules)
        scalar = NamedSharding(self.mesh, PartitionSpec())
        opt_sh = opt_state_shardings(self._tx, params, self._param_sh, self.mesh)
        self._state_sh = TrainState(self._param_sh, opt_sh, scalar, scalar, scalar)
        self._batch_axes = logical_to_spec(("batch",), self.rules, self.mesh)[0]
        self._batch_sh = NamedSharding(self.mesh, PartitionSpec(None, None, self._batch_axes))

        params = jax.device_put(params, self._param_sh)
        if ref_params is None and t.kl_coef > 0:
            # A real copy: `params` is donated to the first step, the reference is not.
            ref_params = copy_tree(params)
        self._ref = None if ref_params is None else jax.device_put(ref_params, self._param_sh)
        opt_state = jax.jit(self._tx.init, out_shardings=opt_sh)(params)
        # Three distinct buffers: the state is donated, one buffer cannot be donated twice.
        zeros = [jax.device_put(np.zeros((), np.int32), scalar) for _ in range(3)]
        self._state = TrainState(params, opt_state, *zeros)
        self._version = 0
        self._opt_updates = 0

        ref_sh = None if self._ref is None else self._param_sh
        bsh = {k: self._batch_sh for k in BATCH_KEYS}
        self._step_jit = jax.jit(self._step, static_argnums=3,
                                 in_shardings=(self._state_sh, bsh, ref_sh),
                                 out_shardings=(self._state_sh, scalar), donate_argnums=0)
        self._grads_jit = jax.jit(self._loss_and_grads, static_argnums=3,
                                  in_shardings=(self._param_sh, bsh, ref_sh),
                                  out_shardings=(scalar, self._param_sh))

    # ----------------------------------------------------------------- public API
    @property
    def params(self):
        """Current policy params on the trainer mesh (version `self.version`).

        Valid until the next `train_step` donates them: copy them out (e.g.
        `jax.device_put` to a slice's shardings) before calling it again.
        """
        return self._state.params

    @property
    def version(self) -> int:
        """Policy version of `params`: 0 initially, +1 per train step (no device sync)."""
        return self._version

    @property
    def opt_updates(self) -> int:
        """Optimizer updates applied so far (num_minibatches per train step)."""
        return self._opt_updates

    @property
    def state(self) -> TrainState:
        return self._state

    @property
    def ref_params(self):
        return self._ref

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with this trainer's shardings: the restore target."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self._state, self._state_sh)

    def load_state(self, state: TrainState):
        """Replaces the train state (e.g. restored from a checkpoint; resharded if needed)."""
        if jax.tree.structure(state) != jax.tree.structure(self._state):
            raise ValueError("train state structure does not match this trainer's "
                             "(different model or optimizer config?)")
        self._state = jax.device_put(state, self._state_sh)
        self._version = int(self._state.version)
        self._opt_updates = int(self._state.opt_updates)

    def train_step(self, batch: TrainBatch) -> dict[str, jax.Array]:
        """One train step: num_minibatches optimizer updates, version += 1.

        Returns metrics as device scalars (read them at the logging boundary):
        loss, pg_loss, kl_ref (with a reference), load_balance_loss / router_z_loss /
        dropped_fraction (MoE), clip_frac_low/high, dual_clip_frac, ratio_mean/max/min
        (pi_theta/pi_behaviour before each update), approx_kl (k3 KL(behaviour||pi)),
        entropy, grad_norm (pre-clip, mean over updates), grad_norm_max,
        tis_weight_mean/max, tis_capped_frac (with tis_cap), response_tokens,
        sequence_tokens, samples, reward_mean, advantage_abs_mean, staleness_mean/max
        (version - behaviour version), learning_rate (last update), updates_this_step,
        opt_updates (total), version (after the step).
        """
        M, U = self.cfg.trainer.num_minibatches, self.cfg.trainer.micro_batches
        arrays = self._device_batch(batch, M, U)
        with activation_rules(self.mesh, self.rules):
            self._state, metrics = self._step_jit(self._state, arrays, self._ref,
                                                  batch.group_size)
        self._version += 1
        self._opt_updates += M
        return metrics

    def warmup(self, batch_size: int, group_size: int) -> None:
        """Compiles the train step for every length bucket without changing the
        state: each compile runs on a throwaway copy (the step donates its input),
        so timed runs measure steady-state steps, not compilation."""
        for T in self.cfg.trainer.length_buckets:
            tokens = np.zeros((batch_size, T), np.int32)
            tokens[:, 1] = 1
            mask = np.zeros((batch_size, T), np.float32)
            mask[:, 1] = 1.0
            batch = TrainBatch(tokens_BT=tokens, loss_mask_BT=mask,
                               behaviour_logp_BT=np.full((batch_size, T), -1.0, np.float32) * mask,
                               rewards_B=np.zeros(batch_size, np.float32),
                               versions_B=np.zeros(batch_size, np.int32),
                               seq_lens_B=np.full(batch_size, 2, np.int32),
                               group_size=group_size,
                               group_ids=tuple(range(batch_size // group_size)))
            M, U = self.cfg.trainer.num_minibatches, self.cfg.trainer.micro_batches
            arrays = self._device_batch(batch, M, U)
            with activation_rules(self.mesh, self.rules):
                jax.block_until_ready(self._step_jit(copy_tree(self._state), arrays, self._ref,
                                                     group_size))

    def loss_and_grads(self, batch: TrainBatch):
        """(loss, grads) of the whole batch as ONE minibatch at the current params,
        accumulated over `micro_batches`; no update. For tests and debugging."""
        arrays = self._device_batch(batch, 1, self.cfg.trainer.micro_batches)
        with activation_rules(self.mesh, self.rules):
            return self._grads_jit(self._state.params, arrays, self._ref, batch.group_size)

    # ------------------------------------------------------------------ batching
    def _device_batch(self, batch: TrainBatch, M: int, U: int) -> dict:
        """Validates against the config and lays rows out as [M, U, b, ...]."""
        if not isinstance(batch, TrainBatch):
            raise BatchError(f"expected a TrainBatch, got {type(batch).__name__}")
        buckets = tuple(self.cfg.trainer.length_buckets)
        if batch.length not in buckets:
            raise BatchError(f"batch length T={batch.length} is not one of "
                             f"trainer.length_buckets={buckets}; build batches with "
                             "TrainBatch.from_trajectories(length_buckets=...)")
        newest = int(batch.versions_B.max())
        if newest > self._version:
            raise BatchError(f"batch holds samples of policy version {newest}, newer than the "
                             f"trainer's version {self._version}")
        arrays = batch.split(M, U)  # checks B % (M * U)
        B, b = batch.batch_size, batch.batch_size // (M * U)
        axes = self._batch_axes
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        n_shards = int(np.prod([self.mesh.shape[a] for a in axes]))
        if b % n_shards:
            raise BatchError(f"micro-batch of {b} rows (B={B} / ({M} * {U})) must be divisible "
                             f"by the {n_shards} batch shards of the trainer mesh {axes}")
        return arrays

    # ---------------------------------------------------------------- objective
    def _logp(self, params, tokens_BT):
        logits, aux, _ = transformer.apply(self.graphdef, params, tokens_BT)
        return logits, aux, transformer.token_logprobs(logits, tokens_BT,
                                                       self.cfg.rollout.temperature)

    def _micro_loss(self, params, ref_params, micro, adv_b, old_logp_bT, ntok, nseq, U):
        """Loss of one micro-batch, normalised so that summing over the minibatch's
        micro-batches gives the minibatch objective. Returns (loss, stats)."""
        t, moe = self.cfg.trainer, self.cfg.model.moe
        tokens, mask, behav = micro["tokens"], micro["loss_mask"], micro["behaviour_logp"]
        logits, aux, logp = self._logp(params, tokens)
        loss_BT, ppo = losses.ppo_clip_loss(logp, behav, adv_b, mask, clip_low=t.clip_low,
                                            clip_high=t.clip_high, dual_clip=t.dual_clip)
        valid = mask != 0
        n = jnp.sum(mask)
        nseq_micro = jnp.sum(jnp.any(valid, axis=-1))

        def agg(x_BT):
            if t.loss_agg_mode == "token-mean":
                return losses.aggregate_loss(x_BT, mask, "token-mean", num_tokens=ntok)
            per_micro = losses.aggregate_loss(x_BT, mask, t.loss_agg_mode,
                                              max_len=self.cfg.rollout.max_decode_len)
            return per_micro * jnp.where(nseq > 0, nseq_micro / jnp.maximum(nseq, 1), 0.0)

        log_ratio = jax.lax.stop_gradient(jnp.where(valid, logp - behav, 0.0))
        stats = {"tokens": n,
                 "clip_frac_low": ppo["clip_frac_low"] * n,
                 "clip_frac_high": ppo["clip_frac_high"] * n,
                 "dual_clip_frac": ppo["dual_clip_frac"] * n,
                 "ratio_mean": ppo["ratio_mean"] * n,
                 "ratio_max": jnp.max(jnp.where(valid, jnp.exp(log_ratio), -jnp.inf)),
                 "ratio_min": jnp.min(jnp.where(valid, jnp.exp(log_ratio), jnp.inf)),
                 # k3 estimate of KL(behaviour || pi): samples come from behaviour.
                 "approx_kl": jnp.sum(jnp.where(valid, jnp.expm1(log_ratio) - log_ratio, 0.0))}
        lp_BTV = jax.nn.log_softmax(
            jax.lax.stop_gradient(logits[:, :-1]) / self.cfg.rollout.temperature, axis=-1)
        ent_BT = jnp.pad(-jnp.sum(jnp.exp(lp_BTV) * lp_BTV, axis=-1), ((0, 0), (1, 0)))
        stats["entropy"] = jnp.sum(jnp.where(valid, ent_BT, 0.0))

        if t.tis_cap is not None:
            old = jax.lax.stop_gradient(logp) if old_logp_bT is None else old_logp_bT
            w_BT = losses.truncated_importance_weights(old, behav, t.tis_cap)
            loss_BT = loss_BT * w_BT
            stats["tis_weight_mean"] = jnp.sum(jnp.where(valid, w_BT, 0.0))
            stats["tis_weight_max"] = jnp.max(jnp.where(valid, w_BT, -jnp.inf))
            capped = jnp.exp(jnp.where(valid, old - behav, 0.0)) > t.tis_cap
            stats["tis_capped_frac"] = jnp.sum(valid & capped).astype(jnp.float32)
        pg = agg(loss_BT)
        total = pg
        stats["pg_loss"] = pg
        if ref_params is not None:
            _, _, ref_logp = self._logp(ref_params, tokens)
            kl = agg(losses.kl_divergence(logp, jax.lax.stop_gradient(ref_logp), t.kl_kind))
            total = total + t.kl_coef * kl
            stats["kl_ref"] = kl
        if moe.enabled:
            total = total + (moe.aux_loss_coef * aux["load_balance_loss"]
                             + moe.z_loss_coef * aux["router_z_loss"]) / U
            stats.update({k: aux[k] / U for k in transformer.AUX_KEYS})
        stats["loss"] = total
        return total, stats

    def _accumulate(self, params, ref_params, micro, adv_Ub, old_UbT, ntok, nseq):
        """Gradients of one minibatch ([U, b, ...] micro-batches), summed over U."""
        U = adv_Ub.shape[0]
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

        def body(g_acc, xs):
            mb, adv_b, old_bT = xs
            (_, stats), g = grad_fn(params, ref_params, mb, adv_b, old_bT, ntok, nseq, U)
            if g_acc is None:
                return g, stats
            return jax.tree.map(lambda a, x: a + x.astype(a.dtype), g_acc, g), stats

        if U == 1:
            grads, stats = body(None, jax.tree.map(lambda x: x[0], (micro, adv_Ub, old_UbT)))
            return grads, stats
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zeros = jax.lax.with_sharding_constraint(zeros, self._param_sh)
        grads, stats_U = jax.lax.scan(body, zeros, (micro, adv_Ub, old_UbT))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        return grads, _combine(stats_U, over_updates=False)

    def _prepare(self, params, batch, group_size):
        M, U, b = batch["rewards"].shape
        adv = compute_advantages(batch["rewards"].reshape(-1), group_size,
                                 self.cfg.trainer.advantage).reshape(M, U, b)
        mask = batch["loss_mask"]
        ntok_M = jnp.sum(mask, axis=(1, 2, 3))
        nseq_M = jnp.sum(jnp.any(mask != 0, axis=-1), axis=(1, 2))
        old = None
        if self.cfg.trainer.tis_cap is not None and M > 1:
            # pi_old for TIS: the params at the start of the step, for every minibatch.
            T = batch["tokens"].shape[-1]
            flat = batch["tokens"].reshape(M * U, b, T)
            old = jax.lax.map(lambda tok: self._logp(params, tok)[2], flat).reshape(M, U, b, T)
        return adv, ntok_M, nseq_M, old

    def _loss_and_grads(self, params, batch, ref_params, group_size):
        adv, ntok, nseq, _ = self._prepare(params, batch, group_size)
        micro = {k: batch[k][0] for k in BATCH_KEYS}
        grads, stats = self._accumulate(params, ref_params, micro, adv[0], None, ntok[0], nseq[0])
        return stats["loss"], grads

    def _step(self, state: TrainState, batch, ref_params, group_size):
        M = batch["rewards"].shape[0]
        adv, ntok, nseq, old = self._prepare(state.params, batch, group_size)
        micro_all = {k: batch[k] for k in BATCH_KEYS}

        def update(carry, xs):
            params, opt_state, count = carry
            micro, adv_Ub, old_UbT, ntok_m, nseq_m = xs
            grads, stats = self._accumulate(params, ref_params, micro, adv_Ub, old_UbT,
                                            ntok_m, nseq_m)
            stats["grad_norm"] = optax.tree.norm(grads)
            stats["learning_rate"] = self._schedule(count)
            updates, opt_state = self._tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state, count + 1), stats

        carry = (state.params, state.opt_state, state.opt_updates)
        (params, opt_state, count), stats_M = _scan_or_call(
            update, carry, (micro_all, adv, old, ntok, nseq))

        metrics = _combine({k: v for k, v in stats_M.items()
                            if k not in ("grad_norm", "learning_rate")}, over_updates=True)
        ntok_all = jnp.maximum(metrics.pop("tokens"), 1.0)
        for k in _TOKEN_KEYS:
            if k in metrics:
                metrics[k] = metrics[k] / ntok_all
        for k in ("ratio_max", "ratio_min", "tis_weight_max"):
            if k in metrics:
                metrics[k] = jnp.where(jnp.isfinite(metrics[k]), metrics[k], 0.0)
        staleness = (state.version - batch["versions"]).astype(jnp.float32)
        metrics.update(
            grad_norm=jnp.mean(stats_M["grad_norm"]), grad_norm_max=jnp.max(stats_M["grad_norm"]),
            learning_rate=stats_M["learning_rate"][-1],
            response_tokens=jnp.sum(batch["loss_mask"]),
            sequence_tokens=jnp.sum(batch["seq_lens"]).astype(jnp.float32),
            samples=jnp.asarray(batch["rewards"].size, jnp.float32),
            reward_mean=jnp.mean(batch["rewards"]), advantage_abs_mean=jnp.mean(jnp.abs(adv)),
            staleness_mean=jnp.mean(staleness), staleness_max=jnp.max(staleness),
            updates_this_step=jnp.asarray(M, jnp.int32), opt_updates=count,
            version=state.version + 1)
        new_state = TrainState(params, opt_state, state.step + 1, state.version + 1, count)
        return new_state, metrics
