"""Entry point: python -m dora_jax.main --config=configs/tiny.py --workdir=DIR

Trains a policy with RL in the mode the config names and writes ledger.jsonl,
metrics.jsonl (also as TensorBoard scalars in DIR/tensorboard), timeline.png,
summary.json and checkpoints/ to DIR. The same command on a workdir that holds a run
resumes it (after a crash too); --fresh starts over. On a host without an
accelerator the config's devices are faked on the CPU (unless XLA_FLAGS is set).

Every config field can be overridden; the main ones:
  --config.coordinator.mode=dora        colocated_sync | sync | one_step_off |
                                        partial_rollout | dora
  --config.coordinator.max_staleness=2  K: how many versions a trajectory may lag
  --config.coordinator.num_steps=100    train steps (raise it to extend a run)
  --config.coordinator.train_batch_size=4 / rollout_batch_size=8 / group_size=4
  --config.model.checkpoint=DIR         start from a Hugging Face checkpoint
  --config.data.source=gsm8k --config.data.path=FILE   (or math, reasoning_gym, tfds,
                                        jsonl, residue, countdown; data.task for
                                        reasoning_gym)
  --config.trainer.learning_rate=1e-6   and trainer.objective, trainer.kl_coef, ...
  --config.init_checkpoint=DIR          params from dora_jax.sft's checkpoints/
Configs: configs/tiny.py (CPU), configs/quickstart.py, configs/longtail.py,
configs/qwen3_gsm8k.py[:tiny], configs/moe.py[:tiny].
"""

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/x.py[:variant]",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "ledger, metrics, timeline, checkpoints")
_FRESH = flags.DEFINE_bool("fresh", False, "start over in a workdir that holds a run "
                           "(by default the run there is resumed)")
flags.mark_flags_as_required(["config", "workdir"])


def _last_line(error) -> str:
    return [line.strip() for line in str(error).splitlines() if line.strip()][-1]


def _parse_flags(argv):
    """absl's parsing, with a bad flag or config file reported in one line."""
    try:
        return flags.FLAGS(argv)
    except SystemExit:  # absl's --help prints and exits 1: asking for help is no error
        if any(a in ("-h", "-?", "--help", "--helpshort", "--helpfull") for a in argv):
            raise SystemExit(0) from None
        raise
    except flags.Error as e:  # config_flags embeds the config file's traceback
        first, last = str(e).splitlines()[0].rstrip(":"), _last_line(e)
        raise SystemExit(f"error: {first}" + ("" if last == first else f": {last}")) from None
    except (AttributeError, KeyError) as e:  # --config.<path> naming no field
        name = _last_line(e).strip("\"'")
        bad = [a.split("=")[0] for a in argv if a.startswith("--config.")
               and name in a.split("=")[0].split(".")[1:]]
        raise SystemExit(f"error: {bad[0] if bad else name}: no such config field") from None


def _config():
    """The --config ConfigDict, or one line saying why it did not load."""
    try:
        value = _CONFIG.value
        value.to_dict()  # a file that failed to load fails here, not later
        return value
    except (OSError, ValueError, SyntaxError) as e:
        raise SystemExit(f"error: --config could not be loaded: {_last_line(e)}") from None


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from dora_jax import config as config_lib
    from dora_jax.data.prompts import DataError
    from dora_jax.model.hf_config import CheckpointError
    from dora_jax.runtime import host

    one_line = (config_lib.ConfigError, DataError, CheckpointError, FileNotFoundError)
    try:  # before JAX: the config says how many devices to fake on a CPU host
        cfg = config_lib.validate(_config())
    except one_line as e:
        raise SystemExit(f"error: {e}") from None
    note = host.fake_cpu_devices_if_needed(cfg.mesh.total_devices)
    if note:
        print(note)
    host.start_pathways_if_proxied()
    import jax
    import tqdm

    from dora_jax import experiment

    bar = None
    try:
        config_lib.check_devices(cfg, jax.device_count())

        def on_step(r):  # the bar starts with the first step: errors before it stand alone
            nonlocal bar
            if bar is None:
                bar = tqdm.tqdm(total=cfg.coordinator.num_steps, desc=cfg.coordinator.mode,
                                unit="step", initial=r["step"])
            tokens_per_s = r["trained_tokens"] / max(r["step_time"] + r["trainer_wait"], 1e-9)
            bar.set_postfix(step=r["step"], reward=f"{r['reward_mean']:.3f}",
                            tok_s=f"{tokens_per_s:.0f}", versions=r["resident_versions"])
            bar.update(1)

        summary = experiment.run(cfg, _WORKDIR.value, on_step=on_step, fresh=_FRESH.value)
    except one_line as e:  # one line, no traceback
        raise SystemExit(f"error: {e}") from None
    finally:
        if bar is not None:
            bar.close()
    if "already_trained" in summary:
        print(f"{_WORKDIR.value} already holds all {summary['already_trained']} steps "
              "(raise --config.coordinator.num_steps to go on, or --fresh to start over)")
        return
    if "resumed_from_step" in summary:
        print(f"resumed from step {summary['resumed_from_step']}")
    print("summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    print(f"wrote {_WORKDIR.value}/ledger.jsonl, metrics.jsonl, tensorboard/, timeline.png, "
          "checkpoints/")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
