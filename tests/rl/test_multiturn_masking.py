"""Observation tokens of multi-turn episodes carry no loss and no log-prob ratio:
through the batch, both layouts (padded, packed) and every objective, against
references that mask by hand."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from _trainer_common import leaves, make_trajectory, trainer_mesh
from test_packing import ROW, VOCAB, _assert_close, _padded_reference

from dora_jax.config import LOSS_AGG_MODES, OBJECTIVES
from dora_jax.rl.batch import TrainBatch
from dora_jax.rl.trainer import Trainer


def episodes(seed, num_groups, group_size):
    """Trajectories whose responses alternate model turns and observations (ranges
    drawn at random), with the observation ranges kept aside for the hand mask."""
    rng = np.random.default_rng(seed)
    trajs, hand = [], []
    for g in range(num_groups):
        prompt = rng.integers(2, VOCAB, rng.integers(2, 6)).tolist()
        for _ in range(group_size):
            turns, at = [], 0
            for k in range(int(rng.integers(1, 4))):
                if k:
                    n_obs = int(rng.integers(1, 6))
                    turns.append(["env", at, at + n_obs, 0.01])
                    at += n_obs
                n_model = int(rng.integers(1, 9))
                turns.append(["model", at, at + n_model])
                at += n_model
            logp = (np.log(1 / VOCAB) + 0.3 * rng.standard_normal(at)).clip(max=-1e-3)
            mask = np.ones(at, np.float32)
            for role, s, e, *_ in turns:
                if role == "env":
                    mask[s:e] = 0.0
                    logp[s:e] = 0.0  # as the slice records them
            t = make_trajectory(prompt, rng.integers(2, VOCAB, at).tolist(), logp.tolist(),
                                float(rng.random()), f"e{seed}-{g}", 0)
            t.episode = {"turns": turns, "reward": t.reward}
            trajs.append(t)
            hand.append((len(prompt), mask))
    return trajs, hand


def hand_masked(batch: TrainBatch, hand) -> TrainBatch:
    """The same rows with the loss mask written out by hand from the turn ranges."""
    mask = np.zeros_like(batch.loss_mask_BT)
    for i, (P, m) in enumerate(hand):
        mask[i, P:P + m.size] = m
    return dataclasses.replace(batch, loss_mask_BT=mask,
                               behaviour_logp_BT=batch.behaviour_logp_BT * mask,
                               token_versions_BT=None)


@pytest.fixture(scope="module")
def cfg_of(load_config):
    def make(**trainer):
        trainer.setdefault("length_buckets", (32, ROW))
        return load_config("configs/tiny.py:spread", num_devices=len(jax.devices()),
                           model__num_layers=1, rollout__max_decode_len=ROW - 16,
                           **{f"trainer__{k}": v for k, v in trainer.items()})
    return make


def test_the_batch_masks_observation_tokens_as_written_by_hand():
    trajs, hand = episodes(0, num_groups=3, group_size=4)
    batch = TrainBatch.from_trajectories(trajs, group_size=4, length_buckets=(32, ROW))
    want = hand_masked(batch, hand)
    np.testing.assert_array_equal(batch.loss_mask_BT, want.loss_mask_BT)
    assert (batch.loss_mask_BT.sum(1) < batch.seq_lens_B - [P for P, _ in hand]).any()
    np.testing.assert_array_equal(batch.token_versions_BT * (1 - batch.loss_mask_BT), 0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_the_objective_equals_a_hand_masked_reference(mode, packed, cfg_of):
    """Loss and gradients of an episode batch, padded or packed, equal the objective
    computed from the model and loss functions directly on the hand-masked batch."""
    cfg = cfg_of(loss_agg_mode=mode, tokens_per_microbatch=16 * ROW if packed else 0)
    tr = Trainer(cfg, trainer_mesh())
    trajs, hand = episodes(1, num_groups=4, group_size=4)
    batch = TrainBatch.from_trajectories(trajs, group_size=4, length_buckets=(32, ROW))
    loss, grads = tr.loss_and_grads(batch)
    _assert_close(loss, grads, *_padded_reference(tr, cfg, hand_masked(batch, hand), 4))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_no_objective_reads_observation_log_probs(objective, cfg_of):
    """Whatever log-probs the observation tokens carry, every objective's loss and
    gradients are those of the hand-masked batch: no ratio is formed there."""
    extra = {"is_cap": 2.0} if objective != "behaviour_clip" else {}
    cfg = cfg_of(objective=objective, tokens_per_microbatch=16 * ROW, **extra)
    tr = Trainer(cfg, trainer_mesh())
    trajs, hand = episodes(2, num_groups=2, group_size=4)
    rng = np.random.default_rng(3)
    for t, (_, m) in zip(trajs, hand):  # garbage where the environment wrote
        lp = np.asarray(t.behaviour_logprobs)
        t.behaviour_logprobs = np.where(m == 0, -rng.uniform(0.1, 9, lp.size), lp).tolist()
    batch = TrainBatch.from_trajectories(trajs, group_size=4, length_buckets=(32, ROW))
    loss, grads = tr.loss_and_grads(batch)
    ref_loss, ref_grads = tr.loss_and_grads(hand_masked(batch, hand))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6, atol=1e-8)
    for g, r in zip(leaves(grads), leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-9)
    # Unmasked, the same batch is a different objective (the check can fail).
    unmasked = dataclasses.replace(batch, loss_mask_BT=(
        np.arange(batch.length)[None] < batch.seq_lens_B[:, None]).astype(np.float32)
        * (np.arange(batch.length)[None] >= np.array([P for P, _ in hand])[:, None]),
        token_versions_BT=None)
    other, _ = tr.loss_and_grads(unmasked)
    assert abs(float(other) - float(loss)) > 1e-4
