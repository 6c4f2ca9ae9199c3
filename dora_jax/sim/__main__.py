"""Simulates every mode of a preset deployment and compares them with the paper.

    python -m dora_jax.sim --preset=paper128 --workdir=/tmp/sim128 [--steps=20] \
        [--trainer_devices=N] [--rollout_batch_size=N] [--max_staleness=K] \
        [--versions_per_slice=V] [--episodes_per_slice=E] [--episode_kv=host] \
        [--explain]

Per mode (each in `<workdir>/<mode>/`, with a real run's outputs and its ledger
audited): step time, rollout-only share, trainer wait, slot utilisation and
throughput over steps 1..N-1 (tokens/s: trained tokens, prompts and responses;
gen tok/s: decoded tokens, which leave out a multi-turn episode's observations), with
the paper's figures beside them where it gives them. Ends with
`dora/sync step-time speedup: X` (against the faster of sync and colocated sync, the
strongest synchronous baseline), `dora/partial_rollout step-time speedup: Y` (partial
rollout under the same staleness bound; the unbounded variant is listed apart) and
`dora rollout-only share: Z`.

Before the final lines, `bound:` gives the step time no policy can beat at this
split (`Preset.step_time_bound`): the trainer's time per batch and the rollout's at
full slots; a mode near it has little left to gain from scheduling. The overrides
plan a deployment: the trainer / rollout split, RBS and K.

With --explain, after the table, one line per mode says where the time went over
steps 1..N-1: the trainer's wait by cause (as a real run splits it: `guard`, at
least a batch finished but the staleness guard or the batch rule holds the trainer;
`starvation`, fewer than a batch finished; the pipeline's `fill` before step 0 in
minutes) and the slots' time by state, in the fixed order of
`cluster.SLOT_REASONS` (busy decoding; idle to a chunk's end, in prefill, loading,
while a colocated trainer trains, short of KV memory, with pending work only at
other versions, held by the scheduler, admission closed by the mode, RBS reached);
states under 0.5%% are left out, except `version_mismatch` (slots idle on a slice
because only other versions have pending work), always shown to two decimals, and
`versions/step`, the mean number of distinct versions in a decode step's batch
(--versions_per_slice V lets a dora slice hold V versions at once). `env` is the slot
time multi-turn episodes spend waiting for their environment (`--preset=multiturn`),
slot kept, not decoding.

`--episodes_per_slice E` (E >= slots per slice; 0: one per slot) lets a slice hold E
multi-turn episodes: one at its environment gives up its slot (no `env` slot time),
its KV kept on device, or with `--episode_kv=host` copied to host memory and back
(`host copies` in the summary); `--preset=multiturn_slow_release` is
`multiturn_slow` with E = 4 x 256, `--preset=multiturn_slow_lora` that with LoRA
adapters, K + 1 versions a dora slice and the KV on host.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time

from absl import app, flags

from dora_jax.sim.presets import PRESETS
from dora_jax.sim.run import SIM_MODES, simulate

_PRESET = flags.DEFINE_enum("preset", "paper128", sorted(PRESETS), "deployment to simulate")
_WORKDIR = flags.DEFINE_string("workdir", None, "where each mode's outputs go")
_STEPS = flags.DEFINE_integer("steps", 20, "train steps per mode")
_MODES = flags.DEFINE_list("modes", list(SIM_MODES), "modes to simulate")
_JOBS = flags.DEFINE_integer("jobs", os.cpu_count() or 1, "modes simulated at once")
_TRAINER = flags.DEFINE_integer("trainer_devices", None,
                                "accelerators of the trainer (the rest form rollout slices)")
_RBS = flags.DEFINE_integer("rollout_batch_size", None, "RBS: groups admitted and not "
                            "consumed (streaming modes: RBS x G samples in flight)")
_K = flags.DEFINE_integer("max_staleness", None, "K")
_V = flags.DEFINE_integer("versions_per_slice", None, "V: versions a dora slice holds at "
                          "once (1..K+1; default: the preset's)")
_E = flags.DEFINE_integer("episodes_per_slice", None, "E: multi-turn episodes a slice holds "
                          "(an episode at its environment frees its slot); 0: one per slot "
                          "(default: the preset's)")
_EPISODE_KV = flags.DEFINE_enum("episode_kv", None, ["device", "host"], "where an episode's "
                                "KV waits for its environment (default: the preset's)")
_EXPLAIN = flags.DEFINE_bool("explain", False, "after the table, per mode: the trainer's "
                             "wait by cause and the slots' time by state")


def configured_preset():
    """The --preset with the overrides given, or UsageError naming the bad flag."""
    preset = PRESETS[_PRESET.value]
    tr = preset.trainer_devices if _TRAINER.value is None else _TRAINER.value
    rollout = preset.total_devices - tr
    if not 0 < tr < preset.total_devices or rollout % preset.slice_devices:
        raise app.UsageError(
            f"--trainer_devices must leave a whole number of {preset.slice_devices}-device "
            f"slices of the {preset.total_devices} devices, got {tr}")
    rbs = preset.rollout_batch_size if _RBS.value is None else _RBS.value
    if rbs < preset.train_batch_size:
        raise app.UsageError(f"--rollout_batch_size must be >= TBS "
                             f"({preset.train_batch_size}), got {rbs}")
    k = preset.max_staleness if _K.value is None else _K.value
    if k < 0:
        raise app.UsageError(f"--max_staleness must be >= 0, got {k}")
    v = preset.versions_per_slice if _V.value is None else _V.value
    if not 1 <= v <= k + 1:
        raise app.UsageError(f"--versions_per_slice must be in 1..K+1 = {k + 1}, got {v}")
    preset = dataclasses.replace(
        preset, trainer_devices=tr, rollout_batch_size=rbs, max_staleness=k,
        versions_per_slice=v,
        episodes_per_slice=preset.episodes_per_slice if _E.value is None else _E.value,
        episode_kv=_EPISODE_KV.value or preset.episode_kv)
    try:
        preset.check_episodes()
    except ValueError as e:
        raise app.UsageError(f"--episodes_per_slice / --episode_kv: {e}") from None
    return preset


def _simulate(preset, mode, steps, workdir):
    start = time.perf_counter()
    summary = simulate(preset, mode, steps, workdir)
    return summary, time.perf_counter() - start


def _fmt(x, pct=False):
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if pct else f"{x:.2f}"


def explain_line(mode: str, summary: dict) -> str:
    """One mode's trainer wait by cause and slot-time by state (see --explain)."""
    w = summary["trainer_wait_split"]
    slots = "  ".join(f"{k} {100 * x:.0f}%" for k, x in summary["slot_idle"].items()
                      if x >= 0.005 and k != "version_mismatch")
    slots += (f"  version_mismatch {100 * summary['slot_idle']['version_mismatch']:.2f}%"
              f"  versions/step {summary.get('versions_per_step', 1):.2f}")
    return (f"{mode:26} trainer wait: guard {100 * w['guard']:.0f}%  starvation "
            f"{100 * w['starvation']:.0f}%  (fill {w['fill_seconds'] / 60:.1f} min)  "
            f"| slots: {slots}")


def main(argv):
    del argv
    unknown = sorted(set(_MODES.value) - set(SIM_MODES))
    if unknown:
        raise app.UsageError(f"--modes: unknown {unknown}; known: {', '.join(SIM_MODES)}")
    if _STEPS.value < 2:
        raise app.UsageError("--steps must be >= 2 (figures are over steps 1..N-1)")
    preset = configured_preset()
    print(f"{preset.name}: {preset.description}; {preset.train_batch_size} prompts x "
          f"{preset.group_size} samples per step, K={preset.max_staleness}, "
          f"RBS={preset.rollout_batch_size}, trainer {preset.trainer_devices} + "
          f"{preset.num_slices} slices of {preset.slice_devices}, {_STEPS.value} steps per mode"
          + (f", {preset.episodes_per_slice} episodes a slice (KV on {preset.episode_kv})"
             if preset.episodes_per_slice else ""))
    results = {}
    header = (f"{'mode':26} {'step min':>8} {'(paper)':>8} {'roll-only':>9} {'(paper)':>8} "
              f"{'trainer wait':>12} {'slot util':>9} {'tokens/s':>9} {'gen tok/s':>9} "
              f"{'audit':>5} {'sim s':>6}")
    print(header)
    with concurrent.futures.ProcessPoolExecutor(max(1, _JOBS.value)) as pool:
        futures = {mode: pool.submit(_simulate, preset, mode, _STEPS.value,
                                     os.path.join(_WORKDIR.value, mode) if _WORKDIR.value
                                     else None)
                   for mode in _MODES.value}
    for mode, future in futures.items():
        s, seconds = future.result()
        results[mode] = s
        paper_min, paper_share = preset.paper.get(mode, (None, None))
        print(f"{mode:26} {s['step_minutes']:8.2f} {_fmt(paper_min):>8} "
              f"{_fmt(s['rollout_only_share'], True):>9} {_fmt(paper_share, True):>8} "
              f"{_fmt(s['trainer_wait_fraction'], True):>12} "
              f"{_fmt(s['slot_utilisation'], True):>9} {s['tokens_per_second']:9.0f} "
              f"{s['generated_tokens_per_second']:9.0f} "
              f"{'ok' if s['audit_ok'] else 'FAIL':>5} {seconds:6.1f}")
    if _EXPLAIN.value:
        print("where the time went, % of steps 1..N-1:")
        for mode, s in results.items():
            print(explain_line(mode, s))
    bad = [m for m, s in results.items() if not s["audit_ok"]]
    if bad:
        raise SystemExit(f"ledger audit failed for {bad}: {[results[m]['audit'] for m in bad]}")
    bound = preset.step_time_bound()
    print(f"bound: no policy beats {bound['step'] / 60:.2f} min/step at this split "
          f"(trainer {bound['train'] / 60:.2f}, rollout at full slots "
          f"{bound['rollout'] / 60:.2f}, longest response / K {bound['latency'] / 60:.2f})")
    if "dora" not in results:
        return
    dora = results["dora"]["step_minutes"]
    syncs = {m: results[m]["step_minutes"] for m in ("sync", "colocated_sync") if m in results}
    if syncs:
        best = min(syncs, key=syncs.__getitem__)
        print(f"dora/sync step-time speedup: {syncs[best] / dora:.2f}  (against {best})")
    if "partial_rollout" in results:
        print(f"dora/partial_rollout step-time speedup: "
              f"{results['partial_rollout']['step_minutes'] / dora:.2f}")
    print(f"dora rollout-only share: {results['dora']['rollout_only_share']:.2f}")


if __name__ == "__main__":
    app.run(main)
