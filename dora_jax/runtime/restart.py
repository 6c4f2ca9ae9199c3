"""One workdir, one run: resuming it after a crash, refusing another config in it,
and starting over only when asked.

A workdir remembers the config it was written with (config.json). Running the same
command again continues the run: from its newest checkpoint (train state, scheduler
and prompt-stream state, finished-but-unconsumed groups with their samples and
rewards), or from the start if it crashed before the first one, with what the
ledger says was lost admitted again (scheduler/resume.py). A run that already
trained its steps is not run again; raising `coordinator.num_steps` extends it.

What a crash or a bad disk leaves is repaired or refused in one line: config.json and
metrics.jsonl are only ever replaced whole (runtime/files.py), a damaged config.json
or ledger line is named, stale temporary checkpoint directories are removed, and a
newest checkpoint that does not restore gives way to the one before it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

from dora_jax import checkpointing
from dora_jax.config import Config, ConfigError
from dora_jax.rollout.trajectory import Trajectory
from dora_jax.runtime import files
from dora_jax.scheduler import ledger, resume

_log = logging.getLogger(__name__)

# What a run writes into its workdir (all of it goes with --fresh).
OUTPUTS = ("ledger.jsonl", "metrics.jsonl", "summary.json", "timeline.json", "timeline.png",
           "checkpoints", "config.json", "tensorboard")
# Fields a resumed run may change: how many steps to train in all.
MAY_DIFFER = ("coordinator.num_steps",)


def _flat(tree, prefix="") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_json(cfg: Config) -> dict:
    """The config as plain JSON data (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def prepare(workdir: str, cfg: Config, fresh: bool) -> None:
    """Makes `workdir` hold this run: with `fresh`, the outputs of an earlier run are
    removed first; otherwise a workdir written with another config is refused
    (ConfigError naming every differing field), as is a damaged config.json
    (ConfigError naming the file). Removes the temporary directories of checkpoint
    saves a crash interrupted."""
    os.makedirs(workdir, exist_ok=True)
    if fresh:
        for name in OUTPUTS:
            path = os.path.join(workdir, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
    path = os.path.join(workdir, "config.json")
    new = config_json(cfg)
    if os.path.exists(path):
        try:
            old = _flat(files.read_json_object(path))
        except files.DamagedFile as e:
            raise ConfigError(f"{e}; remove it to go on with this config, or pass --fresh "
                              "to start over") from None
        flat = _flat(new)
        diff = [f"{k}: {old.get(k)!r} -> {flat.get(k)!r}" for k in sorted(set(old) | set(flat))
                if k not in MAY_DIFFER and old.get(k) != flat.get(k)]
        if diff:
            raise ConfigError(f"workdir {workdir} holds a run with another config ("
                              + "; ".join(diff) + "); pass --fresh to start over there")
    files.write_json_atomic(path, new, indent=1)
    checkpointing.remove_stale_tmp(os.path.join(workdir, "checkpoints"))


@dataclasses.dataclass
class Resumed:
    """What a resumed run starts from (the trainer's state is already restored)."""

    plan: resume.ResumePlan
    kept: dict  # group id -> {"version", "record", "samples", "rewards"}
    readmit_records: dict  # group id -> prompt record
    stream_state: dict | None  # the prompt stream at the checkpoint (None: its start)
    # Newer checkpoints that did not restore (Checkpointer.restore_newest_intact).
    skipped_checkpoints: list = dataclasses.field(default_factory=list)


def load(workdir: str, cfg: Config, checkpointer, trainer, records: list) -> Resumed | None:
    """The run to continue in `workdir`, or None if it holds none. Restores the
    trainer's state from the newest checkpoint that restores (a damaged newer one is
    moved aside, logged and listed in `skipped_checkpoints`). A ledger line that is
    not an event is a ConfigError naming the file and line."""
    path = os.path.join(workdir, "ledger.jsonl")
    try:
        events = ledger.read(path) if os.path.exists(path) else []
    except ledger.LedgerError as e:
        raise ConfigError(str(e)) from e
    step = checkpointer.latest_step()
    if not events and step is None:
        return None
    if cfg.coordinator.mode == "one_step_off":
        raise ConfigError(f"workdir {workdir} holds a one_step_off run, which does not resume "
                          "(its batches are fixed runs of group ids); pass --fresh")
    extra, skipped = {}, []
    if step is not None:
        restored = checkpointer.restore_newest_intact(trainer.abstract_state())
        trainer.load_state(restored.state)
        extra, skipped = restored.extra, restored.skipped
    kept = {int(g): d for g, d in extra.get("finished_groups", {}).items()}
    p = resume.plan(events, trainer.version, {g: d["version"] for g, d in kept.items()},
                    extra.get("scheduler", {}).get("next_group_id", 0))
    by_prompt = {r["prompt_id"]: r for r in records}
    missing = sorted({p.prompt_ids[g] for g in p.readmit} - set(by_prompt))
    if missing:
        raise ConfigError(f"workdir {workdir}: the ledger's prompts {missing[:3]} are not in "
                          "the data source; pass --fresh to start over")
    return Resumed(plan=p, kept={g: kept[g] for g in p.kept},
                   readmit_records={g: by_prompt[p.prompt_ids[g]] for g in p.readmit},
                   stream_state=extra.get("prompt_stream"), skipped_checkpoints=skipped)


def finished_group(g, rewards: list) -> dict:
    """A finished group as a checkpoint keeps it (JSON)."""
    return {"version": g.version, "record": g.record,
            "samples": [dataclasses.asdict(g.trajectories[k]) for k in sorted(g.trajectories)],
            "rewards": rewards}


def trajectories(saved: dict) -> list:
    return [Trajectory(**d) for d in saved["samples"]]


def truncate_metrics(workdir: str, step: int) -> None:
    """Drops the metrics of steps >= `step` (their training was lost with the crash),
    replacing the file whole: a crash or a full disk meanwhile leaves it as it was.
    A line that is not a metrics record (one cut short by the crash) is dropped with
    a warning: the records are reports, and the run can go on without one."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    keep = []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record["step"] < step:
                    keep.append(json.dumps(record) + "\n")  # the appends need its newline
            except (ValueError, TypeError, KeyError) as e:  # JSON and UTF-8 errors: ValueError
                _log.warning("%s:%d: dropped a line that is not a metrics record (%s)", path,
                             number, type(e).__name__)
    files.write_atomic(path, "".join(keep))
