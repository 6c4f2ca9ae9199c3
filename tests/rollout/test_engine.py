"""Engine API against full-forward references (tests/_rollout_common.py)."""

import _rollout_common as rc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dora_jax.rollout import SamplingParams, key_data_from_seed, prefill_buckets
from dora_jax.rollout.jetstream_compat import DEFAULT_STREAM
from dora_jax.rollout.sampling import truncated_logprobs
from dora_jax.rollout.step_cost import step_cost


def run_engine(eng, p, prompts, slots, seeds=None):
    """Drives the raw Engine API: prefill + insert each prompt into its slot, then
    generate_steps until every slot finished. Returns [(tokens, logprobs, positions)]."""
    params = eng.load_params(p)
    state = eng.init_decode_state()
    out = {}
    for i, (prompt, slot) in enumerate(zip(prompts, slots)):
        padded, n = eng.pad_tokens(prompt)
        prefix, first = eng.prefill(params=params, padded_tokens=padded, true_length=n,
                                    rng=None if seeds is None else seeds[i])
        state = eng.insert(prefix, state, slot)
        first = jax.device_get(first)
        out[slot] = ([int(first.tokens[0])], [float(first.logprobs[0])],
                     [int(first.positions[0])], bool(first.finished[0]))
    running = {s for s, v in out.items() if not v[3]}
    while running:
        state, res = eng.generate_steps(params, state)
        res = jax.device_get(res)
        assert res.data.shape[:2] == (eng.decode_steps, eng.max_concurrent_decodes)
        # Token i of this call for every running slot; the call ends after the first
        # step in which a slot finishes (later rows hold nothing).
        steps_run = int(res.valid.any(axis=1).sum())
        assert not res.valid[steps_run:].any()
        assert steps_run == eng.decode_steps or res.finished[steps_run - 1].any()
        for i in range(steps_run):
            assert set(np.flatnonzero(res.valid[i])) == running
            for s in list(running):
                out[s][0].append(int(res.tokens[i, s]))
                out[s][1].append(float(res.logprobs[i, s]))
                out[s][2].append(int(res.positions[i, s]))
                if res.finished[i, s]:
                    running.remove(s)
    return [out[s][:3] for s in slots]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_greedy_equals_full_forward_argmax(model):
    eng = rc.engine(model, "greedy", 0)
    p = rc.params(model, 0)
    prompts = rc.PROMPTS[:3]
    got = run_engine(eng, p, prompts, slots=[3, 0, 2])
    want = rc.greedy_reference(model, p, prompts, rc.eos_id())
    for (tokens, _, positions), ref, prompt in zip(got, want, prompts):
        assert tokens == ref
        assert positions == list(range(len(prompt), len(prompt) + len(ref)))
        assert len(tokens) == rc.MAX_DECODE or tokens[-1] == rc.eos_id()


def test_sampled_logprobs_equal_full_forward_with_temperature():
    eng = rc.engine("dense", "sampled", 1)
    p = rc.params("dense", 0)
    prompts = rc.PROMPTS[1:4]
    got = run_engine(eng, p, prompts, slots=[1, 2, 0], seeds=[11, 12, 13])
    for (tokens, logprobs, _), prompt in zip(got, prompts):
        want = rc.logprob_reference("dense", p, prompt, tokens, rc.TEMPERATURE)
        np.testing.assert_allclose(logprobs, want, rtol=0, atol=2e-5)
    # Sampling, not argmax: some sampled token is not the greedy choice.
    greedy = rc.greedy_reference("dense", p, prompts, rc.eos_id())
    assert any(t != g for (t, _, _), g in zip(got, greedy))


def test_topk_logprobs_renormalise_over_topk_set():
    eng = rc.engine("dense", "topk", 3)
    p = rc.params("dense", 0)
    prompts = rc.PROMPTS[:2]
    got = run_engine(eng, p, prompts, slots=[0, 1], seeds=[5, 6])
    for (tokens, logprobs, _), prompt in zip(got, prompts):
        (lg,) = rc.forward_logits("dense", p, [list(prompt) + tokens])
        z = lg[len(prompt) - 1:-1].astype(np.float64) / 0.8
        for zi, tok, lp in zip(z, tokens, logprobs):
            top = np.argsort(-zi)[:rc.TOP_K]
            assert tok in top
            want = zi[tok] - rc.logsumexp(zi[top])
            assert abs(lp - want) < 2e-5
            # Strictly above the untruncated log-prob: the mass outside top-k is gone.
            assert lp > zi[tok] - rc.logsumexp(zi) + 1e-4


def test_truncation_by_hand():
    logits = jnp.array([[2.0, 1.0, 0.5, 0.0, -1.0]])
    # top_p = 0.6 at T=1: probs ~ [.56, .21, .13, .08, .03]: .56 < .6 <= .77 so the
    # nucleus is {0, 1}, renormalised: log(e^2 / (e^2 + e^1)).
    lp = np.asarray(truncated_logprobs(logits, SamplingParams(top_p=0.6)))[0]
    np.testing.assert_allclose(lp[:2], [2 - np.log(np.e ** 2 + np.e), 1 - np.log(np.e ** 2 + np.e)],
                               rtol=1e-6)
    assert np.all(np.isneginf(lp[2:]))
    # top_k = 3, T = 2: logits/2 = [1, .5, .25, 0, -.5], kept {0, 1, 2}.
    lp = np.asarray(truncated_logprobs(logits, SamplingParams(temperature=2.0, top_k=3)))[0]
    norm = np.log(np.exp(1) + np.exp(.5) + np.exp(.25))
    np.testing.assert_allclose(lp[:3], [1 - norm, .5 - norm, .25 - norm], rtol=1e-6)
    assert np.all(np.isneginf(lp[3:]))


def test_api_surface_and_bad_calls():
    eng = rc.engine("dense", "greedy", 0)
    assert eng.max_concurrent_decodes == rc.SLOTS
    assert eng.max_prefill_length == rc.MAX_PROMPT
    assert eng.samples_per_slot == 1
    assert eng.mesh is rc.meshes()[1][0]
    # Prompt bucket, then doubling re-prefill buckets capped at the cache length.
    assert eng.buckets == (8, 16, 20) == prefill_buckets(eng.rollout_cfg)
    assert key_data_from_seed(7).tolist() == jax.random.key_data(jax.random.PRNGKey(7)).tolist()
    params = eng.load_params(rc.params("dense", 0))
    with pytest.raises(ValueError, match="padded_tokens"):
        eng.prefill(params=params, padded_tokens=np.zeros((1, 8), np.int32), true_length=3)
    # Padded to another bucket (JetStream's 16, 32, ...): re-padded to ours.
    p7, r7 = eng.prefill(params=params, padded_tokens=np.arange(1, 8, dtype=np.int32),
                         true_length=3)
    p8, r8 = eng.prefill(params=params, padded_tokens=np.array([1, 2, 3, 0, 0, 0, 0, 0],
                                                               np.int32), true_length=3)
    assert p7.cache.length == p8.cache.length == 8 and r7.tokens.tolist() == r8.tokens.tolist()
    with pytest.raises(ValueError, match="max_prefill_length"):
        eng.prefill(params=params, padded_tokens=np.zeros(16, np.int32), true_length=9)
    with pytest.raises(ValueError, match="prompt length"):
        eng.prefill(params=params, padded_tokens=np.zeros(8, np.int32), true_length=0)
    # No rng while sampling: the default key scheme, a new key per sample.
    sampler = rc.engine("dense", "sampled", 1)
    first = sampler._default_keys.take(1)[0]
    assert first[0] == DEFAULT_STREAM
    _, r = sampler.prefill_multisampling(params=params, padded_tokens=np.zeros(8, np.int32),
                                         true_length=3, num_samples=3)
    assert r.samples_per_slot == 3 and r.get_result_at_slot(0).tokens.shape == (3, 1)
    assert sampler._default_keys.take(1)[0][1] == first[1] + 4
    state = eng.init_decode_state()
    prefix, _ = eng.prefill(params=params, padded_tokens=np.ones(8, np.int32), true_length=2)
    with pytest.raises(ValueError, match="slot 4 out of range"):
        eng.insert(prefix, state, 4)
    with pytest.raises(ValueError, match="true_length"):
        eng.prefill(params=params, padded_tokens=np.ones(8, np.int32), true_length=9,
                    existing_prefix=prefix)
    assert eng.colocated_cpus is None
    with pytest.raises(ValueError, match="structure"):
        eng.load_params(rc.params("moe", 0))


def test_prefill_extending_a_prefix_equals_a_full_forward():
    """Chunked prefill: the prompt's prefix, then prompt + 6 tokens so far on top of
    it. The next token's log-prob equals the full forward's, and decoding on from the
    extended prefix gives the tokens that decoding on from a whole prefill gives."""
    eng = rc.engine("dense", "sampled", 1)
    p = rc.params("dense", 0)
    params = eng.load_params(p)
    prompt, so_far = rc.PROMPTS[1], [11, 12, 13, 14, 15, 16]
    padded, n = eng.pad_tokens(prompt + so_far)
    prompt_padded, P = eng.pad_tokens(prompt)
    base, _ = eng.prefill(params=params, padded_tokens=prompt_padded, true_length=P, rng=3)
    whole, first = eng.prefill(params=params, padded_tokens=padded, true_length=n, rng=9,
                               num_generated=6)
    chunk, t = eng.pad_tokens(so_far)  # appended to the prompt's prefix, as in JetStream
    ext, ext_first = eng.prefill(params=params, padded_tokens=chunk, true_length=t, rng=9,
                                 num_generated=6, existing_prefix=base)
    first, ext_first = jax.device_get((first, ext_first))
    assert int(ext_first.tokens[0]) == int(first.tokens[0])
    assert int(ext_first.positions[0]) == int(first.positions[0]) == n
    ref = rc.logprob_reference("dense", p, prompt + so_far[:-1],
                               [so_far[-1], int(ext_first.tokens[0])], rc.TEMPERATURE)
    np.testing.assert_allclose(ext_first.logprobs[0], ref[-1], atol=1e-4)
    assert ext.cache.length == whole.cache.length == 16
    np.testing.assert_allclose(np.asarray(ext.cache.k)[:, :, :n],
                               np.asarray(whole.cache.k)[:, :, :n], atol=1e-5)
    state = eng.init_decode_state()
    state = eng.insert(whole, state, 0, length=n)
    state = eng.insert(ext, state, 1, length=n)
    state, res = eng.generate_steps(params, state)
    res = jax.device_get(res)
    rows = res.valid[:, 0]
    assert rows.sum() >= 3 and (res.valid[:, 1] == rows).all()
    assert res.tokens[rows, 0].tolist() == res.tokens[rows, 1].tolist()
    np.testing.assert_allclose(res.logprobs[rows, 0], res.logprobs[rows, 1], atol=1e-5)


@pytest.mark.parametrize("config_name", ["tiny.py", "longtail.py"])
def test_warm_up_covers_every_chunked_prefill_shape(config_name):
    """The (prefix, chunk) buckets warmed equal those of every prompt length and
    tokens-so-far count, enumerated one by one."""
    import types

    from conftest import load_repo_config

    from dora_jax.base.buckets import pick_bucket
    from dora_jax.rollout.warmup import extension_shapes

    r = load_repo_config(f"configs/{config_name}", num_devices=8).rollout
    eng = types.SimpleNamespace(buckets=prefill_buckets(r), cache_length=r.cache_length,
                                max_prefill_length=r.max_prefill_length,
                                max_decode_len=r.max_decode_len)

    def key(prompt_len, so_far):
        return tuple(pick_bucket(x, eng.buckets) for x in (prompt_len, so_far))

    warmed = {key(p, t) for p, t in extension_shapes(eng)}
    every = {key(p, t) for p in range(1, r.max_prefill_length + 1)
             for t in range(1, r.max_decode_len)}
    assert warmed == every and len(warmed) > 1


def test_warm_up_compiles_every_paged_decode_bucket():
    """Warm-up runs a decode call at every bucket of mapped pages the pool can
    reach (the largest as the pool read in place), so that no bucket compiles
    mid-run."""
    import dataclasses

    from dora_jax.rollout import Engine
    from dora_jax.rollout.warmup import warm_engine

    # Pages of 2 positions: 10 per slot, buckets 8, 16, 32 and 40 (every slot full).
    eng = Engine(rc.config("dense").model,
                 dataclasses.replace(rc.rollout(2), page_size=2), rc.meshes()[1][3],
                 greedy=True)
    assert eng.pages.flat_buckets() == (8, 16, 32, 40)
    seen = []
    view = eng.pages.view

    def record():
        v = view()
        seen.append(len(v.flat_pages))
        return v

    eng.pages.view = record
    try:
        warm_engine(eng, eng.load_params(rc.params("dense", 0)), reprefills=False)
    finally:
        del eng.pages.view
    assert set(seen) == {8, 16, 32, 0}  # the largest reads the pool in place: none listed


def test_warm_up_compiles_what_groups_starting_together_run():
    """With the run's group size, warm-up compiles every shape a slice's groups of
    fresh samples start with (a power of two of them at a time): groups of 1 to 4
    samples then decode without compiling anything."""
    from dora_jax.rollout import DecodeSlice, Engine, Request
    from dora_jax.rollout.warmup import warm_engine

    eng = Engine(rc.config("dense").model, rc.rollout(), rc.meshes()[1][3],
                 sampling_params=rc.SAMPLING["sampled"])
    params = eng.load_params(rc.params("dense", 0))
    warm_engine(eng, params, reprefills=False, group_size=4)
    programs = ("prefill", "resample", "insert", "steps")
    compiled = {name: getattr(eng._jit, name)._cache_size() for name in programs}
    sl = DecodeSlice(0, eng)
    sl.load_version(0, params)
    for size in (1, 2, 3, 4):
        for k in range(size):
            sl.submit(Request(group_id=size, prompt_id=size, sample_index=k, version=0,
                              prompt_tokens=rc.PROMPTS[size], seed=10 * size + k))
        assert len(sl.drain()) == size
    assert {name: getattr(eng._jit, name)._cache_size() for name in programs} == compiled
    assert sl.stats.prefills == 4 and sl.stats.prefills_shared == 6


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_continuations_prefilled_together_equal_each_alone(model):
    """Three prefixes (their own prompts, each with tokens of its own appended) in one
    batched call: each row's first token, log-prob, position and extended KV equal the
    same prefill alone; three rows compile as four, the fourth dropped."""
    eng = rc.engine(model, "sampled", 1)
    params = eng.load_params(rc.params(model, 0))
    prompts, chunks = rc.PROMPTS[1:4], [[11, 12, 13], [7], [21, 22, 23, 24, 25]]
    bases = []
    for i, prompt in enumerate(prompts):
        padded, P = eng.pad_tokens(prompt)
        bases.append(eng.prefill(params=params, padded_tokens=padded, true_length=P,
                                 rng=i)[0])
    padded = [eng.pad_tokens(c)[0] for c in chunks]
    together = eng.prefill_continuations(
        params=params, prefixes=bases, padded_tokens=padded,
        true_lengths=[len(c) for c in chunks], rngs=[40, 41, 42],
        num_generated=[len(c) for c in chunks], max_new_tokens=[None] * 3)
    assert len(together) == 3
    for base, pad, chunk, seed, (prefix, first) in zip(bases, padded, chunks, [40, 41, 42],
                                                       together):
        alone, first_alone = eng.prefill(params=params, padded_tokens=pad,
                                         true_length=len(chunk), rng=seed,
                                         num_generated=len(chunk), existing_prefix=base)
        first, first_alone = jax.device_get((first, first_alone))
        np.testing.assert_array_equal(first.data[:, :1], first_alone.data[:, :1])  # token
        np.testing.assert_allclose(first.logprobs, first_alone.logprobs, atol=1e-5)
        assert int(prefix.position) == int(alone.position)
        np.testing.assert_allclose(np.asarray(prefix.cache.k), np.asarray(alone.cache.k),
                                   atol=1e-5)
    with pytest.raises(ValueError, match="one cache length"):
        short = eng.prefill(params=params, padded_tokens=eng.pad_tokens([3])[0],
                            true_length=1, rng=0)[0]
        long_ = together[0][0]
        eng.prefill_continuations(params=params, prefixes=[short, long_],
                                  padded_tokens=padded[:2], true_lengths=[1, 1], rngs=[1, 2],
                                  num_generated=[1, 1], max_new_tokens=[None, None])


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_a_decode_step_s_cost_counts_every_weight_and_the_cache(kv_cache):
    """step_cost: the weights are the model's (counted from its shapes here),
    the KV bytes the cache's, and the compiled step reads at least every weight."""
    from dora_jax.model import transformer

    eng = rc.engine("dense", "greedy", 1, kv_cache=kv_cache)
    p = eng.load_params(rc.params("dense", 0))
    cost = step_cost(eng, p)
    abstract = transformer.abstract_params(rc.config("dense").model)[1]
    assert cost["weight_bytes"] == sum(x.size * x.dtype.itemsize
                                       for x in jax.tree.leaves(abstract))
    cfg = rc.config("dense")
    m = cfg.model
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * np.dtype(m.dtype).itemsize
    positions = (eng.max_concurrent_decodes * eng.cache_length if kv_cache == "dense"
                 else (eng.pages.num_pages + 1) * eng.pages.page_size)
    assert cost["kv_bytes"] == per_token * positions
    assert cost["ideal_bytes"] == cost["weight_bytes"] + cost["kv_bytes"]
    assert cost["weight_bytes"] <= cost["bytes_accessed"] and cost["flops"] > 0
