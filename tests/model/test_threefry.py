"""Threefry written out round by round: the generator's published known answers, and
the draws JAX's own `jax.random` makes from the same keys, bit for bit; a model's
weights are JAX's normal draws from its stream of keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.config import ModelConfig
from dora_jax.model import threefry, transformer

# Threefry-2x32-20's known answers (Random123's kat_vectors): key, counter, output.
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
    ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
]


@pytest.mark.parametrize("key,counter,want", KNOWN_ANSWERS)
def test_threefry_gives_the_published_known_answers(key, counter, want):
    got = jax.jit(threefry.threefry2x32)(*(jnp.uint32(v) for v in key + counter))
    assert tuple(int(x) for x in got) == want


@pytest.mark.parametrize("shape", [(), (1,), (7,), (64, 192), (3, 5, 11)])
@pytest.mark.parametrize("seed", [0, 123456789])
def test_normal_and_uniform_draw_what_jax_random_draws(shape, seed):
    key = jax.random.fold_in(jax.random.key(seed), 3)
    with jax.threefry_partitionable(True):
        for ours, theirs in (
                (lambda k: threefry.normal(k, shape), lambda k: jax.random.normal(k, shape)),
                (lambda k: threefry.uniform(k, shape),
                 lambda k: jax.random.uniform(k, shape)),
                (lambda k: threefry.uniform(k, shape, -0.25, 0.5),
                 lambda k: jax.random.uniform(k, shape, jnp.float32, -0.25, 0.5))):
            got, want = jax.jit(ours)(key), jax.jit(theirs)(key)
            assert got.shape == shape and got.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_draw_too_large_for_its_counters_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*32"):
        jax.eval_shape(lambda k: threefry.normal(k, (2 ** 16, 2 ** 16)), jax.random.key(0))


def test_a_models_weights_are_jax_normal_draws_in_the_order_they_are_made():
    cfg = ModelConfig(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, mlp_hidden=64, tie_embeddings=False)
    _, params = transformer.create(cfg, seed=5)
    key = jax.random.key(5)
    # Draw 0 is the embedding table (std 1 when untied), draw 1 layer 0's query.
    embed = jax.random.normal(jax.random.fold_in(key, 0), (96, 32))
    wq = 32 ** -0.5 * jax.random.normal(jax.random.fold_in(key, 1), (32, 4, 8))
    np.testing.assert_allclose(np.asarray(params["embed"][...]), embed, rtol=1e-6)
    got_wq = params["blocks"][0]["attn"]["wq"][...]
    assert got_wq.shape == (2, 32, 4, 8)  # layers stacked
    np.testing.assert_allclose(np.asarray(got_wq[0]), wq, rtol=1e-6)
