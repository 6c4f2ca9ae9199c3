"""Every scheduling mode side by side on one long-tailed workload: DORA's regime.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m dora_jax.bench.modes --config=configs/longtail.py --workdir=/tmp/modes

Runs colocated_sync (sync on the colocated layout: bench/runs.py), sync,
one_step_off, partial_rollout (streaming), partial_rollout_rounds
(round-synchronous) and dora at K = 1, 2, 3 on the same config, prompts, seed and
total device count, interleaved (the order rotates each repetition) and repeated
`--reps` times; the table gives medians. Each
run goes to DIR/<mode>/<rep>/ (ledger.jsonl, metrics.jsonl, summary.json,
timeline.png) and counts only if its ledger audits clean under the mode's own
constraints (C1 unless the mode breaks it by design, C2, C3). Both partial rollouts
run under the config's staleness bound, like the DORA run with the same K.

Without `--config.init_checkpoint` the policy is first trained with the supervised
warm start (`dora_jax.sft`, into DIR/sft/, reused when present), so response lengths
are long-tailed from the first step.

`--curves` instead runs sync and dora at K = 1, 2, 3 over `--curve_seeds` seeds from
a partly trained policy (DIR/sft_<n>/, `--curve_sft_steps` supervised steps) so the
reward has room to rise, and writes DIR/curves.png and DIR/curves.json
(bench/curves.py).
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter

from absl import app, flags, logging
from ml_collections import config_flags

from dora_jax.bench import CONFIGS
from dora_jax.bench.runs import COLOCATED, audited_run, parse_spec, run_config, warm_start

_CONFIG = config_flags.DEFINE_config_file("config", str(CONFIGS / "longtail.py"), "config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "where every run is kept", required=True)
_STEPS = flags.DEFINE_integer("steps", 60, "train steps per run")
_REPS = flags.DEFINE_integer("reps", 3, "repetitions of every mode (the table gives medians)")
_MODES = flags.DEFINE_list(
    "modes", ["colocated_sync", "sync", "one_step_off", "partial_rollout",
              "partial_rollout_rounds", "dora_k1", "dora_k2", "dora_k3"],
    "runs: a mode, optionally with _k<K> for its staleness bound (default: the config's) "
    "_v<V> for its versions per slice and _e<E> for its episodes per slice "
    "(rollout.max_episodes_per_slice)")
_SFT_STEPS = flags.DEFINE_integer("sft_steps", 300,
                                  "supervised warm-start steps (0: start from the random init)")
_CURVES = flags.DEFINE_bool("curves", False, "reward curves instead of the throughput table")
_CURVE_STEPS = flags.DEFINE_integer("curve_steps", 150, "train steps per curve run")
_CURVE_MODES = flags.DEFINE_list("curve_modes", ["sync", "dora_k1", "dora_k2", "dora_k3"],
                                 "runs of the curves (specs as --modes)")
_CURVE_SEEDS = flags.DEFINE_integer("curve_seeds", 3, "seeds per curve")
_CURVE_SFT_STEPS = flags.DEFINE_integer("curve_sft_steps", 20,
                                        "supervised steps before the curve runs (0: none)")

SYNC_MODES = (COLOCATED, "sync")


COLUMNS = (  # (header, summary key or function, format)
    ("tokens/s", "tokens_per_second", "{:9.0f}"),
    ("step s", "step_seconds", "{:7.3f}"),
    ("train s", lambda s: s.get("train_step_seconds", float("nan")), "{:7.3f}"),
    ("fill s", lambda s: s["trainer_wait_split"]["fill_seconds"], "{:7.2f}"),
    ("wait", "trainer_wait_fraction", "{:6.1%}"),
    ("guard", lambda s: s["trainer_wait_split"]["guard"], "{:6.1%}"),
    ("starve", lambda s: s["trainer_wait_split"]["starvation"], "{:6.1%}"),
    ("slot util", "mean_slot_utilisation", "{:9.1%}"),
    ("rollout-only", "rollout_only_share", "{:12.1%}"),
    ("reward", "reward_mean", "{:6.3f}"),
)


def _value(summary: dict, key):
    return key(summary) if callable(key) else summary[key]


def median_row(summaries: list[dict]) -> dict:
    """Medians of every column over a mode's audited runs, and their staleness
    histogram summed."""
    row = {h: statistics.median(_value(s, k) for s in summaries) for h, k, _ in COLUMNS}
    stale: Counter[int] = Counter()
    for s in summaries:
        stale.update({int(k): v for k, v in s["staleness"].items()})
    row["staleness"] = dict(sorted(stale.items()))
    if "episodes" in summaries[0]:  # multi-turn: episodes under more than one version
        row["episodes"] = sum(s["episodes"] for s in summaries)
        row["mixed"] = sum(s["episodes_mixed_versions"] for s in summaries)
    return row


def _episodes_note(row: dict) -> str:
    if "episodes" not in row:
        return ""
    if row["mixed"]:
        return (f"  MIXES VERSIONS ACROSS TURNS: {row['mixed']} of {row['episodes']} "
                f"episodes ran under 2+ versions")
    return f"  one version per episode ({row['episodes']} episodes)"


def table(rows: dict[str, dict], counts: dict[str, str]) -> str:
    header = f"{'mode':16} {'runs':>5} " + " ".join(
        f"{h:>{len(fmt.format(0))}}" for h, _, fmt in COLUMNS)
    lines = [header + "  staleness", "-" * (len(header) + 11)]
    for spec, row in rows.items():
        cells = " ".join(fmt.format(row[h]) for h, _, fmt in COLUMNS)
        stale = " ".join(f"{k}:{v}" for k, v in row["staleness"].items())
        lines.append(f"{spec:16} {counts[spec]:>5} {cells}  {stale}{_episodes_note(row)}")
    return "\n".join(lines)


def ratio_lines(rows: dict[str, dict], dora_spec: str) -> list[str]:
    """Per-K ratios against the better sync, then the two headline lines."""
    tps = {spec: row["tokens/s"] for spec, row in rows.items()}
    syncs = [s for s in SYNC_MODES if s in tps]
    if not syncs or dora_spec not in tps:
        return ["(need a sync mode and dora to print ratios)"]
    best_sync = max(syncs, key=tps.__getitem__)
    others = [s for s in tps if parse_spec(s)[0] != "dora"]
    best_other = max(others, key=tps.__getitem__)
    lines = [f"{s}/{best_sync} tokens/s ratio: {tps[s] / tps[best_sync]:.2f}"
             for s in tps if parse_spec(s)[0] == "dora"]
    lines += [f"(dora = {dora_spec}; sync = {best_sync}; best other = {best_other})",
              f"dora/sync tokens/s ratio: {tps[dora_spec] / tps[best_sync]:.2f}",
              f"dora/best-other tokens/s ratio: {tps[dora_spec] / tps[best_other]:.2f}"]
    return lines


def bench_modes(base, root: str, specs: list[str], steps: int, reps: int) -> dict:
    """Runs every spec `reps` times, interleaved; prints and returns the table."""
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    for rep in range(reps):
        order = specs[rep % len(specs):] + specs[:rep % len(specs)]
        for spec in order:
            s = audited_run(run_config(base, spec, steps=steps), os.path.join(root, spec, str(rep)))
            runs[spec].append(s)
            print(f"{spec} rep {rep}: {s['tokens_per_second']:.0f} tokens/s, "
                  f"audit {'clean' if s['audit_ok'] else 'FAILED: ' + s['audit']}", flush=True)
    clean = {spec: [s for s in rs if s["audit_ok"]] for spec, rs in runs.items()}
    rows = {spec: median_row(rs) for spec, rs in clean.items() if rs}
    counts = {spec: f"{len(clean[spec])}/{len(runs[spec])}" for spec in specs}
    k = base.coordinator.max_staleness
    dora_spec = f"dora_k{k}" if f"dora_k{k}" in rows else next(
        (s for s in rows if parse_spec(s)[0] == "dora"), "dora")
    c = base.coordinator
    print(f"\nworkload: {c.train_batch_size} groups x {c.group_size} samples per step, "
          f"{steps} steps, {reps} repetitions (medians over audited runs); runs in {root}")
    print("wait = trainer idle share of the steady window (after step 0) = guard + starve; "
          "fill s = the pipeline fill before step 0")
    print(table(rows, counts))
    for line in ratio_lines(rows, dora_spec):
        print(line)
    out = {"rows": rows, "runs": runs}
    with open(os.path.join(root, "bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from dora_jax.runtime import cli, compile_times

    cli.workdir_to_write(_WORKDIR.value)
    # Every run recompiles the same programs: one persistent cache for all of them
    # (the workdir's, not each run's) makes that a load.
    compile_times.use_persistent_cache(_WORKDIR.value)
    base = _CONFIG.value
    root = _WORKDIR.value
    if _CURVES.value:
        from dora_jax.bench import curves

        n = _CURVE_SFT_STEPS.value
        ckpt = base.init_checkpoint or (n and warm_start(base, os.path.join(root, f"sft_{n}"), n))
        curves.run_curves(base, root, init_checkpoint=ckpt or "", steps=_CURVE_STEPS.value,
                          seeds=_CURVE_SEEDS.value, specs=tuple(_CURVE_MODES.value))
        return
    if not base.init_checkpoint and _SFT_STEPS.value:
        base.init_checkpoint = warm_start(base, os.path.join(root, "sft"), _SFT_STEPS.value)
    bench_modes(base, root, list(_MODES.value), _STEPS.value, _REPS.value)


if __name__ == "__main__":
    app.run(main)
