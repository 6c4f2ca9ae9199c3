"""Recovery: one workdir, one run, resumed after a crash from its ledger and its
newest checkpoint; another config refused there; starting over only when asked.

A workdir remembers the config it was written with (config.json). Running the same
command again continues the run: from its newest checkpoint (train state, the next
group id, the prompt stream's state, finished-but-unconsumed groups with their samples
and rewards), or from the start if it crashed before the first one. A run that already
trained its steps is not run again; raising `coordinator.num_steps` extends it.

What stands is read from the ledger (`ledger.standing`) once the resume at step s
(the checkpoint's version) is written (`plan`, pure):

* groups consumed by steps < s were trained into the checkpoint;
* groups filtered stay filtered;
* every other admitted group is *outstanding*. One that the checkpoint holds as
  finished, with its samples and rewards, is kept as it is: its version still meets
  its deadline, since the checkpointed state was feasible. Every other one (running
  at the checkpoint, or admitted after it) is regenerated whole: it waits in the
  scheduler's `readmit_queue`, and the mode admits it again, under its own id and
  prompt, the way it admits a new group (at a version the mode chooses, within its
  in-flight and staleness bounds), before any new one. So C1 and C3 hold as for any
  group, and only the newest params are needed: the checkpoint keeps no older
  version (K more copies of the model in every checkpoint), and a regenerated group
  costs its decoding again.

Group ids never restart: the next new group gets the id after every one admitted. A
mode whose policy is not `resumable` (one_step_off: its batches are fixed runs of
group ids with fixed versions) refuses such a workdir.

What a crash or a bad disk leaves is repaired or refused in one line: config.json and
metrics.jsonl are only ever replaced whole (base/atomic_files.py), a damaged config.json
or ledger line is named, stale temporary checkpoint directories are removed, and a
newest checkpoint that does not restore gives way to the one before it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING

from dora_jax.base import atomic_files
from dora_jax.config import Config, ConfigError
from dora_jax.model import checkpointing
from dora_jax.scheduler import ledger
from dora_jax.scheduler.core import Scheduler
from dora_jax.scheduler.ledger import standing
from dora_jax.scheduler.modes import POLICIES
from dora_jax.scheduler.types import SchedulerConfig

if TYPE_CHECKING:
    from dora_jax.rl.trainer import Trainer

_log = logging.getLogger(__name__)

# What a run writes into its workdir (all of it goes with --fresh).
OUTPUTS = ("ledger.jsonl", "metrics.jsonl", "summary.json", "timeline.json", "timeline.png",
           "checkpoints", "config.json", "tensorboard", "compile_seconds.json")
# Fields a resumed run may change: how many steps to train in all, and the process
# kill drill (runtime/faults.py), which the command that resumes does not repeat.
MAY_DIFFER = ("coordinator.num_steps", "coordinator.kill_point", "coordinator.kill_after")


def _is_default(cfg: Config, dotted: str, value: object) -> bool:
    """Whether config field `dotted` (JSON form `value`) holds its declared default."""
    *sections, name = dotted.split(".")
    node: object = cfg
    for part in sections:
        node = getattr(node, part, None)
    if not dataclasses.is_dataclass(node):
        return False
    for f in dataclasses.fields(node):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                return False
            return json.loads(json.dumps(default, default=list)) == value
    return False


def _flat(tree: dict, prefix: str = "") -> dict:
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
            old = _flat(atomic_files.read_json_object(path))
        except atomic_files.DamagedFile as e:
            raise ConfigError(f"{e}; remove it to go on with this config, or pass --fresh "
                              "to start over") from None
        flat = _flat(new)
        # A field added since the run was written reads as its default there.
        old.update({k: v for k, v in flat.items() if k not in old and _is_default(cfg, k, v)})
        diff = [f"{k}: {old.get(k)!r} -> {flat.get(k)!r}" for k in sorted(set(old) | set(flat))
                if k not in MAY_DIFFER and old.get(k) != flat.get(k)]
        if diff:
            raise ConfigError(f"workdir {workdir} holds a run with another config ("
                              + "; ".join(diff) + "); pass --fresh to start over there")
    atomic_files.write_json_atomic(path, new, indent=1)
    # A gs:// checkpoint_dir is no local directory: Orbax there cleans up after itself.
    checkpointing.remove_stale_tmp(cfg.coordinator.checkpoint_dir
                                   or os.path.join(workdir, "checkpoints"))


@dataclasses.dataclass
class Resumed:
    """What a resumed run starts from (the trainer's state is already restored)."""

    plan: ResumePlan
    kept: dict  # group id -> {"version", "record", "samples", "rewards"}
    readmit_records: dict  # group id -> prompt record
    stream_state: dict | None  # the prompt stream at the checkpoint (None: its start)
    # Newer checkpoints that did not restore (Checkpointer.restore_newest_intact).
    skipped_checkpoints: list = dataclasses.field(default_factory=list)


def load(workdir: str, cfg: Config, checkpointer: checkpointing.Checkpointer, trainer: Trainer,
         records: list) -> Resumed | None:
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
    if not POLICIES[cfg.coordinator.mode].resumable:
        raise ConfigError(f"workdir {workdir} holds a {cfg.coordinator.mode} run, which does "
                          "not resume (its batches are fixed runs of group ids); pass --fresh")
    extra: dict = {}
    skipped: list = []
    if step is not None:
        restored = checkpointer.restore_newest_intact(trainer.abstract_state())
        assert restored is not None  # there is a step: it restores, or this raised
        trainer.load_state(restored.state)
        extra, skipped = restored.extra, restored.skipped
    kept = {int(g): d for g, d in extra.get("finished_groups", {}).items()}
    p = plan(events, trainer.version, {g: d["version"] for g, d in kept.items()},
                    extra.get("scheduler", {}).get("next_group_id", 0))
    by_prompt = {r["prompt_id"]: r for r in records}
    missing = sorted({p.prompt_ids[g] for g in p.readmit} - set(by_prompt))
    if missing:
        raise ConfigError(f"workdir {workdir}: the ledger's prompts {missing[:3]} are not in "
                          "the data source; pass --fresh to start over")
    return Resumed(plan=p, kept={g: kept[g] for g in p.kept},
                   readmit_records={g: by_prompt[p.prompt_ids[g]] for g in p.readmit},
                   stream_state=extra.get("prompt_stream"), skipped_checkpoints=skipped)


def truncate_metrics(workdir: str, step: int) -> list[dict]:
    """Drops the metrics of steps >= `step` (their training was lost with the crash),
    replacing the file whole: a crash or a full disk meanwhile leaves it as it was;
    returns the records kept (the earlier segments' steps and evaluations, for the
    run's summary). A line that is not a metrics record (one cut short by the crash)
    is dropped with a warning: the records are reports, and the run can go on
    without one."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    keep, records = [], []
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record["step"] < step:
                    keep.append(json.dumps(record) + "\n")  # the appends need its newline
                    records.append(record)
            except (ValueError, TypeError, KeyError) as e:  # JSON and UTF-8 errors: ValueError
                _log.warning("%s:%d: dropped a line that is not a metrics record (%s)", path,
                             number, type(e).__name__)
    atomic_files.write_atomic(path, "".join(keep))
    return records


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    step: int  # the first step the resumed run trains (= the restored version)
    kept: tuple  # finished group ids restored from the checkpoint, ascending
    readmit: tuple  # group ids to admit again, ascending
    prompt_ids: dict  # group id -> prompt id, for every outstanding group
    next_group_id: int
    admitted_since_checkpoint: int  # groups the prompt stream gave out after it
    filtered: int = 0  # groups filtered before the resume (they stay filtered)
    # The processes that ran before, as `ledger.segments` (their steps that stand).
    segments: tuple = ()


def plan(events: list, step: int, finished_in_checkpoint: dict,
         checkpoint_next_group_id: int) -> ResumePlan:
    """The plan for resuming at `step` over a ledger's `events` (before the resume
    line is written). `finished_in_checkpoint`: group id -> version of the groups the
    checkpoint holds finished and scored."""
    events = list(events) + [{"event": "resume", "step": step}]
    segments = tuple(ledger.segments(events)[:-1])  # the last: the run resuming now
    events = standing(events)
    admitted, done, filtered = {}, set(), set()
    for e in events:
        if e["event"] == "admit":
            admitted[e["group_id"]] = e
        elif e["event"] == "consume":
            done.add(e["group_id"])
        elif e["event"] == "filter" and "group_id" in e:  # not a prompt left out
            done.add(e["group_id"])
            filtered.add(e["group_id"])
    outstanding = sorted(set(admitted) - done)
    kept = tuple(g for g in outstanding if g in finished_in_checkpoint)
    readmit = tuple(g for g in outstanding if g not in finished_in_checkpoint)
    next_id = max(max(admitted, default=-1) + 1, checkpoint_next_group_id)
    return ResumePlan(step=step, kept=kept, readmit=readmit,
                      prompt_ids={g: admitted[g]["prompt_id"] for g in outstanding},
                      next_group_id=next_id,
                      admitted_since_checkpoint=next_id - checkpoint_next_group_id,
                      filtered=len(filtered), segments=segments)


def scheduler_for(config: SchedulerConfig, p: ResumePlan, kept_versions: dict) -> Scheduler:
    """A Scheduler in the state the plan resumes from: version `p.step` published and
    loaded on every slice, the trainer idle, the kept groups finished (and scored),
    the others queued for readmission."""
    return Scheduler.resumed(
        config, published=p.step, next_group_id=p.next_group_id,
        filtered=p.filtered,  # the run's count, not this process's
        kept={gid: kept_versions[gid] for gid in p.kept}, readmit=p.readmit)
