"""Builds every part of a run from a validated config and runs it.

`run(cfg, workdir)` is what `python -m dora_jax.main` calls; tests call it too.
The workdir receives ledger.jsonl, metrics.jsonl (and the other metric writers'
output, runtime/writers.py), timeline.png (+ timeline.json), summary.json and
checkpoints/.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dora_jax.base import atomic_files
from dora_jax.base.timeline import Timeline
from dora_jax.config import Config, devices
from dora_jax.data import prompts as prompts_lib
from dora_jax.model import lora, transformer
from dora_jax.model.checkpointing import Checkpointer, load_params
from dora_jax.model.sharding import copy_tree
from dora_jax.rewards.pool import RewardPool
from dora_jax.rl.trainer import Trainer
from dora_jax.rollout.episodes import EpisodeRunner, Latency
from dora_jax.rollout.sampling import read_stop_ids
from dora_jax.rollout.slice import DecodeSlice
from dora_jax.rollout.warmup import warm_engine
from dora_jax.runtime import compile_times, recovery, remote, roles, writers
from dora_jax.runtime.evaluation import EvalDecoder
from dora_jax.runtime.faults import Drills
from dora_jax.runtime.loop import Runtime
from dora_jax.runtime.report import StepReporter
from dora_jax.runtime.trainer_group import LeadCheckpointer, LeadTrainer, TrainerGroup
from dora_jax.runtime.worker import SliceWorker
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.ledger import LedgerWriter
from dora_jax.scheduler.modes import POLICIES
from dora_jax.scheduler.types import SchedulerConfig
from dora_jax.tasks import sources

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from dora_jax.text.tokenizer import Tokenizer


def initial_params(cfg: Config, mesh: Mesh | None = None) -> tuple[Any, Any]:
    """(graphdef, params) a run starts from: model.checkpoint's weights (placed shard
    by shard on `mesh` under the trainer's rules), else random ones from the seed;
    then init_checkpoint's params (an Orbax checkpoint, e.g. dora_jax.sft's) if set.
    With LoRA the base comes from either, the adapters from model.lora.checkpoint (a
    PEFT adapter directory, model/peft_format.py) or the checkpoint when it holds
    them, else fresh from the seed (`transformer.init_adapters`)."""
    if cfg.init_checkpoint and not os.path.isdir(cfg.init_checkpoint):
        raise FileNotFoundError(f"config.init_checkpoint: no checkpoint directory at "
                                f"{cfg.init_checkpoint!r}")
    use_lora = cfg.model.lora.enabled
    peft_adapters = cfg.model.lora.checkpoint if use_lora else ""
    if peft_adapters:
        from dora_jax.model import peft_format

        adapters = peft_format.load_adapters(peft_adapters, cfg.model)
    if cfg.model.checkpoint:
        from dora_jax.model import hf

        graphdef, _ = transformer.abstract_params(cfg.model)
        _, params = hf.load_pretrained(cfg.model.checkpoint, cfg=lora.base_config(cfg.model),
                                       mesh=mesh, rules=cfg.mesh.trainer_rules)
        if use_lora:
            params = lora.merge(params, adapters if peft_adapters
                                else transformer.init_adapters(cfg.model, cfg.seed))
    else:
        graphdef, params = transformer.create(cfg.model, cfg.seed)
        if peft_adapters:
            params = lora.merge(lora.split(params)[0], adapters)
    if cfg.init_checkpoint:
        saves_adapters = use_lora and _saves_adapters(cfg.init_checkpoint)
        if saves_adapters and peft_adapters:
            raise ValueError(f"config.model.lora.checkpoint: {peft_adapters} gives the "
                             f"adapters, but init_checkpoint {cfg.init_checkpoint} holds "
                             "adapters too: name one of them")
        if use_lora and not saves_adapters:
            base, adapters = lora.split(params)  # e.g. full fine-tuning's SFT params
            params = lora.merge(load_params(cfg.init_checkpoint, base), adapters)
        else:
            params = load_params(cfg.init_checkpoint, params)
    return graphdef, params


def _saves_adapters(directory: str) -> bool:
    """Whether the newest params checkpoint in `directory` holds LoRA adapters (its
    tree read, no array)."""
    with Checkpointer(directory, async_save=False) as checkpointer:
        return checkpointer.latest_step() is not None and lora.has_adapters(
            checkpointer.saved_tree())


TRAIN_PHASE, DECODE_PHASE = "train step", "prefill buckets and generate"


def warm_up(slices: Sequence[DecodeSlice], trainer: Trainer, cfg: Config,
            watch: compile_times.Stopwatch | None = None) -> None:
    """Compiles every jitted function a run will use before its clock starts, so
    throughput and waits measure steady state. `watch`: a compile_times.Stopwatch
    that times the train step and the slices' programs apart."""
    watch = watch or compile_times.Stopwatch()
    batch_size = cfg.coordinator.train_batch_size * cfg.coordinator.group_size
    with watch(TRAIN_PHASE):
        trainer.warmup(batch_size, cfg.coordinator.group_size)
    with watch(DECODE_PHASE):
        warm_slices(slices, cfg)


def warm_slices(slices: Sequence[DecodeSlice], cfg: Config) -> None:
    """Compiles each slice's programs on the version it holds (run() and a slice
    process load one first), then gives it a fresh decode state."""
    reprefills = not POLICIES[cfg.coordinator.mode].keeps_c1
    for sl in slices:
        assert sl.version is not None
        warm_engine(sl.engine, sl.versions.prefill_params(sl.version), reprefills=reprefills,
                    generate_params=sl.versions.generate_params(),
                    group_size=cfg.coordinator.group_size)
        sl.reset_decode_state()


def new_slice(slice_id: int, mesh: Mesh, cfg: Config, stop_ids: tuple[int, ...] | None,
              episodes: EpisodeRunner | None = None) -> DecodeSlice:
    """A decode slice of the run on `mesh`. Without lookahead a slice reports a
    finished sample in the step that ends it, so the scheduler never migrates or
    reloads around a request that has in fact already finished on the device."""
    return DecodeSlice.create(slice_id, mesh, cfg.model, cfg.rollout,
                              rules=cfg.mesh.decode_rules, lookahead=False,
                              tokenizer_path=cfg.data.tokenizer or None, stop_ids=stop_ids,
                              episodes=episodes, versions=cfg.rollout.versions_per_slice,
                              prefill_samples=cfg.coordinator.group_size)


def episode_runner(cfg: Config, tokenizer: Tokenizer) -> EpisodeRunner | None:
    """A slice's runner of multi-turn episodes (data.source "env"), else None."""
    d = cfg.data
    if d.source != "env":
        return None
    latency = None if not d.env_latency_median else Latency(
        d.env_latency_median, d.env_latency_sigma, d.env_latency_most)
    return EpisodeRunner(d.env, tokenizer, max_turns=d.env_max_turns, timeout=d.env_timeout,
                         workers=d.env_workers, isolation=d.env_isolation, latency=latency)


def run(cfg: Config, workdir: str, *, records: list[dict] | None = None,
        on_step: Callable[[dict], None] = lambda record: None,
        make_trainer: Callable[..., Trainer] = Trainer, fresh: bool = False,
        tokenizer: Tokenizer | None = None,
        progress: Callable[[str], None] = lambda line: None,
        role: roles.Role = roles.Role()) -> dict:
    """Runs `cfg.coordinator.num_steps` train steps end to end; returns the summary.

    A workdir holding a run of this config continues it (runtime/recovery.py); one
    holding another config is refused unless `fresh`, which starts over there.
    `make_trainer(cfg, mesh, params=, graphdef=)` builds the trainer (a subclass can
    instrument it). `tokenizer`: the one `model.hf_checks.check_pretrained` read
    for this config (None: read here). `progress` gets a line before the warm-up's
    compiles (with the time the last run in `workdir` took) and one after (the
    seconds per phase, kept in the workdir for the next run). `role`: this process's
    part of a run of several (runtime/roles.py): the lead runs the slices through the
    slice processes (remote.py), and a trainer over several processes through
    trainer_group.py. Raises
    `runtime.loop.RunError` if any part fails; the ledger then still accounts for
    every admitted group."""
    recovery.prepare(workdir, cfg, fresh)
    compile_times.use_persistent_cache(workdir)
    if cfg.logging.wandb_project:  # a missing package fails here, before any compute
        writers.import_wandb()
    checkpoints = cfg.coordinator.checkpoint_dir or os.path.join(workdir, "checkpoints")
    if role.trainer_processes > 1:  # the trainer spans processes: each call reaches all
        group = TrainerGroup(role.trainer_commands, role.trainer_processes,
                             timeout=cfg.coordinator.stall_timeout or 600.0)
        checkpointer: Checkpointer = LeadCheckpointer(checkpoints, group=group)
        make_trainer = functools.partial(LeadTrainer, group=group)
    else:
        checkpointer = Checkpointer(checkpoints)
    trained = checkpointer.latest_step()
    if trained is not None and trained >= cfg.coordinator.num_steps:
        checkpointer.close()  # nothing left to train: the run is complete
        path = os.path.join(workdir, "summary.json")
        try:  # the figures of the finished run, if its summary survived
            summary = atomic_files.read_json_object(path)
        except (OSError, atomic_files.DamagedFile):
            summary = {}
        return dict(summary, already_trained=trained, mode=cfg.coordinator.mode)
    if tokenizer is None:
        tokenizer = sources.tokenizer_for(cfg)
    skipped: list = []
    if records is None:
        records, skipped = sources.prompt_records(cfg, tokenizer)
    # Held-out prompts never reach the prompt stream: training cannot admit them.
    records, eval_prompts = sources.held_out_split(records, cfg)
    reward_fn = sources.reward_for(cfg, tokenizer)  # an unknown name fails before compute
    if role.multi:  # the slices live in the slice processes
        trainer_mesh, slice_meshes = devices.make_trainer_mesh(cfg.mesh), []
    else:
        trainer_mesh, slice_meshes = devices.make_meshes(cfg.mesh)
    graphdef, params = initial_params(cfg, trainer_mesh)
    # Every stop id of the tokenizer read above ends a sequence (no engine reads it again).
    stop_ids = read_stop_ids(cfg.rollout, tokenizer)
    runners = [episode_runner(cfg, tokenizer) for _ in slice_meshes]
    slices: list = [new_slice(i, mesh, cfg, stop_ids, runners[i])
                    for i, mesh in enumerate(slice_meshes)]
    for sl in slices:  # every slice starts on version 0, as the scheduler assumes
        sl.load_version(0, params)
    trainer = make_trainer(cfg, trainer_mesh, params=params, graphdef=graphdef)
    resumed = recovery.load(workdir, cfg, checkpointer, trainer, records)
    if trainer.version and slices:  # every slice holds the version resumed from
        params = copy_tree(trainer.params)
        for sl in slices:
            sl.load_version(trainer.version, params)
    procs = None
    if role.multi:  # the slice processes start on the trainer's version
        first = (trainer.version, trainer.published_params())
        procs = remote.start(cfg, role, trainer_mesh, lambda: first,
                             timeout=cfg.coordinator.stall_timeout or 600.0)
        slices = [procs.slices[i] for i in range(cfg.mesh.num_slices)]
    phases = (["eval"] * bool(cfg.eval.every) + [TRAIN_PHASE, DECODE_PHASE]
              + ["checkpoint save"] * bool(cfg.coordinator.checkpoint_every))
    progress(compile_times.announcement(phases, workdir))
    watch = compile_times.Stopwatch()
    eval_decoder = None
    if cfg.eval.every:
        host = slices[cfg.eval.slice]
        eval_decoder = EvalDecoder(host, cfg.eval, cfg.seed)
        with watch("eval"):
            eval_decoder.warm(host.engine.load_params(params))
    warm_up([sl for sl in slices if isinstance(sl, DecodeSlice)], trainer, cfg, watch)
    if procs is not None:  # compiling in their own processes meanwhile
        with watch(DECODE_PHASE):
            procs.wait_ready(cfg.coordinator.stall_timeout or 600.0)
    # Periodic saves: none may stall the run. (A trainer over several processes
    # gathers its state for the lead's save: that program compiles in the run.)
    if cfg.coordinator.checkpoint_every and role.trainer_processes == 1:
        with watch("checkpoint save"):
            Checkpointer.warm_up(trainer.state)
    watch.save(workdir)
    progress(watch.summary())

    stream = prompts_lib.PromptStream(prompts_lib.prompt_dataset(
        records, seed=cfg.seed, shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs))
    max_groups = None if cfg.data.num_epochs is None else len(records) * cfg.data.num_epochs
    sched_cfg = SchedulerConfig.from_config(cfg, max_groups)
    if resumed is None:
        scheduler = Scheduler(sched_cfg)
    else:
        if resumed.stream_state is not None:
            stream.set_state(resumed.stream_state)
        for _ in range(resumed.plan.admitted_since_checkpoint):  # prompts given out since
            stream.next()
        scheduler = recovery.scheduler_for(sched_cfg, resumed.plan,
                                         {g: d["version"] for g, d in resumed.kept.items()})
        earlier_metrics = recovery.truncate_metrics(workdir, trainer.version)
    c = cfg.coordinator
    rewards = RewardPool(reward_fn, c.reward_workers, c.reward_timeout,
                         memory_mb=c.reward_memory_mb, max_response=c.reward_max_response)
    ledger = LedgerWriter(os.path.join(workdir, "ledger.jsonl"))
    if resumed is None:
        for prompt_id in skipped:
            ledger.write("filter", prompt_id=prompt_id, time=0.0,
                         reason=f"prompt over rollout.max_prefill_length "
                                f"({cfg.rollout.max_prefill_length})")
    reporter = StepReporter(writers=writers.make_writers(
        cfg.logging, workdir, purge_step=None if resumed is None else trainer.version,
        run_config=recovery.config_json(cfg)))
    if resumed is not None:  # the summary covers the whole run, every segment
        reporter.resume_from(trainer.version, earlier_metrics, resumed.plan.segments)
    timeline = Timeline()
    runtime = Runtime(cfg, scheduler, slices, trainer, stream, rewards, ledger, reporter,
                      timeline, on_step=on_step, checkpointer=checkpointer, resumed=resumed,
                      eval_decoder=eval_decoder, eval_prompts=eval_prompts,
                      faults=Drills.from_config(cfg.coordinator),
                      make_worker=SliceWorker if procs is None else procs.worker)
    if procs is not None:  # a replacement process starts from the newest version
        procs.current = runtime.weights.newest
    try:
        try:
            summary = runtime.run(cfg.coordinator.num_steps - trainer.version)
            runtime.save_checkpoint()
        finally:
            runtime.close_saves()
    finally:
        # Each closes even if one before it raises (a full disk fails the ledger's
        # final lines and its close): above all the checkpointer, last, whose close
        # waits for a pending asynchronous save. ExitStack runs them bottom-up.
        with contextlib.ExitStack() as closing:
            closing.callback(checkpointer.close)
            if procs is not None:
                closing.callback(procs.close)
            closing.callback(reporter.close)
            closing.callback(ledger.close)
            closing.callback(rewards.close)
            for runner in filter(None, runners):  # their event loops' threads end
                closing.callback(runner.close)
    summary["mode"] = cfg.coordinator.mode
    if procs is not None:
        summary["slice_processes"] = {str(i): procs.process_of(i)
                                      for i in range(cfg.mesh.num_slices)}
        summary["slice_process_replacements"] = [
            dict(process=p, seconds_to_ready=round(t, 1)) for p, t in procs.replacements]
    if resumed is not None:
        summary["resumed_from_step"] = resumed.plan.step
    timeline.save_json(os.path.join(workdir, "timeline.json"))
    timeline.plot(os.path.join(workdir, "timeline.png"),
                  title=f"{cfg.coordinator.mode}: slices coloured by policy version; "
                        f"trainer steps on top")
    atomic_files.write_json_atomic(os.path.join(workdir, "summary.json"), summary, indent=1)
    return summary
