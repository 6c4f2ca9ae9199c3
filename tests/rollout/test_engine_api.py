"""Our Engine against JetStream's `engine_api.Engine`: the interface written out
below (from jetstream/engine/engine_api.py) checked by signature, and what the
API's calls must do, against full-forward references (tests/_rollout_common.py)."""

import dataclasses
import inspect

import _rollout_common as rc
import jax
import numpy as np
import pytest

from dora_jax.rollout import Engine, ResultTokens, SlotData
from dora_jax.rollout.sampling import SamplingParams
from dora_jax.text.tokenizer import TokenizerParameters

_ = inspect.Parameter.empty
KW, POS = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
VARARGS = "*args, **kwargs"  # JetStream leaves these arguments to the engine

# JetStream's Engine: method -> its parameters (name, kind, default) after self.
JETSTREAM_METHODS = {
    "prefill": [("params", KW, _), ("existing_prefix", KW, None), ("padded_tokens", KW, _),
                ("true_length", KW, _), ("sampler", KW, None), ("request_id", KW, None)],
    "prefill_multisampling": [
        ("params", KW, _), ("existing_prefix", KW, None), ("padded_tokens", KW, _),
        ("true_length", KW, _), ("sampler", KW, None), ("rng", KW, None),
        ("num_samples", KW, 1)],
    "generate": [("params", POS, _), ("decode_state", POS, _), ("sampler", POS, None)],
    "insert": [("prefix", POS, _), ("decode_state", POS, _), ("slot", POS, _),
               ("request_id", POS, None)],
    "bulk_insert": [("prefix", POS, _), ("decode_state", POS, _), ("slots", POS, _)],
    "free_resource": [("slot", POS, _)],
    "load_params": VARARGS,
    "get_prefix_destination_sharding": [],
    "get_tokenizer": [],
    "build_tokenizer": [("metadata", POS, _)],
    "init_decode_state": VARARGS,
}
JETSTREAM_PROPERTIES = ["max_concurrent_decodes", "samples_per_slot", "max_prefill_length",
                        "mesh", "colocated_cpus", "use_chunked_prefill", "prefill_chunk_size"]
RESULT_TOKENS_FIELDS = ["data", "tokens_idx", "valid_idx", "length_idx", "samples_per_slot"]
RESULT_TOKENS_METHODS = {"copy_to_host_async": [], "convert_to_numpy": [],
                         "get_result_at_slot": ["slot"]}
SLOT_DATA_FIELDS = ["tokens", "valid", "lengths", "log_prob"]
TOKENIZER_PARAMETERS_FIELDS = ["path", "extra_ids"]


@pytest.mark.parametrize("name", sorted(JETSTREAM_METHODS))
def test_method_signature_is_jetstreams(name):
    """JetStream's parameters first, in order, of the same kind and default; ours
    after them, each with a default, so every call JetStream's callers make works."""
    want = JETSTREAM_METHODS[name]
    method = inspect.getattr_static(Engine, name)
    assert callable(method) and not isinstance(method, property)
    if want == VARARGS:
        return
    got = list(inspect.signature(method).parameters.values())[1:]
    assert [(p.name, p.kind, p.default) for p in got[:len(want)]] == want
    for extra in got[len(want):]:
        assert extra.default is not _ and extra.kind in (KW, POS), extra


@pytest.mark.parametrize("name", JETSTREAM_PROPERTIES)
def test_property_is_jetstreams(name):
    assert isinstance(inspect.getattr_static(Engine, name), property)


def test_result_types_are_jetstreams():
    # JetStream's fields in its order (positional construction works), extensions after.
    names = [f.name for f in dataclasses.fields(ResultTokens)]
    assert names[:len(RESULT_TOKENS_FIELDS)] == RESULT_TOKENS_FIELDS
    assert names[len(RESULT_TOKENS_FIELDS):] == ["routing"]
    for name, params in RESULT_TOKENS_METHODS.items():
        sig = inspect.signature(getattr(ResultTokens, name))
        assert list(sig.parameters)[1:] == params
    assert [f.name for f in dataclasses.fields(SlotData)] == SLOT_DATA_FIELDS
    names = [f.name for f in dataclasses.fields(TokenizerParameters)]
    assert names[:len(TOKENIZER_PARAMETERS_FIELDS)] == TOKENIZER_PARAMETERS_FIELDS


def _prefill_insert(eng, params, state, prompts, slots, seeds=None):
    firsts = []
    for i, (prompt, slot) in enumerate(zip(prompts, slots)):
        padded, n = eng.pad_tokens(prompt)
        prefix, first = eng.prefill(params=params, padded_tokens=padded, true_length=n,
                                    rng=None if seeds is None else seeds[i])
        state = eng.insert(prefix, state, slot)
        firsts.append(int(jax.device_get(first).tokens[0]))
    return state, firsts


def _decode(eng, params, state, slots):
    """One-step `generate` until every slot in `slots` finished: {slot: [(token,
    log-prob), ...]} of the tokens after the first."""
    out, running = {s: [] for s in slots}, set(slots)
    while running:
        state, res = eng.generate(params, state)
        res = res.convert_to_numpy()
        for s in list(running):
            if res.valid[s]:  # not valid: it finished on its first token
                out[s].append((int(res.tokens[s]), float(res.logprobs[s])))
            if res.finished[s] or not res.valid[s]:
                running.remove(s)
    return out


def test_generate_advances_one_token_per_active_slot_and_reads_by_slot():
    eng = rc.engine("dense", "greedy", 0)
    p = rc.params("dense", 0)
    params = eng.load_params(p)
    prompts, slots = rc.PROMPTS[:2], [2, 0]
    want = rc.greedy_reference("dense", p, prompts, eos=-1, steps=3)
    state, firsts = _prefill_insert(eng, params, eng.init_decode_state(), prompts, slots)
    assert firsts == [w[0] for w in want]
    for k in (1, 2):  # response tokens 1 and 2: one per call
        state, res = eng.generate(params, state)
        assert res.data.shape == (eng.max_concurrent_decodes, 6)
        res = res.convert_to_numpy()
        assert set(np.flatnonzero(res.valid)) == set(slots)
        np.testing.assert_array_equal(np.asarray(state.steps)[slots], k + 1)
        for prompt, slot, ref in zip(prompts, slots, want):
            got = res.get_result_at_slot(slot)
            assert got.tokens.shape == got.valid.shape == (1, 1) and got.lengths.shape == (1,)
            assert (got.tokens[0, 0], got.valid[0, 0], got.lengths[0]) == (ref[k], 1, k + 1)
            assert got.log_prob[0, 0] == res.logprobs[slot] <= 0
            assert res.positions[slot] == len(prompt) + k
        for idle in set(range(eng.max_concurrent_decodes)) - set(slots):
            assert res.get_result_at_slot(idle).valid[0, 0] == 0


def test_multisampling_prefix_and_bulk_insert_equal_one_by_one():
    """prefill_multisampling: the KV of one prefill and, for sample i, the first
    token of a prefill with rng[i]; bulk_insert (mapping shared prompt pages)
    decodes every sample as inserting each alone does."""
    eng = rc.engine("dense", "sampled", 1)
    params = eng.load_params(rc.params("dense", 0))
    prompt, seeds, slots = rc.PROMPTS[4], [31, 32, 33], [3, 0, 2]
    padded, n = eng.pad_tokens(prompt)
    multi, first_m = eng.prefill_multisampling(params=params, padded_tokens=padded,
                                               true_length=n, rng=seeds, num_samples=3)
    first_m = first_m.convert_to_numpy()
    assert multi.num_samples == 3 and first_m.data.shape == (3, 6)
    state = eng.bulk_insert(multi, eng.init_decode_state(), slots, length=n)
    together = _decode(eng, params, state, slots)
    state, firsts = eng.init_decode_state(), []
    for seed, slot in zip(seeds, slots):
        single, first = eng.prefill(params=params, padded_tokens=padded, true_length=n,
                                    rng=seed)
        np.testing.assert_array_equal(np.asarray(single.cache.k), np.asarray(multi.cache.k))
        np.testing.assert_array_equal(np.asarray(single.cache.v), np.asarray(multi.cache.v))
        firsts.append(int(jax.device_get(first).tokens[0]))
        state = eng.insert(single, state, slot, length=n)
    assert first_m.tokens.tolist() == firsts
    alone = _decode(eng, params, state, slots)
    assert together == alone
    assert len({tuple(t for t, _ in together[s]) for s in slots}) > 1  # distinct samples
    with pytest.raises(ValueError, match="bulk_insert"):
        eng.insert(multi, eng.init_decode_state(), 0)


def test_a_prompt_program_drawing_for_more_samples_gives_each_count_what_it_asks():
    """With prefill_samples=4 one prompt program serves 1, 2 and 4 samples, and each
    count gets the prefix, first tokens and log-probs of an engine drawing only them."""
    mesh = rc.meshes()[1][2]
    own = SamplingParams(temperature=0.85)  # programs of this test's own
    wide, exact = (Engine(rc.config("dense").model, rc.rollout(kv_cache="dense"), mesh,
                          sampling_params=own, prefill_samples=k) for k in (4, 1))
    params = wide.load_params(rc.params("dense", 0))
    padded, n = wide.pad_tokens(rc.PROMPTS[3])
    counts = (4, 2, 1)
    got = [wide.prefill_multisampling(params=params, padded_tokens=padded, true_length=n,
                                      rng=[71 + i for i in range(c)], num_samples=c)
           for c in counts]
    assert wide._jit.prefill._cache_size() == 1  # before `exact` adds to the shared programs
    for count, out in zip(counts, got):
        want = exact.prefill_multisampling(params=params, padded_tokens=padded, true_length=n,
                                           rng=[71 + i for i in range(count)],
                                           num_samples=count)
        (prefix, result), (ref_prefix, ref_result) = jax.device_get((out, want))
        assert prefix.num_samples == count and result.data.shape == (count, 6)
        np.testing.assert_array_equal(result.data, ref_result.data)
        for name in ("token", "key", "active", "position", "step", "logits"):
            np.testing.assert_array_equal(getattr(prefix, name), getattr(ref_prefix, name))
        np.testing.assert_array_equal(prefix.cache.k, ref_prefix.cache.k)
    assert exact._jit.prefill._cache_size() == 3  # and 2 and 1 samples, drawn alone
    with pytest.raises(ValueError, match="prefill_samples"):
        Engine(rc.config("dense").model, rc.rollout(kv_cache="dense"), mesh, prefill_samples=0)


def test_a_sequence_stops_on_any_stop_id():
    """Two stop ids: the greedy response ends at the first place it emits the
    second one (the first is never emitted)."""
    p = rc.params("dense", 0)
    prompt = rc.PROMPTS[1]
    (ref,) = rc.greedy_reference("dense", p, [prompt], eos=-1)
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    never = min(set(range(rc.config("dense").model.vocab_size)) - set(ref))
    eng = Engine(rc.config("dense").model, rc.rollout(kv_cache="dense"), rc.meshes()[1][2],
                 greedy=True, stop_ids=(never, ref[k]))
    assert eng.stop_ids == (never, ref[k])
    params = eng.load_params(p)
    state, (first,) = _prefill_insert(eng, params, eng.init_decode_state(), [prompt], [1])
    tokens = [first] + [t for t, _ in _decode(eng, params, state, [1])[1]]
    assert tokens == ref[:k + 1]
    with pytest.raises(NotImplementedError, match="sampler"):
        eng.generate(params, eng.init_decode_state(), sampler=lambda logits: logits)
