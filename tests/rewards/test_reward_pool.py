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
