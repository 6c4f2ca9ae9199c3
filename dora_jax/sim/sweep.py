"""DORA against the baselines over the settings a user would try, on one preset.

    python -m dora_jax.sim.sweep --preset=paper128 [--steps=20] [--seeds=0,1,2] \
        [--trainer_devices=32,40,48,64] [--rbs=1,1.5,2,3] [--versions=1,K+1] \
        [--jobs=2] [--workdir=DIR]

For every trainer split, rollout batch size (a multiple of TBS) and workload seed it
simulates dora, streaming partial rollout and round-synchronous partial rollout;
sync (at each split) and colocated sync (on all devices) do not depend on the
rollout batch size and run once per split and seed. `--versions` lists the versions
per slice V that dora runs with (`K+1` for max_staleness + 1; default: the
preset's); the baselines hold one version per slice by definition and run once,
and the table and summary are printed for each V. Every run's ledger is audited
(C1 where the mode keeps it, C2, C3); a failed audit stops the sweep. With
`--workdir` each run's outputs go to DIR/<split>/<rbs>/<seed>/<mode>/.

Prints one row per (split, RBS) with each mode's median step minutes over the seeds
and the bound (`Preset.step_time_bound`), then:

    dora/partial_rollout worst: A        (min over every run of partial's step / dora's)
    dora/partial_rollout median: B
    dora/partial_rollout_rounds median: C
    dora/sync median: D                  (colocated sync, the stronger sync baseline)
    dora/sync at the same split median: D'  (sync on the trainer / rollout split)
    dora step / bound worst: E
    dora step spread over rollout batch sizes worst: F
    dora version-mismatch slot time worst: M  (median: M'; share of slot time)

F is max/min of dora's step time over the batch sizes at one split and seed, the
worst such (split, seed). Ratios above 1 mean DORA is faster.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import statistics
import time

from absl import app, flags

from dora_jax.sim.presets import PRESETS
from dora_jax.sim.run import simulate

PER_SPLIT = ("sync",)  # independent of RBS: once per split and seed
PER_SEED = ("colocated_sync",)  # independent of the split as well


def plan(preset, splits, factors, seeds, modes, versions=None) -> list:
    """[(key, preset, mode)] of every run; key = (split, rbs factor, seed), with
    None where the run does not depend on it. With `versions` (a list of V) dora runs
    once per V, as mode `dora@V`."""
    if versions is not None:
        modes = [m for m in modes if m != "dora"]
        runs = plan(preset, splits, factors, seeds, modes)
        for v in versions:
            at_v = dataclasses.replace(preset, versions_per_slice=v)
            runs += [(key, p, f"dora@{v}")
                     for key, p, m in plan(at_v, splits, factors, seeds, ["dora"])
                     if m == "dora"]
        return runs
    runs = []
    for seed in seeds:
        seeded = dataclasses.replace(preset, workload=dataclasses.replace(preset.workload,
                                                                          seed=seed))
        runs += [((None, None, seed), seeded, m) for m in PER_SEED]
        for split in splits:
            at_split = dataclasses.replace(seeded, trainer_devices=split)
            runs += [((split, None, seed), at_split, m) for m in PER_SPLIT]
            for f in factors:
                rbs = round(f * preset.train_batch_size)
                runs += [((split, f, seed), dataclasses.replace(at_split, rollout_batch_size=rbs),
                          m) for m in modes]
    return runs


def run_key(split, factor, seed, mode) -> tuple:
    """The key of the run that gives `mode`'s figure at (split, factor, seed)."""
    if mode in PER_SEED:
        return (None, None, seed)
    return (split, None, seed) if mode in PER_SPLIT else (split, factor, seed)


def _run(key, preset, mode, steps, workdir):
    out = None
    if workdir:
        out = os.path.join(workdir, *(str(k) for k in key if k is not None), mode)
    s = simulate(preset, mode.split("@")[0], steps, out)
    dora = mode.startswith("dora")
    return dict(key=key, mode=mode, minutes=s["step_minutes"], audit_ok=s["audit_ok"],
                audit=s["audit"], bound=preset.step_time_bound()["step"] / 60 if dora else None,
                mismatch=s["slot_idle"]["version_mismatch"] if dora else None)


def headline(results: list, splits, factors, seeds) -> dict:
    """The sweep's summary ratios (module docstring) from `_run`'s results."""
    at = {(r["key"], r["mode"]): r for r in results}

    def minutes(split, f, seed, mode):
        return at.get((run_key(split, f, seed, mode), mode), {}).get("minutes")

    cells = list(itertools.product(splits, factors, seeds))
    dora = {c: minutes(*c, "dora") for c in cells}
    out = {}
    for base in ("partial_rollout", "partial_rollout_rounds", "colocated_sync", "sync"):
        if all(minutes(*c, base) is not None for c in cells):
            ratios = [minutes(*c, base) / dora[c] for c in cells]
            out[base] = (min(ratios), statistics.median(ratios))
    out["bound_worst"] = max(dora[c] / at[(c, "dora")]["bound"] for c in cells)
    mismatch = [at[(c, "dora")].get("mismatch") for c in cells]
    if None not in mismatch:
        out["mismatch"] = (max(mismatch), statistics.median(mismatch))
    out["spread_worst"] = max(
        max(dora[(s, f, sd)] for f in factors) / min(dora[(s, f, sd)] for f in factors)
        for s in splits for sd in seeds)
    return out


def main(argv):
    del argv
    f = flags.FLAGS
    preset = PRESETS[f.preset]
    try:
        seeds = [int(s) for s in f.seeds]
        splits = [int(s) for s in f.trainer_devices]
        factors = [float(f) for f in f.rbs]
    except ValueError as e:
        raise app.UsageError(f"--seeds, --trainer_devices and --rbs take numbers: {e}")
    for split in splits:
        if not 0 < split < preset.total_devices or \
                (preset.total_devices - split) % preset.slice_devices:
            raise app.UsageError(f"--trainer_devices: {split} does not leave whole "
                                 f"{preset.slice_devices}-device slices")
    k = preset.max_staleness
    try:
        versions = None if not f.versions else [k + 1 if v.upper() == "K+1" else int(v)
                                                 for v in f.versions]
    except ValueError as e:
        raise app.UsageError(f"--versions takes numbers or K+1: {e}")
    if versions and not all(1 <= v <= k + 1 for v in versions):
        raise app.UsageError(f"--versions: each V must be in 1..K+1 = {k + 1}, got {versions}")
    if any(f < 1 for f in factors):
        raise app.UsageError("--rbs: a rollout batch holds at least one train batch (>= 1)")
    if "dora" not in f.modes:
        raise app.UsageError("--modes must include dora")
    runs = plan(preset, splits, factors, seeds, f.modes, versions)
    print(f"{preset.name}: {len(runs)} runs of {f.steps} steps, seeds {seeds}", flush=True)
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(max(1, f.jobs)) as pool:
        results = list(pool.map(_run, *zip(*runs), itertools.repeat(f.steps),
                                itertools.repeat(f.workdir)))
    bad = [(r["key"], r["mode"], r["audit"]) for r in results if not r["audit_ok"]]
    if bad:
        raise SystemExit(f"ledger audit failed: {bad}")
    for v in versions or (None,):
        label = "dora" if v is None else f"dora@{v}"
        view = [dict(r, mode="dora") if r["mode"] == label else r for r in results
                if not r["mode"].startswith("dora") or r["mode"] == label]
        if v is not None:
            print(f"dora with {v} version{'s' if v > 1 else ''} per slice:")
        _report(view, preset, f, splits, factors, seeds, start)


def _report(results, preset, f, splits, factors, seeds, start):
    """The table and the summary lines of one set of runs (one V of dora)."""
    at = {(r["key"], r["mode"]): r for r in results}
    cols = [*f.modes, *PER_SPLIT, *PER_SEED]
    print(f"{'trainer':>7} {'RBS':>5} " + " ".join(f"{m:>22}" for m in cols) + f" {'bound':>7}")
    for split, f in itertools.product(splits, factors):
        def med(mode, split=split, f=f):
            return statistics.median(at[(run_key(split, f, sd, mode), mode)]["minutes"]
                                     for sd in seeds)
        bound = statistics.median(at[((split, f, sd), "dora")]["bound"] for sd in seeds)
        print(f"{split:>7} {round(f * preset.train_batch_size):>5} "
              + " ".join(f"{med(m):>22.2f}" for m in cols) + f" {bound:>7.2f}")
    h = headline(results, splits, factors, seeds)
    print(f"step minutes, medians over {len(seeds)} seeds; {len(results)} runs audited clean "
          f"in {time.perf_counter() - start:.0f} s")
    for base, name in (("partial_rollout", "partial_rollout"),
                       ("partial_rollout_rounds", "partial_rollout_rounds"),
                       ("colocated_sync", "sync"), ("sync", "sync at the same split")):
        if base in h:
            if base == "partial_rollout":
                print(f"dora/partial_rollout worst: {h[base][0]:.3f}")
            print(f"dora/{name} median: {h[base][1]:.3f}")
    print(f"dora step / bound worst: {h['bound_worst']:.3f}")
    print(f"dora step spread over rollout batch sizes worst: {h['spread_worst']:.3f}")
    if "mismatch" in h:
        print(f"dora version-mismatch slot time worst: {100 * h['mismatch'][0]:.2f}% "
              f"(median {100 * h['mismatch'][1]:.2f}%)")


def define_flags():
    """The command line's flags (defined only when run as a program: tests import
    this module beside others that define flags of the same names)."""
    flags.DEFINE_enum("preset", "paper128", list(PRESETS), "deployment to simulate")
    flags.DEFINE_integer("steps", 20, "train steps per run")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "workload seeds")
    flags.DEFINE_list("trainer_devices", ["32", "40", "48", "64"],
                      "trainer splits (devices of the trainer)")
    flags.DEFINE_list("rbs", ["1", "1.5", "2", "3"],
                      "rollout batch sizes, as multiples of the train batch size")
    flags.DEFINE_list("versions", [], "versions per slice V for dora (numbers or K+1; "
                      "default: the preset's)")
    flags.DEFINE_list("modes", ["dora", "partial_rollout", "partial_rollout_rounds"],
                      "modes run at every rollout batch size")
    flags.DEFINE_integer("jobs", os.cpu_count() or 1, "runs simulated at once")
    flags.DEFINE_string("workdir", None, "where each run's outputs go (optional)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
