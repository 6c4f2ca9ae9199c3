"""bench.engine --profile: the kernel table read from a trace (bench/kernels.py), and the
`--profile` run end to end on CPU (where the profiler sees no device); `--bytes_only`."""

import os
import re
import subprocess
import sys

from conftest import REPO

from dora_jax.bench import kernels


def _trace():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kernels = [("gemm", 10), ("memcpy", 4), ("gemm", 30), ("memcpy", 2)]
    device = [{"ph": "X", "pid": 1, "name": n, "ts": i, "dur": d}
              for i, (n, d) in enumerate(kernels)]
    host = [{"ph": "X", "pid": 2, "name": "gemm", "ts": 0, "dur": 1000},
            {"ph": "i", "pid": 1, "name": "marker", "ts": 0}]
    return meta + device + host


def test_kernel_table_sums_device_kernels_only():
    micros, launches = kernels.kernel_table(_trace())
    assert micros == {"gemm": 40, "memcpy": 6} and launches == {"gemm": 2, "memcpy": 2}
    lines = kernels.kernel_lines(micros, launches, steps=2)
    assert lines[0].startswith("2 kernels per step, device busy 23 us per step")
    assert "20.0 us/step" in lines[1] and lines[1].endswith("gemm")
    assert kernels.kernel_lines({}, {}, steps=2) == [
        "the profiler saw no device kernels (a CPU host)"]


def test_profile_runs_on_cpu(tmp_path):
    cmd = [sys.executable, "-m", "dora_jax.bench.engine", "--profile", "--models=tiny",
           "--slots=4", "--decode_len=16", "--config.model.num_layers=1",
           "--config.rollout.kv_cache=paged"]  # the runtime's default, not tiny's
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "S=4, kv_cache=paged, scan_layers=True" in lines[0]
    assert lines[-2] == "the profiler saw no device kernels (a CPU host)"
    assert float(lines[-1].removeprefix("seconds per decode step: ")) > 0


def test_bytes_only_sets_each_layouts_step_against_its_ideal(tmp_path):
    cmd = [sys.executable, "-m", "dora_jax.bench.engine", "--bytes_only", "--models=tiny",
           "--slots=4", "--decode_len=8", "--page_size=8", "--paged_attention=ragged"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path))
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "== tiny, S=4 slots, max_decode_len=8, pages of 8" in out.stdout
    ratios = {kv: float(x) for kv, x in re.findall(
        r"decode step \((\S+) KV\): [\d.]+ MB accessed, ([\d.]+)x the ideal", out.stdout)}
    assert set(ratios) == {"dense", "paged", "paged/ragged"}, out.stdout
    # Each reads at least its weights and cache; gathering the pages copies them first.
    assert min(ratios.values()) >= 1.0 and ratios["paged/ragged"] > ratios["paged"], ratios


def test_a_decode_step_is_set_against_the_ideal_bytes_at_the_device_bandwidth():
    """Worked by hand: 4.8 GB at an H200's 4.8 TB/s is 1 ms, so a 2 ms step is 2x its
    bound; a CPU has no public bandwidth and gets none."""
    import pytest

    from dora_jax.bench import decode_bound

    figures = dict(slots=64, step_seconds={"1": 1e-3, "64": 2e-3},
                   paged_step_seconds={"64": 3e-3},
                   step_bytes={"dense": {"ideal_bytes": 4.8e9}, "paged": {"ideal_bytes": 9.6e9}})
    got = decode_bound(figures, "NVIDIA H200")
    assert got["dense"]["bound_seconds"] == pytest.approx(1e-3)
    assert got["dense"]["over_bound"] == pytest.approx(2.0)
    assert got["paged"]["bound_seconds"] == pytest.approx(2e-3)
    assert got["paged"]["over_bound"] == pytest.approx(1.5)
    assert decode_bound(figures, "NVIDIA H100 80GB HBM3")["dense"]["over_bound"] == \
        pytest.approx(2e-3 / (4.8e9 / 3.35e12))
    assert decode_bound(figures, "cpu") is None
    # Another paged implementation timed beside the config's (--paged_attention)
    figures["paged_impl_step_seconds"] = {"paged/pallas_gpu": 2.4e-3}
    figures["step_bytes"]["paged/pallas_gpu"] = {"ideal_bytes": 9.6e9}
    got = decode_bound(figures, "NVIDIA H200")
    assert got["paged/pallas_gpu"]["over_bound"] == pytest.approx(1.2)
    assert got["paged"]["over_bound"] == pytest.approx(1.5)
