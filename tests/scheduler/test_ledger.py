"""The ledger auditor catches each kind of violation, and passes a clean ledger."""

import copy

from dora_jax.scheduler import ledger


def _sample(i, version, n=3, finish="eos"):
    return {"sample": i, "versions": [[version, n]], "slices": [0], "response_len": n,
            "finish": finish, "reward": 0.5}


def _clean():
    # TBS=2, G=2, K=1: steps 0 and 1, groups 0..3; group 4 still in flight at exit.
    ev = [{"event": "admit", "group_id": g, "prompt_id": f"p{g}", "version": v, "time": 0.0}
          for g, v in [(0, 0), (1, 0), (2, 0), (3, 1), (4, 1)]]
    for g, v, step in [(0, 0, 0), (1, 0, 0), (2, 0, 1), (3, 1, 1)]:
        ev.append({"event": "consume", "group_id": g, "prompt_id": f"p{g}", "version": v,
                   "step": step, "time": 1.0, "samples": [_sample(0, v), _sample(1, v)]})
    ev.append({"event": "unconsumed", "group_id": 4, "version": 1})
    return ev


def _audit(events, k=1):
    return ledger.audit(events, train_batch_size=2, group_size=2, max_staleness=k,
                        max_decode_len=8)


def test_clean_ledger_passes(tmp_path):
    path = tmp_path / "ledger.jsonl"
    writer = ledger.LedgerWriter(str(path))
    for e in _clean():
        writer.write(e.pop("event"), **e)
    writer.close()
    report = _audit(ledger.read(str(path)))
    assert report.ok, report.summary()
    assert report.steps == 2 and report.groups_consumed == 4 and report.groups_admitted == 5
    assert report.staleness == {0: 3, 1: 1}  # only group 2 (v0 at step 1) is stale


def test_each_violation_is_caught():
    ev = _clean()
    ev[6]["samples"][0]["versions"] = [[0, 2], [1, 1]]  # mixed versions: C1
    assert _audit(ev).c1 and not _audit(ev).c2

    ev = _clean()
    assert _audit(ev, k=0).c3  # group 2 (v0) at step 1 exceeds K=0

    ev = _clean()
    ev.append(copy.deepcopy(ev[5]))  # consumed twice: C2 and a 3-group step
    report = _audit(ev)
    assert any("consumed 2 times" in v for v in report.c2) and report.batch_size

    ev = [e for e in _clean() if e["event"] != "unconsumed"]  # group 4 lost: C2
    assert any("group 4" in v for v in _audit(ev).c2)

    ev = _clean()
    ev[5]["samples"] = ev[5]["samples"][:1]  # incomplete group: C2
    assert _audit(ev).c2

    ev = _clean()
    ev[5]["samples"][0].update(finish="length", response_len=3)  # truncated early: C2
    assert any("truncated" in v for v in _audit(ev).c2)

    ev = _clean()
    ev[-1] = {"event": "filter", "group_id": 4, "reason": ""}  # a filter needs a reason
    assert _audit(ev).c2
    ev[-1]["reason"] = "zero-variance rewards"
    assert _audit(ev).ok


def test_segments_split_at_resumes_and_count_the_steps_that_stand():
    """A second process resumes at step 1: the first's step 1 is void (trained again),
    its time counts to its last line; each segment on its own clock."""
    second = [{"event": "resume", "step": 1, "time": 0.2}]
    for g, v in [(2, 1), (3, 1)]:
        second.append({"event": "admit", "group_id": g, "prompt_id": f"p{g}", "version": v,
                       "time": 0.5, "readmit": True})
    for g, step in [(2, 1), (3, 1), (4, 2), (5, 2)]:
        second.append({"event": "consume", "group_id": g, "version": 1, "step": step,
                       "time": 3.0 + step, "samples": [_sample(0, 1), _sample(1, 1)]})
    assert ledger.segments(_clean() + second) == [
        {"from_step": 0, "steps": 1, "wall_seconds": 1.0},
        {"from_step": 1, "steps": 2, "wall_seconds": 5.0}]
    assert ledger.segments(_clean()) == [{"from_step": 0, "steps": 2, "wall_seconds": 1.0}]
