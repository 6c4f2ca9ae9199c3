"""Adapters that are not zero, for tests across packages (fresh B is zero, which would
hide the adapters' effect)."""

import jax


def randomise_b(params, seed=0, std=0.3):
    """Every B drawn at random."""
    keys = iter(jax.random.split(jax.random.key(seed), 1000))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (std * jax.random.normal(next(keys), x.shape)).astype(x.dtype)
        if "lora_b" in jax.tree_util.keystr(p) else x, params)
