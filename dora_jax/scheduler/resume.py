"""Resuming a run from its last checkpoint after a crash (pure: no JAX, no files).

What stands is read from the ledger (`ledger.standing`) once the resume at step s
(the checkpoint's version) is written:

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

Group ids never restart: the next new group gets the id after every one admitted.
one_step_off, whose batches are fixed runs of group ids with fixed versions, does not
resume: its policy is not `resumable` (policies.py), and the runtime's restart refuses
such a workdir.
"""

from __future__ import annotations

import dataclasses

from .core import Scheduler
from .ledger import standing
from .types import FINISHED, GroupState, SampleState, SchedulerConfig, SliceState


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    step: int  # the first step the resumed run trains (= the restored version)
    kept: tuple  # finished group ids restored from the checkpoint, ascending
    readmit: tuple  # group ids to admit again, ascending
    prompt_ids: dict  # group id -> prompt id, for every outstanding group
    next_group_id: int
    admitted_since_checkpoint: int  # groups the prompt stream gave out after it


def plan(events: list, step: int, finished_in_checkpoint: dict,
         checkpoint_next_group_id: int) -> ResumePlan:
    """The plan for resuming at `step` over a ledger's `events` (before the resume
    line is written). `finished_in_checkpoint`: group id -> version of the groups the
    checkpoint holds finished and scored."""
    events = standing(list(events) + [{"event": "resume", "step": step}])
    admitted, done = {}, set()
    for e in events:
        if e["event"] == "admit":
            admitted[e["group_id"]] = e
        elif e["event"] in ("consume", "filter"):
            done.add(e["group_id"])
    outstanding = sorted(set(admitted) - done)
    kept = tuple(g for g in outstanding if g in finished_in_checkpoint)
    readmit = tuple(g for g in outstanding if g not in finished_in_checkpoint)
    next_id = max(max(admitted, default=-1) + 1, checkpoint_next_group_id)
    return ResumePlan(step=step, kept=kept, readmit=readmit,
                      prompt_ids={g: admitted[g]["prompt_id"] for g in outstanding},
                      next_group_id=next_id,
                      admitted_since_checkpoint=next_id - checkpoint_next_group_id)


def scheduler_for(config: SchedulerConfig, p: ResumePlan, kept_versions: dict) -> Scheduler:
    """A Scheduler in the state the plan resumes from: version `p.step` published and
    loaded on every slice, the trainer idle, the kept groups finished (and scored),
    the others queued for readmission."""
    sched = Scheduler(config)
    sched.published = sched.next_step = p.step
    sched.next_group_id = p.next_group_id
    sched.slices = [SliceState(i, p.step) for i in range(config.num_slices)]
    G = config.group_size
    for gid in p.kept:
        w = kept_versions[gid]
        samples = [SampleState(FINISHED, None, [w], []) for _ in range(G)]
        sched.groups[gid] = GroupState(gid, w, samples, n_finished=G)
    sched.readmit_queue.extend(p.readmit)
    sched._recount()
    return sched
