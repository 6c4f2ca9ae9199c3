"""The transformer: KV-cache decoding equals the full forward; causality."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.model import transformer as tf


@pytest.fixture(scope="module")
def dense(load_config):
    return load_config("configs/tiny.py:spread").model


def _decode_against_full(cfg, prompt_lens, total_len, cache_len=24):
    """Prefills each slot with its own prompt, then decodes every slot in lockstep
    (each at its own position) and returns max |decode - full forward| logits."""
    graphdef, params = tf.create(cfg, seed=3)
    B = len(prompt_lens)
    tokens_BT = jax.random.randint(jax.random.key(7), (B, total_len), 0, cfg.vocab_size)
    # Exact (dropless) full forward of every whole sequence is the reference.
    full_BTV, _, _ = tf.apply(graphdef, params, tokens_BT, dropless=True)

    cache = tf.init_cache(cfg, B, cache_len)
    for b, n in enumerate(prompt_lens):
        _, _, kv = tf.apply(graphdef, params, tokens_BT[b:b + 1, :n], dropless=True,
                            return_kv=True)
        # a layer's buffer is [B, kv_heads, S, head_dim]; the prefix's [layers, 1, T, ...]
        cache = tf.LayerCaches(
            tuple(c.at[b, :, :n].set(kv.k[i, 0].swapaxes(0, 1)) for i, c in enumerate(cache.k)),
            tuple(c.at[b, :, :n].set(kv.v[i, 0].swapaxes(0, 1)) for i, c in enumerate(cache.v)))
    decode = jax.jit(lambda p, t, pos, c: tf.decode(graphdef, p, t, pos, c))
    pos_B = np.array(prompt_lens)
    worst = 0.0
    while pos_B.min() < total_len:
        # Slots that are done keep re-decoding their last position (ignored below).
        step_pos = np.minimum(pos_B, total_len - 1)
        logits_BV, cache = decode(params, tokens_BT[jnp.arange(B), step_pos], step_pos, cache)
        for b in range(B):
            if pos_B[b] < total_len:
                err = float(jnp.max(jnp.abs(logits_BV[b] - full_BTV[b, pos_B[b]])))
                worst = max(worst, err)
        pos_B = pos_B + 1
    return worst, float(jnp.max(jnp.abs(full_BTV)))


def test_kv_cache_decode_equals_full_forward(tiny_cfg):
    cfg = tiny_cfg.model
    err, scale = _decode_against_full(cfg, prompt_lens=[1, 4, 7], total_len=12)
    assert scale > 0.1  # the comparison is not between near-zero logits
    assert err < 1e-4 * max(1.0, scale), err


def test_decode_from_wrong_cache_differs(dense):
    """Guards the equality test: a cache missing the prompt must not match."""
    graphdef, params = tf.create(dense, seed=3)
    tokens = jax.random.randint(jax.random.key(7), (1, 6), 0, dense.vocab_size)
    full, _, _ = tf.apply(graphdef, params, tokens)
    logits, _ = tf.decode(graphdef, params, tokens[:, 5], jnp.array([5]),
                          tf.init_cache(dense, 1, 8))
    assert float(jnp.max(jnp.abs(logits - full[:, 5]))) > 1e-3


def test_causality(tiny_cfg):
    cfg = tiny_cfg.model
    graphdef, params = tf.create(cfg, seed=1)
    tokens = jax.random.randint(jax.random.key(0), (2, 10), 0, cfg.vocab_size)
    j = 6
    changed = tokens.at[:, j].set((tokens[:, j] + 1) % cfg.vocab_size)
    a, _, _ = tf.apply(graphdef, params, tokens, dropless=True)
    b, _, _ = tf.apply(graphdef, params, changed, dropless=True)
    np.testing.assert_array_equal(np.asarray(a[:, :j]), np.asarray(b[:, :j]))
    assert float(jnp.max(jnp.abs(a[:, j:] - b[:, j:]))) > 1e-4


def test_tied_embeddings_share_the_table(dense):
    cfg = dataclasses.replace(dense, tie_embeddings=True)
    _, params = tf.create(cfg)
    assert "lm_head" not in params
    assert tf.count_params(params) == tf.count_params(tf.create(dense)[1]) - 128 * 64


def test_rope_is_relative(dense):
    """Shifting every position by a constant leaves the logits unchanged (RoPE
    encodes relative offsets); changing one gap changes them."""
    graphdef, params = tf.create(dense)
    tokens = jax.random.randint(jax.random.key(0), (1, 5), 0, dense.vocab_size)
    a, _, _ = tf.apply(graphdef, params, tokens)
    b, _, _ = tf.apply(graphdef, params, tokens, jnp.arange(3, 8)[None])
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
    c, _, _ = tf.apply(graphdef, params, tokens, jnp.array([[0, 1, 2, 3, 9]]))
    np.testing.assert_allclose(np.asarray(a[:, :4]), np.asarray(c[:, :4]), atol=1e-4)
    assert float(jnp.max(jnp.abs(a[:, 4] - c[:, 4]))) > 1e-3


def test_token_logprobs_alignment():
    # Logits that put all mass on token (t+1) at position t: log p = 0 for the
    # matching next token, -inf-ish otherwise; column 0 is 0 by definition.
    tokens = jnp.array([[2, 0, 1]])
    logits = jnp.full((1, 3, 3), -1e4).at[0, 0, 0].set(0.0).at[0, 1, 2].set(0.0)
    lp = tf.token_logprobs(logits, tokens)
    assert lp.shape == (1, 3)
    assert float(lp[0, 0]) == 0.0 and abs(float(lp[0, 1])) < 1e-6
    assert float(lp[0, 2]) < -1e3
    # Temperature divides the logits: uniform logits stay uniform at any temperature.
    lp2 = tf.token_logprobs(jnp.zeros((1, 3, 4)), jnp.array([[0, 1, 2]]), temperature=0.7)
    np.testing.assert_allclose(np.asarray(lp2[0, 1:]), np.log(0.25), rtol=1e-6)


@pytest.mark.parametrize("moe_every", [1, 2])
def test_an_unrolled_forward_is_the_scanned_one(moe_every, load_config):
    """`unroll_forward` changes how the stacked layers run, not what they compute:
    logits, MoE losses, prefill KV, the routing a rollout records and gradients."""
    base = load_config("configs/moe.py:tiny").model
    cfg = dataclasses.replace(base, num_layers=4, unroll_forward=False,
                              moe=dataclasses.replace(base.moe, moe_every=moe_every))
    graphdef, params = tf.create(cfg, seed=3)
    unrolled, _ = tf.create(dataclasses.replace(cfg, unroll_forward=True), seed=3)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)

    def run(g):
        return tf.apply(g, params, tokens, dropless=True, return_kv=True,
                        return_routing=True)

    (logits, aux, kv), (ref, ref_aux, ref_kv) = run(unrolled), run(graphdef)
    np.testing.assert_allclose(logits, ref, atol=1e-5)
    np.testing.assert_allclose(kv.k, ref_kv.k, atol=1e-5)
    np.testing.assert_allclose(kv.v, ref_kv.v, atol=1e-5)
    np.testing.assert_array_equal(aux["routing"], ref_aux["routing"])
    for key in tf.AUX_KEYS:
        np.testing.assert_allclose(aux[key], ref_aux[key], atol=1e-6)

    def grads(g):
        return jax.grad(lambda p: tf.apply(g, p, tokens, dropless=True)[0].std())(params)

    for a, b in zip(jax.tree.leaves(grads(unrolled)), jax.tree.leaves(grads(graphdef)),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    # Unrolled, the layer loop is gone from the program (attention keeps its own).
    def loops(g):
        hlo = jax.jit(lambda p: tf.apply(g, p, tokens, dropless=True)[0]).lower(
            params).as_text()
        return hlo.count("stablehlo.while")

    assert loops(unrolled) < loops(graphdef)


@pytest.mark.parametrize("moe_every", [1, 2])
def test_scanned_layers_equal_the_unrolled_model(moe_every, load_config):
    """Scanning one layer period over the depth (dense/MoE interleave included)
    gives the unrolled model's logits, MoE losses, prefill KV and decode steps."""
    base = load_config("configs/moe.py:tiny").model
    cfg = dataclasses.replace(base, num_layers=4,
                              moe=dataclasses.replace(base.moe, moe_every=moe_every))
    flat = dataclasses.replace(cfg, scan_layers=False)
    graphdef, params = tf.create(cfg, seed=5)
    flat_graphdef, flat_params = tf.create(flat, seed=5)
    assert params["blocks"][0]["attn"]["wq"][...].shape[0] == 4 // moe_every
    # Same init, layer for layer: stacked block r holds layers r, r + p, ...
    for i in range(cfg.num_layers):
        stacked = jax.tree.leaves(params["blocks"][i % moe_every])
        for a, b in zip(stacked, jax.tree.leaves(flat_params["blocks"][i]), strict=True):
            np.testing.assert_array_equal(a[i // moe_every], b)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    logits, aux, kv = tf.apply(graphdef, params, tokens, dropless=True, return_kv=True)
    ref, ref_aux, ref_kv = tf.apply(flat_graphdef, flat_params, tokens, dropless=True,
                                    return_kv=True)
    np.testing.assert_allclose(logits, ref, atol=1e-5)
    np.testing.assert_allclose(kv.k, ref_kv.k, atol=1e-5)
    for key in tf.AUX_KEYS:
        np.testing.assert_allclose(aux[key], ref_aux[key], atol=1e-6)
    cache = tf.init_cache(cfg, 2, 12)
    pos = jnp.array([0, 5])
    out, new = tf.decode(graphdef, params, tokens[:, 0], pos, cache)
    ref_out, ref_new = tf.decode(flat_graphdef, flat_params, tokens[:, 0], pos, cache)
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_allclose(new.v, ref_new.v, atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_gradients(remat, dense):
    graphdef, params = tf.create(dense, seed=2)
    re_graphdef, _ = tf.create(dataclasses.replace(dense, remat=remat), seed=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, dense.vocab_size)

    def loss(graphdef):
        return lambda p: jnp.mean(tf.apply(graphdef, p, tokens)[0] ** 2)

    want = jax.grad(loss(graphdef))(params)
    got = jax.jit(jax.grad(loss(re_graphdef)))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_blockwise_attention_model_equals_dense(dense):
    """The model with blockwise attention (blocks smaller than the sequence) gives
    the dense model's logits."""
    graphdef, params = tf.create(dataclasses.replace(dense, attention="dense"), seed=4)
    bw_graphdef, _ = tf.create(dataclasses.replace(dense, attention="blockwise",
                                                   attention_block=4), seed=4)
    tokens = jax.random.randint(jax.random.key(2), (2, 11), 0, dense.vocab_size)
    np.testing.assert_allclose(tf.apply(bw_graphdef, params, tokens)[0],
                               tf.apply(graphdef, params, tokens)[0], atol=1e-5)


@pytest.mark.parametrize("spec,contract", [("btd,df->btf", 1), ("btd,dhk->bthk", 1),
                                           ("bthk,hkd->btd", 2)])
def test_dense_is_the_einsum_it_stands_for(spec, contract):
    from dora_jax.model.layers import dense

    lhs, rhs = spec.split("->")[0].split(",")
    sizes = dict(b=2, t=3, d=8, f=5, h=2, k=4)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, [sizes[c] for c in lhs])
    w = jax.random.normal(kw, [sizes[c] for c in rhs])
    np.testing.assert_allclose(dense(x, w, contract), jnp.einsum(spec, x, w), rtol=1e-5,
                               atol=1e-5)
    grads = [jax.grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
             for f in (lambda x, w: dense(x, w, contract), lambda x, w: jnp.einsum(spec, x, w))]
    for ours, theirs in zip(*grads):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
