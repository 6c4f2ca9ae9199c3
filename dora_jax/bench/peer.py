"""Our side of a throughput comparison with another RL library, at a named workload.

    python -m dora_jax.bench.peer --workload=tiny [--steps=60] [--rounds=3]
    python -m dora_jax.bench.peer --workload=larger [--nostop]

Workloads (random init, configs/tiny.py's residue task): `tiny` is configs/tiny.py's
policy (2 layers, d_model 64), 16 samples a step (4 groups of 4) of at most 16 tokens;
`larger` is 8 layers, d_model 256 (full forwards unrolled: `model.unroll_forward`),
32 samples a step (8 groups of 4) of at most 128 tokens. Prompts are the task's 6
tokens, prefilled in one bucket of 8, so that KV caches and train rows (8 + the
response limit) are as long as a peer's that bounds prompts at 6 tokens. No periodic
saves, no evaluation. `--layout=tiny`: configs/tiny.py's mesh (the trainer on one
device, two decode slices of 8 slots); `spread`: configs/tiny.py:spread's on 8 devices
(faked on a CPU); `pair`: the trainer on one device, and on another one decode slice
with a slot for each sample of a step.
`--nostop`: no stop token, every response runs to the limit, so that the lengths
match a peer's run held the same way.

Each round is one audited run of `--steps` steps per mode (`--modes`, default dora),
the modes interleaved. The steady state is what follows step `--warmup`
(compilation and the pipeline fill come before it). Per round and as the median over
rounds: response tokens/s; the step time (one step to the next) split into the train
step and the trainer's wait for rollouts; slot utilisation (the whole run's);
response lengths (mean, p50, p90, max, share cut at the length limit), so that a
peer's run can be matched to ours in what it generates; and where the steady state's
CPU time went, in milliseconds a step by part (bench/cpu_split.py: XLA's compute
threads, the slice workers, the coordinator, the trainer thread, the metric writers,
the reward pool, the rest; Linux only). Ends with
`response tokens/s: X (median of N rounds, <mode>, <workload>, <layout>)`.
"""

from __future__ import annotations

import json
import os
import statistics

import numpy as np

from dora_jax.bench import CONFIGS, cpu_split

WORKLOADS = {
    # (model overrides, groups per step, samples per group, response tokens at most)
    # Scanned, as its figures in docs/benchmarks.md were measured (the shipped tiny
    # default unrolls; in this workload's pair layout unrolled ran slower).
    "tiny": (dict(unroll_forward=False), 4, 4, 16),
    # Unrolled full forwards: on a CPU a train step at this size takes ~9% less (the
    # scan's stacked residuals are zero-filled, then written).
    "larger": (dict(num_layers=8, d_model=256, num_heads=4, num_kv_heads=2, head_dim=64,
                    mlp_hidden=768, unroll_forward=True), 8, 4, 128),
}

# Where the work runs: configs/tiny.py's mesh (the trainer on one device, two decode
# slices of 8 slots), tiny.py:spread's (the trainer on data=2 x fsdp=2, four decode
# slices of 8 slots), or one device for the trainer and one for a slice with a
# slot per sample of a step (a peer that runs on one device is matched by it on a host
# whose devices are faked on its cores). One slice holds one version at a time, so
# slots beyond a step's samples would decode empty rows.
LAYOUTS = ("tiny", "spread", "pair")
PROMPT_BUCKET = 8  # the residue task's prompts: BOS, a cue and 4 symbols


def workload_config(name: str, mode: str, steps: int, layout: str = "tiny",
                    stop: bool = True):
    """configs/tiny.py (`spread`: tiny.py:spread) set to the named workload and layout,
    in `mode`, without periodic saves; `stop=False`: no stop token, every response
    runs to the limit."""
    from dora_jax import config as config_lib
    from dora_jax.bench import runs

    model, groups, group_size, max_len = WORKLOADS[name]
    c = config_lib.load(str(CONFIGS / "tiny.py") + (":spread" if layout == "spread" else ""))
    c.model.update(model)
    c.rollout.update(dict(max_prefill_length=PROMPT_BUCKET, prefill_buckets=(PROMPT_BUCKET,),
                          max_decode_len=max_len))
    c.trainer.length_buckets = (PROMPT_BUCKET + max_len,)
    c.coordinator.update(dict(group_size=group_size, train_batch_size=groups,
                              rollout_batch_size=2 * groups))
    c.eval.every = 0
    if not stop:
        c.rollout.eos_id = -1
    if layout == "pair":
        c.mesh.trainer.update(dict(data=1, fsdp=1))
        c.mesh.num_slices = 1
        c.rollout.slots_per_slice = groups * group_size
    return runs.run_config(c, mode, steps=steps)


def steady_figures(workdir: str, warmup: int) -> dict:
    """The steady state of the run in `workdir`: the steps after `warmup` (slot
    utilisation: the run's, summary.json's)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "trained_tokens" in r and "eval" not in r]
    steady = [r for r in steps if r["step"] > warmup]
    if len(steady) < 2:
        raise ValueError(f"{len(steps)} steps: too few after --warmup={warmup}")
    start = next(r["time"] for r in steps if r["step"] == warmup)
    seconds = steady[-1]["time"] - start
    lengths, cut = [], 0
    with open(os.path.join(workdir, "ledger.jsonl")) as f:
        for event in map(json.loads, f):
            if event.get("event") == "consume" and event["step"] > warmup:
                for s in event["samples"]:
                    lengths.append(s["response_len"])
                    cut += s["finish"] == "length"
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    return {
        "tokens_per_s": sum(r["trained_tokens"] for r in steady) / seconds,
        "step_s": seconds / len(steady),
        "train_s": statistics.mean(r["step_time"] for r in steady),
        "wait_s": statistics.mean(r["trainer_wait"] for r in steady),
        "slot_util": summary["mean_slot_utilisation"],
        "len_mean": float(np.mean(lengths)), "len_p50": float(np.percentile(lengths, 50)),
        "len_p90": float(np.percentile(lengths, 90)), "len_max": int(max(lengths)),
        "cut_share": cut / len(lengths),
    }


COLUMNS = ("tokens_per_s", "step_s", "train_s", "wait_s", "slot_util", "len_mean",
           "len_p50", "len_p90", "len_max", "cut_share")


def _row(label: str, fig: dict) -> str:
    return f"{label:<16}" + "".join(f"{fig[c]:>13.4g}" for c in COLUMNS)


def _cpu_row(cpu: dict | None) -> str:
    if cpu is None:
        return f"{'':<16}cpu split not available (no /proc)"
    return (f"{'':<16}cpu ms/step " + " ".join(f"{p} {cpu[p]:.1f}" for p in cpu_split.PARTS)
            + f" | total {cpu['total']:.1f}")


class SteadyCPU:
    """`on_step` for a run: the CPU split (cpu_split.py) from step `warmup` to the last."""

    def __init__(self, warmup: int, steps: int):
        self.warmup, self.steps = warmup, steps
        self.start: dict | None = None
        self.end: dict | None = None

    def __call__(self, record: dict) -> None:
        if record["step"] == self.warmup:
            self.start = cpu_split.snapshot()
        elif record["step"] == self.steps - 1:
            self.end = cpu_split.snapshot()

    def per_step(self) -> dict | None:
        return cpu_split.per_step(self.start, self.end, self.steps - 1 - self.warmup)


if __name__ == "__main__":
    from absl import app, flags, logging

    # Flags here: tests import this module beside other benchmarks that define
    # flags of the same names.
    _WORKLOAD = flags.DEFINE_enum("workload", "tiny", list(WORKLOADS), "the named workload")
    _LAYOUT = flags.DEFINE_enum("layout", "tiny", list(LAYOUTS), "where the work runs")
    _MODES = flags.DEFINE_list("modes", ["dora"], "modes to run (sync, one_step_off, dora...)")
    _STEPS = flags.DEFINE_integer("steps", 60, "train steps per round")
    _WARMUP = flags.DEFINE_integer("warmup", 10, "steps before the steady state")
    _ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved rounds")
    _WORKDIR = flags.DEFINE_string("workdir", "/tmp/dora_peer", "where the runs go")
    _STOP = flags.DEFINE_bool("stop", True, "--nostop: no stop token, every response runs "
                              "to the limit (lengths a peer's run can match exactly)")

    def main(argv):
        del argv
        logging.set_verbosity(logging.WARNING)  # Orbax logs each save at INFO
        from dora_jax.bench import runs
        from dora_jax.runtime import cli

        name, steps, warmup = _WORKLOAD.value, _STEPS.value, _WARMUP.value
        if not 0 <= warmup < steps - 2:
            raise SystemExit(f"error: --warmup={warmup} must leave 2 steps of --steps={steps}")
        configs = {m: workload_config(name, m, steps, _LAYOUT.value, _STOP.value)
                   for m in _MODES.value}
        cli.workdir_to_write(_WORKDIR.value)
        from dora_jax.model import hf_checks

        cli.start_devices(hf_checks.validated(next(iter(configs.values()))))
        model, groups, group_size, max_len = WORKLOADS[name]
        print(f"workload {name} ({_LAYOUT.value}): {groups * group_size} samples a step of at "
              f"most {max_len} tokens, {steps} steps a round (steady after step {warmup}), "
              f"{_ROUNDS.value} interleaved rounds", flush=True)
        print(f"{'run':<16}" + "".join(f"{c:>13}" for c in COLUMNS), flush=True)
        figures: dict = {m: [] for m in configs}
        cpus: dict = {m: [] for m in configs}
        for r in range(_ROUNDS.value):
            for mode, c in configs.items():
                workdir = os.path.join(_WORKDIR.value, name, mode, str(r))
                cpu = SteadyCPU(warmup, steps)
                summary = runs.audited_run(c, workdir, on_step=cpu)
                if not summary["audit_ok"]:
                    raise SystemExit(f"error: {workdir}: the ledger's audit failed: "
                                     f"{summary['audit']}")
                figures[mode].append(steady_figures(workdir, warmup))
                cpus[mode].append(cpu.per_step())
                print(_row(f"{mode} {r}", figures[mode][-1]), flush=True)
                print(_cpu_row(cpus[mode][-1]), flush=True)
        for mode, rows in figures.items():
            print(_row(f"{mode} median", {c: statistics.median(x[c] for x in rows)
                                          for c in COLUMNS}), flush=True)
            measured = [x for x in cpus[mode] if x is not None]
            print(_cpu_row({p: statistics.median(x[p] for x in measured)
                            for p in measured[0]} if measured else None), flush=True)
        for mode, rows in figures.items():
            print(f"response tokens/s: {statistics.median(x['tokens_per_s'] for x in rows):.0f} "
                  f"(median of {len(rows)} rounds, {mode}, {name}, {_LAYOUT.value})")
    app.run(main)
