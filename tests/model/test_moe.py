"""Mixture of experts: routing, capacity dropping, auxiliary losses, exactness."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dora_jax.config import ModelConfig, MoEConfig
from dora_jax.model import moe

CFG = ModelConfig(vocab_size=16, d_model=8, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=4, mlp_hidden=16,
                  moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=6))


def _probs_logits(probs):
    # log(p) are router logits whose softmax is exactly p.
    return jnp.log(jnp.asarray(probs, jnp.float32))


def test_topk_choice_and_renormalised_weights():
    logits = _probs_logits([[0.1, 0.5, 0.15, 0.25],
                            [0.4, 0.05, 0.3, 0.25]])
    experts, weights, probs = moe.route(logits, top_k=2, normalize=True)
    np.testing.assert_array_equal(np.asarray(experts), [[1, 3], [0, 2]])
    # Renormalised over the chosen pair: 0.5/0.75, 0.25/0.75 and 0.4/0.7, 0.3/0.7.
    np.testing.assert_allclose(np.asarray(weights), [[2 / 3, 1 / 3], [4 / 7, 3 / 7]], rtol=1e-6)
    _, raw, _ = moe.route(logits, top_k=2, normalize=False)
    np.testing.assert_allclose(np.asarray(raw), [[0.5, 0.25], [0.4, 0.3]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, rtol=1e-6)


def test_capacity_formula():
    # ceil(1.25 * 10 tokens * 2 / 4 experts) = ceil(6.25) = 7
    assert moe.capacity(10, 2, 4, 1.25) == 7
    assert moe.capacity(1, 1, 8, 1.0) == 1  # never zero


def test_capacity_dropping_priority_order():
    """First choices (in token order) are served before any second choice."""
    # 3 tokens, 2 experts, top-2 (each token uses both), capacity 2 per expert.
    # Token order of first choices: t0->e0, t1->e0, t2->e1; second choices:
    # t0->e1, t1->e1, t2->e0.
    # Expert 0 receives t0(1st), t1(1st) -> full; t2's second choice is dropped.
    # Expert 1 receives t2(1st), then t0(2nd) -> full; t1's second choice dropped.
    experts = jnp.array([[0, 1], [0, 1], [1, 0]])
    weights = jnp.array([[0.6, 0.4], [0.7, 0.3], [0.8, 0.2]])
    dispatch, combine, dropped = moe.capacity_dispatch(experts, weights, 2, cap=2)
    d = np.asarray(dispatch)  # [N, E, C]
    assert d[0, 0, 0] == 1 and d[1, 0, 1] == 1  # expert 0 slots: t0, t1
    assert d[2, 1, 0] == 1 and d[0, 1, 1] == 1  # expert 1 slots: t2, then t0's 2nd
    assert d.sum() == 4
    assert d[1, 1].sum() == 0 and d[2, 0].sum() == 0  # the two dropped assignments
    np.testing.assert_allclose(np.asarray(combine)[0, 1, 1], 0.4)
    np.testing.assert_allclose(float(dropped), 2 / 6, rtol=1e-6)


def _layer(cfg):
    return moe.MoE(cfg, rngs=nnx.Rngs(params=0))


def _reference_moe(layer, x_ND, top_k, normalize):
    """Token-by-token, expert-by-expert numpy reference (no dispatch tensors)."""
    router = np.asarray(layer.router[...])
    wg, wu, wd = (np.asarray(w[...]) for w in (layer.w_gate, layer.w_up, layer.w_down))
    out = np.zeros_like(x_ND)
    for n, x in enumerate(x_ND):
        logits = x @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:top_k]
        w = p[chosen] / (p[chosen].sum() if normalize else 1.0)
        for e, we in zip(chosen, w):
            g, u = x @ wg[e], x @ wu[e]
            out[n] += we * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return out


def test_dropless_equals_reference_and_roomy_capacity():
    layer = _layer(CFG)
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    ref = _reference_moe(layer, np.asarray(x).reshape(10, 8), 2, True)
    y, aux = layer(x, dropless=True)
    np.testing.assert_allclose(np.asarray(y).reshape(10, 8), ref, rtol=1e-4, atol=1e-5)
    assert float(aux["dropped_fraction"]) == 0.0
    # A capacity that can hold every assignment drops nothing and equals dropless.
    roomy = _layer(dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=2.0)))
    y2, aux2 = roomy(x, dropless=False)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y), rtol=1e-4, atol=1e-5)
    assert float(aux2["dropped_fraction"]) == 0.0


def test_dropped_token_contributes_nothing():
    # Force every token's top-1 to expert 0 with capacity 1: only token 0 is served.
    cfg = dataclasses.replace(CFG, moe=MoEConfig(num_experts=4, top_k=1, expert_hidden=6,
                                                 capacity_factor=1.0))
    layer = _layer(cfg)
    layer.router[...] = jnp.zeros((8, 4)).at[:, 0].set(1.0)
    x = jnp.abs(jax.random.normal(jax.random.key(2), (1, 4, 8)))  # x @ router > 0 on e0
    y, aux = layer(x, dropless=False)  # capacity ceil(1.0 * 4 * 1 / 4) = 1
    assert float(jnp.max(jnp.abs(y[0, 0]))) > 0
    np.testing.assert_array_equal(np.asarray(y[0, 1:]), 0.0)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 0.75)
    y_exact, _ = layer(x, dropless=True)
    assert float(jnp.max(jnp.abs(y_exact[0, 1:]))) > 0


def test_load_balance_loss_hand_worked():
    # 2 tokens, 2 experts, top-1. Probs [[.7,.3],[.6,.4]]: both pick expert 0, so
    # f = [1, 0], P = [(.7+.6)/2, (.3+.4)/2] = [.65, .35];
    # loss = E * sum f*P = 2 * (1 * .65 + 0 * .35) = 1.3
    probs = jnp.array([[0.7, 0.3], [0.6, 0.4]])
    experts, _, p = moe.route(jnp.log(probs), top_k=1, normalize=True)
    np.testing.assert_allclose(float(moe.load_balance_loss(experts, p)), 1.3, rtol=1e-6)


def test_load_balance_loss_uniform_routing_is_one():
    # Perfectly balanced: each of 4 experts gets the same share of the top-2
    # assignments (f_i = 1/4) and the mean router probability is 1/4 each, so
    # loss = E * sum (1/E)(1/E) = 1, the known minimum of the Switch/GShard loss.
    probs = np.array([[0.4, 0.3, 0.2, 0.1],
                      [0.1, 0.2, 0.3, 0.4],
                      [0.2, 0.1, 0.4, 0.3],
                      [0.3, 0.4, 0.1, 0.2]])
    experts, _, p = moe.route(jnp.log(jnp.asarray(probs, jnp.float32)), top_k=2, normalize=True)
    counts = np.bincount(np.asarray(experts).ravel(), minlength=4)
    assert (counts == 2).all()
    np.testing.assert_allclose(float(moe.load_balance_loss(experts, p)), 1.0, rtol=1e-6)


def test_router_z_loss_hand_worked():
    # logsumexp([0, 0]) = log 2; logsumexp([log 3, 0]) = log 4 -> mean of squares.
    logits = jnp.array([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2) ** 2 + math.log(4) ** 2) / 2
    np.testing.assert_allclose(float(moe.router_z_loss(logits)), expected, rtol=1e-6)


def test_shared_expert_adds_dense_path():
    cfg = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, num_shared_experts=1,
                                                           shared_expert_hidden=6))
    layer = _layer(cfg)
    x = jax.random.normal(jax.random.key(3), (1, 3, 8))
    y, _ = layer(x, dropless=True)
    routed = _reference_moe(layer, np.asarray(x).reshape(3, 8), 2, True)
    np.testing.assert_allclose(np.asarray(y).reshape(3, 8) - routed,
                               np.asarray(layer.shared(x)).reshape(3, 8), rtol=1e-4, atol=1e-5)


def test_capacity_mode_requires_factor():
    with pytest.raises(ValueError, match="capacity_factor"):
        _layer(CFG)(jnp.ones((1, 2, 8)), dropless=False)


def test_padding_is_never_routed_nor_counted():
    """Two real tokens then two padding tokens: the real tokens' outputs and both aux
    losses equal those of the real tokens alone, whatever the padding holds; in
    capacity mode padding takes no slot (capacity 1 of 4 tokens x 1 choice / 4
    experts: with padding routed, a padding token could take a real one's slot)."""
    x = jax.random.normal(jax.random.key(3), (1, 4, 8))
    garbage = x.at[:, 2:].set(jax.random.normal(jax.random.key(4), (1, 2, 8)) * 10)
    valid = jnp.array([[True, True, False, False]])
    layer = _layer(CFG)
    alone, aux_alone = layer(x[:, :2], dropless=True)
    for xp in (x, garbage):
        y, aux = layer(xp, dropless=True, valid_BT=valid)
        np.testing.assert_allclose(np.asarray(y[:, :2]), np.asarray(alone), rtol=1e-5, atol=1e-6)
        for k in ("load_balance_loss", "router_z_loss"):
            np.testing.assert_allclose(float(aux[k]), float(aux_alone[k]), rtol=1e-5)
    # Load balance by hand for the real tokens: E * sum_i f_i P_i over 2 tokens.
    experts, _, probs = moe.route(jnp.einsum("nd,de->ne", x[0, :2], layer.router[...]), 2,
                                  True)
    f = np.bincount(np.asarray(experts).reshape(-1), minlength=4) / 4
    np.testing.assert_allclose(float(aux_alone["load_balance_loss"]),
                               4 * np.sum(f * np.asarray(probs).mean(0)), rtol=1e-5)
    # Capacity 1 per expert (4 tokens x top-1 / 4 experts). Row 0 is [a, padding],
    # row 1 is [b, c]: in token order the padding comes before b. Padding that is a
    # copy of b would, if routed, take b's expert slot and drop b.
    tight = _layer(dataclasses.replace(CFG, moe=dataclasses.replace(
        CFG.moe, top_k=1, dispatch="capacity", capacity_factor=1.0)))
    a, b, c = x[0, 0], x[0, 1], x[0, 2]

    def first(v):
        return int(np.argmax(np.asarray(v @ tight.router[...])))

    assert first(a) != first(b)  # so b keeps its slot unless padding takes it

    def rows(pad):
        return jnp.stack([jnp.stack([a, pad]), jnp.stack([b, c])])

    two = jnp.array([[True, False], [True, True]])
    y_copy, aux = tight(rows(b), valid_BT=two)
    y_zero, _ = tight(rows(jnp.zeros(8)), valid_BT=two)
    np.testing.assert_allclose(np.asarray(y_copy[1]), np.asarray(y_zero[1]), rtol=1e-6)
    assert np.abs(np.asarray(y_copy[1, 0])).max() > 0  # b was served
    unmasked, _ = tight(rows(b))
    np.testing.assert_array_equal(np.asarray(unmasked[1, 0]), 0.0)  # routed padding drops b
    assert 0 <= float(aux["dropped_fraction"]) <= 1 / 3  # of 3 real assignments


def test_packed_rows_route_real_tokens_as_if_alone():
    """Packed rows (valid_BT = segment_ids_BT > 0) with padding at the start, in the
    middle and at the end, holding large garbage: the real tokens' outputs equal
    those of the real tokens concatenated into one unpadded row, and so do both
    losses (the formulas over exactly those tokens). Dropless, and capacity dispatch
    with room for every assignment (factor 2 with top-2 of 4 experts: C >= N, so no
    expert can overflow). A tighter capacity depends on the whole batch, packed or
    not (see the module docstring)."""
    segment_ids = jnp.array([[0, 1, 1, 0, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 2, 0]])
    valid = segment_ids > 0
    x = jax.random.normal(jax.random.key(5), (2, 8, 8))
    x = jnp.where(valid[..., None], x, 100 * jax.random.normal(jax.random.key(6), x.shape))
    real = x[np.asarray(valid)][None]  # [1, 10, 8]: the real tokens in row order
    roomy = dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, capacity_factor=2.0))
    for dropless in (True, False):
        layer = _layer(roomy)
        want, want_aux = layer(real, dropless=dropless)
        y, aux = layer(x, dropless=dropless, valid_BT=valid)
        np.testing.assert_allclose(np.asarray(y)[np.asarray(valid)], np.asarray(want[0]),
                                   rtol=1e-5, atol=1e-6)
        for key in ("load_balance_loss", "router_z_loss"):
            np.testing.assert_allclose(float(aux[key]), float(want_aux[key]), rtol=1e-5)
        assert float(aux["dropped_fraction"]) == 0.0
