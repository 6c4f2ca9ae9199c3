"""Multi-turn episodes on a decode slice, against full-forward references.

The reference never uses the engine: it runs the whole sequence (prompt, model
turns, observations) through `transformer.apply` for every token, picks the greedy
token with numpy and asks a plain copy of the environment's rule for each
observation. The slice keeps each episode's KV between turns and prefills the
observation on top of it; both must give the same tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import _rollout_common as rc
import jax
import numpy as np
import pytest

from dora_jax.base.turns import check_turns, model_token_mask
from dora_jax.envs import base
from dora_jax.model import transformer
from dora_jax.rollout import DecodeSlice, Engine, SamplingParams
from dora_jax.rollout import routing as routing_lib
from dora_jax.rollout.episodes import EpisodeRunner
from dora_jax.rollout.trajectory import Request, SlotOverflowError

BUDGET = 24  # response tokens of an episode: model turns and observations
MAX_TURNS = 3
OBS_LEN = 3
PROMPTS = rc.PROMPTS[:4]


class IdsTokenizer:
    """Token ids written as decimal text: the environment reads the turn's ids."""

    special_tokens = ()

    def encode(self, text):
        return [int(x) for x in text.split()]

    def decode(self, ids, *, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def observation_for(turn_ids: list, vocab: int) -> list:
    """The rule of the test environment, written out for the reference: three ids
    following the turn's last token."""
    last = turn_ids[-1]
    return [(last + 1 + k) % vocab for k in range(OBS_LEN)]


# The environment's gate: a test may hold every step until it opens.
GATE = threading.Event()
GATE.set()


@base.register("test_followers")
class Followers(base.Environment):
    max_turns = MAX_TURNS
    vocab = 128

    def reset(self, record):
        self.turns = 0
        return "go"

    def step(self, action):
        GATE.wait(30)
        self.turns += 1
        ids = [int(x) for x in action.split()]
        obs = " ".join(map(str, observation_for(ids, self.vocab)))
        return base.StepResult(obs, 0.5, False, {"turns_seen": 1})


@functools.cache
def stop_id(model: str = "dense") -> int:
    """A token the greedy policy produces early in several prompts' continuations
    (chosen from the references, not the engine), so turns end by themselves."""
    refs = rc.greedy_reference(model, rc.params(model, 0), PROMPTS, eos=-1, steps=8)
    counts = {}
    for r in refs:
        for pos, tok in enumerate(r):
            if tok != 0:
                counts.setdefault(tok, []).append(pos)
    return max(counts, key=lambda t: (len(set(counts[t])) >= 2, len(counts[t]),
                                      -np.mean(counts[t])))


@functools.cache
def engine(kind: str = "greedy", kv_cache: str = "paged", mesh_index: int = 0,
           model: str = "dense", episode_kv: str = "device", episodes: int = 0,
           batch: bool = False) -> Engine:
    base_cfg = rc.config(model).rollout
    rollout = dataclasses.replace(
        base_cfg, slots_per_slice=rc.SLOTS, max_prefill_length=rc.MAX_PROMPT,
        max_decode_len=BUDGET, prefill_buckets=(rc.MAX_PROMPT,), temperature=1.0, top_k=0,
        top_p=1.0, eos_id=stop_id(model), decode_steps=4, kv_cache=kv_cache, page_size=4,
        kv_pages=0, episode_kv=episode_kv, max_episodes_per_slice=episodes,
        batch_observations=batch)
    sampling = SamplingParams(greedy=True) if kind == "greedy" else SamplingParams(0.7)
    return Engine(rc.config(model).model, rollout, rc.meshes()[1][mesh_index],
                  sampling_params=sampling)


def make_slice(slice_id=0, kind="greedy", kv_cache="paged", mesh_index=0, version=0,
               model="dense", episode_kv="device", episodes=0, batch=False):
    runner = EpisodeRunner("test_followers", IdsTokenizer(), max_turns=MAX_TURNS,
                           timeout=30.0, workers=2, frame=([], []))
    sl = DecodeSlice(slice_id, engine(kind, kv_cache, mesh_index, model, episode_kv, episodes,
                                      batch), episodes=runner)
    sl.load_version(version, rc.params(model, 0))
    return sl


def episode_requests(version=0, record=True):
    return [Request(group_id=i, prompt_id=i, sample_index=0, prompt_tokens=p, seed=100 + i,
                    version=version, record={"prompt_id": i} if record else None)
            for i, p in enumerate(PROMPTS)]


@functools.cache
def _logits_fn():
    graphdef = transformer.create(rc.config("dense").model, 0)[0]
    return jax.jit(lambda p, x: transformer.apply(graphdef, p, x, dropless=True)[0])


def full_logits(seq: list) -> np.ndarray:
    L = rc.MAX_PROMPT + BUDGET
    x = np.zeros((1, L), np.int32)
    x[0, :len(seq)] = seq
    return np.asarray(_logits_fn()(rc.params("dense", 0), x))[0, :len(seq)]


def reference_episode(prompt: list) -> tuple[list, list]:
    """(response, turns) by full forward: greedy model turns, observations by rule."""
    seq, response, turns = list(prompt), [], []
    for turn in range(MAX_TURNS):
        start = len(response)
        while True:
            tok = int(np.argmax(full_logits(seq)[-1]))
            seq.append(tok)
            response.append(tok)
            if tok == stop_id() or len(response) >= BUDGET:
                break
        turns.append(["model", start, len(response)])
        if response[-1] != stop_id() or turn + 1 == MAX_TURNS:
            return response, turns
        obs = observation_for(response[start:], Followers.vocab)
        if len(response) + len(obs) + 1 > BUDGET:
            return response, turns
        turns.append(["env", len(response), len(response) + len(obs)])
        response += obs
        seq += obs
    return response, turns


@pytest.mark.parametrize("kv_cache,episode_kv", [("paged", "device"), ("dense", "device"),
                                                  ("paged", "host")])
def test_episodes_keep_kv_between_turns_and_equal_full_forward(kv_cache, episode_kv):
    sl = make_slice(kv_cache=kv_cache, episode_kv=episode_kv)
    for r in episode_requests():
        sl.submit(r)
    got = {t.group_id: t for t in sl.drain()}
    # Host: each observation's KV went out at the turn's end and back with the answer.
    env_calls = sum(role == "env" for t in got.values() for role, *_ in t.episode["turns"])
    assert sl.stats.kv_host_copies == (2 * env_calls if episode_kv == "host" else 0)
    assert sl.num_requests == 0 and sl.num_at_environment == 0
    multi = 0
    for i, prompt in enumerate(PROMPTS):
        want, turns = reference_episode(prompt)
        t = got[i]
        assert t.response_tokens == want
        assert [x[:3] for x in t.episode["turns"]] == turns
        assert check_turns(t.episode, len(want)) is None
        env_turns = [x for x in t.episode["turns"] if x[0] == "env"]
        multi += bool(env_turns)
        # Observation tokens carry no behaviour log-prob; model tokens do.
        mask = model_token_mask(t.episode, len(want))
        assert all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, mask) if not m)
        assert all(lp <= 0.0 for lp in t.behaviour_logprobs)
        assert t.episode["reward"] == pytest.approx(0.5 * len(env_turns) + 0.5 * (
            t.episode["end"] == "max_turns"))
        assert t.versions == [[0, len(want)]]  # C1: one version, the whole episode
    assert multi >= 2, "the references should have episodes of several turns"
    # Observations ran on kept KV: only their own tokens (and the turn's end) were
    # prefilled again, never the whole sequence.
    assert sl.stats.observation_tokens == sum(
        e - s for t in got.values() for role, s, e, *_ in t.episode["turns"] if role == "env")
    assert sl.stats.reprefill_tokens == 0


@pytest.mark.parametrize("episode_kv,episodes", [("device", 0), ("device", 2 * rc.SLOTS),
                                                 ("host", 2 * rc.SLOTS)])
def test_sampled_episode_logprobs_equal_full_forward_on_model_tokens(episode_kv, episodes):
    """Held slots, and slots released at the environment (the KV kept on the device or
    copied to host and back): behaviour log-probs equal the full forward's."""
    sl = make_slice(kind="sampled", mesh_index=1, episode_kv=episode_kv, episodes=episodes)
    reqs = [dataclasses.replace(r, group_id=r.group_id + 10 * copy)
            for copy in range(1 + bool(episodes)) for r in episode_requests()]
    for r in reqs:
        sl.submit(r)
    got = sl.drain()
    assert len(got) == len(reqs)
    if episode_kv == "host":
        assert sl.stats.kv_host_copies > 0
    for t in got:
        prompt, resp = list(t.prompt_tokens), t.response_tokens
        logits = full_logits(prompt + resp)[len(prompt) - 1:-1].astype(np.float64) / 0.7
        want = np.array([z[tok] - rc.logsumexp(z) for z, tok in zip(logits, resp)])
        mask = np.array(model_token_mask(t.episode, len(resp)), bool)
        np.testing.assert_allclose(np.array(t.behaviour_logprobs)[mask], want[mask],
                                   rtol=0, atol=2e-5)


def test_an_moe_episode_records_its_model_tokens_experts_across_turns():
    """Each model token taken as input by a decode step carries the experts a full
    forward over the whole episode chooses at its position; observation tokens and a
    turn's last token (both fed to the observation's prefill) carry none."""
    sl = make_slice(mesh_index=1, model="moe")
    for r in episode_requests():
        sl.submit(r)
    graphdef = transformer.create(rc.config("moe").model, 0)[0]
    multi = 0
    for t in sl.drain():
        P, R = len(t.prompt_tokens), len(t.response_tokens)
        seq = np.asarray([list(t.prompt_tokens) + t.response_tokens], np.int32)
        aux = transformer.apply(graphdef, rc.params("moe", 0), seq, dropless=True,
                                return_routing=True)[1]
        own = np.sort(np.asarray(aux["routing"][0, P:]), -1)
        # None: nothing recorded (every model turn here was one token, sampled by a prefill)
        has = np.zeros(R, bool) if t.routing is None else routing_lib.recorded(t.routing)
        fed_to_prefill = np.zeros(R, bool)
        for role, s, e, *_ in t.episode["turns"]:
            fed_to_prefill[s:e] = role == "env"
            fed_to_prefill[e - 1] = True
        np.testing.assert_array_equal(has, ~fed_to_prefill, err_msg=str(t.episode["turns"]))
        if has.any():
            np.testing.assert_array_equal(np.sort(t.routing[has].astype(int), -1), own[has])
        multi += any(role == "env" for role, *_ in t.episode["turns"])
    assert multi >= 1, "some episode should reach its environment"


def multi_turn_index() -> int:
    """A prompt whose reference episode has an observation."""
    return next(i for i, p in enumerate(PROMPTS)
                if any(role == "env" for role, *_ in reference_episode(p)[1]))


def step_until_at_environment(sl, limit=50):
    for _ in range(limit):
        sl.step()
        if sl.num_at_environment:
            return
    raise AssertionError("the episode never reached its environment")


def test_a_slice_decodes_other_requests_while_an_episode_waits():
    sl = make_slice()
    i = multi_turn_index()
    GATE.clear()
    try:
        sl.submit(episode_requests()[i])
        step_until_at_environment(sl)
        plain = episode_requests(record=False)[(i + 1) % len(PROMPTS)]
        sl.submit(dataclasses.replace(plain, group_id=9))
        finished, steps = [], 0
        while not finished and steps < 50:  # the episode's environment is held
            finished += sl.step()
            steps += 1
        assert [t.group_id for t in finished] == [9]
        assert sl.num_at_environment == 1 and sl.holds((i, 0))
    finally:
        GATE.set()
    (t,) = sl.drain()
    assert t.group_id == i and t.response_tokens == reference_episode(PROMPTS[i])[0]


@pytest.mark.parametrize("episode_kv", ["device", "host"])
def test_more_episodes_than_slots_fill_the_slots_their_environments_free(episode_kv):
    """Twice as many episodes as slots: while environments hold some, the others take
    their slots; every episode still equals its full-forward reference."""
    sl = make_slice(episode_kv=episode_kv, episodes=2 * rc.SLOTS, batch=True)
    reqs = [dataclasses.replace(r, group_id=r.group_id + 10 * copy)
            for copy in range(2) for r in episode_requests()]
    assert sl.num_free_slots == 2 * rc.SLOTS
    GATE.clear()
    try:
        for r in reqs:
            sl.submit(r)
        with pytest.raises(SlotOverflowError):
            sl.submit(dataclasses.replace(reqs[0], group_id=99))
        most, got = 0, []
        for _ in range(60):  # until every episode held is at its (held) environment
            got += sl.step()
            assert sl.num_running <= rc.SLOTS
            most = max(most, sl.num_running + sl.num_at_environment)
            if sl.num_requests == sl.num_at_environment:
                break
        assert most > rc.SLOTS, "episodes at their environments should free their slots"
    finally:
        GATE.set()
    got += sl.drain()
    assert sorted(t.group_id for t in got) == sorted(r.group_id for r in reqs)
    # The answers held until then arrive together: their observations share a prefill.
    assert sl.stats.observation_batches >= 1 and sl.stats.observations_batched >= 2
    for t in got:
        assert t.response_tokens == reference_episode(PROMPTS[t.group_id % 10])[0]


def test_a_request_moved_into_a_slice_whose_slots_are_taken_waits_and_goes_on():
    """A slice holding more than its slots: a running request moved in while every
    slot decodes waits with its KV and continues as it would have (its last token run
    on the kept KV)."""
    src = make_slice(0, mesh_index=0)
    dst = make_slice(1, mesh_index=1, episodes=2 * rc.SLOTS)
    refs = rc.greedy_reference("dense", rc.params("dense", 0), PROMPTS, eos=stop_id())
    i = max(range(len(PROMPTS)), key=lambda j: len(refs[j]))
    assert len(refs[i]) > 6
    req = episode_requests(record=False)[i]
    src.submit(req)
    src.step()
    (moved,) = src.export_requests([req.request_id])
    assert moved.prefix is not None
    fillers = [dataclasses.replace(r, group_id=20 + r.group_id, record=None)
               for r in episode_requests()]
    for r in fillers:
        dst.submit(r)
    dst.step()
    assert dst.slots.full
    dst.import_requests([moved])
    assert dst.holds(req.request_id) and dst.num_running == rc.SLOTS
    got = {t.group_id: t for t in dst.drain()}
    assert got[i].response_tokens[:len(refs[i])] == refs[i] and got[i].slice_ids == [0, 1]
    assert dst.stats.reprefill_tokens == 0  # one token run again, on the kept KV


def test_an_episode_migrates_between_turns_with_its_kv():
    """Exported while its environment still works on its turn: the destination takes
    the kept KV and the pending call, and the episode goes on there."""
    src, dst = make_slice(0, mesh_index=0), make_slice(1, mesh_index=1)
    i = multi_turn_index()
    req = episode_requests()[i]
    GATE.clear()
    try:
        src.submit(req)
        step_until_at_environment(src)
        (moved,) = src.export_requests([req.request_id])
        assert moved.kept is not None and moved.env_call is not None
        assert not src.holds(req.request_id) and src.idle
        dst.import_requests([moved])
        assert dst.num_at_environment == 1
    finally:
        GATE.set()
    (t,) = dst.drain()
    want, turns = reference_episode(PROMPTS[i])
    assert t.response_tokens == want and [x[:3] for x in t.episode["turns"]] == turns
    assert t.slice_ids == [0, 1] and t.versions == [[0, len(want)]]
    assert dst.stats.reprefill_tokens == 0  # the kept KV moved, nothing recomputed


def test_partial_rollout_reload_between_turns_mixes_versions():
    sl = make_slice()
    GATE.clear()
    try:
        i = multi_turn_index()
        sl.submit(episode_requests()[i])
        step_until_at_environment(sl)
        sl.interrupt_and_reload(1, rc.params("dense", 0))  # same weights, next version
    finally:
        GATE.set()
    (t,) = sl.drain()
    assert [v for v, _ in t.versions] == [0, 1]
    # Same weights: the re-prefilled continuation decodes as the reference does.
    assert t.response_tokens == reference_episode(PROMPTS[i])[0]


def test_an_environment_that_raises_ends_its_episode_with_the_reason(monkeypatch):
    def broken(self, action):
        raise RuntimeError("tool exploded")

    monkeypatch.setattr(Followers, "step", broken)
    sl = make_slice()
    sl.submit(episode_requests()[1])
    (t,) = sl.drain()
    assert t.episode["end"] == "env_error" and "tool exploded" in t.episode["error"]
    assert t.episode["reward"] == 0.0 and sl.num_requests == 0


@base.register("test_async_followers")
class AsyncFollowers(Followers):
    """The same rule with a coroutine `step`: run to completion off the slice."""

    async def step(self, action):
        import asyncio

        await asyncio.sleep(0.001)
        return Followers.step(self, action)


def test_an_async_environment_gives_the_same_episodes():
    runner = EpisodeRunner("test_async_followers", IdsTokenizer(), max_turns=MAX_TURNS,
                           workers=2, frame=([], []))
    sl = DecodeSlice(0, engine(), episodes=runner)
    sl.load_version(0, rc.params("dense", 0))
    for r in episode_requests():
        sl.submit(r)
    for t in sl.drain():
        assert t.response_tokens == reference_episode(PROMPTS[t.group_id])[0]


def test_an_environment_past_its_timeout_ends_its_episode():
    runner = EpisodeRunner("test_followers", IdsTokenizer(), max_turns=MAX_TURNS,
                           timeout=0.2, workers=1, frame=([], []))
    sl = DecodeSlice(0, engine(), episodes=runner)
    sl.load_version(0, rc.params("dense", 0))
    i = multi_turn_index()
    GATE.clear()  # the environment never answers in time
    try:
        sl.submit(episode_requests()[i])
        (t,) = sl.drain()
    finally:
        GATE.set()
    assert t.episode["end"] == "env_timeout" and t.episode["reward"] == 0.0
    assert t.episode["env_s"] >= 0.2
