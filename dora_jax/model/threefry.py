"""Threefry-2x32 random numbers written as fused elementwise code.

Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as
1, 2, 3", SC 2011) is the generator of JAX's default keys. XLA's CPU backend lowers
JAX's own threefry as a loop over its rounds: several kernels per draw, each slow to
compile (a model's initialisation drew a dozen of them). Here every round is written
out, so a draw is one elementwise kernel. `uniform` and `normal` give the values
`jax.random.uniform` and `jax.random.normal` give for the same key (threefry keys,
partitionable bits: JAX's default), bit for bit (tests/model/test_threefry.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

# The rotations of even and odd groups of four rounds, and the key schedule's parity.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


@jax.jit  # traced once per shape, not again in every program that draws
def threefry2x32(k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32-20 block of counters (x0, x1) under key (k0, k1), uint32
    arrays of one shape."""
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))
            x1 = x0 ^ x1
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def unit_floats(bits: jax.Array) -> jax.Array:
    """f32 in [0, 1) from uint32 bits: 23 random mantissa bits under exponent 0 (a
    float in [1, 2)), less 1."""
    one_bits = jnp.uint32(np.float32(1.0).view(np.uint32))
    return jax.lax.bitcast_convert_type((bits >> 9) | one_bits, jnp.float32) - 1.0


def _bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint32 bits of `shape` under a threefry key: element i is counter i's block,
    its two words xor-ed."""
    size = int(np.prod(shape))
    if size >= 2 ** 32:
        raise ValueError(f"threefry: {size} draws at once; at most 2**32 - 1")
    k = jax.random.key_data(key)
    counters = jax.lax.iota(jnp.uint32, size).reshape(shape)
    k0, k1 = (jnp.broadcast_to(k[i], shape) for i in (0, 1))
    x0, x1 = threefry2x32(k0, k1, jnp.zeros(shape, jnp.uint32), counters)
    return x0 ^ x1


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def uniform(key: jax.Array, shape: tuple[int, ...], minval: float = 0.0,
            maxval: float = 1.0) -> jax.Array:
    """f32 uniform in [minval, maxval): `jax.random.uniform(key, shape, float32,
    minval, maxval)`. The bounds are static (see `layers._normal`)."""
    lo, hi = np.float32(minval), np.float32(maxval)
    return jax.lax.max(lo, unit_floats(_bits(key, shape)) * (hi - lo) + lo)


@functools.partial(jax.jit, static_argnums=1)
def normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """f32 standard normal: `jax.random.normal(key, shape, float32)`, the inverse
    error function of a uniform in (-1, 1)."""
    lo = np.nextafter(np.float32(-1.0), np.float32(0.0))
    return np.float32(np.sqrt(2.0)) * jax.lax.erf_inv(uniform(key, shape, lo, 1.0))
