"""What things cost in the simulated cluster, and the workload it runs.

`CostModel` holds per-slice and trainer costs in seconds:

- a decode step of a slice with B running samples of total context C (prompt +
  tokens so far, summed) takes `step_fixed + step_per_seq * B + step_per_ctx * C`:
  a fixed part (weights read once per step, launch and collective latency), a part
  per sequence (its matmuls) and a part per context token (its KV read by
  attention, which a paged cache makes follow the real contexts);
- a prefill costs `prefill_fixed + prefill_per_token` per token (a group's prompt
  once per slice; a resumed request re-prefills its tokens so far);
- with several versions per slice, each distinct version of the batch beyond the
  first adds `per_version_read` to a step: its weights read again (full weights) or
  its adapters (LoRA: the base is read once, `step_fixed`);
- a weight load moves `weight_bytes` over `transfer_bandwidth` shared by the loads
  in progress (contention), after `transfer_latency` (with LoRA a publish moves the
  adapters only);
- a migration moves the request's KV (`kv_bytes_per_token` per position) and, for an
  MoE policy, its recorded routing (`routing_bytes_per_token`, rollout/routing.py)
  over `migrate_bandwidth`, after `migrate_latency`;
- a slice holds at most `kv_tokens` positions (long contexts limit its samples);
- a multi-turn episode's KV copied to host memory during its environment call and
  back (`rollout.episode_kv = "host"`) moves `kv_bytes_per_token` per position over
  `host_bandwidth` (the slice's host links, each direction; 0: no host copies);
- a train step takes `train_fixed + train_per_token` per trained token (prompt +
  response); colocated sync adds `reshard` per step (trainer <-> decode layouts);
- a generate call costs `call_overhead` on top of its steps (host work between
  dispatches); a full slice runs `call_steps` steps per call, one with a free slot
  (so that new work starts at once), as the runtime's slices do;
- `cores` > 0 models components that share compute (a CPU host running every slice
  and the trainer): each runs at min(1, cores / components busy at its start).

`CostModel.from_hardware` derives these from a model's size and an accelerator's
public figures with stated efficiency factors; `calibrate.py` fits them to a real
run instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from dora_jax.sim.episodes import Episode, Turns, episodes, single_turn


@dataclasses.dataclass(frozen=True)
class CostModel:
    step_fixed: float
    step_per_seq: float
    step_per_ctx: float
    prefill_fixed: float
    prefill_per_token: float
    weight_bytes: float
    transfer_bandwidth: float  # bytes/s, shared by concurrent loads
    transfer_latency: float
    kv_bytes_per_token: float
    migrate_bandwidth: float
    migrate_latency: float
    kv_tokens: int  # KV positions one slice holds
    train_fixed: float
    train_per_token: float
    reshard: float = 0.0
    cores: float = 0.0  # shared compute (0: every slice and the trainer has its own)
    call_overhead: float = 0.0
    call_steps: int = 16
    per_version_read: float = 0.0  # seconds per step per extra distinct version
    routing_bytes_per_token: float = 0.0  # an MoE rollout's recorded experts
    host_bandwidth: float = 0.0  # bytes/s a slice copies to or from host memory

    def calls_seconds(self, k: int, full: bool) -> float:
        """Per-call overhead of k decode steps: one call per step unless full."""
        if not self.call_overhead:
            return 0.0
        return self.call_overhead * (-(-k // self.call_steps) if full else k)

    def contention(self, busy: int) -> float:
        """Slow-down of a component started while `busy` components (itself
        included) share the compute."""
        return max(1.0, busy / self.cores) if self.cores else 1.0

    def step_seconds(self, batch: int, context: float, versions: int = 1) -> float:
        """One decode step of `batch` sequences of total `context` under `versions`
        distinct versions."""
        fixed = self.step_fixed + (self.per_version_read * (versions - 1) if versions > 1 else 0)
        return fixed + self.step_per_seq * batch + self.step_per_ctx * context

    def steps_seconds(self, k: int, batch: int, context: float, versions: int = 1) -> float:
        """k decode steps during which every one of `batch` samples grows by a token
        per step (context grows by `batch` per step), in closed form."""
        return (k * self.step_seconds(batch, context, versions)
                + self.step_per_ctx * batch * k * (k - 1) / 2)

    def prefill_seconds(self, tokens: int) -> float:
        return self.prefill_fixed + self.prefill_per_token * tokens if tokens else 0.0

    def load_seconds(self, concurrent: int) -> float:
        return self.transfer_latency + self.weight_bytes * concurrent / self.transfer_bandwidth

    def migrate_seconds(self, tokens: int) -> float:
        return self.migrate_latency + tokens * (
            self.kv_bytes_per_token + self.routing_bytes_per_token) / self.migrate_bandwidth

    def host_seconds(self, tokens: int) -> float:
        """One copy of `tokens` positions of KV between a slice and its host memory."""
        if self.host_bandwidth <= 0:
            raise ValueError("episode KV on host needs the hardware's host_bytes_per_s")
        return tokens * self.kv_bytes_per_token / self.host_bandwidth

    def train_seconds(self, tokens: float) -> float:
        return self.train_fixed + self.train_per_token * tokens

    def scaled_trainer(self, factor: float) -> CostModel:
        """The trainer on `factor` times the devices (colocated: all of them)."""
        return dataclasses.replace(self, train_fixed=self.train_fixed / factor,
                                   train_per_token=self.train_per_token / factor)

    @classmethod
    def from_hardware(cls, *, params: float, kv_bytes_per_token: float, layers: int,
                      hidden: int, slice_devices: int, trainer_devices: int, flops: float,
                      hbm_bytes_per_s: float, hbm_bytes: float, link_bytes_per_s: float,
                      slice_link_bytes_per_s: float, efficiency: Efficiency,
                      active_params: float | None = None, param_bytes: int = 2,
                      kv_memory_fraction: float = 0.8, adapter_params: float = 0.0,
                      adapter_param_bytes: int = 4, versions: int = 1,
                      routing_bytes_per_token: float = 0.0,
                      host_bytes_per_s: float = 0.0) -> CostModel:
        """Roofline costs from public figures, scaled by achieved fractions
        (`Efficiency`).

        params: model parameters (`active_params` per token for an MoE: FLOPs follow
        them; the weights read per step and moved per load are all of them);
        kv_bytes_per_token: layers x 2 x kv_heads x head_dim x bytes; layers /
        hidden: the tensor-parallel all-reduces (two per layer, of hidden x bytes per
        sequence); flops / hbm_bytes_per_s / hbm_bytes: one accelerator's peak dense
        bf16 FLOP/s, HBM bandwidth and capacity; slice_link_bytes_per_s: one
        accelerator's link inside a slice (NVLink, ICI); link_bytes_per_s: what one
        transfer of weights or KV gets between slices and trainer;
        routing_bytes_per_token: an MoE policy's recorded experts (MoE layers x top_k
        x 1 byte), moved with a migrating request; host_bytes_per_s: one
        accelerator's link to host memory (PCIe), each direction: the KV is sharded
        over the slice's devices, so a slice copies at `slice_devices` times it.

        A decode step reads the weights once, pays the per-step host overhead and
        the collectives' latency (`step_fixed`); each sequence adds its matmuls and
        its share of the all-reduce bytes (`step_per_seq`); each position of context
        adds its KV read (`step_per_ctx`). A prefilled token costs its forward
        matmuls (attention's quadratic part is left out: prompts are short and
        re-prefills are rare). A trained token costs `efficiency.train_passes`
        forward passes' FLOPs.

        LoRA (`adapter_params` > 0, `lora_adapter_params`): the base is frozen, each
        version is an adapter set (`adapter_param_bytes` per parameter). A step reads
        the base and one adapter set, plus one more per extra distinct version in the
        batch; its FLOPs include the adapters'; a load (publish) moves the adapters
        only; training skips the base's weight gradients (one forward pass fewer per
        token of `train_passes`). `versions` (V): versions a slice holds, each a full
        copy of the weights (or an adapter set) taken from the KV memory; ValueError
        naming `rollout.versions_per_slice` if they leave no room for KV.
        """
        eff = efficiency
        n = slice_devices
        active = (params if active_params is None else active_params) + adapter_params
        weight_bytes = params * param_bytes
        adapter_bytes = adapter_params * adapter_param_bytes
        version_bytes = adapter_bytes if adapter_params else weight_bytes
        slice_bw = n * hbm_bytes_per_s * eff.hbm
        resident = weight_bytes + (versions * adapter_bytes if adapter_params else
                                   (versions - 1) * weight_bytes)
        kv_room = n * hbm_bytes * kv_memory_fraction - resident
        if kv_room < kv_bytes_per_token:
            raise ValueError(
                f"rollout.versions_per_slice: {versions} versions of {version_bytes / 1e9:.1f} "
                f"GB on a slice of {n} x {hbm_bytes / 1e9:.0f} GB leave no KV memory")
        collectives = 2 * layers if n > 1 else 0
        ring = 2 * (n - 1) / n  # bytes an all-reduce moves per byte reduced
        return cls(
            step_fixed=((weight_bytes + adapter_bytes) / slice_bw + eff.step_overhead
                        + collectives * eff.collective_latency),
            per_version_read=version_bytes / slice_bw,
            step_per_seq=(2 * active / (n * flops * eff.mfu_decode)
                          + collectives * hidden * param_bytes * ring
                          / (slice_link_bytes_per_s * eff.link)),
            step_per_ctx=kv_bytes_per_token / slice_bw,
            prefill_fixed=eff.step_overhead,
            prefill_per_token=2 * active / (n * flops * eff.mfu_prefill),
            weight_bytes=version_bytes, transfer_bandwidth=link_bytes_per_s,
            transfer_latency=1.0, kv_bytes_per_token=kv_bytes_per_token,
            migrate_bandwidth=link_bytes_per_s, migrate_latency=0.05,
            kv_tokens=int(kv_room // kv_bytes_per_token),
            routing_bytes_per_token=routing_bytes_per_token,
            host_bandwidth=n * host_bytes_per_s,
            train_fixed=eff.train_fixed,
            train_per_token=2 * active * (eff.train_passes - (1 if adapter_params else 0))
            / (trainer_devices * flops * eff.mfu_train))


def lora_adapter_params(*, layers: int, d_model: int, q_dim: int, kv_dim: int, ffn: int,
                        rank: int, targets=("q", "k", "v", "o", "gate", "up", "down")) -> int:
    """Parameters of one LoRA adapter set (model/lora.py: A rank x in, B out x rank on
    each targeted projection of each layer), from shapes alone, as
    `transformer.publish_bytes` counts them for a dense model."""
    shapes = dict(q=(d_model, q_dim), k=(d_model, kv_dim), v=(d_model, kv_dim),
                  o=(q_dim, d_model), gate=(d_model, ffn), up=(d_model, ffn),
                  down=(ffn, d_model))
    return layers * rank * sum(sum(shapes[t]) for t in targets)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """What a real stack achieves of the hardware's peak figures (stated, or fitted
    by `sim/fit.py`).

    hbm: fraction of HBM bandwidth that decode's weight and KV reads reach;
    mfu_decode / mfu_prefill / mfu_train: fractions of peak FLOP/s; link: fraction of
    the slice's link bandwidth an all-reduce reaches; step_overhead: host seconds per
    decode call step outside the kernels (sampling, scheduling, launch);
    collective_latency: seconds per all-reduce; train_passes: forward-pass
    equivalents per trained token — forward 1, backward 2, rematerialisation 1, the
    proximal (old) policy's log-probs 1 and the reference model's 1; train_fixed:
    seconds per step besides the tokens (optimizer update, batch hand-over).
    """

    hbm: float = 0.6
    mfu_decode: float = 0.5
    mfu_prefill: float = 0.5
    mfu_train: float = 0.35
    link: float = 0.7
    step_overhead: float = 0.004
    collective_latency: float = 15e-6
    train_passes: float = 6.0
    train_fixed: float = 5.0


@dataclasses.dataclass(frozen=True)
class Workload:
    """Prompts and response lengths. Lengths are log-normal per sample around a
    per-prompt factor (hard prompts give long answers to all their samples), with
    the given mean and clipped at `max_len`, or replayed from a ledger.

    With `turns` (episodes.Turns) requests are multi-turn episodes: `mean_len`,
    `max_len` and the sigmas then describe one model turn (the per-prompt factor is
    shared by every turn of the group's samples), and `lengths` gives an episode's
    model tokens (what is decoded; its observations are not)."""

    prompt_len: int = 256
    mean_len: float = 2400.0
    max_len: int = 30_720
    sigma_prompt: float = 0.6
    sigma_sample: float = 0.8
    seed: int = 0
    replay: tuple = ()  # response lengths to cycle through instead, group-major
    turns: Turns | None = None  # multi-turn episodes; None: every request one turn

    def episodes(self, group_size: int) -> Callable[[int, int], Episode]:
        """episode(group_id, sample) for this workload, deterministic per seed."""
        if self.turns is None:
            length = self.lengths(group_size)
            return lambda g, k: single_turn(length(g, k))
        mu = math.log(self.mean_len) - (self.sigma_prompt ** 2 + self.sigma_sample ** 2) / 2

        def per_group(rng):
            factor = rng.normal(mu, self.sigma_prompt)
            return lambda n: np.clip(np.exp(factor + rng.normal(0, self.sigma_sample, n)), 1,
                                     self.max_len).astype(int).tolist()

        return episodes(self.turns, self.seed, group_size, per_group)

    def lengths(self, group_size: int) -> Callable[[int, int], int]:
        """length(group_id, sample) for this workload, deterministic per seed (an
        episode's model tokens when multi-turn)."""
        if self.turns is not None:
            episode = self.episodes(group_size)
            return lambda g, k: sum(episode(g, k).model)
        if self.replay:
            data = self.replay
            return lambda g, k: int(data[(g * group_size + k) % len(data)])
        sigma2 = self.sigma_prompt ** 2 + self.sigma_sample ** 2
        mu = math.log(self.mean_len) - sigma2 / 2
        cache: dict = {}

        def length(g: int, k: int) -> int:
            if g not in cache:
                rng = np.random.default_rng([self.seed, g])
                z = rng.normal(mu, self.sigma_prompt) + rng.normal(0, self.sigma_sample,
                                                                   group_size)
                cache[g] = np.clip(np.exp(z), 1, self.max_len).astype(int).tolist()
            return cache[g][k]

        return length
