"""The sampler's randomness and its draws: a step's uniforms against JAX's own draws
(threefry itself: tests/model/test_threefry.py); the inverse CDF against numpy's
cumulative sums; the tokens drawn against the distribution they are reported under."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.rollout import hlo_cost, sampling
from dora_jax.rollout.sampling import SamplingParams


def test_a_step_draws_what_jax_random_draws_from_the_folded_key():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2 ** 32, (64, 2), dtype=np.uint64).astype(np.uint32)
    steps = rng.integers(0, 10_000, 64).astype(np.int32)
    got = np.asarray(jax.jit(sampling.step_uniforms)(keys, steps))
    with jax.threefry_partitionable(True):
        want = [float(jax.random.uniform(jax.random.fold_in(
            jax.random.wrap_key_data(k, impl="threefry2x32"), int(n))))
            for k, n in zip(keys, steps)]
    np.testing.assert_array_equal(got, np.float32(want))
    assert ((0 <= got) & (got < 1)).all() and len(set(got.tolist())) == len(got)


def _weights(V=300, seed=0):
    """Rows over 300 tokens (three blocks, the last one partial), with zero-weight
    tokens inside and at the end, and one row whose mass is all on its last token."""
    rng = np.random.default_rng(seed)
    w = rng.exponential(size=(4, V)).astype(np.float32)
    w[0, rng.choice(V, 100, replace=False)] = 0
    w[1, 130:] = 0  # the last two blocks empty
    w[2, :-1] = 0  # all on the last token
    w[3, :128] = 0  # the first block empty
    return w


def test_the_inverse_cdf_picks_the_token_whose_interval_holds_u():
    w = _weights()
    rng = np.random.default_rng(1)
    u = rng.random((4000,)).astype(np.float32)
    W = np.repeat(w, 1000, axis=0)
    got = np.asarray(jax.jit(sampling.inverse_cdf)(W, u))
    cdf = np.cumsum(W.astype(np.float64), axis=1)
    target = u * cdf[:, -1]
    want = np.array([np.searchsorted(c, t, side="right") for c, t in zip(cdf, target)])
    # f32 sums differ from float64's by rounding: only draws that close to a boundary
    # may fall on the neighbour.
    near = np.abs(np.take_along_axis(cdf, np.minimum(want, W.shape[1] - 1)[:, None], 1)[:, 0]
                  - target) < 1e-5 * cdf[:, -1]
    assert (got == want)[~near].all() and (~near).sum() > 3900
    assert (W[np.arange(len(got)), got] > 0).all()  # never a token of zero weight
    assert (got[2000:3000] == 299).all()


def test_u_next_to_one_still_draws_a_kept_token():
    w = _weights()
    u = np.full(4, np.nextafter(np.float32(1), np.float32(0)))
    got = np.asarray(sampling.inverse_cdf(jnp.asarray(w), jnp.asarray(u)))
    assert (w[np.arange(4), got] > 0).all()
    assert got.tolist() == [int(np.flatnonzero(r)[-1]) for r in w]


@pytest.mark.parametrize("sp", [SamplingParams(temperature=0.7),
                                SamplingParams(top_k=40), SamplingParams(top_p=0.8)])
def test_tokens_are_drawn_with_the_probabilities_they_are_reported_under(sp):
    """50,000 draws over a 300-token vocabulary, every row the same logits and its
    own request key: the counts against the reported distribution (chi-square), and
    each token's log-prob equal to that distribution's."""
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=300) * 2).astype(np.float32)
    N = 50_000
    keys = rng.integers(0, 2 ** 32, (N, 2), dtype=np.uint64).astype(np.uint32)
    draw = jax.jit(lambda lg, k, n: sampling.sample(jnp.broadcast_to(lg, (N, 300)),
                                                    sampling.step_uniforms(k, n), sp))
    tokens, logprobs = (np.asarray(x) for x in draw(logits, keys, np.zeros(N, np.int32)))
    logp = np.asarray(sampling.truncated_logprobs(jnp.asarray(logits)[None], sp))[0]
    np.testing.assert_allclose(logprobs, logp[tokens], atol=1e-5)
    p = np.exp(logp.astype(np.float64))
    kept = p > 0
    assert kept[tokens].all()
    counts = np.bincount(tokens, minlength=300)
    expected = N * p
    # Tokens expected fewer than 5 times are pooled, as the test requires.
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = ((obs - exp) ** 2 / np.maximum(exp, 1e-12)).sum()
    dof = len(obs) - 1
    # mean dof, sd sqrt(2 dof): six sd is a chance of about 1e-9 of failing.
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (chi2, dof)


def test_a_draw_over_a_large_vocabulary_reads_its_logits_a_few_times():
    """256 rows of 32,768 logits: one uniform per row, so the compiled draw reads and
    writes a few multiples of the logits and launches a few dozen kernels (Gumbel-max
    over rolled threefry loops took 1.7 GB and 210 kernels at this shape)."""
    B, V = 256, 32_768
    fn = jax.jit(lambda lg, k, n: sampling.sample(lg, sampling.step_uniforms(k, n),
                                                  SamplingParams()))
    hlo = fn.lower(jax.ShapeDtypeStruct((B, V), jnp.float32),
                   jax.ShapeDtypeStruct((B, 2), jnp.uint32),
                   jax.ShapeDtypeStruct((B,), jnp.int32)).compile().as_text()
    assert hlo_cost.count_bytes(hlo) < 8 * B * V * 4
    assert hlo_cost.count_kernels(hlo) <= 40
