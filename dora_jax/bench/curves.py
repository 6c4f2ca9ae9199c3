"""Reward curves: sync and DORA at K = 1, 2, 3 over several seeds (bench.modes --curves).

Each (mode, seed) run goes to DIR/curves/<mode>/<seed>/ and counts only if its ledger
audits clean. curves.json holds every run's per-step reward and time; curves.png
plots the mean over seeds with a min-max band against the step and against wall time
(from the end of step 0, so the one-off pipeline fill does not shift the curves).
"""

from __future__ import annotations

import json
import os

import numpy as np

from dora_jax.bench.runs import audited_run, run_config

CURVE_SPECS = ("sync", "dora_k1", "dora_k2", "dora_k3")


def _records(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_curves(base, root: str, *, init_checkpoint: str, steps: int, seeds: int,
               specs=CURVE_SPECS) -> dict:
    """Runs every spec for every seed (interleaved), writes curves.json and curves.png,
    and prints each spec's mean reward over the first and last tenth of the steps."""
    out: dict = {"steps": steps, "init_checkpoint": init_checkpoint, "runs": {}}
    for seed in range(seeds):
        for spec in specs:
            workdir = os.path.join(root, "curves", spec, str(seed))
            s = audited_run(run_config(base, spec, steps=steps, seed=seed,
                                       init_checkpoint=init_checkpoint), workdir)
            r = _records(workdir)
            out["runs"].setdefault(spec, []).append({
                "seed": seed, "audit_ok": s["audit_ok"], "audit": s["audit"],
                "reward": [x["reward_mean"] for x in r],
                "time": [round(x["time"] - r[0]["time"], 4) for x in r]})
            print(f"curves: {spec} seed {seed}: reward {s['reward_first']:.3f} -> "
                  f"{s['reward_last']:.3f}, audit {'clean' if s['audit_ok'] else 'FAILED'}",
                  flush=True)
    tenth = max(steps // 10, 1)
    for spec, runs in out["runs"].items():
        rewards = np.array([r["reward"] for r in runs if r["audit_ok"]])
        if len(rewards):
            first, last = rewards[:, :tenth].mean(axis=1), rewards[:, -tenth:].mean(axis=1)
            print(f"{spec}: reward over the first {tenth} steps {first.mean():.3f} "
                  f"(seeds {np.round(first, 3).tolist()}), last {tenth} steps "
                  f"{last.mean():.3f} (seeds {np.round(last, 3).tolist()})")
    with open(os.path.join(root, "curves.json"), "w") as f:
        json.dump(out, f)
    plot(out, os.path.join(root, "curves.png"))
    print(f"wrote {root}/curves.json and curves.png")
    return out


def _smooth(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average along the last axis (per-step rewards are noisy)."""
    c = np.cumsum(np.pad(x, [(0, 0)] * (x.ndim - 1) + [(1, 0)]), axis=-1)
    n = np.minimum(np.arange(1, x.shape[-1] + 1), window)
    return (c[..., 1:] - c[..., np.maximum(np.arange(1, x.shape[-1] + 1) - window, 0)]) / n


def plot(curves: dict, path: str, window: int = 10) -> None:
    """Mean reward over seeds with a min-max band, against step and wall time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for spec, runs in curves["runs"].items():
        runs = [r for r in runs if r["audit_ok"]]
        if not runs:
            continue
        reward = _smooth(np.array([r["reward"] for r in runs]), window)
        mean, lo, hi = reward.mean(0), reward.min(0), reward.max(0)
        steps = np.arange(reward.shape[1])
        line, = by_step.plot(steps, mean, label=spec)
        by_step.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
        # Against time: each seed's own clock, averaged (the runs have equal steps).
        t = np.array([r["time"] for r in runs]).mean(0)
        by_time.plot(t, mean, color=line.get_color(), label=spec)
        by_time.fill_between(t, lo, hi, color=line.get_color(), alpha=0.2)
    for ax, xlabel in ((by_step, "train step"), (by_time, "seconds since step 0")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"reward (mean of {window} steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("reward: mean over seeds, band = min..max")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
