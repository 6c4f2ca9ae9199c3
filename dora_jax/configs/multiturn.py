"""Multi-turn, tool-using episodes on a CPU: a small policy learns to call a tool.

SFT:  python -m dora_jax.sft --config=configs/multiturn.py --workdir=/tmp/mt_sft \\
        --steps=70 --batch_size=32 --learning_rate=3e-3
RL:   python -m dora_jax.main --config=configs/multiturn.py --workdir=/tmp/mt \\
        --config.init_checkpoint=/tmp/mt_sft/checkpoints
Modes side by side (every run audited):
      XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m dora_jax.bench.modes \\
        --config=configs/multiturn.py --workdir=/tmp/mt_modes \\
        --modes=sync,one_step_off,partial_rollout,dora_k2 --steps=30 --reps=2 --sft_steps=40

Task (`data.env="calculator"`, dora_jax/envs/arithmetic.py): "37*41+12 = ?" with
two-digit numbers. The model may call `<calc>37*41+12</calc>`; the environment
answers with the exact value (an `ast`-checked calculator, nothing executed) as a
`tool` message; `<answer>1529</answer>` ends the episode with reward 1 if right.
Three model turns at most; an episode's 64 response tokens hold its model turns
and observations. The supervised warm start imitates whole episodes (the
observations carry no loss) and stops early on purpose, so RL has room: the
metrics' `episodes` record gives the environment's reward, the share of episodes
that called the tool (`tool_use`) and that got the right value from it
(`tool_correct`); summary.json compares the first and last fifth of the run.
Expect (measured on a 2-core CPU, colab/multiturn.ipynb): about a minute of
compilation, then ~1 s per step; over 100 steps the episode reward rose from 0.61 to
0.75 and correct tool use from 0.90 to 0.94; `:no_tool` with the same budget: 0.00.

Variants (each warm-started as above, with its own --config):
  python -m dora_jax.main --config=configs/multiturn.py:guess --workdir=/tmp/mt_guess
      dora_jax/envs/guess.py: find a number in 1..16 from "higher" / "lower", six
      turns, 112 tokens
  python -m dora_jax.main --config=configs/multiturn.py:python --workdir=/tmp/mt_py
      the same arithmetic with `<python>print(37*41+12)</python>`, run in
      dora_jax/envs/sandbox.py's confined process
  python -m dora_jax.main --config=configs/multiturn.py:no_tool --workdir=/tmp/mt_bare
      the same arithmetic with no tool, one turn: the baseline that measures what
      the tool is worth
  python -m dora_jax.main --config=configs/multiturn.py:tiny --workdir=/tmp/mt_tiny
      3 steps of 2 groups from the random init: a smoke run of the whole path
  python -m dora_jax.main --config=configs/multiturn.py:slow_tools --workdir=/tmp/mt_slow
      the calculator as a slow remote tool (0.4 s median per call, heavy-tailed),
      six episodes per slot (rollout.max_episodes_per_slice), 32 groups in flight:
      slots decode other episodes while one waits. Slots held (one episode each,
      _e8) vs released, side by side:
      python -m dora_jax.bench.modes --config=configs/multiturn.py:slow_tools \
        --workdir=/tmp/mt_slow_modes --modes=dora_k2_e8,dora_k2 --steps=20 --reps=2
  python -m dora_jax.main --config=configs/multiturn.py:slow_tools_multi --workdir=/tmp/mt_multi
      slow_tools at agent scale: rank-8 adapters over the frozen warm start, every
      slice holding the K + 1 = 4 versions of the staleness window at once
      (rollout.versions_per_slice: a slice takes each new version beside those its
      episodes at their tools still need), 32 groups a step, 128 admitted ahead, up
      to 256 episodes a slice. Held vs released, side by side:
      python -m dora_jax.bench.modes --config=configs/multiturn.py:slow_tools_multi \
        --workdir=/tmp/mt_multi_modes --modes=dora_k3_e8,dora_k3 --steps=12 --reps=2

Tokenizer and model as configs/quickstart.py (the 512-token BPE of
dora_jax/assets/tokenizer; a Qwen3-family policy of 459,520 parameters); mesh as
configs/tiny.py:spread (8 fake CPU devices: trainer data=2 x fsdp=2, 4 decode slices of 8
slots); groups of 8, 8 groups per step, 16 admitted ahead, max_staleness 2.
"""

from dora_jax.configs import quickstart
from dora_jax.data import word_problems

VARIANTS = (None, "guess", "python", "no_tool", "tiny", "slow_tools",
            "slow_tools_multi")


def get_config(arg=None):
    c = quickstart.get_config()  # its tokenizer, model, mesh and learning rate
    c.rollout.update(dict(max_prefill_length=64, max_decode_len=64, prefill_buckets=(64,)))
    c.trainer.length_buckets = (128,)
    c.coordinator.num_steps = 100
    c.eval.every = 0  # episodes report their rewards in metrics.jsonl and the ledger
    c.data.update(dict(source="env", env="calculator", task="", task_args={},
                       num_prompts=2000, tokenizer=word_problems.TOKENIZER_DIR))
    if arg == "guess":
        c.data.env = "guess"
        c.rollout.max_decode_len = 112
        c.trainer.length_buckets = (128, 192)
    elif arg in ("python", "no_tool"):
        c.data.env = arg
    elif arg in ("slow_tools", "slow_tools_multi"):
        # The calculator answering like a remote tool: 0.4 s at the median (a model
        # turn of ~15 tokens takes 50 to 80 ms here), a log-normal tail clipped at 4 s.
        # An episode spends most of its time at its tool, so six episodes per slot
        # (and the groups in flight to fill them) keep the slots decoding.
        c.data.update(dict(env_latency_median=0.4, env_latency_sigma=0.75,
                           env_latency_max=4.0, env_workers=64))
        c.rollout.max_episodes_per_slice = 6 * c.rollout.slots_per_slice
        c.rollout.batch_observations = True
        c.coordinator.rollout_batch_size = 32
        if arg == "slow_tools_multi":
            # Enough episodes in flight to keep the slots decoding through the tool
            # calls: 32 groups a step, four steps' worth admitted (K + 1 = 4), up to
            # 32 episodes a slot, every call of them at once.
            c.model.lora.update(dict(rank=8, alpha=16.0))
            c.trainer.learning_rate = quickstart.LORA_LEARNING_RATE
            c.coordinator.update(dict(max_staleness=3, train_batch_size=32,
                                      rollout_batch_size=128))
            c.rollout.versions_per_slice = c.coordinator.max_staleness + 1
            c.rollout.max_episodes_per_slice = 32 * c.rollout.slots_per_slice
            c.data.env_workers = c.rollout.max_episodes_per_slice
    elif arg == "tiny":
        c.coordinator.update(dict(group_size=4, train_batch_size=2, rollout_batch_size=4,
                                  num_steps=3))
    elif arg is not None:
        raise ValueError(f"unknown variant {arg!r}; choose from {VARIANTS}")
    return c
