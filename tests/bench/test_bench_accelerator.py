"""The accelerator check: its CPU form end to end, and how it keeps going when a part
fails or overruns (bench/accelerator.py)."""

import configparser
import json
import os
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO

from dora_jax.bench import accelerator

ENV = dict(os.environ, PYTHONPATH=str(REPO))


def test_a_part_past_its_budget_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "grandchild"
    command = [sys.executable, "-c",
               "import subprocess, sys, time; "
               "p = subprocess.Popen(['sleep', '60']); "
               f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"]
    start = time.monotonic()
    status, seconds = accelerator.run_part(command, dict(os.environ), 2.0,
                                           str(tmp_path / "part.log"))
    assert status == "timed out" and seconds < 10 and time.monotonic() - start < 10
    grandchild = int(pid_file.read_text())
    time.sleep(0.2)
    try:  # the whole process group went (at most a zombie awaiting its reaper is left)
        state = open(f"/proc/{grandchild}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z")


def test_a_failing_part_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(accelerator, "detect", lambda: dict(
        platform="cpu", device_kind="cpu", devices=8, jax="x"))
    commands = {"engine": [sys.executable, "-c", "raise SystemExit(3)"],
                "trainer": [sys.executable, "-c", "print('ok')"]}
    monkeypatch.setattr(accelerator, "part_command", lambda name, *a: commands[name])
    report = accelerator.check(str(tmp_path), "tiny", 100, ["engine", "trainer"])
    assert report["parts"]["engine"]["status"] == "failed (exit 3)"
    assert report["parts"]["trainer"]["status"] == "passed"
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["parts"].keys() == {"engine", "trainer"}
    summary = (tmp_path / "summary.txt").read_text()
    assert re.search(r"engine\s+failed \(exit 3\)", summary)
    assert "cpu: not shown here" in summary


def test_parts_use_the_report_s_own_cache_which_a_killed_part_removes(tmp_path,
                                                                       monkeypatch):
    """A part killed at its budget may die writing a compilation-cache entry: the
    parts' cache (the report's own, whatever the caller's) is removed after it."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "callers"))
    monkeypatch.setattr(accelerator, "detect", lambda: dict(
        platform="cpu", device_kind="cpu", devices=8, jax="x"))
    write_and_hang = ("import os, pathlib, time; d = pathlib.Path("
                      "os.environ['JAX_COMPILATION_CACHE_DIR']); d.mkdir(parents=True); "
                      "(d / 'entry').write_bytes(b'half'); time.sleep(60)")
    commands = {"engine": [sys.executable, "-c", write_and_hang],
                "trainer": [sys.executable, "-c", "import os; "
                            "print(os.environ['JAX_COMPILATION_CACHE_DIR'])"]}
    monkeypatch.setattr(accelerator, "part_command", lambda name, *a: commands[name])
    out = tmp_path / "report"
    report = accelerator.check(str(out), "tiny", 5, ["engine", "trainer"])
    assert report["parts"]["engine"]["status"] == "timed out"
    assert (out / "trainer.log").read_text().strip() == str(out / "compile_cache")
    assert not (out / "compile_cache").exists() and not (tmp_path / "callers").exists()


def test_peak_memory_is_recorded_when_the_module_fails(tmp_path):
    out = tmp_path / "mem.json"
    code = subprocess.run([sys.executable, "-m", "dora_jax.bench.peak_memory", str(out),
                           "json.tool", str(tmp_path / "missing.json")],
                          capture_output=True, env=ENV).returncode
    assert code != 0
    assert json.loads(out.read_text()) == dict(peak_bytes=None,
                                               reason="the part never imported JAX")


def _configs_from_flags(args: list, names: dict) -> dict:
    """The validated configs a benchmark would build from `args` (its config flags and
    their overrides, parsed as ml_collections parses them)."""
    from absl import flags
    from ml_collections import config_flags

    from dora_jax.model import hf_checks

    values = flags.FlagValues()
    argv = ["bench"] + [a for a in args if a.split("=")[0].split(".")[0][2:] in names]
    for name, default in names.items():  # overrides are read from the argv given here
        config_flags.DEFINE_config_file(name, str(REPO / default), flag_values=values,
                                        sys_argv=argv)
    values(argv)
    return {name: hf_checks.validated(values[name].value) for name in names}


def test_on_a_gpu_the_engine_part_times_the_pallas_paged_kernel_beside_ragged(tmp_path):
    size = accelerator.SIZES["device"]
    gpu = accelerator.part_command("engine", size, str(tmp_path), "gpu")
    assert "--paged_attention=ragged,pallas_gpu" in gpu
    for platform in ("tpu", "cpu"):
        assert not any(a.startswith("--paged_attention") for a in
                       accelerator.part_command("engine", size, str(tmp_path), platform))
    # The device shape's pages tile for the kernel (validated as the run would be).
    engine = _configs_from_flags(size.engine + ["--config.rollout.paged_attention=pallas_gpu"],
                                 {"config": "configs/tiny.py:spread"})["config"]
    assert engine.rollout.paged_attention == "pallas_gpu"


def test_the_device_form_flags_build_valid_configs_of_the_stated_size():
    from dora_jax.bench import model_shape
    from dora_jax.model import transformer

    device = accelerator.SIZES["device"]
    engine = _configs_from_flags(device.engine, {"config": "configs/tiny.py:spread",
                                                 "moe_config": "configs/moe.py:tiny"})
    trainer = _configs_from_flags(device.trainer, {"config": "configs/tiny.py:spread"})["config"]
    sizes = {name: model_shape(cfg.model, transformer.abstract_params(cfg.model)[1])
             for name, cfg in dict(engine, trainer=trainer).items()}
    assert 0.8e9 < sizes["config"]["params"] < 1.0e9
    assert (sizes["config"]["params"] == sizes["config"]["active_params"]
            == sizes["trainer"]["params"])
    # 8 layers of 16 experts (3 x 2048 x 1408 each), 2 of them read per token
    assert sizes["moe_config"]["params"] - sizes["moe_config"]["active_params"] == (
        8 * 14 * 3 * 2048 * 1408)
    assert {s["dtype"] for s in sizes.values()} == {"bfloat16"}
    assert trainer.trainer.length_buckets == (128,)


def test_the_accelerator_extras_pin_the_jax_the_package_requires():
    import jax

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    floor = re.search(r"^jax>=([\d.]+)$", cfg["options"]["install_requires"], re.M).group(1)
    extras = cfg["options.extras_require"]
    assert extras["cuda"].strip() == f"jax[cuda12]=={floor}"
    assert extras["tpu"].strip() == f"jax[tpu]=={floor}"
    assert jax.__version__ == floor, "the extras would install another jax than the tested one"


@pytest.mark.slow
def test_the_cpu_form_runs_every_part_and_reports(tmp_path):
    out = tmp_path / "report"
    # The kernel tests run in the suite itself: here one of them, to keep the part's
    # plumbing (junit counts, recorded comparisons) checked.
    proc = subprocess.run([sys.executable, "-m", "dora_jax.bench.accelerator", f"--out={out}",
                           "--tests_k=paged_decode and ragged"],
                          capture_output=True, text=True, env=ENV, timeout=1500)
    report = json.loads((out / "report.json").read_text())
    logs = {n: (out / f"{n}.log").read_text() for n in report["parts"]}
    failed = {n: logs[n][-3000:] for n, p in report["parts"].items() if p["status"] != "passed"}
    assert proc.returncode == 0, (proc.stdout[-1500:], failed)
    assert (report["platform"], report["size"]) == ("cpu", "tiny")
    assert list(report["parts"]) == list(accelerator.PARTS)
    parts = {n: p["figures"] for n, p in report["parts"].items()}
    assert parts["tests"]["tests"] > 0 and parts["tests"]["failures"] == 0
    assert parts["tests"]["comparisons"], "the kernel tests recorded no comparison"
    assert all(c["max_abs_err"] <= c["tol"] for c in parts["tests"]["comparisons"] if "tol" in c)
    assert [r["model"] for r in parts["engine"]["runs"]] == ["tiny", "moe"]
    assert all(r["regimes"]["all_busy"]["slice_tokens_per_s"] > 0 for r in parts["engine"]["runs"])
    for r in parts["engine"]["runs"]:  # paged timed too; no bound without a bandwidth
        assert r["paged_step_seconds"][str(r["slots"])] > 0 and r["bound"] is None
    for r in parts["engine"]["runs"]:  # bytes per compiled decode step, against the ideal
        for cost in r["step_bytes"].values():
            assert cost["weight_bytes"] <= cost["bytes_accessed"]
            assert cost["over_ideal"] == cost["bytes_accessed"] / cost["ideal_bytes"]
    assert parts["trainer"]["tokens_per_s"]
    assert parts["quickstart"]["audit_ok"] is True and parts["quickstart"]["mode"] == "dora"
    assert set(parts["preset"]["provenance"]["predicted_step_minutes"]) == {"sync", "dora"}
    # the benchmarks' own last lines, as their users read them
    assert re.search(r"slice/fixed-batch tokens/s ratio: \d+\.\d\d$", logs["engine"].strip())
    assert re.search(r"trainer/plain-optax tokens/s ratio: \d+\.\d\d$", logs["trainer"].strip())
    for part in report["parts"].values():
        assert part["memory"]["peak_bytes"] is None and "cpu" in part["memory"]["reason"]
    summary = (out / "summary.txt").read_text()
    for line in ("tests:", "8 fake devices", "engine tiny", "engine moe", "trainer:",
                 "quickstart: dora", "preset cpu", "cpu: not shown here"):
        assert line in summary, summary


@pytest.mark.parametrize("devices, mode, slices", [(1, "sync", 1), (2, "dora", 1), (5, "dora", 4),
                                                    (8, "dora", 4)])
def test_the_quickstart_layout_fits_the_devices_there_are(devices, mode, slices):
    from dora_jax import config as config_lib
    from dora_jax.bench.quickstart_run import fit_layout
    from dora_jax.model import hf_checks

    c = config_lib.load(str(REPO / "configs/quickstart.py"))
    said = fit_layout(c, devices)
    cfg = hf_checks.validated(c, devices)  # fails if the layout needs more devices
    assert (cfg.coordinator.mode, cfg.mesh.num_slices) == (mode, slices), said
    assert cfg.mesh.colocated == (devices == 1)


def test_the_installer_script_parses_and_names_each_extra():
    script = REPO / "launchers" / "accelerator.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert 'pip install -q -e ".[$extra,test]"' in text and "dora_jax.bench.accelerator" in text
    assert os.access(script, os.X_OK)


@pytest.mark.parametrize("platform, count", [("cpu", ["8"]), ("gpu", [])])
def test_parts_keep_the_caller_s_xla_flags_but_not_its_device_count(platform, count,
                                                                   monkeypatch, tmp_path):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3 --xla_dump_to=d")
    flags = accelerator.child_env(platform, str(tmp_path))["XLA_FLAGS"].split()
    assert "--xla_dump_to=d" in flags
    assert [f.split("=")[1] for f in flags if "device_count" in f] == count
