"""Supervised warm start: teacher forcing on a task's demonstrations.

    python -m dora_jax.sft --config=configs/longtail.py --workdir=/tmp/sft

RL starts from a supervised model in practice. This trains the config's policy (from
model.checkpoint's weights when set) to maximise the log-likelihood of each prompt's
demonstration (the correct response its task defines, e.g. the countdown; for text
tasks the answer in the format the prompt asks for, then EOS) and writes the params as an Orbax checkpoint in
`<workdir>/checkpoints/`, which an RL run starts from with
`--config.init_checkpoint=<workdir>/checkpoints`. Loss values go to
`<workdir>/sft_metrics.jsonl`. One device; the policies this is for are small.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dora_jax.checkpointing import Checkpointer
from dora_jax.config import Config
from dora_jax.data import sources
from dora_jax.model import transformer
from dora_jax.rl.batch import TrainBatch


def demonstration_batch(cfg: Config, records: list, demonstrate, rows: np.ndarray) -> TrainBatch:
    """Prompt + demonstration for each chosen record, padded to a length bucket; the
    loss mask covers the demonstration tokens."""
    trajs = []
    for n, i in enumerate(rows):
        response = demonstrate(records[i])
        trajs.append({"prompt_tokens": records[i]["tokens"], "response_tokens": response,
                      "behaviour_logprobs": np.zeros(len(response), np.float32),
                      "reward": 0.0, "group_id": n, "version": 0})
    return TrainBatch.from_trajectories(trajs, group_size=1,
                                        length_buckets=cfg.trainer.length_buckets,
                                        pad_id=cfg.rollout.pad_id)


def train(cfg: Config, workdir: str, *, steps: int, batch_size: int, learning_rate: float,
          log_every: int = 10) -> dict:
    """Runs `steps` teacher-forced updates; returns {loss_first, loss_last, checkpoint}."""
    from dora_jax.experiment import initial_params

    tokenizer = sources.tokenizer_for(cfg)
    demonstrate = sources.demonstration_for(cfg, tokenizer)  # fails before compute
    records, _ = sources.prompt_records(cfg, tokenizer)
    os.makedirs(workdir, exist_ok=True)
    graphdef, params = initial_params(cfg)
    tx = optax.chain(optax.clip_by_global_norm(cfg.trainer.grad_clip),
                     optax.adamw(learning_rate, weight_decay=cfg.trainer.weight_decay))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens_BT, mask_BT):
        def loss_fn(p):
            logits, _, _ = transformer.apply(graphdef, p, tokens_BT)
            logp_BT = transformer.token_logprobs(logits, tokens_BT)
            return -jnp.sum(logp_BT * mask_BT) / jnp.maximum(jnp.sum(mask_BT), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(cfg.seed)
    losses = []
    with open(os.path.join(workdir, "sft_metrics.jsonl"), "w") as log:
        for i in range(steps):
            batch = demonstration_batch(cfg, records, demonstrate,
                                        rng.integers(len(records), size=batch_size))
            params, opt_state, loss = step(params, opt_state, batch.tokens_BT,
                                           batch.loss_mask_BT)
            if i % log_every == 0 or i == steps - 1:
                losses.append(float(loss))
                log.write(json.dumps({"step": i, "loss": losses[-1]}) + "\n")
    directory = os.path.join(workdir, "checkpoints")
    with Checkpointer(directory, async_save=False) as checkpointer:
        checkpointer.save(steps, params, {"kind": "sft_params", "loss": losses[-1]}, force=True)
    return {"loss_first": losses[0], "loss_last": losses[-1], "checkpoint": directory}


if __name__ == "__main__":
    from absl import app, flags, logging

    from dora_jax import cli

    _CONFIG = cli.define_config_flag()
    _WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints/ and sft_metrics.jsonl")
    _STEPS = flags.DEFINE_integer("steps", 300, "teacher-forced updates")
    _BATCH = flags.DEFINE_integer("batch_size", 32, "demonstrations per update")
    _LR = flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate")
    flags.mark_flag_as_required("workdir")

    def main(argv):
        del argv
        logging.set_verbosity(logging.WARNING)
        cfg = cli.validated_config(_CONFIG)
        with cli.one_line_errors():
            out = train(cfg, _WORKDIR.value, steps=_STEPS.value, batch_size=_BATCH.value,
                        learning_rate=_LR.value)
        print(f"sft: loss {out['loss_first']:.4f} -> {out['loss_last']:.4f}; start RL with "
              f"--config.init_checkpoint={out['checkpoint']}")

    app.run(main, flags_parser=cli.parse_flags)
