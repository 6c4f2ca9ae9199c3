"""Full-sequence attention implementations against the dense reference: outputs and
gradients, grouped-query heads, lengths that are not a multiple of the block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.model import attention


def _qkv(B, T, H, K, D, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, T, K, D), dtype),
            jax.random.normal(kv, (B, T, K, D), dtype))


def _naive(q, k, v):
    """Attention written out per head with numpy: the independent reference."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, H, D = q.shape
    G = H // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            s = q[b, :, h] @ k[b, :, h // G].T / np.sqrt(D)
            s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // G]
    return out


@pytest.mark.parametrize("T, block", [(16, 4), (37, 8), (5, 16)])
@pytest.mark.parametrize("H, K", [(4, 2), (2, 2), (4, 1)])
def test_blockwise_matches_dense_and_the_naive_reference(T, block, H, K):
    q, k, v = _qkv(2, T, H, K, 8)
    want = _naive(q, k, v)
    np.testing.assert_allclose(attention.dense_causal(q, k, v), want, atol=1e-5)
    np.testing.assert_allclose(attention.blockwise_causal(q, k, v, block), want, atol=1e-5)


@pytest.mark.parametrize("T, block", [(16, 4), (21, 8)])
def test_blockwise_gradients_match_dense(T, block):
    q, k, v = _qkv(2, T, 4, 2, 8, seed=1)
    w = jax.random.normal(jax.random.key(2), q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    want = jax.grad(loss(attention.dense_causal), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(loss(lambda q, k, v: attention.blockwise_causal(q, k, v, block)),
                           argnums=(0, 1, 2)))(q, k, v)
    for g, r, name in zip(got, want, "qkv"):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_splash_kernel_in_interpret_mode_matches_dense():
    q, k, v = _qkv(1, 256, 4, 2, 128, seed=3)
    got = attention.splash_causal(q, k, v, block=128, interpret=True)
    np.testing.assert_allclose(got, attention.dense_causal(q, k, v), atol=2e-4, rtol=2e-4)


def test_auto_picks_the_backend_kernel():
    assert attention.resolve("auto", "tpu") == "splash"
    assert attention.resolve("auto", "gpu") == "cudnn"
    assert attention.resolve("auto", "cpu") == "blockwise"
    assert attention.resolve("dense", "tpu") == "dense"
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'"):
        attention.causal_attention(*_qkv(1, 4, 2, 2, 4), implementation="flash")


def test_blockwise_training_memory_is_linear_in_length():
    """Peak temporary memory of a compiled gradient at 8x the length: about 8x for
    blockwise, far more for dense (its T x T scores)."""
    def peak(fn, T):
        q, k, v = (jax.ShapeDtypeStruct(s, jnp.float32)
                   for s in ((1, T, 4, 32), (1, T, 2, 32), (1, T, 2, 32)))
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2)))
        return g.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    block = lambda q, k, v: attention.blockwise_causal(q, k, v, 128)
    ratio_block = peak(block, 2048) / peak(block, 256)
    ratio_dense = peak(attention.dense_causal, 2048) / peak(attention.dense_causal, 256)
    assert ratio_block <= 10, ratio_block
    assert ratio_dense > 30, ratio_dense


def test_splash_runs_per_shard_under_the_trainer_rules():
    """Inside activation_rules the kernel runs under shard_map (batch over data x
    fsdp, heads over tensor) and still equals the dense attention."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dora_jax import config as config_lib
    from dora_jax.model import sharding

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2, 1), config_lib.TRAINER_MESH_AXES)
    q, k, v = _qkv(4, 128, 4, 2, 128, seed=4)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
    fn = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, "splash", block=128,
                                                            interpret=True))
    with sharding.activation_rules(mesh, config_lib.TRAINER_RULES):
        got = fn(put(q), put(k), put(v))
    np.testing.assert_allclose(got, attention.dense_causal(q, k, v), atol=2e-4, rtol=2e-4)
