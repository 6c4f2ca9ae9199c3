"""Adversarial scoring benchmark: hostile responses through the run's own scoring path.

    python -m dora_jax.bench.adversarial [--responses=FILE.jsonl] [--timeout=5]
        [--workers=2] [--memory_mb=2048] [--max_response=1048576]

Scores the shipped corpus (bench/adversarial_corpus.py: code payloads for every
verifier, numeric and LaTeX bombs, pathological regex inputs, megabyte responses,
digits of other scripts), plus the cases of FILE.jsonl if given, with
`rewards.pool.RewardPool` and `verifiers.record_reward`: the pool a run
scores with, under the same limits (`--timeout` stands for
coordinator.reward_timeout). A FILE.jsonl line is `{"record": {...}, "text": "..."}`,
scored by `record["verifier"]`; `{sentinel}` in a text becomes a path that only
code execution creates.

Once the pool's workers are up (a run starts its pool before rollout), responses go
to it at most `workers` at a time, so a response's seconds are its own scoring (or
its timeout, and the replacement of a killed worker), not a queue. Meanwhile a thread
of this process wakes every 10 ms and records its longest extra wait: a stall of the
caller, which in a run is the coordinator. The last line is

    responses: N, code executed: C, nonzero rewards: Z, max score seconds: S,
    max coordinator stall seconds: T

(on one line). C counts responses whose sentinel exists afterwards or whose scoring
attempted an operation the workers block (a process start, a file write, ...).
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time

from absl import app, flags

_RESPONSES = flags.DEFINE_string("responses", None, "JSONL of more cases: "
                                 '{"record": {...}, "text": "..."} per line')
_TIMEOUT = flags.DEFINE_float("timeout", 5.0, "seconds a reward call may run "
                              "(coordinator.reward_timeout)")
_WORKERS = flags.DEFINE_integer("workers", 2, "reward worker processes")
_MEMORY = flags.DEFINE_integer("memory_mb", 2048, "MiB a worker may grow "
                               "(coordinator.reward_memory_mb)")
_MAX_RESPONSE = flags.DEFINE_integer("max_response", 1 << 20, "longest response "
                                     "scored (coordinator.reward_max_response)")


def read_cases(path: str) -> list[dict]:
    """Cases of a JSONL file; a bad line raises ValueError naming `path:line`."""
    from dora_jax.data.prompts import jsonl_objects

    cases = []
    for where, _, case in jsonl_objects(path):
        if not isinstance(case.get("record"), dict) or not isinstance(case.get("text"), str):
            raise ValueError(f'{where}: expected {{"record": {{...}}, "text": "..."}}')
        cases.append({"record": case["record"], "text": case["text"],
                      "kind": case.get("kind", os.path.basename(path))})
    return cases


class StallMeter:
    """A thread that wakes every 10 ms and records its longest extra wait."""

    def __init__(self, period: float = 0.01):
        self.worst, self._period = 0.0, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-meter", daemon=True)

    def _run(self):
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(self._period)
            now = time.perf_counter()
            self.worst, last = max(self.worst, now - last - self._period), now

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def score_all(cases: list[dict], pool, workers: int, sentinels: str) -> list[dict]:
    """Scores every case through `pool`, at most `workers` in flight; each result
    has the case's kind, reward, error, seconds and whether code ran."""
    slots = threading.Semaphore(workers)
    results: list[dict] = [{} for _ in cases]
    done = threading.Event()
    left = [len(cases)]
    lock = threading.Lock()

    def finish(i, sentinel, start, future):
        reward, error = future.result()
        ran = os.path.exists(sentinel) or "blocked" in (error or "")
        results[i] = {"kind": cases[i]["kind"], "reward": reward, "error": error,
                      "seconds": time.perf_counter() - start, "code_executed": ran}
        slots.release()
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    for i, case in enumerate(cases):
        sentinel = os.path.join(sentinels, f"case-{i}")
        text = case["text"].replace("{sentinel}", sentinel)
        slots.acquire()
        start = time.perf_counter()
        future = pool.submit(case["record"], text)
        future.add_done_callback(lambda f, i=i, s=sentinel, t=start: finish(i, s, t, f))
    if cases:
        done.wait()
    return results


def summary_line(results: list[dict], stall: float) -> str:
    return (f"responses: {len(results)}, "
            f"code executed: {sum(r['code_executed'] for r in results)}, "
            f"nonzero rewards: {sum(r['reward'] != 0 for r in results)}, "
            f"max score seconds: {max((r['seconds'] for r in results), default=0):.2f}, "
            f"max coordinator stall seconds: {stall:.3f}")


def _table(results: list[dict]) -> list[str]:
    by_kind = collections.defaultdict(list)
    for r in results:
        by_kind[r["kind"]].append(r)
    lines = [f"{'kind':32s} {'n':>5s} {'code':>5s} {'nonzero':>8s} {'timeouts':>9s} "
             f"{'max s':>7s}"]
    for kind, rs in sorted(by_kind.items()):
        timeouts = sum("timed out" in (r["error"] or "") for r in rs)
        lines.append(f"{kind:32s} {len(rs):5d} {sum(r['code_executed'] for r in rs):5d} "
                     f"{sum(r['reward'] != 0 for r in rs):8d} {timeouts:9d} "
                     f"{max(r['seconds'] for r in rs):7.2f}")
    return lines


def main(argv):
    del argv
    from dora_jax.bench import adversarial_corpus
    from dora_jax.rewards import verifiers
    from dora_jax.rewards.pool import RewardPool

    cases = adversarial_corpus.cases()
    if _RESPONSES.value:
        try:
            cases += read_cases(_RESPONSES.value)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
    pool = RewardPool(verifiers.record_reward, _WORKERS.value, _TIMEOUT.value,
                      memory_mb=_MEMORY.value, max_response=_MAX_RESPONSE.value)
    try:
        # A run starts its pool before rollout: start-up is not scoring.
        warm = {"prompt_id": "warm", "verifier": "gsm8k", "answer": "1"}
        for f in [pool.submit(warm, "#### 1") for _ in range(_WORKERS.value)]:
            f.result()
        with tempfile.TemporaryDirectory(prefix="dora_adversarial_") as sentinels:
            with StallMeter() as meter:
                results = score_all(cases, pool, _WORKERS.value, sentinels)
    finally:
        pool.close()
    print("\n".join(_table(results)))
    for r, case in zip(results, cases):
        if r["code_executed"] or r["reward"] != 0:
            print(f"  {r['kind']}: reward {r['reward']}, {r['error']}: {case['text'][:80]!r}")
    print(summary_line(results, meter.worst))


if __name__ == "__main__":
    app.run(main)
