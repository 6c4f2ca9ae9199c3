"""metrics.jsonl records as TensorBoard scalars (`<workdir>/tensorboard/`).

View them with `tensorboard --logdir=<workdir>/tensorboard` (the `tensorboard` package,
installed apart). Every number of a step's record becomes a scalar at that step,
nested keys joined by "/": `reward_mean`, `trainer/loss`, `slot_utilisation/0`,
`staleness/2`, `trainer_wait_split/guard`; a list is logged by its length
(`resident_versions/count`). A resumed run purges the events of steps it trains
again, as metrics.jsonl drops their lines. `read_scalars` reads the files back.
"""

from __future__ import annotations

import glob
import os
import struct
import time
from numbers import Real


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numbers by tag (see the module docstring); `step` is not one."""
    out = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, bool):
            out[tag] = float(value)
        elif isinstance(value, Real):  # what JSON numbers load as (no complex)
            if tag != "step":
                out[tag] = float(value)
        elif isinstance(value, dict):
            out.update(flatten(value, tag + "/"))
        elif isinstance(value, (list, tuple)):
            out[tag + "/count"] = float(len(value))
    return out


class TensorBoardWriter:
    """Writes each step record's scalars as one event, on the caller's thread (the
    metrics writer's); `purge_step`: drop events at or after it (the steps a resumed
    run trains again).

    tensorboardX's SummaryWriter would send every scalar through a multiprocessing
    queue to a polling thread of its own: on the tiny default, about a tenth of a CPU
    core for a few dozen scalars a step, taken from the decode slices and the trainer.
    Its synchronous `EventsWriter` writes the same file format (tests read it back).
    """

    def __init__(self, logdir: str, purge_step: int | None = None,
                 flush_secs: float = 10.0) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        os.makedirs(logdir, exist_ok=True)
        # The nanoseconds order two files opened in the same second (a quick resume)
        # as TensorBoard reads them, by name, instead of the second overwriting the first.
        self._events = EventsWriter(os.path.join(logdir, "events"), f".{time.time_ns()}")
        if purge_step is not None:  # TensorBoard drops the earlier files' later steps
            self._events.write_event(Event(step=purge_step, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
        self._flush_secs, self._flushed = flush_secs, time.monotonic()

    def write(self, record: dict) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value)
                  for tag, value in flatten(record).items()]
        self._events.write_event(Event(step=int(record["step"]), wall_time=time.time(),
                                       summary=Summary(value=values)))
        if time.monotonic() - self._flushed >= self._flush_secs:
            self._events.flush()
            self._flushed = time.monotonic()

    def close(self) -> None:
        self._events.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under `logdir`: {tag: [(step, value), ...]} in
    file order, honouring a later file's purge of steps at or after its first step
    (what TensorBoard shows)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"),
                                 recursive=True)):
        with open(path, "rb") as f:
            data = f.read()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            offset += 12 + length + 4  # length, its CRC, the payload, its CRC
            if event.HasField("session_log") and event.session_log.status == 1:  # START
                for tag in scalars:  # a purge: later steps are replaced
                    scalars[tag] = [(s, v) for s, v in scalars[tag] if s < event.step]
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
