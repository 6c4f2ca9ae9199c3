"""AdamW with warmup + constant/cosine schedule (optax's schedules), global-norm
clipping, and the update guard that skips a non-finite update.

The schedule is indexed by *optimizer updates* (optax's count), not train steps: a
train step with `num_minibatches = M` advances it by M.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dora_jax.config import TrainerConfig


def learning_rate_schedule(t: TrainerConfig) -> optax.Schedule:
    """lr(count) for count = optimizer updates already applied, built from optax's
    schedules.

    Warmup is linear and reaches the peak at the *end* of update `warmup_steps - 1`:
    lr = peak * (count + 1) / warmup_steps, so no update is wasted at lr = 0 (optax's
    `warmup_cosine_decay_schedule` starts its warmup at `init_value` instead, one
    update later: hence the warmup here is a `linear_schedule` from peak / warmup).
    "cosine" then decays from the peak to 0 over `decay_steps` updates and stays at 0.
    """
    peak, warmup, decay = t.learning_rate, t.warmup_steps, max(t.decay_steps, 1)
    schedule = (optax.cosine_decay_schedule(peak, decay) if t.schedule == "cosine"
                else optax.constant_schedule(peak))
    if warmup:
        # linear_schedule needs a positive length: one warmup update is the peak itself.
        ramp = (optax.linear_schedule(peak / warmup, peak, warmup - 1) if warmup > 1
                else optax.constant_schedule(peak))
        schedule = optax.join_schedules([ramp, schedule], [warmup])
    # A float32 array whatever the count (optax's constant is a Python float), as the
    # train step's metrics stack it.
    return lambda count: jnp.asarray(schedule(count), jnp.float32)


def guarded_update(tx: optax.GradientTransformation, grads: nnx.State, opt_state: optax.OptState,
                   params: nnx.State, finite: jax.Array) -> tuple[nnx.State, optax.OptState]:
    """One optimizer update applied only if `finite` (a scalar bool): otherwise params
    and optimizer state come back unchanged, so the schedule's count does not advance.

    Returns (params, opt_state). Where the two overlap this is `optax.apply_if_finite`
    (tests/rl/test_optimizer.py shows equal params, state and count), which is not used
    because its semantics differ: it checks the gradient's elements only (here also
    the loss, and the pre-clip global norm, which can overflow on finite elements),
    it gives up and applies the update after `max_consecutive_errors` non-finite ones
    (here never), and it wraps the optimizer state in its own, which would make the
    train state of existing checkpoints no longer restore.
    """
    def apply(params: nnx.State, opt_state: optax.OptState) -> tuple[nnx.State, optax.OptState]:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # A branch, not a select of new and old: with the state donated, each branch
    # writes it in place, where a select keeps the old state alive beside the new
    # and XLA copies params and moments every step to make room.
    return jax.lax.cond(finite, apply, lambda p, s: (p, s), params, opt_state)


def _decay_mask(params: nnx.State) -> nnx.State:
    # Decay matrices only: norm scales (1-D) are not regularised towards 0.
    return jax.tree.map(lambda x: getattr(x, "ndim", 0) >= 2, params)


def make_optimizer(t: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clip (skipped when grad_clip <= 0) then AdamW on the schedule."""
    adamw = optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2,
                        weight_decay=t.weight_decay, mask=_decay_mask)
    if t.grad_clip and t.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
    return adamw


def opt_state_shardings(tx: optax.GradientTransformation, params: nnx.State,
                        param_shardings_full: nnx.State, mesh: Mesh) -> optax.OptState:
    """Shardings for `tx.init(params)`: moments follow their param, the rest replicate.

    `param_shardings_full` has exactly the structure of `params` (sharding leaves).
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx, lambda _, s: s, abstract, param_shardings_full,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
