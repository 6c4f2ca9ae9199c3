"""Packed rows in the model's training forward: several sequences concatenated in a
row (`segment_ids_BT`, positions restarting per sequence) give each sequence the
logits, log-prob gradients and MoE losses it has in an unpacked batch, whatever the
attention implementation and wherever the padding sits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, load_repo_config

from dora_jax.model import attention
from dora_jax.model import transformer as tf

# Rows of a packed batch: a positive count is a sequence of that many tokens, a
# negative one a run of padding. The second row has padding between sequences.
ROWS = [[5, 7, 3, -3], [9, -2, 6, -1]]
# Splash needs blocks of 128: two blocks, the middle sequence crossing between them.
SPLASH_ROWS = [[70, 100, 40, -46]]
AUX_WEIGHT = 0.1  # the MoE losses enter the checked objective, so their gradients too


def _pack(rows, vocab, seed=0):
    """(tokens_BT, segment_ids_BT, positions_BT, [(row, start, tokens) per sequence]):
    random tokens, padding included (its content must not matter), positions written
    out by hand."""
    rng = np.random.default_rng(seed)
    T = sum(abs(n) for n in rows[0])
    tokens = rng.integers(0, vocab, (len(rows), T))
    segments = np.zeros((len(rows), T), np.int32)
    positions = np.zeros((len(rows), T), np.int32)
    seqs = []
    for b, row in enumerate(rows):
        assert sum(abs(n) for n in row) == T
        t, seg = 0, 0
        for n in row:
            if n > 0:
                seg += 1
                segments[b, t:t + n] = seg
                positions[b, t:t + n] = np.arange(n)
                seqs.append((b, t, tokens[b, t:t + n]))
            t += abs(n)
    return jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions), seqs


def _objective(logits_BTV, aux, tokens_BT, mask_BT):
    """Sum of the masked next-token log-probs plus the weighted MoE losses."""
    logp_BT = tf.token_logprobs(logits_BTV, tokens_BT)
    return jnp.sum(jnp.where(mask_BT, logp_BT, 0.0)) + AUX_WEIGHT * (
        aux["load_balance_loss"] + aux["router_z_loss"])


def _packed(graphdef, params, tokens_BT, segment_ids_BT, positions_BT):
    """(objective, (logits, aux)) and its gradient over a packed batch: the first
    token of each sequence has no prediction, padding none at all."""
    def loss(p):
        logits, aux, _ = tf.apply(graphdef, p, tokens_BT, positions_BT, dropless=True,
                                  segment_ids_BT=segment_ids_BT)
        mask = (segment_ids_BT > 0) & (positions_BT > 0)
        return _objective(logits, aux, tokens_BT, mask), (logits, aux)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _unpacked(graphdef, params, seqs):
    """The same, one sequence per row, right-padded with `valid_BT`: the layout
    packing replaces."""
    L = max(len(s) for _, _, s in seqs)
    tokens = jnp.asarray(np.stack([np.pad(s, (0, L - len(s))) for _, _, s in seqs]))
    valid = jnp.asarray(np.stack([np.arange(L) < len(s) for _, _, s in seqs]))

    def loss(p):
        logits, aux, _ = tf.apply(graphdef, p, tokens, dropless=True, valid_BT=valid)
        mask = valid & (jnp.arange(L) > 0)
        return _objective(logits, aux, tokens, mask), (logits, aux)
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _model(kind, **overrides):
    cfg = load_repo_config(TINY[kind]).model
    return dataclasses.replace(cfg, **overrides)


@functools.cache
def _reference(kind, rows_key, num_layers):
    """Unpacked objective, logits, aux and gradients (dense attention) for `rows`."""
    rows = [list(r) for r in rows_key]
    cfg = _model(kind, attention="dense", num_layers=num_layers)
    graphdef, params = tf.create(cfg, seed=1)
    *_, seqs = _pack(rows, cfg.vocab_size)
    return params, seqs, _unpacked(graphdef, params, seqs)


def _check_against_reference(kind, rows, cfg_overrides, num_layers=2):
    cfg = _model(kind, num_layers=num_layers, **cfg_overrides)
    graphdef, _ = tf.create(cfg, seed=1)
    params, seqs, ((ref_loss, (ref_logits, ref_aux)), ref_grads) = _reference(
        kind, tuple(map(tuple, rows)), num_layers)
    tokens, segments, positions, _ = _pack(rows, cfg.vocab_size)
    (loss, (logits, aux)), grads = _packed(graphdef, params, tokens, segments, positions)

    assert np.isfinite(np.asarray(logits)).all()  # at padding too
    for i, (b, start, seq) in enumerate(seqs):
        np.testing.assert_allclose(logits[b, start:start + len(seq)], ref_logits[i, :len(seq)],
                                   atol=1e-5, err_msg=f"sequence {i}")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in tf.AUX_KEYS:
        np.testing.assert_allclose(aux[key], ref_aux[key], rtol=1e-5, atol=1e-7, err_msg=key)
    flat, ref_flat = jax.tree.leaves_with_path(grads), jax.tree.leaves(ref_grads)
    for (path, g), r in zip(flat, ref_flat, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("impl, block", [("dense", 512), ("blockwise", 4)])
@pytest.mark.parametrize("kind", sorted(TINY))
def test_packed_rows_equal_the_unpacked_batch(kind, impl, block):
    """Logits of every real token, the objective, its gradients (through the
    blockwise backward, with blocks of 4 so that sequences cross block boundaries)
    and the MoE losses over the real tokens."""
    _check_against_reference(kind, ROWS, dict(attention=impl, attention_block=block))


def test_packed_rows_equal_the_unpacked_batch_with_splash(monkeypatch):
    """The splash kernel (Pallas interpreter) with segment ids, one layer."""
    kernel = attention.splash_causal
    monkeypatch.setattr(attention, "splash_causal",
                        lambda *args, interpret, **kw: kernel(*args, interpret=True, **kw))
    _check_against_reference("dense", SPLASH_ROWS, dict(attention="splash",
                                                         attention_block=128), num_layers=1)


def test_the_unpacked_reference_is_each_sequence_alone():
    """Guards the reference: a right-padded row gives its sequence's own logits."""
    cfg = _model("moe", attention="dense")
    graphdef, _ = tf.create(cfg, seed=1)
    params, seqs, ((_, (ref_logits, _)), _) = _reference("moe", tuple(map(tuple, ROWS)), 2)
    for i, (_, _, seq) in enumerate(seqs):
        alone, _, _ = tf.apply(graphdef, params, jnp.asarray(seq)[None], dropless=True)
        np.testing.assert_allclose(ref_logits[i, :len(seq)], alone[0], atol=1e-5)


def test_segment_positions_restart_at_each_sequence():
    segments = jnp.array([[1, 1, 1, 2, 2, 0, 0], [1, 0, 2, 2, 2, 2, 0]])
    np.testing.assert_array_equal(tf.segment_positions(segments),
                                  [[0, 1, 2, 0, 1, 0, 1], [0, 0, 0, 1, 2, 3, 0]])


def test_default_positions_and_mask_come_from_the_segments():
    """Without positions_BT or valid_BT the forward derives them from the segment
    ids: the same real tokens' logits and MoE losses as when the caller gives them
    (padding's positions are the caller's to choose)."""
    cfg = _model("moe")
    graphdef, params = tf.create(cfg, seed=1)
    tokens, segments, positions, _ = _pack(ROWS, cfg.vocab_size)
    fwd = jax.jit(lambda pos, valid: tf.apply(graphdef, params, tokens, pos, dropless=True,
                                              segment_ids_BT=segments, valid_BT=valid)[:2])
    logits, aux = fwd(None, None)
    given_logits, given_aux = fwd(positions, segments > 0)
    real = np.asarray(segments) > 0
    # Two compilations: equal up to the order of float reductions.
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(given_logits)[real],
                               rtol=1e-5, atol=1e-5)
    for key in tf.AUX_KEYS:
        np.testing.assert_allclose(aux[key], given_aux[key], rtol=1e-5, atol=1e-6)


def test_packed_rows_refuse_a_past_cache():
    cfg = _model("dense")
    graphdef, params = tf.create(cfg)
    cache = tf.init_cache(cfg, 1, 4)
    with pytest.raises(ValueError, match="segment_ids_BT"):
        tf.apply(graphdef, params, jnp.zeros((1, 2), jnp.int32), past=cache, past_length=2,
                 segment_ids_BT=jnp.ones((1, 2), jnp.int32))
