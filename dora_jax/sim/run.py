"""One simulated run of a preset in one mode, with a real run's outputs.

`simulate(preset, mode, steps, workdir)` writes ledger.jsonl, metrics.jsonl,
summary.json, timeline.json and timeline.png into `workdir` (if given) and returns
the summary. Figures are over the steady-state window (end of step 0 to end of the
last step), as the runtime reports them: `tokens_per_second` counts trained tokens
(prompt and response, a multi-turn episode's observations included),
`generated_tokens_per_second` decoded ones (model turns only). The ledger is audited
by the project's auditor, and a summary says whether it passed (`audit_ok`). As in
the runtime, each metrics record has the trainer's wait before its step by cause
(`trainer_wait_split`: fill / guard / starvation); it also has the slot-seconds since
the previous step by state (`slot_idle`, cluster.SLOT_REASONS), and the summary both
as fractions of the window.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter

from dora_jax.runtime.report import rollout_only_share
from dora_jax.scheduler.ledger import audit_run
from dora_jax.scheduler.types import SchedulerConfig
from dora_jax.sim.cluster import SLOT_REASONS, ClusterSim
from dora_jax.sim.cost import CostModel
from dora_jax.sim.presets import Preset

# Modes as simulated, by the name a run is reported under: partial_rollout also
# without a staleness bound, reported apart, and sync on the colocated layout (slices
# and trainer take turns on every device: the paper's synchronous baseline).
SIM_MODES = ("colocated_sync", "sync", "one_step_off", "partial_rollout",
             "partial_rollout_unbounded", "partial_rollout_rounds", "dora")
COLOCATED = "colocated_sync"  # a run's name: mode sync, mesh.colocated
UNBOUNDED = 10**6


def scheduler_mode(name: str) -> str:
    """The scheduling mode of a simulated run's name (SIM_MODES)."""
    return {COLOCATED: "sync", "partial_rollout_unbounded": "partial_rollout"}.get(name, name)


def scheduler_config(preset: Preset, mode: str) -> SchedulerConfig:
    """The scheduler's config of `preset` run as `mode` (a name of SIM_MODES)."""
    colocated = mode == COLOCATED
    return SchedulerConfig(
        mode=scheduler_mode(mode),
        num_slices=preset.colocated_slices if colocated else preset.num_slices,
        slots_per_slice=preset.slots_per_slice, group_size=preset.group_size,
        train_batch_size=preset.train_batch_size,
        rollout_batch_size=preset.rollout_batch_size,
        max_staleness=UNBOUNDED if mode == "partial_rollout_unbounded" else preset.max_staleness,
        # Several versions per slice are dora's; the other modes hold one by definition.
        versions_per_slice=preset.versions_per_slice if mode == "dora" else 1,
        episodes_per_slice=preset.episodes_per_slice)


def simulate(preset: Preset, mode: str, steps: int, workdir: str | None = None, *,
             cost: CostModel | None = None, max_chunk: int = 64) -> dict:
    """Simulates `steps` train steps of `preset` in `mode` (one of SIM_MODES)."""
    if mode not in SIM_MODES:
        raise ValueError(f"mode must be one of {SIM_MODES}, got {mode!r}")
    if steps < 2:
        raise ValueError("steps must be >= 2 (figures are over steps 1..N-1)")
    preset.check_episodes()
    colocated = mode == COLOCATED
    config = scheduler_config(preset, mode)
    cost = cost or preset.cost(colocated, versions=config.versions_per_slice)
    workload = preset.workload
    sim = ClusterSim(config, cost, workload.lengths(preset.group_size),
                     prompt_len=workload.prompt_len, colocated=colocated, max_chunk=max_chunk,
                     episode=workload.episodes(preset.group_size) if workload.turns else None,
                     host_kv=preset.episode_kv == "host")
    sim.run(steps)
    summary = summarize(sim, preset, mode, cost)
    if workdir:
        write_outputs(sim, summary, workdir, f"{preset.name}: {mode}")
    return summary


def summarize(sim: ClusterSim, preset: Preset, mode: str, cost: CostModel) -> dict:
    m = sim.metrics
    start, end = m[0]["time"], m[-1]["time"]
    window = end - start
    trained = sum(r["trained_tokens"] for r in m[1:])
    generated = sum(r["generated_tokens"] for r in m[1:])
    train_busy = sum(min(s.end, end) - max(s.start, start) for s in sim.timeline.spans
                     if s.kind == "train" and s.end > start and s.start < end)
    report = audit_run(sim.ledger + sim.unconsumed_records(), sim.config)
    consumed = [r for r in sim.ledger if r["event"] == "consume"]
    staleness = Counter(r["step"] - r["version"] for r in consumed)
    slots = sim.config.num_slices * sim.config.slots_per_slice
    # As the runtime's summary: fill in seconds (before step 0), the other causes as
    # fractions of the window; slot-time by state (cluster.SLOT_REASONS) likewise.
    wait_split = {"fill_seconds": round(m[0]["trainer_wait_split"]["fill"], 4),
                  **{k: round(sum(r["trainer_wait_split"][k] for r in m[1:]) / window, 4)
                     for k in ("guard", "starvation")}}
    slot_idle = {k: round(sum(r["slot_idle"][k] for r in m[1:]) / (slots * window), 4)
                 for k in SLOT_REASONS}
    share = rollout_only_share(sim.timeline.spans, start, end)
    assert share is not None  # the window is not empty (figures above divide by it)
    return dict(
        preset=preset.name, mode=mode, steps=len(m),
        step_minutes=round(window / (len(m) - 1) / 60, 3),
        tokens_per_second=round(trained / window, 1),
        generated_tokens_per_second=round(generated / window, 1),
        rollout_only_share=round(share, 4),
        trainer_wait_fraction=round(1 - train_busy / window, 4),
        trainer_wait_split=wait_split, slot_idle=slot_idle,
        slot_utilisation=round(sim.stats["busy_slot_seconds"] / (slots * end), 4),
        migrations=sim.stats["migrations"], loads=sim.stats["loads"],
        interrupts=sim.stats["interrupts"], preemptions=sim.stats["preemptions"],
        host_copies=sim.stats["host_copies"],
        # Distinct versions in a decode step's batch, on average over every slice's steps.
        versions_per_step=round(sim.stats["version_steps"] / max(1, sim.stats["decode_steps"]), 3),
        staleness={str(k): v for k, v in sorted(staleness.items())},
        audit_ok=report.ok, audit=report.summary(),
        cost=dataclasses.asdict(cost))


def write_outputs(sim: ClusterSim, summary: dict, workdir: str, title: str) -> None:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "ledger.jsonl"), "w") as f:
        for rec in sim.ledger + sim.unconsumed_records():
            f.write(json.dumps(rec) + "\n")
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        prev = 0.0
        for rec in sim.metrics:
            f.write(json.dumps(dict(rec, step_seconds=round(rec["time"] - prev, 3))) + "\n")
            prev = rec["time"]
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    sim.timeline.save_json(os.path.join(workdir, "timeline.json"))
    sim.timeline.plot(os.path.join(workdir, "timeline.png"), title)
