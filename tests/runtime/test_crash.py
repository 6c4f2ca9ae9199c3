"""Kill -9 at random points, resume with the same command, audit: the crash
benchmark at its smallest (5 kills), end to end through `python -m dora_jax.main`."""

import json
import subprocess
import sys

import pytest
from conftest import REPO

# Two decode slices, not the tiny default's four: each process traces half as many
# slice programs, and two still hold two versions at once and share the work.
SMALL = ("--config.mesh.num_slices=2",)


@pytest.mark.slow
def test_five_kills_lose_and_duplicate_nothing(tmp_path):
    """Also the entry-point smoke test of `python -m dora_jax.bench.crash`: exit 0 and
    its documented final line (kills, lost, duplicated, steps), here exactly."""
    cmd = [sys.executable, "-m", "dora_jax.bench.crash", "--config=configs/tiny.py:spread",
           "--kills=5", "--max_delay=1", "--startup_kills=0.2", "--seed=1",
           f"--workdir={tmp_path / 'run'}", "--config.model.num_layers=1", *SMALL,
           "--config.coordinator.num_steps=60", "--config.coordinator.checkpoint_every=2"]
    # The kills may cut the suite's compilation-cache entries short: JAX then fails
    # their checksum and compiles again (tests/conftest.py).
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "kills: 5, lost groups: 0, duplicated groups: 0, steps: 60/60"
    resumes = next(x for x in lines if x.startswith("resumes: "))
    assert not resumes.startswith("resumes: 0,"), out.stdout  # the kills hit a running job


# Each kill in a run resumed from the one before: the later points are reached in a
# resumed run (a save, groups waiting) as well as a fresh one.
KILLS = (("train", 3), ("save", 1), ("finished_waiting", 5))


@pytest.mark.slow
def test_kills_at_chosen_points_resume_whole(tmp_path):
    """SIGKILL at chosen points of the run (coordinator.kill_point, by count): a train
    step begun, a checkpoint being written, finished groups waiting on a busy
    trainer, one after the other. The same command without the drill then finishes
    it: one `resume` line per kill, nothing lost or trained twice, every step trained,
    the ledger audited clean."""
    from conftest import assert_resumed_whole, load_repo_config

    workdir, steps = tmp_path / "run", 12
    overrides = ["--config.model.num_layers=1", *SMALL, f"--config.coordinator.num_steps={steps}",
                 "--config.coordinator.checkpoint_every=2"]
    cmd = [sys.executable, "-m", "dora_jax.main", "--config=configs/tiny.py:spread",
           f"--workdir={workdir}", *overrides]
    for point, after in KILLS:
        killed = subprocess.run(cmd + [f"--config.coordinator.kill_point={point}",
                                       f"--config.coordinator.kill_after={after}"],
                                cwd=REPO, capture_output=True, text=True, timeout=600)
        assert killed.returncode == -9, (point, killed.stderr[-3000:])
        assert f"killing the run at {point}" in killed.stderr
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = load_repo_config("configs/tiny.py:spread", model__num_layers=1, mesh__num_slices=2,
                           coordinator__num_steps=steps, coordinator__checkpoint_every=2)
    standing = assert_resumed_whole(cfg, workdir, resumes=len(KILLS))
    consumed = [e for e in standing if e["event"] == "consume"]
    # The summary is the whole run's, every process's, not the last one's alone.
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == steps and 0 < summary["resumed_from_step"] < steps
    assert summary["groups_consumed"] == len(consumed)
    segments = summary["segments"]
    assert len(segments) == len(KILLS) + 1 and segments[0]["from_step"] == 0
    assert segments[-1]["from_step"] == summary["resumed_from_step"]
    starts = [seg["from_step"] for seg in segments]
    assert starts == sorted(starts) and segments[0]["wall_seconds"] > 0
    assert segments[-1]["from_step"] + segments[-1]["steps"] == steps
    # And the audit command agrees on this real workdir.
    audit = subprocess.run([sys.executable, "-m", "dora_jax.audit", str(workdir)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert f"steps: {steps}\n" in audit.stdout
