"""A run's persistent compilation cache (runtime/compile_times.use_persistent_cache):
in the workdir unless JAX_COMPILATION_CACHE_DIR names another, and an entry cut short
or spliced by a killed run is compiled again, never served."""

import os
import subprocess
import sys

from conftest import REPO

PROGRAM = """
import os, sys
from dora_jax.runtime import compile_times
path = compile_times.use_persistent_cache(sys.argv[1])
import jax, jax.numpy as jnp
f = jax.jit(lambda x: jnp.tanh(x * 3.0).sum() + jnp.cumsum(x)[-1])
print(path, float(f(jnp.arange(64.0))))
"""


def _run(workdir, env):
    return subprocess.run([sys.executable, "-c", PROGRAM, str(workdir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_run_keeps_its_programs_in_the_workdir_and_refuses_torn_entries(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    first = _run(tmp_path, env)
    assert first.returncode == 0, first.stderr[-2000:]
    path, value = first.stdout.split()
    assert path == str(tmp_path / "compile_cache")
    entries = [p for p in (tmp_path / "compile_cache").iterdir() if p.is_file()]
    assert entries
    # Cut every entry short, as a run killed while writing would leave it, and
    # splice one into another's tail: each is refused and compiled again.
    for i, entry in enumerate(entries):
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2] if i % 2 == 0 else data[:40] + data[41:])
    again = _run(tmp_path, env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.split()[1] == value
    # JAX's reader refused each one (its decompressor failed) and compiled again.
    assert again.stderr.count("Error reading persistent compilation cache entry") == len(
        entries), again.stderr


def test_jax_compilation_cache_dir_names_another_place(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "elsewhere"))
    out = _run(tmp_path / "run", env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == str(tmp_path / "elsewhere")
    assert not (tmp_path / "run" / "compile_cache").exists()
