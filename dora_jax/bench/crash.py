"""Crash benchmark: kill the main job with SIGKILL at random points and resume it with
the same command, again and again, then audit the whole ledger.

    python -m dora_jax.bench.crash --config=configs/tiny.py --kills=20 \\
        --config.coordinator.num_steps=400 [--workdir=/tmp/dora_crash] \\
        [--startup_kills=0.25] [--max_delay=2] [--seed=0]

Each round starts `python -m dora_jax.main --config=... --workdir=...` (the same
command every time; the first round with --fresh) and kills it with SIGKILL: in a
`startup_kills` share of the rounds (chosen at random) during start-up (compilation,
restore) at a time drawn from [1, 10] s, in the others once the ledger has grown, after a further
delay drawn from [0, max_delay] s: while decoding, in a train step or in a checkpoint
save, wherever it falls. After the kills the command runs to the end. The run must
be long enough to take every kill (a run that finishes first stops the benchmark
with a message saying so). The ledger is audited by the project's auditor (after
every resume's voiding) and the last line is

    kills: N, lost groups: L, duplicated groups: D, steps: S/S

L: admitted groups neither consumed, filtered nor listed unconsumed at the exit; D:
groups consumed more than once; S: steps consumed with exactly TBS groups.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "the run's config")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/dora_crash", "the run's workdir")
_KILLS = flags.DEFINE_integer("kills", 20, "SIGKILLs before the run is let finish")
_STARTUP = flags.DEFINE_float("startup_kills", 0.25, "fraction of kills during start-up")
_MAX = flags.DEFINE_float("max_delay", 2.0, "longest time a run goes on once it has "
                          "written to the ledger before it is killed (s)")
_SEED = flags.DEFINE_integer("seed", 0, "draws the kill times")


def _overrides(argv_flags: list) -> list:
    """The --config.x=y overrides given to this command, passed on to main."""
    return [a for a in argv_flags if a.startswith("--config.")]


def count(events: list, train_batch_size: int) -> dict:
    """Lost and duplicated groups and complete steps over the ledger's standing events."""
    from dora_jax.scheduler import ledger

    events = ledger.standing(events)
    admitted = {e["group_id"] for e in events if e["event"] == "admit"}
    consumed = collections.Counter(e["group_id"] for e in events if e["event"] == "consume")
    other = {e["group_id"] for e in events if e["event"] in ("filter", "unconsumed")}
    per_step = collections.Counter(e["step"] for e in events if e["event"] == "consume")
    return dict(lost=len(admitted - set(consumed) - other),
                duplicated=sum(n > 1 for n in consumed.values()),
                steps=sum(n == train_batch_size for n in per_step.values()))


def main(argv):
    del argv
    from dora_jax.model import hf_checks
    from dora_jax.scheduler import SchedulerConfig, ledger

    cfg = hf_checks.validated(_CONFIG.value)
    config_arg = next(a for a in sys.argv if a.startswith("--config="))
    cmd = [sys.executable, "-m", "dora_jax.main", config_arg, f"--workdir={_WORKDIR.value}",
           *_overrides(sys.argv[1:])]
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count="
                                f"{cfg.mesh.total_devices}")
    rng = random.Random(_SEED.value)
    shutil.rmtree(_WORKDIR.value, ignore_errors=True)  # the benchmark's own workdir
    os.makedirs(_WORKDIR.value)
    log = os.path.join(_WORKDIR.value, "crash_round.log")
    ledger_path = os.path.join(_WORKDIR.value, "ledger.jsonl")
    size = lambda: os.path.getsize(ledger_path) if os.path.exists(ledger_path) else 0  # noqa
    # Which kills fall in start-up: a fixed share, at random rounds.
    startups = set(rng.sample(range(_KILLS.value), round(_STARTUP.value * _KILLS.value)))
    kills = rounds = 0
    while kills < _KILLS.value:
        before = size()
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd + (["--fresh"] if rounds == 0 else []), env=env,
                                    stdout=subprocess.DEVNULL, stderr=err)
        rounds += 1
        start = time.perf_counter()
        startup = kills in startups
        delay = rng.uniform(1.0, 10.0) if startup else rng.uniform(0.0, _MAX.value)
        if not startup:  # wait for the run to write to its ledger
            while proc.poll() is None and size() <= before:
                time.sleep(0.05)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        else:
            if proc.returncode:
                raise SystemExit(f"round {rounds}: main failed:\n{open(log).read()[-3000:]}")
            raise SystemExit(f"the run finished after {kills} kills: raise "
                             "--config.coordinator.num_steps for more")
        kills += 1
        print(f"kill {kills}: {'start-up' if startup else 'running'}, after "
              f"{time.perf_counter() - start:.1f}s", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"final run failed:\n{done.stderr[-3000:]}")
    print(f"final run: {time.perf_counter() - start:.1f}s")
    events = ledger.read(os.path.join(_WORKDIR.value, "ledger.jsonl"))
    report = ledger.audit_run(events, SchedulerConfig.from_config(cfg), cfg.rollout.max_decode_len)
    print(f"audit: {report.summary()}")
    resumes = sum(e["event"] == "resume" for e in events)
    print(f"resumes: {resumes}, readmitted: {sum(bool(e.get('readmit')) for e in events)}")
    c = count(events, cfg.coordinator.train_batch_size)
    n = cfg.coordinator.num_steps
    print(f"kills: {_KILLS.value}, lost groups: {c['lost']}, duplicated groups: "
          f"{c['duplicated']}, steps: {c['steps']}/{n}")
    if not report.ok or c["lost"] or c["duplicated"] or c["steps"] != n:
        raise SystemExit(1)


if __name__ == "__main__":
    app.run(main)
