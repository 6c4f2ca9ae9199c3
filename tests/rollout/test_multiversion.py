"""One engine serving several LoRA versions at once, each slot under its own: every
request gets exactly the tokens, and within 1e-5 the log-probs, of an engine that
holds only its version; across a version loaded mid-run and a place reused after
its version is evicted."""

import dataclasses
import functools

import _rollout_common as rc
import jax
import numpy as np
import pytest

from dora_jax.model import lora, transformer
from dora_jax.rollout import Engine
from dora_jax.rollout.adapters import check_versions

RANK = 4


@functools.cache
def lora_model():
    cfg = rc.config("dense").model
    return dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=RANK, alpha=8.0))


@functools.cache
def version_params(version: int):
    """One base for every version; adapters of their own, B non-zero so they differ."""
    _, params = transformer.create(lora_model(), seed=0)
    base, adapters = lora.split(params)
    keys = iter(jax.random.split(jax.random.key(100 + version), 64))
    adapters = jax.tree.map(lambda x: 0.5 * jax.random.normal(next(keys), x.shape, x.dtype),
                            adapters)
    return lora.merge(base, adapters)


@functools.cache
def engines(kind: str, kv_cache: str):
    """(an engine holding 3 versions at once, one holding one) on two slice meshes."""
    rollout = rc.rollout(decode_steps=2, kv_cache=kv_cache)
    make = functools.partial(Engine, lora_model(), rollout, sampling_params=rc.SAMPLING[kind])
    return make(rc.meshes()[1][0], versions=3), make(rc.meshes()[1][1])


def _prefill(eng, params, prompt, seed):
    padded, n = eng.pad_tokens(prompt)
    return eng.prefill(params=params, padded_tokens=padded, true_length=n, rng=seed)


def _collect(out, res, slot, step=None):
    row = (lambda f: f[slot]) if step is None else (lambda f: f[step, slot])
    out[0].append(int(row(res.tokens)))
    out[1].append(float(row(res.logprobs)))
    return bool(row(res.finished))


def alone(kind, kv_cache, version, prompt, seed):
    """(tokens, logprobs) of one request on an engine holding only its version."""
    _, eng = engines(kind, kv_cache)
    params = eng.load_params(version_params(version))
    prefix, first = _prefill(eng, params, prompt, seed)
    state = eng.insert(prefix, eng.init_decode_state(), 0)
    out = ([], [])
    done = _collect(out, jax.device_get(first), 0)
    while not done:
        state, res = eng.generate_steps(params, state)
        res = jax.device_get(res)
        for i in range(res.data.shape[0]):
            if res.valid[i, 0]:
                done = _collect(out, res, 0, i)
                if done:
                    break
    return out


# (request, version, prompt index, seed); the phases below say when each starts.
FIRST = [("a", 0, 0, 11), ("b", 1, 1, 12), ("c", 0, 2, 13)]
LOADED_MID_RUN = [("d", 2, 3, 14)]  # version 2 loads into place 2 while a-c decode
AFTER_EVICTION = [("e", 3, 0, 15), ("f", 1, 0, 16)]  # version 0 evicted, 3 in its place


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_each_slot_decodes_as_an_engine_holding_only_its_version(kind, kv_cache):
    eng, _ = engines(kind, kv_cache)
    places = eng.places
    stack = places.empty(eng.load_params(version_params(0)))
    place_of, slot_of, free_slots = {}, {}, [3, 2, 1, 0]
    version_of = {r: v for r, v, _, _ in FIRST + LOADED_MID_RUN + AFTER_EVICTION}
    out, running = {}, set()
    state = eng.init_decode_state()
    most_versions = 0

    def load(version, place):
        nonlocal stack
        stack = places.put(stack, place, eng.load_params(version_params(version)))
        place_of[version] = place

    def start(requests):
        nonlocal state
        for rid, version, prompt, seed in requests:
            slot = free_slots.pop()
            params = places.with_rows(stack, [place_of[version]])
            prefix, first = _prefill(eng, params, rc.PROMPTS[prompt], seed)
            state = eng.insert(prefix, state, slot)
            out[rid], slot_of[rid] = ([], []), slot
            if not _collect(out[rid], jax.device_get(first), 0):
                running.add(rid)
            else:
                free_slots.append(slot)

    def call():
        nonlocal state, most_versions
        rows = np.zeros(eng.max_concurrent_decodes, np.int32)
        for rid in running:
            rows[slot_of[rid]] = place_of[version_of[rid]]
        most_versions = max(most_versions, len({version_of[r] for r in running}))
        state, res = eng.generate_steps(places.with_rows(stack, rows), state)
        res = jax.device_get(res)
        for i in range(res.data.shape[0]):
            for rid in sorted(running):
                if res.valid[i, slot_of[rid]] and _collect(out[rid], res, slot_of[rid], i):
                    running.discard(rid)
                    free_slots.append(slot_of[rid])

    load(0, 0)
    load(1, 1)
    start(FIRST)
    call()
    load(2, 2)  # a free place: nothing else stops
    start(LOADED_MID_RUN)
    while running & {"a", "c"}:
        call()
    del place_of[0]  # evicted: nothing of version 0 remains
    load(3, 0)
    start(AFTER_EVICTION)
    while running:
        call()

    assert most_versions == 3  # one generate call served three versions
    for rid, version, prompt, seed in FIRST + LOADED_MID_RUN + AFTER_EVICTION:
        tokens, logprobs = alone(kind, kv_cache, version, rc.PROMPTS[prompt], seed)
        assert out[rid][0] == tokens, rid
        np.testing.assert_allclose(out[rid][1], logprobs, atol=1e-5, err_msg=rid)
    # The versions really differ: one prompt, three versions, three responses.
    refs = {v: alone(kind, kv_cache, v, rc.PROMPTS[0], 11)[0] for v in (0, 1, 3)}
    assert len({tuple(t) for t in refs.values()}) == 3, refs


def test_stacked_adapters_apply_each_rows_own_version_in_a_full_forward():
    """The per-row path against the plain one: a batch of rows under places [2, 0, 1]
    gives each row the logits of the model holding that row's version."""
    cfg = lora_model()
    graphdef = transformer.create(cfg, seed=0)[0]
    tokens = np.asarray([rc.PROMPTS[0][:3], rc.PROMPTS[1][:3], rc.PROMPTS[3][:3]], np.int32)
    single = [version_params(v) for v in range(3)]
    # The place axis follows the layers axis of scanned layers (rollout/adapters.py).
    axis = int(cfg.scan_layers)
    stacked = jax.tree.map(lambda *xs: np.stack(xs, axis=axis), *single)
    stacked = lora.merge(lora.split(single[0])[0], lora.split(stacked)[1])
    with lora.rows(np.asarray([2, 0, 1], np.int32)):
        got = transformer.apply(graphdef, stacked, tokens)[0]
    for row, v in enumerate([2, 0, 1]):
        want = transformer.apply(graphdef, single[v], tokens[row:row + 1])[0]
        np.testing.assert_allclose(got[row], want[0], atol=1e-5)
    with pytest.raises(ValueError, match="lora.rows"):
        transformer.apply(graphdef, stacked, tokens)


def test_several_versions_need_lora_and_no_expert_adapters():
    dense = rc.config("dense").model
    with pytest.raises(ValueError, match="model.lora.rank"):
        check_versions(dense, 2)
    moe = rc.config("moe").model
    experts = dataclasses.replace(moe, lora=dataclasses.replace(moe.lora, rank=2, experts=True))
    with pytest.raises(ValueError, match="model.lora.experts"):
        check_versions(experts, 2)
    check_versions(dense, 1)
    check_versions(lora_model(), 3)
