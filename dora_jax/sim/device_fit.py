"""A device preset: the efficiencies our engine reaches on one device, fitted to its
benchmark figures, on the paper's 64-device deployment.

    python -m dora_jax.sim.device_fit --engine=engine.json --trainer=trainer.json \\
        [--run=WORKDIR --config=configs/quickstart.py] [--peaks=peaks.json] \\
        --out=preset.json [--modes=sync,dora]

engine.json / trainer.json are `bench.engine --json_out` / `bench.trainer
--mesh=single --json_out` on that device; --run is a short real run there (its
per-step host costs, `calibrate.fit`). Prints the peaks, the fitted efficiency and
how it was fitted (`details`), writes the preset and prints its simulated step
minutes per mode. The fit inverts `CostModel.from_hardware` on one device (no
collectives) with the device's public peaks (`PEAKS`; for a CPU or an unknown kind,
peaks measured on this host, which must then be the benchmark's):
- decode, per engine run: step_seconds(k busy slots) = a + b k (non-negative line);
  b = 2 active / (flops mfu_decode) (the bench's short contexts' KV reads count in
  b, so mfu_decode is a lower bound); a slope under the timing noise (b = 0) is
  bounded by step(S) / S, a lower bound on mfu_decode, and flagged;
- a = step_overhead + weight_bytes / (hbm_bytes_per_s hbm): across runs of different
  weight bytes, slope and intercept of a over weight bytes; with one weight size,
  step_overhead from the run (step_fixed + call_overhead / call_steps: a tiny model,
  whose weight reads are negligible) or 0, and hbm from a - step_overhead;
- train: mfu_train = 2 active passes tokens / (flops (step_seconds - train_fixed)),
  train_fixed from the run or 0 (not subtracted, and flagged, when it is not small
  beside the bench's step); mfu_prefill (not measured) is taken as mfu_train.
Nothing is clamped: an efficiency outside (0, 1] is kept and flagged in `details`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import time

import numpy as np
from absl import app, flags

from dora_jax.sim import presets
from dora_jax.sim.calibrate import nonnegative_line
from dora_jax.sim.cost import CostModel, Efficiency

# Public per-device figures, by JAX's `device_kind` (presets.H800's keys). Links
# between slices: 400 Gb/s InfiniBand per GPU as presets.H800; a sixth of a TPU
# chip's ICI as presets.V5P. Public code names v5p both "TPU v5p" and "TPU v5" (not
# checked on one here): both are listed.
_H200 = dict(flops=989e12, hbm_bytes_per_s=4.8e12, hbm_bytes=141e9, link_bytes_per_s=50e9,
             slice_link_bytes_per_s=900e9)
_H100 = dict(_H200, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9)
_V5E = dict(flops=197e12, hbm_bytes_per_s=819e9, hbm_bytes=16e9, link_bytes_per_s=33e9,
            slice_link_bytes_per_s=200e9)
_V6E = dict(flops=918e12, hbm_bytes_per_s=1.64e12, hbm_bytes=32e9, link_bytes_per_s=75e9,
            slice_link_bytes_per_s=448e9)
PEAKS = {"NVIDIA H200": _H200, "NVIDIA H100 80GB HBM3": _H100, "TPU v5p": presets.V5P,
         "TPU v5": presets.V5P, "TPU v5 lite": _V5E, "TPU v6 lite": _V6E}
SHORT_NAMES = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "TPU v5p": "tpu_v5p",
               "TPU v5": "tpu_v5p", "TPU v5 lite": "tpu_v5e", "TPU v6 lite": "tpu_v6e"}
TRAINER_KEY = "trainer["  # trainer.json's step_seconds key of our trainer (vs plain optax)


def measure_peaks(seconds: float = 1.0) -> dict:
    """This host's first device's peaks, measured: a jitted f32 matmul's FLOP/s and
    a donated array update's bytes/s (read + write); capacity is host memory."""
    import jax
    import jax.numpy as jnp

    def best(fn, x, n):
        x = jax.block_until_ready(fn(x))
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            x = jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        return min(times)

    size, reps = 1024, max(3, int(seconds * 10))
    matmul = jax.jit(lambda a: a @ a * (1.0 / size))
    flops = 2 * size ** 3 / best(matmul, jnp.ones((size, size), jnp.float32), reps)
    words = 16 * 2 ** 20
    update = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    bandwidth = 2 * 4 * words / best(update, jnp.ones((words,), jnp.float32), reps)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dict(flops=flops, hbm_bytes_per_s=bandwidth, hbm_bytes=float(memory),
                link_bytes_per_s=bandwidth, slice_link_bytes_per_s=bandwidth)


def peaks_for(kind: str) -> tuple:
    """(peaks, where they come from) for `kind`: public figures, or measured here
    when this host's device is of that kind (ValueError otherwise)."""
    if kind in PEAKS:
        return dict(PEAKS[kind]), f"public figures for {kind}"
    import jax

    here = jax.devices()[0].device_kind
    if here != kind:
        raise ValueError(f"no public figures for {kind!r} and this host's device is {here!r}: "
                         "fit on that device or pass its peaks")
    return measure_peaks(), f"measured on this host's {kind} (f32 matmul, array update)"


def per_step_host_seconds(run_cost: CostModel) -> float:
    """A real run's decode cost per step outside the model: its fitted fixed step
    cost plus its per-call overhead spread over a call's steps."""
    return run_cost.step_fixed + run_cost.call_overhead / run_cost.call_steps


def _decode_line(run: dict, flops: float) -> dict:
    ks = sorted(int(k) for k in run["step_seconds"])
    seconds = [run["step_seconds"][str(k)] for k in ks]
    a, b = nonnegative_line(ks, seconds)
    line = dict(model=run.get("model", "?"), weight_bytes=run["params"] * run["param_bytes"],
                active_params=run["active_params"], intercept_s=a, per_seq_s=b,
                per_seq_from="slope")
    if b <= 0:
        k = ks[-1]
        line.update(per_seq_s=seconds[-1] / k, per_seq_from=f"bound step({k})/{k}")
    line["mfu_decode"] = 2 * run["active_params"] / (flops * line["per_seq_s"])
    return line


def fit_efficiency(engine: dict, trainer: dict, peaks: dict,
                   run_cost: CostModel | None = None) -> tuple:
    """(Efficiency, details) of the figures (see the module docstring)."""
    flops, bandwidth = peaks["flops"], peaks["hbm_bytes_per_s"]
    flagged = []
    lines = [_decode_line(r, flops) for r in engine["runs"]]
    flagged += [f"{ln['model']}: per-sequence cost under the timing noise; mfu_decode is "
                f"a lower bound ({ln['per_seq_from']})" for ln in lines
                if ln["per_seq_from"] != "slope"]
    x = np.array([2 * ln["active_params"] / flops for ln in lines])
    y = np.array([ln["per_seq_s"] for ln in lines])
    mfu_decode = float(x @ x / (x @ y))  # b = x / mfu through the origin
    weights = np.array([ln["weight_bytes"] for ln in lines], float)
    intercepts = np.array([ln["intercept_s"] for ln in lines])
    overhead, per_byte = nonnegative_line(weights, intercepts)
    if per_byte > 0:
        overhead_from = f"intercepts across {len(lines)} weight sizes"
    else:
        if run_cost is not None:
            overhead = per_step_host_seconds(run_cost)
            overhead_from = "run: step_fixed + call_overhead / call_steps"
        else:
            overhead, overhead_from = 0.0, "assumed 0 (one weight size, no run)"
        reads = float(weights @ (intercepts - overhead))
        per_byte = max(reads, 0.0) / float(weights @ weights)
    if per_byte > 0:
        hbm = 1.0 / (bandwidth * per_byte)
    else:  # the run's overhead covers the whole fixed cost: the reads are under the noise
        hbm = Efficiency().hbm
        flagged.append(f"hbm not fitted: the step overhead ({overhead_from}) covers the "
                       f"whole fixed step cost; the default {hbm} is used")
    share = weights / (bandwidth * hbm) / np.maximum(intercepts, 1e-30)
    if per_byte > 0 and (overhead_from.startswith("assumed") or share.max() < 0.05):
        flagged.append(f"hbm rests on weight reads of {share.max():.0%} of the fixed step "
                       f"cost (step_overhead {overhead_from})")
    key = next(k for k in trainer["step_seconds"] if k.startswith(TRAINER_KEY))
    train_fixed = run_cost.train_fixed if run_cost is not None else 0.0
    step_seconds = trainer["step_seconds"][key]
    train_fixed_from = "run" if run_cost is not None else "assumed 0 (no run)"
    if train_fixed >= step_seconds / 2:  # another model's host costs: not this step's
        flagged.append(f"the run's train_fixed ({train_fixed:.3g} s) is not small beside the "
                       f"bench's step ({step_seconds:.3g} s): mfu_train over the whole step")
        train_fixed_from = f"run, not subtracted ({train_fixed:.3g} s)"
        train_seconds = step_seconds
    else:
        train_seconds = step_seconds - train_fixed
    passes = trainer["train_passes"]
    mfu_train = (2 * trainer["active_params"] * passes * trainer["tokens_per_step"]
                 / (flops * train_seconds))
    efficiency = dataclasses.replace(
        Efficiency(), hbm=hbm, mfu_decode=mfu_decode, mfu_prefill=mfu_train,
        mfu_train=mfu_train, step_overhead=float(overhead), train_passes=passes,
        train_fixed=float(train_fixed))
    flagged += [f"{name} = {value:.4g} is outside (0, 1]"
                for name, value in (("hbm", hbm), ("mfu_decode", mfu_decode),
                                    ("mfu_train", mfu_train)) if not 0 < value <= 1]
    details = dict(decode_runs=lines, step_overhead_from=overhead_from,
                   train_fixed_from=train_fixed_from,
                   trainer_step=key, assumed=dict(mfu_prefill="= mfu_train (not measured)",
                                                  link="default (one device: no collectives)",
                                                  collective_latency="default"),
                   flags=flagged)
    return efficiency, details


def device_preset(kind: str, peaks: dict, efficiency: Efficiency, *, source: str = "",
                  details: dict | None = None, date: str | None = None) -> dict:
    """presets.PRESETS['paper64']'s deployment (Qwen2.5-32B, 32 trainer devices,
    slices of 8, 256 slots) on `kind` with the fitted `efficiency`, as JSON for
    presets.preset_from_dict. Training runs the deployment's passes per token, not
    the bench's: MFU is a fraction of FLOPs, the passes are the objective's."""
    base = presets.PRESETS["paper64"]
    date = date or datetime.date.today().isoformat()
    name = SHORT_NAMES.get(kind, kind.lower().replace(" ", "_"))
    eff = dataclasses.replace(efficiency, train_passes=base.efficiency.train_passes)
    return dict(
        name=name,
        description=f"Qwen2.5-32B on 64 {kind}, efficiency fitted from our engine's figures "
                    f"on one {kind} ({source or 'figures'}, {date})",
        total_devices=base.total_devices, trainer_devices=base.trainer_devices,
        slice_devices=base.slice_devices, slots_per_slice=base.slots_per_slice,
        hardware={k: float(v) for k, v in peaks.items()}, model=dict(base.model),
        efficiency=dataclasses.asdict(eff),
        provenance=dict(device_kind=kind, source=source, date=date, fit=details or {}))


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main(argv):
    del argv
    from dora_jax.sim.run import SIM_MODES, simulate

    f = flags.FLAGS
    unknown = sorted(set(f.modes) - set(SIM_MODES))
    if unknown:
        raise app.UsageError(f"--modes: unknown {unknown}; known: {', '.join(SIM_MODES)}")
    engine, trainer = _read(f.engine), _read(f.trainer)
    kind = engine["device_kind"]
    if trainer["device_kind"] != kind:
        raise app.UsageError(f"engine figures are from {kind!r}, trainer's from "
                             f"{trainer['device_kind']!r}")
    if f.peaks:
        peaks, peaks_from = _read(f.peaks), f"peaks from {f.peaks}"
    else:
        try:
            peaks, peaks_from = peaks_for(kind)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    run_cost = None
    if f.run:
        from dora_jax import config as config_lib
        from dora_jax.sim import calibrate

        rollout = config_lib.load(f.config).rollout
        run_cost = calibrate.fit([calibrate.load_run(f.run)], rollout.slots_per_slice, f.cores,
                                 call_steps=rollout.decode_steps)
    efficiency, details = fit_efficiency(engine, trainer, peaks, run_cost)
    details["peaks_from"] = peaks_from
    preset = device_preset(kind, peaks, efficiency, source=os.path.dirname(
        os.path.abspath(f.engine)), details=details)
    print(f"{kind}: {peaks_from}: " + json.dumps(peaks))
    print("efficiency: " + json.dumps(dataclasses.asdict(efficiency)))
    print("details: " + json.dumps(details, indent=1))
    try:
        loaded = presets.preset_from_dict(preset, f.out or "preset")
    except ValueError as e:
        raise SystemExit(f"not simulated: {e}") from None
    predicted = preset["provenance"]["predicted_step_minutes"] = {}
    for mode in f.modes:
        predicted[mode] = simulate(loaded, mode, f.steps)["step_minutes"]
        print(f"{loaded.name} {mode}: {predicted[mode]:.2f} min/step ({f.steps} simulated steps)")
    if f.out:
        with open(f.out, "w") as out:
            json.dump(preset, out, indent=1)
        print(f"preset written to {f.out}; copied into {presets.DEVICE_PRESETS_DIR} it is "
              f"--preset={preset['name']}")

if __name__ == "__main__":  # flags only here: tests import this module
    flags.DEFINE_string("engine", None, "bench.engine --json_out file")
    flags.DEFINE_string("trainer", None, "bench.trainer --mesh=single --json_out file")
    flags.DEFINE_string("run", None, "a short real run's workdir on the same device")
    flags.DEFINE_string("config", "configs/quickstart.py", "that run's config")
    flags.DEFINE_float("cores", 0.0, "cores that run's slices and trainer share (0: none)")
    flags.DEFINE_string("peaks", None, "JSON of the device's peaks (presets.H800's keys)")
    flags.DEFINE_integer("steps", 2, "simulated train steps per mode")
    flags.DEFINE_list("modes", ["sync", "dora"], "modes whose step time is predicted")
    flags.DEFINE_string("out", None, "where the preset JSON goes")
    flags.mark_flags_as_required(["engine", "trainer"])
    app.run(main)
