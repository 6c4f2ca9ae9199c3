"""Deployments to simulate: the paper's two GPU clusters and a TPU pod.

Hardware figures are public peak numbers; what a real stack achieves of them
(`cost.Efficiency`) is fitted for the H800 presets to the paper's schedules that
leave no policy freedom (`sim/fit.py`, `H800_FIT` below) and assumed the same for
v5p; `calibrate.py` fits a cost model to a measured run instead.

- NVIDIA H800 SXM: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s; weights and KV
  cross nodes over 400 Gb/s InfiniBand (50 GB/s per transfer); each GPU reaches host
  memory over PCIe gen5 x16 (64 GB/s a direction; we take 50 GB/s achieved, and
  assume every GPU of a node copies at once at that rate: a PCIe switch shared by
  two GPUs would halve it).
- Google TPU v5p: 459 TFLOP/s bf16, 95 GB HBM at 2.76 TB/s; transfers inside the
  pod over ICI (we take 100 GB/s per transfer, a fraction of a chip's links); host
  memory at 25 GB/s a chip (an assumption, PCIe gen4 x16 achieved: not checked).
- Qwen2.5-32B: 32.5B parameters, 64 layers, 8 KV heads of dim 128: 256 KiB of bf16
  KV per token. Qwen3-30B-A3B: 30.5B parameters (3.3B active), 48 layers, 4 KV heads
  of dim 128: 96 KiB per token.

The paper's workload (DAPO-Math-17k): 512 prompts x 16 samples per step, responses
up to 30,720 tokens with mean about 2.4K, K = 3. Its device split is not stated, but
its figures imply one (sim/fit.py): sync is colocated (rollout, then training, on
all the GPUs) and the asynchronous modes give half the GPUs to the trainer — the
trainer is busy 8.0 min per step in sync and 15.4 min in one-step-off. The presets
use that split, in slices of 8 GPUs (tensor parallel 8), 256 sequences per slice.

`paper128_lora` is paper128 with LoRA (rank 32 on every projection, float32
adapters, 1.6% of the base's bytes): a publish moves the adapters, a decode step
reads the base once and one adapter set per distinct version in its batch, and a
dora slice holds K + 1 = 4 versions (every slot can decode every live version).

`multiturn` is paper64's deployment on an agentic workload (`MULTITURN`): episodes
of 4 model turns on average (geometric, up to 32: a few run many), each turn about
400 tokens, observations about 300 tokens, and an environment answering in 100 ms
at the median (log-normal, sigma 0.8: from a few decode steps of about 20 ms to
several hundred ms, clipped at 2 s); responses are cut at 30,720 positions.

`multiturn_slow` is the same with slow tools (`MULTITURN_SLOW`): the environment
answers in 80 s at the median (log-normal, sigma 1.0, clipped at 600 s), over five
times a model turn — at paper64's costs a full slice's decode step at the
workload's mean context takes about 37 ms, so a 400-token turn about 15 s
(tests/sim/test_release.py checks the ratio from the cost model). Its episodes hold
their slots through their tool calls; `multiturn_slow_release` lets a slice hold
4 x 256 episodes (`episodes_per_slice`, `rollout.max_episodes_per_slice`): an
episode at its environment gives up its slot, its KV kept on device (or on host,
`episode_kv`, `rollout.episode_kv`), and re-enters a free slot when its observation
arrived (release.py). `multiturn_slow_lora` is `multiturn_slow_release` with
paper128_lora's adapters: every mode trains and publishes adapters, and a dora slice
holds K + 1 = 4 versions, so an episode's version stays resident beside newer ones
while it waits on its tools; the KV of episodes at their tools waits on host (1024
episodes a slice overflow its device KV).

Every `device_presets/*.json` (a report's preset, fitted by `sim/device_fit.py` to
our engine's figures on one device) is loaded into PRESETS too, by its name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from dora_jax.sim.cost import CostModel, Efficiency, Workload, lora_adapter_params
from dora_jax.sim.episodes import Turns

H800 = dict(flops=989e12, hbm_bytes_per_s=3.35e12, hbm_bytes=80e9, link_bytes_per_s=50e9,
            slice_link_bytes_per_s=400e9, host_bytes_per_s=50e9)
V5P = dict(flops=459e12, hbm_bytes_per_s=2.76e12, hbm_bytes=95e9, link_bytes_per_s=100e9,
           slice_link_bytes_per_s=600e9, host_bytes_per_s=25e9)
# Hardware fields a loaded preset may leave out (0: no host copies).
_HARDWARE_OPTIONAL = ("host_bytes_per_s",)
QWEN25_32B = dict(params=32.5e9, kv_bytes_per_token=64 * 2 * 8 * 128 * 2, layers=64,
                  hidden=5120)
# Qwen2.5-32B's projections (40 query heads and 8 KV heads of dim 128, MLP 27,648)
# for LoRA's shape arithmetic.
QWEN25_32B_SHAPE = dict(layers=64, d_model=5120, q_dim=40 * 128, kv_dim=8 * 128, ffn=27648)
# paper128_lora: rank 32 on every projection (model/lora.py's default targets),
# float32 adapters (model.lora.dtype's default): 268M parameters, 1.07 GB per version
# against 65 GB of bf16 base weights (1.6%).
LORA_RANK = 32
QWEN25_32B_LORA = lora_adapter_params(**QWEN25_32B_SHAPE, rank=LORA_RANK)
QWEN3_30B_A3B = dict(params=30.5e9, active_params=3.3e9, kv_bytes_per_token=48 * 2 * 4 * 128 * 2,
                     layers=48, hidden=2048,
                     # its recorded routing: 48 MoE layers x top-8 ids of one byte
                     routing_bytes_per_token=48 * 8)

# Fitted by `python -m dora_jax.sim.fit --steps=20` on the paper's colocated sync (64
# and 128 GPUs) and one-step-off (64): 25.28 / 18.25 / 23.93 min against 22.91 /
# 20.23 / 22.94, worst error 10%. Decode reaches half the HBM bandwidth and pays
# 15 ms of host overhead per step: a lone 30K-token stream then costs 22.6 ms a
# token, and the paper's sync rollout (65% of 22.91 min for responses up to 30,720
# tokens) needs at least 29 ms for a 30K response started at once. Training at
# 28% MFU over six forward passes per token (forward, backward, remat, proximal and
# reference log-probs) takes 8.0 min per batch on 64 GPUs, the paper's 35% of 22.91.
H800_FIT = Efficiency(hbm=0.5, step_overhead=0.015, mfu_train=0.282)

# The paper's figures (the DORA paper, arXiv 2604.26256, cited in the README): step
# minutes and rollout-only share per run. The paper's sync is colocated (our
# `colocated_sync` run: mode sync on the colocated layout) and its partial rollout
# round-synchronous (sim/fit.py): their figures stand beside those runs.
PAPER_64 = {"dora": (14.67, 0.12), "colocated_sync": (22.91, 0.65),
            "one_step_off": (22.94, 0.33), "partial_rollout_rounds": (17.38, 0.46)}
PAPER_128 = {"dora": (10.46, None), "colocated_sync": (20.23, None),
             "partial_rollout_rounds": (13.95, None)}


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
    efficiency: Efficiency = Efficiency()
    # V: versions a dora slice holds at once (the other modes hold one by definition).
    versions_per_slice: int = 1
    # LoRA: parameters of one adapter set (0: full fine-tuning), bytes per parameter.
    adapter_params: float = 0.0
    adapter_param_bytes: int = 4
    # Multi-turn episodes a slice holds at once (rollout.max_episodes_per_slice): 0,
    # one per slot, each keeping its slot through its environment calls; more, an
    # episode at its environment gives up its slot (release.py), its KV kept on
    # "device" or copied to "host" and back (rollout.episode_kv).
    episodes_per_slice: int = 0
    episode_kv: str = "device"
    paper: dict = dataclasses.field(default_factory=dict)
    provenance: dict = dataclasses.field(default_factory=dict)  # where a loaded one came from

    @property
    def num_slices(self) -> int:
        return (self.total_devices - self.trainer_devices) // self.slice_devices

    @property
    def colocated_slices(self) -> int:
        return self.total_devices // self.slice_devices

    def cost(self, colocated: bool = False, versions: int | None = None) -> CostModel:
        """The cost model of this deployment with `versions` per slice (default
        `versions_per_slice`); ValueError naming rollout.versions_per_slice if their
        weights leave a slice's KV memory short of one longest response."""
        model = dict(self.model)
        active = model.pop("active_params", model["params"])
        versions = self.versions_per_slice if versions is None else versions
        cost = CostModel.from_hardware(**model, slice_devices=self.slice_devices,
                                       trainer_devices=self.trainer_devices, **self.hardware,
                                       active_params=active, efficiency=self.efficiency,
                                       adapter_params=self.adapter_params,
                                       adapter_param_bytes=self.adapter_param_bytes,
                                       versions=versions)
        need = self.workload.prompt_len + self.workload.max_len
        if versions > 1 and cost.kv_tokens < need:
            raise ValueError(f"rollout.versions_per_slice: {versions} versions leave "
                             f"{cost.kv_tokens} KV positions per slice, less than one "
                             f"longest response ({need})")
        if colocated:
            cost = cost.scaled_trainer(self.total_devices / self.trainer_devices)
            # Between training and rollout the weights change layout on the same
            # devices, and the optimizer state makes room for the KV cache: a
            # transfer of the weights at HBM speed and one over the links (with
            # LoRA, of the adapters: the frozen base is kept in both layouts).
            cost = dataclasses.replace(cost, reshard=cost.load_seconds(1))
        return cost

    def check_episodes(self) -> None:
        """ValueError naming the field if `episodes_per_slice` / `episode_kv` do not
        fit this preset (as the run config refuses them)."""
        e = self.episodes_per_slice
        if e and self.workload.turns is None:
            raise ValueError(f"episodes_per_slice {e} needs multi-turn episodes (a "
                             f"workload with turns); leave it 0")
        if 0 < e < self.slots_per_slice:
            raise ValueError(f"episodes_per_slice {e} < slots_per_slice "
                             f"{self.slots_per_slice} (0: one per slot)")
        if self.episode_kv not in ("device", "host"):
            raise ValueError(f"episode_kv must be 'device' or 'host', got {self.episode_kv!r}")
        if self.episode_kv == "host" and not e:
            raise ValueError("episode_kv 'host' needs episodes_per_slice > 0 (a held "
                             "slot keeps its episode's KV)")
        if self.episode_kv == "host" and not self.hardware.get("host_bytes_per_s"):
            raise ValueError("episode_kv 'host' needs the hardware's host_bytes_per_s")

    def step_time_bound(self, cost: CostModel | None = None, groups: int = 4096) -> dict:
        """Seconds per train step that no policy can beat at this split: the largest
        of three floors.

        - train: the trainer's time for one batch (prompt + response tokens).
        - rollout: TBS x G responses decoded at full slots. A full slice holds B
          sequences whose context, averaged over the tokens it decodes, is
          P / G + (E[L^2]/E[L] - 1)/2: a sample of length L spends one step at each
          of its positions, and a group's prompt is stored once per slice, as the
          simulator stores it (at best all G samples share it). B is cut to what the
          KV memory holds. Prefill is left out.
        - latency: the longest response (L_max tokens) is decoded one token per step,
          each step at least a lone sequence's (tau_1, at its mean context), within
          K train steps: a group of version v starts once v is published (the end
          of step v - 1) and step v + K must train it. So a step lasts at least
          L_max x tau_1 / K; with K = 0 the batch's rollout and training run in turn,
          L_max x tau_1 + train.

        Lengths are the workload's over `groups` groups; `cost` defaults to the
        preset's. For multi-turn episodes the lengths are the decoded (model) tokens,
        the trainer's tokens include the observations, and the environments' waits
        and the observations' prefills are left out (the floors stay floors)."""
        episode = self.workload.episodes(self.group_size)
        episodes = [episode(g, k) for g in range(groups) for k in range(self.group_size)]
        lengths = [sum(e.model) for e in episodes]
        mean = sum(lengths) / len(lengths)
        prompt = self.workload.prompt_len
        context = prompt / self.group_size + (sum(x * x for x in lengths) / sum(lengths) - 1) / 2
        cost = cost or self.cost()
        batch = max(1, min(self.slots_per_slice, int(cost.kv_tokens // context)))
        step = (cost.step_seconds(batch, batch * context)
                + cost.calls_seconds(cost.call_steps, True) / cost.call_steps)
        responses = self.train_batch_size * self.group_size
        rollout = responses * mean / (self.num_slices * batch / step)
        trained = sum(e.response_len for e in episodes) / len(episodes)
        train = cost.train_seconds(round(responses * (trained + prompt)))
        longest = max(lengths)
        tau = cost.step_seconds(1, prompt + (longest - 1) / 2) + cost.calls_seconds(1, False)
        k = self.max_staleness
        latency = longest * tau / k if k else longest * tau + train
        return dict(step=max(train, rollout, latency), train=train, rollout=rollout,
                    latency=latency)


MULTITURN = Workload(prompt_len=512, mean_len=400, max_len=8192,
                     turns=Turns(mean_turns=4.0, max_turns=32, obs_mean=300, max_obs=4096,
                                 env_median=0.1, env_sigma=0.8, max_env=2.0,
                                 max_response=30_720))

# Slow tools: the environment's median latency over five model turns (the
# module docstring), heavy-tailed.
MULTITURN_SLOW = dataclasses.replace(
    MULTITURN, turns=Turns(mean_turns=4.0, max_turns=32, obs_mean=300, max_obs=4096,
                           env_median=80.0, env_sigma=1.0, max_env=600.0,
                           max_response=30_720))

PRESETS = {
    "paper64": Preset(
        "paper64", "Qwen2.5-32B on 64 H800",
        total_devices=64, trainer_devices=32, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, efficiency=H800_FIT, paper=PAPER_64),
    "paper128": Preset(
        "paper128", "Qwen2.5-32B on 128 H800",
        total_devices=128, trainer_devices=64, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, efficiency=H800_FIT, paper=PAPER_128),
    "paper128_lora": Preset(
        "paper128_lora", f"Qwen2.5-32B with LoRA rank {LORA_RANK} on 128 H800, "
        "K + 1 adapter versions per slice",
        total_devices=128, trainer_devices=64, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, efficiency=H800_FIT, versions_per_slice=4,
        adapter_params=QWEN25_32B_LORA),
    "v5p": Preset(
        "v5p", "Qwen3-30B-A3B (configs/moe.py) on a v5p pod",
        total_devices=256, trainer_devices=128, slice_devices=16, slots_per_slice=256,
        hardware=V5P, model=QWEN3_30B_A3B, efficiency=H800_FIT),
    "multiturn": Preset(
        "multiturn", "Qwen2.5-32B on 64 H800, multi-turn agentic episodes",
        total_devices=64, trainer_devices=32, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, workload=MULTITURN, efficiency=H800_FIT),
    "multiturn_slow": Preset(
        "multiturn_slow", "Qwen2.5-32B on 64 H800, multi-turn episodes with slow tools, "
        "slots held through tool calls",
        total_devices=64, trainer_devices=32, slice_devices=8, slots_per_slice=256,
        hardware=H800, model=QWEN25_32B, workload=MULTITURN_SLOW, efficiency=H800_FIT),
}
PRESETS["multiturn_slow_release"] = dataclasses.replace(
    PRESETS["multiturn_slow"], name="multiturn_slow_release",
    description="Qwen2.5-32B on 64 H800, multi-turn episodes with slow tools, 4 x 256 "
    "episodes a slice (slots released during tool calls)", episodes_per_slice=4 * 256)

PRESETS["multiturn_slow_lora"] = dataclasses.replace(
    PRESETS["multiturn_slow_release"], name="multiturn_slow_lora",
    description=f"Qwen2.5-32B with LoRA rank {LORA_RANK} on 64 H800, multi-turn episodes "
    "with slow tools, 4 x 256 episodes a slice, K + 1 adapter versions per slice",
    versions_per_slice=4, adapter_params=QWEN25_32B_LORA, episode_kv="host")

DEVICE_PRESETS_DIR = pathlib.Path(__file__).parent / "device_presets"
_MODEL_REQUIRED = ("params", "kv_bytes_per_token", "layers", "hidden")
_MODEL_OPTIONAL = ("active_params", "param_bytes", "routing_bytes_per_token")
_INTS = ("total_devices", "trainer_devices", "slice_devices", "slots_per_slice", "group_size",
         "train_batch_size", "rollout_batch_size", "max_staleness", "versions_per_slice",
         "adapter_param_bytes", "episodes_per_slice")
_MAY_BE_ZERO = ("step_overhead", "collective_latency", "train_fixed", "max_staleness",
                "routing_bytes_per_token",
                "adapter_params", "episodes_per_slice")


def preset_from_dict(d: dict, source: str = "preset") -> Preset:
    """A Preset from its JSON form (`device_fit.device_preset`); ValueError naming
    `source` and the field when one is missing, unknown or of the wrong kind, so that
    a bad file fails where it is loaded and not mid-simulation."""
    def bad(field, why):
        raise ValueError(f"{source}: field {field!r} {why}")

    def number(field, v, positive=True):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            bad(field, f"must be a finite number, got {v!r}")
        if v < 0 or (positive and v == 0 and field.split(".")[-1] not in _MAY_BE_ZERO):
            bad(field, f"must be positive, got {v!r}")
        return v

    def table(field, value, required, optional=()):
        if not isinstance(value, dict):
            bad(field, f"must be an object, got {value!r}")
        for k in value:
            if k not in required + optional:
                bad(f"{field}.{k}", "is unknown")
        for k in required:
            if k not in value:
                bad(f"{field}.{k}", "is missing")
        return {k: number(f"{field}.{k}", v) for k, v in value.items()}

    if not isinstance(d, dict):
        raise ValueError(f"{source}: a preset must be a JSON object")
    known = {f.name for f in dataclasses.fields(Preset)}
    for k in d:
        if k not in known:
            bad(k, "is not a Preset field")
    kw = dict(d)
    for k in ("name", "description", "total_devices", "trainer_devices", "slice_devices",
              "slots_per_slice", "hardware", "model"):
        if k not in kw:
            bad(k, "is missing")
    for k in ("name", "description"):
        if not isinstance(kw[k], str) or not kw[k]:
            bad(k, f"must be a non-empty string, got {kw[k]!r}")
    for k in _INTS:
        if k in kw and (not isinstance(kw[k], int) or isinstance(kw[k], bool)):
            bad(k, f"must be an integer, got {kw[k]!r}")
        if k in kw:
            number(k, kw[k])
    if "adapter_params" in kw:
        number("adapter_params", kw["adapter_params"])
    required = tuple(k for k in H800 if k not in _HARDWARE_OPTIONAL)
    kw["hardware"] = table("hardware", kw["hardware"], required, _HARDWARE_OPTIONAL)
    kw["model"] = table("model", kw["model"], _MODEL_REQUIRED, _MODEL_OPTIONAL)
    if "efficiency" in kw:
        fields = tuple(f.name for f in dataclasses.fields(Efficiency))
        kw["efficiency"] = Efficiency(**table("efficiency", kw["efficiency"], (), fields))
    if "workload" in kw:
        try:
            work = dict(kw["workload"])
            if work.get("turns") is not None:
                work["turns"] = Turns(**work["turns"])
            work["replay"] = tuple(work.get("replay", ()))
            kw["workload"] = Workload(**work)
        except (TypeError, ValueError) as e:
            bad("workload", f"is not a Workload: {e}")
    paper = kw.get("paper", {})
    if not isinstance(paper, dict) or not all(isinstance(v, list) for v in paper.values()):
        bad("paper", f"must map modes to [minutes, share], got {paper!r}")
    kw["paper"] = {mode: tuple(v) for mode, v in paper.items()}
    rollout = kw["total_devices"] - kw["trainer_devices"]
    if rollout <= 0 or rollout % kw["slice_devices"]:
        bad("trainer_devices", f"must leave whole slices of {kw['slice_devices']} devices "
            f"of the {kw['total_devices']}, got {kw['trainer_devices']}")
    preset = Preset(**kw)
    try:
        preset.check_episodes()
    except ValueError as e:
        bad("episodes_per_slice", str(e))
    return preset


def load_device_presets(directory=DEVICE_PRESETS_DIR, reserved=()) -> dict:
    """{name: Preset} of every *.json in `directory` (none when it is absent);
    ValueError naming the file for a bad one or a name already taken."""
    out = {}
    for path in sorted(pathlib.Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        preset = preset_from_dict(data, str(path))
        if preset.name in reserved or preset.name in out:
            raise ValueError(f"{path}: field 'name' {preset.name!r} is already a preset")
        out[preset.name] = preset
    return out


PRESETS.update(load_device_presets(reserved=PRESETS))
