"""Worked examples for dora_jax.rl.losses.

Every expected value is a literal derived by hand in the comment next to it;
none is computed by calling the code under test.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.rl.losses import (
    aggregate_loss,
    group_advantages,
    kl_divergence,
    masked_mean,
    ppo_clip_loss,
    rloo_advantages,
    truncated_importance_weights,
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
        ppo_clip_loss(jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.zeros((1,)), jnp.ones((1, 1)), dual_clip=1.0)


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
    for name in ["clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "ratio_max", "ratio_min"]:
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
        # default max_len = T = 4: 6/4 = 1.5, 11/4 = 2.75 -> 2.125
        ("seq-mean-token-scale", {}, 2.125),
        # max_len 8: .75, 1.375 -> 1.0625
        ("seq-mean-token-scale", {"max_len": 8}, 1.0625),
    ],
)
def test_aggregate_modes(mode, kwargs, expected):
    close(aggregate_loss(f32(AGG_LOSS), jnp.asarray(AGG_MASK), mode, **kwargs), expected)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-scale"]
)
def test_aggregate_all_masked_is_zero_with_finite_grad(mode):
    loss = f32([[1.0, jnp.inf], [jnp.nan, 2.0]])
    mask = jnp.zeros((2, 2), bool)
    value, grad = jax.value_and_grad(lambda l: aggregate_loss(l, mask, mode))(loss)
    close(value, 0.0)
    close(grad, [[0, 0], [0, 0]])


def test_aggregate_token_mean_grad_uses_num_tokens():
    # d/dloss of sum(loss*mask)/num_tokens = mask/num_tokens = mask/4
    g = jax.grad(lambda l: aggregate_loss(l, jnp.asarray(AGG_MASK), "token-mean", num_tokens=4))(f32(AGG_LOSS))
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


# ------------------------------------------------------------------------ TIS


def test_truncated_importance_weights_cap_and_no_gradient():
    # exp([0, .5, -1, 3]) = [1, 1.64872127, .36787944, 20.0855] -> capped at 2
    train = f32([0.0, 0.5, -1.0, 3.0])
    rollout = jnp.zeros(4, jnp.float32)
    close(truncated_importance_weights(train, rollout, 2.0), [1.0, 1.64872127, 0.36787944, 2.0])
    # rollout offset: exp(-1 - (-1 - ln 2)) = 2 -> capped at 1.5
    close(truncated_importance_weights(f32([-1.0]), f32([-1.0 - math.log(2.0)]), 1.5), [1.5])
    g_train = jax.grad(lambda t: jnp.sum(truncated_importance_weights(t, rollout, 2.0)))(train)
    g_roll = jax.grad(lambda r: jnp.sum(truncated_importance_weights(train, r, 2.0)))(rollout)
    close(g_train, [0, 0, 0, 0])
    close(g_roll, [0, 0, 0, 0])
