"""Export a run's policy as a Hugging Face checkpoint.

    python -m dora_jax.export --config=configs/quickstart.py --workdir=/tmp/qs --out=/tmp/qs_hf

Restores the newest checkpoint of the run in `--workdir` (the same config and
overrides as the run, so the same meshes) and writes the policy's params with
`model.hf.save_pretrained`: config.json, generation_config.json, safetensors and, when
the run has a tokenizer, its files. transformers and vLLM load the directory as they
load the family's hub checkpoints.
"""

from __future__ import annotations

import os

from dora_jax.config import Config


def export(cfg: Config, workdir: str, out: str, *, dtype: str | None = None) -> dict:
    """Writes the newest params of the run in `workdir` to `out`; returns
    {"step", "files", "out"}. FileNotFoundError if the run has no checkpoint."""
    from dora_jax.checkpointing import Checkpointer
    from dora_jax.data import sources
    from dora_jax import devices
    from dora_jax.model import hf
    from dora_jax.rl.trainer import Trainer

    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{workdir}: no checkpoints/ (has the run saved a step?)")
    trainer_mesh, _ = devices.make_meshes(cfg.mesh)
    trainer = Trainer(cfg, trainer_mesh)
    with Checkpointer(directory, async_save=False) as checkpointer:
        step = checkpointer.latest_step()
        if step is None:
            raise FileNotFoundError(f"{directory}: no checkpoint")
        state, _ = checkpointer.restore(trainer.abstract_state(), step)
    trainer.load_state(state)
    files = hf.save_pretrained(cfg.model, trainer.params, out, dtype=dtype,
                               tokenizer=sources.tokenizer_for(cfg))
    return {"step": step, "files": files, "out": out}


if __name__ == "__main__":
    from absl import app, flags, logging

    from dora_jax import cli

    _CONFIG = cli.define_config_flag()
    _WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir")
    _OUT = flags.DEFINE_string("out", None, "the Hugging Face checkpoint directory to write")
    _DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                               "stored dtype (default: the params')")
    flags.mark_flags_as_required(["workdir", "out"])

    def main(argv):
        del argv
        logging.set_verbosity(logging.WARNING)
        cfg = cli.validated_config(_CONFIG)
        cli.start_devices(cfg)  # the run's meshes: faked on a CPU host before JAX starts
        with cli.one_line_errors():
            result = export(cfg, _WORKDIR.value, _OUT.value, dtype=_DTYPE.value)
        print(f"wrote step {result['step']} of {_WORKDIR.value} to {result['out']}/ "
              f"({', '.join(result['files'])})")

    app.run(main, flags_parser=cli.parse_flags)
