"""bench.jetstream: the parts that need neither JetStream nor the network (the check
itself runs where `pip install -e ".[jetstream]"` and GitHub are at hand)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from dora_jax import serve
from dora_jax.bench import jetstream

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(*args, cwd):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def origin(tmp_path):
    """A repository of two commits; (its path, first commit, second commit)."""
    repo = tmp_path / "origin"
    repo.mkdir()
    _git("init", "--quiet", cwd=repo)
    (repo / "a.txt").write_text("1")
    _git("add", "a.txt", cwd=repo)
    _git("commit", "--quiet", "-m", "one", cwd=repo)
    first = _git("rev-parse", "HEAD", cwd=repo)
    (repo / "a.txt").write_text("2")
    _git("commit", "--quiet", "-am", "two", cwd=repo)
    return repo, first, _git("rev-parse", "HEAD", cwd=repo)


@needs_git
def test_a_clone_is_checked_out_at_the_commit_asked(origin, tmp_path):
    repo, first, _ = origin
    src = tmp_path / "src"
    assert jetstream.checkout(str(src), str(repo), commit=first) == first
    assert (src / "a.txt").read_text() == "1"
    # An existing checkout is reused, not cloned again.
    assert jetstream.checkout(str(src), "/nonexistent", commit=first) == first


@needs_git
def test_a_repository_without_jetstream_s_final_commit_is_refused(origin, tmp_path):
    repo, _, _ = origin
    with pytest.raises(jetstream.CheckError, match="no commit acd4f5a"):
        jetstream.checkout(str(tmp_path / "src"), str(repo))


def test_a_directory_that_is_not_a_checkout_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(jetstream.CheckError, match="not a git checkout"):
        jetstream.checkout(str(tmp_path), "/nonexistent")


def test_counts_read_pytest_s_own_report(tmp_path):
    (tmp_path / "test_three.py").write_text(
        "import pytest\n"
        "def test_passes(): pass\n"
        "def test_fails(): assert False\n"
        "def test_skips(): pytest.skip('no')\n")
    report = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={report}", str(tmp_path / "test_three.py")],
                   cwd=tmp_path, capture_output=True)
    assert jetstream.counts(str(report)) == {"tests": 3, "failed": 1, "skipped": 1,
                                             "passed": 1}


def test_the_tests_it_runs_exist():
    assert jetstream.tests_root() == REPO


def test_without_the_server_s_dependencies_it_stops_before_cloning(tmp_path):
    if not [m for m in serve.missing_modules() if m != "jetstream"]:
        pytest.skip("JetStream's server dependencies are installed here")
    src = tmp_path / "src"
    out = subprocess.run([sys.executable, "-m", "dora_jax.bench.jetstream", f"--src={src}",
                          "--repo=/nonexistent"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "error: JetStream's server needs" in out.stderr and "[jetstream]" in out.stderr
    assert not src.exists()
