"""The quickstart on whatever devices this host has: a supervised warm start, then a
short RL run whose ledger is audited (`bench.accelerator`'s end-to-end part).

    python -m dora_jax.bench.quickstart_run --workdir=DIR [--sft_steps=150] [--steps=30]

The config is configs/quickstart.py on a layout that fits the devices JAX sees:
the config's own where there are enough (8 fake CPU devices), otherwise a trainer
on one device and decode slices on the others (dora needs at least one of each),
and on a single accelerator colocated sync, the one mode in which rollout and
training take turns on the same device. Writes DIR/quickstart.json: the layout,
mode, steps, seconds, the reward's first and last step means and the audit.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags
from ml_collections import config_flags

from dora_jax.bench import CONFIGS, write_figures
from dora_jax.bench.runs import audited_run, run_config, warm_start


def fit_layout(c, num_devices: int) -> str:
    """Puts `c`'s mesh on `num_devices` devices (module docstring); returns what was
    chosen, in words."""
    m = c.mesh
    trainer = m.trainer.data * m.trainer.fsdp * m.trainer.tensor * m.trainer.expert
    per_slice = m.slice.tensor * m.slice.expert
    if trainer + m.num_slices * per_slice <= num_devices:
        return f"the config's: trainer on {trainer}, {m.num_slices} slices of {per_slice}"
    m.trainer.update(dict(data=1, fsdp=1, tensor=1, expert=1))
    m.slice.update(dict(tensor=1, expert=1))
    if num_devices >= 2:
        m.num_slices = min(4, num_devices - 1)
        return f"trainer on 1 device, {m.num_slices} slices of 1"
    m.num_slices, m.colocated = 1, True
    c.coordinator.mode = "sync"
    return "one device: colocated sync (rollout and training take turns)"


def main(argv):
    del argv
    from dora_jax.runtime import cli

    f = flags.FLAGS
    workdir = cli.workdir_to_write(f.workdir)
    import jax

    c = f.config
    layout = fit_layout(c, jax.device_count())
    if not f.eval:
        c.eval.every = 0
    start = time.perf_counter()
    init = warm_start(c, os.path.join(workdir, "sft"), f.sft_steps)
    sft_seconds = time.perf_counter() - start
    run = run_config(c, c.coordinator.mode, steps=f.steps, init_checkpoint=init)
    summary = audited_run(run, os.path.join(workdir, "rl"))
    figures = dict(layout=layout, mode=run.coordinator.mode, devices=jax.device_count(),
                   sft_steps=f.sft_steps, sft_seconds=sft_seconds, steps=f.steps,
                   rl_seconds=time.perf_counter() - start - sft_seconds,
                   run_dir=os.path.join(workdir, "rl"),
                   **{k: summary.get(k) for k in ("reward_first", "reward_last", "reward_mean",
                                                  "tokens_per_second", "audit_ok", "audit")})
    write_figures(os.path.join(workdir, "quickstart.json"), figures)
    print(json.dumps(figures, indent=1))
    if not summary["audit_ok"]:
        raise SystemExit(f"the ledger did not audit clean: {summary['audit']}")


if __name__ == "__main__":  # flags only here: tests import this module
    config_flags.DEFINE_config_file("config", str(CONFIGS / "quickstart.py"), "config file")
    flags.DEFINE_string("workdir", None, "where the warm start and the run go")
    flags.DEFINE_integer("sft_steps", 150, "supervised warm-start steps")
    flags.DEFINE_integer("steps", 30, "RL train steps")
    flags.DEFINE_bool("eval", False, "keep the config's held-out evaluations")
    flags.mark_flag_as_required("workdir")
    app.run(main)
