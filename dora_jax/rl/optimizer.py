"""AdamW with warmup + constant/cosine schedule and global-norm clipping (optax).

The schedule is indexed by *optimizer updates* (optax's count), not train steps: a
train step with `num_minibatches = M` advances it by M.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from dora_jax.config import TrainerConfig


def learning_rate_schedule(t: TrainerConfig) -> optax.Schedule:
    """lr(count) for count = optimizer updates already applied.

    Warmup is linear and reaches the peak at the *end* of update `warmup_steps - 1`:
    lr = peak * (count + 1) / warmup_steps, so no update is wasted at lr = 0.
    "cosine" then decays from the peak to 0 over `decay_steps` updates and stays at 0.
    """
    peak, warmup, decay = t.learning_rate, t.warmup_steps, max(t.decay_steps, 1)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        lr = jnp.asarray(peak, jnp.float32)
        if t.schedule == "cosine":
            progress = jnp.clip((count - warmup) / decay, 0.0, 1.0)
            lr = peak * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        if warmup > 0:
            lr = jnp.where(count < warmup, peak * (count + 1.0) / warmup, lr)
        return lr

    return schedule


def _decay_mask(params):
    # Decay matrices only: norm scales (1-D) are not regularised towards 0.
    return jax.tree.map(lambda x: getattr(x, "ndim", 0) >= 2, params)


def make_optimizer(t: TrainerConfig) -> optax.GradientTransformation:
    """Global-norm clip (skipped when grad_clip <= 0) then AdamW on the schedule."""
    adamw = optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2,
                        weight_decay=t.weight_decay, mask=_decay_mask)
    if t.grad_clip and t.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
    return adamw


def opt_state_shardings(tx: optax.GradientTransformation, params, param_shardings_full, mesh):
    """Shardings for `tx.init(params)`: moments follow their param, the rest replicate.

    `param_shardings_full` has exactly the structure of `params` (sharding leaves).
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx, lambda _, s: s, abstract, param_shardings_full,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
