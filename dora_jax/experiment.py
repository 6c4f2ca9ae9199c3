"""Builds every part of a run from a validated config and runs it.

`run(cfg, workdir)` is what `python -m dora_jax.main` calls; tests call it too.
The workdir receives ledger.jsonl, metrics.jsonl, timeline.png (+ timeline.json),
summary.json and checkpoints/.
"""

from __future__ import annotations

import json
import os
from typing import Callable


from dora_jax.checkpointing import Checkpointer, load_params
from dora_jax.config import Config
from dora_jax.data import prompts as prompts_lib
from dora_jax.data import tasks
from dora_jax.model import sharding, transformer
from dora_jax.rl.trainer import Trainer
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.rollout.warmup import warm_engine
from dora_jax.runtime.loop import Runtime
from dora_jax.runtime.report import StepReporter
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.ledger import LedgerWriter
from dora_jax.scheduler.modes import policy_for
from dora_jax.scheduler.types import SchedulerConfig
from dora_jax.timeline import Timeline


def prompt_records(cfg: Config) -> list[dict]:
    """The prompt source named by `cfg.data`, validated."""
    d, vocab = cfg.data, cfg.model.vocab_size
    if d.source in ("residue", "countdown"):  # generated
        records = (tasks.residue_prompts(d.num_prompts, vocab, prompt_len=d.prompt_len,
                                         modulus=d.modulus, seed=cfg.seed)
                   if d.source == "residue" else
                   tasks.countdown_prompts(d.num_prompts, vocab, median=d.count_median,
                                           sigma=d.count_sigma, max_count=d.max_count,
                                           seed=cfg.seed))
        return prompts_lib.in_memory(records, vocab)
    records = prompts_lib.read_jsonl(d.path, vocab_size=vocab)  # validate() allows no other
    too_long = [r["prompt_id"] for r in records if len(r["tokens"]) > cfg.rollout.max_prefill_length]
    if too_long:
        raise prompts_lib.DataError(
            f"{len(too_long)} prompt(s) longer than rollout.max_prefill_length="
            f"{cfg.rollout.max_prefill_length}, e.g. {too_long[:3]}")
    return records


def warm_up(slices, trainer, cfg: Config) -> None:
    """Compiles every jitted function a run will use before its clock starts, so
    throughput and waits measure steady state."""
    batch_size = cfg.coordinator.train_batch_size * cfg.coordinator.group_size
    trainer.warmup(batch_size, cfg.coordinator.group_size)
    reprefills = not policy_for(cfg.coordinator.mode).keeps_c1
    for sl in slices:
        warm_engine(sl.engine, sl.params, reprefills=reprefills)
        sl.reset_decode_state()


def run(cfg: Config, workdir: str, *, records: list[dict] | None = None,
        on_step: Callable[[dict], None] = lambda record: None,
        make_trainer: Callable[..., Trainer] = Trainer) -> dict:
    """Runs `cfg.coordinator.num_steps` train steps end to end; returns the summary.

    `make_trainer(cfg, mesh, params=, graphdef=)` builds the trainer (a subclass can
    instrument it). Raises `runtime.loop.RunError` if any part fails; the ledger
    then still accounts for every admitted group."""
    os.makedirs(workdir, exist_ok=True)
    records = prompt_records(cfg) if records is None else records
    reward_fn = tasks.reward_fn(cfg.data.reward)  # an unknown name fails before compute
    if cfg.init_checkpoint and not os.path.isdir(cfg.init_checkpoint):
        raise FileNotFoundError(f"config.init_checkpoint: no checkpoint directory at "
                                f"{cfg.init_checkpoint!r}")
    trainer_mesh, slice_meshes = sharding.make_meshes(cfg.mesh)
    graphdef, params = transformer.create(cfg.model, cfg.seed)
    if cfg.init_checkpoint:
        params = load_params(cfg.init_checkpoint, params)
    # Without lookahead a slice reports a finished sample in the step that ends it,
    # so the scheduler never migrates or reloads around a request that has in fact
    # already finished on the device.
    slices = [DecodeSlice.create(i, mesh, cfg.model, cfg.rollout, rules=cfg.mesh.decode_rules,
                                 lookahead=False)
              for i, mesh in enumerate(slice_meshes)]
    for sl in slices:  # every slice starts on version 0, as the scheduler assumes
        sl.load_version(0, params)
    trainer = make_trainer(cfg, trainer_mesh, params=params, graphdef=graphdef)
    warm_up(slices, trainer, cfg)

    stream = prompts_lib.PromptStream(prompts_lib.prompt_dataset(
        records, seed=cfg.seed, shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs))
    rewards = tasks.RewardPool(reward_fn, cfg.coordinator.reward_threads)
    ledger = LedgerWriter(os.path.join(workdir, "ledger.jsonl"))
    reporter = StepReporter(os.path.join(workdir, "metrics.jsonl"))
    timeline = Timeline()
    max_groups = None if cfg.data.num_epochs is None else len(records) * cfg.data.num_epochs
    scheduler = Scheduler(SchedulerConfig.from_config(cfg, max_groups))
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
    runtime = Runtime(cfg, scheduler, slices, trainer, stream, rewards, ledger, reporter,
                      timeline, on_step=on_step, checkpointer=checkpointer)
    try:
        summary = runtime.run(cfg.coordinator.num_steps)
        runtime.save_checkpoint()
    finally:
        rewards.close()
        ledger.close()
        reporter.close()
        checkpointer.close()
    summary["mode"] = cfg.coordinator.mode
    timeline.save_json(os.path.join(workdir, "timeline.json"))
    timeline.plot(os.path.join(workdir, "timeline.png"),
                  title=f"{cfg.coordinator.mode}: slices coloured by policy version; "
                        f"trainer steps on top")
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
