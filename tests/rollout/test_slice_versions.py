"""A decode slice holding several LoRA versions at once (`DecodeSlice.add_version` /
`evict_version` on a multi-version engine): every slot decodes under its own
request's version in the same generate call, exactly as a slice holding only that
version does; versions load into free places while the others decode and leave
when nothing of them is held."""

from __future__ import annotations

import dataclasses
import functools

import _rollout_common as rc
import numpy as np
import pytest
from _lora_common import randomise_b

from dora_jax.config.model import LoRAConfig
from dora_jax.model import lora, transformer
from dora_jax.rollout import DecodeSlice, Engine, Request, RolloutError, VersionMismatchError

MODEL = dataclasses.replace(rc.config("dense").model, lora=LoRAConfig(rank=4, alpha=8.0))


@functools.cache
def _base():
    return transformer.create(MODEL, 0)[1]


@functools.cache
def version_params(v: int):
    """Version v: the one base (the same arrays), its own adapters (random B, so
    versions really differ)."""
    return randomise_b(_base(), seed=v, std=0.3 + 0.1 * v)


@functools.cache
def engine(kind: str, kv_cache: str, versions: int, mesh_index: int) -> Engine:
    return Engine(MODEL, rc.rollout(kv_cache=kv_cache), rc.meshes()[1][mesh_index],
                  sampling_params=rc.SAMPLING[kind], versions=versions)


def request(gid, v, prompt, n=None):
    return Request(gid, f"p{gid}", 0, prompt, seed=1000 + gid, version=v, max_new_tokens=n)


# (group id, version, prompt index, max_new_tokens): version 0 ends early.
FIRST = [(0, 0, 0, 7), (1, 1, 1, None), (2, 0, 2, 9), (3, 1, 3, None)]
LATER = [(4, 2, 4, None), (5, 3, 5, None)]  # after version 0 is evicted


def alone(kind, kv_cache, v, reqs) -> dict:
    """Trajectories of `reqs` on a one-version slice holding version v only."""
    sl = DecodeSlice(0, engine(kind, kv_cache, 1, 0))
    sl.load_version(v, version_params(v))
    for r in reqs:
        sl.submit(r)
    return {t.request_id: t for t in sl.drain()}


@pytest.mark.parametrize("kind,kv_cache", [
    ("greedy", "dense"), ("sampled", "paged"),
    pytest.param("sampled", "dense", marks=pytest.mark.slow),
    pytest.param("greedy", "paged", marks=pytest.mark.slow)])
def test_slots_of_several_versions_decode_as_each_version_alone(kind, kv_cache):
    reqs = {g: request(g, v, rc.PROMPTS[p], n) for g, v, p, n in FIRST + LATER}
    sl = DecodeSlice(1, engine(kind, kv_cache, 3, 1))
    sl.add_version(0, version_params(0))
    sl.add_version(1, version_params(1))
    assert sl.resident_versions == [0, 1] and sl.versions.free_places == 1
    for g, *_ in FIRST:
        sl.submit(reqs[g])
    got = {}
    for _ in range(1):  # decode a while, then a version joins mid-run
        got.update({t.request_id: t for t in sl.step()})
    assert sl.num_running == 4
    sl.add_version(2, version_params(2))
    with pytest.raises(RolloutError, match="no free place"):
        sl.add_version(3, version_params(3))
    with pytest.raises(VersionMismatchError, match="cannot evict version 0"):
        sl.evict_version(0)
    while any(sl.holds(reqs[g].request_id) for g, v, *_ in FIRST if v == 0):
        got.update({t.request_id: t for t in sl.step()})
    assert sl.holds(reqs[1].request_id)  # version 1 is still decoding
    sl.evict_version(0)
    sl.add_version(3, version_params(3))  # into version 0's place
    assert sl.resident_versions == [1, 2, 3]
    for g, *_ in LATER:
        sl.submit(reqs[g])
    with pytest.raises(VersionMismatchError):
        sl.submit(request(9, 0, rc.PROMPTS[0]))
    got.update({t.request_id: t for t in sl.drain()})
    assert len(got) == len(reqs)
    for v in range(4):
        mine = [r for r in reqs.values() if r.version == v]
        ref = alone(kind, kv_cache, v, mine)
        for r in mine:
            t, u = got[r.request_id], ref[r.request_id]
            assert t.response_tokens == u.response_tokens, (v, r.request_id)
            np.testing.assert_allclose(t.behaviour_logprobs, u.behaviour_logprobs, atol=1e-5)
            assert t.versions == [[v, len(t.response_tokens)]]
    # The versions differ: the same prompt and seed give other tokens under another.
    other = alone(kind, kv_cache, 1, [dataclasses.replace(reqs[4], version=1)])
    assert other[reqs[4].request_id].response_tokens != got[reqs[4].request_id].response_tokens


def test_later_versions_move_only_their_adapters():
    """Loads count the bytes they place: the first the whole model, later versions
    (the same base arrays) their adapters alone, into a one-version slice and into
    the places of a multi-version one."""
    full, ad = lora.tree_bytes(_base()), lora.tree_bytes(lora.split(_base())[1])
    for versions in (1, 3):
        sl = DecodeSlice(0, Engine(MODEL, rc.rollout(kv_cache="dense"), rc.meshes()[1][2],
                                   greedy=True, versions=versions))
        sl.load_version(0, version_params(0))
        assert sl.stats.weight_bytes == full
        (sl.load_version if versions == 1 else sl.add_version)(1, version_params(1))
        assert sl.stats.weight_bytes == full + ad and ad < full / 10
        assert sl.resident_versions == ([1] if versions == 1 else [0, 1])
    sl.evict_version(0)
    sl.load_version(2, version_params(2))  # the only resident one now
    assert sl.resident_versions == [2] and sl.stats.weight_bytes == full + 2 * ad


def test_a_one_version_slice_evicts_and_refuses_as_before():
    sl = DecodeSlice(0, engine("greedy", "dense", 1, 0))
    sl.load_version(0, version_params(0))
    assert sl.resident_versions == [0] and sl.versions.free_places == 0
    with pytest.raises(RolloutError, match="no free place"):
        sl.add_version(1, version_params(1))
    sl.submit(request(0, 0, rc.PROMPTS[0]))
    with pytest.raises(VersionMismatchError, match="cannot evict version 0"):
        sl.evict_version(0)
    with pytest.raises(VersionMismatchError, match="holds version 0"):
        sl.submit(request(1, 1, rc.PROMPTS[1]))
    sl.drain()
    sl.evict_version(0)
    assert sl.resident_versions == [] and sl.params is None
    sl.add_version(1, version_params(1))
    assert sl.resident_versions == [1]


def test_a_worker_adds_and_evicts_versions_while_its_slots_decode():
    """The coordinator's commands on a multi-version slice's own loop: `add` posts
    VersionLoaded, one generate call serves both
    versions (the timeline's decode span names the slots per version), and `evict`
    frees the place for the next version."""
    import queue

    from dora_jax.base.timeline import Timeline
    from dora_jax.runtime.events import SamplesFinished, VersionLoaded
    from dora_jax.runtime.worker import SliceWorker

    events, timeline = queue.Queue(), Timeline()
    sl = DecodeSlice(0, engine("greedy", "dense", 2, 0))
    sl.load_version(0, version_params(0))
    w = SliceWorker(sl, events, timeline)
    # Queued before the loop starts, so they apply before its first generate call.
    w.submit(request(0, 0, rc.PROMPTS[0]))
    w.add(1, version_params(1))
    w.submit(request(1, 1, rc.PROMPTS[1]))
    w.start()
    finished, loaded = {}, []

    def take_until(done):
        while not done():
            ev = events.get(timeout=120)
            if isinstance(ev, SamplesFinished):
                finished.update({t.request_id: t for t in ev.trajectories})
                w.ack()
            elif isinstance(ev, VersionLoaded):
                loaded.append(ev.version)
            else:
                raise AssertionError(ev)

    try:
        take_until(lambda: len(finished) == 2 and loaded == [1])
        w.evict(0)
        w.add(2, version_params(2))
        take_until(lambda: loaded == [1, 2])
    finally:
        w.stop(timeout=60)
    assert sl.resident_versions == [1, 2]
    assert {t.versions[0][0] for t in finished.values()} == {0, 1}
    mixed = [s for s in timeline.spans if s.kind == "decode" and s.slots]
    assert mixed and all(s.slots == {0: 1, 1: 1} and s.version == 1 for s in mixed)
