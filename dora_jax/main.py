"""Entry point: python -m dora_jax.main --config=configs/tiny.py --workdir=DIR

Trains a policy with RL in the mode the config names and writes ledger.jsonl,
metrics.jsonl (also as TensorBoard scalars in DIR/tensorboard), timeline.png,
summary.json and checkpoints/ to DIR. The same command on a workdir that holds a run
resumes it (after a crash too); --fresh starts over. On a host without an
accelerator the config's devices are faked on the CPU (unless XLA_FLAGS is set).
The same command runs as several processes (the trainer's lead and slice processes)
under a launcher: python -m dora_jax.launch.local --processes=3 -- <these flags>.

Every config field can be overridden; the main ones:
  --config.coordinator.mode=dora        sync | one_step_off | partial_rollout |
                                        partial_rollout_rounds | dora
  --config.mesh.colocated=True          trainer and slices take turns on the same
                                        devices (mode sync)
  --config.coordinator.max_staleness=2  K: how many versions a trajectory may lag
  --config.coordinator.num_steps=100    train steps (raise it to extend a run)
  --config.coordinator.train_batch_size=4 / rollout_batch_size=8 / group_size=4
  --config.model.checkpoint=DIR         start from a Hugging Face checkpoint
  --config.data.source=gsm8k --config.data.path=FILE   (or math, reasoning_gym, tfds,
                                        jsonl, residue, countdown; data.task for
                                        reasoning_gym)
  --config.trainer.learning_rate=1e-6   and trainer.objective, trainer.kl_coef, ...
  --config.init_checkpoint=DIR          params from dora_jax.sft's checkpoints/

configs/moe.py, the flagship, is a dry run without a checkpoint; on a host without
its 256 chips, one line names configs/moe.py:tiny.

Configs (--config=configs/NAME.py[:variant], or from any directory --config=NAME[:variant]):
"""

from absl import app, flags, logging

from dora_jax import configs
from dora_jax.runtime import cli

# The list is read from the configs' directory (dora_jax/configs): it names every one.
__doc__ += configs.listing() + "\n"

_CONFIG = cli.define_config_flag(lock=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "ledger, metrics, timeline, checkpoints",
                               required=True)
_FRESH = flags.DEFINE_bool("fresh", False, "start over in a workdir that holds a run "
                           "(by default the run there is resumed)")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    # Before JAX: it says how many devices to fake; the tokenizer read is reused.
    cfg, pretrained = cli.validated_config(_CONFIG, with_pretrained=True)
    cli.workdir_to_write(_WORKDIR.value)
    cli.start_devices(cfg)
    role = cli.process_role(cfg)
    if role.trains and not role.lead:  # its share of the trainer (launch/local.py)
        from dora_jax.runtime import trainer_process

        with cli.one_line_errors():
            trainer_process.follow(cfg, _WORKDIR.value, role)
        return
    if not role.lead:  # a slice process of a run of several
        from dora_jax.runtime import compile_times, slice_process

        assert role.coordinator is not None  # roles.from_env sets it for several processes
        # A replacement process reads what the one before it compiled.
        compile_times.use_persistent_cache(_WORKDIR.value)
        slice_process.serve(cfg, role.process_id, role.coordinator,
                            tokenizer=pretrained.tokenizer)
        return
    import tqdm

    from dora_jax.runtime import experiment

    bar = None

    def on_step(r):  # the bar starts with the first step: errors before it stand alone
        nonlocal bar
        if bar is None:
            bar = tqdm.tqdm(total=cfg.coordinator.num_steps, desc=cfg.coordinator.mode,
                            unit="step", initial=r["step"])
        tokens_per_s = r["trained_tokens"] / max(r["step_time"] + r["trainer_wait"], 1e-9)
        bar.set_postfix(step=r["step"], reward=f"{r['reward_mean']:.3f}",
                        tok_s=f"{tokens_per_s:.0f}", versions=r["resident_versions"])
        bar.update(1)

    try:
        with cli.one_line_errors():
            summary = experiment.run(cfg, _WORKDIR.value, on_step=on_step, fresh=_FRESH.value,
                                     tokenizer=pretrained.tokenizer, role=role,
                                     progress=lambda line: print(line, flush=True))
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
    app.run(main, flags_parser=cli.parse_flags)
