"""The scheduler's state as plain JSON data, and back (`Scheduler.snapshot` / `restore`).

The runtime stores a snapshot with each checkpoint; a resumed run rebuilds its
scheduler from the ledger and the checkpoint instead (resume.py), reading only the
snapshot's `next_group_id`. The round trip is exact: the tests restore a snapshot and
compare it with the original.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import TYPE_CHECKING

from .types import FINISHED, PENDING, RUNNING, GroupState, SampleState, SliceState

if TYPE_CHECKING:  # pragma: no cover
    from .core import Scheduler

SNAPSHOT_FORMAT = 1


def snapshot(sched: "Scheduler") -> dict:
    """All of `sched`'s state as plain JSON-serialisable data."""
    return {
        "format": SNAPSHOT_FORMAT,
        "config": asdict(sched.config),
        "published": sched.published,
        "next_step": sched.next_step,
        "trainer_step": sched.trainer_step,
        "next_group_id": sched.next_group_id,
        "readmit_queue": list(sched.readmit_queue),
        "settled": sched.settled,
        "filtered": sched.filtered,
        "groups": [{
            "id": g.group_id, "version": g.version, "scored": g.scored,
            "samples": [[smp.status, smp.slice_id, list(smp.versions), list(smp.slices),
                         smp.num_tokens] for smp in g.samples],
        } for g in sched.groups.values()],
        "slices": [{
            "id": sl.slice_id, "version": sl.version, "loading": sl.loading,
            "interrupted": sl.interrupted, "running": sorted(map(list, sl.running)),
            "kv_free": sl.kv_free,
        } for sl in sched.slices],
    }


def check_format(snap: dict) -> None:
    """Raises ValueError unless `snap` is a snapshot of this format."""
    if snap.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"unsupported snapshot format {snap.get('format')!r}")


def restore_into(sched: "Scheduler", snap: dict) -> None:
    """Sets a fresh `sched` (built from the snapshot's config) to the snapshot's state."""
    sched.published = snap["published"]
    sched.next_step = snap["next_step"]
    sched.trainer_step = snap["trainer_step"]
    sched.next_group_id = snap["next_group_id"]
    sched.readmit_queue = deque(snap.get("readmit_queue", ()))
    sched.settled = snap["settled"]
    sched.filtered = snap.get("filtered", 0)
    sched.groups = {}
    for gd in snap["groups"]:
        samples = [SampleState(st, sid, list(vs), list(ss), nt)
                   for st, sid, vs, ss, nt in gd["samples"]]
        g = GroupState(gd["id"], gd["version"], samples, scored=gd.get("scored", True))
        g.n_pending = sum(smp.status == PENDING for smp in samples)
        g.n_running = sum(smp.status == RUNNING for smp in samples)
        g.n_finished = sum(smp.status == FINISHED for smp in samples)
        sched.groups[g.group_id] = g
    sched.slices = [SliceState(d["id"], d["version"], d["loading"], d["interrupted"],
                               {tuple(r) for r in d["running"]}, d.get("kv_free"))
                    for d in snap["slices"]]
    sched._recount()
