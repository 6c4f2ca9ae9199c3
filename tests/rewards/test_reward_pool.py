"""The reward pool scores in killable worker processes: a hung, hungry or hostile
reward scores 0 with its reason, the caller's threads never stall, and closing never
waits on a hung call. Reward functions live at module level: workers import them."""

import os
import time

import pytest

from dora_jax.bench.adversarial import StallMeter
from dora_jax.rewards.pool import RewardPool


def length_or_explode(record, response):
    if record.get("explode"):
        raise RuntimeError("bad verifier")
    return float(len(response))


def sleepy(record, response):
    time.sleep(record.get("sleep", 0))
    return 1.0


def big_integer(record, response):
    return float(9 ** (9 ** 9) > 0)  # minutes of GIL-holding work


def hungry(record, response):
    return float(len(bytearray(record["bytes"])))


def shell(record, response):
    os.system(f"touch {record['path']}")
    return 1.0


def writer(record, response):
    with open(record["path"], "w") as f:
        f.write("x")
    return 1.0


def not_a_number(record, response):
    return float("nan")


def dies(record, response):
    if record.get("die"):
        os._exit(3)
    return 1.0


def _counting_calls(pool) -> list:
    """The worker calls `pool` makes from now on, by function name."""
    calls, schedule = [], pool._pool.schedule

    def counted(fn, *args, **kwargs):
        calls.append(fn.__name__)
        return schedule(fn, *args, **kwargs)
    pool._pool.schedule = counted
    return calls


def test_failures_are_recorded_and_the_pool_goes_on():
    with RewardPool(length_or_explode, num_workers=2) as pool:
        ok = pool.submit({}, [1, 2, 3])
        bad = pool.submit({"explode": True}, [1])
        assert ok.result(60) == (3.0, None)
        reward, error = bad.result(60)
        assert reward == 0.0 and error == "RuntimeError: bad verifier"


def test_a_call_past_the_timeout_is_killed_and_its_worker_replaced():
    with RewardPool(sleepy, num_workers=1, timeout=1.0) as pool:
        pool.submit({}, [1]).result(60)  # the worker is up
        start = time.perf_counter()
        hung = pool.submit({"sleep": 30}, [1])
        assert hung.result(60) == (0.0, "reward timed out after 1 s (worker killed)")
        assert time.perf_counter() - start < 3
        # The one worker was killed; a new one scores the next call.
        assert pool.submit({}, [1]).result(60) == (1.0, None)


def test_big_integer_work_neither_stalls_the_caller_nor_outlives_the_timeout():
    with RewardPool(big_integer, num_workers=1, timeout=1.0) as pool:
        with StallMeter() as ticker:
            start = time.perf_counter()
            reward, error = pool.submit({}, [1]).result(60)
            took = time.perf_counter() - start
    assert reward == 0.0 and "timed out" in error
    assert took < 1.0 + 5  # the limit, plus a worker's start on a loaded machine
    assert ticker.worst < 0.1, ticker.worst


def test_a_call_past_the_memory_cap_scores_zero():
    with RewardPool(hungry, num_workers=1, memory_mb=256) as pool:
        assert pool.submit({"bytes": 1 << 20}, [1]).result(60) == (float(1 << 20), None)
        reward, error = pool.submit({"bytes": 4 << 30}, [1]).result(60)
    assert reward == 0.0 and "memory" in error


@pytest.mark.parametrize("fn, event", [(shell, "os.system"), (writer, "open")])
def test_process_starts_and_file_writes_are_blocked(tmp_path, fn, event):
    path = tmp_path / "pwned"
    with RewardPool(fn, num_workers=1) as pool:
        reward, error = pool.submit({"path": str(path)}, [1]).result(60)
    assert reward == 0.0 and event in error and "blocked" in error
    assert not path.exists()


def test_a_response_over_the_cap_is_not_scored():
    with RewardPool(length_or_explode, num_workers=1, max_response=4) as pool:
        assert pool.submit({}, [1, 2, 3, 4]).result(60) == (4.0, None)
        reward, error = pool.submit({}, [1] * 5).result(60)
    assert reward == 0.0 and "reward_max_response=4" in error


def test_a_non_finite_reward_scores_zero():
    with RewardPool(not_a_number, num_workers=1) as pool:
        reward, error = pool.submit({}, [1]).result(60)
    assert reward == 0.0 and "nan" in error


def test_closing_never_waits_on_a_hung_call():
    pool = RewardPool(sleepy, num_workers=1, timeout=0)  # no limit: only close stops it
    hung = pool.submit({"sleep": 60}, [1])
    queued = pool.submit({}, [1])
    time.sleep(0.5)
    start = time.perf_counter()
    pool.close()
    assert time.perf_counter() - start < 10
    assert hung.result(1)[0] == 0.0 and queued.result(1)[0] == 0.0


def test_samples_that_finish_together_take_one_call_per_worker_and_score_as_alone():
    items = [({}, [1, 2, 3]), ({"explode": True}, [1]), ({}, [1] * 5), ({}, [1, 2]),
             ({}, []), ({}, [4, 4, 4, 4])]
    with RewardPool(length_or_explode, num_workers=2, max_response=4) as pool:
        alone = [pool.submit(*item).result(60) for item in items]
        calls = _counting_calls(pool)
        together = [f.result(60) for f in pool.submit_many(items)]
    assert together == alone
    assert alone[1] == (0.0, "RuntimeError: bad verifier") and "reward_max_response" in alone[2][1]
    assert calls == ["_score_many"] * 2  # 5 to score (one refused unscored), 2 workers


def test_a_sample_that_hangs_a_shared_call_times_out_alone_and_calls_go_single():
    with RewardPool(sleepy, num_workers=1, timeout=1.0) as pool:
        pool.submit({}, [1]).result(60)  # the worker is up
        got = [f.result(60) for f in pool.submit_many([({}, [1]), ({"sleep": 30}, [1]),
                                                       ({}, [2])])]
        assert got == [(1.0, None), (0.0, "reward timed out after 1 s (worker killed)"),
                       (1.0, None)]
        # The samples' total can pass the limit each keeps: one sample per call now.
        calls = _counting_calls(pool)
        assert [f.result(60) for f in pool.submit_many([({}, [1])] * 3)] == [(1.0, None)] * 3
        assert calls == ["_score"] * 3


def test_a_sample_that_kills_a_shared_call_s_worker_is_the_only_one_to_score_zero():
    with RewardPool(dies, num_workers=1) as pool:
        got = [f.result(60) for f in pool.submit_many([({}, [1]), ({"die": True}, [1]),
                                                       ({}, [2])])]
        assert got[0] == got[2] == (1.0, None)
        assert got[1][0] == 0.0 and "exit code 3" in got[1][1]
        calls = _counting_calls(pool)
        pool.submit_many([({}, [1])] * 2)[1].result(60)
        assert calls == ["_score_many"]  # a death is the sample's, not the batch size's
