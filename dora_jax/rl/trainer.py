"""Sharded RL train step (PPO/GRPO objective, AdamW) on the trainer mesh.

One `Trainer.train_step(batch)` publishes one policy version: `num_minibatches`
optimizer updates, each accumulating gradients over micro-batches, in one jitted call
with the state donated. pi_prox (the policy at the step's start) is computed once: a
pre-pass when the step makes several updates, else stop_gradient(pi_theta).
Advantages are per group over the whole batch, before minibatch splitting, since a
group may straddle minibatches. Per-sequence quantities go through each token's sample
index, so the padded and packed layouts (packing.py) give one objective, aggregated
exactly over micro-batches (seq-mean-* max_len is rollout.max_decode_len, not the
bucket). With LoRA only the adapters train and the KL reference is the base itself
(adapters zeroed), costing no copy. A non-finite update is skipped, counted in
`skipped_updates`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import Config
from dora_jax.config.devices import make_meshes
from dora_jax.model import lora, transformer
from dora_jax.model.sharding import (
    Rules,
    activation_rules,
    copy_tree,
    logical_to_spec,
    param_shardings,
    published_copy,
)
from dora_jax.rl import losses, objective, packing, step_metrics
from dora_jax.rl.batch import TrainBatch
from dora_jax.rl.objective import MIN_KEYS
from dora_jax.rl.optimizer import (
    guarded_update,
    learning_rate_schedule,
    make_optimizer,
    opt_state_shardings,
)
from dora_jax.rl.packing import SAMPLE_ARRAYS, TOKEN_ARRAYS
from dora_jax.rollout.routing import routing_dtype

# A micro-batch's (or the layout's) arrays by name, and a step's stats by name.
Arrays = dict[str, jax.Array]
# (loss, stats), grads: what the value-and-grad of one micro-batch gives.
LossGrads = tuple[tuple[jax.Array, Arrays], nnx.State]


class TrainState(NamedTuple):
    """Everything the train step updates (and a checkpoint stores)."""

    params: Any  # nnx.State of nnx.Param
    opt_state: Any  # optax state
    step: jax.Array  # int32: train steps done
    version: jax.Array  # int32: policy version of `params` (+1 per train step)
    opt_updates: jax.Array  # int32: optimizer updates applied (+num_minibatches per step)


def full_param_shardings(params: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedShardings with exactly the tree structure of `params` (not a prefix)."""
    prefix = param_shardings(params, mesh, rules)
    leaves = jax.tree.leaves(prefix, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _scan_or_call(f: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any
                  ) -> tuple[Any, Any]:
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
        means a copy of the initial params (with LoRA: the base, adapters zeroed);
        with kl_coef == 0 the KL is only reported.
    """

    def __init__(self, cfg: Config, mesh: Mesh | None = None, *, params: nnx.State | None = None,
                 graphdef: nnx.GraphDef | None = None, ref_params: nnx.State | None = None
                 ) -> None:
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
        # What the optimizer updates: every param, or with LoRA the adapters alone.
        self._lora = cfg.model.lora.enabled
        self._train_sh = (lora.split(self._param_sh)[1] if self._lora else self._param_sh)
        opt_sh = opt_state_shardings(self._tx, self._trainable(params), self._train_sh,
                                     self.mesh)
        self._state_sh = TrainState(self._param_sh, opt_sh, scalar, scalar, scalar)
        self._batch_axes = logical_to_spec(("batch",), self.rules, self.mesh)[0]
        self._batch_sh = NamedSharding(self.mesh, PartitionSpec(None, None, self._batch_axes))
        self._packed = t.tokens_per_microbatch > 0
        # MoE: the rollout's recorded experts ride with the batch (agreement, loads),
        # and with moe_routing="replay" every forward of the step routes by them.
        m = cfg.model.moe
        self._routing = None if not m.enabled else (
            cfg.model.num_moe_layers, m.top_k,
            routing_dtype(m.num_experts))
        self._replay = t.moe_routing == "replay"

        params = jax.device_put(params, self._param_sh)
        # With LoRA and no reference given, the step zeroes the adapters of its params.
        self._base_ref = self._lora and ref_params is None and t.kl_coef > 0
        if ref_params is None and t.kl_coef > 0 and not self._lora:
            # A real copy: `params` is donated to the first step, the reference is not.
            ref_params = copy_tree(params)
        self._ref = None if ref_params is None else jax.device_put(ref_params, self._param_sh)
        opt_state = jax.jit(self._tx.init, out_shardings=opt_sh)(self._trainable(params))
        # Three distinct buffers: the state is donated, one buffer cannot be donated twice.
        zeros = [jax.device_put(np.zeros((), np.int32), scalar) for _ in range(3)]
        self._state = TrainState(params, opt_state, *zeros)
        self._version = 0
        self._opt_updates = 0

        ref_sh = None if self._ref is None else self._param_sh
        bsh = {k: self._batch_sh for k in self._token_arrays} | {
            k: scalar for k in SAMPLE_ARRAYS}
        self._batch_shardings = bsh
        self._step_jit = jax.jit(self._step, static_argnums=3,
                                 in_shardings=(self._state_sh, bsh, ref_sh),
                                 out_shardings=(self._state_sh, scalar), donate_argnums=0)
        self._grads_jit = jax.jit(self._loss_and_grads, static_argnums=3,
                                  in_shardings=(self._param_sh, bsh, ref_sh),
                                  out_shardings=(scalar, self._train_sh))

    # ----------------------------------------------------------------- public API
    @property
    def params(self) -> nnx.State:
        """Current policy params on the trainer mesh (version `self.version`).

        Valid until the next `train_step` donates them: copy them out (e.g.
        `jax.device_put` to a slice's shardings) before calling it again.
        """
        return self._state.params

    def published_params(self, adapters_only: bool = False) -> nnx.State:
        """A copy of `params` that outlives the next step, as a slice loads it
        (`sharding.published_copy`); with `adapters_only` (LoRA) the adapters alone."""
        params = lora.split(self.params)[1] if adapters_only else self.params
        return published_copy(params)

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
    def ref_params(self) -> nnx.State | None:
        return self._ref

    def abstract_state(self) -> TrainState:
        """ShapeDtypeStructs with this trainer's shardings: the restore target."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            self._state, self._state_sh)

    def load_state(self, state: TrainState) -> None:
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
        (the PPO ratio of the objective before each update), is_weight_mean/max and
        is_capped_frac (decoupled / tis), approx_kl (k3 KL(behaviour||pi)), entropy,
        logprob_mismatch (mean |pi_prox - mu| over the tokens the trainer's own
        version sampled) and logprob_mismatch_tokens, grad_norm (pre-clip, mean over
        updates), grad_norm_max, skipped_updates (non-finite), response_tokens,
        sequence_tokens, samples, reward_mean, advantage_abs_mean, staleness_mean/max
        (version - the version that sampled each response token), truncated_fraction,
        learning_rate (last update), updates_this_step, opt_updates (total), version
        (after the step).
        """
        M = self.cfg.trainer.num_minibatches
        arrays = self._device_batch(batch, M)
        with activation_rules(self.mesh, self.rules):
            self._state, metrics = self._step_jit(self._state, arrays, self._ref,
                                                  batch.group_size)
        self._version += 1
        self._opt_updates += M
        return metrics

    def warmup(self, batch_size: int, group_size: int) -> None:
        """Compiles the train step for every shape it can take (one per length
        bucket, padded or packed) without changing the state: each compile runs
        on a throwaway copy (the step donates its input), so timed runs measure
        steady-state steps, not compilation."""
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
            arrays = self._device_batch(batch, self.cfg.trainer.num_minibatches)
            with activation_rules(self.mesh, self.rules):
                jax.block_until_ready(self._step_jit(copy_tree(self._state), arrays, self._ref,
                                                     group_size))

    def loss_and_grads(self, batch: TrainBatch) -> tuple[jax.Array, nnx.State]:
        """(loss, grads) of the whole batch as ONE minibatch at the current params,
        accumulated over `micro_batches`; no update (grads of the adapters alone with
        LoRA). For tests and debugging."""
        arrays = self._device_batch(batch, 1)
        with activation_rules(self.mesh, self.rules):
            return self._grads_jit(self._state.params, arrays, self._ref, batch.group_size)

    # ------------------------------------------------------------------ batching
    def _device_batch(self, batch: TrainBatch, M: int) -> dict:
        """The batch validated and laid out for this mesh (packing.for_trainer)."""
        axes = self._batch_axes
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        n_shards = int(np.prod([self.mesh.shape[a] for a in axes]))
        arrays = packing.for_trainer(batch, self.cfg.trainer, M, self._version, axes,
                                     n_shards, self._routing)
        if self.mesh.is_multi_process:  # every process holds the whole batch: its shards
            arrays = {k: jax.make_array_from_callback(
                np.shape(x), self._batch_shardings[k], lambda index, x=x: np.asarray(x)[index])
                for k, x in arrays.items()}
        return arrays

    @property
    def _token_arrays(self) -> tuple:
        return TOKEN_ARRAYS + (("routing",) if self._routing is not None else ())

    # ---------------------------------------------------------------- objective
    def _trainable(self, params: nnx.State) -> nnx.State:
        """The params the optimizer updates: all, or with LoRA the adapters."""
        return lora.split(params)[1] if self._lora else params

    def _with_trainable(self, params: nnx.State, trainable: nnx.State) -> nnx.State:
        """`params` with `trainable` (as `_trainable` gives them) in place."""
        if not self._lora:
            return trainable
        return lora.merge(lora.split(params)[0], trainable)

    def _forward(self, params: nnx.State, micro: Arrays) -> tuple[jax.Array, Arrays | None]:
        """(logits, MoE aux) of a micro-batch's rows; packed rows attend within each
        sample only, with positions restarting at each."""
        # Right padding (unpacked): causal attention alone keeps it out of real tokens.
        packed = dict(positions_BT=micro["positions"],
                      segment_ids_BT=micro["segment_ids"]) if self._packed else {}
        logits, aux, _ = transformer.apply(self.graphdef, params, micro["tokens"],
                                           valid_BT=micro["segment_ids"] > 0,
                                           routing_BTLK=micro.get("routing"),
                                           replay=self._replay, **packed)
        return logits, aux

    def _logp(self, params: nnx.State, micro: Arrays) -> jax.Array:
        return objective.sampled_logprobs(self._forward(params, micro)[0], micro["tokens"],
                                          self.cfg)

    def _accumulate(self, params: nnx.State, ref_params: nnx.State | None, micro: Arrays,
                    adv_B: jax.Array, old_UbT: jax.Array | None, ntok: jax.Array,
                    nseq: jax.Array, version: jax.Array) -> tuple[nnx.State, Arrays]:
        """Gradients of one minibatch ([U, b, ...] micro-batches), summed over U.
        Packed, a micro-batch without tokens is skipped (the layout's U is the most a
        minibatch can need) and MoE aux losses are averaged over the others."""
        U = micro["tokens"].shape[0]
        num_micro = U
        if self._packed:
            num_micro = jnp.maximum(jnp.sum(jnp.any(micro["segment_ids"] > 0, axis=(1, 2))), 1)
        loss_fn: Callable[..., Any] = functools.partial(
            objective.micro_loss, self.cfg, self._forward)
        trainable = params
        if self._lora:  # differentiated in the adapters alone; the base is a constant
            base, trainable = lora.split(params)
            base = jax.lax.stop_gradient(base)
            loss_fn = lambda adapters, *rest: objective.micro_loss(  # noqa: E731
                self.cfg, self._forward, lora.merge(base, adapters), *rest)
            if self._base_ref:
                ref_params = jax.lax.stop_gradient(lora.zero_adapters(params))
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def grads_of(mb: Arrays, old_bT: jax.Array | None) -> LossGrads:
            return grad_fn(trainable, ref_params, mb, adv_B, old_bT, ntok, nseq, num_micro,
                           version)

        def body(g_acc: nnx.State | None, xs: tuple[Arrays, jax.Array | None]
                 ) -> tuple[nnx.State, Arrays]:
            mb, old_bT = xs
            if self._packed and U > 1:
                shapes = jax.eval_shape(grads_of, mb, old_bT)

                def skip(mb: Arrays, old_bT: jax.Array | None  # no tokens: nothing to add,
                         ) -> LossGrads:                        # nothing to report
                    out = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
                    (loss, stats), g = out
                    stats = dict(stats, **{k: jnp.full_like(stats[k], jnp.inf)
                                           for k in MIN_KEYS if k in stats})
                    return (loss, stats), g

                (_, stats), g = jax.lax.cond(jnp.any(mb["segment_ids"] > 0), grads_of, skip,
                                             mb, old_bT)
            else:
                (_, stats), g = grads_of(mb, old_bT)
            if g_acc is None:
                return g, stats
            return jax.tree.map(lambda a, x: a + x.astype(a.dtype), g_acc, g), stats

        if U == 1:
            return body(None, jax.tree.map(lambda x: x[0], (micro, old_UbT)))
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
        zeros = jax.lax.with_sharding_constraint(zeros, self._train_sh)
        grads, stats_U = jax.lax.scan(body, zeros, (micro, old_UbT))
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
        return grads, step_metrics.combine(stats_U, over_updates=False)

    def _prepare(self, params: nnx.State, batch: Arrays, group_size: int
                 ) -> tuple[Arrays, jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """(per-token arrays [M, U, b, T] with the loss mask in effect, advantages [B],
        response tokens and non-empty sequences per minibatch, the starting policy's
        log-probs or None)."""
        M, U, b, T = batch["tokens"].shape
        B = batch["rewards"].shape[0]
        adv_B = objective.advantages(batch["rewards"], group_size, self.cfg.trainer.advantage)
        micro = {k: batch[k] for k in self._token_arrays}
        sample = micro["sample"]
        # DAPO's overlong filtering: no loss on cut responses, which still count in
        # their group's advantages (computed above from every reward).
        if self.cfg.trainer.mask_truncated:
            cut = jnp.where(sample >= 0, batch["truncated"][jnp.maximum(sample, 0)], False)
            micro["loss_mask"] = micro["loss_mask"] * (~cut).astype(micro["loss_mask"].dtype)
        mask = micro["loss_mask"]
        ntok_M = jnp.sum(mask, axis=(1, 2, 3))
        # Samples keep their minibatch: [m B/M, (m+1) B/M) (rl/packing.py).
        has_loss_B = losses.per_sequence_sums(mask, sample, B) > 0
        nseq_M = jnp.sum(has_loss_B.reshape(M, B // M), axis=1)
        old = None
        if M > 1:  # pi_prox: the step's starting params, for every minibatch
            flat = jax.tree.map(lambda x: x.reshape((M * U,) + x.shape[2:]), micro)

            def logp(mb: Arrays) -> jax.Array:
                if not self._packed:
                    return self._logp(params, mb)
                return jax.lax.cond(jnp.any(mb["segment_ids"] > 0),
                                    lambda mb: self._logp(params, mb),
                                    lambda mb: jnp.zeros(mb["tokens"].shape, jnp.float32), mb)

            old = jax.lax.map(logp, flat).reshape(M, U, b, T)
        return micro, adv_B, ntok_M, nseq_M, old

    def _loss_and_grads(self, params: nnx.State, batch: Arrays, ref_params: nnx.State | None,
                        group_size: int) -> tuple[jax.Array, nnx.State]:
        micro, adv_B, ntok, nseq, _ = self._prepare(params, batch, group_size)
        grads, stats = self._accumulate(params, ref_params, jax.tree.map(lambda x: x[0], micro),
                                        adv_B, None, ntok[0], nseq[0], jnp.zeros((), jnp.int32))
        return stats["loss"], grads

    def _step(self, state: TrainState, batch: Arrays, ref_params: nnx.State | None,
              group_size: int) -> tuple[TrainState, Arrays]:
        M = batch["tokens"].shape[0]
        micro_all, adv_B, ntok, nseq, old = self._prepare(state.params, batch, group_size)

        def update(carry: tuple[nnx.State, optax.OptState, jax.Array],
                   xs: tuple[Arrays, jax.Array | None, jax.Array, jax.Array]
                   ) -> tuple[tuple[nnx.State, optax.OptState, jax.Array], Arrays]:
            params, opt_state, count = carry
            micro, old_UbT, ntok_m, nseq_m = xs
            grads, stats = self._accumulate(params, ref_params, micro, adv_B, old_UbT,
                                            ntok_m, nseq_m, state.version)
            stats["grad_norm"] = optax.tree.norm(grads)
            stats["learning_rate"] = self._schedule(count)
            # A non-finite update is skipped: params and optimizer state unchanged.
            finite = jnp.isfinite(stats["grad_norm"]) & jnp.isfinite(stats["loss"])
            trainable, opt_state = guarded_update(self._tx, grads, opt_state,
                                                  self._trainable(params), finite)
            params = self._with_trainable(params, trainable)
            stats["skipped_updates"] = (~finite).astype(jnp.int32)
            return (params, opt_state, count + finite.astype(count.dtype)), stats

        carry = (state.params, state.opt_state, state.opt_updates)
        (params, opt_state, count), stats_M = _scan_or_call(
            update, carry, (micro_all, old, ntok, nseq))

        metrics = step_metrics.report(stats_M, micro_all, batch, adv_B, state.version, M,
                                      count)
        new_state = TrainState(params, opt_state, state.step + 1, state.version + 1, count)
        return new_state, metrics
