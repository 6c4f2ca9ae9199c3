"""Per-step metrics (`<workdir>/metrics.jsonl`), evaluation records, and the run
summary.

Throughput, the trainer-wait fraction (split by cause, `WaitClock`), the step time
and the rollout-only share are reported over the steady-state window — from the end of
step 0 to the end of the last step — because the wait before step 0 is the pipeline
filling; whole-run figures are given too.

A resumed run (runtime/recovery.py) is one run in several segments, one per process.
Its summary's totals cover the whole run, from step 0: `steps`, `wall_seconds`
(summed over `segments`: each one's `from_step`, the `steps` it trained that stand
and its `wall_seconds`, an earlier segment's to its last ledger line, lost work
included), `trained_tokens`, `groups_consumed`, `groups_filtered`, the rewards, the
staleness histogram, migrations, weight transfer time, slice failures, episodes and
evaluations; the earlier segments' come from metrics.jsonl and the ledger. The
steady-state rates (`tokens_per_second`, `step_seconds`, `trainer_wait_fraction` and
`trainer_wait_split`, `train_step_seconds`, `rollout_only_share`) and what the
slices and timeline of one process measure (`mean_slot_utilisation`,
`load_overlap_fraction`, `prefills_per_group`, `max_resident_versions`) are the last
segment's: each process has its own clock and slices.
"""

from __future__ import annotations

import bisect
import contextlib
import queue
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from dora_jax.base.timeline import Span, Timeline
    from dora_jax.rl.batch import TrainBatch
    from dora_jax.rollout.slice import DecodeSlice
    from dora_jax.rollout.trajectory import Trajectory
    from dora_jax.scheduler.core import Scheduler


def _scalar(x: Any) -> Any:
    x = np.asarray(x)
    return x.item() if x.size == 1 else x.tolist()


def _migrations(slices: Iterable[DecodeSlice]) -> int:
    return sum(sl.stats.migrated_out for sl in slices)


def _transfer_seconds(slices: Iterable[DecodeSlice]) -> float:
    return sum(sl.stats.weight_transfer_seconds for sl in slices)


def load_overlap_fraction(spans: Sequence[Span]) -> float | None:
    """Of the weight loads in `spans` (timeline.Span), the fraction during which
    another slice was decoding; None without loads."""
    loads = [s for s in spans if s.kind == "load"]
    if not loads:
        return None
    decoding: dict = {}  # row -> (starts, ends) of its decode time, disjoint, sorted
    for s in spans:
        if s.kind == "decode":
            decoding.setdefault(s.row, []).append((s.start, s.end))
    decoding = {row: list(zip(*_union(iv))) for row, iv in decoding.items()}

    def overlaps(ld: Span, starts: Sequence[float], ends: Sequence[float]) -> bool:
        # The last interval starting before the load ends has the latest end.
        i = bisect.bisect_left(starts, ld.end) - 1
        return i >= 0 and ends[i] > ld.start

    overlapped = sum(any(row != ld.row and overlaps(ld, *se) for row, se in decoding.items())
                     for ld in loads)
    return round(overlapped / len(loads), 4)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def rollout_only_share(spans: Sequence[Span], start: float, end: float) -> float | None:
    """Of the window [start, end], the fraction in which some slice was decoding and
    the trainer was not training (the paper's "rollout-only" time); None if empty."""
    if end <= start:
        return None

    def clip(iv: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(max(a, start), min(b, end)) for a, b in iv if b > start and a < end]

    decode = _union(clip((s.start, s.end) for s in spans if s.kind == "decode"))
    train = _union(clip((s.start, s.end) for s in spans if s.kind == "train"))
    overlap, j = 0.0, 0
    for a, b in decode:  # both lists sorted and disjoint: one merge pass
        while j < len(train) and train[j][1] <= a:
            j += 1
        k = j
        while k < len(train) and train[k][0] < b:
            overlap += min(b, train[k][1]) - max(a, train[k][0])
            k += 1
    return round((sum(b - a for a, b in decode) - overlap) / (end - start), 4)


WAIT_KINDS = ("fill", "guard", "starvation")


class WaitClock:
    """Splits the trainer's idle time by cause. The coordinator calls `mark` after
    every decision pass with the state it leaves: the trainer busy (None), still
    before its first step ("fill": the pipeline filling), holding at least a batch of
    finished groups that the mode does not train yet ("guard": the staleness guard or
    the mode's batch rule), or short of finished groups ("starvation")."""

    def __init__(self, now: float = 0.0) -> None:
        self._kind: str | None = None
        self._since = now
        self._split = dict.fromkeys(WAIT_KINDS, 0.0)

    def mark(self, now: float, kind: str | None) -> None:
        if self._kind is not None:
            self._split[self._kind] += now - self._since
        self._kind, self._since = kind, now

    def take(self, now: float) -> dict:
        """The split since the last `take`, up to `now`, when the trainer gets a batch
        (so it is busy from `now`)."""
        self.mark(now, None)
        out = {k: round(v, 4) for k, v in self._split.items()}
        self._split = dict.fromkeys(WAIT_KINDS, 0.0)
        return out


class _RecordWriter:
    """Hands records to every writer (writers.py) on its own thread, so that a step's
    writes never hold the coordinator. `close` writes what is queued."""

    def __init__(self, writers: list) -> None:
        self._writers = list(writers)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="metrics writer",
                                        daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        if self._error is not None:  # a full disk: say so at the next step
            raise self._error
        self._queue.put(record)

    def _loop(self) -> None:
        while (record := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                for w in self._writers:
                    w.write(record)
            except BaseException as e:  # noqa: BLE001 - raised in the coordinator
                self._error = e

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        try:
            with contextlib.ExitStack() as closing:  # each closes even if one raises
                for w in reversed(self._writers):
                    closing.callback(w.close)
        finally:
            if self._error is not None:
                raise self._error


def _step_record(r: dict) -> bool:
    return (all(isinstance(r.get(k), (int, float)) for k in ("step", "time", "reward_mean",
                                                             "trained_tokens", "trainer_wait"))
            and isinstance(r.get("staleness", {}), dict))


class StepReporter:
    """Turns each finished step into a metrics record and keeps run totals; the
    records are written on a thread of their own."""

    def __init__(self, path: str | None = None, *, tensorboard: str | None = None,
                 purge_step: int | None = None, writers: list | None = None) -> None:
        """`writers`: where records go (writers.py, e.g. `writers.make_writers`); without
        them, `path`: metrics.jsonl (appended) and `tensorboard`: a directory that gets
        the same records as TensorBoard scalars (runtime/tensorboard.py), with the
        events of steps >= `purge_step` dropped (a resumed run trains them again)."""
        if writers is None:
            from dora_jax.runtime.writers import JsonlWriter

            writers = [JsonlWriter(path)] if path else []
            if tensorboard:
                from dora_jax.runtime.tensorboard import TensorBoardWriter

                writers.append(TensorBoardWriter(tensorboard, purge_step))
        self._writer = _RecordWriter(writers)
        self.records: list[dict] = []
        self.evals: list[dict] = []  # evaluation records, apart from the steps'
        self._last: dict[str, Any] = {"migrations": 0, "transfer": 0.0, "busy": {}, "total": {},
                      "prefill_tokens": {}, "reprefill_tokens": {}}
        self.staleness: Counter[int] = Counter()
        self._from_step = 0
        self._earlier: list[dict] = []  # the earlier segments' step records
        self._segments: list[dict] = []  # the earlier segments (`ledger.segments`)

    def resume_from(self, step: int, records: list[dict], segments: Iterable[dict]) -> None:
        """Makes the summary cover the whole run resumed at `step`: `records` are
        metrics.jsonl's records of the steps before it (evaluations among them),
        `segments` the earlier processes' (`ResumePlan.segments`)."""
        self._from_step = step
        # Only what reads as this reporter's own records: the file was handed over.
        self._earlier = [r for r in records if "eval" not in r and _step_record(r)]
        self.evals = [r for r in records if isinstance(r.get("eval"), dict)] + self.evals
        self._segments = [dict(x) for x in segments]
        for r in self._earlier:
            self.staleness.update({int(k): v for k, v in r.get("staleness", {}).items()})

    def _utilisation_since_last(self, slices: Iterable[DecodeSlice]) -> dict:
        out = {}
        for sl in slices:
            busy, total = sl.stats.busy_slot_steps, sl.stats.total_slot_steps
            d_busy = busy - self._last["busy"].get(sl.slice_id, 0)
            d_total = total - self._last["total"].get(sl.slice_id, 0)
            self._last["busy"][sl.slice_id], self._last["total"][sl.slice_id] = busy, total
            out[str(sl.slice_id)] = round(d_busy / d_total, 4) if d_total else 0.0
        return out

    def _per_slice_since_last(self, slices: Iterable[DecodeSlice], counter: str) -> dict:
        """Slice id -> the SliceStats `counter`'s increase since the previous step."""
        out, last = {}, self._last[counter]
        for sl in slices:
            n = getattr(sl.stats, counter)
            before = last.get(sl.slice_id, 0)
            out[str(sl.slice_id)] = n - before if n >= before else n  # restarted: anew
            last[sl.slice_id] = n
        return out

    def step(self, step: int, batch: TrainBatch, metrics: dict, *, wait: float, train_time: float,
             now: float, slices: Sequence[DecodeSlice], scheduler: Scheduler,
             wait_split: dict | None = None, slice_failures: int = 0, checkpoint_pause: float = 0.0,
             checkpoint_copy_wait: float = 0.0, episodes: dict | None = None,
             publish_bytes: int | None = None) -> dict:
        """Records step `step` (a TrainBatch and the trainer's host metrics); `wait`
        is the trainer's idle time before it, `wait_split` that time by cause,
        `slice_failures` the slices restarted since the previous step,
        `checkpoint_pause` the seconds a checkpoint save after it held the
        coordinator (handing it to the saver thread), `checkpoint_copy_wait` the
        seconds the step waited, before it started, for a save's device-to-host copy
        of the previous state. `episodes`: the batch's multi-turn figures
        (`episode_record`), None for single-turn samples. `publish_bytes`: what the
        step's new version carried to the slices (with LoRA, its adapters)."""
        versions = batch.versions_B[::batch.group_size]  # one per group
        lags = Counter(int(step - v) for v in versions)
        self.staleness.update(lags)
        migrations, transfer = _migrations(slices), _transfer_seconds(slices)
        record = {
            "step": step,
            "time": round(now, 4),
            "reward_mean": float(np.mean(batch.rewards_B)),
            "trained_tokens": int(batch.num_response_tokens),
            "step_time": round(train_time, 4),
            "trainer_wait": round(wait, 4),
            "trainer_wait_split": wait_split or {},
            "slot_utilisation": self._utilisation_since_last(slices),
            # Per slice: prompt positions prefilled, response tokens run again.
            "prefill_tokens": self._per_slice_since_last(slices, "prefill_tokens"),
            "reprefill_tokens": self._per_slice_since_last(slices, "reprefill_tokens"),
            "resident_versions": sorted({v for sl in scheduler.slices for v in sl.held}),
            "staleness": {str(k): v for k, v in sorted(lags.items())},
            "migrations": migrations - self._last["migrations"],
            "weight_transfer_seconds": round(transfer - self._last["transfer"], 4),
            **({} if publish_bytes is None else {"publish_bytes": int(publish_bytes)}),
            "slice_failures": slice_failures,
            "checkpoint_pause_s": round(checkpoint_pause, 4),
            "checkpoint_copy_wait_s": round(checkpoint_copy_wait, 4),
            "trainer": {k: _scalar(v) for k, v in sorted(metrics.items())},
        }
        if episodes:
            record["episodes"] = episodes
            # Per slice: episodes waiting for their environment as the step ends.
            record["at_environment"] = {str(sl.slice_id): sl.num_at_environment
                                        for sl in slices}
        self._last["migrations"], self._last["transfer"] = migrations, transfer
        self.records.append(record)
        self._writer.put(record)
        return record

    def eval(self, record: dict) -> None:
        """Writes an evaluation's record (runtime/evaluation.py) with the steps'."""
        self.evals.append(record)
        self._writer.put(record)

    def summary(self, slices: Sequence[DecodeSlice], timeline: Timeline | None = None) -> dict:
        """Run totals; see the module docstring for the steady-state window. With the
        run's timeline, also the fraction of weight loads that overlapped another
        slice's decoding (loads that did not stall the rest of the rollout)."""
        r, every, earlier = self.records, self._earlier + self.records, self._earlier
        if not every:
            return {"steps": 0}
        busy = sum(sl.stats.busy_slot_steps for sl in slices)
        total = sum(sl.stats.total_slot_steps for sl in slices)
        segments = [*self._segments, {"from_step": self._from_step, "steps": len(r),
                                      "wall_seconds": round(r[-1]["time"] if r else 0.0, 3)}]
        wall = sum(x["wall_seconds"] for x in segments)
        out = {
            "steps": every[-1]["step"] + 1,  # counted from step 0, every segment's
            "wall_seconds": round(wall, 3),
            "segments": segments,
            "trained_tokens": sum(x["trained_tokens"] for x in every),
            "groups_consumed": sum(self.staleness.values()),
            "reward_first": round(every[0]["reward_mean"], 4),
            "reward_last": round(every[-1]["reward_mean"], 4),
            "reward_mean": round(sum(x["reward_mean"] for x in every) / len(every), 4),
            "mean_slot_utilisation": round(busy / total, 4) if total else 0.0,
            "trainer_wait_fraction_all": round(sum(x["trainer_wait"] for x in every)
                                               / wall, 4) if wall else 0.0,
            "migrations": sum(x.get("migrations", 0) for x in earlier) + _migrations(slices),
            "weight_transfer_seconds": round(sum(x.get("weight_transfer_seconds", 0.0)
                                                 for x in earlier)
                                             + _transfer_seconds(slices), 4),
            "slice_failures": sum(x.get("slice_failures", 0) for x in earlier),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }
        if "publish_bytes" in every[-1]:
            out["publish_bytes"] = every[-1]["publish_bytes"]
        if "episodes" in every[0]:  # multi-turn: the first and last steps' windows
            w = max(1, len(every) // 5)
            out["episodes_first"] = _episode_window([x["episodes"] for x in every[:w]])
            out["episodes_last"] = _episode_window([x["episodes"] for x in every[-w:]])
            out["episodes"] = sum(x["episodes"]["episodes"] for x in every)
            out["episodes_mixed_versions"] = sum(x["episodes"]["mixed_versions"]
                                                 for x in every)
        if timeline is not None:
            out["load_overlap_fraction"] = load_overlap_fraction(timeline.spans)
        out.update(_train_rollout_agreement([x["trainer"] for x in every]))
        if self.evals:  # held-out pass@1 and pass@k before and after (by version)
            keys = ("version", "pass_at_1", "pass_at_k")
            first, last = (min(self.evals, key=lambda e: e["step"]),
                           max(self.evals, key=lambda e: e["step"]))
            out["eval_first"] = {k: first["eval"][k] for k in keys}
            out["eval_last"] = {k: last["eval"][k] for k in keys}
        if len(r) > 1:
            window = r[-1]["time"] - r[0]["time"]
            out["tokens_per_second"] = round(sum(x["trained_tokens"] for x in r[1:]) / window, 2)
            out["trainer_wait_fraction"] = round(sum(x["trainer_wait"] for x in r[1:]) / window, 4)
            out["trainer_wait_split"] = {  # fill: seconds before step 0; others: fractions
                "fill_seconds": round(r[0].get("trainer_wait_split", {}).get("fill", 0.0), 4),
                **{k: round(sum(x.get("trainer_wait_split", {}).get(k, 0.0) for x in r[1:])
                            / window, 4) for k in ("guard", "starvation")}}
            out["step_seconds"] = round(window / (len(r) - 1), 4)
            # The trainer's own time per step (not its waits), steady steps only.
            out["train_step_seconds"] = round(float(np.median([x["step_time"] for x in r[1:]])), 4)
            if timeline is not None:
                out["rollout_only_share"] = rollout_only_share(timeline.spans, r[0]["time"],
                                                               r[-1]["time"])
        return out

    def close(self) -> None:
        """Writes every queued record, then closes the files."""
        self._writer.close()


def _train_rollout_agreement(trainer_records: list) -> dict:
    """Means over steps of how the trainer's forward agrees with the rollout's: the
    log-prob mismatch at staleness 0 and, for an MoE policy, the routing agreement
    and both sides' expert load imbalance (rl/step_metrics.py)."""
    keys = ("logprob_mismatch", "routing_agreement", "expert_load_imbalance_rollout",
            "expert_load_imbalance_train")
    return {f"{k}_mean": round(float(np.mean([m[k] for m in trainer_records])), 6)
            for k in keys if trainer_records and all(k in m for m in trainer_records)}


def episode_record(trajectories: Sequence[Trajectory]) -> dict | None:
    """A train step's multi-turn figures (None if no sample is an episode): episodes,
    model turns and environment seconds per episode, the environment's reward, the
    share of episodes that called a tool (`tool_use`) and that got a tool result equal
    to the answer (`tool_correct`, environments that count it), why they ended, and
    how many ran under more than one policy version (`mixed_versions`: partial
    rollout's reloads between or within turns; 0 under C1)."""
    runs = [t for t in trajectories if getattr(t, "episode", None)]
    if not runs:
        return None
    eps = [t.episode for t in runs if t.episode is not None]  # all of `runs`
    n = len(runs)
    info = [e.get("info", {}) for e in eps]
    return {
        "episodes": n,
        "model_turns": round(sum(sum(1 for t in e["turns"] if t[0] == "model")
                                 for e in eps) / n, 4),
        "env_s": round(sum(e.get("env_s", 0.0) for e in eps) / n, 6),
        "env_reward": round(sum(e["reward"] for e in eps) / n, 4),
        "tool_use": round(sum(1 for i in info if i.get("tool_calls")) / n, 4),
        "tool_correct": round(sum(1 for i in info if i.get("tool_correct")) / n, 4),
        "ends": dict(Counter(e.get("end") for e in eps)),
        "mixed_versions": sum(1 for t in runs
                              if len({v for v, count in t.versions if count}) > 1),
    }


def _episode_window(records: list) -> dict:
    """Episode-weighted means of steps' `episode_record`s."""
    n = sum(r["episodes"] for r in records)
    return {"episodes": n, **{k: round(sum(r[k] * r["episodes"] for r in records) / n, 4)
                              for k in ("env_reward", "tool_use", "tool_correct",
                                        "model_turns")}}
