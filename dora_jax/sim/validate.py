"""Calibrates the simulator on one mode of a real benchmark and predicts the others.

    python -m dora_jax.sim.validate --workdir=BENCH_DIR [--calibrate_on=sync] \\
        [--config=configs/longtail.py] [--cores=2]

BENCH_DIR is a `python -m dora_jax.bench.modes` output directory: one folder per
mode (`dora_k2` is dora at K = 2) with one run per repetition, and bench.json with
the measured medians. The cost model is fitted on the `--calibrate_on` runs
(calibrate.py); every mode is then simulated with the benchmark's scheduler
settings, each repetition with the response lengths its own ledger recorded, and
the predicted step time and tokens/s (medians over repetitions) are printed beside
the measured ones. What the spans do not show (handing a batch to the trainer,
publishing) is one more cost per train step, set so that the calibration mode's
own step time is met. Ends with `max relative error: E` over the modes not calibrated
on. `--cores=2` models this machine, where every slice and the trainer share two
cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics

from absl import app, flags

from dora_jax.scheduler.types import SchedulerConfig
from dora_jax.sim.calibrate import fit, load_run
from dora_jax.sim.cluster import ClusterSim
from dora_jax.sim.run import COLOCATED, scheduler_mode


def mode_of(name: str) -> tuple:
    """bench.modes folder name -> (mode, K or None): dora_k2 -> ("dora", 2)."""
    m = re.fullmatch(r"(\w+?)_k(\d+)", name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def replayed_lengths(ledger: list, group_size: int):
    """length(group, sample) as the run's ledger recorded it; groups it never
    consumed take the lengths of consumed ones, in turn."""
    table = {r["group_id"]: {s["sample"]: s["response_len"] for s in r["samples"]}
             for r in ledger if r["event"] == "consume"}
    spare = [table[g] for g in sorted(table)]

    def length(g, k):
        return (table.get(g) or spare[g % len(spare)])[k]

    return length


def predict(run: dict, cfg, mode: str, k, cost, steps: int) -> dict:
    """Step seconds and response tokens/s of one simulated repetition."""
    c = cfg.coordinator
    colocated = mode == COLOCATED
    sched = SchedulerConfig(
        mode=scheduler_mode(mode), num_slices=cfg.mesh.num_slices * (2 if colocated else 1),
        slots_per_slice=cfg.rollout.slots_per_slice, group_size=c.group_size,
        train_batch_size=c.train_batch_size, rollout_batch_size=c.rollout_batch_size,
        max_staleness=c.max_staleness if k is None else k)
    if colocated:  # the reshard is a device_put of the weights, like a load
        cost = dataclasses.replace(cost, reshard=cost.transfer_latency)
    sim = ClusterSim(sched, cost, replayed_lengths(run["ledger"], c.group_size),
                     prompt_len=0, colocated=colocated)
    sim.run(steps)
    m = sim.metrics
    window = m[-1]["time"] - m[0]["time"]
    return dict(step=window / (len(m) - 1),
                tokens=sum(r["trained_tokens"] for r in m[1:]) / window)


_WORKDIR = flags.DEFINE_string("workdir", None, "a bench.modes output directory")
_CALIBRATE_ON = flags.DEFINE_string("calibrate_on", "sync", "mode folder fitted on")
_CONFIG = flags.DEFINE_string("config", "configs/longtail.py", "the benchmark's config")
_CORES = flags.DEFINE_float("cores", 2.0, "cores every slice and the trainer share")


def main(argv):
    del argv
    from dora_jax import config as config_lib

    workdir = _WORKDIR.value
    assert workdir is not None  # a required flag
    cfg = config_lib.load(_CONFIG.value)
    if not os.path.exists(os.path.join(workdir, "bench.json")):
        raise app.UsageError(f"--workdir={workdir} is not a bench.modes output "
                             f"directory (no bench.json)")
    if not os.path.isdir(os.path.join(workdir, _CALIBRATE_ON.value)):
        raise app.UsageError(f"--calibrate_on={_CALIBRATE_ON.value}: no such mode folder "
                             f"in {workdir}")
    with open(os.path.join(workdir, "bench.json")) as f:
        measured = json.load(f)["rows"]

    def runs(name):
        d = os.path.join(workdir, name)
        return [load_run(os.path.join(d, r)) for r in sorted(os.listdir(d))
                if os.path.exists(os.path.join(d, r, "timeline.json"))]

    base = _CALIBRATE_ON.value
    cost = fit(runs(base), cfg.rollout.slots_per_slice, _CORES.value)
    # What the spans do not show (batch hand-over to the trainer, publication): the
    # calibration mode's measured step time less its predicted one, per train step.
    mode, k = mode_of(base)
    for _ in range(2):
        step = statistics.median(predict(r, cfg, mode, k, cost, len(r["metrics"]))["step"]
                                 for r in runs(base))
        cost = dataclasses.replace(
            cost, train_fixed=max(0.0, cost.train_fixed + measured[base]["step s"] - step))
    print(f"calibrated on {_CALIBRATE_ON.value}: step {1e3 * cost.step_fixed:.2f} ms + "
          f"{1e3 * cost.step_per_seq:.3f} ms/seq, train {cost.train_fixed:.3f} s + "
          f"{1e6 * cost.train_per_token:.1f} us/token, load {cost.transfer_latency:.4f} s, "
          f"call {1e3 * cost.call_overhead:.2f} ms, cores {cost.cores:g}")
    print(f"{'mode':16} {'step s':>8} {'pred':>8} {'err':>6} {'tokens/s':>9} {'pred':>8} "
          f"{'err':>6}")
    errors = []
    for name, row in measured.items():
        mode, k = mode_of(name)
        reps = runs(name)
        if not reps:
            continue
        steps = len(reps[0]["metrics"])
        preds = [predict(run, cfg, mode, k, cost, steps) for run in reps]
        step = statistics.median(p["step"] for p in preds)
        tokens = statistics.median(p["tokens"] for p in preds)
        e_step = step / row["step s"] - 1
        e_tok = tokens / row["tokens/s"] - 1
        if name != _CALIBRATE_ON.value:
            errors += [abs(e_step), abs(e_tok)]
        print(f"{name:16} {row['step s']:8.3f} {step:8.3f} {100 * e_step:5.0f}% "
              f"{row['tokens/s']:9.0f} {tokens:8.0f} {100 * e_tok:5.0f}%"
              + ("  (calibrated on)" if name == _CALIBRATE_ON.value else ""))
    if not errors:
        raise SystemExit(f"{workdir}: no audited run of a mode other than "
                         f"{_CALIBRATE_ON.value} to validate against")
    print(f"max relative error: {max(errors):.2f}")


if __name__ == "__main__":
    flags.mark_flag_as_required("workdir")
    app.run(main)
