"""Worked examples for dora_jax.rl.losses.

Every expected value is a literal derived by hand in the comment next to it;
none is computed by calling the code under test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.rewards.shaping import overlong_penalty
from dora_jax.rl.losses import (
    aggregate_loss,
    decoupled_ppo_loss,
    group_advantages,
    kl_divergence,
    masked_mean,
    ppo_clip_loss,
    rloo_advantages,
)

RTOL = 1e-6
ATOL = 1e-7


def f32(x):
    return jnp.asarray(x, dtype=jnp.float32)


def close(actual, expected, rtol=RTOL, atol=ATOL):
    actual = np.asarray(actual)
    assert actual.dtype == np.float32, actual.dtype
    np.testing.assert_allclose(actual, np.asarray(expected, np.float32), rtol=rtol, atol=atol)


# ---------------------------------------------------------------- advantages


def test_group_advantages_bessel_std():
    # [1,0,0,0]: mean .25, deviations [.75,-.25,-.25,-.25],
    # sum of squares .5625 + 3*.0625 = .75, ddof=1 var = .75/3 = .25, std .5
    # -> [1.5, -.5, -.5, -.5]   (ddof=0 would give std .433 and 1.732...)
    close(group_advantages(f32([1, 0, 0, 0]), 4, eps=0.0), [1.5, -0.5, -0.5, -0.5])
    # Default eps=1e-6: each value scaled by .5/(.5+1e-6) = 1 - 2e-6.
    close(group_advantages(f32([1, 0, 0, 0]), 4), [1.5, -0.5, -0.5, -0.5], rtol=3e-6)
    # [0,1]: mean .5, deviations -/+.5, ddof=1 var = (.25+.25)/1 = .5,
    # std = sqrt(.5) = .70710678 -> -/+ .5/.70710678 = -/+ .70710678
    close(group_advantages(f32([0, 1]), 2, eps=0.0), [-0.70710678, 0.70710678])


def test_group_advantages_multiple_groups_and_zero_variance():
    # group 1 [3,1,2]: mean 2, dev [1,-1,0], var (1+1+0)/2 = 1, std 1 -> [1,-1,0]
    # group 2 [5,5,5]: zero variance -> [0,0,0]
    # group 3 [.1,.1,.1]: zero variance (mean of .1s is not exactly .1 in float) -> 0
    r = f32([3, 1, 2, 5, 5, 5, 0.1, 0.1, 0.1])
    out = group_advantages(r, 3, eps=0.0)
    close(out, [1, -1, 0, 0, 0, 0, 0, 0, 0])
    assert np.all(np.asarray(out)[3:] == 0.0)
    close(group_advantages(r, 3), [1, -1, 0, 0, 0, 0, 0, 0, 0], rtol=2e-6)


def test_group_advantages_mean_centred():
    # normalize_std=False: just r - mean.
    # [1,0,0,0] -> mean .25 -> [.75,-.25,-.25,-.25]; [3,1,2] mean 2 -> [1,-1,0] (std 1 anyway,
    # so use [6,2,4] mean 4 -> [2,-2,0] to see that no division happened).
    close(group_advantages(f32([1, 0, 0, 0]), 4, normalize_std=False), [0.75, -0.25, -0.25, -0.25])
    close(group_advantages(f32([6, 2, 4]), 3, normalize_std=False), [2, -2, 0])


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_group_of_size_one(normalize_std):
    # One sample per group: ddof=1 std undefined -> advantage defined as 0.
    out = group_advantages(f32([0.3, -2.0, 7.0]), 1, normalize_std=normalize_std)
    close(out, [0, 0, 0])
    assert out.shape == (3,)


def test_group_advantages_jit_and_int_rewards():
    out = jax.jit(group_advantages, static_argnums=1)(jnp.array([1, 0, 0, 0]), 4)
    close(out, [1.5, -0.5, -0.5, -0.5], rtol=3e-6)


@pytest.mark.parametrize("fn", [group_advantages, rloo_advantages])
def test_advantage_bad_group_size(fn):
    with pytest.raises(ValueError, match="group_size"):
        fn(f32([1, 2, 3, 4, 5]), 2)  # 2 does not divide 5
    with pytest.raises(ValueError, match="group_size"):
        fn(f32([1, 2]), 0)
    with pytest.raises(ValueError, match="flat"):
        fn(f32([[1, 2], [3, 4]]), 2)


def test_rloo_advantages():
    # [1,0,0,0]: r0 - mean(0,0,0) = 1; r1 - mean(1,0,0) = -1/3 (same for r2, r3).
    # [3,1,2]:   3 - mean(1,2) = 1.5; 1 - mean(3,2) = -1.5; 2 - mean(3,1) = 0.
    # [4,4]:     4 - 4 = 0 each.
    close(rloo_advantages(f32([1, 0, 0, 0]), 4), [1, -1 / 3, -1 / 3, -1 / 3])
    close(rloo_advantages(f32([3, 1, 2]), 3), [1.5, -1.5, 0])
    close(rloo_advantages(f32([4, 4]), 2), [0, 0])
    # Size-1 groups: no leave-one-out baseline exists -> 0.
    close(rloo_advantages(f32([5.0, -1.0]), 1), [0, 0])


# ------------------------------------------------------------------- PPO clip

# Ratios are set via logp = log(ratio), behaviour_logp = 0.
# clip_low = 0.2, clip_high = 0.28 -> range [0.8, 1.28].
#  a) r=.5,  A=-1: min(-.5, .8*-1=-.8) = -.8   -> loss .8   low clip active   grad 0
#  b) r=.5,  A=+1: min(.5, .8) = .5             -> loss -.5  not active        grad -A*r = -.5
#  c) r=1.5, A=+1: min(1.5, 1.28) = 1.28        -> loss -1.28 high clip active grad 0
#  d) r=1.5, A=-1: min(-1.5, -1.28) = -1.5      -> loss 1.5  not active        grad -A*r = 1.5
#  e) r=1,   A=2:  min(2, 2) = 2                -> loss -2                     grad -2
#  f) r=1.25,A=1:  inside [.8,1.28] (a symmetric .2 clip would clip it) -> -1.25, grad -1.25
#  g) r=.75, A=-2: min(-1.5, .8*-2=-1.6) = -1.6 -> loss 1.6  low clip active   grad 0
#  h) masked token with absurd logp=100 -> loss 0, grad 0
# 7 valid tokens: clip_frac_low = 2/7 (a, g), clip_frac_high = 1/7 (c),
# ratio_mean = (.5+.5+1.5+1.5+1+1.25+.75)/7 = 7/7 = 1, max 1.5, min .5.
RATIOS = [[0.5, 0.5, 1.5, 1.5], [1.0, 1.25, 0.75, 1.0]]
ADV = [[-1.0, 1.0, 1.0, -1.0], [2.0, 1.0, -2.0, 5.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


def _asym_inputs():
    logp = np.log(np.asarray(RATIOS, np.float32))
    logp[1, 3] = 100.0  # masked garbage
    return f32(logp), jnp.zeros((2, 4), jnp.float32), f32(ADV), jnp.asarray(MASK)


def test_ppo_asymmetric_clip_values_and_metrics():
    logp, blogp, adv, mask = _asym_inputs()
    loss, m = ppo_clip_loss(logp, blogp, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, [[0.8, -0.5, -1.28, 1.5], [-2.0, -1.25, 1.6, 0.0]])
    close(m["clip_frac_low"], 2 / 7)
    close(m["clip_frac_high"], 1 / 7)
    close(m["dual_clip_frac"], 0.0)
    close(m["ratio_mean"], 1.0)
    close(m["ratio_max"], 1.5)
    close(m["ratio_min"], 0.5)


def test_ppo_gradient_zero_where_clipped_else_minus_adv_times_ratio():
    logp, blogp, adv, mask = _asym_inputs()

    def total(lp):
        loss, _ = ppo_clip_loss(lp, blogp, adv, mask, clip_low=0.2, clip_high=0.28)
        return jnp.sum(loss)

    # d loss/d logp = -A * ratio where unclipped (d ratio/d logp = ratio), 0 where clipped:
    # a 0, b -.5, c 0, d 1.5 / e -2, f -1.25, g 0, h 0 (masked)
    close(jax.grad(total)(logp), [[0.0, -0.5, 0.0, 1.5], [-2.0, -1.25, 0.0, 0.0]])


def test_ppo_per_sequence_advantages_broadcast():
    # Symmetric clip .2 -> [.8, 1.2]; A = [1, -1] per sequence.
    # row 0 (A=1):  r=1.5 -> min(1.5, 1.2) = 1.2 -> -1.2 ; r=.9 -> -.9
    # row 1 (A=-1): r=1.5 -> min(-1.5,-1.2) = -1.5 -> 1.5 ; r=.5 -> min(-.5,-.8) -> .8
    logp = f32(np.log(np.asarray([[1.5, 0.9], [1.5, 0.5]], np.float32)))
    loss, m = ppo_clip_loss(logp, jnp.zeros((2, 2)), f32([1.0, -1.0]), jnp.ones((2, 2), bool))
    close(loss, [[-1.2, -0.9], [1.5, 0.8]])
    close(m["clip_frac_high"], 0.25)  # only row 0, r=1.5
    close(m["clip_frac_low"], 0.25)  # only row 1, r=.5


def test_ppo_dual_clip():
    # clip .2/.2, dual_clip c=3 (caps loss at 3|A| when A<0).
    #  r=5,  A=-1: clipped loss max(5, 1.2) = 5 > 3 -> 3     dual active, grad 0
    #  r=2,  A=-1: loss 2 < 3 -> 2, unclipped               grad -A*r = 2
    #  r=.5, A=-1: min(-.5, -.8) -> .8 (low clip)           grad 0
    #  r=5,  A=+1: min(5, 1.2) -> -1.2 (high clip; dual never applies to A>0) grad 0
    logp = f32(np.log(np.asarray([[5.0, 2.0, 0.5, 5.0]], np.float32)))
    blogp = jnp.zeros((1, 4), jnp.float32)
    adv = f32([[-1.0, -1.0, -1.0, 1.0]])
    mask = jnp.ones((1, 4))
    loss, m = ppo_clip_loss(logp, blogp, adv, mask, dual_clip=3.0)
    close(loss, [[3.0, 2.0, 0.8, -1.2]])
    close(m["dual_clip_frac"], 0.25)
    close(m["clip_frac_low"], 0.25)
    # r=5 with A<0 is above the range but the unclipped branch won the min -> not counted.
    close(m["clip_frac_high"], 0.25)
    close(m["ratio_max"], 5.0)

    def total(lp):
        return jnp.sum(ppo_clip_loss(lp, blogp, adv, mask, dual_clip=3.0)[0])

    close(jax.grad(total)(logp), [[0.0, 2.0, 0.0, 0.0]])
    # Without dual clip the first token would be 5.
    close(ppo_clip_loss(logp, blogp, adv, mask)[0][0, 0], 5.0)


def test_ppo_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((1,)), jnp.ones((1, 1)),
                      dual_clip=1.0)


def test_ppo_all_masked_is_finite():
    logp = f32([[100.0, -100.0], [jnp.inf, 0.0]])
    blogp = f32([[-100.0, 100.0], [0.0, 0.0]])
    mask = jnp.zeros((2, 2))

    def run(lp):
        loss, m = ppo_clip_loss(lp, blogp, f32([1.0, -1.0]), mask, dual_clip=3.0)
        return jnp.sum(loss), (loss, m)

    grad, (loss, m) = jax.grad(run, has_aux=True)(logp)
    close(loss, [[0, 0], [0, 0]])
    close(grad, [[0, 0], [0, 0]])
    for name in ["clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "ratio_max",
                 "ratio_min"]:
        close(m[name], 0.0)


def test_ppo_under_jit():
    logp, blogp, adv, mask = _asym_inputs()
    fn = jax.jit(lambda *a: ppo_clip_loss(*a, clip_low=0.2, clip_high=0.28))
    loss, m = fn(logp, blogp, adv, mask)
    close(loss, [[0.8, -0.5, -1.28, 1.5], [-2.0, -1.25, 1.6, 0.0]])
    close(m["clip_frac_low"], 2 / 7)


# ---------------------------------------------------------------- aggregation

# Row 2 is all-masked and holds large values that must be ignored.
AGG_LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 8.0, 9.0, 1e9]]
AGG_MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        # valid sum 1+2+3+5+6 = 17 over 5 tokens
        ("token-mean", {}, 3.4),
        # gradient-accumulation override: 17 / 10
        ("token-mean", {"num_tokens": 10}, 1.7),
        # row means 6/3 = 2, 11/2 = 5.5; empty row excluded -> (2 + 5.5)/2
        ("seq-mean-token-mean", {}, 3.75),
        # row sums 6, 11 -> 8.5
        ("seq-mean-token-sum", {}, 8.5),
        # Dr. GRPO, default max_len = T = 4: 6/4 = 1.5, 11/4 = 2.75 -> mean 2.125
        ("seq-mean-token-sum-over-max-len", {}, 2.125),
        # max_len 8: .75, 1.375 -> 1.0625
        ("seq-mean-token-sum-over-max-len", {"max_len": 8}, 1.0625),
        # verl's: (6 + 11) / 4, no mean over sequences
        ("seq-mean-token-sum-norm", {}, 4.25),
        ("seq-mean-token-sum-norm", {"max_len": 8}, 2.125),
    ],
)
def test_aggregate_modes(mode, kwargs, expected):
    close(aggregate_loss(f32(AGG_LOSS), jnp.asarray(AGG_MASK), mode, **kwargs), expected)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm", "seq-mean-token-sum-over-max-len"]
)
def test_aggregate_all_masked_is_zero_with_finite_grad(mode):
    loss = f32([[1.0, jnp.inf], [jnp.nan, 2.0]])
    mask = jnp.zeros((2, 2), bool)
    value, grad = jax.value_and_grad(lambda x: aggregate_loss(x, mask, mode))(loss)
    close(value, 0.0)
    close(grad, [[0, 0], [0, 0]])


def test_aggregate_token_mean_grad_uses_num_tokens():
    # d/dloss of sum(loss*mask)/num_tokens = mask/num_tokens = mask/4
    g = jax.grad(lambda x: aggregate_loss(x, jnp.asarray(AGG_MASK), "token-mean",
                                          num_tokens=4))(f32(AGG_LOSS))
    close(g, np.asarray(AGG_MASK) / 4)


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="seq-mean-sum.*token-mean"):
        aggregate_loss(jnp.zeros((1, 1)), jnp.ones((1, 1)), "seq-mean-sum")


def test_masked_mean():
    x = f32([[1.0, jnp.nan], [3.0, 4.0], [jnp.inf, 5.0]])
    mask = jnp.asarray([[1, 0], [1, 1], [0, 0]])
    close(masked_mean(x, mask), 8 / 3)  # (1 + 3 + 4)/3
    close(masked_mean(x, mask, axis=-1), [1.0, 3.5, 0.0])  # empty row -> 0
    close(masked_mean(x, jnp.zeros((3, 2))), 0.0)


# ------------------------------------------------------------------------- KL

# logp = [0, -1, -2], ref = [0, -2, -.5] -> d = logp - ref = [0, 1, -1.5]
KL_LOGP = [0.0, -1.0, -2.0]
KL_REF = [0.0, -2.0, -0.5]


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("k1", [0.0, 1.0, -1.5]),
        # .5 * [0, 1, 2.25]
        ("k2", [0.0, 0.5, 1.125]),
        # ref - logp = [0, -1, 1.5]:
        #   e^0 - 0 - 1 = 0;  e^-1 + 1 - 1 = .36787944;  e^1.5 - 1.5 - 1 = 4.48168907 - 2.5
        ("k3", [0.0, 0.36787944, 1.98168907]),
    ],
)
def test_kl_kinds(kind, expected):
    close(kl_divergence(f32(KL_LOGP), f32(KL_REF), kind), expected)


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k4.*k1"):
        kl_divergence(jnp.zeros(2), jnp.zeros(2), "k4")


def test_kl_k3_is_clamped_and_its_gradient_finite():
    # ref - logp = 30: e^30 - 31 is far above the bound 10; ref - logp = 1000 would
    # overflow without the log-ratio clamp.
    value, grad = jax.value_and_grad(
        lambda lp: jnp.sum(kl_divergence(lp, f32([30.0, 1000.0]), "k3")))(f32([0.0, 0.0]))
    close(kl_divergence(f32([0.0, 0.0]), f32([30.0, 1000.0]), "k3"), [10.0, 10.0])
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))


# ----------------------------------------------------- off-policy objectives
# One token whose log-prob under the current policy is the parameter theta. The
# behaviour policy mu gave it probability 0.25, the proximal policy pi_prox 0.5:
# pi_prox / mu = 2. Clip range [0.8, 1.2]. d ratio / d theta = ratio.

MU, PROX = math.log(0.25), math.log(0.5)


def _one_token(loss_fn, theta, adv=1.0):
    def f(th):
        loss, metrics = loss_fn(f32([[th]]), f32([[adv]]))
        return loss[0, 0], metrics
    (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(f32(theta))
    return float(value), float(grad), metrics


def _behaviour(logp, adv):
    return ppo_clip_loss(logp, f32([[MU]]), adv[:, 0], jnp.ones((1, 1)))


def _decoupled(cap, mode="truncate", prox=PROX, mu=MU):
    return lambda logp, adv: decoupled_ppo_loss(logp, f32([[prox]]), f32([[mu]]), adv[:, 0],
                                                jnp.ones((1, 1)), is_cap=cap, is_mode=mode)


def test_behaviour_clip_ratio_is_against_mu():
    # theta = log .5: ratio .5/.25 = 2 > 1.2 with A > 0: clipped, loss -1.2, no gradient.
    assert _one_token(_behaviour, PROX)[:2] == pytest.approx((-1.2, 0.0), abs=1e-6)
    # theta = log .275: ratio 1.1 in range: loss -1.1, gradient -A * ratio = -1.1.
    assert _one_token(_behaviour, math.log(0.275))[:2] == pytest.approx((-1.1, -1.1), abs=1e-6)


def test_decoupled_ratio_is_against_the_proximal_policy():
    # theta = pi_prox: ratio 1 (in range whatever the staleness), weight w = 2 (cap 3):
    # loss -w * 1 = -2, gradient -A * w * ratio = -2.
    assert _one_token(_decoupled(3.0), PROX)[:2] == pytest.approx((-2.0, -2.0), abs=1e-6)
    # A = -1: loss w * 1 = 2, gradient +2.
    assert _one_token(_decoupled(3.0), PROX, adv=-1.0)[:2] == pytest.approx((2.0, 2.0), abs=1e-6)
    # theta = log .75: ratio 1.5 > 1.2 with A > 0: clipped, loss -2 * 1.2 = -2.4, no gradient.
    assert _one_token(_decoupled(3.0), math.log(0.75))[:2] == pytest.approx((-2.4, 0.0),
                                                                              abs=1e-6)
    # No cap: the weight as is.
    assert _one_token(_decoupled(None), PROX)[:2] == pytest.approx((-2.0, -2.0), abs=1e-6)


def test_tis_weight_is_applied_once():
    # pi_old / mu = .5 / (1/3) = 1.5 (cap 2): on the first update (theta = pi_old) the
    # gradient is -A * 1.5 = -1.5. Multiplying a ratio already taken against mu by the
    # weight again would give -(1.5 * 1.5) = -2.25.
    value, grad, _ = _one_token(_decoupled(2.0, mu=math.log(1 / 3)), PROX)
    assert (value, grad) == pytest.approx((-1.5, -1.5), abs=1e-6)
    # Truncated at the cap: w = min(2, 1.5) = 1.5.
    value, grad, m = _one_token(_decoupled(1.5), PROX)
    assert (value, grad) == pytest.approx((-1.5, -1.5), abs=1e-6)
    assert float(m["is_capped_frac"]) == 1.0 and float(m["is_weight_max"]) == pytest.approx(1.5)


def test_decoupled_mask_mode_drops_tokens_beyond_the_cap():
    # w = 2 > 1.5: the token is dropped (AReaL's cap): no loss, no gradient.
    value, grad, m = _one_token(_decoupled(1.5, "mask"), PROX)
    assert (value, grad) == (0.0, 0.0) and float(m["is_capped_frac"]) == 1.0
    # Two tokens, w = 2 and w = .5 / .4 = 1.25 <= 1.5: only the first is dropped.
    loss, m = decoupled_ppo_loss(f32([[PROX, PROX]]), f32([[PROX, PROX]]),
                                 f32([[MU, math.log(0.4)]]), f32([1.0]), jnp.ones((1, 2)),
                                 is_cap=1.5, is_mode="mask")
    close(loss, [[0.0, -1.25]])
    close(m["is_weight_mean"], 0.625)  # (0 + 1.25) / 2
    close(m["is_capped_frac"], 0.5)


def test_decoupled_gives_no_gradient_to_proximal_or_behaviour():
    def f(prox, mu):
        return jnp.sum(decoupled_ppo_loss(f32([[PROX]]), prox, mu, f32([1.0]),
                                          jnp.ones((1, 1)), is_cap=3.0)[0])

    gp, gm = jax.grad(f, argnums=(0, 1))(f32([[math.log(0.4)]]), f32([[MU]]))
    close(gp, [[0.0]])
    close(gm, [[0.0]])


def test_decoupled_rejects_bad_options():
    args = (f32([[0.0]]),) * 3 + (f32([1.0]), jnp.ones((1, 1)))
    with pytest.raises(ValueError, match="is_mode"):
        decoupled_ppo_loss(*args, is_cap=2.0, is_mode="clip")
    with pytest.raises(ValueError, match="is_cap must be > 0"):
        decoupled_ppo_loss(*args, is_cap=0.0)


def test_log_ratio_is_clamped_before_exp():
    # logp - mu = 100 would overflow exp; clamped to 20: with A = -1 the loss is
    # e^20 (finite) and the clamp stops the gradient.
    value, grad, _ = _one_token(
        lambda logp, adv: ppo_clip_loss(logp, f32([[-100.0]]), adv[:, 0], jnp.ones((1, 1))),
        0.0, adv=-1.0)
    assert value == pytest.approx(math.exp(20), rel=1e-6) and grad == 0.0


def test_overlong_penalty():
    # max 100, buffer 20: free up to 80 tokens, then linear down to -factor at 100.
    np.testing.assert_allclose(overlong_penalty([50, 80, 90, 100], 100, 20),
                               [0.0, 0.0, -0.5, -1.0])
    np.testing.assert_allclose(overlong_penalty([95], 100, 20, factor=2.0), [-1.5])
    np.testing.assert_allclose(overlong_penalty([100], 100, 0), [0.0])
