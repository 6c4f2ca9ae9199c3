"""The device preset fit (sim/device_fit.py) and the presets' loader of fitted files."""

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import pytest

from dora_jax.sim import device_fit, presets
from dora_jax.sim.cost import CostModel, Efficiency, Workload
from dora_jax.sim.run import simulate

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "accelerator"
TRUTH = Efficiency(hbm=0.55, mfu_decode=0.3, mfu_prefill=0.4, mfu_train=0.4,
                   step_overhead=0.006, train_passes=3.0, train_fixed=0.05)
MODELS = (dict(model="dense", params=1e9, active_params=1e9, layers=16, hidden=2048),
          dict(model="moe", params=8e9, active_params=2e9, layers=24, hidden=2048))
TOKENS = 4096


def _cost(model: dict, truth: Efficiency) -> CostModel:
    return CostModel.from_hardware(
        params=model["params"], active_params=model["active_params"], layers=model["layers"],
        hidden=model["hidden"], kv_bytes_per_token=65536, slice_devices=1, trainer_devices=1,
        efficiency=truth, param_bytes=2, **device_fit.PEAKS["NVIDIA H200"])


def synthetic_figures(models=MODELS, truth=TRUTH) -> tuple:
    """engine.json and trainer.json as the roofline with `truth` would measure them on
    one H200 (decode at context 0: the fit reads no context term)."""
    runs = [dict(m, param_bytes=2, slots=8,
                 step_seconds={str(k): _cost(m, truth).step_seconds(k, 0) for k in range(1, 9)})
            for m in models]
    engine = dict(platform="gpu", device_kind="NVIDIA H200", runs=runs)
    train = _cost(models[0], truth).train_seconds(TOKENS)
    trainer = dict(platform="gpu", device_kind="NVIDIA H200", tokens_per_step=TOKENS,
                   params=models[0]["params"], active_params=models[0]["active_params"],
                   param_bytes=2, train_passes=truth.train_passes,
                   step_seconds={"trainer[single mesh 1x1x1x1]": train, "plain optax": 2 * train})
    return engine, trainer


def _recovered(eff: Efficiency, truth: Efficiency = TRUTH) -> None:
    for name in ("hbm", "step_overhead", "mfu_decode", "mfu_train", "train_fixed"):
        assert getattr(eff, name) == pytest.approx(getattr(truth, name), rel=0.01), name


def test_fit_recovers_a_known_efficiency_from_two_model_sizes():
    """Two weight sizes separate the weight reads from the host overhead: the fit
    gives back the truth, not the run's (deliberately wrong) step cost."""
    engine, trainer = synthetic_figures()
    run_cost = dataclasses.replace(_cost(MODELS[0], TRUTH), step_fixed=1.0)
    eff, details = device_fit.fit_efficiency(engine, trainer, device_fit.PEAKS["NVIDIA H200"],
                                             run_cost)
    _recovered(eff)
    assert details["step_overhead_from"].startswith("intercepts across 2")
    assert details["flags"] == []


def test_one_model_size_takes_the_step_overhead_from_the_run_or_flags_zero():
    engine, trainer = synthetic_figures(MODELS[:1])
    run_cost = dataclasses.replace(_cost(MODELS[0], TRUTH), step_fixed=0.004,
                                   call_overhead=0.032, call_steps=16)
    eff, details = device_fit.fit_efficiency(engine, trainer, device_fit.PEAKS["NVIDIA H200"],
                                             run_cost)
    _recovered(eff)
    assert details["step_overhead_from"].startswith("run")
    eff, details = device_fit.fit_efficiency(engine, trainer, device_fit.PEAKS["NVIDIA H200"])
    assert eff.step_overhead == 0 and eff.train_fixed == 0 and eff.hbm < TRUTH.hbm
    assert any("assumed 0" in f for f in details["flags"])


def test_an_overhead_that_covers_the_fixed_cost_leaves_hbm_unfitted_and_the_preset_valid():
    """On a loaded host one weight size's intercept can fall under the run's host cost:
    no weight reads are left to fit, so hbm keeps its default, flagged, and the preset
    still loads (a negative or infinite hbm once failed the accelerator check)."""
    engine, trainer = synthetic_figures(MODELS[:1])
    intercept = engine["runs"][0]["step_seconds"]["1"]
    run_cost = dataclasses.replace(_cost(MODELS[0], TRUTH), step_fixed=2 * intercept,
                                   call_overhead=0.0, call_steps=16)
    peaks = device_fit.PEAKS["NVIDIA H200"]
    eff, details = device_fit.fit_efficiency(engine, trainer, peaks, run_cost)
    assert eff.hbm == Efficiency().hbm
    assert any(f.startswith("hbm not fitted") for f in details["flags"]), details["flags"]
    preset = device_fit.device_preset("NVIDIA H200", peaks, eff, details=details)
    assert presets.preset_from_dict(preset).efficiency.hbm == Efficiency().hbm


def test_cpu_figures_fit_to_a_preset_that_loads_and_simulates(tmp_path):
    engine = json.loads((FIXTURES / "engine.json").read_text())
    trainer = json.loads((FIXTURES / "trainer.json").read_text())
    peaks = device_fit.measure_peaks(seconds=0.3)
    assert all(math.isfinite(v) and v > 0 for v in peaks.values()), peaks
    eff, details = device_fit.fit_efficiency(engine, trainer, peaks)
    fitted = (eff.hbm, eff.mfu_decode, eff.mfu_train)
    assert all(math.isfinite(v) and v > 0 for v in fitted), details
    # Its per-sequence cost is under the noise: bounded, and said so.
    assert details["decode_runs"][0]["per_seq_from"].startswith("bound")
    preset = device_fit.device_preset("cpu", peaks, eff, source=str(FIXTURES),
                                      details=details, date="2000-01-01")
    (tmp_path / "cpu.json").write_text(json.dumps(preset))
    loaded = presets.load_device_presets(tmp_path)["cpu"]
    assert loaded.efficiency == dataclasses.replace(eff, train_passes=6.0)
    assert loaded.hardware == peaks and loaded.model == presets.QWEN25_32B
    assert "fitted from our engine's figures" in loaded.description
    small = dataclasses.replace(loaded, train_batch_size=8, rollout_batch_size=12, group_size=4,
                                slots_per_slice=8, workload=Workload(mean_len=64, max_len=256))
    for mode in ("sync", "dora"):
        summary = simulate(small, mode, 2)
        assert summary["audit_ok"] and summary["step_minutes"] > 0


def test_a_dropped_preset_file_becomes_a_preset_and_names_are_unique(tmp_path):
    engine, trainer = synthetic_figures()
    eff, _ = device_fit.fit_efficiency(engine, trainer, device_fit.PEAKS["NVIDIA H200"])
    preset = device_fit.device_preset("NVIDIA H200", device_fit.PEAKS["NVIDIA H200"], eff)
    (tmp_path / "report.json").write_text(json.dumps(preset))
    found = presets.load_device_presets(tmp_path, reserved=presets.PRESETS)
    assert list(found) == ["h200"] and found["h200"].num_slices == 4
    assert found["h200"].cost().step_fixed == pytest.approx(
        65e9 / (8 * 4.8e12 * eff.hbm) + eff.step_overhead + 2 * 64 * eff.collective_latency)
    assert presets.load_device_presets(tmp_path / "absent") == {}
    (tmp_path / "again.json").write_text(json.dumps(preset))
    with pytest.raises(ValueError, match=r"report\.json: field 'name' 'h200' is already"):
        presets.load_device_presets(tmp_path)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("hardware"), "hardware"),
    (lambda d: d.update(slots=8), "slots"),
    (lambda d: d["hardware"].update(flops="989e12"), "hardware.flops"),
    (lambda d: d["hardware"].pop("hbm_bytes"), "hardware.hbm_bytes"),
    (lambda d: d["model"].update(heads=8), "model.heads"),
    (lambda d: d["efficiency"].update(hbm=-0.5), "efficiency.hbm"),
    (lambda d: d.update(total_devices=64.5), "total_devices"),
    (lambda d: d.update(trainer_devices=30), "trainer_devices"),
])
def test_a_malformed_preset_file_names_the_file_and_the_field(tmp_path, edit, field):
    engine, trainer = synthetic_figures()
    eff, _ = device_fit.fit_efficiency(engine, trainer, device_fit.PEAKS["NVIDIA H200"])
    preset = device_fit.device_preset("NVIDIA H200", device_fit.PEAKS["NVIDIA H200"], eff)
    edit(preset)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(preset))
    with pytest.raises(ValueError) as e:
        presets.load_device_presets(tmp_path)
    assert str(path) in str(e.value) and f"'{field}'" in str(e.value)


def test_a_file_that_is_not_json_is_named(tmp_path):
    (tmp_path / "cut.json").write_text('{"name": "h2')
    with pytest.raises(ValueError, match=r"cut\.json: not JSON"):
        presets.load_device_presets(tmp_path)


def test_command_line_fits_writes_and_predicts(tmp_path):
    engine, trainer = synthetic_figures()
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    (tmp_path / "trainer.json").write_text(json.dumps(trainer))
    out = subprocess.run(
        [sys.executable, "-m", "dora_jax.sim.device_fit", f"--engine={tmp_path}/engine.json",
         f"--trainer={tmp_path}/trainer.json", f"--out={tmp_path}/h200.json", "--modes=sync"],
        capture_output=True, text=True, check=True, timeout=300).stdout
    lines = out.strip().splitlines()
    assert lines[0].startswith("NVIDIA H200: public figures for NVIDIA H200")
    assert lines[-2].startswith("h200 sync: ") and lines[-2].endswith("(2 simulated steps)")
    assert lines[-1].startswith(f"preset written to {tmp_path}/h200.json")
    written = json.loads((tmp_path / "h200.json").read_text())
    assert written["efficiency"]["hbm"] == pytest.approx(TRUTH.hbm, rel=0.01)


def write_run(workdir: pathlib.Path, slots: int = 8) -> None:
    """A real run's workdir (timeline, metrics, ledger) of four slices whose busy time
    is 20 ms a generate call + 3 ms a step + 0.2 ms a sequence-step, and one train
    step of 50 ms: what `calibrate.fit` reads."""
    spans, ledger, util, t = [], [], {}, 0.0
    for i, (calls, u, n_samples) in enumerate([(10, 1.0, 20), (20, 0.5, 12), (15, 0.75, 30),
                                               (30, 0.25, 8)]):
        ledger += [dict(event="consume", samples=[dict(response_len=10, slices=[i])])
                   for _ in range(n_samples)]
        steps = n_samples * 9 / (u * slots)
        busy = 0.020 * calls + 0.003 * steps + 0.0002 * steps * u * slots
        for _ in range(calls):
            spans.append(dict(row=f"slice {i}", kind="decode", start=t, end=t + busy / calls))
            t += busy / calls
        util[str(i)] = u
    spans.append(dict(row="trainer", kind="train", start=t, end=t + 0.05))
    workdir.mkdir()
    (workdir / "timeline.json").write_text(json.dumps(spans))
    (workdir / "metrics.jsonl").write_text(json.dumps(dict(
        time=t + 0.05, slot_utilisation=util, trainer=dict(sequence_tokens=100))) + "\n")
    (workdir / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))


def test_command_line_takes_the_host_costs_from_a_run(tmp_path):
    """One weight size: step_overhead is the run's 3 ms a step + 20 ms a call over
    the config's 8 steps a call (configs/quickstart.py), train_fixed its 50 ms."""
    engine, trainer = synthetic_figures(MODELS[:1])
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    (tmp_path / "trainer.json").write_text(json.dumps(trainer))
    write_run(tmp_path / "run")
    subprocess.run(
        [sys.executable, "-m", "dora_jax.sim.device_fit", f"--engine={tmp_path}/engine.json",
         f"--trainer={tmp_path}/trainer.json", f"--run={tmp_path}/run",
         "--config=configs/quickstart.py", f"--out={tmp_path}/p.json", "--modes="],
        capture_output=True, text=True, check=True, timeout=300, cwd=REPO)
    written = json.loads((tmp_path / "p.json").read_text())
    assert written["provenance"]["fit"]["step_overhead_from"].startswith("run")
    assert written["efficiency"]["step_overhead"] == pytest.approx(0.003 + 0.020 / 8)
    assert written["efficiency"]["train_fixed"] == pytest.approx(0.05)
