"""The ledger (`<workdir>/ledger.jsonl`) and an auditor of constraints C1-C3 over it.

One JSON object per line:
  {"event": "admit", "group_id", "prompt_id", "version", "time"}  (+ "readmit": true)
  {"event": "consume", "group_id", "prompt_id", "version", "step", "time",
   "samples": [{"sample", "versions": [[v, n_tokens], ...], "slices": [...],
                "response_len", "finish": "eos"|"length", "reward", ...}]}
   A multi-turn episode's sample adds "turns": [["model", start, end] |
   ["env", start, end, seconds], ...] (response-token ranges, dora_jax/base/turns.py),
   "env_s", "episode_end" and "env_info"; `finish` is how its last model turn ended.
  {"event": "filter", "group_id", "reason"}  (or "prompt_id" instead of "group_id":
                                             a prompt left out before admission)
  {"event": "unconsumed", "group_id", "version"}     (written at exit)
  {"event": "resume", "step", "time"}                (a run resumed from a checkpoint;
   + "repaired": {"dropped_bytes"} if the ledger's last line was cut short, and
   "skipped_checkpoints": [{"step", "error", "moved_to"}] if newer ones were damaged)
`step` is the params version the trainer used for the batch (it publishes step+1).
A `resume` at step s voids every earlier `consume` of step s or later (that training
was lost with the crash) and every earlier `unconsumed`; a group admitted again after
it has another `admit` with "readmit": true, and its latest admission is the one
that counts (`standing`).
`versions` is run-length encoded (`dora_jax.base.versions`). The runtime, the simulator
(sim/cluster.py) and the tests' fake engine write the same format (their lines come
from driver.py), so one auditor serves all three; `python -m dora_jax.audit WORKDIR`
runs it on a workdir (dora_jax/audit.py), and `segments` splits a run at its resumes.
A kill mid-write can only cut the last line short: `read` leaves such a line out and
`LedgerWriter` removes it before appending (that event never happened). A bad line
anywhere else is an error naming the file and line, never skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Iterable

from dora_jax.base import untrusted_files
from dora_jax.base.turns import check_turns
from dora_jax.base.versions import num_tokens

from .modes import policy_for
from .types import SchedulerConfig

_log = logging.getLogger(__name__)


class LedgerError(ValueError):
    """A ledger line that is not an event; the message names the file and line:
    `/w/ledger.jsonl:17: not JSON (Expecting ':' delimiter)`."""


class LedgerWriter:
    """Appends ledger events, one line each, flushed so a crash loses nothing.

    A process killed mid-write leaves its last line cut short (no newline). Opening
    the ledger cuts that line off first, so the next event starts a line of its own;
    `repaired` says what was dropped ({"dropped_bytes": n}, None if nothing), for the
    resumed run's `resume` line. The dropped event never completed, and `read` leaves
    it out the same way, so what a resume plans from is what stays in the file."""

    def __init__(self, path: str):
        self.path = path
        dropped = _cut_partial_last_line(path)
        self.repaired = {"dropped_bytes": dropped} if dropped else None
        if dropped:
            _log.warning("%s: dropped a last line cut short by a crash (%d bytes)",
                         path, dropped)
        self._file = open(path, "a")
        self._lock = threading.Lock()

    def write(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def sync(self) -> None:
        """Puts every line written so far on disk (fsync): a checkpoint saved after
        this cannot outlive, through a power loss, the ledger lines it relies on."""
        with self._lock:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            finally:
                self._file.close()


def _cut_partial_last_line(path: str) -> int:
    """Truncates `path` just after its last newline (to empty if it has none);
    returns the bytes dropped (0 for a missing file or one ending in a newline)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        end = pos = f.seek(0, os.SEEK_END)
        keep = 0
        while pos > 0:  # backwards, a block at a time: a ledger can be large
            start = max(0, pos - 65536)
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        if keep < end:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
        return end - keep


def unconsumed_records(groups: dict, queued=()) -> list[dict]:
    """`unconsumed` records for the groups still in flight (a scheduler's `groups`)
    and those still waiting to be admitted again (its `readmit_queue`), written at
    exit."""
    return ([dict(event="unconsumed", group_id=gid, version=g.version)
             for gid, g in groups.items()]
            + [dict(event="unconsumed", group_id=gid, version=None) for gid in queued])


def read(path: str) -> list[dict]:
    """The ledger's events. A last line without its newline was cut short by a kill
    mid-write: it is left out (whether or not it parses), as `LedgerWriter` drops it.
    Any other line that is not a JSON event raises LedgerError naming the file and
    line; blank lines are skipped."""
    return [event for _, event in read_numbered(path)]


def read_numbered(path: str) -> list[tuple[int, dict]]:
    """`read`, each event with its line number (for messages naming the line)."""
    # A resumed workdir may be handed over: a regular file (a FIFO would hang), and
    # each event line's nesting bounded.
    lines = untrusted_files.read_bytes(path, untrusted_files.LEDGER_CAP,
                                       error=LedgerError).split(b"\n")
    events = []
    for number, raw in enumerate(lines[:-1], start=1):  # lines[-1]: after the last newline
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        untrusted_files.check_depth(raw, where, error=LedgerError)
        try:
            event = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise LedgerError(f"{where}: not UTF-8 text") from None
        except json.JSONDecodeError as e:
            raise LedgerError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise LedgerError(f"{where}: not a ledger event (no \"event\" name)")
        events.append((number, event))
    return events


# The fields the auditor reads, by event (`check_fields`).
_INT_FIELDS = {"admit": ("group_id", "version"), "consume": ("group_id", "version", "step"),
               "unconsumed": ("group_id",), "resume": ("step",)}
_SAMPLE_FIELDS = (("sample", int), ("versions", list), ("response_len", int), ("finish", str))


def check_fields(event: dict) -> str | None:
    """What keeps `audit` from reading `event` (a field missing or of the wrong type),
    None if nothing: a hand-edited or foreign line is named, not a KeyError."""
    kind = event["event"]
    for name in _INT_FIELDS.get(kind, ()):
        if not isinstance(event.get(name), int):
            return f"{kind} without an integer {name!r}"
    if kind == "filter" and "group_id" not in event and "prompt_id" not in event:
        return "filter without a 'group_id' or 'prompt_id'"
    if kind != "consume":
        return None
    samples = event.get("samples")
    if not isinstance(samples, list) or not all(isinstance(x, dict) for x in samples):
        return "consume without a list of 'samples'"
    for x in samples:
        for name, kind_of in _SAMPLE_FIELDS:
            if not isinstance(x.get(name), kind_of):
                return f"consume sample without a {kind_of.__name__} {name!r}"
        if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(n, int) for n in p)
                   for p in x["versions"]):
            return "consume sample whose 'versions' are not [version, tokens] pairs"
    return None


def standing(events: Iterable[dict]) -> list[dict]:
    """The events that stand once every `resume` has voided what it voids (see the
    module docstring); the `resume` events themselves are dropped."""
    out: list[dict] = []
    for e in events:
        if e["event"] == "resume":
            s = e["step"]
            out = [x for x in out if x["event"] != "unconsumed"
                   and not (x["event"] == "consume" and x["step"] >= s)]
        else:
            out.append(e)
    return out


def segments(events: Iterable[dict]) -> list[dict]:
    """The run's segments, one per process that wrote to the ledger (a `resume` line
    starts each after the first): {"from_step", "steps", "wall_seconds"}. `steps`:
    the train steps it consumed that stand (no later resume voided them);
    `wall_seconds`: its latest event time (its own clock), lost work included."""
    out = [{"from_step": 0, "wall_seconds": 0.0}]
    consumed: list[tuple[int, int]] = []  # (segment, step) of each consume
    for e in events:
        if e["event"] == "resume":
            consumed = [(i, s) for i, s in consumed if s < e["step"]]
            out.append({"from_step": e["step"], "wall_seconds": 0.0})
        elif e["event"] == "consume":
            consumed.append((len(out) - 1, e["step"]))
        t = e.get("time")
        if isinstance(t, (int, float)):
            out[-1]["wall_seconds"] = max(out[-1]["wall_seconds"], t)
    steps = collections.defaultdict(set)
    for i, s in consumed:
        steps[i].add(s)
    return [{"from_step": x["from_step"], "steps": len(steps[i]),
             "wall_seconds": round(x["wall_seconds"], 3)} for i, x in enumerate(out)]


@dataclasses.dataclass
class AuditReport:
    steps: int
    groups_admitted: int
    groups_consumed: int
    c1: list  # violations, human-readable
    c2: list
    c3: list
    batch_size: list
    staleness: dict  # staleness -> number of consumed groups
    groups_filtered: int = 0
    groups_unconsumed: int = 0  # in flight at the exit
    max_staleness: int | None = None  # the bound C3 checked (None: none)
    c1_checked: bool = True
    train_batch_size: int | None = None

    @property
    def ok(self) -> bool:
        return not (self.c1 or self.c2 or self.c3 or self.batch_size)

    def summary(self) -> str:
        return (f"{self.steps} steps, {self.groups_consumed}/{self.groups_admitted} groups "
                f"consumed; violations C1={len(self.c1)} C2={len(self.c2)} C3={len(self.c3)} "
                f"batch-size={len(self.batch_size)}; "
                f"staleness {dict(sorted(self.staleness.items()))}")

    def text(self, examples: int = 3) -> str:
        """The report a person reads: figures, each constraint's violations (the first
        `examples` of each spelled out) and a last line counting them."""
        bound = "unbounded" if self.max_staleness is None else f"<= {self.max_staleness}"
        lines = [f"steps: {self.steps}",
                 f"groups: {self.groups_admitted} admitted, {self.groups_consumed} consumed, "
                 f"{self.groups_filtered} filtered, {self.groups_unconsumed} unconsumed at exit",
                 "staleness (step - version: groups): " + (", ".join(
                     f"{k}: {v}" for k, v in sorted(self.staleness.items())) or "none")]
        c1 = ("one version per trajectory" if self.c1_checked else
              "one version per group; per trajectory not checked, the mode breaks it")
        checks = [("C1", c1, self.c1),
                  ("C2", "nothing dropped", self.c2),
                  ("C3", f"staleness {bound}", self.c3),
                  ("batch size", f"{self.train_batch_size} groups per step", self.batch_size)]
        for name, what, found in checks:
            lines.append(f"{name} ({what}): {len(found)} violation(s)")
            lines += [f"  {v}" for v in found[:examples]]
            if len(found) > examples:
                lines.append(f"  ... and {len(found) - examples} more")
        n = [len(found) for _, _, found in checks]
        lines.append(f"violations: {sum(n)} (C1 {n[0]}, C2 {n[1]}, C3 {n[2]}, "
                     f"batch size {n[3]})")
        return "\n".join(lines)


def audit(events: Iterable[dict], *, train_batch_size: int, group_size: int,
          max_staleness: int | None, max_decode_len: int | None = None,
          check_c1: bool = True) -> AuditReport:
    """Checks C1 (one version per trajectory and per group; `check_c1=False` for a
    mode that breaks it by design), C2 (every admitted group consumed exactly once,
    complete; or filtered with a reason; or listed as unconsumed at exit), C3
    (step - version <= max_staleness; None skips) and that every step consumed
    exactly `train_batch_size` groups, over the events that stand after any resumes
    (`standing`): C1 and C3 against a group's latest admission."""
    c1, c2, c3, bad_batch = [], [], [], []
    events = standing(events)
    admitted: dict = {}
    consumed: collections.Counter[int | None] = collections.Counter()
    per_step: collections.Counter[int] = collections.Counter()
    staleness: collections.Counter[int] = collections.Counter()
    accounted: set[int | None] = set()
    left: dict[str, set[int | None]] = {"filter": set(), "unconsumed": set()}
    for e in events:
        kind, gid = e["event"], e.get("group_id")
        if kind == "admit":
            if gid in admitted and not e.get("readmit"):
                c2.append(f"group {gid} admitted twice")
            if e.get("readmit") and (gid in consumed or gid in accounted):
                c2.append(f"group {gid} admitted again after it was accounted for")
            admitted[gid] = e["version"]  # the latest admission counts
        elif kind == "consume":
            consumed[gid] += 1
            per_step[e["step"]] += 1
            if gid not in admitted:
                c2.append(f"group {gid} consumed but never admitted")
            elif admitted[gid] != e["version"]:
                c1.append(f"group {gid} admitted at v{admitted[gid]}, consumed as v{e['version']}")
            lag = e["step"] - e["version"]
            staleness[lag] += 1
            if lag < 0 or (max_staleness is not None and lag > max_staleness):
                c3.append(f"group {gid} (v{e['version']}) consumed at step {e['step']}")
            samples = e["samples"]
            if sorted(s["sample"] for s in samples) != list(range(group_size)):
                c2.append(f"group {gid} consumed with samples "
                          f"{sorted(s['sample'] for s in samples)}")
            for s in samples:
                versions = {v for v, n in s["versions"] if n > 0}
                if check_c1 and versions != {e["version"]}:
                    c1.append(f"group {gid} sample {s['sample']} versions {s['versions']} "
                              f"!= group version {e['version']}")
                n_tokens = num_tokens(s["versions"])
                if n_tokens != s["response_len"]:
                    c2.append(f"group {gid} sample {s['sample']}: {n_tokens} versioned "
                              f"tokens != response_len {s['response_len']}")
                if "turns" in s and check_turns(s, s["response_len"]):
                    c2.append(f"group {gid} sample {s['sample']}: "
                              f"{check_turns(s, s['response_len'])}")
                if s["finish"] not in ("eos", "length"):
                    c2.append(f"group {gid} sample {s['sample']} finish {s['finish']!r}")
                elif (max_decode_len is not None and s["finish"] == "length"
                      and s["response_len"] != max_decode_len):
                    c2.append(f"group {gid} sample {s['sample']} truncated at "
                              f"{s['response_len']} < max_decode_len {max_decode_len}")
        elif kind == "filter" and gid is None:
            pass  # a prompt left out before any group was made of it
        elif kind in ("filter", "unconsumed"):
            if kind == "filter" and not e.get("reason"):
                c2.append(f"group {gid} filtered without a reason")
            if gid in accounted:
                c2.append(f"group {gid} {kind} twice")
            accounted.add(gid)
            left[kind].add(gid)
    for gid, n in consumed.items():
        if n > 1:
            c2.append(f"group {gid} consumed {n} times")
        if gid in accounted:
            c2.append(f"group {gid} both consumed and filtered/unconsumed")
    for gid in admitted:
        if gid not in consumed and gid not in accounted:
            c2.append(f"group {gid} admitted but neither consumed, filtered nor unconsumed")
    for step, n in sorted(per_step.items()):
        if n != train_batch_size:
            bad_batch.append(f"step {step} consumed {n} groups, not {train_batch_size}")
    return AuditReport(steps=len(per_step), groups_admitted=len(admitted),
                       groups_consumed=len(consumed), c1=c1, c2=c2, c3=c3,
                       batch_size=bad_batch, staleness=dict(staleness),
                       groups_filtered=len(left["filter"]),
                       groups_unconsumed=len(left["unconsumed"]), max_staleness=max_staleness,
                       c1_checked=check_c1, train_batch_size=train_batch_size)


def audit_run(events: Iterable[dict], config: SchedulerConfig,
              max_decode_len: int | None = None) -> AuditReport:
    """`audit` under the run's own mode: its staleness bound, and C1 unless the mode
    breaks it by design."""
    policy = policy_for(config.mode)
    return audit(events, train_batch_size=config.train_batch_size,
                 group_size=config.group_size, max_staleness=policy.staleness_bound(config),
                 max_decode_len=max_decode_len, check_c1=policy.keeps_c1)
