"""Kill -9 at random points, resume with the same command, audit: the crash
benchmark at its smallest (5 kills), end to end through `python -m dora_jax.main`."""

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow
def test_five_kills_lose_and_duplicate_nothing(tmp_path):
    cmd = [sys.executable, "-m", "dora_jax.bench.crash", "--config=configs/tiny.py",
           "--kills=5", "--max_delay=1", "--startup_kills=0.2", "--seed=1",
           f"--workdir={tmp_path / 'run'}", "--config.model.num_layers=1",
           "--config.coordinator.num_steps=60", "--config.coordinator.checkpoint_every=2"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "kills: 5, lost groups: 0, duplicated groups: 0, steps: 60/60"
    resumes = next(x for x in lines if x.startswith("resumes: "))
    assert not resumes.startswith("resumes: 0,"), out.stdout  # the kills hit a running job
