"""Full-sequence attention implementations against the dense reference: outputs and
gradients, grouped-query heads, lengths that are not a multiple of the block, packed
rows (segment ids)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.model import attention


def _qkv(B, T, H, K, D, seed=0, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, T, K, D), dtype),
            jax.random.normal(kv, (B, T, K, D), dtype))


def _naive_probs(q, k, segment_ids=None):
    """Softmax probabilities [B, H, T, T] per head with numpy; with segment ids, each
    token sees the earlier tokens of its own segment."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    probs = np.zeros((B, H, T, T))
    for b in range(B):
        mask = np.tril(np.ones((T, T), bool))
        if segment_ids is not None:
            seg = np.asarray(segment_ids[b])
            mask &= seg[:, None] == seg[None, :]
        for h in range(H):
            s = np.where(mask, q[b, :, h] @ k[b, :, h // G].T / np.sqrt(D), -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            probs[b, h] = p / p.sum(-1, keepdims=True)
    return probs


def _naive(q, k, v, segment_ids=None):
    """Attention written out per head with numpy: the independent reference."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    G = q.shape[2] // k.shape[2]
    probs = _naive_probs(q, k, segment_ids)
    out = np.zeros_like(q)
    for h in range(q.shape[2]):
        out[:, :, h] = probs[:, h] @ v[:, :, h // G]
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


def _segments(rows):
    """Segment ids [B, T] from rows of run lengths; a negative length is padding."""
    out = []
    for row in rows:
        ids, seg = [], 0
        for n in row:
            seg += n > 0
            ids += [seg if n > 0 else 0] * abs(n)
        out.append(ids)
    return jnp.asarray(out, jnp.int32)


# Three sequences then padding; padding at the start, in the middle and at the end.
PACKED_21 = [[5, 9, 4, -3], [-2, 6, -1, 7, 3, -2]]


@pytest.mark.parametrize("block", [4, 8, 32])
def test_packed_rows_match_the_naive_reference(block):
    """Within-segment attention, outputs and gradients, for dense and blockwise
    (sequences crossing block boundaries; T not a multiple of the block)."""
    q, k, v = _qkv(2, 21, 4, 2, 8, seed=5)
    seg = _segments(PACKED_21)
    want = _naive(q, k, v, seg)
    np.testing.assert_allclose(attention.dense_causal(q, k, v, seg), want, atol=1e-5)

    def blockwise(q, k, v):
        return attention.blockwise_causal(q, k, v, block, segment_ids_BT=seg)

    np.testing.assert_allclose(blockwise(q, k, v), want, atol=1e-5)
    w = jax.random.normal(jax.random.key(6), q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    ref = jax.grad(loss(lambda q, k, v: attention.dense_causal(q, k, v, seg)),
                   argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    for g, r, name in zip(got, ref, "qkv"):
        np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


def test_one_segment_is_plain_causal_attention():
    q, k, v = _qkv(2, 16, 4, 2, 8, seed=7)
    ones = jnp.ones((2, 16), jnp.int32)
    np.testing.assert_allclose(attention.blockwise_causal(q, k, v, 4, segment_ids_BT=ones),
                               attention.blockwise_causal(q, k, v, 4), atol=1e-6)


def test_blockwise_never_computes_blocks_of_other_segments():
    """Non-finite values in the first sequence's keys and values (blocks 0-1) do not
    reach the second sequence's outputs or gradients (blocks 2-3): those block pairs
    are skipped, not just masked (a masked 0 times NaN would still be NaN)."""
    q, k, v = _qkv(1, 16, 2, 1, 8, seed=8)
    seg = _segments([[8, 8]])
    want = _naive(q, k, v, seg)[:, 8:]
    k, v = k.at[:, :8].set(jnp.nan), v.at[:, :8].set(jnp.inf)

    def fn(q, k, v):
        return attention.blockwise_causal(q, k, v, 4, segment_ids_BT=seg)[:, 8:]

    np.testing.assert_allclose(fn(q, k, v), want, atol=1e-5)
    grads = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g[:, 8:])).all()


def test_cudnn_runs_packed_rows_blockwise(caplog):
    """cudnn takes no segment ids: packed rows run blockwise (with a warning), and
    `auto` picks blockwise for them on GPU."""
    q, k, v = _qkv(2, 21, 4, 2, 8, seed=9)
    seg = _segments(PACKED_21)
    with caplog.at_level("WARNING"):
        got = attention.causal_attention(q, k, v, "cudnn", block=8, segment_ids_BT=seg)
    assert "model.attention=cudnn" in caplog.text
    np.testing.assert_allclose(got, _naive(q, k, v, seg), atol=1e-5)
    assert attention.resolve("auto", "gpu", packed=True) == "blockwise"
    assert attention.resolve("auto", "tpu", packed=True) == "splash"


def test_cudnn_runs_what_it_refuses_blockwise(caplog):
    """float32 or an unaligned head dim: cudnn's kernel refuses them (seen on an H200),
    so `cudnn` runs them blockwise with a warning and `auto` picks blockwise."""
    assert attention.cudnn_takes(jnp.bfloat16, 128) is None
    assert "float32" in attention.cudnn_takes(jnp.float32, 128)
    assert "head dim" in attention.cudnn_takes(jnp.bfloat16, 12)
    assert "head dim" in attention.cudnn_takes(jnp.float16, 512)
    q, k, v = _qkv(2, 21, 4, 2, 8, seed=4)
    with caplog.at_level("WARNING"):
        got = attention.causal_attention(q, k, v, "cudnn", block=8)
    assert "float32" in caplog.text
    np.testing.assert_allclose(got, _naive(q, k, v), atol=1e-5)
    assert attention.resolve("auto", "gpu", cudnn_refusal="float32") == "blockwise"
    assert attention.resolve("auto", "tpu", cudnn_refusal="float32") == "splash"


def test_cudnn_pads_an_odd_length_exactly(monkeypatch):
    """cudnn's causal training kernel needs an even length; the padded call, cut back,
    equals attention over the odd length (the kernel stood in for by JAX's own XLA
    implementation of the same call)."""
    seen, xla_attention = [], jax.nn.dot_product_attention

    def kernel(q, k, v, is_causal, implementation):
        assert implementation == "cudnn" and is_causal
        seen.append(q.shape[1])
        return xla_attention(q, k, v, is_causal=True, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)
    q, k, v = _qkv(2, 37, 4, 2, 8, seed=5)
    np.testing.assert_allclose(attention.cudnn_causal(q, k, v), _naive(q, k, v), atol=1e-5)
    np.testing.assert_allclose(attention.cudnn_causal(q[:, :36], k[:, :36], v[:, :36]),
                               _naive(q[:, :36], k[:, :36], v[:, :36]), atol=1e-5)
    assert seen == [38, 36]


def test_splash_kernel_in_interpret_mode_matches_dense():
    q, k, v = _qkv(1, 256, 4, 2, 128, seed=3)
    got = attention.splash_causal(q, k, v, block=128, interpret=True)
    np.testing.assert_allclose(got, attention.dense_causal(q, k, v), atol=2e-4, rtol=2e-4)


def test_splash_kernel_takes_segment_ids():
    """Packed rows through the kernel's SegmentIds (each row its own ids), a
    sequence crossing the two blocks and padding in between."""
    q, k, v = _qkv(2, 256, 4, 2, 128, seed=10)
    seg = _segments([[100, 60, -16, 80], [-6, 250]])
    got = attention.splash_causal(q, k, v, block=128, interpret=True, segment_ids_BT=seg)
    np.testing.assert_allclose(got, attention.dense_causal(q, k, v, seg), atol=2e-4,
                               rtol=2e-4)


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

    def block(q, k, v):
        return attention.blockwise_causal(q, k, v, 128)

    ratio_block = peak(block, 2048) / peak(block, 256)
    ratio_dense = peak(attention.dense_causal, 2048) / peak(attention.dense_causal, 256)
    assert ratio_block <= 10, ratio_block
    assert ratio_dense > 30, ratio_dense


@pytest.mark.parametrize("packed", [False, True])
def test_splash_runs_per_shard_under_the_trainer_rules(packed):
    """Inside activation_rules the kernel runs under shard_map (batch over data x
    fsdp, heads over tensor; segment ids split with the batch) and still equals the
    dense attention."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dora_jax import config as config_lib
    from dora_jax.model import sharding

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2, 1), config_lib.TRAINER_MESH_AXES)
    q, k, v = _qkv(4, 128, 4, 2, 128, seed=4)
    # Each row packed differently, so a shard given another's ids would differ.
    seg = _segments([[128], [50, 78], [30, 30, -68], [-10, 100, 18]]) if packed else None

    def put(x):
        return jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))

    fn = jax.jit(lambda q, k, v, seg: attention.causal_attention(
        q, k, v, "splash", block=128, interpret=True, segment_ids_BT=seg))
    with sharding.activation_rules(mesh, config_lib.TRAINER_RULES):
        got = fn(put(q), put(k), put(v), seg)
    np.testing.assert_allclose(got, attention.dense_causal(q, k, v, seg), atol=2e-4,
                               rtol=2e-4)
