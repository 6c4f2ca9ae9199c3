"""End to end: each mode trains a few steps on 8 fake devices; an auditor over the
ledger confirms C1-C3 (C1 may fail only in partial_rollout, by design)."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, SUITE_XLA_FLAGS, audit_workdir, env_without_device_count

from dora_jax.model import hf_checks
from dora_jax.runtime import experiment
from dora_jax.scheduler import ledger


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "partial_rollout", "dora"])
def test_mode_end_to_end_satisfies_constraints(mode, tmp_path, small_config):
    cfg = small_config(mode)
    workdir = str(tmp_path)
    summary = experiment.run(cfg, workdir)
    events, report = audit_workdir(cfg, workdir)
    assert report.steps == cfg.coordinator.num_steps
    assert not report.c2 and not report.c3 and not report.batch_size, report.summary()
    if mode != "partial_rollout":
        assert not report.c1, report.c1[:3]
    # Every consumed sample carries its provenance.
    consumed = [e for e in events if e["event"] == "consume"]
    for e in consumed:
        for s in e["samples"]:
            assert s["finish"] in ("eos", "length") and s["slices"] and 0 <= s["reward"] <= 1
    # Admission order is ledger order and group ids are unique.
    admitted = [e["group_id"] for e in events if e["event"] == "admit"]
    assert admitted == sorted(set(admitted))

    metrics = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(cfg.coordinator.num_steps))
    for m in metrics:
        assert m["trained_tokens"] > 0
        assert set(m["slot_utilisation"]) == {str(i) for i in range(cfg.mesh.num_slices)}
        assert m["trainer"]["version"] == m["step"] + 1
    assert summary["steps"] == cfg.coordinator.num_steps and summary["mode"] == mode
    assert 0 <= summary["trainer_wait_fraction"] <= 1
    assert os.path.getsize(os.path.join(workdir, "timeline.png")) > 10_000
    ckpt = os.listdir(os.path.join(workdir, "checkpoints"))
    assert str(cfg.coordinator.num_steps) in ckpt
    if mode == "sync":
        assert set(report.staleness) == {0}


def test_countdown_task_end_to_end(tmp_path, load_config):
    """The long-tailed countdown source runs through the whole loop: prompts, rewards
    of the countdown verifier in [0, 1], a clean audit."""
    c = load_config("configs/tiny.py:spread", validate=False)
    c.model.num_layers = 1
    c.rollout.update(dict(slots_per_slice=4, max_prefill_length=8, max_decode_len=8,
                          prefill_buckets=(8,)))
    c.trainer.length_buckets = (16,)
    c.coordinator.update(dict(group_size=2, train_batch_size=2, rollout_batch_size=4,
                              num_steps=2))
    c.data.update(dict(source="countdown", reward="countdown", max_count=7, num_prompts=32))

    cfg = hf_checks.validated(c, num_devices=8)
    experiment.run(cfg, str(tmp_path))
    events, report = audit_workdir(cfg, str(tmp_path))
    assert report.ok and report.steps == 2, report.summary()
    rewards = [s["reward"] for e in events if e["event"] == "consume" for s in e["samples"]]
    assert all(0 <= r <= 1 for r in rewards)


@pytest.mark.slow
def test_main_entry_point(tmp_path):
    """`python -m dora_jax.main` with command-line overrides, as a user runs it."""
    env = dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS)
    cmd = [sys.executable, "-m", "dora_jax.main", "--config=configs/moe.py:tiny",
           f"--workdir={tmp_path}", "--config.coordinator.num_steps=2",
           "--config.coordinator.mode=sync", "--config.model.num_layers=1",
           "--config.rollout.max_decode_len=4", "--config.rollout.slots_per_slice=4",
           "--config.trainer.dual_clip=3.0"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "summary: steps=2" in out.stdout
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["mode"] == "sync"
    events = ledger.read(str(tmp_path / "ledger.jsonl"))
    assert sum(e["event"] == "consume" for e in events) == 2 * 4


def test_main_rejects_bad_override_before_compute(tmp_path):
    env = dict(os.environ, XLA_FLAGS=SUITE_XLA_FLAGS)
    cmd = [sys.executable, "-m", "dora_jax.main", "--config=configs/tiny.py",
           f"--workdir={tmp_path}", "--config.coordinator.rollout_batch_size=2"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode != 0
    assert "config.coordinator.rollout_batch_size" in out.stderr
    assert not os.path.exists(tmp_path / "ledger.jsonl")


# The quickstart notebook: tests/test_notebooks.py::
# test_colab_quickstart_runs_from_a_wheel_in_a_fresh_environment runs its cells (from
# the wheel, in a fresh environment) and checks what this test did: the audit, the
# steps, one reward per step, the curve and the export's files.


def test_main_refuses_a_workdir_of_another_config_with_one_line(tmp_path):
    """A workdir remembers its config: main on it with another one stops before any
    compute, with one line naming the differing field and no traceback."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO, load_repo_config

    from dora_jax.runtime import recovery

    (tmp_path / "config.json").write_text(json.dumps(recovery.config_json(
        load_repo_config("configs/tiny.py:spread", num_devices=8))))
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.main", "--config=configs/tiny.py:spread",
         f"--workdir={tmp_path}", "--config.coordinator.mode=sync"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "XLA_FLAGS": SUITE_XLA_FLAGS})
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "coordinator.mode: 'dora' -> 'sync'" in out.stderr and "--fresh" in out.stderr


def _main(args, faked_devices=False, timeout=300):
    """main on a CPU host that has not faked its devices, or, with `faked_devices`,
    with the suite's 8."""
    env = dict(os.environ) if faked_devices else env_without_device_count()
    return subprocess.run([sys.executable, "-m", "dora_jax.main", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_first_run_on_a_cpu_host_fakes_the_devices_and_says_so(tmp_path):
    """Without XLA_FLAGS, main on a CPU host fakes the devices the config's mesh
    needs before JAX starts, says so in one line, and runs."""
    out = _main(["--config=configs/tiny.py", f"--workdir={tmp_path}",
                 "--config.coordinator.num_steps=2", "--config.model.num_layers=1"])
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("no accelerator found: running on 3 CPU devices"), first
    assert events_ok(tmp_path, "configs/tiny.py")
    # Before the silent compiles, one line says what they are; after, what they took.
    assert re.search(r"^compiling: train step, prefill buckets and generate.* \(first run: "
                     r"timing unknown\)$", out.stdout, flags=re.M), out.stdout
    assert re.search(r"^compiled in \d+ s: train step [\d.]+ s, ", out.stdout, flags=re.M)
    # No sharding XLA reaches only by replicating a tensor (when the programs compile
    # here rather than come from the compilation cache).
    assert "rematerialization" not in out.stderr


def test_a_mesh_beyond_the_faked_devices_names_xla_flags(tmp_path):
    """With XLA_FLAGS fixing 8 CPU devices, a 9-device config is one line: it needs 9,
    there are 8, and XLA_FLAGS can fake 9 (no smaller variant to name)."""
    out = _main(["--config=configs/tiny.py", "--config.mesh.num_slices=8",
                 f"--workdir={tmp_path}"], faked_devices=True)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert lines[0] == ("error: config.mesh: configs/tiny.py needs 9 devices (trainer 1 + 8 "
                        "decode slices x 1), but this host has 8 (cpu): set XLA_FLAGS="
                        "--xla_force_host_platform_device_count=9 to fake them on a CPU")


def events_ok(workdir, spec="configs/tiny.py:spread") -> bool:
    from conftest import load_repo_config

    from dora_jax.scheduler import SchedulerConfig

    cfg = load_repo_config(spec, coordinator__num_steps=2, model__num_layers=1)
    events = ledger.read(os.path.join(workdir, "ledger.jsonl"))
    return ledger.audit_run(events, SchedulerConfig.from_config(cfg),
                            cfg.rollout.max_decode_len).ok


@pytest.mark.parametrize("args, says", [
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such file"),
    (["--config=nope"], "--config=nope: no such shipped config (a path to a config file, "
                        "or one of: longtail, moe, multiturn, quickstart, qwen3_gsm8k, tiny)"),
    (["--config=configs/moe.py:bogus"], "unknown variant 'bogus'"),
    (["--config=moe:bogus"], "unknown variant 'bogus'"),
    # The flagship on a host without its chips: how many, and the variant to run here.
    (["--config=configs/moe.py"], "error: config.mesh: configs/moe.py needs 256 devices "
     "(trainer 128 + 8 decode slices x 16), but this host has 1 (cpu): run "
     "configs/moe.py:tiny here"),
    (["--config=moe"], "moe needs 256 devices (trainer 128 + 8 decode slices x 16), but this "
     "host has 1 (cpu): run moe:tiny here"),
    (["--config=moe:lora"], "but this host has 1 (cpu): run moe:tiny_lora here"),
    (["--config=configs/moe.py", "--config.data.source=jsonl",
      "--config.data.path=/nowhere/prompts.jsonl"],
     "error: config.data.path: no such file: /nowhere/prompts.jsonl"),
    (["--config=configs/moe.py", "--config.data.tokenizer=dora_jax/assets/tokenizer"],
     "config.data.source: 'countdown' is a token task"),
    (["--config=configs/tiny.py", "--config.coordinator.num_steps=abc"], "invalid literal"),
    (["--config=configs/tiny.py", "--config.coordinator.nope=3"],
     "--config.coordinator.nope: no such config field"),
    (["--config=configs/tiny.py", "--config.coordinator.max_staleness=-1"],
     "config.coordinator.max_staleness: must be >= 0"),
    (["--config=configs/tiny.py", "--config.model.checkpoint=/nowhere"],
     "config.model.checkpoint: /nowhere: no such checkpoint directory"),
    (["--config=configs/tiny.py", "--config.data.source=gsm8k",
      "--config.data.path=/nowhere.jsonl", "--config.data.tokenizer=/nowhere"],
     "config.data.tokenizer"),
])
def test_bad_input_stops_with_one_line_and_no_traceback(args, says, tmp_path):
    out = _main([*args, f"--workdir={tmp_path}"])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], out.stderr
    assert not os.path.exists(tmp_path / "ledger.jsonl")


@pytest.mark.parametrize("entry, extra", [
    ("dora_jax.sft", []), ("dora_jax.export", ["--out=/tmp/never_written"])])
@pytest.mark.parametrize("args, says", [
    (["--config=configs/nope.py"], "--config=configs/nope.py: no such file"),
    (["--config=configs/tiny.py", "--config.coordinator.mode=dorra"],
     "config.coordinator.mode: must be one of"),
    (["--config=configs/tiny.py", "--config.coordinator.modee=dora"],
     '--config.coordinator.modee: no such config field (did you mean "mode"?)'),
])
def test_every_entry_point_reports_bad_input_in_one_line(entry, extra, args, says, tmp_path):
    """sft and export share main's command line (dora_jax/runtime/cli.py): the same bad input
    ends each of them with the same one line, before any compute."""
    env = env_without_device_count()
    out = subprocess.run([sys.executable, "-m", entry, *args, *extra,
                          f"--workdir={tmp_path}"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], out.stderr
    assert not os.listdir(tmp_path)


def test_bad_data_stops_with_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "2 + 2?", "answer": "four"}\n')
    out = _main(["--config=configs/qwen3_gsm8k.py:tiny", f"--config.data.path={bad}",
                 f"--workdir={tmp_path / 'run'}"])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"error: {bad}:1:"), lines[0]


def test_help_names_the_main_overrides():
    out = _main(["--help"])
    assert out.returncode == 0
    for name in ("--config.coordinator.mode", "--config.coordinator.max_staleness",
                 "--config.model.checkpoint", "--config.data.source", "--fresh"):
        assert name in out.stdout, name
