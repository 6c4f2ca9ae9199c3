"""The optimizer's pieces against their definitions: the learning-rate schedule (built
from optax's schedules) equals the formula it documents at every update count, and
the non-finite-update guard agrees with `optax.apply_if_finite` where their semantics
overlap, leaving params, optimizer state and the schedule's count unchanged."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dora_jax.config import TrainerConfig
from dora_jax.rl.optimizer import guarded_update, learning_rate_schedule, make_optimizer


def hand_written(t: TrainerConfig, count: int) -> float:
    """The schedule as rl/optimizer.py's docstring states it."""
    peak, warmup, decay = t.learning_rate, t.warmup_steps, max(t.decay_steps, 1)
    if count < warmup:
        return peak * (count + 1) / warmup
    if t.schedule == "cosine":
        return peak * 0.5 * (1 + math.cos(math.pi * min(max(count - warmup, 0) / decay, 1)))
    return peak


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 2, 7])
@pytest.mark.parametrize("decay", [1, 10, 100])
def test_schedule_equals_the_formula_at_every_count(schedule, warmup, decay):
    t = TrainerConfig(learning_rate=3e-4, warmup_steps=warmup, schedule=schedule,
                      decay_steps=decay)
    fn = learning_rate_schedule(t)
    counts = np.arange(0, warmup + decay + 20)
    got = np.asarray(jax.vmap(fn)(jnp.asarray(counts, jnp.int32)))  # traced, as in the step
    want = np.array([hand_written(t, int(c)) for c in counts])
    # float32 throughout: equal to a millionth of the peak.
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * t.learning_rate)
    assert float(fn(jnp.int32(0))) > 0  # no update is wasted at lr = 0


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(4), jnp.float32)}


def _grads(seed, poison=None):
    rng = np.random.default_rng(seed)
    g = {"w": rng.standard_normal((3, 4)).astype(np.float32),
         "b": rng.standard_normal(4).astype(np.float32)}
    if poison is not None:
        g["w"][1, 2] = poison
    return jax.tree.map(jnp.asarray, g)


GRADS = [(1, None), (2, np.nan), (3, None), (4, np.inf), (5, np.nan), (6, None)]


def _count(opt_state) -> int:
    """The schedule's count inside the optimizer state (optax's ScaleByScheduleState)."""
    counts = [x.count for x in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
        if isinstance(x, optax.ScaleByScheduleState)]
    assert len(counts) == 1
    return int(counts[0])


def test_guard_equals_apply_if_finite_and_skips_whole_updates():
    t = TrainerConfig(learning_rate=1e-2, warmup_steps=2, schedule="cosine", decay_steps=5,
                      weight_decay=0.1, grad_clip=1.0)
    tx = make_optimizer(t)
    theirs_tx = optax.apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
    ours, state = _params(), tx.init(_params())
    theirs, theirs_state = _params(), theirs_tx.init(_params())
    guard = jax.jit(lambda g, s, p, f: guarded_update(tx, g, s, p, f))
    applied = 0
    for seed, poison in GRADS:
        g = _grads(seed, poison)
        finite = jnp.isfinite(optax.tree.norm(g))
        before = jax.tree.map(np.asarray, (ours, state))
        ours, state = guard(g, state, ours, finite)
        updates, theirs_state = theirs_tx.update(g, theirs_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
        if poison is None:
            applied += 1
        else:  # skipped: params, moments and count exactly as they were
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((ours, state))):
                np.testing.assert_array_equal(a, np.asarray(b))
        assert _count(state) == _count(theirs_state.inner_state) == applied
        for a, b in zip(jax.tree.leaves((ours, state)),
                        jax.tree.leaves((theirs, theirs_state.inner_state))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(theirs_state.total_notfinite) == 3


def test_the_guard_updates_the_donated_state_in_place():
    """Donated params and moments: the guarded step needs no more scratch memory than
    an unguarded one. Choosing between new and old state by a select (as the guard
    once did) keeps both alive, and XLA copies params and moments each step."""
    tx = make_optimizer(TrainerConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip=1.0))
    params = {"w": jnp.zeros((256, 512)), "v": jnp.zeros((512, 256)), "s": jnp.zeros(512)}
    state, grads = tx.init(params), jax.tree.map(jnp.ones_like, params)

    def plain(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    def select(p, s, g):
        finite = jnp.isfinite(optax.tree.norm(g))
        new = plain(p, s, g)
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (p, s))

    def guarded(p, s, g):
        return guarded_update(tx, g, s, p, jnp.isfinite(optax.tree.norm(g)))

    def temp(fn):
        compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(params, state, grads).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    assert temp(guarded) <= temp(plain) + param_bytes // 10
    assert temp(select) >= temp(plain) + param_bytes // 2  # the check sees the copies


def test_apply_if_finite_gives_up_where_the_guard_does_not():
    """Why the guard is kept: after `max_consecutive_errors` non-finite updates in a
    row, optax applies the next one (NaN params); the guard skips every one."""
    tx = make_optimizer(TrainerConfig(learning_rate=1e-2))
    theirs_tx = optax.apply_if_finite(tx, max_consecutive_errors=1)
    ours, state = _params(), tx.init(_params())
    theirs, theirs_state = _params(), theirs_tx.init(_params())
    for seed in (1, 2):
        g = _grads(seed, np.nan)
        ours, state = guarded_update(tx, g, state, ours, jnp.isfinite(optax.tree.norm(g)))
        updates, theirs_state = theirs_tx.update(g, theirs_state, theirs)
        theirs = optax.apply_updates(theirs, updates)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(ours))
    assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(theirs))
