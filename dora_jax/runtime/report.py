"""Per-step metrics (`<workdir>/metrics.jsonl`) and the run summary.

Throughput and the trainer-wait fraction are reported over the steady-state window
— from the end of step 0 to the end of the last step — because on a fresh process
the first step also pays for compiling every jitted function; whole-run figures are
given too.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np


def _scalar(x):
    x = np.asarray(x)
    return x.item() if x.size == 1 else x.tolist()


def _migrations(slices) -> int:
    return sum(sl.stats.migrated_out for sl in slices)


def _transfer_seconds(slices) -> float:
    return sum(sl.stats.weight_transfer_seconds for sl in slices)


def load_overlap_fraction(spans) -> float | None:
    """Of the weight loads in `spans` (timeline.Span), the fraction during which
    another slice was decoding; None without loads."""
    loads = [s for s in spans if s.kind == "load"]
    decodes = [s for s in spans if s.kind == "decode"]
    if not loads:
        return None
    overlapped = sum(any(d.row != ld.row and d.start < ld.end and ld.start < d.end
                         for d in decodes) for ld in loads)
    return round(overlapped / len(loads), 4)


class StepReporter:
    """Turns each finished step into a metrics record and keeps run totals."""

    def __init__(self, path: str | None):
        self._file = open(path, "a") if path else None
        self.records: list[dict] = []
        self._last = {"migrations": 0, "transfer": 0.0, "busy": {}, "total": {}}
        self.staleness = Counter()

    def _utilisation_since_last(self, slices) -> dict:
        out = {}
        for sl in slices:
            busy, total = sl.stats.busy_slot_steps, sl.stats.total_slot_steps
            d_busy = busy - self._last["busy"].get(sl.slice_id, 0)
            d_total = total - self._last["total"].get(sl.slice_id, 0)
            self._last["busy"][sl.slice_id], self._last["total"][sl.slice_id] = busy, total
            out[str(sl.slice_id)] = round(d_busy / d_total, 4) if d_total else 0.0
        return out

    def step(self, step, batch, metrics, *, wait, train_time, now, slices, scheduler) -> dict:
        """Records step `step` (a TrainBatch and the trainer's host metrics)."""
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
            "slot_utilisation": self._utilisation_since_last(slices),
            "resident_versions": sorted({sl.version for sl in scheduler.slices
                                         if sl.version is not None}),
            "staleness": {str(k): v for k, v in sorted(lags.items())},
            "migrations": migrations - self._last["migrations"],
            "weight_transfer_seconds": round(transfer - self._last["transfer"], 4),
            "trainer": {k: _scalar(v) for k, v in sorted(metrics.items())},
        }
        self._last["migrations"], self._last["transfer"] = migrations, transfer
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        return record

    def summary(self, slices, timeline=None) -> dict:
        """Run totals; see the module docstring for the steady-state window. With the
        run's timeline, also the fraction of weight loads that overlapped another
        slice's decoding (loads that did not stall the rest of the rollout)."""
        r = self.records
        if not r:
            return {"steps": 0}
        busy = sum(sl.stats.busy_slot_steps for sl in slices)
        total = sum(sl.stats.total_slot_steps for sl in slices)
        out = {
            "steps": len(r),
            "wall_seconds": round(r[-1]["time"], 3),
            "trained_tokens": sum(x["trained_tokens"] for x in r),
            "reward_first": round(r[0]["reward_mean"], 4),
            "reward_last": round(r[-1]["reward_mean"], 4),
            "mean_slot_utilisation": round(busy / total, 4) if total else 0.0,
            "trainer_wait_fraction_all": round(sum(x["trainer_wait"] for x in r) / r[-1]["time"], 4),
            "migrations": _migrations(slices),
            "weight_transfer_seconds": round(_transfer_seconds(slices), 4),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
        }
        if timeline is not None:
            out["load_overlap_fraction"] = load_overlap_fraction(timeline.spans)
        if len(r) > 1:
            window = r[-1]["time"] - r[0]["time"]
            out["tokens_per_second"] = round(sum(x["trained_tokens"] for x in r[1:]) / window, 2)
            out["trainer_wait_fraction"] = round(sum(x["trainer_wait"] for x in r[1:]) / window, 4)
        return out

    def close(self):
        if self._file:
            self._file.close()
