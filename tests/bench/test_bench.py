"""bench.modes and bench.curves: run specs, the table's figures from audited runs,
the headline ratios, and one small end-to-end run of each entry."""

import json

import numpy as np
import pytest

from dora_jax.bench import curves, modes, runs


def test_parse_spec():
    assert runs.parse_spec("dora_k3") == ("dora", 3)
    assert runs.parse_spec("partial_rollout_k1") == ("partial_rollout", 1)
    assert runs.parse_spec("one_step_off") == ("one_step_off", None)
    assert runs.parse_spec("colocated_sync") == ("colocated_sync", None)
    assert runs.parse_spec("dora_k2_v1") == ("dora", 2)
    assert runs.spec_parts("dora_k2_v1") == ("dora", {"k": 2, "v": 1})
    assert runs.spec_parts("partial_rollout_e32") == ("partial_rollout", {"e": 32})
    assert runs.spec_parts("one_step_off") == ("one_step_off", {})


def test_a_run_spec_sets_episodes_per_slice(load_config):
    base = load_config("configs/multiturn.py:tiny", validate=False)
    assert runs.run_config(base, "dora_k2_e16", steps=2).rollout.max_episodes_per_slice == 16
    assert runs.run_config(base, "dora_k2", steps=2).rollout.max_episodes_per_slice == 0


def test_ratio_lines_use_the_better_sync_and_the_best_other_mode():
    rows = {"colocated_sync": {"tokens/s": 90.0}, "sync": {"tokens/s": 100.0},
            "partial_rollout": {"tokens/s": 120.0}, "dora_k1": {"tokens/s": 150.0},
            "dora_k2": {"tokens/s": 180.0}}
    lines = modes.ratio_lines(rows, "dora_k2")
    assert lines[-2:] == ["dora/sync tokens/s ratio: 1.80",
                          "dora/best-other tokens/s ratio: 1.50"]
    assert "dora_k1/sync tokens/s ratio: 1.50" in lines


def test_median_row_and_staleness_sum():
    runs = [{"tokens_per_second": t, "step_seconds": 1.0, "trainer_wait_fraction": 0.1,
             "trainer_wait_split": {"fill_seconds": 1.0, "guard": 0.0, "starvation": 0.1},
             "mean_slot_utilisation": 0.5, "rollout_only_share": 0.2, "reward_mean": 0.5,
             "staleness": {"0": 4, "1": n}} for t, n in ((3.0, 1), (1.0, 2), (2.0, 3))]
    row = modes.median_row(runs)
    assert row["tokens/s"] == 2.0 and row["staleness"] == {0: 12, 1: 6}


def test_smooth_is_a_trailing_mean():
    x = np.array([[1.0, 3.0, 5.0, 7.0]])
    np.testing.assert_allclose(curves._smooth(x, 2), [[1.0, 2.0, 4.0, 6.0]])
    np.testing.assert_allclose(curves._smooth(x, 10), [[1.0, 2.0, 3.0, 4.0]])


# bench.modes end to end (colocated_sync, sync and dora_k2 audited, the table's
# staleness, the ratio lines): tests/test_entry_points.py::test_bench_modes, on the
# run its fixture makes once per session.


@pytest.mark.slow
def test_curves_entry_point(tmp_path):
    """`python -m dora_jax.bench.modes --curves` end to end (its flags, the shared
    run helpers), on the tiny config from the random init."""
    import subprocess
    import sys

    from conftest import REPO

    cmd = [sys.executable, "-m", "dora_jax.bench.modes", "--config=configs/tiny.py:spread",
           f"--workdir={tmp_path}", "--curves", "--curve_modes=dora_k1", "--curve_seeds=1",
           "--curve_steps=3", "--curve_sft_steps=0", "--config.model.num_layers=1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    c = json.load(open(tmp_path / "curves.json"))
    (run,) = c["runs"]["dora_k1"]
    assert run["audit_ok"] and len(run["reward"]) == len(run["time"]) == 3
    assert (tmp_path / "curves.png").exists()


def test_measured_runs_save_no_periodic_checkpoints(load_config):
    """A save pauses the coordinator between steps, which costs sync more than the
    asynchronous modes: measured runs leave it out (and leave the base config alone)."""
    from dora_jax.bench.runs import run_config

    base = load_config("configs/tiny.py:spread", validate=False)
    c = run_config(base, "dora_k1", steps=7)
    assert (c.coordinator.mode, c.coordinator.max_staleness, c.coordinator.num_steps,
            c.coordinator.checkpoint_every) == ("dora", 1, 7, 0)
    assert base.coordinator.checkpoint_every == 5


@pytest.mark.parametrize("variant", [None, "lora_multi"])
@pytest.mark.parametrize("flag", ["modes", "curve_modes"])
def test_every_default_run_of_bench_modes_builds_a_valid_config(flag, variant, load_config):
    """`python -m dora_jax.bench.modes --workdir=DIR` as docs/benchmarks.md gives it: each of
    its default runs on its default config (configs/longtail.py, and its variant with
    several versions per slice) passes validation, the colocated layout's packed
    micro-batches included (they span twice the shards); dora holds the K + 1
    versions of its window per slice, every other mode one."""
    from dora_jax.bench.runs import parse_spec, run_config
    from dora_jax.model import hf_checks

    path = "configs/longtail.py" + (f":{variant}" if variant else "")
    base = load_config(path, validate=False)
    per_shard = base.trainer.tokens_per_microbatch // 4  # its trainer: data 2 x fsdp 2
    for spec in getattr(modes, f"_{flag.upper()}").default:
        cfg = hf_checks.validated(run_config(base, spec, steps=2), num_devices=8)
        shards = cfg.mesh.trainer["data"] * cfg.mesh.trainer["fsdp"]
        assert cfg.trainer.tokens_per_microbatch == per_shard * shards, spec
        multi = variant and parse_spec(spec)[0] == "dora"
        assert cfg.rollout.versions_per_slice == (
            cfg.coordinator.max_staleness + 1 if multi else 1), spec


# ------------------------------------------------------------------ bench.adversarial

def test_adversarial_corpus_scores_zero_without_running_code(tmp_path):
    """A slice of the shipped corpus through the run's reward pool: code payloads for
    each verifier and a bomb; the summary line counts what happened."""
    from dora_jax.bench import adversarial, adversarial_corpus
    from dora_jax.rewards import verifiers
    from dora_jax.rewards.pool import RewardPool

    cases = adversarial_corpus.cases()
    picked = [c for c in cases if c["kind"].startswith("code/")][::25]
    picked += [c for c in cases if c["kind"] == "bomb/math"][:1]
    assert {c["kind"].split("/")[1] for c in picked} >= {"gsm8k", "math", "countdown_expr"}
    with RewardPool(verifiers.record_reward, 2, 2.0) as pool:
        results = adversarial.score_all(picked, pool, 2, str(tmp_path))
    assert [r["reward"] for r in results] == [0.0] * len(picked)
    assert not any(r["code_executed"] for r in results) and not list(tmp_path.iterdir())
    assert "timed out after 2 s" in results[-1]["error"]
    line = adversarial.summary_line(results, 0.0123)
    assert line.startswith(f"responses: {len(picked)}, code executed: 0, nonzero rewards: 0, "
                           "max score seconds: ")
    assert line.endswith("max coordinator stall seconds: 0.012")


def test_adversarial_counts_code_that_ran(tmp_path):
    """The count is not vacuous: a response whose sentinel exists, or whose scoring
    was blocked, counts as code executed."""
    from dora_jax.bench import adversarial
    from dora_jax.rewards.pool import RewardPool

    (tmp_path / "case-0").write_text("made")  # as if case 0's payload had run
    cases = [{"record": {}, "text": "x", "kind": "k"}, {"record": {}, "text": "y", "kind": "k"}]
    with RewardPool(_touch_reward, 1) as pool:
        results = adversarial.score_all(cases, pool, 1, str(tmp_path))
    assert [r["code_executed"] for r in results] == [True, True]


def _touch_reward(record, text):
    import os

    os.system("true")  # blocked in the worker: reported, scores 0
    return 1.0


def test_adversarial_responses_file_errors_name_the_line(tmp_path):
    from dora_jax.bench import adversarial

    path = tmp_path / "cases.jsonl"
    path.write_text('{"record": {"verifier": "gsm8k"}, "text": "#### 1"}\n\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"cases\.jsonl:3: expected"):
        adversarial.read_cases(str(path))
    path.write_text('{"record": {"verifier": "gsm8k"}, "text": "#### 1"}\n')
    assert adversarial.read_cases(str(path))[0]["text"] == "#### 1"


def test_host_profile_counts_only_the_coordinators_busy_samples(tmp_path):
    """bench.host's breakdown: main-thread samples inside Runtime.run, less those
    waiting on the event queue, at 10 ms a sample (100 Hz), per step."""
    from dora_jax.bench.host import coordinator_profile

    run = "Runtime.run (dora_jax/runtime/loop.py:300)"
    lines = [
        f"thread (1): MainThread;main (dora_jax/main.py:1);{run};"
        f"Runtime._decide (dora_jax/runtime/loop.py:290);Driver.execute (d.py:20) 30",
        f"thread (1): MainThread;{run};Queue.get (queue.py:10);Condition.wait (t.py:3) 500",
        f"thread (1): MainThread;{run};Runtime._handle (dora_jax/runtime/loop.py:215) 10",
        "thread (2): slice 0;SliceWorker._loop (dora_jax/runtime/worker.py:1) 400",
        "thread (1): MainThread;warm_up (dora_jax/runtime/experiment.py:5) 900",
    ]
    path = tmp_path / "raw.txt"
    path.write_text("\n".join(lines) + "\n")
    out = coordinator_profile(str(path), steps=10)
    assert out["busy_ms_per_step"] == 40.0  # (30 + 10) samples x 10 ms / 10 steps
    assert out["top"][0] == ("Runtime._decide (loop.py) > Driver.execute (d.py)", 30.0)


def test_trainer_bench_on_one_device_runs_the_one_device_mesh(tmp_path):
    """`bench.trainer --mesh=single` on a host with one device (an accelerator host),
    whose config's 8-device mesh cannot fit there: the bench builds its own meshes."""
    import os
    import subprocess
    import sys

    from conftest import DEVICE_COUNT_FLAG, REPO, TEST_XLA_FLAGS

    env = dict(os.environ, XLA_FLAGS=f"{DEVICE_COUNT_FLAG}=1 {TEST_XLA_FLAGS}")
    cmd = [sys.executable, "-m", "dora_jax.bench.trainer", "--mesh=single", "--groups=2",
           "--group_size=2", "--steps=1", "--rounds=1", "--config.model.num_layers=1",
           f"--json_out={tmp_path / 'trainer.json'}"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "devices=1 " in out.stdout
    rates = json.load(open(tmp_path / "trainer.json"))["tokens_per_s"]
    assert rates["trainer[single mesh 1x1x1x1]"] > 0
    assert not [name for name in rates if "config mesh" in name]


def test_trainer_bench_compares_routing_replay_with_recompute():
    import re
    import subprocess
    import sys

    from conftest import REPO

    cmd = [sys.executable, "-m", "dora_jax.bench.trainer", "--config=configs/moe.py:tiny",
           "--moe_routing", "--groups=2", "--group_size=4", "--steps=1", "--rounds=1"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "routing 4 bytes per token (2 layers x 2 ids)" in out.stdout
    assert float(re.search(r"replay/recompute step time: ([\d.]+)", out.stdout)[1]) > 0
    dense = subprocess.run(cmd[:3] + ["--config=configs/tiny.py:spread", "--moe_routing"], cwd=REPO,
                           capture_output=True, text=True, timeout=600)
    assert dense.returncode != 0 and "--moe_routing needs an MoE config" in dense.stderr
