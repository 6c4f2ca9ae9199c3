"""The simulator's sweep: its plan of runs, its summary ratios worked by hand, and
its command line."""

import subprocess
import sys

import pytest

from dora_jax.sim import PRESETS
from dora_jax.sim.sweep import headline, plan


def test_plan_runs_sync_once_per_split_and_colocated_sync_once_per_seed():
    runs = plan(PRESETS["paper128"], [32, 64], [1, 1.5], [0, 1], ["dora", "partial_rollout"])
    keys = [(key, mode) for key, _, mode in runs]
    assert len(keys) == len(set(keys)) == 2 * (1 + 2 * (1 + 2 * 2))
    for key, preset, mode in runs:
        split, factor, seed = key
        assert preset.workload.seed == seed
        if mode == "colocated_sync":
            assert split is None and factor is None
        elif mode == "sync":
            assert split == preset.trainer_devices and factor is None
        else:
            assert preset.rollout_batch_size == round(factor * preset.train_batch_size)


def test_headline_by_hand():
    """Two splits x two batch sizes, one seed. dora 10/12 at split 32 (RBS x1, x2)
    and 8/8 at 64; partial 11/12 and 8/6: ratios 1.1, 1, 1, 0.75 (worst 0.75,
    median 1); spread 12/10 = 1.2 at 32; bounds 10 and 6: worst 8/6."""
    def r(split, f, mode, minutes, bound=None):
        return dict(key=(split, f, 0), mode=mode, minutes=minutes, bound=bound)

    results = [r(32, 1, "dora", 10, 10), r(32, 2, "dora", 12, 10), r(64, 1, "dora", 8, 6),
               r(64, 2, "dora", 8, 6), r(32, 1, "partial_rollout", 11),
               r(32, 2, "partial_rollout", 12), r(64, 1, "partial_rollout", 8),
               r(64, 2, "partial_rollout", 6), r(32, None, "sync", 20), r(64, None, "sync", 16),
               dict(key=(None, None, 0), mode="colocated_sync", minutes=20, bound=None)]
    h = headline(results, [32, 64], [1, 2], [0])
    assert h["partial_rollout"] == (0.75, 1.0)
    assert h["colocated_sync"] == (20 / 12, 2.25)  # 2, 1.67, 2.5, 2.5
    assert h["sync"] == (20 / 12, 2.0)  # 2, 1.67, 2, 2
    assert "partial_rollout_rounds" not in h
    assert h["bound_worst"] == pytest.approx(8 / 6)
    assert h["spread_worst"] == pytest.approx(1.2)


def test_command_line_prints_the_summary_lines():
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.sim.sweep", "--preset=paper64", "--trainer_devices=32",
         "--rbs=1,2", "--seeds=0", "--steps=2", "--jobs=1"],
        capture_output=True, text=True, check=True, timeout=600).stdout
    lines = out.strip().splitlines()
    names = [line.split(":")[0] for line in lines if ": " in line and line.startswith("dora")]
    assert names == ["dora/partial_rollout worst", "dora/partial_rollout median",
                     "dora/partial_rollout_rounds median", "dora/sync median",
                     "dora/sync at the same split median", "dora step / bound worst",
                     "dora step spread over rollout batch sizes worst",
                     "dora version-mismatch slot time worst"]
    assert all(float(line.split(": ")[1].split("%")[0]) >= 0 for line in lines
               if line.startswith("dora"))


@pytest.mark.parametrize("args,said", [
    (["--trainer_devices=30"], "--trainer_devices: 30"),
    (["--rbs=0.5"], "--rbs: a rollout batch holds at least one"),
    (["--seeds=a"], "--seeds, --trainer_devices and --rbs take numbers"),
    (["--modes=partial_rollout"], "--modes must include dora"),
])
def test_command_line_refuses_bad_input_with_one_line(args, said):
    out = subprocess.run([sys.executable, "-m", "dora_jax.sim.sweep", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and said in out.stderr + out.stdout


def test_plan_runs_dora_once_per_versions_per_slice_and_the_baselines_once():
    runs = plan(PRESETS["paper128_lora"], [64], [1], [0], ["dora", "partial_rollout"],
                versions=[1, 4])
    modes = sorted(mode for _, _, mode in runs)
    assert modes == ["colocated_sync", "dora@1", "dora@4", "partial_rollout", "sync"]
    for _, preset, mode in runs:
        if mode.startswith("dora@"):
            assert preset.versions_per_slice == int(mode[5:])


def test_command_line_sweeps_versions_per_slice():
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.sim.sweep", "--preset=paper128_lora",
         "--trainer_devices=64", "--rbs=1", "--seeds=0", "--steps=2", "--jobs=1",
         "--versions=1,K+1", "--modes=dora,partial_rollout"],
        capture_output=True, text=True, check=True, timeout=600).stdout
    assert "dora with 1 version per slice:" in out and "dora with 4 versions per slice:" in out
    assert out.count("dora/partial_rollout worst") == 2
    assert out.count("dora version-mismatch slot time worst") == 2
