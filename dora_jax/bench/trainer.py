"""Train-step throughput: `Trainer.train_step` vs a minimal plain optax loop.

Both run the same model, the same batch and the same objective (GRPO advantages, PPO
clip against behaviour log-probs, token-mean) with the same AdamW + clipping, one
optimizer update per step. The plain loop is `jax.jit` + optax with no sharding
annotations, no metrics and no micro-batch machinery, on one device. The trainer runs
on the config's trainer mesh (`--mesh=config`) or on a one-device mesh
(`--mesh=single`, which isolates the cost of the trainer's machinery); `--mesh=both`
runs both. Rounds alternate between the contenders so that load from other
processes hits them alike; the median round is reported.

  python -m dora_jax.bench.trainer [--config=configs/tiny.py[:variant]] [--mesh=both]

`--lengths=long_tail` instead trains the same long-tailed batches (response lengths
drawn as configs/longtail.py's countdown task draws them: lognormal, median 12,
sigma 1.1, up to 255 tokens) padded (one row per sample, the batch's length bucket)
and packed (rl/packing.py, `trainer.tokens_per_microbatch`), on the config's trainer
mesh, interleaved and repeated, and ends with

  packed/padded real tokens/s: X
  packed/padded peak memory: Y

(real tokens: prompt + response, no padding; peak memory: the largest working set
XLA assigns the step program over the shapes the batches took, params and optimizer
state excluded, which both layouts hold alike).

  python -m dora_jax.bench.trainer --config=configs/longtail.py --lengths=long_tail
  python -m dora_jax.bench.trainer --config=configs/longtail.py --lengths=long_tail \
      --config.model.d_model=256 --config.model.num_heads=4 --config.model.head_dim=64

`--moe_routing` (an MoE config) trains the same batches, each response token with
recorded experts, with `trainer.moe_routing=replay` and `=recompute`, interleaved,
and ends with `replay/recompute step time: X` and the routing's bytes per token.

  python -m dora_jax.bench.trainer --config=configs/moe.py:tiny --moe_routing
"""

from __future__ import annotations

import os

# On a CPU host, fake the devices the configs' meshes expect (no effect elsewhere).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from absl import app, flags
from jax.sharding import Mesh
from ml_collections import config_flags

from dora_jax import config as config_lib
from dora_jax.bench import CONFIGS, model_shape, write_figures
from dora_jax.model import hf_checks, transformer
from dora_jax.rl import losses
from dora_jax.rl.batch import TrainBatch
from dora_jax.rl.objective import advantages
from dora_jax.rl.optimizer import make_optimizer
from dora_jax.rl.trainer import Trainer
from dora_jax.rollout.routing import routing_dtype

_CONFIG = config_flags.DEFINE_config_file("config", str(CONFIGS / "tiny.py"), "config file")
_MESH = flags.DEFINE_enum("mesh", "both", ["config", "single", "both"],
                          "trainer mesh: the config's, one device, or both")
_GROUPS = flags.DEFINE_integer("groups", 8, "groups per batch")
_GROUP_SIZE = flags.DEFINE_integer("group_size", 8, "samples per group")
_STEPS = flags.DEFINE_integer("steps", 5, "steps per round")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "interleaved rounds (median reported)")
_LENGTHS = flags.DEFINE_enum("lengths", "synthetic", ["synthetic", "long_tail"],
                             "synthetic: trainer vs plain optax on one batch; long_tail: "
                             "packed vs padded on long-tailed batches")
_JSON_OUT = flags.DEFINE_string("json_out", "", "also write the figures to this JSON file")
_MOE_ROUTING = flags.DEFINE_bool("moe_routing", False, "MoE: trainer.moe_routing replay vs "
                                 "recompute on the same batches with recorded routing")


def _batch(cfg: config_lib.Config, num_groups: int, group_size: int, rng, prompt_len: int,
           response_len, routing=None) -> TrainBatch:
    """Random tokens; each group shares a `prompt_len`-token prompt; `response_len(P)`
    draws a response length after a prompt of P tokens; `routing` (MoE layers, k,
    experts): random recorded experts per response token."""
    V = cfg.model.vocab_size
    trajs = []
    for g in range(num_groups):
        prompt = rng.integers(2, V, prompt_len).tolist()
        for _ in range(group_size):
            n = response_len(len(prompt))
            logp = np.minimum(np.log(1.0 / V) + 0.3 * rng.standard_normal(n), 0.0)
            trajs.append(dict(prompt_tokens=prompt, response_tokens=rng.integers(2, V, n),
                              behaviour_logprobs=logp, reward=float(rng.random()),
                              group_id=g, version=0))
            if routing is not None:
                layers, k, experts = routing
                ids = rng.random((n, layers, experts)).argsort(-1)[..., :k]
                trajs[-1]["routing"] = ids.astype(routing_dtype(experts))
    return TrainBatch.from_trajectories(trajs, group_size=group_size,
                                        length_buckets=cfg.trainer.length_buckets)


def synthetic_batch(cfg: config_lib.Config, num_groups: int, group_size: int, seed: int = 0):
    """Random prompts/responses filling most of the largest bucket."""
    rng, T = np.random.default_rng(seed), cfg.trainer.length_buckets[-1]
    return _batch(cfg, num_groups, group_size, rng, max(1, T // 4),
                  lambda P: int(rng.integers(T // 2, T - P + 1)))


def long_tail_batch(cfg: config_lib.Config, num_groups: int, group_size: int, seed: int):
    """A batch whose response lengths follow configs/longtail.py's counts (lognormal,
    median 12, sigma 1.1, clipped to [1, 255]) + 1 for EOS, after a 2-token prompt;
    capped to what the config's longest bucket holds."""
    rng, T = np.random.default_rng(seed), cfg.trainer.length_buckets[-1]

    def length(P):
        count = int(np.clip(np.rint(rng.lognormal(np.log(12.0), 1.1)), 1, 255))
        return min(count + 1, T - P)

    return _batch(cfg, num_groups, group_size, rng, 2, length)


def step_working_set(tr: Trainer, batch: TrainBatch) -> int:
    """Bytes of temporaries XLA assigns the train step program for this batch's
    layout (activations, gradients, the optimizer's intermediates)."""
    arrays = tr._device_batch(batch, tr.cfg.trainer.num_minibatches)
    compiled = tr._step_jit.lower(tr.state, arrays, tr.ref_params, batch.group_size).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def packed_vs_padded(cfg: config_lib.Config, rounds: int, steps: int) -> None:
    """The long_tail comparison (module docstring)."""
    t = cfg.trainer
    T, groups, G = t.length_buckets[-1], _GROUPS.value, _GROUP_SIZE.value
    tokens_per_micro = t.tokens_per_microbatch or 8 * T
    cfgs = {"padded": dataclasses.replace(cfg, trainer=dataclasses.replace(
                t, tokens_per_microbatch=0, micro_batches=1)),
            "packed": dataclasses.replace(cfg, trainer=dataclasses.replace(
                t, tokens_per_microbatch=tokens_per_micro, micro_batches=1))}
    batches = [long_tail_batch(cfg, groups, G, seed) for seed in range(steps)]
    real = sum(int(b.seq_lens_B.sum()) for b in batches)
    resp = np.concatenate([b.loss_mask_BT.sum(1) for b in batches])
    print(f"backend={jax.default_backend()} devices={len(jax.devices())} "
          f"d_model={cfg.model.d_model} layers={cfg.model.num_layers}: {steps} batches of "
          f"B={groups * G}, responses mean {resp.mean():.1f} max {int(resp.max())} tokens "
          f"(max/mean {resp.max() / resp.mean():.1f}); padded T per batch "
          f"{sorted({b.length for b in batches})}; packed rows as long as the bucket, "
          f"{tokens_per_micro} tokens per micro-batch")
    graphdef, params0 = transformer.create(cfg.model, cfg.seed)
    host_params = jax.device_get(params0)
    trainers = {name: Trainer(c, params=jax.device_put(host_params), graphdef=graphdef)
                for name, c in cfgs.items()}
    memory = {name: max(step_working_set(tr, b) for b in batches)
              for name, tr in trainers.items()}

    def run(tr):
        for b in batches:
            out = tr.train_step(b)
        jax.block_until_ready((out, tr.params))

    for name, tr in trainers.items():  # compile every shape, then warm
        t0 = time.perf_counter()
        run(tr)
        print(f"  {name}: first pass (compiles) {time.perf_counter() - t0:.1f}s")
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            run(tr)
            times[name].append(time.perf_counter() - t0)
    rate = {name: real / statistics.median(ts) for name, ts in times.items()}
    for name in trainers:
        print(f"{name:>8s}: {rate[name]:12,.0f} real tokens/s (median of {rounds} rounds x "
              f"{steps} steps; rounds {', '.join(f'{real / x:,.0f}' for x in times[name])}), "
              f"step working set {memory[name] / 2**20:.1f} MiB")
    print(f"packed/padded real tokens/s: {rate['packed'] / rate['padded']:.2f}")
    print(f"packed/padded peak memory: {memory['packed'] / memory['padded']:.2f}")


def replay_vs_recompute(cfg: config_lib.Config, rounds: int, steps: int) -> None:
    """The --moe_routing comparison: the same batches with recorded routing trained
    with replay and with recompute, interleaved rounds, on the config's trainer mesh."""
    m = cfg.model.moe
    if not m.enabled:
        raise SystemExit("error: --moe_routing needs an MoE config (model.moe.num_experts > 0)")
    layers = cfg.model.num_moe_layers
    rng, T = np.random.default_rng(0), cfg.trainer.length_buckets[-1]
    batches = [_batch(cfg, _GROUPS.value, _GROUP_SIZE.value, rng, max(1, T // 4),
                      lambda P: int(rng.integers(T // 2, T - P + 1)),
                      routing=(layers, m.top_k, m.num_experts)) for _ in range(steps)]
    tokens = sum(int(b.seq_lens_B.sum()) for b in batches)
    per_token = layers * m.top_k * np.dtype(routing_dtype(m.num_experts)).itemsize
    print(f"backend={jax.default_backend()} devices={len(jax.devices())} "
          f"d_model={cfg.model.d_model} layers={cfg.model.num_layers} ({layers} MoE, "
          f"top-{m.top_k} of {m.num_experts}): {steps} batches of B={batches[0].batch_size}; "
          f"routing {per_token} bytes per token ({layers} layers x {m.top_k} ids)")
    graphdef, params0 = transformer.create(cfg.model, cfg.seed)
    host_params = jax.device_get(params0)
    # The config's trainer mesh where it fits, else one device (an accelerator host).
    shape = tuple(cfg.mesh.trainer[a] for a in config_lib.TRAINER_MESH_AXES)
    shape = shape if np.prod(shape) <= len(jax.devices()) else (1, 1, 1, 1)
    mesh = Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape),
                config_lib.TRAINER_MESH_AXES)
    print(f"trainer mesh {'x'.join(map(str, shape))}")
    trainers = {name: Trainer(dataclasses.replace(cfg, trainer=dataclasses.replace(
                    cfg.trainer, moe_routing=name)), mesh, params=jax.device_put(host_params),
                    graphdef=graphdef) for name in ("recompute", "replay")}

    def run(tr):
        for b in batches:
            out = tr.train_step(b)
        jax.block_until_ready((out, tr.params))

    for tr in trainers.values():  # compile, then warm
        run(tr)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, tr in trainers.items():
            t0 = time.perf_counter()
            run(tr)
            times[name].append((time.perf_counter() - t0) / steps)
    for name, ts in times.items():
        print(f"{name:>10s}: {statistics.median(ts) * 1e3:8.1f} ms/step, "
              f"{tokens / steps / statistics.median(ts):10,.0f} tokens/s (median of {rounds} "
              f"rounds x {steps} steps; rounds {', '.join(f'{x * 1e3:.1f}' for x in ts)} ms)")
    print(f"replay/recompute step time: "
          f"{statistics.median(times['replay']) / statistics.median(times['recompute']):.3f}")


def _runner(tr: Trainer, batch: TrainBatch) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(one train step of `tr`, its params)."""
    return (lambda: tr.train_step(batch)), (lambda: tr.params)


def plain_optax_step(cfg: config_lib.Config, graphdef, group_size: int):
    """The reference loop's step: jit + optax, nothing else."""
    t = cfg.trainer
    tx = make_optimizer(t)

    def loss_fn(params, tokens, mask, behav, rewards):
        logits = transformer.apply(graphdef, params, tokens)[0]
        logp = transformer.token_logprobs(logits, tokens, cfg.rollout.temperature)
        adv = advantages(rewards, group_size, t.advantage)
        loss_BT, _ = losses.ppo_clip_loss(logp, behav, adv, mask, clip_low=t.clip_low,
                                          clip_high=t.clip_high, dual_clip=t.dual_clip)
        return losses.aggregate_loss(loss_BT, mask, t.loss_agg_mode)

    def step(params, opt_state, tokens, mask, behav, rewards):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, mask, behav, rewards)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return tx, jax.jit(step, donate_argnums=(0, 1))


def main(argv):
    del argv
    mesh_choice, steps, rounds = _MESH.value, _STEPS.value, _ROUNDS.value
    # Not held to the devices there are: the benchmark builds its own meshes, the
    # config's trainer mesh only where it fits.
    cfg = hf_checks.validated(_CONFIG.value)
    if _LENGTHS.value == "long_tail":
        return packed_vs_padded(cfg, rounds, steps)
    if _MOE_ROUTING.value:
        return replay_vs_recompute(cfg, rounds, steps)
    # One optimizer update per step on both sides; no optional terms the plain loop lacks.
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
        cfg.trainer, micro_batches=1, num_minibatches=1, kl_coef=0.0,
        objective="behaviour_clip", is_cap=None))
    batch = synthetic_batch(cfg, _GROUPS.value, _GROUP_SIZE.value)
    tokens_per_step = int(batch.seq_lens_B.sum())
    print(f"backend={jax.default_backend()} devices={len(jax.devices())} "
          f"batch B={batch.batch_size} T={batch.length} tokens/step={tokens_per_step} "
          f"params={transformer.count_params(transformer.abstract_params(cfg.model)[1]):,}")

    graphdef, params0 = transformer.create(cfg.model, cfg.seed)
    host_params = jax.device_get(params0)
    # name -> (one step, the params it leaves)
    runners: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {}
    def mesh_of(shape):
        devices = jax.devices()[:int(np.prod(shape))]
        return Mesh(np.array(devices).reshape(shape), config_lib.TRAINER_MESH_AXES)

    meshes = {"single": mesh_of((1, 1, 1, 1))}
    trainer_shape = tuple(cfg.mesh.trainer[a] for a in config_lib.TRAINER_MESH_AXES)
    if np.prod(trainer_shape) <= len(jax.devices()):
        meshes["config"] = mesh_of(trainer_shape)
    elif mesh_choice != "single":
        print(f"only {len(jax.devices())} devices: the config's trainer mesh "
              f"{trainer_shape} does not fit; running the one-device mesh only")
        mesh_choice = "single"
    for name in (("config", "single") if mesh_choice == "both" else (mesh_choice,)):
        tr = Trainer(cfg, meshes[name], params=jax.device_put(host_params), graphdef=graphdef)
        shape = "x".join(str(v) for v in meshes[name].shape.values())
        runners[f"trainer[{name} mesh {shape}]"] = _runner(tr, batch)

    tx, step = plain_optax_step(cfg, graphdef, batch.group_size)
    plain = {"params": jax.device_put(host_params)}
    plain["opt"] = tx.init(plain["params"])
    arrays = (batch.tokens_BT, batch.loss_mask_BT, batch.behaviour_logp_BT, batch.rewards_B)

    def plain_step():
        plain["params"], plain["opt"], loss = step(plain["params"], plain["opt"], *arrays)
        return loss

    runners["plain optax"] = (plain_step, lambda: plain["params"])

    for name, (run, result) in runners.items():  # compile + warm up
        t0 = time.perf_counter()
        jax.block_until_ready((run(), result()))
        print(f"  {name}: first step (compile) {time.perf_counter() - t0:.1f}s")
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, (run, result) in runners.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                out = run()
            jax.block_until_ready((out, result()))
            times[name].append((time.perf_counter() - t0) / steps)
    rates = {name: tokens_per_step / statistics.median(ts) for name, ts in times.items()}
    for name, rate in rates.items():
        print(f"{name:>40s}: {rate:12,.0f} tokens/s  ({statistics.median(times[name]) * 1e3:.1f} "
              f"ms/step, median of {rounds} rounds x {steps} steps)")
    plain_rate = rates.pop("plain optax")
    for name, rate in rates.items():
        print(f"{name} / plain-optax: {rate / plain_rate:.2f}")
    headline = next(iter(rates.values()))  # the sharded (config-mesh) trainer when run
    print(f"trainer/plain-optax tokens/s ratio: {headline / plain_rate:.2f}")
    device = jax.devices()[0]
    write_figures(_JSON_OUT.value, dict(
        platform=device.platform, device_kind=device.device_kind,
        **model_shape(cfg.model, host_params), tokens_per_step=tokens_per_step,
        batch_rows=batch.batch_size, batch_length=batch.length,
        # forward-pass equivalents per trained token: forward 1, backward 2, and a
        # recomputed forward under remat (this step computes no other log-probs)
        train_passes=3.0 + (cfg.model.remat != "none"),
        step_seconds={name: statistics.median(ts) for name, ts in times.items()},
        tokens_per_s=dict(rates, **{"plain optax": plain_rate}),
        ratio=headline / plain_rate))


if __name__ == "__main__":
    app.run(main)
