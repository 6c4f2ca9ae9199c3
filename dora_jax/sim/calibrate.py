"""Fits the simulator's cost model to real runs (their timeline, metrics and ledger).

    python -m dora_jax.sim.calibrate --workdir=RUN [--workdir=RUN2 ...] \\
        [--config=configs/longtail.py] [--cores=2]

What a run records and what is fitted from it:
- Decode: per slice, the time and number of its decode spans (one per generate
  call), the tokens it generated (the ledger's response lengths, split evenly over
  the slices a migrated sample visited) and its mean slot utilisation u
  (metrics.jsonl, per step interval): it ran N = tokens / (u x slots) decode steps
  of u x slots sequences. Non-negative least squares of busy time = calls x
  `call_overhead` + N x (`step_fixed` + `step_per_seq` x u x slots) over every
  slice (contexts on a CPU benchmark are short: `step_per_ctx` = 0), plus the
  tokens it prefilled — prompts and re-prefills, metrics.jsonl's per-slice
  `prefill_tokens` and `reprefill_tokens` — x `prefill_per_token`, fitted only
  when the runs re-prefill (otherwise prompt prefills grow with the decode work and
  the two cannot be told apart).
- Training: each train span against its step's trained sequence tokens
  (`train_fixed`, `train_per_token`).
- Weight loads and migrations: their mean span (`transfer_latency`,
  `migrate_latency`).
With `--cores` (a CPU host where every slice and the trainer share the cores) each
span is first divided by its slow-down, min(1, cores / components busy at its
midpoint), so that the fitted costs are those of a component running alone.
Prints the fitted CostModel as JSON, then ends with `decode step at S busy slots:
X ms` (step_fixed + step_per_seq x S, S the config's slots per slice).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np
from absl import app, flags

from dora_jax.sim.cost import CostModel


def _read_jsonl(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_run(workdir: str) -> dict:
    """A run's timeline spans, metrics and ledger (FileNotFoundError naming what is
    missing)."""
    missing = [f for f in ("timeline.json", "metrics.jsonl", "ledger.jsonl")
               if not os.path.exists(os.path.join(workdir, f))]
    if missing:
        raise FileNotFoundError(f"{workdir} is not a run's workdir: no {', '.join(missing)}")
    with open(os.path.join(workdir, "timeline.json")) as f:
        spans = json.load(f)
    # Step records only: evaluation records (runtime/evaluation.py) are no steps.
    steps = [m for m in _read_jsonl(os.path.join(workdir, "metrics.jsonl")) if "eval" not in m]
    return dict(spans=spans, metrics=steps,
                ledger=_read_jsonl(os.path.join(workdir, "ledger.jsonl")))


def _alone(spans: list, cores: float) -> list:
    """Each span's duration as if it had run alone (see module docstring)."""
    busy = [s for s in spans if s["kind"] in ("decode", "train")]
    starts = sorted(s["start"] for s in busy)
    ends = sorted(s["end"] for s in busy)
    out = []
    for s in spans:
        seconds = s["end"] - s["start"]
        if cores:
            mid = (s["start"] + s["end"]) / 2
            active = bisect.bisect_right(starts, mid) - bisect.bisect_right(ends, mid)
            seconds /= max(1.0, active / cores)
        out.append(seconds)
    return out


def nonnegative_line(x, y) -> tuple:
    """Least-squares intercept and slope, neither negative; a flat line when x does
    not vary."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2 or np.ptp(x) < 1e-9 * max(1.0, abs(x).max()):
        return float(y.mean()), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    if slope < 0:  # noise: no cost per unit then
        return float(y.mean()), 0.0
    if intercept < 0:  # no negative fixed cost: the line through the origin
        return 0.0, float(x @ y / (x @ x))
    return float(intercept), float(slope)


def decode_points(run: dict, slots: int, cores: float) -> list:
    """(generate calls, decode steps, sequences per step, prefilled tokens, busy
    seconds) of each slice of one run; prefilled tokens are prompts and re-prefills
    as metrics.jsonl counts them (0 for a run that predates those counters)."""
    # seconds and tokens (floats) by slice
    busy: dict[str, float] = collections.defaultdict(float)
    util_time: dict[str, float] = collections.defaultdict(float)
    util: dict[str, float] = collections.defaultdict(float)
    tokens: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    prefilled: collections.Counter[str] = collections.Counter()
    for s, seconds in zip(run["spans"], _alone(run["spans"], cores)):
        if s["kind"] == "decode":  # one span per slice step: one generate call
            busy[s["row"].split()[-1]] += seconds
            calls[s["row"].split()[-1]] += 1
    prev = 0.0
    for m in run["metrics"]:
        dt, prev = m["time"] - prev, m["time"]
        for sl, u in m.get("slot_utilisation", {}).items():
            util[sl] += u * dt
            util_time[sl] += dt
        for key in ("prefill_tokens", "reprefill_tokens"):
            for sl, n in m.get(key, {}).items():
                prefilled[sl] += n
    for rec in run["ledger"]:
        if rec["event"] == "consume":
            for smp in rec["samples"]:
                for sl in smp["slices"]:  # the first token comes from the prefill
                    tokens[str(sl)] += (smp["response_len"] - 1) / len(smp["slices"])
    points = []
    for sl, seconds in busy.items():
        u = util[sl] / util_time[sl] if util_time[sl] else 0.0
        if u > 0 and tokens[sl] > 0:
            points.append((calls[sl], tokens[sl] / (u * slots), u * slots, prefilled[sl],
                           seconds))
    return points


def _nonnegative_fit(columns: list, target: Sequence[float]) -> np.ndarray:
    """Least squares with every coefficient >= 0 (dropping negative ones in turn)."""
    A, y = np.asarray(columns, float).T, np.asarray(target, float)
    keep = list(range(A.shape[1]))
    while True:
        coef = np.zeros(A.shape[1])
        coef[keep] = np.linalg.lstsq(A[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or len(keep) == 1:
            return np.maximum(coef, 0.0)
        keep.remove(int(np.argmin(np.where(np.isin(range(len(coef)), keep), coef, np.inf))))


def fit(runs: list, slots: int, cores: float = 0.0, call_steps: int = 16) -> CostModel:
    """The cost model of `runs` (see the module docstring)."""
    points = [p for run in runs for p in decode_points(run, slots, cores)]
    if not points:
        raise ValueError("no decode spans with generated tokens in these runs")
    # busy = calls x call_overhead + steps x (step_fixed + step_per_seq x batch)
    #        + prefilled tokens x prefill_per_token
    calls, steps, batch, prefilled, busy = zip(*points)
    columns = [calls, steps, np.multiply(steps, batch)]
    # Prompt prefills grow with the decode work (both with the groups a slice runs):
    # their cost is told apart only where re-prefills (interrupts, preemptions) vary
    # it independently, so the prefill column is fitted only for such runs.
    reprefilled = any(n for run in runs for m in run["metrics"]
                      for n in m.get("reprefill_tokens", {}).values())
    if reprefilled:
        columns.append(prefilled)
    call_overhead, step_fixed, step_per_seq, *prefill = _nonnegative_fit(columns, busy)
    prefill_per_token = prefill[0] if prefill else 0.0
    train_x, train_y, loads, migrations = [], [], [], []
    for run in runs:
        alone = _alone(run["spans"], cores)
        trains = [sec for s, sec in zip(run["spans"], alone) if s["kind"] == "train"]
        for m, sec in zip(run["metrics"], trains):
            train_x.append(m["trainer"]["sequence_tokens"])
            train_y.append(sec)
        loads += [sec for s, sec in zip(run["spans"], alone) if s["kind"] == "load"]
        migrations += [sec for s, sec in zip(run["spans"], alone) if s["kind"] == "migrate"]
    train_fixed, train_per_token = nonnegative_line(train_x, train_y)
    return CostModel(step_fixed=step_fixed, step_per_seq=step_per_seq, step_per_ctx=0.0,
                     prefill_fixed=0.0, prefill_per_token=float(prefill_per_token),
                     weight_bytes=0.0,
                     transfer_bandwidth=1.0, transfer_latency=float(np.mean(loads or [0.0])),
                     kv_bytes_per_token=0.0, migrate_bandwidth=1.0,
                     migrate_latency=float(np.mean(migrations or [0.0])), kv_tokens=10**12,
                     train_fixed=train_fixed, train_per_token=train_per_token, cores=cores,
                     call_overhead=float(call_overhead), call_steps=call_steps)


def main(argv):
    del argv
    from dora_jax import config as config_lib

    f = flags.FLAGS
    slots = config_lib.load(f.config).rollout.slots_per_slice
    try:
        runs = [load_run(w) for w in f.workdir]
    except FileNotFoundError as e:
        raise app.UsageError(str(e)) from None
    cost = fit(runs, slots, f.cores)
    print(json.dumps(dataclasses.asdict(cost), indent=1))
    print(f"decode step at {slots} busy slots: "
          f"{1e3 * (cost.step_fixed + cost.step_per_seq * slots):.3f} ms")


if __name__ == "__main__":  # flags only here: validate.py imports this module
    flags.DEFINE_multi_string("workdir", None, "a real run's workdir (repeatable)")
    flags.DEFINE_string("config", "configs/longtail.py", "the runs' config")
    flags.DEFINE_float("cores", 0.0, "cores every slice and the trainer share (0: none)")
    flags.mark_flag_as_required("workdir")
    app.run(main)
