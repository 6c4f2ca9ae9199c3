"""Deployments to simulate: the paper's two GPU clusters and a TPU pod.

Hardware figures are public peak numbers; what a real stack achieves of them is a
stated assumption (`CostModel.from_hardware`'s efficiency factors), which
`calibrate.py` replaces with figures fitted to a measured run.

- NVIDIA H800 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s; weights and KV
  cross nodes over 400 Gb/s InfiniBand (50 GB/s per transfer).
- Google TPU v5p: 459 TFLOP/s bf16, 95 GB HBM at 2.76 TB/s; transfers inside the
  pod over ICI (we take 100 GB/s per transfer, a fraction of a chip's links).
- Qwen2.5-32B: 32.5B parameters, 64 layers, 8 KV heads of dim 128: 256 KiB of bf16
  KV per token. Qwen3-30B-A3B: 30.5B parameters (3.3B active), 48 layers, 4 KV heads
  of dim 128: 96 KiB per token.

The paper's workload (DAPO-Math-17k): 512 prompts x 16 samples per step, responses
up to 30,720 tokens with mean about 2.4K, K = 3. Its device split between trainer
and rollout is not stated; we give half the accelerators to each, in slices of 8
GPUs (tensor parallel 8), 256 sequences per slice. Colocated sync runs rollout and
training on all of them in turn.
"""

from __future__ import annotations

import dataclasses

from dora_jax.sim.cost import CostModel, Workload

H800 = dict(flops=989e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9, link_bytes_per_s=50e9)
V5P = dict(flops=459e12, hbm_bytes_per_s=2.76e12, hbm_bytes=95e9, link_bytes_per_s=100e9)
QWEN25_32B = dict(params=32.5e9, kv_bytes_per_token=64 * 2 * 8 * 128 * 2)
QWEN3_30B_A3B = dict(params=30.5e9, active_params=3.3e9, kv_bytes_per_token=48 * 2 * 4 * 128 * 2)

# The paper's figures (DESIGN.md §7): step minutes and rollout-only share per mode.
PAPER_64 = {"dora": (14.67, 0.12), "sync": (22.91, 0.65), "one_step_off": (22.94, 0.33),
            "partial_rollout": (17.38, 0.46)}
PAPER_128 = {"dora": (10.46, None), "sync": (20.23, None), "partial_rollout": (13.95, None)}


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    total_devices: int
    trainer_devices: int
    slice_devices: int
    slots_per_slice: int
    hardware: dict
    model: dict
    workload: Workload = Workload()
    group_size: int = 16
    train_batch_size: int = 512
    rollout_batch_size: int = 768
    max_staleness: int = 3
    paper: dict = dataclasses.field(default_factory=dict)

    @property
    def num_slices(self) -> int:
        return (self.total_devices - self.trainer_devices) // self.slice_devices

    @property
    def colocated_slices(self) -> int:
        return self.total_devices // self.slice_devices

    def cost(self, colocated: bool = False) -> CostModel:
        model = dict(self.model)
        active = model.pop("active_params", model["params"])
        cost = CostModel.from_hardware(**model, slice_devices=self.slice_devices,
                                       trainer_devices=self.trainer_devices, **self.hardware,
                                       active_params=active)
        if colocated:
            cost = cost.scaled_trainer(self.total_devices / self.trainer_devices)
            # Between training and rollout the weights change layout on the same
            # devices, and the optimizer state makes room for the KV cache: a
            # transfer of the weights at HBM speed and one over the links.
            cost = dataclasses.replace(cost, reshard=cost.load_seconds(1))
        return cost

    def step_time_bound(self, cost: CostModel | None = None, groups: int = 4096) -> dict:
        """Seconds per train step that no policy can beat at this split: the larger of
        the trainer's time for one batch and the rollout's at full slots.

        Rollout decodes TBS x G responses per step; a full slice holds B sequences
        whose context, averaged over the tokens it decodes, is P + (E[L^2]/E[L] - 1)/2
        (a sample of length L spends one step at each of its positions), and B is
        cut to what the KV memory holds. Prefill is left out: it is a lower bound.
        Lengths are the workload's over `groups` groups; `cost` defaults to the
        preset's."""
        length = self.workload.lengths(self.group_size)
        lengths = [length(g, k) for g in range(groups) for k in range(self.group_size)]
        mean = sum(lengths) / len(lengths)
        context = self.workload.prompt_len + (sum(x * x for x in lengths) / sum(lengths) - 1) / 2
        cost = cost or self.cost()
        batch = max(1, min(self.slots_per_slice, int(cost.kv_tokens // context)))
        step = (cost.step_seconds(batch, batch * context)
                + cost.calls_seconds(cost.call_steps, True) / cost.call_steps)
        responses = self.train_batch_size * self.group_size
        rollout = responses * mean / (self.num_slices * batch / step)
        train = cost.train_seconds(round(responses * (mean + self.workload.prompt_len)))
        return dict(step=max(train, rollout), train=train, rollout=rollout)


PRESETS = {
    "paper64": Preset(
        "paper64", "Qwen2.5-32B on 64 H800",
        total_devices=64, trainer_devices=32, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, paper=PAPER_64),
    "paper128": Preset(
        "paper128", "Qwen2.5-32B on 128 H800",
        total_devices=128, trainer_devices=64, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, paper=PAPER_128),
    "v5p": Preset(
        "v5p", "Qwen3-30B-A3B (configs/moe.py) on a v5p pod",
        total_devices=256, trainer_devices=128, slice_devices=16, slots_per_slice=256,
        hardware=V5P, model=QWEN3_30B_A3B),
}
