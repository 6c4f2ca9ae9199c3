"""Export a run's policy as a Hugging Face checkpoint, or its LoRA adapters in PEFT's format.

    python -m dora_jax.export --config=configs/quickstart.py --workdir=/tmp/qs --out=/tmp/qs_hf
    python -m dora_jax.export --config=... --workdir=/tmp/run --out=/tmp/adapter --format=peft

Restores the newest checkpoint of the run in `--workdir` (the same config and
overrides as the run, so the same meshes). `--format=merged` (the default) writes the
policy's params with `model.hf.save_pretrained`, LoRA adapters folded into the
weights: config.json, generation_config.json, safetensors and, when the run has a
tokenizer, its files; transformers and vLLM load the directory as they load the
family's hub checkpoints. `--format=peft` (a LoRA run) writes the adapters alone
(`model.peft_format.save_adapters`: adapter_config.json, adapter_model.safetensors),
for `peft.PeftModel.from_pretrained` on the base: `model.checkpoint`, or with
`--base_out=DIR` the run's base written there (needed when the base is not
model.checkpoint's, e.g. random or from init_checkpoint).
"""

from __future__ import annotations

import os

from dora_jax.config import Config

FORMATS = ("merged", "peft")


def export(cfg: Config, workdir: str, out: str, *, dtype: str | None = None,
           format: str = "merged", base_out: str | None = None) -> dict:
    """Writes the newest params of the run in `workdir` to `out` (`format`: FORMATS);
    returns {"step", "files", "out"} (and "base" for peft). FileNotFoundError if the
    run has no checkpoint."""
    from dora_jax.model import hf, lora, peft_format
    from dora_jax.tasks import sources

    if format not in FORMATS:
        raise ValueError(f"format {format!r}: one of {FORMATS}")
    base = base_out or ("" if cfg.init_checkpoint else cfg.model.checkpoint)
    if format == "peft" and not cfg.model.lora.enabled:
        raise peft_format.PeftFormatError("--format=peft exports LoRA adapters, but the run "
                                          "has none (model.lora.rank is 0)")
    if format == "peft" and not base:
        raise peft_format.PeftFormatError(
            "--format=peft: the run's base is not model.checkpoint's (random, or from "
            "init_checkpoint): pass --base_out=DIR to write it beside the adapters")
    step, params = newest_params(cfg, workdir)
    tokenizer = sources.tokenizer_for(cfg)
    if format == "merged":
        files = hf.save_pretrained(cfg.model, params, out, dtype=dtype,
                                   tokenizer=tokenizer)
        return {"step": step, "files": files, "out": out}
    if base_out:
        hf.save_pretrained(lora.base_config(cfg.model), lora.split(params)[0],
                           base_out, dtype=dtype, tokenizer=tokenizer)
    files = peft_format.save_adapters(cfg.model, params, out, dtype=dtype,
                                      base_model_name_or_path=os.path.abspath(base))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return {"step": step, "files": files, "out": out, "base": base_out or base}


def newest_params(cfg: Config, workdir: str, trainer_mesh=None) -> tuple:
    """(step, params) of the newest checkpoint of the run in `workdir`, on the trainer
    mesh (built from `cfg.mesh` if not given). FileNotFoundError if it has none."""
    from dora_jax.config import devices
    from dora_jax.model.checkpointing import Checkpointer
    from dora_jax.rl.trainer import Trainer

    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{workdir}: no checkpoints/ (has the run saved a step?)")
    if trainer_mesh is None:
        trainer_mesh, _ = devices.make_meshes(cfg.mesh)
    trainer = Trainer(cfg, trainer_mesh)
    with Checkpointer(directory, async_save=False) as checkpointer:
        step = checkpointer.latest_step()
        if step is None:
            raise FileNotFoundError(f"{directory}: no checkpoint")
        state, _ = checkpointer.restore(trainer.abstract_state(), step)
    trainer.load_state(state)
    return step, trainer.params


if __name__ == "__main__":
    from absl import app, flags, logging

    from dora_jax.runtime import cli

    _CONFIG = cli.define_config_flag()
    _WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir", required=True)
    _OUT = flags.DEFINE_string("out", None, "the directory to write: the Hugging Face "
                               "checkpoint, or with --format=peft the adapter",
                               required=True)
    _DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                               "stored dtype (default: the params')")
    _FORMAT = flags.DEFINE_enum("format", "merged", list(FORMATS),
                                "merged: a Hugging Face checkpoint, adapters folded in; "
                                "peft: the LoRA adapters in PEFT's format")
    _BASE_OUT = flags.DEFINE_string("base_out", None, "with --format=peft: also write the "
                                    "run's base as a Hugging Face checkpoint here")

    def main(argv):
        del argv
        logging.set_verbosity(logging.WARNING)
        cfg = cli.validated_config(_CONFIG)
        cli.workdir_to_read(_WORKDIR.value)
        cli.start_devices(cfg)  # the run's meshes: faked on a CPU host before JAX starts
        with cli.one_line_errors():
            result = export(cfg, _WORKDIR.value, _OUT.value, dtype=_DTYPE.value,
                            format=_FORMAT.value, base_out=_BASE_OUT.value)
        print(f"wrote step {result['step']} of {_WORKDIR.value} to {result['out']}/ "
              f"({', '.join(result['files'])})"
              + (f", on base {result['base']}" if "base" in result else ""))

    app.run(main, flags_parser=cli.parse_flags)
