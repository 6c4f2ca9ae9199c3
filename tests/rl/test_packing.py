"""Packed training: samples packed whole into rows (rl/packing.py) give the padded
batch's objective and gradients in every aggregation mode, with and without KL, dense
and MoE; micro-batches cut by tokens accumulate to the whole batch; the step compiles
once for any length distribution. References are written from the model and the loss
functions on the padded batch, not from the trainer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import leaves, make_trajectory, trainer_mesh

from dora_jax.config import LOSS_AGG_MODES
from dora_jax.model import transformer
from dora_jax.rl import losses, packing
from dora_jax.rl.batch import BatchError, TrainBatch
from dora_jax.rl.trainer import Trainer

VOCAB = 128
ROW = 64  # the packed row: the largest length bucket below


def long_tail(seed, num_groups, group_size, *, max_len=ROW, version=0):
    """Trajectories with long-tailed response lengths (lognormal, a few near the
    limit), so a padded batch is mostly padding."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        prompt = rng.integers(2, VOCAB, rng.integers(1, 6)).tolist()
        for k in range(group_size):
            n = int(min(max_len - len(prompt), max(1, rng.lognormal(1.5, 1.0))))
            if (g, k) == (0, 1):
                n = max_len - len(prompt)  # the tail every padded row pays for
            logp = (np.log(1 / VOCAB) + 0.3 * rng.standard_normal(n)).clip(max=0)
            out.append(make_trajectory(prompt, rng.integers(2, VOCAB, n).tolist(),
                                       logp.tolist(), float(rng.random()),
                                       f"g{seed}-{g}", version))
    return out


def batch_of(trajs, group_size):
    return TrainBatch.from_trajectories(trajs, group_size=group_size, length_buckets=(32, ROW))


@pytest.fixture(scope="module")
def cfg_of(load_config):
    def make(spec="configs/tiny.py:spread", model=None, mesh=None, **trainer):
        trainer.setdefault("length_buckets", (32, ROW))
        return load_config(spec, num_devices=len(jax.devices()), model__num_layers=1,
                           rollout__max_decode_len=ROW - 16,
                           **{f"model__{k}": v for k, v in (model or {}).items()},
                           **{f"mesh__{k}": v for k, v in (mesh or {}).items()},
                           **{f"trainer__{k}": v for k, v in trainer.items()})
    return make


# ------------------------------------------------------------------ layout, by hand

def test_first_fit_by_decreasing_length_by_hand():
    # 5 -> row 0 (room 3); 4 -> row 1 (room 4); 3 -> row 0 (room 0); 2 -> row 1.
    assert packing.first_fit_rows([5, 3, 4, 2], 8) == [[0, 1], [2, 3]]
    assert packing.first_fit_rows([8, 8], 8) == [[0], [1]]
    with pytest.raises(BatchError, match="does not fit a packed row of 8"):
        packing.first_fit_rows([9], 8)


def test_packed_layout_holds_every_token_once():
    batch = batch_of(long_tail(0, num_groups=4, group_size=4), 4)
    out = packing.packed(batch, num_minibatches=2, row_length=ROW, rows_per_micro=2)
    M, U, r, T = out["tokens"].shape
    assert (M, r, T) == (2, 2, ROW) and U == packing.micro_batches_needed(16, 2, 2) == 4
    assert out["rewards"].shape == (16,)
    for i in range(batch.batch_size):
        where = out["sample"] == i
        m = np.nonzero(where)[0]
        assert set(m) == {i // 8}, "a sample stays in its minibatch"
        n = batch.seq_lens_B[i]
        np.testing.assert_array_equal(out["tokens"][where], batch.tokens_BT[i, :n])
        np.testing.assert_array_equal(out["positions"][where], np.arange(n))
        np.testing.assert_array_equal(out["loss_mask"][where], batch.loss_mask_BT[i, :n])
        np.testing.assert_array_equal(out["behaviour_logp"][where],
                                      batch.behaviour_logp_BT[i, :n])
        assert len(np.unique(out["segment_ids"][where])) == 1  # one row, one segment
    assert (out["segment_ids"] > 0).sum() == batch.seq_lens_B.sum()
    assert ((out["segment_ids"] > 0) == (out["sample"] >= 0)).all()
    # Packed, the batch takes fewer positions than padded to its longest sample.
    assert (out["segment_ids"] > 0).any(axis=-1).sum() * ROW < batch.batch_size * batch.length


# ------------------------------------------------------- objective equals the padded

def _padded_reference(tr, cfg, batch, group_size, ref_params=None):
    """The minibatch objective on the padded batch, from the model and the loss
    functions directly (one micro-batch, behaviour clip, the config's aggregation)."""
    t, graphdef = cfg.trainer, tr.graphdef
    tokens = jnp.asarray(batch.tokens_BT)
    mask = jnp.asarray(batch.loss_mask_BT)
    valid = jnp.arange(batch.length)[None, :] < jnp.asarray(batch.seq_lens_B)[:, None]
    adv = losses.group_advantages(jnp.asarray(batch.rewards_B), group_size)

    def agg(x):
        if t.loss_agg_mode == "token-mean":
            return losses.aggregate_loss(x, mask, "token-mean")
        return losses.aggregate_loss(x, mask, t.loss_agg_mode,
                                     max_len=cfg.rollout.max_decode_len)

    def loss_fn(params):
        logits, aux, _ = transformer.apply(graphdef, params, tokens, valid_BT=valid)
        logp = transformer.token_logprobs(logits, tokens, cfg.rollout.temperature)
        loss_BT, _ = losses.ppo_clip_loss(logp, jnp.asarray(batch.behaviour_logp_BT), adv,
                                          mask, clip_low=t.clip_low, clip_high=t.clip_high)
        total = agg(loss_BT)
        if ref_params is not None:
            ref = transformer.apply(graphdef, ref_params, tokens, valid_BT=valid)[0]
            ref_logp = jax.lax.stop_gradient(
                transformer.token_logprobs(ref, tokens, cfg.rollout.temperature))
            total = total + t.kl_coef * agg(losses.kl_divergence(logp, ref_logp, t.kl_kind))
        if cfg.model.moe.enabled:
            m = cfg.model.moe
            total = total + (m.aux_loss_coef * aux["load_balance_loss"]
                             + m.z_loss_coef * aux["router_z_loss"])
        return total

    return jax.jit(jax.value_and_grad(loss_fn))(tr.params)


def _assert_close(loss, grads, ref_loss, ref_grads):
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=2e-5, atol=1e-7)
    for g, r in zip(leaves(grads), leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-7)
    assert max(np.abs(g).max() for g in leaves(grads)) > 1e-4  # not vacuous


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_packed_objective_equals_padded_in_every_aggregation_mode(mode, cfg_of):
    """One micro-batch of packed rows (several samples per row, attention kept within
    each): the loss and gradients of the padded batch."""
    cfg = cfg_of(loss_agg_mode=mode, tokens_per_microbatch=16 * ROW)
    tr = Trainer(cfg, trainer_mesh())
    batch = batch_of(long_tail(1, num_groups=4, group_size=4), 4)
    loss, grads = tr.loss_and_grads(batch)
    _assert_close(loss, grads, *_padded_reference(tr, cfg, batch, 4))


@pytest.mark.parametrize("spec", ["configs/tiny.py:spread", "configs/moe.py:tiny"])
def test_packed_objective_with_kl_equals_padded_dense_and_moe(spec, cfg_of):
    """KL to a reference, MoE aux losses (dropless: routing per token, counted over
    real tokens only), seq-mean aggregation."""
    model = {"moe__dispatch": "dropless"} if "moe" in spec else None
    cfg = cfg_of(spec, model=model, kl_coef=0.1, loss_agg_mode="seq-mean-token-mean",
                 tokens_per_microbatch=16 * ROW)
    _, ref_params = transformer.create(cfg.model, seed=7)
    tr = Trainer(cfg, trainer_mesh(), ref_params=ref_params)
    batch = batch_of(long_tail(2, num_groups=2, group_size=8), 8)
    loss, grads = tr.loss_and_grads(batch)
    _assert_close(loss, grads, *_padded_reference(tr, cfg, batch, 8, tr.ref_params))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_micro_batches_by_tokens_accumulate_to_the_whole_batch(mode, cfg_of):
    """Rows of 64 tokens, 2 rows per micro-batch: the batch spreads over several
    micro-batches (some left empty and skipped), and the accumulated gradient is the
    whole padded batch's."""
    cfg = cfg_of(loss_agg_mode=mode, tokens_per_microbatch=2 * ROW,
                 mesh=dict(trainer__data=1, trainer__fsdp=1))  # one shard: 2-row micro-batches
    tr = Trainer(cfg, trainer_mesh())
    batch = batch_of(long_tail(3, num_groups=4, group_size=4), 4)
    layout = packing.packed(batch, 1, ROW, 2)
    used = np.any(layout["segment_ids"] > 0, axis=(2, 3))[0]
    assert used.sum() >= 2 and not used.all(), used  # several micro-batches, one empty
    loss, grads = tr.loss_and_grads(batch)
    _assert_close(loss, grads, *_padded_reference(tr, cfg, batch, 4))


def test_packed_steps_equal_padded_steps(cfg_of):
    """Two steps of two updates each (the proximal pre-pass, the optimizer, the
    metrics): packed and padded trainers from the same params end equal."""
    common = dict(num_minibatches=2, objective="decoupled", loss_agg_mode="seq-mean-token-mean")
    packed_tr = Trainer(cfg_of(tokens_per_microbatch=4 * ROW, **common), trainer_mesh())
    padded_tr = Trainer(cfg_of(**common), trainer_mesh(),
                        params=jax.tree.map(jnp.copy, packed_tr.params))
    for step in range(2):
        batch = batch_of(long_tail(10 + step, num_groups=4, group_size=4, version=step), 4)
        got, want = packed_tr.train_step(batch), padded_tr.train_step(batch)
        for k in ("loss", "pg_loss", "ratio_mean", "entropy", "response_tokens", "samples",
                  "sequence_tokens", "advantage_abs_mean", "staleness_mean"):
            np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-4, atol=1e-6,
                                       err_msg=k)
    # Adam's update (about lr * g / |g|) turns a float-rounding difference in a
    # gradient entry that nearly cancels into up to ~1e-5 here: 1% of lr = 0.01 is
    # allowed, where a wrong mask or position would move every entry by ~lr.
    for a, b in zip(leaves(packed_tr.params), leaves(padded_tr.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


_compiles: list = []  # programs compiled while a test listens (None: not listening)


def _count_compiles(name, secs, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration" and _compiles and _compiles[0]:
        _compiles.append(name)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


def test_packed_step_compiles_once_for_any_lengths(cfg_of):
    """After warm-up, long-tailed batches of every length mix (the longest response
    1 token or the whole row; padded buckets 32 and 64) run without compiling
    anything again: the packed layout has one shape."""
    cfg = cfg_of(tokens_per_microbatch=4 * ROW)
    tr = Trainer(cfg, trainer_mesh())
    tr.warmup(batch_size=16, group_size=4)
    _compiles[:] = [True]
    try:
        for seed in range(4):
            max_len = [8, 24, 40, ROW][seed]
            tr.train_step(batch_of(long_tail(20 + seed, 4, 4, max_len=max_len, version=seed), 4))
        jax.block_until_ready(tr.params)
    finally:
        compiled, _compiles[:] = _compiles[1:], []
    assert compiled == [], compiled


def test_sft_step_packed_equals_padded(cfg_of):
    """The supervised warm start's update on packed rows (several micro-batches) is
    the padded batch's: the same loss and the same params after it."""
    import dataclasses

    import optax

    from dora_jax import sft

    packed_cfg = cfg_of(tokens_per_microbatch=4 * ROW)
    padded_cfg = dataclasses.replace(packed_cfg, trainer=dataclasses.replace(
        packed_cfg.trainer, tokens_per_microbatch=0))
    graphdef, params = transformer.create(packed_cfg.model, seed=0)
    tx = optax.adam(1e-3)
    batch = batch_of(long_tail(5, num_groups=8, group_size=2), 2)
    out = {}
    for name, cfg in (("packed", packed_cfg), ("padded", padded_cfg)):
        rows = sft._layout(cfg, batch)
        step = jax.jit(functools.partial(sft._step, graphdef, tx, name == "packed", None))
        out[name] = step(params, tx.init(params), rows)
    assert (packing.micro_batches_needed(16, 1, 4)
            == sft._layout(packed_cfg, batch)["tokens"].shape[0])
    np.testing.assert_allclose(float(out["packed"][2]), float(out["padded"][2]), rtol=1e-5)
    for a, b in zip(leaves(out["packed"][0]), leaves(out["padded"][0])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
