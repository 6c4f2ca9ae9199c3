"""MoE routing recorded by the decode slices (rollout/routing.py): each response token
carries the experts of the step that took it as input, the experts a full forward
over the sequence chooses at its position (float32), through lookahead, preemption
and migration; the record survives a checkpoint's JSON form."""

import json

import _rollout_common as rc
import numpy as np
import pytest

from dora_jax.model import transformer
from dora_jax.rollout import Request, Trajectory
from dora_jax.rollout import routing as routing_lib


def _requests(group_size=2):
    return [Request(group_id=i, prompt_id=i, sample_index=k, prompt_tokens=q,
                    seed=1000 * i + k, version=0)
            for i, q in enumerate(rc.PROMPTS[:4]) for k in range(group_size)]


def _full_forward_routing(t: Trajectory, seed: int = 0) -> np.ndarray:
    cfg = rc.config("moe").model
    graphdef = transformer.create(cfg, 0)[0]
    seq = np.asarray([list(t.prompt_tokens) + list(t.response_tokens)], np.int32)
    _, aux, _ = transformer.apply(graphdef, rc.params("moe", seed), seq, dropless=True,
                                  return_routing=True)
    return np.asarray(aux["routing"][0])


def _check(t: Trajectory, seed: int = 0, tokens: slice = slice(None)) -> int:
    """Asserts every record (of the response's `tokens`) equals the full forward's
    experts at the token's position under params `seed`; returns how many tokens before
    the last have none."""
    P, R = len(t.prompt_tokens), len(t.response_tokens)
    assert t.routing is not None and t.routing.shape[0] == R
    own = _full_forward_routing(t, seed)
    has = routing_lib.recorded(t.routing)
    in_range = np.zeros(R, bool)
    in_range[tokens] = True
    has &= in_range
    assert not has[-1]  # the last token was never an input
    idx = np.flatnonzero(has)
    np.testing.assert_array_equal(np.sort(t.routing[idx].astype(int), -1),
                                  np.sort(own[P + idx], -1), err_msg=str(t.request_id))
    # Shifted by one token, the records would be another position's experts.
    if len(idx) > 1:
        assert not np.array_equal(np.sort(t.routing[idx].astype(int), -1),
                                  np.sort(own[P + idx + 1], -1))
    return int((~has[:-1] & in_range[:-1]).sum())


@pytest.mark.parametrize("kv_pages,window", [(0, None), (8, None), (0, 1)])
def test_each_token_records_the_experts_its_full_forward_uses(kv_pages, window, monkeypatch):
    """Groups of 2, more requests than slots, lookahead; with 8 pages requests are
    preempted and resumed by a re-prefill (whose last token before it has no record);
    a slot's routing window of one call's steps is written out at every call."""
    if window is not None:
        monkeypatch.setattr("dora_jax.rollout.slice.ROUTING_WINDOW", window)
    sl = rc.make_slice(0, "moe", "sampled", 0, kv_pages=kv_pages)
    if window is not None:
        assert sl.slots.routing_window == sl.engine.decode_steps < rc.config(
            "moe").rollout.max_decode_len
    reqs, got = _requests(), {}
    while reqs or sl.num_requests:
        while reqs and sl.num_free_slots:
            sl.submit(reqs.pop(0))
        got.update({t.request_id: t for t in sl.step()})
    assert len(got) == 8
    unrecorded = sum(_check(t) for t in got.values())
    assert unrecorded <= sl.stats.preempted
    if kv_pages:
        assert sl.stats.preempted > 0


def test_records_move_with_a_migrated_request():
    src = rc.make_slice(1, "moe", "sampled", 1, kv_cache="dense")
    dst = rc.make_slice(2, "moe", "sampled", 2, kv_cache="dense")
    reqs = _requests(group_size=1)
    for r in reqs:
        src.submit(r)
    for _ in range(2):
        src.step()
    moving = src.export_requests([reqs[0].request_id, reqs[1].request_id])
    assert all(f.routing is not None for f in moving if len(f.response_tokens) > 1)
    dst.import_requests(moving)
    got = {t.request_id: t for t in src.drain() + dst.drain()}
    assert {got[r.request_id].slice_ids[-1] for r in reqs[:2]} == {2}
    for t in got.values():
        assert _check(t) == 0


def test_partial_rollout_keeps_each_token_s_record_from_the_version_that_sampled_it():
    """A reload mid-response: tokens taken as input under v0 keep v0's experts (the
    re-prefill under v1 records nothing), later ones carry v1's; the last token before
    the reload fed only the re-prefill, so it alone has none."""
    sl = rc.make_slice(0, "moe", "sampled", 0, decode_steps=1)
    sl.submit(_requests(group_size=1)[0])
    for _ in range(4):
        sl.step()
    m = 5  # tokens so far: 1 from prefill + 4 generate steps
    sl.interrupt_and_reload(1, rc.params("moe", 1))
    (t,) = sl.drain()
    assert t.versions[0] == [0, m] and t.versions[1][0] == 1
    has = routing_lib.recorded(t.routing)
    assert has[:m - 1].all() and not has[m - 1]
    assert _check(t, seed=0, tokens=slice(0, m)) == 1
    assert _check(t, seed=1, tokens=slice(m, None)) == 0
    # Each half differs from the other version's experts: the records are not both v0's.
    own0, P = _full_forward_routing(t, 0), len(t.prompt_tokens)
    tail = np.flatnonzero(has[m:]) + m
    assert not np.array_equal(np.sort(t.routing[tail].astype(int), -1),
                              np.sort(own0[P + tail], -1))
    sl.load_version(0, rc.params("moe", 0))


def test_a_record_survives_the_checkpoint_form():
    sl = rc.make_slice(3, "moe", "sampled", 3, kv_cache="dense")
    sl.submit(_requests(group_size=1)[0])
    (t,) = sl.drain()
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.routing.dtype == t.routing.dtype
    np.testing.assert_array_equal(back.routing, t.routing)
    assert back == t


def test_a_dense_model_records_nothing():
    sl = rc.make_slice(0, "dense", "sampled", 0, kv_cache="dense")
    sl.submit(_requests(group_size=1)[0])
    (t,) = sl.drain()
    assert t.routing is None and t.to_dict()["routing"] is None


def _routing_call(table, steps_by_slot: dict, experts: list) -> None:
    """A generate call's host results: {slot: [its steps]}, step n's experts experts[n]."""
    from dora_jax.rollout.state import ResultTokens
    n = max(len(s) for s in steps_by_slot.values())
    data = np.zeros((n, len(table), 6), np.int32)
    routing = np.zeros((n, len(table), 1, 2), np.uint8)
    for slot, steps in steps_by_slot.items():
        for i, step in enumerate(steps):
            data[i, slot, 3], data[i, slot, 4] = step + 1, 1  # length, valid
            routing[i, slot] = experts[i]
    table.record_call(ResultTokens(data, routing=routing))


class _Seq:
    slot, response_tokens, behaviour_logprobs = None, [9, 9], [0.0, 0.0]

    def __init__(self, routing=None):
        self.routing = routing


def test_a_call_adds_each_slots_run_to_its_holders_record():
    """Worked by hand: slot 1's holder arrives with tokens 0-1 recorded (migrated);
    two calls of two steps report tokens 1-3 of slot 1 and token 0 of slot 0 (which
    finished after one step). Token 1 keeps the record it came with. The records
    reach the holders when their slots are freed, not before."""
    from dora_jax.rollout.slots import SlotTable

    table = SlotTable(3, 8)
    migrated, fresh = _Seq(np.array([[[1, 1]], [[2, 2]]], np.uint8)), _Seq()
    fresh.response_tokens, fresh.behaviour_logprobs = [9], [0.0]
    table.place(migrated, 1, prompt_len=4, written=6)
    table.place(fresh, 0, prompt_len=4, written=5)
    _routing_call(table, {1: [2, 3], 0: [1]}, experts=[7, 8])  # slot 1 tokens 1, 2; 0: 0
    _routing_call(table, {1: [4]}, experts=[6])                # slot 1 token 3
    assert fresh.routing is None and migrated.routing.shape[0] == 2
    table.free(1)
    table.free(0)
    assert routing_lib.cut(migrated.routing, 5)[:, 0, 0].tolist() == [1, 2, 8, 6, 255]
    assert routing_lib.cut(fresh.routing, 2)[:, 0, 0].tolist() == [7, 255]


def test_a_full_window_or_a_re_placed_holder_writes_the_record_first():
    """A window of 4 tokens: calls of 3 steps fill it; the run that does not fit
    writes the first four to the record. A holder placed again in its slot (re-
    prefilled under new params) keeps them, and the next holder starts empty."""
    from dora_jax.rollout.slots import SlotTable

    table, seq, nxt = SlotTable(2, 16, routing_window=4), _Seq(), _Seq()
    seq.response_tokens, seq.behaviour_logprobs = [9], [0.0]
    table.place(seq, 1, prompt_len=4, written=5)
    _routing_call(table, {1: [1, 2, 3]}, experts=[1, 2, 3])  # tokens 0-2
    assert seq.routing is None
    _routing_call(table, {1: [4, 5, 6]}, experts=[4, 5, 6])  # tokens 3-5: token 3 fits no more
    assert routing_lib.cut(seq.routing, 6)[:, 0, 0].tolist() == [1, 2, 3, 255, 255, 255]
    table.place(seq, 1, prompt_len=4, written=11)
    assert routing_lib.cut(seq.routing, 7)[:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 255]
    _routing_call(table, {1: [7]}, experts=[7])
    table.free(1)
    table.place(nxt, 1, prompt_len=4, written=6)
    table.free(1)
    assert routing_lib.cut(seq.routing, 8)[:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 255]
    assert nxt.routing is None


def test_put_keeps_the_first_record_and_grows_unrecorded():
    rows = np.array([[[1, 2]], [[3, 4]]], np.uint8)
    buf = routing_lib.put(None, 2, rows)
    assert buf.shape[0] >= 4 and routing_lib.recorded(buf)[:4].tolist() == [
        False, False, True, True]
    buf = routing_lib.put(buf, 3, np.array([[[7, 7]], [[5, 6]]], np.uint8))
    assert buf[2].tolist() == [[1, 2]] and buf[3].tolist() == [[3, 4]]
    assert buf[4].tolist() == [[5, 6]]
    buf = routing_lib.put(buf, 19, rows)
    assert buf.shape[0] >= 21 and buf[20].tolist() == [[3, 4]]


def test_a_record_is_cut_to_its_response_and_refuses_a_malformed_form():
    buf = routing_lib.unrecorded((21, 1, 2), np.uint8)
    buf[20] = 5
    cut = routing_lib.cut(buf, 40)
    assert cut.shape[0] == 40 and not routing_lib.recorded(cut)[21:].any()
    with pytest.raises(ValueError, match="does not match"):
        routing_lib.from_json({"dtype": "uint8", "shape": [2, 1, 2], "data": "AAA="})
