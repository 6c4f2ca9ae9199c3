"""Policy-gradient objectives for RL post-training: advantages, PPO clip (against the
behaviour policy, or decoupled against a proximal policy with an importance weight),
KL and loss aggregation (reward shaping is rewards/shaping.py's).

Everything here is a pure JAX function of arrays, safe to call under ``jit``
(string options such as ``mode`` / ``kind`` and ``group_size`` must be static).
Shape suffixes: ``N`` flat samples, ``G`` groups, ``K`` group size,
``B`` sequences, ``T`` tokens.

Masks may be bool or float. A position counts as valid when its mask is
non-zero; float masks additionally act as weights in the means.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from dora_jax.config import IS_MODES, KL_KINDS, LOSS_AGG_MODES

# Log-ratios are clamped before exp (as verl does): a log-ratio above 88.7 overflows
# float32, and inf * 0 advantages or gradients would turn the step into NaN.
LOG_RATIO_CLAMP = 20.0
# The k3 KL estimate per token is clamped to [-KL_CLAMP, KL_CLAMP] (verl's bound).
KL_CLAMP = 10.0


def clamped_log_ratio(num: jax.Array, den: jax.Array, valid: jax.Array) -> jax.Array:
    """Clamped num - den on valid positions, 0 elsewhere (padding may hold anything)."""
    return jnp.clip(jnp.where(valid, _float(num) - den, 0.0), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den, or 0 where den == 0 (empty masks must not produce NaN)."""
    nonzero = den != 0
    # Divide by 1 in the dead branch so neither the value nor its gradient is NaN.
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1), 0)


def _float(x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | tuple[int, ...] | None = None
                ) -> jax.Array:
    """Mean of ``x`` over positions where ``mask`` is non-zero (weighted by ``mask``).

    ``mask`` broadcasts against ``x``. Where a reduction has no valid entries the
    result is 0 rather than NaN. Masked-out entries of ``x`` are never read, so
    they may hold inf/NaN (e.g. padding logits) without poisoning the result.
    """
    x = _float(x)
    w = jnp.broadcast_to(jnp.asarray(mask), x.shape).astype(x.dtype)
    total = jnp.sum(jnp.where(w != 0, x, 0) * w, axis=axis)
    return _safe_div(total, jnp.sum(w, axis=axis))


def _grouped(rewards: jax.Array, group_size: int) -> jax.Array:
    """Validate and reshape flat rewards [N] into [G, K]."""
    rewards_N = _float(rewards)
    if rewards_N.ndim != 1:
        raise ValueError(f"rewards must be a flat [N] array, got shape {rewards_N.shape}")
    k = operator.index(group_size)
    n = rewards_N.shape[0]
    if k <= 0 or n % k != 0:
        raise ValueError(
            f"group_size={k} must be a positive divisor of the number of rewards N={n}"
        )
    return rewards_N.reshape(n // k, k)


def group_advantages(rewards: jax.Array, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
    """GRPO group-relative advantages for flat ``rewards`` [N] (returns [N]).

    Consecutive runs of ``group_size`` entries form one group (the samples for
    one prompt). Each reward becomes ``(r - group_mean) / (group_std + eps)``
    with the Bessel-corrected (ddof=1) std, matching verl and tunix. With
    ``normalize_std=False`` it is just ``r - group_mean`` (Dr. GRPO).

    Edge cases, chosen so the output is never NaN:
      * ``group_size == 1``: ddof=1 std is undefined, so the advantage is
        defined as 0 (the mean-centred value is 0 anyway).
      * Zero-variance groups (all rewards equal): advantage is exactly 0, even
        when float rounding makes ``r - mean`` a tiny non-zero number that
        dividing by ``eps`` would otherwise blow up.

    Raises ValueError unless ``group_size`` is a positive divisor of N.
    """
    return _group_advantages(_grouped(rewards, group_size), eps, normalize_std=normalize_std)


@functools.partial(jax.jit, static_argnames="normalize_std")
def _group_advantages(rewards_GK: jax.Array, eps: float, *, normalize_std: bool) -> jax.Array:
    g, k = rewards_GK.shape
    if k == 1:
        return jnp.zeros((g,), rewards_GK.dtype)
    mean_G1 = jnp.mean(rewards_GK, axis=1, keepdims=True)
    centred_GK = rewards_GK - mean_G1
    # Exact equality test rather than std == 0: the computed mean of identical
    # floats can differ from them by an ulp, leaving std tiny but non-zero.
    constant_G1 = jnp.max(rewards_GK, axis=1, keepdims=True) == jnp.min(
        rewards_GK, axis=1, keepdims=True
    )
    if normalize_std:
        std_G1 = jnp.sqrt(jnp.sum(centred_GK**2, axis=1, keepdims=True) / (k - 1))
        centred_GK = centred_GK / (std_G1 + eps)
    return jnp.where(constant_G1, 0.0, centred_GK).reshape(g * k)


def rloo_advantages(rewards: jax.Array, group_size: int) -> jax.Array:
    """REINFORCE leave-one-out advantages: ``r_i - mean_{j != i} r_j`` per group.

    ``rewards`` is flat [N] grouped as in :func:`group_advantages`. Groups of
    size 1 have no other samples to form a baseline, so their advantage is 0.
    """
    rewards_GK = _grouped(rewards, group_size)
    g, k = rewards_GK.shape
    if k == 1:
        return jnp.zeros((g,), rewards_GK.dtype)
    sum_G1 = jnp.sum(rewards_GK, axis=1, keepdims=True)
    baseline_GK = (sum_G1 - rewards_GK) / (k - 1)
    return (rewards_GK - baseline_GK).reshape(g * k)


def ppo_clip_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token PPO clipped surrogate loss (to be minimised).

    Args:
      logp: [B, T] log-probs of the sampled tokens under the current policy.
      behaviour_logp: [B, T] log-probs under the policy that generated them.
      advantages: [B] (one per sequence, broadcast over T) or [B, T].
      mask: [B, T] non-zero on tokens that belong to the loss.
      clip_low, clip_high: ratio clipped to ``[1 - clip_low, 1 + clip_high]``;
        a larger ``clip_high`` is DAPO's "clip-higher".
      dual_clip: optional constant c > 1. For A < 0 the loss is additionally
        capped at ``c * |A|`` (verl's dual-clip PPO), so a huge ratio on a bad
        token cannot produce an unbounded update.

    Returns:
      ``(loss_BT, metrics)``. ``loss_BT = -min(ratio*A, clip(ratio)*A)`` (then
      dual-clipped), zero on masked positions; the log-ratio is clamped to
      ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` first. ``metrics`` holds scalar
      masked means over valid tokens: ``clip_frac_low`` / ``clip_frac_high``
      (ratio outside the range on that side AND the clipped branch won the
      min, i.e. the token gets no gradient), ``dual_clip_frac``,
      ``ratio_mean``, ``ratio_max``, ``ratio_min``. All are 0 when no token is
      valid.
    """
    # Only concrete values can be checked; a traced dual_clip is trusted.
    if isinstance(dual_clip, (int, float)) and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    return _ppo_clip_loss(
        logp,
        behaviour_logp,
        advantages,
        mask,
        clip_low,
        clip_high,
        0.0 if dual_clip is None else dual_clip,
        use_dual_clip=dual_clip is not None,
    )


# jit so an eager call (metrics, tests) compiles once instead of per primitive;
# under an outer jit this simply inlines.
@functools.partial(jax.jit, static_argnames="use_dual_clip")
def _ppo_clip_loss(logp: jax.Array, behaviour_logp: jax.Array, advantages: jax.Array,
                   mask: jax.Array, clip_low: float, clip_high: float, dual_clip: float, *,
                   use_dual_clip: bool) -> tuple[jax.Array, dict[str, jax.Array]]:
    logp_BT = _float(logp)
    valid_BT = jnp.asarray(mask) != 0
    adv = _float(advantages)
    adv_BT = adv[:, None] if adv.ndim == logp_BT.ndim - 1 else adv
    adv_BT = jnp.broadcast_to(adv_BT, logp_BT.shape)

    ratio_BT = jnp.exp(clamped_log_ratio(logp_BT, behaviour_logp, valid_BT))
    clipped_ratio_BT = jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    surr_BT = ratio_BT * adv_BT
    clipped_surr_BT = clipped_ratio_BT * adv_BT
    loss_BT = -jnp.minimum(surr_BT, clipped_surr_BT)
    # The clipped branch is strictly smaller only on the side where clipping
    # reduces the objective: ratio below range with A<0, above range with A>0.
    clip_active_BT = clipped_surr_BT < surr_BT

    if use_dual_clip:
        cap_BT = -dual_clip * adv_BT
        dual_active_BT = (adv_BT < 0) & (cap_BT < loss_BT)
        loss_BT = jnp.where(dual_active_BT, cap_BT, loss_BT)
    else:
        dual_active_BT = jnp.zeros_like(valid_BT)
    loss_BT = jnp.where(valid_BT, loss_BT, 0.0)

    r_BT = jax.lax.stop_gradient(ratio_BT)
    low_BT = clip_active_BT & (r_BT < 1.0 - clip_low)
    high_BT = clip_active_BT & (r_BT > 1.0 + clip_high)
    any_valid = jnp.any(valid_BT)
    metrics = {
        "clip_frac_low": masked_mean(low_BT, valid_BT),
        "clip_frac_high": masked_mean(high_BT, valid_BT),
        "dual_clip_frac": masked_mean(dual_active_BT, valid_BT),
        "ratio_mean": masked_mean(r_BT, valid_BT),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(valid_BT, r_BT, -jnp.inf)), 0.0),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(valid_BT, r_BT, jnp.inf)), 0.0),
    }
    return loss_BT, metrics


def decoupled_ppo_loss(logp: jax.Array, proximal_logp: jax.Array, behaviour_logp: jax.Array,
                       advantages: jax.Array, mask: jax.Array, *, clip_low: float = 0.2,
                       clip_high: float = 0.2, is_cap: float | None = None,
                       dual_clip: float | None = None, is_mode: str = "truncate"
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token decoupled PPO loss (AReaL's decoupled objective; verl's TIS).

    The PPO ratio is taken against the proximal policy ``pi_prox`` (the trainer's
    policy at the start of the step), so a stale token starts inside the clip range
    whatever its age; the staleness is corrected by a per-token importance weight
    ``w = pi_prox / mu`` (``mu``: the behaviour policy that sampled the token):

        loss = w * ppo_clip(pi_theta / pi_prox, A)

    ``is_mode="truncate"`` uses ``min(w, is_cap)`` (truncated IS, verl's TIS);
    ``is_mode="mask"`` drops tokens with ``w > is_cap`` (AReaL's cap); with
    ``is_cap=None`` the weight is used as is. ``w`` is a constant for the optimiser
    (stop-gradient), and so is ``proximal_logp``.

    Args:
      logp: [B, T] log-probs of the sampled tokens under the current policy.
      proximal_logp: [B, T] under the proximal policy (no gradient flows into it).
      behaviour_logp: [B, T] under the policy that sampled them.
      advantages, mask, clip_low, clip_high, dual_clip: as in :func:`ppo_clip_loss`.

    Returns:
      ``(loss_BT, metrics)``: the metrics of :func:`ppo_clip_loss` (for the ratio
      against ``pi_prox``) and ``is_weight_mean`` / ``is_weight_max`` (the weight
      applied) and ``is_capped_frac`` (tokens whose ``w`` exceeded the cap),
      masked means over valid tokens.
    """
    if is_mode not in IS_MODES:
        raise ValueError(f"is_mode must be one of {IS_MODES}, got {is_mode!r}")
    if isinstance(is_cap, (int, float)) and not is_cap > 0:
        raise ValueError(f"is_cap must be > 0 (or None), got {is_cap}")
    proximal_logp = jax.lax.stop_gradient(_float(proximal_logp))
    loss_BT, metrics = ppo_clip_loss(logp, proximal_logp, advantages, mask, clip_low=clip_low,
                                     clip_high=clip_high, dual_clip=dual_clip)
    return _importance_weighted(loss_BT, metrics, proximal_logp, behaviour_logp, mask,
                                0.0 if is_cap is None else is_cap,
                                use_cap=is_cap is not None, mask_mode=is_mode == "mask")


@functools.partial(jax.jit, static_argnames=("use_cap", "mask_mode"))
def _importance_weighted(loss_BT: jax.Array, metrics: dict[str, jax.Array],
                         proximal_logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array,
                         is_cap: float, *, use_cap: bool, mask_mode: bool
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
    valid_BT = jnp.asarray(mask) != 0
    w_BT = jnp.exp(clamped_log_ratio(proximal_logp, behaviour_logp, valid_BT))
    capped_BT = (w_BT > is_cap) if use_cap else jnp.zeros_like(valid_BT)
    if use_cap:
        w_BT = jnp.where(capped_BT, 0.0, w_BT) if mask_mode else jnp.minimum(w_BT, is_cap)
    w_BT = jax.lax.stop_gradient(jnp.where(valid_BT, w_BT, 0.0))
    any_valid = jnp.any(valid_BT)
    metrics = dict(metrics,
                   is_weight_mean=masked_mean(w_BT, valid_BT),
                   is_weight_max=jnp.where(any_valid, jnp.max(jnp.where(valid_BT, w_BT, 0.0)),
                                           0.0),
                   is_capped_frac=masked_mean(capped_BT, valid_BT))
    return loss_BT * w_BT, metrics


def aggregate_loss(loss: jax.Array, mask: jax.Array, mode: str, *,
                   num_tokens: jax.Array | float | None = None, max_len: float | None = None,
                   segments: jax.Array | None = None, num_segments: int | None = None
                   ) -> jax.Array:
    """Reduce a per-token loss [B, T] to a scalar.

    A sequence is a row, or with ``segments`` (int [B, T]: the sequence each token
    belongs to, in ``[0, num_segments)``, -1 for none) the tokens sharing a segment
    index, wherever they lie: packed rows hold several sequences (rl/packing.py).

    Modes:
      * ``token-mean``: ``sum(loss*mask) / sum(mask)``. If ``num_tokens`` is
        given it replaces the denominator; gradient accumulation passes the
        whole batch's token count so that summing micro-batch losses equals
        the full-batch token mean.
      * ``seq-mean-token-mean``: masked mean per sequence, then mean over
        sequences.
      * ``seq-mean-token-sum``: masked sum per sequence, then mean over
        sequences.
      * ``seq-mean-token-sum-norm`` (verl's): the masked sums of all sequences
        added up and divided by the constant ``max_len`` (default T), with no
        mean over sequences: configs ported from verl mean the same thing.
      * ``seq-mean-token-sum-over-max-len`` (Dr. GRPO): masked sum per sequence
        divided by the constant ``max_len``, then mean over sequences (the
        normaliser depends neither on response length nor on batch size).

    All-masked rows (sequences with no valid token, e.g. batch padding) are
    excluded from the "mean over sequences" in every ``seq-mean-*`` mode, so
    padding rows neither produce NaN nor dilute the loss. Any reduction with
    nothing valid returns 0. ``num_tokens`` is only read by ``token-mean`` and
    ``max_len`` only by the two ``max_len`` modes; other modes ignore them.

    Raises ValueError for an unknown ``mode``.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES)}"
        )
    if segments is not None and num_segments is None:
        raise ValueError("segments needs num_segments")
    return _aggregate_loss(
        loss,
        mask,
        0.0 if num_tokens is None else num_tokens,
        1.0 if max_len is None else max_len,
        segments,
        mode=mode,
        use_num_tokens=num_tokens is not None,
        use_max_len=max_len is not None,
        num_segments=num_segments,
    )


def per_sequence_sums(x_BT: jax.Array, segments_BT: jax.Array, num_segments: int) -> jax.Array:
    """Sums of `x_BT` per segment index ([num_segments]); tokens of segment -1 are
    dropped."""
    seg = jnp.where(segments_BT >= 0, segments_BT, num_segments).reshape(-1)
    return jax.ops.segment_sum(x_BT.reshape(-1), seg, num_segments + 1)[:num_segments]


@functools.partial(jax.jit, static_argnames=("mode", "use_num_tokens", "use_max_len",
                                             "num_segments"))
def _aggregate_loss(loss: jax.Array, mask: jax.Array, num_tokens: jax.Array | float,
                    max_len: float, segments: jax.Array | None, *, mode: str,
                    use_num_tokens: bool, use_max_len: bool, num_segments: int | None
                    ) -> jax.Array:
    loss_BT = _float(loss)
    w_BT = jnp.broadcast_to(jnp.asarray(mask), loss_BT.shape).astype(loss_BT.dtype)
    # where() first so inf/NaN in padding positions cannot leak through 0*inf.
    weighted_BT = jnp.where(w_BT != 0, loss_BT, 0.0) * w_BT

    if mode == "token-mean":
        den = jnp.asarray(num_tokens, loss_BT.dtype) if use_num_tokens else jnp.sum(w_BT)
        return _safe_div(jnp.sum(weighted_BT), den)

    if segments is None:
        count_B = jnp.sum(w_BT, axis=-1)
        sum_B = jnp.sum(weighted_BT, axis=-1)
    else:
        assert num_segments is not None  # aggregate_loss requires it with segments
        count_B = per_sequence_sums(w_BT, segments, num_segments)
        sum_B = per_sequence_sums(weighted_BT, segments, num_segments)
    scale = max_len if use_max_len else loss_BT.shape[-1]
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(sum_B) / scale
    if mode == "seq-mean-token-mean":
        per_seq_B = _safe_div(sum_B, count_B)
    elif mode == "seq-mean-token-sum":
        per_seq_B = sum_B
    else:  # seq-mean-token-sum-over-max-len
        per_seq_B = sum_B / scale
    return masked_mean(per_seq_B, count_B != 0)


def kl_divergence(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """Per-token KL(policy || reference) estimator from sampled-token log-probs.

    ``k1 = logp - ref`` (unbiased, can be negative), ``k2 = (logp - ref)**2 / 2``,
    ``k3 = exp(ref - logp) - (ref - logp) - 1`` (unbiased and non-negative;
    Schulman's low-variance estimator), computed from a log-ratio clamped to
    ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` and then clamped to ``[0, KL_CLAMP]``
    (verl's bound: one token far off the reference must not dominate). Raises
    ValueError for an unknown kind.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    diff = _float(logp) - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff**2
    # Written via -diff = log(ref/pi) so that it is the exact k3 formula.
    diff = jnp.clip(diff, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return jnp.clip(jnp.exp(-diff) + diff - 1.0, 0.0, KL_CLAMP)
