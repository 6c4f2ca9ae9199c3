"""One benchmark run: its config from a run spec ('dora_k2'), the supervised warm
start it starts from, and the run itself with its ledger audited (bench.modes and
bench.curves share these)."""

from __future__ import annotations

import json
import os
import shutil

# A run spec that is no mode: sync on the colocated layout (config.model.colocate),
# the trainer and the slices taking turns on all the devices the config's
# disaggregated layout uses, so it is compared on the same device count.
COLOCATED = "colocated_sync"


def spec_parts(spec: str) -> tuple[str, dict]:
    """'dora_k2_v1_e32' -> ('dora', {'k': 2, 'v': 1, 'e': 32}): a run spec's mode and
    the suffixes it names: staleness bound K, versions per slice V, episodes per slice E
    (`rollout.max_episodes_per_slice`)."""
    parts = spec.split("_")
    named: dict[str, int] = {}
    while len(parts) > 1 and parts[-1][:1] in ("k", "v", "e") and parts[-1][1:].isdigit():
        named.setdefault(parts[-1][0], int(parts.pop()[1:]))
    return "_".join(parts), named


def parse_spec(spec: str) -> tuple[str, int | None]:
    """'dora_k2' -> ('dora', 2); 'sync' -> ('sync', None); other suffixes are ignored."""
    mode, named = spec_parts(spec)
    return mode, named.get("k")


def run_config(base, spec: str, *, steps: int, seed: int | None = None,
               init_checkpoint: str | None = None):
    """The ConfigDict of one measured run: `base` with the spec's mode (and layout, for
    COLOCATED), staleness bound, versions per slice ('_v<V>'; else K + 1 for dora
    on a base holding several, 1 for the other modes), episodes per slice ('_e<E>'),
    and no periodic checkpoints."""
    from dora_jax.config.model import colocate

    c = base.copy_and_resolve_references()
    mode, k = parse_spec(spec)
    if mode == COLOCATED:
        mode = "sync"
        grown = colocate(c.mesh.to_dict())
        # Packed micro-batches are counted over every batch shard: each shard keeps its
        # tokens per micro-batch when the trainer's data axis grows.
        c.trainer.tokens_per_microbatch *= grown["trainer"]["data"] // c.mesh.trainer.data
        c.mesh.update(grown)
    c.coordinator.mode = mode
    if k is not None:
        c.coordinator.max_staleness = k
    named = spec_parts(spec)[1]
    versions = named.get("v")
    if "e" in named:
        c.rollout.max_episodes_per_slice = named["e"]
    if versions is not None:
        c.rollout.versions_per_slice = versions
    elif c.rollout.versions_per_slice > 1:
        # Several LoRA versions per slice: as many as the staleness window holds in
        # dora, the one a slice serves in the other modes.
        c.rollout.versions_per_slice = c.coordinator.max_staleness + 1 if mode == "dora" else 1
    c.coordinator.num_steps = steps
    # No periodic saves in a measured run: a save holds the coordinator between two
    # steps (the first one in a process for seconds on a CPU), and sync's slices sit
    # idle through it while the asynchronous modes' keep decoding, so saves would
    # count against sync. Every run still saves once, after its last step.
    c.coordinator.checkpoint_every = 0
    if seed is not None:
        c.seed = seed
    if init_checkpoint:
        c.init_checkpoint = init_checkpoint
    return c


def warm_start(base, workdir: str, steps: int) -> str:
    """The supervised checkpoint RL starts from: trained into `workdir` unless it is
    already there. It fine-tunes the whole model: a LoRA run's adapters then train
    on that base, from fresh."""
    from dora_jax import sft
    from dora_jax.model import hf_checks

    directory = os.path.join(workdir, "checkpoints")
    if base.model.lora.rank:
        base = base.copy_and_resolve_references()
        base.model.lora.rank = 0
        base.rollout.versions_per_slice = 1
    if not os.path.isdir(directory):
        out = sft.train(hf_checks.validated(base), workdir, steps=steps, batch_size=32,
                        learning_rate=3e-3)
        print(f"supervised warm start: loss {out['loss_first']:.3f} -> "
              f"{out['loss_last']:.4f} in {steps} steps ({directory})", flush=True)
    return directory


def audited_run(c, workdir: str, on_step=lambda record: None) -> dict:
    """Runs one config into a fresh `workdir` (`on_step`: called with each step's
    metrics record); returns its summary with the audit."""
    import jax

    from dora_jax.model import hf_checks
    from dora_jax.runtime import experiment
    from dora_jax.scheduler import ledger
    from dora_jax.scheduler.types import SchedulerConfig

    cfg = hf_checks.validated(c, num_devices=jax.device_count())
    shutil.rmtree(workdir, ignore_errors=True)
    summary = experiment.run(cfg, workdir, on_step=on_step)
    report = ledger.audit_run(ledger.read(os.path.join(workdir, "ledger.jsonl")),
                              SchedulerConfig.from_config(cfg), cfg.rollout.max_decode_len)
    summary["audit_ok"], summary["audit"] = report.ok, report.summary()
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
