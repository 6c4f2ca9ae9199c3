"""Train step: gradient accumulation, sharding invariance, learning signal, versioning,
and batch validation. References are written here from the model and loss functions
directly (no trainer code), or are the same step on one device."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _trainer_common import batch_of, leaves, make_trajectory, trainer_mesh, trajectories
from jax.sharding import PartitionSpec

from dora_jax.model import transformer
from dora_jax.rl import losses
from dora_jax.rl.batch import BatchError, TrainBatch
from dora_jax.rl.trainer import Trainer


@pytest.fixture(scope="module")
def tiny_config(load_config):
    def make(spec="configs/tiny.py:spread", model=None, **trainer):
        # Compile time dominates on CPU; one layer tests the same code.
        return load_config(spec, num_devices=len(jax.devices()), model__num_layers=1,
                           **{f"model__{k}": v for k, v in (model or {}).items()},
                           **{f"trainer__{k}": v for k, v in trainer.items()})
    return make


@pytest.fixture(scope="module")
def simple(tiny_config):
    """One update per step, no accumulation, one device."""
    return Trainer(tiny_config(), trainer_mesh())


@pytest.fixture(scope="module")
def multi_cfg(tiny_config):
    # Every optional term on: the MoE model (aux + z losses, capacity dispatch), 2
    # updates x 2 micro-batches, TIS, dual clip, KL to the initial params, weight
    # decay, warmup + cosine. (A capacity small enough to drop real tokens makes
    # XLA's CPU collectives deadlock now and then on this 8-device mesh, with or
    # without the padding mask: dropping itself is tested in test_moe.py.)
    return tiny_config("configs/moe.py:tiny",
                       model={"moe__dispatch": "capacity", "moe__capacity_factor": 2.0},
                       num_minibatches=2, micro_batches=2, objective="tis", is_cap=1.5,
                       dual_clip=3.0,
                       kl_coef=0.05, weight_decay=0.01, warmup_steps=2,
                       schedule="cosine", decay_steps=10, clip_high=0.28)


@pytest.fixture(scope="module")
def multi(multi_cfg):
    return Trainer(multi_cfg, trainer_mesh())


@pytest.fixture(scope="module")
def sharded(multi_cfg):
    return Trainer(multi_cfg, trainer_mesh(fsdp=2, tensor=2, expert=2))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_grad_accumulation_matches_full_batch(mode, tiny_config):
    cfg = tiny_config(micro_batches=4, loss_agg_mode=mode)
    tr = Trainer(cfg, trainer_mesh())
    trajs = trajectories(1, num_groups=2, group_size=4)
    # An empty response: a row with no loss tokens must neither count nor produce NaN.
    trajs[5] = make_trajectory(trajs[5].prompt_tokens, [], [], trajs[5].reward,
                          trajs[5].group_id, 0)
    batch = batch_of(trajs, 4)
    loss, grads = tr.loss_and_grads(batch)

    graphdef, t = tr.graphdef, cfg.trainer
    tokens = jnp.asarray(batch.tokens_BT)
    mask = jnp.asarray(batch.loss_mask_BT)

    def full_batch_loss(params):
        logits = transformer.apply(graphdef, params, tokens)[0]
        logp = transformer.token_logprobs(logits, tokens, cfg.rollout.temperature)
        adv = losses.group_advantages(jnp.asarray(batch.rewards_B), 4)
        loss_BT, _ = losses.ppo_clip_loss(logp, jnp.asarray(batch.behaviour_logp_BT), adv,
                                          mask, clip_low=t.clip_low, clip_high=t.clip_high)
        return losses.aggregate_loss(loss_BT, mask, mode)

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(full_batch_loss))(tr.params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(leaves(grads), leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7)
    assert max(np.abs(g).max() for g in leaves(grads)) > 1e-4  # not vacuous


@pytest.mark.slow
def test_sharded_step_matches_unsharded(multi, sharded, multi_cfg):
    start = jax.device_get(multi.state)  # common start, whatever ran on `multi` before
    multi.load_state(start)
    sharded.load_state(start)
    batch = batch_of(trajectories(2, num_groups=4, group_size=4), 4)
    m_one = jax.device_get(multi.train_step(batch))
    m_sharded = jax.device_get(sharded.train_step(batch))

    # Adam divides by sqrt(v): an element whose gradient is ~0 moves by up to lr on
    # rounding noise alone, so bound the worst element loosely (10% of lr) and demand
    # that practically all elements agree tightly.
    lr = multi_cfg.trainer.learning_rate
    for a, b in zip(leaves(sharded.params), leaves(multi.params)):
        diff = np.abs(a - b)
        assert diff.max() < 0.1 * lr
        assert np.mean(diff > 2e-6 + 1e-4 * np.abs(b)) < 1e-3
    moved = max(np.abs(a - b).max() for a, b in zip(leaves(multi.params), leaves(start.params)))
    assert moved > 1e-4
    for k in m_one:
        np.testing.assert_allclose(m_sharded[k], m_one[k], rtol=2e-4, atol=1e-6, err_msg=k)
    assert m_one["is_weight_max"] <= 1.5 + 1e-6 and m_one["clip_frac_low"] > 0
    assert m_one["load_balance_loss"] > 0
    # The step keeps params on the trainer mesh with their rule-derived shardings.
    wq = sharded.params["blocks"][0]["attn"]["wq"][...]
    assert wq.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)  # layers stacked
    assert len(wq.sharding.device_set) == 8
    w_up = sharded.params["blocks"][0]["mlp"]["w_up"][...]  # stacked experts
    assert w_up.sharding.spec[1] == "expert"


def _response_logp(graphdef, params, batch, temperature):
    score = jax.jit(lambda p, tok: transformer.token_logprobs(
        transformer.apply(graphdef, p, tok)[0], tok, temperature))
    logp_BT = np.asarray(score(params, jnp.asarray(batch.tokens_BT)))
    return (logp_BT * batch.loss_mask_BT).sum(-1), logp_BT


def test_advantage_sign_moves_logprob(simple):
    cfg = simple.cfg
    # Group 0: sample 0 rewarded, group 1: sample 3 rewarded. On-policy behaviour.
    rewards = [1, 0, 0, 0, 0, 0, 0, 1]
    probe = batch_of(trajectories(3, 2, 4, rewards=rewards), 4)
    before, logp_BT = _response_logp(simple.graphdef, simple.params, probe,
                                     cfg.rollout.temperature)
    behaviour = [logp_BT[i, probe.loss_mask_BT[i] > 0] for i in range(8)]
    batch = batch_of(trajectories(3, 2, 4, rewards=rewards, behaviour=behaviour), 4)
    np.testing.assert_array_equal(batch.tokens_BT, probe.tokens_BT)
    metrics = simple.train_step(batch)
    after, _ = _response_logp(simple.graphdef, simple.params, batch, cfg.rollout.temperature)
    assert float(metrics["ratio_max"]) == pytest.approx(1.0, abs=1e-4)  # on-policy
    positive = np.array(rewards) == 1
    assert np.all(after[positive] > before[positive] + 1e-3), (before, after)
    assert np.all(after[~positive] < before[~positive] - 1e-3), (before, after)


@pytest.mark.parametrize("which", ["simple", "multi"])
def test_version_increments_once_per_step(which, request):
    tr = request.getfixturevalue(which)
    M = tr.cfg.trainer.num_minibatches
    v0, u0 = tr.version, tr.opt_updates
    groups = 2 if which == "simple" else 4  # the batch sizes the other tests compiled
    compiled = []
    for i in range(2):
        # Different lengths within one bucket; behaviour version 0 (stale by v0 + i).
        batch = batch_of(trajectories(10 + i, groups, 4, max_len=20 + 12 * i), 4)
        m = jax.device_get(tr.train_step(batch))
        assert tr.version == v0 + i + 1 == int(m["version"])
        assert int(tr.state.version) == tr.version == int(tr.state.step)
        assert int(m["updates_this_step"]) == M
        assert tr.opt_updates == u0 + M * (i + 1) == int(m["opt_updates"])
        assert m["staleness_max"] == m["staleness_mean"] == v0 + i
        assert m["response_tokens"] == batch.num_response_tokens
        compiled.append(tr._step_jit._cache_size())
    assert compiled[0] == compiled[1]  # another length in the same bucket: no recompile


def test_learning_rate_schedule_in_metrics(multi):
    # warmup 2 then cosine over 10 updates; the metric is the last update's rate.
    u = multi.opt_updates + 1  # the step's last update index
    peak = multi.cfg.trainer.learning_rate
    expected = peak * ((u + 1) / 2 if u < 2 else 0.5 * (1 + np.cos(np.pi * min(u - 2, 10) / 10)))
    m = multi.train_step(batch_of(trajectories(20, 4, 4), 4))
    assert float(m["learning_rate"]) == pytest.approx(expected, rel=1e-5)


def test_batch_errors(simple, multi):
    good = trajectories(4, 2, 4)
    with pytest.raises(BatchError, match="expected group_size=4"):
        batch_of(good[:7], 4)
    with pytest.raises(BatchError, match="exceeds the largest bucket 32"):
        long = make_trajectory([5] * 10, [6] * 30, [-1.0] * 30, 0.0, "x", 0)
        batch_of([long], 1)
    with pytest.raises(BatchError, match="3 response tokens but 2 behaviour log-probs"):
        batch_of([make_trajectory([5], [6, 7, 8], [-1.0, -1.0], 0.0, "x", 0)], 1)
    with pytest.raises(BatchError, match="mixes policy versions"):
        batch_of([make_trajectory([5], [6], [-1.0], 0.0, "x", v) for v in (0, 1)], 2)
    with pytest.raises(BatchError, match="empty prompt"):
        batch_of([make_trajectory([], [6], [-1.0], 0.0, "x", 0)], 1)
    with pytest.raises(BatchError, match="must be log-probabilities"):
        batch_of([make_trajectory([5], [6], [0.5], 0.0, "x", 0)], 1)
    with pytest.raises(BatchError, match="has no field 'reward'"):
        batch_of([dict(prompt_tokens=[5], response_tokens=[6], behaviour_logprobs=[-1.0],
                       group_id=0, version=0)], 1)
    b = batch_of(good, 4)
    with pytest.raises(BatchError, match="not a multiple of group_size=3"):
        TrainBatch(b.tokens_BT, b.loss_mask_BT, b.behaviour_logp_BT, b.rewards_B,
                   b.versions_B, b.seq_lens_B, group_size=3)
    with pytest.raises(BatchError, match="not divisible by num_minibatches \\* micro_batches"):
        multi.train_step(batch_of(trajectories(5, 3, 2), 2))  # B=6, M*U=4
    with pytest.raises(BatchError, match="not one of trainer.length_buckets"):
        simple.train_step(batch_of(good, 4, buckets=(16, 48)))
    v = simple.version
    with pytest.raises(BatchError, match=f"version {v + 1}, newer than the trainer's"):
        simple.train_step(batch_of(trajectories(4, 2, 4, version=v + 1), 4))
    with pytest.raises(BatchError):
        simple.train_step("not a batch")
    assert simple.version == v  # a rejected batch does not advance the version


def test_micro_batch_must_split_over_batch_shards(sharded):
    with pytest.raises(BatchError, match="divisible by the 4 batch shards"):
        sharded.train_step(batch_of(trajectories(6, 2, 4), 4))  # b = 8 / 4 = 2 rows


def test_golden_metrics_of_one_step(tiny_config):
    """Pins one train step of a fresh tiny policy (configs/tiny.py, one layer, one
    device) on a fixed batch: a change anywhere in the model, the objective or the
    optimizer that moves these numbers is a change of behaviour, to be explained.
    Figures as printed by this step on CPU with the pinned dependencies."""
    tr = Trainer(tiny_config(), trainer_mesh())
    m = jax.device_get(tr.train_step(batch_of(trajectories(7, 2, 4), 4)))
    got = {k: float(m[k]) for k in ("loss", "grad_norm", "entropy", "approx_kl")}
    assert got == pytest.approx(dict(loss=0.0833042, grad_norm=1.569503, entropy=4.378455,
                                     approx_kl=0.4644768), rel=1e-4)
