"""The peer's side of `bench.peer --workload=tiny`: tunix's GRPOLearner on the same
workload, for the comparison in docs/benchmarks.md.

    pip install google-tunix==0.1.7   # beside dora_jax: both run on jax 0.10.2
    python -m dora_jax.bench.peer_tunix --steps=100 [--warmup=5] [--nostop]

The workload is configs/tiny.py's: its policy's shape (tunix's Qwen3 at vocab 128,
d_model 64, 2 layers, 4 query / 2 KV heads of dim 16, MLP 192, untied), its residue
prompts and reward (dora_jax.tasks.residue, rewards.tokens), its optimizer
(`rl.optimizer.make_optimizer`), its group size and groups per step, at most 16
response tokens, temperature 1, token-mean loss, no KL; one device. What tunix needs
to run it: `top_p=1.0` (with `top_p=None` its sampler is greedy, a group's samples
are equal and every gradient is zero), a new `rollout_config.seed` every step (else
every step samples with the same key), and the weights redrawn as model/layers.py
draws ours (tunix's own init leaves the MLP kernels at zero: they never train).
Prompts are 6 tokens, so its KV cache (8 + 16) is as long as ours. `--nostop`: an
eos id outside the vocabulary, every response runs to the limit.

Ends with `response tokens/s: X (tunix, tiny, N steps)`, generated tokens (EOS
included, as our `response_len` counts them) over the steps after `--warmup`.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from dora_jax import config as config_lib
from dora_jax.bench.peer import PROMPT_BUCKET, WORKLOADS
from dora_jax.rewards.tokens import BOS, EOS, PAD, residue_reward
from dora_jax.tasks.residue import residue_prompts

_STEPS = flags.DEFINE_integer("steps", 100, "train steps")
_WARMUP = flags.DEFINE_integer("warmup", 5, "steps before the steady state")
_STOP = flags.DEFINE_bool("stop", True, "--nostop: every response runs to the limit")


class IdTokenizer:
    """tunix speaks text: token i is the word `t<i>`."""

    def __init__(self, eos: int):
        self._eos = eos

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids, **kwargs) -> str:
        return " ".join(f"t{int(i)}" for i in ids)

    def bos_id(self) -> int:
        return BOS

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return PAD


def redraw_as_ours(policy, seed: int) -> None:
    """Every matrix normal(0, 1/sqrt(fan_in)) (o_proj: of heads x head_dim), the untied
    input embedding normal(0, 1), norm scales left at 1: model/layers.py's init."""
    import jax
    from flax import nnx

    key = jax.random.PRNGKey(seed)
    for path, var in nnx.to_flat_state(nnx.state(policy, nnx.Param)):
        shape = var[...].shape
        if len(shape) < 2:
            continue
        name = "/".join(map(str, path))
        std = (1.0 if "input_embedding" in name else
               (shape[0] * shape[1]) ** -0.5 if "o_proj" in name else shape[0] ** -0.5)
        key, sub = jax.random.split(key)
        var[...] = std * jax.random.normal(sub, shape, var[...].dtype)


def main(argv) -> None:
    del argv
    try:
        import jax
        from flax import nnx
        from tunix.models.qwen3 import model as qwen3
        from tunix.rl import rl_cluster as rl
        from tunix.rl.grpo import grpo_learner
        from tunix.rl.rollout import base_rollout
    except ImportError as e:
        raise SystemExit(f"error: {e.name}: not installed (pip install google-tunix==0.1.7)")

    from dora_jax.rl.optimizer import make_optimizer

    steps, warmup = _STEPS.value, _WARMUP.value
    if not 0 < warmup < steps - 1:
        raise SystemExit(f"error: --warmup={warmup} must leave 2 steps of --steps={steps}")
    cfg = config_lib.validate(config_lib.load("tiny"))
    m, d = cfg.model, cfg.data
    _, groups, group_size, max_len = WORKLOADS["tiny"]
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    policy = qwen3.Qwen3(qwen3.ModelConfig(
        num_layers=m.num_layers, vocab_size=m.vocab_size, embed_dim=m.d_model,
        hidden_dim=m.mlp_hidden, num_heads=m.num_heads, head_dim=m.head_dim,
        num_kv_heads=m.num_kv_heads, rope_theta=int(m.rope_theta), norm_eps=m.norm_eps,
        use_tied_embedding=m.tie_embeddings), rngs=nnx.Rngs(cfg.seed))
    redraw_as_ours(policy, cfg.seed + 1)
    eos = EOS if _STOP.value else m.vocab_size  # past the logits: never sampled
    tokenizer = IdTokenizer(eos)
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=max_len, temperature=1.0, top_p=1.0, top_k=None,
        max_prompt_length=d.prompt_len, kv_cache_size=PROMPT_BUCKET + max_len, eos_tokens=[eos],
        seed=cfg.seed)
    cluster = rl.RLCluster(actor=policy, reference=None, tokenizer=tokenizer,
                           cluster_config=rl.ClusterConfig(
        role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False, rollout_config=rollout_config,
        training_config=rl.RLTrainingConfig(
            actor_optimizer=make_optimizer(cfg.trainer), eval_every_n_steps=10**9,
            max_steps=steps, mini_batch_size=groups, train_micro_batch_size=groups,
            metrics_logging_options=None, checkpoint_root_directory=None,
            pbar_description=None)))
    lengths: list[list[int]] = []  # per step, each sample's
    rewards: list[float] = []  # per step, the mean

    def reward_fn(prompts, completions, target, modulus, **kwargs):
        ids = [tokenizer.encode(text) for text in completions]  # the EOS cut off
        lengths.append([len(x) + (len(x) < max_len) for x in ids])
        scored = [residue_reward({"target": int(t), "modulus": int(k)}, x)
                  for x, t, k in zip(ids, target, modulus)]
        rewards.append(float(np.mean(scored)))
        return scored

    records = residue_prompts(d.num_prompts, m.vocab_size, prompt_len=d.prompt_len,
                              modulus=d.modulus, seed=cfg.seed)
    order = np.random.default_rng(cfg.seed).permutation(len(records))
    started: list[float] = []  # started[k]: when step k asked for its batch

    def batches():
        for k in range(steps):
            started.append(time.perf_counter())
            rollout_config.seed = cfg.seed * 100_003 + k  # tunix reuses one otherwise
            batch = [records[order[(k * groups + i) % len(records)]] for i in range(groups)]
            yield {"prompts": np.array([tokenizer.decode(r["tokens"]) for r in batch]),
                   "target": np.array([r["target"] for r in batch]),
                   "modulus": np.array([r["modulus"] for r in batch])}

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward_fn, algo_config=grpo_learner.GRPOConfig(
            num_generations=group_size, num_iterations=1, beta=0.0, epsilon=0.2,
            loss_agg_mode="token-mean"))
    learner.train(batches())
    jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
    seconds = time.perf_counter() - started[warmup]
    steady = np.concatenate(lengths[warmup:])
    n = len(lengths) - warmup
    print(f"steady state: {n} steps, {seconds / n * 1e3:.1f} ms a step, response length "
          f"mean {steady.mean():.2f}; mean reward of the first 5 steps "
          f"{np.mean(rewards[:5]):.3f}, of the last 5 {np.mean(rewards[-5:]):.3f}")
    print(f"response tokens/s: {steady.sum() / seconds:.0f} (tunix, tiny, {steps} steps)")


if __name__ == "__main__":
    app.run(main)
