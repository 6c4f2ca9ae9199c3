"""Entry point: python -m dora_jax.main --config=configs/tiny.py --workdir=DIR.

Every field can be overridden: --config.coordinator.mode=sync,
--config.coordinator.max_staleness=2, ... On a CPU, fake the devices the config's
mesh needs with XLA_FLAGS=--xla_force_host_platform_device_count=8. The same command
on a workdir that holds a run resumes it (after a crash too); --fresh starts over.
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/x.py[:variant]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "ledger, metrics, timeline, checkpoints")
_FRESH = flags.DEFINE_bool("fresh", False, "start over in a workdir that holds a run "
                           "(by default the run there is resumed)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    import jax
    import tqdm

    from dora_jax import config as config_lib, experiment

    cfg = config_lib.validate(_CONFIG.value, num_devices=jax.device_count())
    bar = tqdm.tqdm(total=cfg.coordinator.num_steps, desc=cfg.coordinator.mode, unit="step")

    def on_step(r):
        tokens_per_s = r["trained_tokens"] / max(r["step_time"] + r["trainer_wait"], 1e-9)
        bar.set_postfix(step=r["step"], reward=f"{r['reward_mean']:.3f}",
                        tok_s=f"{tokens_per_s:.0f}", versions=r["resident_versions"])
        bar.update(1)

    from dora_jax.data.prompts import DataError

    try:
        summary = experiment.run(cfg, _WORKDIR.value, on_step=on_step, fresh=_FRESH.value)
    except (config_lib.ConfigError, DataError) as e:  # one line, no traceback
        bar.close()
        raise SystemExit(f"error: {e}") from None
    bar.close()
    if "already_trained" in summary:
        print(f"{_WORKDIR.value} already holds all {summary['already_trained']} steps "
              "(raise --config.coordinator.num_steps to go on, or --fresh to start over)")
        return
    if "resumed_from_step" in summary:
        print(f"resumed from step {summary['resumed_from_step']}")
    print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    print(f"wrote {_WORKDIR.value}/ledger.jsonl, metrics.jsonl, timeline.png, checkpoints/")


if __name__ == "__main__":
    app.run(main)
