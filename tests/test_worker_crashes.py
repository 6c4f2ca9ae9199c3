"""conftest.py's handling of an xdist worker that dies: its test runs again, up to
twice, and counts by its last run."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

CRASHING = '''
import os, signal

def test_dies_once(tmp_path_factory):
    marker = os.path.join(os.environ["MARKER_DIR"], "died")
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)

def test_dies_every_time():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_passes():
    pass
'''


def test_a_crashed_test_runs_again_and_a_third_crash_fails_it(tmp_path):
    (tmp_path / "test_crashing.py").write_text(CRASHING)
    env = {**os.environ, "PYTHONPATH": TESTS, "MARKER_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "conftest", "-p",
         "no:cacheprovider", "--rootdir", str(tmp_path), "test_crashing.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    tail = out.stdout[-3000:]
    assert out.returncode == 1, tail
    assert "1 failed, 2 passed, 3 rerun" in tail, tail
    assert "FAILED test_crashing.py::test_dies_every_time" in tail, tail
    assert "crashed 1x running test_crashing.py::test_dies_once (1 rerun)" in tail, tail
    assert "crashed 3x running test_crashing.py::test_dies_every_time (2 rerun)" in tail, tail
