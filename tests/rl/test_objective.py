"""The off-policy objectives inside the train step, against references written here
from the model and jnp alone (not rl/losses.py): every objective with nonzero
behaviour log-probs and KL on, gradient accumulation included; the trainer's
log-probs against the engine's at staleness 0; non-finite updates skipped; overlong
filtering; staleness counted per token."""

import dataclasses
import math

import _rollout_common as rc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import batch_of, leaves, make_trajectory, trainer_mesh, trajectories

from dora_jax.model import transformer
from dora_jax.rl import objective
from dora_jax.rl.batch import TrainBatch
from dora_jax.rl.trainer import Trainer
from dora_jax.rollout import Request

CAP = 1.3


@pytest.fixture(scope="module")
def one_layer(load_config):
    def make(**trainer):
        return load_config("configs/tiny.py:spread", num_devices=len(jax.devices()),
                           model__num_layers=1, **{f"trainer__{k}": v for k, v in trainer.items()})
    return make


def _reference_loss(cfg, graphdef, params, ref_params, batch, kl_coef):
    """Token-mean objective of the whole batch as ONE update, written out by hand."""
    t = cfg.trainer
    tokens, mask = jnp.asarray(batch.tokens_BT), jnp.asarray(batch.loss_mask_BT)
    mu = jnp.asarray(batch.behaviour_logp_BT)
    r_GK = jnp.asarray(batch.rewards_B).reshape(-1, batch.group_size)
    adv = ((r_GK - r_GK.mean(1, keepdims=True))
           / (r_GK.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)[:, None]

    def logp_of(p):
        logits = transformer.apply(graphdef, p, tokens)[0] / cfg.rollout.temperature
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return jnp.pad(jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0], ((0, 0), (1, 0)))

    ref = jax.lax.stop_gradient(logp_of(ref_params))

    def loss(p):
        logp = logp_of(p)
        start = jax.lax.stop_gradient(logp)
        if t.objective == "behaviour_clip":
            r, weight = jnp.exp(logp - mu), 1.0
        else:
            r = jnp.exp(logp - start)
            w = jnp.exp(start - mu)
            weight = jnp.where(w > CAP, 0.0, w) if t.is_mode == "mask" else jnp.minimum(w, CAP)
        surr = -jnp.minimum(r * adv, jnp.clip(r, 1 - t.clip_low, 1 + t.clip_high) * adv)
        pg = jnp.sum(weight * surr * mask) / jnp.sum(mask)
        d = ref - logp
        kl = jnp.sum((jnp.exp(d) - d - 1) * mask) / jnp.sum(mask)
        return pg + kl_coef * kl

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("objective_kw", [
    dict(objective="behaviour_clip"),
    dict(objective="decoupled", is_cap=CAP, is_mode="mask"),
    dict(objective="tis", is_cap=CAP),
], ids=lambda kw: kw["objective"])
def test_every_objective_equals_its_reference_with_accumulation_and_kl(objective_kw, one_layer):
    cfg = one_layer(micro_batches=4, kl_coef=0.1, **objective_kw)
    tr = Trainer(cfg, trainer_mesh())
    tr.train_step(batch_of(trajectories(30, 2, 4), 4))  # params now differ from the reference
    # Behaviour log-probs: the model's own, shifted by +-0.4 (stale or mismatched), so
    # ratios and weights spread on both sides of 1 and of the cap.
    probe = batch_of(trajectories(31, 2, 4), 4)
    logits = transformer.apply(tr.graphdef, tr.params, jnp.asarray(probe.tokens_BT))[0]
    own = np.asarray(transformer.token_logprobs(logits, jnp.asarray(probe.tokens_BT),
                                                cfg.rollout.temperature))
    rng = np.random.default_rng(0)
    behaviour = [np.minimum(own[i, probe.loss_mask_BT[i] > 0]
                            + rng.uniform(-0.4, 0.4, int(probe.loss_mask_BT[i].sum())), 0.0)
                 for i in range(8)]
    batch = batch_of(trajectories(31, 2, 4, behaviour=behaviour), 4)
    loss, grads = tr.loss_and_grads(batch)
    ref_loss, ref_grads = _reference_loss(cfg, tr.graphdef, tr.params, tr.ref_params, batch, 0.1)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, r in zip(leaves(grads), leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7)
    assert max(np.abs(g).max() for g in leaves(grads)) > 1e-4
    w = np.exp(own - batch.behaviour_logp_BT)[batch.loss_mask_BT > 0]
    assert (w > CAP).any() and (w < 1).any()  # the cap and both sides are exercised


def _engine_batch(model, kind, group_size=4, groups=2):
    """Trajectories sampled by a version-0 slice of the tiny `model`."""
    sl = rc.make_slice(0, model, kind, 0)
    trajs = []
    for g in range(groups):  # a group fills the slice's slots
        for k in range(group_size):
            sl.submit(Request(group_id=g, prompt_id=g, sample_index=k,
                              prompt_tokens=rc.PROMPTS[g], version=0, group_version=0,
                              seed=np.array([g, k], np.uint32)))
        trajs += sorted(sl.drain(), key=lambda t: t.sample_index)
    for t in trajs:
        t.reward = float(len(t.response_tokens) % 3)
    return trajs


@pytest.mark.parametrize("model, kind", [("dense", "sampled"), ("dense", "topk"),
                                         ("moe", "sampled")])
def test_logprob_mismatch_is_zero_at_staleness_zero(model, kind):
    """The trainer, on the engine's params, reproduces the engine's log-probs of the
    tokens it sampled: same temperature and, for top-k, the same truncation."""
    sp = rc.SAMPLING[kind]
    cfg = dataclasses.replace(rc.config(model), rollout=dataclasses.replace(
        rc.rollout(), temperature=sp.temperature, top_k=sp.top_k))
    tr = Trainer(cfg, params=jax.tree.map(jnp.copy, rc.params(model, 0)))
    trajs = _engine_batch(model, kind)
    batch = TrainBatch.from_trajectories(trajs, group_size=4,
                                         length_buckets=cfg.trainer.length_buckets)
    m = jax.device_get(tr.train_step(batch))
    assert m["logprob_mismatch_tokens"] == batch.num_response_tokens > 0
    assert m["logprob_mismatch"] < 1e-4, m["logprob_mismatch"]
    if kind == "topk":  # without the truncation the trainer's log-probs would differ
        full = dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, top_k=0))
        tokens = jnp.asarray(batch.tokens_BT)
        logits = transformer.apply(tr.graphdef, rc.params(model, 0), tokens)[0]
        untruncated = np.asarray(objective.sampled_logprobs(logits, tokens, full))
        gap = np.abs(untruncated - batch.behaviour_logp_BT)[batch.loss_mask_BT > 0]
        assert gap.mean() > 0.05


def test_non_finite_update_is_skipped_and_counted(one_layer):
    tr = Trainer(one_layer(), trainer_mesh())
    state = jax.device_get(tr.state)
    poisoned = jax.tree.map(np.array, state)
    emb = poisoned.params["embed"]
    value = np.array(emb.get_value())
    value[0, 0] = np.nan  # every forward pass is now NaN
    emb.set_value(value)
    tr.load_state(poisoned)
    m = jax.device_get(tr.train_step(batch_of(trajectories(40, 2, 4), 4)))
    assert int(m["skipped_updates"]) == 1 and int(m["opt_updates"]) == 0
    after = jax.device_get(tr.state)
    for a, b in zip(leaves(after.params) + leaves(after.opt_state),
                    leaves(poisoned.params) + leaves(poisoned.opt_state)):
        np.testing.assert_array_equal(a, b)  # untouched (NaN included)
    assert tr.version == 1  # the step itself happened: a version is published


def test_overlong_filtering_masks_truncated_responses(one_layer):
    trajs = trajectories(50, 2, 4)
    trajs[2].finish_reason = "length"
    batch = batch_of(trajs, 4)
    assert batch.truncated_B.tolist() == [False, False, True] + [False] * 5
    loss, grads = Trainer(one_layer(mask_truncated=True), trainer_mesh()).loss_and_grads(batch)
    # Reference: the same rows with row 2's loss mask cleared by hand, no filtering.
    mask = batch.loss_mask_BT.copy()
    mask[2] = 0
    cleared = TrainBatch(batch.tokens_BT, mask, batch.behaviour_logp_BT * mask,
                         batch.rewards_B, batch.versions_B, batch.seq_lens_B, 4)
    ref_loss, ref_grads = Trainer(one_layer(), trainer_mesh()).loss_and_grads(cleared)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for g, r in zip(leaves(grads), leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-8)


def test_staleness_is_counted_per_token(one_layer):
    tr = Trainer(one_layer(), trainer_mesh())
    for i in range(3):
        tr.train_step(batch_of(trajectories(60 + i, 2, 4), 4))
    # Trainer at version 3. One sample's 6 tokens: 2 from v1, 4 from v3 (a partial-
    # rollout reload); the other 7 samples' tokens all from v1.
    trajs = trajectories(70, 2, 4, version=1)
    n = [len(t.response_tokens) for t in trajs]
    trajs[0] = make_trajectory(trajs[0].prompt_tokens, [5] * 6, [-1.0] * 6, 0.0,
                               trajs[0].group_id, 1)
    trajs[0].versions = [[1, 2], [3, 4]]
    n[0] = 6
    m = jax.device_get(tr.train_step(batch_of(trajs, 4)))
    # Staleness 2 on every token but the 4 sampled by v3 (staleness 0).
    assert float(m["staleness_mean"]) == pytest.approx(2 * (sum(n) - 4) / sum(n))
    assert float(m["staleness_max"]) == 2.0
    assert math.isfinite(float(m["logprob_mismatch"])) and m["logprob_mismatch_tokens"] == 4


def test_two_updates_take_the_proximal_policy_from_the_start_of_the_step(one_layer):
    """num_minibatches = 2, decoupled: the second update's ratio and weight are
    against the params the step started from, not those after the first update.
    Reference: the two updates written out with the model and optax."""
    from dora_jax.rl.optimizer import make_optimizer

    cfg = one_layer(num_minibatches=2, objective="decoupled", is_cap=CAP, is_mode="truncate",
                    learning_rate=0.05)
    tr = Trainer(cfg, trainer_mesh())
    batch = batch_of(trajectories(80, 2, 4), 4)
    start = jax.device_get(tr.state)
    t = cfg.trainer
    tokens, mask = jnp.asarray(batch.tokens_BT), jnp.asarray(batch.loss_mask_BT)
    mu = jnp.asarray(batch.behaviour_logp_BT)
    r_GK = jnp.asarray(batch.rewards_B).reshape(-1, 4)
    adv = ((r_GK - r_GK.mean(1, keepdims=True))
           / (r_GK.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)[:, None]

    def logp_of(p, rows):
        logits = transformer.apply(tr.graphdef, p, tokens[rows])[0]
        lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        x = jnp.take_along_axis(lp, tokens[rows, 1:, None], -1)[..., 0]
        return jnp.pad(x, ((0, 0), (1, 0)))

    def loss(p, rows, prox):
        r = jnp.exp(logp_of(p, rows) - prox)
        w = jnp.minimum(jnp.exp(prox - mu[rows]), CAP)
        a = adv[rows]
        surr = -jnp.minimum(r * a, jnp.clip(r, 1 - t.clip_low, 1 + t.clip_high) * a)
        return jnp.sum(w * surr * mask[rows]) / jnp.sum(mask[rows])

    tx = make_optimizer(t)
    params, opt = start.params, tx.init(start.params)
    ratios, weights = [], []
    for rows in (slice(0, 4), slice(4, 8)):
        prox = logp_of(start.params, rows)  # the step's starting policy, both times
        valid = np.asarray(mask[rows]) > 0
        ratios.append(np.exp(np.asarray(logp_of(params, rows) - prox))[valid])
        weights.append(np.minimum(np.exp(np.asarray(prox - mu[rows])), CAP)[valid])
        grads = jax.grad(loss)(params, rows, prox)
        updates, opt = tx.update(grads, opt, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    m = jax.device_get(tr.train_step(batch))
    # The metrics before each update: weights from the start of the step only, and
    # the second update's ratio against it (not 1, as a per-update pi_prox gives).
    assert float(m["is_weight_mean"]) == pytest.approx(np.concatenate(weights).mean(), rel=1e-5)
    assert float(m["ratio_mean"]) == pytest.approx(np.concatenate(ratios).mean(), rel=1e-5)
    assert abs(ratios[1].mean() - 1) > 1e-3
    # Adam turns rounding noise on near-zero gradients into steps of up to lr: a loose
    # bound on the worst element, a tight one on practically all of them.
    for a, b in zip(leaves(tr.params), leaves(params)):
        diff = np.abs(a - b)
        assert diff.max() < 0.1 * t.learning_rate
        assert np.mean(diff > 1e-6 + 1e-4 * np.abs(b)) < 1e-3
    moved = max(np.abs(a - b).max() for a, b in zip(leaves(params), leaves(start.params)))
    assert moved > 1e-3
