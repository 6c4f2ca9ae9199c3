"""conftest.py's guard against a worker running out of memory maps: past its limit, a
test's teardown drops JAX's caches, which unmaps the programs they held, and says so."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

PLANTED = '''
import jax
import jax.numpy as jnp

KEEP = []


def _maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_compiles_many_programs():
    KEEP.append(_maps())
    for i in range(16):  # each a program of its own, kept in jit's cache
        jax.jit(lambda x, i=i: jnp.cumsum(x * i))(jnp.ones(3 + i)).block_until_ready()
    KEEP.append(_maps())


def test_the_next_test_starts_below_the_limit():
    before, loaded = KEEP
    assert loaded - before > 30  # the programs held maps ...
    assert _maps() < loaded - 30  # ... which the guard gave back
'''


def _run_planted(tmp_path, map_limit: int) -> str:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "test_planted.py"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": TESTS,
                           "DORA_TEST_MAP_LIMIT": str(map_limit),
                           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=300)
    return out.stdout[-3000:] + out.stderr[-2000:]


def test_a_worker_past_its_map_limit_drops_jax_caches(tmp_path):
    out = _run_planted(tmp_path, map_limit=50)
    assert "2 passed" in out and "JAX's caches dropped" in out, out


def test_without_the_guard_the_maps_stay(tmp_path):
    """The planted module's second test fails when nothing drops the caches: the
    first test's check is not vacuous."""
    out = _run_planted(tmp_path, map_limit=0)
    assert "1 failed, 1 passed" in out, out
