"""MoE routing replay: a forward that sends each token to the experts a rollout recorded
equals a reference written from the model's pieces that routes by those ids (padded
and packed rows, dense and blockwise attention, gradients included); replaying a
forward's own routing changes nothing; decode reports the experts it used."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, load_repo_config
from flax import nnx

from dora_jax.model import moe
from dora_jax.model import transformer as tf

AUX_WEIGHT = 0.1


def _cfg(**overrides):
    cfg = load_repo_config(TINY["moe"]).model
    return dataclasses.replace(cfg, scan_layers=False, num_layers=2, **overrides)


def _recorded(cfg, shape_BT, seed):
    """Distinct random expert ids per token and MoE layer [B, T, L, k] (uint8), as a
    rollout under other params would have chosen."""
    rng = np.random.default_rng(seed)
    m = cfg.moe
    layers = cfg.num_moe_layers
    ids = np.stack([rng.permutation(m.num_experts)[:m.top_k]
                    for _ in range(int(np.prod(shape_BT)) * layers)])
    return jnp.asarray(ids.reshape(*shape_BT, layers, m.top_k).astype(np.uint8))


def _replayed_moe(layer, x_BTD, ids_BTK):
    """Token by token through the recorded experts, gated by this router's
    probabilities of them: gathers of each token's expert weights, no dispatch."""
    x = x_BTD.astype(jnp.float32)
    probs = jax.nn.softmax(x @ layer.router[...].astype(jnp.float32), axis=-1)
    ids = ids_BTK.astype(jnp.int32)
    gates = jnp.take_along_axis(probs, ids, axis=-1)
    if layer.normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    g = jnp.einsum("btd,btkdf->btkf", x, layer.w_gate[...][ids])
    u = jnp.einsum("btd,btkdf->btkf", x, layer.w_up[...][ids])
    y = jnp.einsum("btkf,btkfd->btkd", jax.nn.silu(g) * u, layer.w_down[...][ids])
    out = jnp.einsum("btk,btkd->btd", gates, y)
    if layer.shared is not None:
        out = out + layer.shared(x_BTD)
    # The replayed assignments against this router's probabilities (moe.py).
    counts = jax.nn.one_hot(ids, probs.shape[-1]).sum((0, 1, 2)) / ids.size
    lb = probs.shape[-1] * jnp.sum(counts * probs.mean((0, 1)))
    return out.astype(x_BTD.dtype), lb


def _reference(graphdef, params, tokens_BT, ids_BTLK):
    """Logits and mean load-balancing loss of one unpacked row batch, layer by layer
    from the model's own modules, its MoE layers routed by `ids_BTLK`."""
    model = nnx.merge(graphdef, params)
    positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    x = model._embed(tokens_BT)
    lbs, moe_index = [], 0
    for block in model.blocks:
        h, _ = block.attn(block.attn_norm(x), positions, None, None)
        x = x + h
        y = block.mlp_norm(x)
        if block.is_moe:
            h, lb = _replayed_moe(block.mlp, y, ids_BTLK[:, :, moe_index])
            lbs.append(lb)
            moe_index += 1
        else:
            h = block.mlp(y)
        x = x + h
    return model._logits(x), jnp.mean(jnp.stack(lbs))


def _objective(logits_BTV, lb, tokens_BT, mask_BT):
    logp = tf.token_logprobs(logits_BTV, tokens_BT)
    return jnp.sum(jnp.where(mask_BT, logp, 0.0)) + AUX_WEIGHT * lb


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_replayed_forward_and_gradients_equal_the_reference(attention):
    cfg = _cfg(attention=attention, attention_block=4)
    graphdef, params = tf.create(cfg, seed=3)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    ids = _recorded(cfg, tokens.shape, seed=1)
    mask = jnp.arange(9)[None] > 0

    def replayed(p):
        logits, aux, _ = tf.apply(graphdef, p, tokens, dropless=True, routing_BTLK=ids,
                                  replay=True)
        return _objective(logits, aux["load_balance_loss"], tokens, mask), (logits, aux)

    def reference(p):
        logits, lb = _reference(graphdef, p, tokens, ids)
        return _objective(logits, lb, tokens, mask), logits

    (loss, (logits, aux)), grads = jax.jit(jax.value_and_grad(replayed, has_aux=True))(params)
    (ref_loss, ref_logits), ref_grads = jax.jit(
        jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(logits, ref_logits, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                 grads, ref_grads)
    # The router still learns under replay: its gates carry the gradient.
    assert any(float(jnp.abs(g).max()) > 0 for path, g in jax.tree_util.tree_leaves_with_path(
        grads) if "router" in jax.tree_util.keystr(path))
    # Random records mostly disagree with this router's own top-k.
    assert float(aux["routing_recorded"]) == 2 * 9 * 2
    assert float(aux["routing_agreeing"]) < float(aux["routing_recorded"]) / 2
    # And replaying them is not what recomputing does.
    own, _, _ = tf.apply(graphdef, params, tokens, dropless=True)
    assert float(jnp.abs(own - logits).max()) > 1e-3


def test_packed_rows_replay_each_sequence_as_if_alone():
    """Packed rows with padding between sequences: each sequence's logits equal the
    reference over it alone with its own recorded routing; padding's record is never
    read."""
    cfg = _cfg(attention="dense")
    graphdef, params = tf.create(cfg, seed=3)
    rows = [[5, 3, -2], [4, -1, 5]]  # sequence lengths, negative: padding
    T = 10
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, T))
    segments = np.zeros((2, T), np.int32)
    seqs = []
    for b, row in enumerate(rows):
        t = seg = 0
        for n in row:
            if n > 0:
                seg += 1
                segments[b, t:t + n] = seg
                seqs.append((b, t, n))
            t += abs(n)
    ids = np.array(_recorded(cfg, (2, T), seed=2))
    ids[segments == 0] = 255  # padding: nothing recorded
    logits, aux, _ = tf.apply(graphdef, params, jnp.asarray(tokens), dropless=True,
                              segment_ids_BT=jnp.asarray(segments),
                              routing_BTLK=jnp.asarray(ids), replay=True)
    reference = jax.jit(lambda tok, rec: _reference(graphdef, params, tok, rec)[0])
    for b, t, n in seqs:
        ref = reference(jnp.asarray(tokens[b:b + 1, t:t + n]), jnp.asarray(ids[b:b + 1, t:t + n]))
        np.testing.assert_allclose(logits[b, t:t + n], ref[0], rtol=2e-5, atol=2e-5)
    assert float(aux["routing_recorded"]) == (segments > 0).sum() * 2


@pytest.mark.parametrize("scan_layers", [False, True])
def test_replaying_a_forwards_own_routing_equals_recomputing(scan_layers):
    cfg = dataclasses.replace(_cfg(attention="dense"), scan_layers=scan_layers, num_layers=4)
    graphdef, params = tf.create(cfg, seed=5)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
    valid = jnp.arange(7)[None] < jnp.array([[7], [5]])
    logits, aux, _ = tf.apply(graphdef, params, tokens, dropless=True, valid_BT=valid,
                              return_routing=True)
    own = aux["routing"]
    layers = cfg.num_moe_layers
    assert own.shape == (2, 7, layers, cfg.moe.top_k)
    again, aux2, _ = tf.apply(graphdef, params, tokens, dropless=True, valid_BT=valid,
                              routing_BTLK=own.astype(jnp.uint8), replay=True)
    np.testing.assert_allclose(again, logits, rtol=1e-6, atol=1e-6)
    assert float(aux2["routing_agreeing"]) == float(aux2["routing_recorded"]) == 12 * layers
    np.testing.assert_allclose(aux2["load_balance_loss"], aux["load_balance_loss"], rtol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decode_reports_the_experts_a_full_forward_chooses(scan_layers):
    """Token t's decode step routes it as the full forward does at position t (f32)."""
    cfg = dataclasses.replace(_cfg(attention="dense"), scan_layers=scan_layers, num_layers=4)
    graphdef, params = tf.create(cfg, seed=5)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, cfg.vocab_size)
    _, aux, _ = tf.apply(graphdef, params, tokens, dropless=True, return_routing=True)
    cache = tf.init_cache(cfg, 2, 8)
    step = jax.jit(lambda tok, pos, cache: tf.decode(graphdef, params, tok, pos, cache,
                                                      return_routing=True))
    for t in range(6):
        _, cache, experts = step(tokens[:, t], jnp.full((2,), t), cache)
        np.testing.assert_array_equal(np.sort(experts, -1), np.sort(aux["routing"][:, t], -1))


def test_route_replays_recorded_tokens_and_recomputes_the_rest():
    logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.15, 0.25], [0.4, 0.05, 0.3, 0.25]]))
    recorded = jnp.asarray([[0, 2], [255, 255]], jnp.uint8)  # the second: not recorded
    experts, weights, _ = moe.route(logits, top_k=2, normalize=True, replay_NK=recorded)
    np.testing.assert_array_equal(experts, [[0, 2], [0, 2]])
    # Token 0: the recorded pair's own probabilities 0.1 and 0.15, renormalised.
    np.testing.assert_allclose(weights, [[0.4, 0.6], [4 / 7, 3 / 7]], rtol=1e-6)
    same, counted = moe.routing_agreement(jnp.asarray([[1, 3], [0, 2]]), recorded, 4)
    assert (float(same), float(counted)) == (0.0, 1.0)


def test_a_hugging_face_qwen3_moe_checkpoint_records_and_replays_its_routing():
    """Qwen3-MoE (a tiny random checkpoint transformers wrote) runs the same MoE
    layers: its decode steps report the experts the full forward chooses, and
    replaying them changes nothing (float32)."""
    import pathlib

    from dora_jax.model import hf

    fixture = pathlib.Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3_moe"
    cfg, params = hf.load_pretrained(str(fixture))
    graphdef, _ = tf.abstract_params(cfg)
    tokens = jnp.asarray(np.load(fixture / "tokens.npy"))[:, :6]
    logits, aux, _ = tf.apply(graphdef, params, tokens, dropless=True, return_routing=True)
    cache = tf.init_cache(cfg, tokens.shape[0], 8)
    for t in range(tokens.shape[1]):
        _, cache, experts = tf.decode(graphdef, params, tokens[:, t],
                                      jnp.full((tokens.shape[0],), t), cache,
                                      return_routing=True)
        np.testing.assert_array_equal(np.sort(experts, -1), np.sort(aux["routing"][:, t], -1))
    again, aux2, _ = tf.apply(graphdef, params, tokens, dropless=True,
                              routing_BTLK=aux["routing"].astype(jnp.uint8), replay=True)
    np.testing.assert_allclose(again, logits, rtol=1e-6, atol=1e-6)
    assert float(aux2["routing_agreeing"]) == float(aux2["routing_recorded"]) > 0
