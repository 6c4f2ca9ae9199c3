"""Supervised warm start: teacher forcing on a task's demonstrations.

    python -m dora_jax.sft --config=configs/longtail.py --workdir=/tmp/sft

RL starts from a supervised model in practice. This trains the config's policy (from
model.checkpoint's weights when set) to maximise the log-likelihood of each prompt's
demonstration (the correct response its task defines, e.g. the countdown; for text
tasks the answer in the format the prompt asks for, then EOS) and writes the params
as an Orbax checkpoint in `<workdir>/checkpoints/`, which an RL run starts from with
`--config.init_checkpoint=<workdir>/checkpoints`. Loss values go to
`<workdir>/sft_metrics.jsonl`, and a progress line (`sft step 30/300: loss 0.4321,
12.50 steps/s`) is printed every tenth of the run; before them, a line as the train
step starts compiling and one when it is done (`compiling: ...`, `compiled in N s:
...`; the same command again reads its programs from `<workdir>/compile_cache`). One
device; the policies this is for are small. With LoRA (`model.lora.rank` > 0) only
the adapters train, as in RL; the checkpoint holds base and adapters.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dora_jax.config import Config
from dora_jax.model import lora, transformer
from dora_jax.model.checkpointing import Checkpointer
from dora_jax.rl import packing
from dora_jax.rl.batch import TrainBatch
from dora_jax.tasks import sources


def demonstration_batch(cfg: Config, records: list, demonstrate, rows: np.ndarray) -> TrainBatch:
    """Prompt + demonstration for each chosen record, padded to a length bucket; the
    loss mask covers the demonstration tokens."""
    trajs = []
    for n, i in enumerate(rows):
        response = demonstrate(records[i])
        extra = {}
        if isinstance(response, dict):  # a multi-turn episode: observations get no loss
            response, extra = response["response_tokens"], {"episode": response["episode"]}
        trajs.append({"prompt_tokens": records[i]["tokens"], "response_tokens": response,
                      "behaviour_logprobs": np.zeros(len(response), np.float32),
                      "reward": 0.0, "group_id": n, "version": 0, **extra})
    return TrainBatch.from_trajectories(trajs, group_size=1,
                                        length_buckets=cfg.trainer.length_buckets,
                                        pad_id=cfg.rollout.pad_id)


def _layout(cfg: Config, batch: TrainBatch) -> dict:
    """The demonstrations as rows [U, r, T]: packed whole into rows of the batch's
    length bucket, micro-batches of about trainer.tokens_per_microbatch tokens (as the
    RL step: rl/packing.py); else one padded micro-batch. One device: no shards."""
    t = cfg.trainer
    if t.tokens_per_microbatch:
        out = packing.packed(batch, 1, batch.length, t.tokens_per_microbatch // batch.length)
    else:
        out = packing.padded(batch, 1, 1)
    return {k: out[k][0] for k in ("tokens", "positions", "segment_ids", "loss_mask")}


def _step(graphdef, tx, packed: bool, base, params, opt_state, rows):
    """One teacher-forced update: the token-mean negative log-likelihood over the
    demonstrations, gradients accumulated over the micro-batches (packed: attention
    kept within each sample, empty micro-batches skipped). base: None, or with LoRA
    the frozen base of `params` (then the adapters)."""
    ntok = jnp.maximum(jnp.sum(rows["loss_mask"]), 1.0)

    def loss_fn(p, mb):
        if base is not None:
            p = lora.merge(jax.lax.stop_gradient(base), p)
        valid_BT = mb["segment_ids"] > 0
        kwargs = dict(segment_ids_BT=mb["segment_ids"]) if packed else {}
        logits, _, _ = transformer.apply(graphdef, p, mb["tokens"],
                                         mb["positions"] if packed else None,
                                         valid_BT=valid_BT, **kwargs)
        logp_BT = transformer.token_logprobs(logits, mb["tokens"])
        return -jnp.sum(logp_BT * mb["loss_mask"]) / ntok

    grad_fn = jax.value_and_grad(loss_fn)

    def body(acc, mb):
        def run(mb):
            return grad_fn(params, mb)

        def skip(mb):
            return jax.tree.map(jnp.zeros_like, jax.eval_shape(run, mb))

        loss, grads = jax.lax.cond(jnp.any(mb["segment_ids"] > 0), run, skip, mb)
        return jax.tree.map(jnp.add, acc, (loss, grads)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zero, rows)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def train(cfg: Config, workdir: str, *, steps: int, batch_size: int, learning_rate: float,
          log_every: int = 10, progress_every: int | None = None) -> dict:
    """Runs `steps` teacher-forced updates; returns {loss_first, loss_last, checkpoint}.
    Prints a progress line every `progress_every` steps and after the last (None:
    max(1, steps // 10); 0: none); its steps/s is over the steps since the line
    before (the first's includes compilation). Before the first step it says that it
    compiles, and after it how long that took (`compile_seconds.json`, which the next
    run in `workdir` reads to say how long it will be)."""
    from dora_jax.runtime import compile_times
    from dora_jax.runtime.experiment import initial_params

    tokenizer = sources.tokenizer_for(cfg)
    demonstrate = sources.demonstration_for(cfg, tokenizer)  # fails before compute
    records, _ = sources.prompt_records(cfg, tokenizer)
    os.makedirs(workdir, exist_ok=True)
    graphdef, params = initial_params(cfg)
    base = None
    if cfg.model.lora.enabled:  # the adapters alone train
        base, params = lora.split(params)
    tx = optax.chain(optax.clip_by_global_norm(cfg.trainer.grad_clip),
                     optax.adamw(learning_rate, weight_decay=cfg.trainer.weight_decay))
    opt_state = tx.init(params)

    step = jax.jit(functools.partial(_step, graphdef, tx, cfg.trainer.tokens_per_microbatch > 0))

    rng = np.random.default_rng(cfg.seed)
    losses = []
    every = max(1, steps // 10) if progress_every is None else progress_every
    phase, watch = "train step (with the first update)", compile_times.Stopwatch()
    if every > 0:
        print(compile_times.announcement([phase], workdir), flush=True)
    shown, since = 0, time.perf_counter()
    with open(os.path.join(workdir, "sft_metrics.jsonl"), "w") as log:
        for i in range(steps):
            batch = demonstration_batch(cfg, records, demonstrate,
                                        rng.integers(len(records), size=batch_size))
            if i == 0:
                with watch(phase):
                    params, opt_state, loss = jax.block_until_ready(
                        step(base, params, opt_state, _layout(cfg, batch)))
                watch.save(workdir)
                if every > 0:
                    print(watch.summary(), flush=True)
            else:
                params, opt_state, loss = step(base, params, opt_state, _layout(cfg, batch))
            logged = i % log_every == 0 or i == steps - 1
            show = every > 0 and ((i + 1) % every == 0 or i == steps - 1)
            if not (logged or show):
                continue  # the loss stays on the device: no host sync this step
            value = float(loss)
            if logged:
                losses.append(value)
                log.write(json.dumps({"step": i, "loss": value}) + "\n")
            if show:
                now = time.perf_counter()
                print(f"sft step {i + 1}/{steps}: loss {value:.4f}, "
                      f"{(i + 1 - shown) / (now - since):.2f} steps/s", flush=True)
                shown, since = i + 1, now
    if base is not None:
        params = lora.merge(base, params)
    directory = os.path.join(workdir, "checkpoints")
    with Checkpointer(directory, async_save=False) as checkpointer:
        checkpointer.save(steps, params, {"kind": "sft_params", "loss": losses[-1]}, force=True)
    return {"loss_first": losses[0], "loss_last": losses[-1], "checkpoint": directory}


if __name__ == "__main__":
    from absl import app, flags, logging

    from dora_jax.runtime import cli, compile_times

    _CONFIG = cli.define_config_flag()
    _WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints/ and sft_metrics.jsonl",
                                   required=True)
    _STEPS = flags.DEFINE_integer("steps", 300, "teacher-forced updates")
    _BATCH = flags.DEFINE_integer("batch_size", 32, "demonstrations per update")
    _LR = flags.DEFINE_float("learning_rate", 3e-3, "AdamW learning rate")

    def main(argv):
        del argv
        logging.set_verbosity(logging.WARNING)
        cfg = cli.validated_config(_CONFIG)
        cli.workdir_to_write(_WORKDIR.value)
        with cli.one_line_errors():
            # As `main` does: the same command again compiles nothing it compiled.
            compile_times.use_persistent_cache(_WORKDIR.value)
            out = train(cfg, _WORKDIR.value, steps=_STEPS.value, batch_size=_BATCH.value,
                        learning_rate=_LR.value)
        print(f"sft: loss {out['loss_first']:.4f} -> {out['loss_last']:.4f}; start RL with "
              f"--config.init_checkpoint={out['checkpoint']}")

    app.run(main, flags_parser=cli.parse_flags)
