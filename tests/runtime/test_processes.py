"""A run as several processes (runtime/remote.py, runtime/slice_process.py,
runtime/trainer_group.py, launch/local.py): the trainer's lead and two slice
processes on this machine, the ledger audited clean; in sync mode the tokens of the
one-process run; a slice process killed with -9 mid-run replaced while the run goes
on, nothing lost; the trainer over two processes (one jax.distributed world) training
as one process does, resuming, and a run whose second trainer process is killed with
-9 started again and resumed, nothing lost or trained twice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, audit_workdir, env_without_device_count, load_repo_config

from dora_jax.scheduler import ledger

FLAGS = ["--config=configs/tiny.py:spread", "--config.model.num_layers=1"]


def _launch(workdir, *extra, processes=3, trainer_processes=1):
    return subprocess.Popen(
        [sys.executable, "-m", "dora_jax.launch.local", f"--processes={processes}",
         f"--trainer_processes={trainer_processes}", "--",
         *FLAGS, f"--workdir={workdir}", *extra],
        cwd=REPO, env=env_without_device_count(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=600):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return out


def _audited(workdir, **overrides):
    cfg = load_repo_config("configs/tiny.py:spread", model__num_layers=1, **overrides)
    events, report = audit_workdir(cfg, str(workdir))
    assert report.ok, report.summary()
    return cfg, events


def _step_metrics(workdir):
    keep = ("step", "reward_mean", "trained_tokens", "loss")
    with open(workdir / "metrics.jsonl") as f:
        return [{k: r[k] for k in keep if k in r} for r in map(json.loads, f)
                if "reward_mean" in r]


SYNC = ["--config.coordinator.num_steps=4", "--config.coordinator.mode=sync"]


@pytest.fixture(scope="module")
def one_process_sync(tmp_path_factory):
    """The workdir of the one-process sync run every several-process run matches."""
    one = tmp_path_factory.mktemp("one")
    single = subprocess.run([sys.executable, "-m", "dora_jax.main", *FLAGS, f"--workdir={one}",
                             *SYNC], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    return one


@pytest.mark.slow
def test_three_processes_run_audited_and_sync_mode_gives_the_one_process_tokens(
        tmp_path, one_process_sync):
    many, one = tmp_path / "three", one_process_sync
    out = _finish(_launch(many, *SYNC))
    assert "slice process 1: slices [0, 1] ready" in out
    assert "slice process 2: slices [2, 3] ready" in out
    _audited(many, coordinator__num_steps=4, coordinator__mode="sync")
    summary = json.loads((many / "summary.json").read_text())
    assert summary["slice_processes"] == {"0": 1, "1": 1, "2": 2, "3": 2}
    rows = {s["row"] for s in json.loads((many / "timeline.json").read_text())}
    assert {"process 1 slice 0", "process 2 slice 3", "trainer"} <= rows, rows
    # The same seed: the same samples, so the same rewards, tokens and losses.
    assert _step_metrics(many) == _step_metrics(one) and len(_step_metrics(one)) == 4
    consumed = {d: [e["group_id"] for e in ledger.read(str(d / "ledger.jsonl"))
                    if e["event"] == "consume"] for d in (many, one)}
    assert consumed[many] == consumed[one]


def _slice_process_pid(launcher_pid, process_id):
    """The pid of the launcher's child running slice process `process_id`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"DORA_PROCESS_ID={process_id}".encode() in env:
            return int(pid)
    return None


@pytest.mark.slow
def test_a_slice_process_killed_mid_run_is_replaced_and_nothing_is_lost(tmp_path):
    workdir = tmp_path / "run"
    proc = _launch(workdir, "--config.coordinator.num_steps=40")
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 500
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    victim = _slice_process_pid(proc.pid, 2)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out = _finish(proc)
    cfg, events = _audited(workdir, coordinator__num_steps=40)
    failed = [e for e in events if e["event"] == "slice_failed"]
    assert {e["slice"] for e in failed} == {2, 3}, failed
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["slice_failures"] == 2
    [replaced] = summary["slice_process_replacements"]
    assert replaced["process"] == 2 and replaced["seconds_to_ready"] > 0
    # Whether a step trains while the killed process is away depends on the schedule:
    # the lost samples are regenerated under their own versions, which the other
    # process's slices may not hold (one run trained none in a 5.9 s absence). The
    # figures are reported, and every step after the loss is trained.
    lost_at = min(e["time"] for e in failed)
    with open(metrics) as f:
        step_ends = [r["time"] for r in map(json.loads, f) if "reward_mean" in r]
    after = [t for t in step_ends if t > lost_at]
    away = [t for t in after if t < lost_at + replaced["seconds_to_ready"]]
    assert after and len(step_ends) == 40, (lost_at, replaced, step_ends)
    print(f"slice process 2 lost at {lost_at:.2f} s (run clock); next step "
          f"{after[0] - lost_at:.2f} s later; {len(away)} steps trained before its "
          f"replacement was ready ({replaced['seconds_to_ready']} s); "
          + out.splitlines()[-2])
    standing = ledger.standing(events)
    consumed = [e["group_id"] for e in standing if e["event"] == "consume"]
    assert len(consumed) == len(set(consumed)) == 40 * cfg.coordinator.train_batch_size


def _trainer_metric(workdir, name):
    with open(workdir / "metrics.jsonl") as f:
        return [r["trainer"][name] for r in map(json.loads, f) if "trainer" in r]


def _consumed(workdir):
    return [e["group_id"] for e in ledger.standing(ledger.read(str(workdir / "ledger.jsonl")))
            if e["event"] == "consume"]


@pytest.mark.slow
def test_a_trainer_over_two_processes_trains_as_one_resumes_and_survives_a_kill(
        tmp_path, one_process_sync):
    """Processes 0 and 1 hold the trainer's mesh (data=2 x fsdp=2) two devices each,
    process 2 the four slices. Sync mode: the same groups, rewards and tokens as one
    process; the losses equal to float32 rounding (the gradients' sums cross
    processes). Then the same command to 12 steps resumes from step 4, and kill -9 of
    trainer process 1 mid-way ends the trainer's jax.distributed world: the launcher
    starts every process again and the run resumes from its last checkpoint; every
    step trained, audit clean, no group consumed twice."""
    many, one = tmp_path / "two_trainers", one_process_sync
    out = _finish(_launch(many, *SYNC, trainer_processes=2))
    assert "slice process 2: slices [0, 1, 2, 3] ready" in out
    _audited(many, coordinator__num_steps=4, coordinator__mode="sync")
    assert _step_metrics(many) == _step_metrics(one) and len(_step_metrics(one)) == 4
    for name in ("loss", "grad_norm"):
        got, want = _trainer_metric(many, name), _trainer_metric(one, name)
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6) and len(got) == 4, name
    assert _consumed(many) == _consumed(one)

    steps = 12
    proc = _launch(many, f"--config.coordinator.num_steps={steps}",
                   "--config.coordinator.mode=sync", trainer_processes=2)
    metrics, ledger_path = many / "metrics.jsonl", many / "ledger.jsonl"
    deadline = time.monotonic() + 500
    while len(metrics.read_text().splitlines()) < 7:  # past the checkpoint at step 5
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    victim = _slice_process_pid(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed, training_again = time.monotonic(), None
    while proc.poll() is None and training_again is None:  # a step consumed after resume
        kinds = [json.loads(x).get("event") for x in ledger_path.read_text().splitlines()
                 if x.endswith("}")]
        resumes = [k for k, kind in enumerate(kinds) if kind == "resume"]
        if len(resumes) == 2 and "consume" in kinds[resumes[1]:]:
            training_again = time.monotonic() - killed
        time.sleep(0.2)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    assert "resumed from step 4" not in out  # the summary names the last resume
    assert "trainer process 1 exited (-9): starting the run again" in out + err
    summary = json.loads((many / "summary.json").read_text())
    assert summary["steps"] == steps and summary["resumed_from_step"] >= 5, summary
    cfg, events = _audited(many, coordinator__num_steps=steps, coordinator__mode="sync")
    assert [e["step"] for e in events if e["event"] == "resume"] == [
        4, summary["resumed_from_step"]]
    consumed = _consumed(many)
    assert len(consumed) == len(set(consumed)) == steps * cfg.coordinator.train_batch_size
    assert training_again is not None
    print(f"trainer process 1 killed; the run resumed from step "
          f"{summary['resumed_from_step']} and trained again {training_again:.1f} s "
          "after the kill")
