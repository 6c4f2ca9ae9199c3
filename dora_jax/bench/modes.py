"""The four scheduling modes side by side on one workload, in one process.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m dora_jax.bench.modes --config=configs/tiny.py --steps=30

Each mode runs the same config (same prompts, seed, model, slices) for the same
number of steps; compilation happens before each run's clock starts. Prints trained
tokens/s and the trainer-wait fraction over the steady-state window (after step 0),
mean slot utilisation, and the reward at the first and last step. Workdirs (ledger,
metrics, timeline.png per mode) are kept under --workdir.
"""

from __future__ import annotations

import os
import tempfile

from absl import app, flags, logging
from ml_collections import config_flags

from dora_jax.bench import CONFIGS

_CONFIG = config_flags.DEFINE_config_file("config", str(CONFIGS / "tiny.py"), "config file")
_STEPS = flags.DEFINE_integer("steps", 30, "train steps per mode")
_MODES = flags.DEFINE_list("modes", ["sync", "one_step_off", "partial_rollout", "dora"],
                           "modes to run")
_WORKDIR = flags.DEFINE_string("workdir", None, "where each mode's run is kept")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    import jax

    from dora_jax import config as config_lib, experiment

    root = _WORKDIR.value or tempfile.mkdtemp(prefix="dora_modes_")
    rows = []
    for mode in _MODES.value:
        c = _CONFIG.value.copy_and_resolve_references()
        c.coordinator.mode = mode
        c.coordinator.num_steps = _STEPS.value
        cfg = config_lib.validate(c, num_devices=jax.device_count())
        summary = experiment.run(cfg, os.path.join(root, mode))
        rows.append((mode, summary))
        print(f"{mode}: {summary}", flush=True)
    print(f"\nworkload: {_CONFIG.value.coordinator.train_batch_size} groups x "
          f"{_CONFIG.value.coordinator.group_size} samples per step, {_STEPS.value} steps; "
          f"runs in {root}")
    header = (f"{'mode':16} {'tokens/s':>9} {'trainer wait':>13} {'slot util':>10} "
              f"{'reward first':>13} {'reward last':>12} {'max stale':>9}")
    print(header)
    print("-" * len(header))
    for mode, s in rows:
        stale = max(int(k) for k in s["staleness"])
        print(f"{mode:16} {s['tokens_per_second']:9.1f} {s['trainer_wait_fraction']:13.3f} "
              f"{s['mean_slot_utilisation']:10.3f} {s['reward_first']:13.3f} "
              f"{s['reward_last']:12.3f} {stale:9d}")
    base = dict(rows).get("sync")
    if base:
        for mode, s in rows:
            if mode != "sync":
                print(f"{mode}/sync tokens/s ratio: "
                      f"{s['tokens_per_second'] / base['tokens_per_second']:.2f}")


if __name__ == "__main__":
    app.run(main)
